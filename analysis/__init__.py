"""TensorBoard logs of `mode` runs -> comparison tables, figures, isoFLOP and routing analyses.

Modules: `tb` (reading runs), `report` (`mode analyze`), `isoflop` (loss vs size at fixed
compute), `routing` (blocks engaged vs prediction entropy, routing heatmaps).
"""

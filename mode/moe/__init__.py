"""Mixture-of-Experts MLPs behind one interface, whatever the backend.

`build_moe_mlp(cfg, layer_idx)` returns a module with `forward(x_BSD, valid_BS=None, routing="topk") -> y_BSD`
(the MLP output: the weighted sum of the token's surviving real-expert routes, zero for tokens
with none; `valid_BS` False marks padding, excluded from routing and capacity) that is `Routed`:
after each forward it holds `aux_loss`, `metrics` (on-device scalars, logged under
`moe/layer{i}/...`) and `last_engaged_BS`. Backends import their packages lazily.
"""
from __future__ import annotations

from torch import nn

from mode.config import ModelConfig


def build_moe_mlp(cfg: ModelConfig, layer_idx: int) -> nn.Module:
    backend = cfg.moe.backend
    if backend == "native":
        from mode.moe.native import NativeMoE

        return NativeMoE(cfg, layer_idx)
    if backend == "deepspeed":
        from mode.moe.deepspeed import DeepSpeedMoE

        return DeepSpeedMoE(cfg, layer_idx)
    if backend == "megablocks":
        from mode.moe.megablocks import MegaBlocksMoE

        return MegaBlocksMoE(cfg, layer_idx)
    raise ValueError(f"unknown MoE backend {backend!r}")  # config validation rejects it first

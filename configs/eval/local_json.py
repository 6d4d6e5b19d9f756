"""The example tasks' `custom_dataset`: their `dataset_kwargs.data_files`, relative to this
directory, read as json lines from any working directory. (lm-eval imports a YAML's `!function`
module from the YAML's own directory; `dataset_path: json` would read relative data_files from
the current directory.) A local task of your own can copy this file beside its YAML."""
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load(data_files: dict[str, str], **_metadata):
    import datasets

    return datasets.load_dataset("json", data_files={split: str(HERE / f) for split, f in data_files.items()})

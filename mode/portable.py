"""The portable model format `mode export` writes and `load_run` reads (its own module, so that
export -> generate (load_run) and generate -> the format do not form an import cycle)."""
from __future__ import annotations

from pathlib import Path

import torch

WEIGHTS = "model.safetensors"
TOKENIZER_DIR = "tokenizer"


def is_export(path: str | Path) -> bool:
    return (Path(path) / WEIGHTS).is_file() and (Path(path) / "config.yaml").is_file()


def save_weights(model: torch.nn.Module, path: Path) -> None:
    # save_model drops the tied head weight (an alias of the embedding) instead of refusing it.
    from safetensors.torch import save_model

    save_model(model, str(path))


def load_weights(model: torch.nn.Module, path: Path) -> None:
    from safetensors.torch import load_model

    load_model(model, str(path), strict=True, device="cpu")

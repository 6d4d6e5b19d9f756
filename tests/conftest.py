"""Shared pytest setup: the `gpu` marker (tests that need CUDA are skipped without it)."""
from __future__ import annotations

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (and, for MegaBlocks, the [megablocks] extra); "
                                       "skipped on machines without CUDA")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

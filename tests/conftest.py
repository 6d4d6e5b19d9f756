"""Shared pytest setup: the `gpu` marker (tests that need CUDA are skipped without it) and the
`slow` marker (tests that start processes or train; `make test-fast` leaves them out)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# DeepSpeed JIT-compiles its CPU comm op on first use. In the shared ~/.cache/torch_extensions every
# virtualenv (another checkout, another path) rebuilds it and all wait on one lock; keep this
# venv's build next to it, so that it is compiled once and then only loaded: the rule every
# `mode` process applies (mode/lifeline.py), for the tests that build a DeepSpeed world in-process.
if sys.prefix != sys.base_prefix:
    from mode.lifeline import use_venv_build_cache

    use_venv_build_cache()
else:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".venv" / "torch_extensions"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (and, for MegaBlocks, the [megablocks] extra); "
                                       "skipped on machines without CUDA")
    config.addinivalue_line("markers", "slow: starts a process or trains; `make test-fast` deselects it")


def pytest_unconfigure(config):
    """Some in-process tests keep a world of one (DeepSpeed caches its groups). Destroy it before the
    interpreter exits, as `mode train` does: left to teardown, gloo's threads abort a finished
    process now and then (SIGABRT), which would take down an xdist worker after its tests passed."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# Seconds of slow tests per file (a `--durations` run, session 14), heaviest first. `make test` hands whole
# files to two workers in this order (--no-loadscope-reorder): by test count, xdist's default, the
# few-test heavy files came last and one worker ran them alone. Stale values only cost balance.
FILE_SECONDS = {"test_cluster.py": 310, "test_train.py": 230, "test_moe_train.py": 222, "test_reliability.py": 209,
                "test_launch.py": 198, "test_faults.py": 183, "test_data.py": 159, "test_compare.py": 150,
                "test_logging.py": 140, "test_mod_variants.py": 250, "test_bf16.py": 87, "test_harness.py": 76,
                "test_sampling.py": 68}


def pytest_collection_modifyitems(config, items):
    import torch

    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))  # stable: a file's own order is kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """In-process tests use tiny tensors: a second OpenMP thread only adds synchronisation, and
    spins badly when the (2-core) machine is busy with a test's subprocesses."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def one_launcher(tmp_path_factory):
    """The expert-parallel reference of the simulated multi-node runs (tests/test_launch.py EP_RUN),
    trained once per test session for test_launch.py and test_cluster.py: one DeepSpeed launcher
    starting both ranks. pytest-xdist workers share it: the first to need it trains it under a file
    lock in the session's temporary directory, the other waits for it (~25 s of both cores saved)."""
    import fcntl
    import shutil

    from tests.test_launch import EP_CONFIG, EP_RUN
    from tests.util import deepspeed_train

    # a worker's basetemp is <session>/popen-gwN; without xdist the parent would outlive the session
    root = tmp_path_factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else \
        tmp_path_factory.mktemp("shared")
    d = root / "one_launcher" / "run"
    with open(root / "one_launcher.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (d / "DONE").exists():
            shutil.rmtree(d.parent, ignore_errors=True)  # what a worker that failed midway left
            deepspeed_train(2, EP_CONFIG, *EP_RUN, f"run.dir={d}")
    return d

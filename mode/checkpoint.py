"""Atomic, exactly-resumable checkpoints on top of DeepSpeed's.

Layout: run.dir/checkpoints/step_00000100/ holds DeepSpeed's files (model, optimizer, scheduler,
client state with the step), `rng_rank{r}.pt` per rank (torch, cuda, numpy, python RNG: random
top-k and DeepSpeed's MoE draw from them), and `model.pt` (plain state dict for generation).
Every rank writes into `step_N.tmp/`; after a barrier rank 0 renames it to `step_N/`. A rename
is atomic, so a kill during a save leaves at most a `.tmp` directory, which is ignored and
removed; the newest `step_N/` is always complete.
"""
from __future__ import annotations

import random
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

STEP_RE = re.compile(r"^step_(\d{8})$")


def complete_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and STEP_RE.match(p.name))


def latest(root: Path) -> Path | None:
    c = complete_checkpoints(Path(root))
    return c[-1] if c else None


def rng_state() -> dict:
    s = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state()
    return s


def set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    np.random.set_state(s["numpy"])
    random.setstate(s["python"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state(s["cuda"])


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def save(engine, root: Path, step: int, client_state: dict, rank: int, keep: int) -> Path:
    root = Path(root)
    tag = f"step_{step:08d}"
    tmp, final = root / f"{tag}.tmp", root / tag
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    _barrier()
    engine.save_checkpoint(str(root), tag=tmp.name, client_state=client_state, save_latest=False)
    torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    if rank == 0:
        torch.save({k: v.detach().float().cpu() if v.is_floating_point() else v.cpu()
                    for k, v in engine.module.state_dict().items()}, tmp / "model.pt")
    _barrier()
    if rank == 0:
        tmp.rename(final)
        for old in complete_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in root.glob("*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    return final


def load(engine, path: Path, rank: int, load_optimizer: bool = True) -> dict:
    """Load a complete checkpoint into the engine; restore this rank's RNG. Returns client state."""
    path = Path(path)
    _, client = engine.load_checkpoint(str(path.parent), tag=path.name, load_optimizer_states=load_optimizer,
                                       load_lr_scheduler_states=load_optimizer)
    rng = path / f"rng_rank{rank}.pt"
    if rng.exists():
        set_rng_state(torch.load(rng, weights_only=False))
    else:
        warnings.warn(f"{path} has no RNG state for rank {rank} (world size changed?): "
                      "training randomness will not continue exactly")
    return client or {}

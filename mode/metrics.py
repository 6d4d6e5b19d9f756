"""On-device metric accumulation; one all-reduce and one host read per logging step; rank 0
writes TensorBoard."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist


class Accumulator:
    """Sums scalar tensors on their device; `read()` averages them over calls and ranks."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}  # per key: callers may add different keys per call

    def add(self, metrics: dict) -> None:
        for k, v in metrics.items():
            v = v.detach().float()
            self.sums[k] = self.sums[k] + v if k in self.sums else v
            self.counts[k] = self.counts.get(k, 0) + 1

    def state_dict(self) -> dict:
        return {"sums": {k: v.cpu() for k, v in self.sums.items()}, "counts": dict(self.counts)}

    def load_state_dict(self, state: dict, device) -> None:
        self.sums = {k: v.to(device) for k, v in state["sums"].items()}
        self.counts = dict(state["counts"])

    def read(self) -> dict[str, float]:
        if not self.sums:
            return {}
        keys = sorted(self.sums)
        vec = torch.stack([self.sums[k] / self.counts[k] for k in keys])
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:
            dist.all_reduce(vec)
            vec /= world
        vals = vec.tolist()  # the one host sync of this logging step
        self.sums, self.counts = {}, {}
        return dict(zip(keys, vals))


class TBWriter:
    def __init__(self, log_dir: Path, enabled: bool):
        self.w = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.w = SummaryWriter(str(log_dir))

    def write(self, scalars: dict, step: int) -> None:
        if self.w is None:
            return
        for k, v in scalars.items():
            self.w.add_scalar(k, v, step)
        self.w.flush()

    def close(self) -> None:
        if self.w is not None:
            self.w.close()

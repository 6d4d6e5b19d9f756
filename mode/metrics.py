"""On-device metric accumulation; one all-reduce and one host read per logging step; rank 0
writes TensorBoard."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist


def is_max(key: str) -> bool:
    """Metrics named `..._max` (e.g. moe/layerN/load_max) are maxima: reduced with max over calls
    and ranks, not averaged (the busiest expert of any rank is what the name promises)."""
    return key.endswith("_max")


class Accumulator:
    """Sums scalar tensors on their device; `read()` averages them over calls and ranks (maxima,
    see `is_max`, are reduced with max)."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}  # per key: callers may add different keys per call

    def add(self, metrics: dict) -> None:
        for k, v in metrics.items():
            v = v.detach().float()
            if k not in self.sums:
                self.sums[k] = v
            else:
                self.sums[k] = torch.maximum(self.sums[k], v) if is_max(k) else self.sums[k] + v
            self.counts[k] = self.counts.get(k, 0) + 1

    def state_dict(self) -> dict:
        return {"sums": {k: v.cpu() for k, v in self.sums.items()}, "counts": dict(self.counts)}

    def load_state_dict(self, state: dict, device) -> None:
        self.sums = {k: v.to(device) for k, v in state["sums"].items()}
        self.counts = dict(state["counts"])

    def read(self) -> dict[str, float]:
        if not self.sums:
            return {}
        mean_keys = sorted(k for k in self.sums if not is_max(k))
        max_keys = sorted(k for k in self.sums if is_max(k))
        vecs = [torch.stack([self.sums[k] / self.counts[k] for k in mean_keys]) if mean_keys else None,
                torch.stack([self.sums[k] for k in max_keys]) if max_keys else None]
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:
            if vecs[0] is not None:
                dist.all_reduce(vecs[0])
                vecs[0] /= world
            if vecs[1] is not None:
                dist.all_reduce(vecs[1], op=dist.ReduceOp.MAX)
        # the host sync of this logging step
        vals = [v for vec in vecs if vec is not None for v in vec.tolist()]
        self.sums, self.counts = {}, {}
        return dict(zip(mean_keys + max_keys, vals))


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

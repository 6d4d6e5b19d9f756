"""On-device metric accumulation (one all-reduce and one host read per logging step) and the
efficiency metrics (MFU, TFLOP/s, memory); mode/loggers.py writes them."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from mode.routed import TRAIN_FLOPS_PER_FORWARD_FLOP  # noqa: F401  (train.py imports it from here)


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


# ----------------------------------------------------------------------------------------------
# Efficiency: model FLOPs utilisation against a per-device peak.

# Dense peak TFLOP/s per device from the vendors' datasheets (bf16 tensor cores without sparsity,
# fp32 = plain FP32 without TF32). Matched in order, as a part of the device name: the PCIe and NVL
# parts of a family run lower clocks than its SXM part (a bare family name), so they come first.
PEAK_TFLOPS = {"H100 PCIe": {"bf16": 756.0, "fp32": 51.0}, "H100 NVL": {"bf16": 835.0, "fp32": 60.0},
               "H200 NVL": {"bf16": 835.0, "fp32": 60.0},
               "H200": {"bf16": 989.0, "fp32": 67.0}, "H100": {"bf16": 989.0, "fp32": 67.0},
               "A100": {"bf16": 312.0, "fp32": 19.5}}


def measure_matmul_tflops(seconds: float = 0.3, n: int = 512, dtype=torch.float32) -> float:
    """Matmul TFLOP/s of this process (its threads) in `dtype` on the CPU: the peak MFU is measured
    against when no datasheet value applies. The best of ~10 short windows, so that other jobs
    on a shared machine lower it less."""
    import time

    g = torch.Generator().manual_seed(0)  # its own: a draw from the global RNG would shift training's
    a, b = torch.randn(n, n, dtype=dtype, generator=g), torch.randn(n, n, dtype=dtype, generator=g)
    a @ b  # warm-up
    best, t_end = 0.0, time.perf_counter() + seconds
    while True:
        t0, reps = time.perf_counter(), 0
        while (dt := time.perf_counter() - t0) < seconds / 10:
            a @ b
            reps += 1
        best = max(best, 2 * n**3 * reps / dt / 1e12)
        if time.perf_counter() >= t_end:
            return best


def peak_cache() -> Path | None:
    """Where the best CPU matmul rate measured on this machine is kept: inside the virtualenv
    (beside the torch extensions it builds), so nothing is written outside it; None outside one."""
    import sys

    return Path(sys.prefix) / "mode_cpu_peak.json" if sys.prefix != sys.base_prefix else None


def cpu_peak_tflops(measured: float, cache: Path | None, gemm: str = "fp32") -> tuple[float, str]:
    """The best of this measurement and those of earlier runs on this CPU model at this thread
    count. One 0.3 s measurement on a shared machine can catch other jobs (a peak 6x too low was
    seen, and MFU above 100% with it); the best seen so far converges to what the cores can do."""
    import json
    import os
    import platform

    threads = torch.get_num_threads()
    info = Path("/proc/cpuinfo").read_text().splitlines() if os.path.exists("/proc/cpuinfo") else []
    cpu = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), platform.processor())
    key = f"{cpu} | {os.cpu_count()} cpus | {threads} threads" + ("" if gemm == "fp32" else f" | {gemm}")
    seen = {}
    if cache is not None:
        try:
            seen = json.loads(cache.read_text())
        except (OSError, ValueError):
            pass  # absent or unreadable: start over (it only ever holds our own numbers)
    seen = seen if isinstance(seen, dict) else {}
    prev = seen.get(key)
    prev = float(prev) if isinstance(prev, (int, float)) else 0.0
    best = max(measured, prev)
    if cache is not None and measured > prev:
        try:
            tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
            tmp.write_text(json.dumps({**seen, key: measured}, indent=1) + "\n")
            os.replace(tmp, cache)  # atomic: a reader sees the old or the new file
        except OSError:
            pass  # a read-only environment: this run's measurement is still used
    src = f"measured {gemm} matmul ({threads} thread{'' if threads == 1 else 's'})"
    if best > measured:
        src += f", best on this machine ({measured:.3g} this run)"
    return best, src


def default_peak_tflops(precision: str) -> tuple[float, str]:
    """(peak TFLOP/s per device, where it comes from) for this process's device."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for gpu, peaks in PEAK_TFLOPS.items():
            if gpu in name:
                return peaks[precision], f"{gpu} {precision} datasheet"
        return float("nan"), f"unknown GPU {name!r}: set perf.peak_tflops"
    from mode.engine import native_bf16_gemms

    # the GEMMs a step runs: bf16 where the CPU has bf16 kernels (its bf16 peak is ~2-4x fp32's:
    # against the fp32 peak a bf16 run's MFU read high); else bf16 runs its GEMMs in fp32 (Fp32Gemms)
    bf16 = precision == "bf16" and native_bf16_gemms(torch.device("cpu"))
    return cpu_peak_tflops(measure_matmul_tflops(dtype=torch.bfloat16 if bf16 else torch.float32), peak_cache(),
                           "bf16" if bf16 else "fp32")


def memory_gb(device: torch.device) -> float:
    """Peak memory of this process: allocated tensors on CUDA, resident set size (ru_maxrss) on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB


def efficiency(tokens_per_s: float, forward_flops_per_token: float, world: int, peak_tflops: float) -> dict:
    """Training TFLOP/s per device and MFU from the global token rate and the analytic FLOPs."""
    tflops = TRAIN_FLOPS_PER_FORWARD_FLOP * forward_flops_per_token * tokens_per_s / world / 1e12
    return {"perf/tflops_per_device": tflops, "perf/mfu": tflops / peak_tflops}

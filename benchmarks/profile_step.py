"""Where the time of a training step goes: torch.profiler over steps of the real DeepSpeed engine.

    python benchmarks/profile_step.py configs/tiny/dense.yaml deepspeed.precision=bf16 [--steps 3]

Prints the step's forward, backward and optimizer times (best of --steps unprofiled steps), then
the profiled step time and the ops that take the most self CPU time (the profile's table).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from mode import engine as eng  # noqa: E402  (sets DS_ACCELERATOR before deepspeed loads)
from mode.config import load_config  # noqa: E402
from mode.model import build_model  # noqa: E402


def build(config: str, overrides: list[str]):
    cfg = load_config(config, overrides)
    eng.init_distributed()
    torch.manual_seed(0)
    dev = eng.device()
    model = eng.prepare_model(cfg, build_model(cfg.model).to(dev), dev)
    engine, _, _ = eng.build_engine(cfg, model, 1)
    B, S, V = cfg.train.micro_batch_size, cfg.data.seq_len, cfg.model.vocab_size
    ids_BS = torch.randint(0, V, (B, S + 1), device=dev)

    def step() -> tuple[float, float, float]:
        """One training step; its forward, backward and optimizer (engine.step) seconds."""
        t0 = time.perf_counter()
        out = engine(ids_BS[:, :-1], ids_BS[:, 1:])
        t1 = time.perf_counter()
        engine.backward(out.loss + out.aux_loss)
        t2 = time.perf_counter()
        engine.step()
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    return cfg, step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=15)
    ap.add_argument("--native-bf16", action="store_true", help="bf16 GEMMs in bf16 even where the CPU lacks bf16 units")
    a = ap.parse_args()
    if a.native_bf16:
        eng.native_bf16_gemms = lambda dev: True
    cfg, step = build(a.config, a.overrides)
    step()  # warmup (and compilation)
    parts = [min(p) for p in zip(*(step() for _ in range(a.steps)))]
    print(f"{a.config} {' '.join(a.overrides)}: forward {parts[0] * 1e3:.0f} ms, backward {parts[1] * 1e3:.0f} ms, "
          f"optimizer {parts[2] * 1e3:.0f} ms, sum {sum(parts) * 1e3:.0f} ms (best of {a.steps}, unprofiled)")
    t = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(a.steps):
            step()
    dt = (time.perf_counter() - t) / a.steps
    print(f"{a.config} {' '.join(a.overrides)}: {dt * 1e3:.0f} ms/step (profiled)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))


if __name__ == "__main__":
    main()

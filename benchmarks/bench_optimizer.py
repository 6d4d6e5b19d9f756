"""The optimizer step: torch AdamW's per-tensor loop (torch's CPU default), foreach and fused
kernels inside GuardedAdamW, side by side on the same gradients; then whole training steps
(forward + backward + optimizer) with the loop and with fused, interleaved, to show what the
optimizer's share of a step is.

    python benchmarks/bench_optimizer.py [--threads 1] [--reps 5] [--device cpu|cuda] [--write]

On CUDA (benchmarks/gpu_check.sh) it shows what fused saves in kernel launches, which a small
bf16 MoD step on an H200 is bound by.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch
from common import append_results

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)  # this checkout's mode, not whichever one an editable install points to
from mode.config import load_config  # noqa: E402
from mode.engine import GuardedAdamW, param_groups  # noqa: E402
from mode.model.lm import build_model  # noqa: E402

KERNELS = {"loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}
D512 = ["model.d_model=512", "model.n_heads=8", "model.d_ff=2048", "model.n_layers=4", "data.seq_len=1024",
        "model.max_seq_len=1024"]


def model_and_opts(overrides, dev):
    cfg = load_config(os.path.join(ROOT, "configs/tiny/mod.yaml"), overrides)
    torch.manual_seed(0)
    model = build_model(cfg.model).to(dev)
    opts = {k: GuardedAdamW(param_groups(model, 0.1), clip=1.0, names={}, lr=1e-4, **kw) for k, kw in KERNELS.items()}
    return cfg, model, opts


def best_of(fn, reps: int, sync, inner: int = 1) -> float:
    fn()  # warm-up (also creates the optimizer states)
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        times.append((time.perf_counter() - t) / inner)
    return min(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = []
    for label, overrides in [("tiny MoD (configs/tiny/mod.yaml)", []), ("d_model 512, 4 layers, MoD", D512)]:
        cfg, model, opts = model_and_opts(overrides, dev)
        params = list(model.parameters())
        n = sum(p.numel() for p in params)
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        opt_ms = {k: 1e3 * best_of(o.step, a.reps, sync, inner=5) for k, o in opts.items()}
        # Whole steps: batch 1 x seq_len of random tokens, the loop vs fused, interleaved per rep.
        S, V = cfg.data.seq_len, cfg.model.vocab_size
        ids = torch.randint(0, V, (1, S + 1), generator=torch.Generator().manual_seed(0)).to(dev)

        def step(opt):
            out = model(ids[:, :-1], ids[:, 1:])
            (out.loss + out.aux_loss).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step_ms = {"loop": [], "fused": []}
        for k in step_ms:
            step(opts[k])  # warm-up
        for _ in range(a.reps):
            for k in step_ms:
                sync()
                t = time.perf_counter()
                step(opts[k])
                sync()
                step_ms[k].append(1e3 * (time.perf_counter() - t))
        loop, fused = min(step_ms["loop"]), min(step_ms["fused"])
        rows.append(f"| {label} | {n / 1e6:.2f}M / {len(params)} | {opt_ms['loop']:.2f} | {opt_ms['foreach']:.2f} | "
                    f"{opt_ms['fused']:.2f} | {opt_ms['loop'] / opt_ms['fused']:.2f}x | {S} | {loop:.0f} | {fused:.0f} | "
                    f"{loop / fused:.3f}x |")
        print(rows[-1], flush=True)
    load = os.getloadavg()
    head = (f"\n## Optimizer step: AdamW per-tensor loop vs foreach vs fused (`benchmarks/bench_optimizer.py`)\n\n"
            f"`python benchmarks/bench_optimizer.py --threads {a.threads} --reps {a.reps} --device {dev.type}`: "
            f"{torch.cuda.get_device_name() if dev.type == 'cuda' else platform.machine()}, {os.cpu_count()} cores, "
            f"torch {torch.__version__}, {a.threads} thread(s), fp32, GuardedAdamW (global-norm "
            f"clip + AdamW); load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the end. Optimizer: best of "
            f"{a.reps} x 5 steps on fixed gradients. Training step: forward + backward + optimizer, batch 1 x S, "
            f"best of {a.reps}, loop and fused interleaved.\n\n"
            "| model | params / tensors | loop ms | foreach ms | fused ms | fused speedup | S | step ms (loop) | "
            "step ms (fused) | step speedup |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
    table = head + "\n".join(rows) + "\n"
    print(table)
    if a.write:
        append_results(table)


if __name__ == "__main__":
    main()

"""Training tokens/s of a dense and a MoD model in four modes, side by side in one run:
fp32 eager, fp32 compiled, bf16 eager, bf16 compiled; and MoD's speedup over dense per mode as a
fraction of its analytic FLOP limit.

    python benchmarks/bench_speed.py [--reps 3] [--batch 1] [--layers 4] [--write]

A training step is forward + backward + AdamW; MoD's speedup is printed for it and for the model
step (forward + backward), which is what the FLOP limit counts: the optimizer's work is the same
for both models and scales with parameters, not tokens. bf16 is what `deepspeed.precision=bf16` runs: bf16
parameters and activations, fp32 master weights and AdamW states (updated in fp32, copied back
to bf16), routing in fp32; on CPUs without bf16 units its GEMMs run in fp32
(mode.engine.Fp32Gemms, as training does). "compiled" is mode.engine.compile_blocks (per-block
torch.compile, inductor). Timing: best of `reps`, the 8 (model, mode) steps interleaved rep by
rep (in a rotated order) after a warmup (which also compiles), so load from other jobs hits all of them alike.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from bench_mod import block_flops  # noqa: E402
from mode import engine as eng  # noqa: E402
from mode.config import ModConfig, ModelConfig  # noqa: E402
from mode.model import build_model  # noqa: E402
from mode.routing.depth import capacity_k  # noqa: E402
from common import append_results  # noqa: E402  (benchmarks/common.py)

MODES = [("fp32", False), ("fp32", True), ("bf16", False), ("bf16", True)]


def model_limit(L: int, S: int, D: int, F: int, V: int, cap: float) -> float:
    head = 3 * S * 2 * D * V
    n_mod = len(range(1, L, 2))
    return (L * block_flops(S, D, F) + head) / (
        (L - n_mod) * block_flops(S, D, F) + n_mod * block_flops(S, D, F, capacity_k(cap, S)) + head)


def make_step(layers: str, precision: str, compiled: bool, dev, D, H, F, L, S, B, V, cap):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, d_model=D, n_layers=L, n_heads=H, d_ff=F, max_seq_len=S,
                      mod=ModConfig(layers=layers, capacity=cap, causal="predictor"))
    model = build_model(cfg).to(dev).train()
    # fp32 master weights (bf16) or the parameters themselves (fp32)
    master = [p.detach().clone().float() if precision == "bf16" else p for p in model.parameters()]
    if precision == "bf16":
        model.to(torch.bfloat16)
        if not eng.native_bf16_gemms(dev):
            eng.fp32_gemms_on_cpu(model)
    if compiled:
        eng.compile_blocks(model)
    for m in master:
        m.requires_grad_(True)
        if precision == "bf16":
            m.grad = torch.zeros_like(m)  # fp32 gradient buffers the bf16 gradients are cast into
    # torch's fused AdamW, as `mode train` runs it (mode.engine.fused_adamw)
    opt = torch.optim.AdamW(master, lr=1e-4, fused=eng.fused_adamw(model) or None)
    params = list(model.parameters())
    ids_BS = torch.randint(0, V, (B, S + 1), device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def step() -> float:
        """Runs one training step; returns when its forward + backward ended (perf_counter)."""
        o = model(ids_BS[:, :-1], ids_BS[:, 1:])
        (o.loss + o.aux_loss).backward()
        sync()
        t_model = time.perf_counter()
        # fp32 update, bf16 copy back (DeepSpeed's bf16 optimizer): one casting copy each way
        if precision == "bf16":
            torch._foreach_copy_([m.grad for m in master], [p.grad for p in params])
        opt.step()
        model.zero_grad(set_to_none=True)
        if precision == "bf16":
            with torch.no_grad():
                torch._foreach_copy_(params, master)
        else:
            opt.zero_grad(set_to_none=True)
        sync()
        return t_model

    return step


def run(dev, D=512, H=8, F=2048, L=4, S=1024, B=1, V=320, cap=0.125, reps=3):
    steps = {}
    for prec, comp in MODES:
        for name, layers in (("dense", "none"), ("mod", "every_other")):
            steps[(prec, comp, name)] = make_step(layers, prec, comp, dev, D, H, F, L, S, B, V, cap)
    keys = list(steps)
    t0 = {}
    for k in keys:  # warmup: compilation and allocator
        t = time.perf_counter()
        steps[k]()
        steps[k]()
        t0[k] = time.perf_counter() - t
        print(f"warmup {k}: {t0[k]:.1f} s", file=sys.stderr)
    # best whole training step and best model step (forward + backward: what the FLOP limit is
    # about; the optimizer's work scales with parameters, not tokens, and is the same for both models)
    best = {k: float("inf") for k in keys}
    best_model = dict(best)
    for r in range(reps):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:  # rotated: no step always runs first
            t = time.perf_counter()
            t_model = steps[k]()
            best[k] = min(best[k], time.perf_counter() - t)
            best_model[k] = min(best_model[k], t_model - t)
        print(f"rep {r}: " + ", ".join(f"{k[0]}{'c' if k[1] else 'e'}-{k[2]} {best[k] * 1e3:.0f}ms" for k in keys),
              file=sys.stderr)
    return best, best_model, model_limit(L, S, D, F, V, cap)


def report(best, best_model, limit, dev, a) -> str:
    tok = a.batch * a.seq
    if dev.type == "cuda":
        where = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    else:
        where = (f"{os.cpu_count()}-core CPU ({platform.processor() or platform.machine()}, torch CPU capability "
                 f"{torch.backends.cpu.get_cpu_capability()}, native bf16 GEMMs: {eng.native_bf16_gemms(dev)}), "
                 f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), load average "
                 f"{' / '.join(f'{v:.1f}' for v in os.getloadavg())}")
    lines = [f"Machine: {where}. Model: {a.layers} layers, d_model {a.d_model}, S {a.seq}, batch {a.batch}, vocab 320; "
             f"MoD every other block at capacity {a.capacity} with predictor. Best of {a.reps} interleaved reps.",
             "",
             f"FLOP limit of MoD's speedup: {limit:.2f}x. Training step = forward + backward + optimizer; model step "
             "= forward + backward.",
             "",
             "| mode | dense tokens/s | MoD tokens/s | MoD speedup, training step (fraction of limit) | "
             "MoD speedup, model step (fraction of limit) | dense vs fp32 eager |",
             "| --- | --- | --- | --- | --- | --- |"]
    ref = best[("fp32", False, "dense")]
    for prec, comp in MODES:
        d, m = best[(prec, comp, "dense")], best[(prec, comp, "mod")]
        dm, mm = best_model[(prec, comp, "dense")], best_model[(prec, comp, "mod")]
        lines.append(f"| {prec} {'compiled' if comp else 'eager'} | {tok / d:,.0f} | {tok / m:,.0f} | "
                     f"{d / m:.2f}x ({d / m / limit:.2f}) | {dm / mm:.2f}x ({dm / mm / limit:.2f}) | {ref / d:.2f}x |")
    bc = ref / best[("bf16", True, "dense")]
    worst = min(best_model[(p, c, "dense")] / best_model[(p, c, "mod")] / limit for p, c in MODES)
    lines += ["", f"Goals: bf16 compiled >= 2x fp32 eager (dense): {bc:.2f}x, **{'met' if bc >= 2 else 'missed'}**; "
                  f"MoD's model step >= 0.9 of its FLOP limit in every mode: worst {worst:.2f}, "
                  f"**{'met' if worst >= 0.9 else 'missed'}**."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--capacity", type=float, default=0.125)
    ap.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    a = ap.parse_args()
    dev = eng.device()
    D = a.d_model
    best, best_model, limit = run(dev, D=D, H=max(1, D // 64), F=4 * D, L=a.layers, S=a.seq, B=a.batch, cap=a.capacity,
                      reps=a.reps)
    text = report(best, best_model, limit, dev, a)
    print(text)
    if a.write:
        append_results(text)

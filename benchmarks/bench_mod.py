"""MoD speed on this machine: one routed block vs the same dense block, and a training step of a
12.5%-every-other-block MoD model vs the equal-size dense model. Not a test: prints a markdown
table (and `--write` appends it to benchmarks/RESULTS.md).

Shape legend: B batch, S sequence, D d_model, F MLP hidden, K tokens a routed block processes.

FLOPs are analytic, from shapes (multiply-add = 2): per processed token the projections
(qkv + out: 8 D^2), attention over the processed sequence and the SwiGLU MLP (6 D F); per token
the router (2 D) and predictor (~D^2). Training counts forward + backward = 3x forward, except the
predictor whose input is detached (no input gradient: 2x). Norms, rotary, softmax and
gather/scatter are not counted: they are what the measured speedup loses against the FLOP limit.
Two conventions for attention (scores + values, n = tokens processed), two FLOP limits:
  full S x S   4 n^2 D forward: the project's convention (mode/flops.py; matched FLOPs, MFU)
  causal       2 n (n+1) D forward: only the n(n+1)/2 unmasked query-key pairs, about what
               SDPA's flash kernels (CPU and CUDA, is_causal=True) compute, skipping masked blocks
"""
from __future__ import annotations

import argparse
import copy
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from mode.config import ModConfig, ModelConfig  # noqa: E402
from mode.engine import compile_blocks  # noqa: E402
from mode.mod import MoDBlock  # noqa: E402
from mode.model import build_model  # noqa: E402
from mode.model.blocks import DenseBlock  # noqa: E402
from mode.routed import Ctx  # noqa: E402
from mode.routing.depth import capacity_k  # noqa: E402
from common import append_results  # noqa: E402  (benchmarks/common.py)


def block_flops(S: int, D: int, F: int, k: int | None = None, causal: bool = False) -> float:
    """Training FLOPs per sequence of a dense block (k None) or a routed block processing k tokens.
    Attention: the full n x n product (causal False, mode/flops.py's convention) or only the
    n(n+1)/2 query-key pairs a causal mask keeps (causal True)."""
    n = S if k is None else k
    attn = 2 * n * (n + 1) * D if causal else 4 * n * n * D
    fwd = n * (8 * D * D + 6 * D * F) + attn
    if k is None:
        return 3 * fwd
    router, predictor = S * 2 * D, S * (2 * D * (D // 2) + 2 * (D // 2))
    return 3 * (fwd + router) + 2 * predictor


COMPILE = False  # --compile: every timed module is torch.compile'd, as train.compile compiles blocks


def timed(module: torch.nn.Module) -> torch.nn.Module:
    """The module as the benchmark times it: itself in eager mode; with --compile a compiled copy (its
    own graphs per module, the same weights), compiled in place as mode.engine.compile_blocks does."""
    if not COMPILE:
        return module
    module = copy.deepcopy(module)
    module.compile(dynamic=False)
    return module


def timeit_interleaved(fns, reps: int, warmup: int = 1) -> list[float]:
    """Best-of-reps seconds of each fn, alternating them rep by rep: on a shared machine other
    load only ever adds time, so the minimum is the least disturbed measurement, and alternating
    keeps one side from owning a quiet (or busy) spell."""
    sync = torch.cuda.synchronize if torch.get_default_device().type == "cuda" else (lambda: None)
    for _ in range(warmup):
        for f in fns:
            f()
    ts = [[] for _ in fns]
    for _ in range(reps):
        for f, t_ in zip(fns, ts):
            sync()
            t = time.perf_counter()
            f()
            sync()  # the GPU's work, not the launches
            t_.append(time.perf_counter() - t)
    return [min(t_) for t_ in ts]


def routed_steps(dense, inner_t, x_BSD, gy_BSD, cap: float):
    """(step_mod, step_inner, k): forward + backward of a MoD block at capacity `cap` around `dense` (the
    same inner block as the dense step: only the routing differs), and of the wrapped block alone
    (`inner_t`, dense as timed) on B x k gathered tokens, the floor the routing overhead sits on."""
    B, S, D = x_BSD.shape
    pos_BS = torch.arange(S).expand(B, S)
    mod = timed(MoDBlock(dense, ModConfig(layers="every", capacity=cap, causal="predictor"), D, 0))

    def step_mod():
        y = x_BSD + mod(x_BSD, Ctx(pos_BS))
        torch.autograd.backward([y, mod.aux_loss], [gy_BSD, None])

    k = capacity_k(cap, S)
    xk_BKD, gk_BKD = torch.randn(B, k, D, requires_grad=True), torch.randn(B, k, D)
    pos_BK = torch.randperm(S)[:k].sort().values.expand(B, k)

    def step_inner():
        inner_t(xk_BKD, Ctx(pos_BK)).backward(gk_BKD)

    return step_mod, step_inner, k


def bench_blocks(D=512, H=8, F=2048, tokens=4096, seqs=(512, 1024, 2048), caps=(0.125, 0.25, 0.5), reps=5):
    cfg = ModelConfig(d_model=D, n_heads=H, d_ff=F, max_seq_len=max(seqs))
    torch.manual_seed(0)
    dense = DenseBlock(cfg)
    dense_t, inner_t = timed(dense), timed(dense)
    rows = []
    for S in seqs:
        B = max(1, tokens // S)
        x_BSD = torch.randn(B, S, D, requires_grad=True)
        gy_BSD = torch.randn(B, S, D)
        pos_BS = torch.arange(S).expand(B, S)

        def step_dense():
            y = x_BSD + dense_t(x_BSD, Ctx(pos_BS))
            y.backward(gy_BSD)

        for c in caps:
            step_mod, step_inner, k = routed_steps(dense, inner_t, x_BSD, gy_BSD, c)
            t_dense, t_mod, t_inner = timeit_interleaved([step_dense, step_mod, step_inner], reps)
            limit = block_flops(S, D, F) / block_flops(S, D, F, k)
            limit_causal = block_flops(S, D, F, causal=True) / block_flops(S, D, F, k, causal=True)
            rows.append((S, B, c, t_dense * 1e3, t_mod * 1e3, t_inner * 1e3, t_dense / t_mod, limit, limit_causal))
            print(rows[-1], file=sys.stderr)
    return rows


def profile_mod(D, H, F, S, cap, tokens, rows=25) -> str:
    """Where a routed block's time goes beyond the inner block: torch.profiler over 3 MoD steps
    (forward + backward at sequence S, capacity cap), the ops sorted by self device time (CPU time
    on a CPU), and the same for the inner block alone on the gathered tokens."""
    cfg = ModelConfig(d_model=D, n_heads=H, d_ff=F, max_seq_len=S)
    torch.manual_seed(0)
    dense = DenseBlock(cfg)
    B = max(1, tokens // S)
    x_BSD, gy_BSD = torch.randn(B, S, D, requires_grad=True), torch.randn(B, S, D)
    step_mod, step_inner, k = routed_steps(dense, timed(dense), x_BSD, gy_BSD, cap)
    cuda = torch.get_default_device().type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    out = []
    for name, fn in (("MoD block", step_mod), ("inner block on the k tokens", step_inner)):
        wall = timeit_interleaved([fn], 3, warmup=2)[0]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(3):
                fn()
            if cuda:
                torch.cuda.synchronize()
        ka = prof.key_averages()
        # device ops (kernels, copies, memsets) and their busy time against the step's wall time: a
        # device busy for a fraction of the step is waiting on the host (launches, Python)
        dev_ops = [e for e in ka if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.self_device_time_total for e in dev_ops) / 3e3
        host = sum(e.self_cpu_time_total for e in ka) / 3e3
        summary = (f"wall {wall * 1e3:.2f} ms/step (unprofiled, best of 3); host ops {host:.2f} ms/step (profiled)"
                   + (f"; device busy {busy:.2f} ms/step ({100 * busy / (wall * 1e3):.0f}% of wall), "
                      f"{sum(e.count for e in dev_ops) // 3} device ops/step" if cuda else ""))
        print(f"{name}: {summary}", file=sys.stderr)
        out.append(f"### {name}: S {S}, B {B}, capacity {cap}, k {k}: {summary}\n")
        out.append(ka.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=rows))
    return "\n".join(out)


def model_limit(S, D, F, L, V, cap=0.125, causal=False) -> float:
    """Analytic training-FLOP ratio dense / MoD (every other block routed) of the bench_model step."""
    head = 3 * S * 2 * D * V  # tied embedding / head matmul, fwd + bwd
    n_mod = len(range(1, L, 2))
    dense = block_flops(S, D, F, causal=causal)
    return (L * dense + head) / (
        (L - n_mod) * dense + n_mod * block_flops(S, D, F, capacity_k(cap, S), causal=causal) + head)


def bench_model(D=512, H=8, F=2048, L=4, S=1024, B=1, V=320, reps=5):
    steps = {}
    for name, layers in (("dense", "none"), ("mod", "every_other")):
        torch.manual_seed(0)
        cfg = ModelConfig(vocab_size=V, d_model=D, n_layers=L, n_heads=H, d_ff=F, max_seq_len=S,
                          mod=ModConfig(layers=layers, capacity=0.125, causal="predictor"))
        model = build_model(cfg).train()
        if COMPILE:
            compile_blocks(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids_BS = torch.randint(0, V, (B, S + 1))

        def step(model=model, opt=opt, ids_BS=ids_BS):
            o = model(ids_BS[:, :-1], ids_BS[:, 1:])
            (o.loss + o.aux_loss).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        steps[name] = step
    t_dense, t_mod = timeit_interleaved([steps["dense"], steps["mod"]], reps)
    return {"dense": t_dense, "mod": t_mod, "L": L, "B": B, "S": S, "V": V, "limit": model_limit(S, D, F, L, V),
            "limit_causal": model_limit(S, D, F, L, V, causal=True)}


def report(runs, D, H, F, reps) -> str:
    """runs: [(threads, block rows, model timings, load average)] -> one markdown section."""
    cpu, dev = platform.processor() or platform.machine(), torch.get_default_device()
    rows0 = runs[0][1]
    lines = [
        f"## MoD block and model speed ({dev.type.upper()})",
        "",
        (f"Machine: {os.cpu_count()}-core CPU ({cpu})" if dev.type == "cpu" else
         f"Machine: {torch.cuda.get_device_name()}") + f", torch {torch.__version__}, {torch.get_default_dtype()}, {'compiled' if COMPILE else 'eager'}. "
        f"Block: d_model {D}, {H} heads, SwiGLU d_ff {F}, {rows0[0][1] * rows0[0][0]} tokens per batch; "
        f"forward + backward (+ router/predictor aux loss for MoD); best of {reps} reps, dense and MoD "
        "interleaved, after warmup. FLOP limit = analytic training FLOPs dense / MoD (router and "
        "predictor included) with attention counted as the full S x S product (the project's convention, "
        "mode/flops.py); causal limit = the same with attention counted as the S(S+1)/2 query-key pairs "
        "a causal mask keeps, about what SDPA's flash kernels compute with is_causal=True (they skip "
        "masked blocks), which makes the limit lower. `inner on k` is the "
        "wrapped block alone on the B x k gathered tokens: MoD minus inner is what routing costs "
        "(router, predictor, top-k, gather/scatter, aux losses). The machine is "
        "shared with other jobs: a second OpenMP thread waits on a descheduled one at every "
        "barrier, so under load the 1-thread run is the steadier measurement of the ratio.",
    ]
    for threads, rows, model_t, load in runs:
        lines += [
            "",
            f"### {threads} thread{'s' if threads > 1 else ''} (load average {load})",
            "",
            "| S | B | capacity | dense ms | MoD ms | inner on k ms | speedup | FLOP limit | % of limit "
            "| causal limit | % of causal |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for S, B, c, td, tm, ti, sp, lim, lim_c in rows:
            lines.append(f"| {S} | {B} | {c} | {td:.1f} | {tm:.1f} | {ti:.1f} | {sp:.2f}x | {lim:.2f}x | "
                         f"{100 * sp / lim:.0f}% | {lim_c:.2f}x | {100 * sp / lim_c:.0f}% |")
        ok_block = all(r[6] / r[7] >= 0.85 for r in rows if r[0] >= 1024 and r[2] == 0.125)
        ms = model_t["dense"] / model_t["mod"]
        lines += [
            "",
            f"Training step (fwd + bwd + AdamW), {model_t['L']} layers d_model {D}, S={model_t['S']}, "
            f"B={model_t['B']}, vocab {model_t['V']}: dense {model_t['dense'] * 1e3:.0f} ms, MoD (12.5% capacity, "
            f"every other block, predictor) {model_t['mod'] * 1e3:.0f} ms: **{ms:.2f}x** faster (analytic FLOP "
            f"limit {model_t['limit']:.2f}x: {100 * ms / model_t['limit']:.0f}%; causal limit "
            f"{model_t['limit_causal']:.2f}x: {100 * ms / model_t['limit_causal']:.0f}%).",
            "",
            f"Verdict: block speedup >= 85% of the FLOP limit at S >= 1024, capacity 0.125: "
            f"**{'met' if ok_block else 'missed'}**; model step >= 1.5x at S = 1024: "
            f"**{'met' if ms >= 1.5 else 'missed'}**.",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true", help="append the section to benchmarks/RESULTS.md")
    ap.add_argument("--quick", action="store_true", help="S=1024, capacity 0.125 only")
    ap.add_argument("--threads", default="0", help="comma list of torch thread counts (0 = torch's default)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (every tensor and model is made there)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                    help="parameters and activations (bf16 = what DeepSpeed's bf16 mode trains; routing stays fp32)")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d-ff", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per block batch (B = tokens / S)")
    ap.add_argument("--batch", type=int, default=1, help="sequences per model step (S = 1024)")
    ap.add_argument("--compile", action="store_true", help="torch.compile every timed block (as train.compile)")
    ap.add_argument("--seqs", default="512,1024,2048", help="comma list of sequence lengths")
    ap.add_argument("--caps", default="0.125,0.25,0.5", help="comma list of capacities")
    ap.add_argument("--profile", metavar="S,CAPACITY",
                    help="only profile one MoD block vs its inner block at this sequence length and capacity")
    a = ap.parse_args()
    torch.set_default_device(a.device)
    torch.set_default_dtype({"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype])
    D, H, F = a.d_model, a.heads, a.d_ff
    COMPILE = a.compile
    torch._dynamo.config.cache_size_limit = 64  # one graph per (S, k) shape of the same block code
    if a.profile:
        S_, cap_ = a.profile.split(",")
        print(profile_mod(D, H, F, int(S_), float(cap_), a.tokens))
        sys.exit(0)
    kw = dict(seqs=(1024,), caps=(0.125,)) if a.quick else dict(
        seqs=tuple(int(v) for v in a.seqs.split(",")), caps=tuple(float(v) for v in a.caps.split(",")))
    kw["tokens"] = a.tokens
    runs = []
    default = torch.get_num_threads()
    for n in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(n or default)
        rows = bench_blocks(D, H, F, reps=a.reps, **kw)
        model_t = bench_model(D, H, F, B=a.batch, reps=a.reps)
        runs.append((torch.get_num_threads(), rows, model_t, " / ".join(f"{v:.1f}" for v in os.getloadavg())))
    text = report(runs, D, H, F, a.reps)
    print(text)
    if a.write:
        append_results(text)

"""Forward+backward time of one MoE layer: native vs DeepSpeed (and MegaBlocks on CUDA).

    python benchmarks/bench_moe.py [--tokens 4096] [--d-model 256] [--d-ff 1024] [--reps 15]

E = 8 experts, top-1 and top-2, capacity factors 1.0, 0.5 and dropless, T tokens of width d. Columns:
  native       mode.moe.native (sort/gather dispatch, batched matmuls)
  ds_stock     deepspeed.moe.layer.MoE as shipped (TopKGate, use_rts=False)
  ds_mode      the deepspeed backend: DeepSpeed's MoE layer with mode's router as its gate
  megablocks   mode's router + MegaBlocks dMoE experts (only with CUDA and megablocks)
Without an importable DeepSpeed the ds_* columns are skipped (one line says why); an
implementation whose warm-up step fails loses its column for that configuration only.
All layers get the same weights, so they route the same tokens (up to the stock gate's own
top-1 drop order). Timings interleave the implementations round by round and report the median,
so a busy machine slows all columns alike; the ratio columns (native / ds_stock, and
native / megablocks where that column exists) are medians of per-round ratios. Before the first
configuration's timed rounds every implementation runs for at least --warmup-s seconds and 3
rounds, so start-of-process costs (allocator, kernel selection, lazy imports) are not timed.
Time = forward + backward of sum(y * g) + aux loss, parameter gradients reset every step.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

from mode.config import ModelConfig, MoEConfig  # noqa: E402

deepspeed = None  # the module once main() has imported it; None = the ds_* columns are skipped


def import_deepspeed() -> str:
    """Import DeepSpeed into the module global; return why it failed ("" if it did not). The GPU image
    may lack DeepSpeed: the native (and MegaBlocks) columns are measured all the same."""
    global deepspeed
    try:
        import deepspeed as ds
    except Exception as e:  # noqa: BLE001 - any import failure only removes the ds_* columns
        return f"{type(e).__name__}: {e}"
    deepspeed = ds
    return ""


def init_dist():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        os.environ.setdefault(k, v)
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")


def layers(cfg: ModelConfig, device, dtype):
    from mode.moe.native import NativeMoE

    out = {"native": NativeMoE(cfg, 0)}
    if deepspeed is not None:
        from mode.moe.deepspeed import DeepSpeedMoE, copy_moe_weights

        out["ds_stock"] = DeepSpeedMoE(cfg, 0, stock_gate=True)
        out["ds_mode"] = DeepSpeedMoE(cfg, 0)
        for name in ("ds_stock", "ds_mode"):
            copy_moe_weights(out["native"], out[name])
    if torch.cuda.is_available():
        try:
            from mode.moe.megablocks import MegaBlocksMoE, copy_native_to_megablocks

            out["megablocks"] = MegaBlocksMoE(cfg, 0)
            copy_native_to_megablocks(out["native"], out["megablocks"])
        except Exception as e:  # noqa: BLE001 - report and go on without the column
            print(f"megablocks column skipped: {e}")
    return {k: m.to(device, dtype) for k, m in out.items()}


def step(m, x, g):
    x.grad = None
    for p in m.parameters():  # as in training: gradients start from None every step
        p.grad = None
    y = m(x)
    ((y * g).sum() + m.aux_loss).backward()


def bench(args) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    first = True
    for k in (1, 2):
        for cf in (1.0, 0.5, None):
            moe = MoEConfig(layers="every", num_experts=8, top_k=k, capacity_factor=cf, backend="deepspeed",
                            renormalize_after_drop=True)  # = the stock gate's top-2 weights
            cfg = ModelConfig(d_model=args.d_model, d_ff=args.d_ff, moe=moe)
            torch.manual_seed(0)
            ms = layers(cfg, device, dtype)
            x = torch.randn(args.tokens // 1024, 1024, args.d_model, device=device, dtype=dtype, requires_grad=True)
            g = torch.randn_like(x)
            for n, m in list(ms.items()):  # first (warm-up) step, guarded: a failure drops only that column
                try:
                    step(m, x, g)
                    sync()
                except Exception as e:  # noqa: BLE001
                    print(f"{n} column skipped for top_k={k}, capacity factor {cf or 'dropless'}: warm-up step "
                          f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
                    del ms[n]
            if "native" not in ms:
                raise RuntimeError("the native layer (the reference every ratio divides) failed its warm-up step")
            if first:  # start-of-process slowness: warm up for a minimum wall time, all implementations
                t0, rounds = time.perf_counter(), 1
                while rounds < 3 or time.perf_counter() - t0 < args.warmup_s:
                    for m in ms.values():
                        step(m, x, g)
                    sync()
                    rounds += 1
                print(f"warm-up: {rounds} rounds, {time.perf_counter() - t0:.1f} s", flush=True)
                first = False
            times = {n: [] for n in ms}
            for _ in range(args.reps):
                for n, m in ms.items():
                    sync()
                    t = time.perf_counter()
                    step(m, x, g)
                    sync()
                    times[n].append(time.perf_counter() - t)
            row = {"k": k, "cf": cf, **{n: 1e3 * statistics.median(v) for n, v in times.items()},
                   "dropped": float(ms["native"].metrics["dropped_routes_frac"])}
            for other in ("ds_stock", "megablocks"):  # paired: rounds slowed by other load cancel out
                if other in times:
                    row[f"native / {other}"] = statistics.median(
                        a / b for a, b in zip(times["native"], times[other]))
            rows.append(row)
            print(row, flush=True)
    return rows


def table(rows) -> str:
    """Columns present in any row; a cell whose implementation failed that configuration reads `failed`."""
    cols = [c for c in ("native", "ds_stock", "ds_mode", "megablocks") if any(c in r for r in rows)]
    ratios = [c for c in ("native / ds_stock", "native / megablocks") if any(c in r for r in rows)]
    head = "| top_k | capacity factor | dropped routes | " + " | ".join(
        [f"{c} ms" for c in cols] + [f"{c} (paired)" for c in ratios]) + " |"
    lines = [head, "|" + " --- |" * (len(cols) + len(ratios) + 3)]
    for r in rows:
        cells = [f"{r[c]:.1f}" if c in r else "failed" for c in cols] + \
            [f"{r[c]:.2f}" if c in r else "-" for c in ratios]
        lines.append(f"| {r['k']} | {r['cf'] or 'dropless'} | {r['dropped']:.1%} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096,
                   help="a positive multiple of 1024 (the batch is tokens/1024 sequences of 1024)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--d-ff", type=int, default=1024)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--warmup-s", type=float, default=2.0,
                   help="minimum warm-up wall time (and at least 3 rounds) before the first configuration")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16" if torch.cuda.is_available() else "fp32",
                   help="bf16 on GPUs (MegaBlocks' grouped GEMMs are bf16-only), fp32 on CPUs")
    args = p.parse_args()
    if args.tokens < 1024 or args.tokens % 1024:
        p.error(f"--tokens {args.tokens}: must be a positive multiple of 1024 (1024, 2048, ...)")
    why = import_deepspeed()
    if why:
        print(f"DeepSpeed columns (ds_stock, ds_mode) skipped: cannot import deepspeed ({why})", flush=True)
    else:
        init_dist()

    rows = bench(args)
    where = f"{torch.cuda.get_device_name()}" if torch.cuda.is_available() else \
        f"{os.cpu_count()}-core CPU ({platform.processor() or platform.machine()})"
    ds = f"deepspeed {deepspeed.__version__}" if deepspeed is not None else "no deepspeed"
    print(f"\n{where}, torch {torch.__version__}, {ds}; "
          f"T={args.tokens}, d={args.d_model}, expert hidden {args.d_ff} (SwiGLU), E=8, {args.dtype}, "
          f"median of {args.reps} fwd+bwd\n")
    print(table(rows))


if __name__ == "__main__":
    main()

"""Forward+backward time of one MoE layer: native vs DeepSpeed (and MegaBlocks on CUDA).

    python benchmarks/bench_moe.py [--tokens 4096] [--d-model 256] [--d-ff 1024] [--reps 15]

E = 8 experts, top-1 and top-2, capacity factors 1.0, 0.5 and dropless, T tokens of width d. Columns:
  native       mode.moe.native (sort/gather dispatch, batched matmuls)
  ds_stock     deepspeed.moe.layer.MoE as shipped (TopKGate, use_rts=False)
  ds_mode      the deepspeed backend: DeepSpeed's MoE layer with mode's router as its gate
  megablocks   mode's router + MegaBlocks dMoE experts (only with CUDA and megablocks)
All layers get the same weights, so they route the same tokens (up to the stock gate's own
top-1 drop order). Timings interleave the implementations round by round and report the median,
so a busy machine slows all columns alike; the ratio column is the median of per-round ratios.
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


def init_dist():
    import socket

    import deepspeed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        os.environ.setdefault(k, v)
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")


def layers(cfg: ModelConfig, device, dtype):
    from mode.moe.deepspeed import DeepSpeedMoE, copy_moe_weights
    from mode.moe.native import NativeMoE

    out = {"native": NativeMoE(cfg, 0)}
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
    for k in (1, 2):
        for cf in (1.0, 0.5, None):
            moe = MoEConfig(layers="every", num_experts=8, top_k=k, capacity_factor=cf, backend="deepspeed",
                            renormalize_after_drop=True)  # = the stock gate's top-2 weights
            cfg = ModelConfig(d_model=args.d_model, d_ff=args.d_ff, moe=moe)
            torch.manual_seed(0)
            ms = layers(cfg, device, dtype)
            x = torch.randn(args.tokens // 1024, 1024, args.d_model, device=device, dtype=dtype, requires_grad=True)
            g = torch.randn_like(x)
            times = {n: [] for n in ms}
            for n, m in ms.items():  # warm-up
                step(m, x, g)
            for _ in range(args.reps):
                for n, m in ms.items():
                    sync()
                    t = time.perf_counter()
                    step(m, x, g)
                    sync()
                    times[n].append(time.perf_counter() - t)
            row = {"k": k, "cf": cf, **{n: 1e3 * statistics.median(v) for n, v in times.items()},
                   "dropped": float(ms["native"].metrics["dropped_routes_frac"]),
                   # median of per-round ratios: rounds slowed by other load cancel out
                   "ratio": statistics.median(a / b for a, b in zip(times["native"], times["ds_stock"]))}
            rows.append(row)
            print(row, flush=True)
    return rows


def table(rows) -> str:
    cols = [c for c in ("native", "ds_stock", "ds_mode", "megablocks") if c in rows[0]]
    head = "| top_k | capacity factor | dropped routes | " + " | ".join(f"{c} ms" for c in cols) + \
        " | native / ds_stock (paired) |"
    lines = [head, "|" + " --- |" * (len(cols) + 4)]
    for r in rows:
        times = " | ".join(f"{r[c]:.1f}" for c in cols)
        lines.append(f"| {r['k']} | {r['cf'] or 'dropless'} | {r['dropped']:.1%} | {times} | {r['ratio']:.2f} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--d-ff", type=int, default=1024)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16" if torch.cuda.is_available() else "fp32",
                   help="bf16 on GPUs (MegaBlocks' grouped GEMMs are bf16-only), fp32 on CPUs")
    args = p.parse_args()
    init_dist()
    import deepspeed

    rows = bench(args)
    where = f"{torch.cuda.get_device_name()}" if torch.cuda.is_available() else \
        f"{os.cpu_count()}-core CPU ({platform.processor() or platform.machine()})"
    print(f"\n{where}, torch {torch.__version__}, deepspeed {deepspeed.__version__}; "
          f"T={args.tokens}, d={args.d_model}, expert hidden {args.d_ff} (SwiGLU), E=8, {args.dtype}, "
          f"median of {args.reps} fwd+bwd\n")
    print(table(rows))


if __name__ == "__main__":
    main()

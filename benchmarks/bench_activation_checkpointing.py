"""Activation checkpointing and MFU through the real trainer (`mode train`), side by side.

Each setting is a fresh `mode train` process (so peak RSS is its own); step time, MFU and peak
memory are read back from the run's metrics.jsonl (perf/step_time_s: median of the logged
intervals after the first; perf/memory_gb: the last, i.e. the whole run's peak).

    python benchmarks/bench_activation_checkpointing.py [--steps 4] [--layers 8] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train(run_dir: Path, config: str, threads: int, *overrides: str) -> dict:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS=str(threads))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "mode.cli", "train", "--config", config, f"run.dir={run_dir}", "log.progress=false",
           *overrides]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [x for x in rows if "perf/step_time_s" in x]
    later = logged[1:] or logged
    info = json.loads((run_dir / "run_info.json").read_text())
    return {"step_time_s": statistics.median(x["perf/step_time_s"] for x in later),
            "tokens_per_s": statistics.median(x["perf/tokens_per_s"] for x in later),
            "mfu": statistics.median(x["perf/mfu"] for x in later),
            "tflops": statistics.median(x["perf/tflops_per_device"] for x in later),
            "memory_gb": logged[-1]["perf/memory_gb"], "loss": [x["train/loss"] for x in logged],
            "peak": info["peak_tflops_per_device"], "params": info["params"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tiny-steps", type=int, default=60)
    a = p.parse_args()
    d512 = ["model.d_model=512", "model.n_heads=8", "model.d_ff=2048", f"model.n_layers={a.layers}",
            "model.max_seq_len=2048", "data.seq_len=2048", "data.max_documents=400", "train.micro_batch_size=1",
            f"train.max_steps={a.steps}", "train.log_every=1", "train.eval_every=0", "train.eval_batches=1",
            "checkpoint.every=0", "optim.warmup_steps=1"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tiny = train(tmp / "tiny", "configs/tiny/dense.yaml", a.threads, f"train.max_steps={a.tiny_steps}",
                     "train.eval_every=0", "checkpoint.every=0")
        res = {ac: train(tmp / f"d512_{ac}", "configs/tiny/dense.yaml", a.threads, *d512,
                         f"train.activation_checkpointing={ac}") for ac in ("none", "block")}
    print(f"threads {a.threads}; peak measured at start: {tiny['peak']:.4g} TFLOP/s (fp32 matmul)")
    print(f"tiny dense ({tiny['params']:,} params, S 128, batch 8): {tiny['tokens_per_s']:.0f} tokens/s, "
          f"{tiny['tflops']:.4g} TFLOP/s, MFU {tiny['mfu']:.1%}, peak RSS {tiny['memory_gb']:.2f} GB")
    print(f"\nd_model 512, {a.layers} layers, S 2048, micro batch 1 ({res['none']['params']:,} params), "
          f"{a.steps} steps")
    print("| activation checkpointing | peak RSS (GB) | step time (s) | tokens/s | TFLOP/s | MFU |")
    print("| --- | --- | --- | --- | --- | --- |")
    for ac, r in res.items():
        print(f"| {ac} | {r['memory_gb']:.2f} | {r['step_time_s']:.2f} | {r['tokens_per_s']:.0f} | {r['tflops']:.4g} "
              f"| {r['mfu']:.1%} |")
    n, b = res["none"], res["block"]
    print(f"| block / none | {b['memory_gb'] / n['memory_gb']:.2f} | {b['step_time_s'] / n['step_time_s']:.2f} | | | |")
    print(f"losses identical: {n['loss'] == b['loss']}")


if __name__ == "__main__":
    main()

"""Scoring speed of `mode eval` (the lm-eval adapter, mode/harness.py) on this machine: tokens/s of
loglikelihood_rolling over the example task's 24 documents (configs/eval/data/stdlib_ppl.jsonl)
for untrained tiny presets, batch 1 vs batch B side by side (interleaved, best of R), and the
log-likelihood difference between the two (batching must not change results). Rows that would
share expert capacity (a non-null `model.moe.inference_capacity_factor`) are scored one row at a
time (see `rows_independent`).
Not a test: prints a markdown table (and `--write` appends it to benchmarks/RESULTS.md).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from mode.config import load_config  # noqa: E402
from mode.data import ByteTokenizer  # noqa: E402
from mode.harness import Scorer  # noqa: E402
from mode.model import build_model  # noqa: E402
from common import append_results  # noqa: E402  (benchmarks/common.py)

ROOT = os.path.join(os.path.dirname(__file__), "..")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--presets", default="dense,mod,moe")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--write", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    docs = [json.loads(ln)["text"] for ln in open(os.path.join(ROOT, "configs/eval/data/stdlib_ppl.jsonl"))]
    n_tok = sum(len(d.encode()) for d in docs)
    rows = [f"| preset | rows batched | tokens/s, batch 1 | tokens/s, batch {a.batch} | ratio | max abs LL diff |",
            "| --- | --- | --- | --- | --- | --- |"]
    for preset in a.presets.split(","):
        cfg = load_config(os.path.join(ROOT, f"configs/tiny/{preset}.yaml"))
        torch.manual_seed(0)
        model = build_model(cfg.model).eval()
        scorers = {bs: Scorer(model, ByteTokenizer(), "causal", bs) for bs in (1, a.batch)}
        best, lls = {1: float("inf"), a.batch: float("inf")}, {}
        for _ in range(a.repeats):
            for bs, s in scorers.items():
                t = time.perf_counter()
                lls[bs] = s.loglikelihood_rolling(docs)
                best[bs] = min(best[bs], time.perf_counter() - t)
        diff = max(abs(x - y) for x, y in zip(lls[1], lls[a.batch]))
        rows.append(f"| {preset} | {'yes' if scorers[a.batch].batch_size > 1 else 'no (shared capacity)'} | "
                    f"{n_tok / best[1]:,.0f} | {n_tok / best[a.batch]:,.0f} | {best[1] / best[a.batch]:.2f}x | {diff:.1e} |")
    head = (f"\n## mode eval scoring speed (benchmarks/bench_eval.py)\n\n{platform.machine()}, {os.cpu_count()} cores, "
            f"torch {torch.__version__}, {a.threads} thread(s), fp32, untrained tiny presets (S={cfg.model.max_seq_len}), "
            f"{len(docs)} documents / {n_tok:,} tokens, loglikelihood_rolling with causal routing, best of {a.repeats}.\n")
    table = head + "\n" + "\n".join(rows) + "\n"
    print(table)
    if a.write:
        append_results(table)


if __name__ == "__main__":
    main()

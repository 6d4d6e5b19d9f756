"""What making checkpoints durable costs (issue #16 follow-up): the time of one `Trainer.save()`
(DeepSpeed's files, RNG states, model.pt, manifest) with every file and directory fsynced before
the manifest (now) against fsyncing only the manifest (before), interleaved, median of R saves
each, on a tiny-preset model (one process). Not a test: prints a markdown table.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python benchmarks/bench_checkpoint_save.py [--config C] [-r R]
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from mode import checkpoint as ckpt  # noqa: E402
from mode.config import load_config  # noqa: E402
from mode.train import Trainer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/tiny/mod.yaml")
    p.add_argument("-r", "--repeats", type=int, default=10)
    p.add_argument("--dir", default=None, help="run.dir's parent (default: a temporary directory)")
    a = p.parse_args()
    root = tempfile.mkdtemp(prefix="bench-ckpt-", dir=a.dir)
    cfg = load_config(a.config, [f"run.dir={root}/run", "log.progress=false", "checkpoint.keep=1"])
    t = Trainer(cfg)
    sync_dir, sha = ckpt._fsync_dir, ckpt._sha256
    ways = {"durable (every file + dir fsynced)": (sync_dir, sha),
            "before (manifest fsynced only)": (lambda d: None, lambda p, sync=False: sha(p))}
    times = {w: [] for w in ways}
    for i in range(a.repeats):
        for w, (fs, h) in ways.items():
            ckpt._fsync_dir, ckpt._sha256 = fs, h
            t.step += 1
            t0 = time.perf_counter()
            t.save()
            times[w].append(time.perf_counter() - t0)
    ckpt._fsync_dir, ckpt._sha256 = sync_dir, sha
    size = sum(f.stat().st_size for f in ckpt.latest(t.ckpt_dir).rglob("*") if f.is_file())
    print(f"\n{a.config}: checkpoint {size / 2**20:.1f} MiB, {a.repeats} saves each (interleaved), "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, filesystem of {root}")
    print("| save | median s | min s | max s |\n|---|---|---|---|")
    for w, ts in times.items():
        print(f"| {w} | {statistics.median(ts):.3f} | {min(ts):.3f} | {max(ts):.3f} |")
    t.log.close()
    t.lock.release()
    shutil.rmtree(root)  # the temporary directory this script created


if __name__ == "__main__":
    main()

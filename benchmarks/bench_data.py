"""Data path benchmark (issue #10), side by side in one run:

1. prepare throughput (`mode data prepare`) with 1 and 2 tokenizer workers on >= 200 MB of text
   built from files present on every machine (this interpreter's stdlib and site-packages sources,
   one document per file), with the byte tokenizer and with a byte-level BPE trained here;
2. the memmap loader over a synthetic token memmap of >= 2e9 tokens (written here, deleted
   afterwards): peak RSS of the data path over the process's baseline, time from opening to the
   first batch, batches/s at B=8, S=2048;
3. the same figures for the previous in-RAM path (`pack`: tokenize everything at start-up into one
   int64 tensor per rank, from git) on the largest corpus it handles here, beside the memmap path
   on that same corpus.

Usage: .venv/bin/python benchmarks/bench_data.py [--mb 200] [--tokens 2e9] [--old-mb 100] [--quick]
Each measurement runs in a fresh subprocess so its RSS is its own.
"""
from __future__ import annotations

import argparse
import codecs
import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
OLD_REV = "d4c1b0b"  # main before issue #10: the in-RAM DataModule
HF_CACHE = ""  # the in-RAM path's Arrow cache goes into the work dir (deleted at the end)


def utf8_ok(f: str) -> bool:
    try:
        with open(f, "rb") as fh:
            b = fh.read()
        if not b.strip() or b"\0" in b:
            return False
        codecs.decode(b, "utf-8")
        return True
    except (OSError, UnicodeDecodeError):
        return False


def build_corpus(dst: Path, mb: float) -> tuple[int, int]:
    """Symlinks to real .py files (stdlib, then site-packages) until `mb` MB: one document each."""
    roots = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]]
    seen, total, n = set(), 0, 0
    dst.mkdir(parents=True)
    for r in roots:
        for f in sorted(glob.glob(os.path.join(r, "**", "*.py"), recursive=True)):
            real = os.path.realpath(f)
            if real in seen or not utf8_ok(real):
                continue
            seen.add(real)
            (dst / f"{n:06d}.py").symlink_to(real)
            total += os.path.getsize(real)
            n += 1
            if total >= mb * 1e6:
                return total, n
    return total, n


def train_bpe(corpus: Path, out: Path, vocab: int = 8192) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    files = sorted(corpus.iterdir())[:2000]
    tok.train_from_iterator((f.read_text() for f in files), trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))


def run_json(code: str, *args) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HF_DATASETS_CACHE=HF_CACHE)
    r = subprocess.run([PY, "-c", code, *map(str, args)], capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


PREPARE = r"""
import json, sys, time
from mode.config import DataConfig
from mode.prepare import prepare, read_manifest
src, tok, workers, out = sys.argv[1:5]
cfg = DataConfig(source=src, tokenizer=tok, num_workers=int(workers), prepared_dir=out, val_fraction=0.01)
t = time.perf_counter()
path = prepare(cfg, progress=False)
dt = time.perf_counter() - t
m = read_manifest(path)
tokens = m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"]
nbytes = m["splits"]["train"]["bytes"] + m["splits"]["val"]["bytes"]
print(json.dumps({"seconds": dt, "tokens": tokens, "bytes": nbytes, "tokens_per_s": tokens / dt,
                  "mb_per_s": nbytes / dt / 1e6, "path": str(path)}))
"""

# Peak RSS (VmHWM: this process image's own high-water mark; ru_maxrss would carry the parent's
# over exec) over the RSS after the imports; the loop reads `n` batches.
LOADER = r"""
import json, sys, time
import numpy as np, torch
from mode.config import DataConfig
def status(key):
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) / 1024
base = status("VmRSS")
kind, src, out, B, S, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
cfg = DataConfig(source=src, seq_len=S, prepared_dir=out, num_workers=1, val_fraction=0.01)
t0 = time.perf_counter()
if kind == "memmap":
    from mode.data import DataModule
else:
    sys.path.insert(0, sys.argv[7])
    from old_data import DataModule
    cfg = DataConfig(source=src, seq_len=S, val_fraction=0.01)
dm = DataModule(cfg)
x, y = dm.train_batch(0, 0, B, 1)
first = time.perf_counter() - t0
assert x.shape == (B, S) and x.dtype == torch.int64
t1 = time.perf_counter()
for step in range(1, n + 1):
    x, y = dm.train_batch(step, 0, B, 1)
dt = time.perf_counter() - t1
peak = status("VmHWM")
print(json.dumps({"first_batch_s": first, "batches_per_s": n / dt, "peak_rss_over_baseline_mb": peak - base,
                  "baseline_mb": base}))
"""


def synthetic(out: Path, tokens: int, shard: int = 1 << 28) -> str:
    """A prepared directory of `tokens` random byte-tokenizer tokens (uint16 shards), with the
    manifest a prepare of the returned source spec would write."""
    import numpy as np

    from mode.config import DataConfig
    from mode.prepare import FORMAT, ByteTokenizer, data_keys, prepared_path

    src = str(out / "synthetic-source.txt")
    Path(src).write_text("synthetic\n")
    cfg = DataConfig(source=src, prepared_dir=str(out), val_fraction=0.01)
    d = prepared_path(cfg)
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    splits = {}
    for split, n_total in (("train", tokens), ("val", 1 << 20)):
        shards, left, k = [], n_total, 0
        while left:
            n = min(shard, left)
            m = np.memmap(d / f"{split}_{k:05d}.bin", dtype=np.uint16, mode="w+", shape=(n,))
            for a in range(0, n, 1 << 26):
                m[a:a + (1 << 26)] = rng.integers(0, 256, min(1 << 26, n - a), dtype=np.uint16)
            m.flush()
            del m
            np.save(d / f"{split}_{k:05d}.docs.npy", np.array([n], dtype=np.int64))
            shards.append({"file": f"{split}_{k:05d}.bin", "docs": f"{split}_{k:05d}.docs.npy", "tokens": n,
                           "documents": 1})
            left -= n
            k += 1
        splits[split] = {"tokens": n_total, "documents": len(shards), "bytes": n_total, "shards": shards}
    tok = ByteTokenizer()
    (d / "manifest.json").write_text(json.dumps({
        "format": FORMAT, "tokenizer": tok.identity, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
        "dtype": "uint16", "data": data_keys(cfg), "splits": splits, "fingerprint": []}))
    return src


def machine() -> str:
    import platform

    load = os.getloadavg()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    mem = next((ln.split()[1] for ln in open("/proc/meminfo") if ln.startswith("MemTotal")), "0")
    return (f"{cpu}, {os.cpu_count()} cores, {int(mem) / 2**20:.0f} GiB RAM, {platform.system()}, "
            f"load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} at start")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, default=200, help="prepare corpus size (MB of text)")
    p.add_argument("--bpe-mb", type=float, default=200, help="MB of that corpus prepared with the BPE tokenizer")
    p.add_argument("--tokens", type=float, default=2e9, help="synthetic memmap size (tokens)")
    p.add_argument("--old-mb", type=float, default=100, help="corpus for the in-RAM path comparison (MB)")
    p.add_argument("--batches", type=int, default=20000)
    p.add_argument("--workdir", default=None)
    p.add_argument("--parts", default="byte,bpe,loader,old", help="which of byte,bpe,loader,old to run")
    a = p.parse_args()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="bench_data_"))
    work.mkdir(parents=True, exist_ok=True)
    global HF_CACHE
    HF_CACHE = str(work / "hf_datasets_cache")
    print(f"machine: {machine()}", flush=True)
    try:
        # 1. prepare throughput
        parts = a.parts.split(",")
        if "byte" in parts or "bpe" in parts:
            corpus = work / "corpus"
            size, n = build_corpus(corpus, a.mb)
            print(f"\n## prepare: {size / 1e6:.0f} MB of Python sources, {n} files (one document each)", flush=True)
            train_bpe(corpus, work / "bpe")
            bpe_corpus = corpus
            if a.bpe_mb < a.mb:
                bpe_corpus = work / "corpus_bpe"
                size, n = build_corpus(bpe_corpus, a.bpe_mb)
                print(f"   (BPE on the first {size / 1e6:.0f} MB, {n} files)", flush=True)
            rows = []
            toks = [(t, s) for t, s, part in (("byte", corpus, "byte"), (str(work / "bpe"), bpe_corpus, "bpe"))
                    if part in parts]
            for tok, src in toks:
                name = "byte" if tok == "byte" else "BPE 8192 (byte-level, trained here)"
                res = {}
                for w in (1, 2):
                    r = run_json(PREPARE, src, tok, w, work / f"prep_{w}_{Path(tok).name}")
                    res[w] = r
                    print(f"  {name:38s} workers={w}: {r['tokens_per_s']:>12,.0f} tokens/s  {r['mb_per_s']:6.1f} MB/s "
                          f"({r['tokens']:,} tokens, {r['bytes'] / 1e6:.0f} MB in {r['seconds']:.1f} s)", flush=True)
                    shutil.rmtree(Path(r["path"]))
                rows.append((name, res))
                print(f"  {name:38s} 2 workers / 1 worker: {res[2]['tokens_per_s'] / res[1]['tokens_per_s']:.2f}x",
                      flush=True)

        # 2. the memmap loader over >= 2e9 tokens
        B, S = 8, 2048
        if "loader" in parts:
            syn = work / "synthetic"
            syn.mkdir()
            t = time.perf_counter()
            src = synthetic(syn, int(a.tokens))
            print(f"\n## loader: synthetic memmap of {int(a.tokens):,} tokens (uint16, {a.tokens * 2 / 2**30:.1f} GiB, "
                  f"written in {time.perf_counter() - t:.0f} s), B={B}, S={S}, {a.batches} batches", flush=True)
            r = run_json(LOADER, "memmap", src, syn, B, S, a.batches)
            print(f"  memmap: first batch {r['first_batch_s']:.3f} s, {r['batches_per_s']:,.0f} batches/s, "
                  f"peak RSS +{r['peak_rss_over_baseline_mb']:.0f} MB over baseline {r['baseline_mb']:.0f} MB", flush=True)
            shutil.rmtree(syn)

        # 3. the in-RAM path beside the memmap path, on the same corpus
        if "old" not in parts:
            return 0
        old = work / "old"
        old.mkdir()
        code = subprocess.run(["git", "show", f"{OLD_REV}:mode/data.py"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout
        (old / "old_data.py").write_text(code)
        oc = work / "corpus_old"
        size, n = build_corpus(oc, a.old_mb)
        print(f"\n## in-RAM (before #10) vs memmap: {size / 1e6:.0f} MB of sources ({n} files), B={B}, S={S}, "
              "byte tokenizer", flush=True)
        for kind in ("in-RAM", "memmap"):
            prep_dir = work / "prep_old_cmp"
            if kind == "memmap":  # prepared first (the one-time cost, reported above), then opened
                run_json(PREPARE, oc, "byte", 2, prep_dir)
            r = run_json(LOADER, "memmap" if kind == "memmap" else "old", oc, prep_dir, B, S, 5000, old)
            print(f"  {kind:7s}: first batch {r['first_batch_s']:.2f} s, {r['batches_per_s']:,.0f} batches/s, "
                  f"peak RSS +{r['peak_rss_over_baseline_mb']:.0f} MB over baseline", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

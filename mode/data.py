"""Training and evaluation data: windows read from the prepared token shards (`mode/prepare.py`)
through np.memmap, and a deterministic, rank-disjoint, resumable sampler.

Shape legend: B micro-batch, S sequence length, V vocabulary.

A split's tokens are one stream (the shards in order); window w is tokens [w*S, w*S + S + 1), so
consecutive windows overlap by one token and every token after the first is a target once. The
sampler is a pure function of (split_seed, global sample index): global sample g of epoch e is
window perm_e(g mod N), where perm_e is a keyed Feistel permutation of [0, N) computed per index
(no array of N entries: per-rank memory does not grow with the corpus). At step t, micro-step m,
rank r reads samples [(t*accum + m)*world*B + r*B, ... + B): ranks read disjoint samples, the
global batch is the same whatever the world size, and resume continues exactly.
"""
from __future__ import annotations

import functools
import math
import mmap
import sys
from pathlib import Path

import numpy as np
import torch

from mode.config import Config, ConfigError, DataConfig
from mode.prepare import (ByteTokenizer, HFTokenizer, build_tokenizer, check_manifest, check_place,  # noqa: F401
                          count_tokens, damaged, prepare, prepared_path, read_manifest, stdlib_files)

_M64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """splitmix64's finalizer on a Python int."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


@functools.lru_cache(maxsize=64)
def _feistel(n: int, seed: int):
    half = max(1, math.ceil((n - 1).bit_length() / 2))
    mask = (1 << half) - 1
    keys = [_mix64((seed & _M64) ^ _mix64(r + 1)) for r in range(4)]

    def once(x: int) -> int:
        left, right = x >> half, x & mask
        for k in keys:
            left, right = right, left ^ (_mix64(right ^ k) & mask)
        return (left << half) | right

    return once


def permute(idx, n: int, seed: int) -> np.ndarray:
    """A permutation of [0, n) evaluated at `idx`: a 4-round Feistel network on the smallest
    even-bit domain >= n, with cycle walking back into [0, n) (the domain is < 4n: a few steps)."""
    if n <= 1:
        return np.zeros(len(idx), dtype=np.int64)
    once = _feistel(n, seed)
    out = []
    for i in np.asarray(idx, dtype=np.int64).tolist():
        x = once(i)
        while x >= n:
            x = once(x)
        out.append(x)
    return np.array(out, dtype=np.int64)


class TokenSplit:
    """One split's shards as a single token stream, read through np.memmap."""

    def __init__(self, root: Path, meta: dict, dtype: str, prepared_dir: str | None = None):
        self.root, self.shards = root, meta["shards"]
        self.memmaps = []
        for s in self.shards:  # check_manifest compared the sizes at the open; a file cut since then stops here
            try:
                m = np.memmap(root / s["file"], dtype=dtype, mode="r")
            except (OSError, ValueError) as e:  # missing, or emptied (mmap refuses an empty file)
                raise damaged(prepared_dir or str(root.parent), root, f"{s['file']}: {type(e).__name__}") from None
            if len(m) != s["tokens"]:
                raise damaged(prepared_dir or str(root.parent), root, f"{s['file']} holds {len(m):,} tokens, the "
                              f"manifest says {s['tokens']:,}")
            m._mmap.madvise(mmap.MADV_RANDOM)  # windows are read in random order: no readahead
            self.memmaps.append(m)
        self.maps = [m.view(np.ndarray) for m in self.memmaps]  # plain views: slicing skips memmap's bookkeeping
        self.starts = np.cumsum([0] + [s["tokens"] for s in self.shards])  # the manifest's counts, verified above
        self.n_tokens = int(self.starts[-1])
        self.n_bytes, self.n_documents = meta["bytes"], meta["documents"]

    def n_windows(self, seq_len: int) -> int:
        return max(0, (self.n_tokens - 1) // seq_len)

    def read(self, start: int, length: int, touched: set | None = None) -> np.ndarray:
        """Tokens [start, start + length) of the stream (crossing shards if needed)."""
        s = int(np.searchsorted(self.starts, start, side="right")) - 1
        off = start - int(self.starts[s])
        part = self.maps[s][off:off + length]
        if touched is not None:
            touched.add(s)
        while len(part) < length:  # the window continues in the next shard
            s += 1
            part = np.concatenate([part, self.maps[s][:length - len(part)]])
            if touched is not None:
                touched.add(s)
        return part

    def documents(self, limit: int):
        """(start, end, UTF-8 bytes) of every document of the shards that begin before token `limit`;
        None for data prepared before per-document bytes were kept."""
        shards = [s for s, begin in zip(self.shards, self.starts) if begin < limit]
        if any("doc_bytes" not in s for s in shards):
            return None
        ends = np.concatenate([int(b) + np.load(self.root / s["docs"]) for s, b in zip(shards, self.starts)])
        starts = np.concatenate([[0], ends[:-1]])  # shards are contiguous and end at document ends
        return starts, ends, np.concatenate([np.load(self.root / s["doc_bytes"]) for s in shards])

    def windows(self, rows, seq_len: int) -> torch.Tensor:
        """[B, S + 1] int64 windows `rows` (window w starts at token w * seq_len)."""
        out = np.empty((len(rows), seq_len + 1), dtype=np.int64)
        touched = set()
        for j, w in enumerate(rows):
            out[j] = self.read(int(w) * seq_len, seq_len + 1, touched)
        for s in touched:
            # The kernel maps whole page-cache folios (up to MBs) on a fault; they would stay in this
            # process's RSS. Unmapping after the copy keeps RSS flat (the pages stay in the page cache).
            self.memmaps[s]._mmap.madvise(mmap.MADV_DONTNEED)
        return torch.from_numpy(out)


FD_HEADROOM = 256  # open files the rest of a rank needs (sockets, libraries, checkpoints)


def room_for_shards(cfg: DataConfig, manifest: dict, raise_limit: bool = False) -> None:
    """Every shard stays memory-mapped, and each mapping holds a file descriptor (CPython's mmap
    keeps a duplicate): a prepared hub corpus of ~5,000 shards exceeds the common soft limit of
    1,024 open files. The soft limit is raised as far as the hard one allows (`raise_limit`);
    beyond that, one config error line before any worker starts."""
    import resource

    need = sum(len(manifest["splits"][s]["shards"]) for s in ("train", "val")) + FD_HEADROOM
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        # a shard closes in both splits whenever one completes: ~2 shards per data.shard_tokens of training tokens
        tokens = sum(manifest["splits"][s]["tokens"] for s in ("train", "val"))
        enough = 1 << max(0, math.ceil(math.log2(4 * tokens / max(hard - FD_HEADROOM, 1))))
        raise ConfigError("data.shard_tokens", cfg.shard_tokens, f"shards few enough to keep open: this prepared "
                          f"data has {need - FD_HEADROOM} and the hard limit of open files is {hard} (`ulimit -Hn`); "
                          f"raise it, or rebuild it with larger shards: `mode data prepare --config F --force "
                          f"data.shard_tokens={max(enough, cfg.shard_tokens)}`")
    if raise_limit:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def open_prepared(cfg: DataConfig, progress: bool = False, raise_limit: bool = False):
    """(directory, manifest) of the prepared data for `cfg` (prepared now if missing), checked
    against the config and the open-file limit (raised for the reader: `room_for_shards`)."""
    path = prepare(cfg, progress=progress)
    manifest = read_manifest(path, cfg)
    if manifest is None:
        raise ConfigError("data.prepared_dir", cfg.prepared_dir,
                          f"prepared data at {path} (run `mode data prepare --config F` first)")
    check_manifest(cfg, path, manifest, build_tokenizer(cfg))
    room_for_shards(cfg, manifest, raise_limit)
    return path, manifest


def check_vocab(cfg: Config):
    """The tokenizer (returned) fits model.vocab_size: checked before anything is tokenized."""
    tok = build_tokenizer(cfg.data)
    if cfg.model.vocab_size < tok.vocab_size:
        raise ConfigError("model.vocab_size", cfg.model.vocab_size, f">= the tokenizer's vocabulary {tok.vocab_size}")
    return tok


def check_data(cfg: Config, write: bool = True) -> Path:
    """The pre-launch data check: the tokenizer fits the model, the data is prepared (preparing it
    now if not: every bad input is found here, before any worker starts or run.dir is written),
    the manifest matches the config, and each split holds at least one sequence. `write=False`
    (`--print-config`) makes the same checks without preparing: unprepared sources are read only
    until each split holds one sequence. Returns the prepared directory (existing or not)."""
    tok = check_vocab(cfg)
    S = cfg.data.seq_len
    if write:
        path, manifest = open_prepared(cfg.data, progress=cfg.log.progress)
    else:
        check_place(cfg.data)
        path = prepared_path(cfg.data)
        manifest = read_manifest(path, cfg.data)  # a damaged manifest or shard: the same line as training
        if manifest is not None:
            check_manifest(cfg.data, path, manifest, tok)
    tokens = ({split: manifest["splits"][split]["tokens"] for split in ("train", "val")} if manifest is not None
              else count_tokens(cfg.data, tok, S + 1))
    for split in ("train", "val"):
        if tokens[split] < S + 1:
            raise ConfigError("data.seq_len", S, f"< the {split} split's {tokens[split]} tokens ({path}): a corpus "
                              "shorter than one sequence; use a shorter data.seq_len or more data")
    return path


class DataModule:
    def __init__(self, cfg: DataConfig, rank: int = 0, world_size: int = 1):
        self.cfg, self.rank, self.world = cfg, rank, world_size
        self.tokenizer = build_tokenizer(cfg)
        self.path, self.manifest = open_prepared(cfg, raise_limit=True)
        dtype = self.manifest["dtype"]
        self.train = TokenSplit(self.path, self.manifest["splits"]["train"], dtype, cfg.prepared_dir)
        self.val = TokenSplit(self.path, self.manifest["splits"]["val"], dtype, cfg.prepared_dir)
        S = cfg.seq_len
        self.n_train, self.n_val = self.train.n_windows(S), self.val.n_windows(S)
        if min(self.n_train, self.n_val) < 1:
            raise ConfigError("data.seq_len", S, "a length the prepared corpus holds at least once per split")
        self.token_bytes_V = self.tokenizer.token_bytes()
        self._val_bytes = {}

    def train_rows(self, step: int, micro: int, micro_batch: int, accum: int) -> torch.Tensor:
        """Indices of the training windows this rank reads at (step, micro)."""
        start = ((step * accum + micro) * self.world + self.rank) * micro_batch
        g = np.arange(start, start + micro_batch, dtype=np.int64)
        n = self.n_train
        epoch, i = g // n, g % n
        rows = np.empty_like(g)
        for e in np.unique(epoch):  # a batch spans at most two epochs
            sel = epoch == e
            rows[sel] = permute(i[sel], n, self.cfg.split_seed * 1000003 + int(e))
        return torch.from_numpy(rows)

    def train_batch(self, step: int, micro: int, micro_batch: int, accum: int):
        """(inputs, targets), each [B, S] int64, for this rank at (step, micro)."""
        seq = self.train.windows(self.train_rows(step, micro, micro_batch, accum).tolist(), self.cfg.seq_len)
        return seq[:, :-1], seq[:, 1:]

    def val_rows(self, n_batches: int, micro_batch: int) -> list[list[int]]:
        """The validation windows of this rank's evaluation batches: the first windows of the split."""
        return [[((b * self.world + self.rank) * micro_batch + j) % self.n_val for j in range(micro_batch)]
                for b in range(n_batches)]

    def val_batches(self, n_batches: int, micro_batch: int):
        """The same evaluation batches every time: (inputs, targets), each [B, S] int64."""
        for rows in self.val_rows(n_batches, micro_batch):
            seq = self.val.windows(rows, self.cfg.seq_len)
            yield seq[:, :-1], seq[:, 1:]

    def val_bytes(self, n_batches: int, micro_batch: int) -> int:
        """UTF-8 bytes of the text that this rank's evaluation targets stand for (eval/bpb's denominator).
        A target token counts its bytes in the tokenizer's table (`token_bytes`); a document's first token
        also counts the document's correction, its text's UTF-8 bytes minus its tokens' table bytes. Whole
        documents are then exact for any tokenizer: SentencePiece-style tokenizers prepend a space that the
        text does not have (+1 byte a document by the table alone), normalisers change the text."""
        key = (n_batches, micro_batch)
        if key not in self._val_bytes:
            S, table = self.cfg.seq_len, self.token_bytes_V
            rows = [w for r in self.val_rows(n_batches, micro_batch) for w in r]  # a repeated window counts again
            total = sum(int(table[self.val.read(w * S + 1, S)].sum()) for w in rows)
            docs = self.val.documents(limit=(max(rows) + 1) * S + 1)
            if docs is None:
                if self.rank == 0:
                    print(f"note: {self.path} was prepared before per-document bytes were kept: eval/bpb counts "
                          "the tokenizer's table only (a tokenizer that prepends a space to each document adds "
                          "1 byte a document); `mode data prepare --force` rebuilds it", file=sys.stderr)
            else:
                starts, ends, nbytes = docs
                for w in rows:  # documents whose first token is one of the window's targets
                    lo, hi = np.searchsorted(starts, [w * S + 1, w * S + S + 1])
                    for d in range(lo, hi):
                        tokens = self.val.read(int(starts[d]), int(ends[d] - starts[d]))
                        total += int(nbytes[d]) - int(table[tokens].sum())
            self._val_bytes[key] = total
        return self._val_bytes[key]

"""Data through `datasets`: load documents, tokenize, pack into fixed-length sequences, and serve
deterministic, rank-disjoint, resumable batches.

Shape legend: B micro-batch, S sequence length.

The sampler is a pure function of (split_seed, global sample index), so the read position is
one integer (the optimizer step) and resume continues exactly. Global sample g of an epoch maps
to a permutation of sequences drawn from split_seed + epoch; at step t, micro-step m, rank r
reads samples [(t*accum + m)*world*B + r*B, ... + B): ranks read disjoint shards, and the
global batch is the same sequences whatever the world size.
"""
from __future__ import annotations

import glob
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mode.config import ConfigError, DataConfig

EXT_FORMAT = {".txt": "text", ".text": "text", ".md": "text", ".py": "text", ".json": "json", ".jsonl": "json",
              ".parquet": "parquet"}


class ByteTokenizer:
    """UTF-8 bytes plus an end-of-document token: no vocabulary file, no download."""

    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer from a local directory holding tokenizer.json."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        f = Path(path) / "tokenizer.json"
        if not f.is_file():
            raise ConfigError("data.tokenizer", path, "a directory containing tokenizer.json")
        self.tok = Tokenizer.from_file(str(f))
        self.vocab_size = self.tok.get_vocab_size()
        eos = next((t for t in ("</s>", "<|endoftext|>", "<eos>", "[SEP]") if self.tok.token_to_id(t) is not None), None)
        self.eos_id = self.tok.token_to_id(eos) if eos else self.vocab_size
        self.vocab_size = max(self.vocab_size, self.eos_id + 1)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text).ids, dtype=np.int32)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids if int(i) != self.eos_id])


def build_tokenizer(cfg: DataConfig):
    return ByteTokenizer() if cfg.tokenizer == "byte" else HFTokenizer(cfg.tokenizer)


def stdlib_files() -> list[str]:
    """The running interpreter's standard-library sources: a real corpus present on every machine."""
    return sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))


def load_documents(cfg: DataConfig):
    """A `datasets.Dataset` with one document per row in column `text`."""
    import datasets

    datasets.disable_progress_bars()
    src = cfg.source
    if src == "stdlib":
        ds = datasets.load_dataset("text", data_files=stdlib_files(), sample_by="document", split="train")
    else:
        files = sorted(glob.glob(os.path.expanduser(src)))
        if len(files) == 1 and os.path.isdir(files[0]):
            files = sorted(f for f in glob.glob(os.path.join(files[0], "**", "*"), recursive=True) if os.path.isfile(f))
        if files:
            fmt = cfg.format if cfg.format != "auto" else EXT_FORMAT.get(Path(files[0]).suffix, "text")
            kwargs = {"sample_by": "document"} if fmt == "text" else {}
            ds = datasets.load_dataset(fmt, data_files=files, split="train", **kwargs)
        else:  # a hub dataset name (clusters); tested here with local files only
            ds = datasets.load_dataset(src, split=cfg.hub_split)
    if cfg.text_key not in ds.column_names:
        raise ConfigError("data.text_key", cfg.text_key, f"one of the dataset's columns {ds.column_names}")
    if cfg.text_key != "text":
        ds = ds.rename_column(cfg.text_key, "text")
    ds = ds.select_columns(["text"])
    if cfg.max_documents:
        ds = ds.select(range(min(cfg.max_documents, len(ds))))
    return ds


def pack(ds, tokenizer, seq_len: int) -> torch.Tensor:
    """Tokenize documents (EOS after each), concatenate, cut into [N, seq_len + 1] windows that
    overlap by one token, so every token after the first is a target exactly once."""
    tok = ds.map(lambda b: {"ids": [np.append(tokenizer.encode(t), tokenizer.eos_id) for t in b["text"]]},
                 batched=True, remove_columns=["text"])
    stream = np.concatenate([np.asarray(x, dtype=np.int64) for x in tok["ids"]]) if len(tok) else np.zeros(0, np.int64)
    n = (len(stream) - 1) // seq_len
    if n < 1:
        raise ConfigError("data.seq_len", seq_len, f"shorter than the corpus ({len(stream)} tokens)")
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None]
    return torch.from_numpy(stream[idx])


@dataclass
class Split:
    seqs_NS1: torch.Tensor  # [N, S + 1]

    def __len__(self) -> int:
        return self.seqs_NS1.shape[0]


class DataModule:
    def __init__(self, cfg: DataConfig, rank: int = 0, world_size: int = 1):
        self.cfg, self.rank, self.world = cfg, rank, world_size
        self.tokenizer = build_tokenizer(cfg)
        docs = load_documents(cfg)
        if len(docs) < 2:
            raise ConfigError("data.source", cfg.source, "a corpus of at least 2 documents (train + validation)")
        parts = docs.train_test_split(test_size=max(1, round(cfg.val_fraction * len(docs))), seed=cfg.split_seed)
        self.train = Split(pack(parts["train"], self.tokenizer, cfg.seq_len))
        self.val = Split(pack(parts["test"], self.tokenizer, cfg.seq_len))

    def _perm(self, epoch: int) -> torch.Tensor:
        """The epoch's sampling order; the last one is kept (a batch needs at most two epochs)."""
        if getattr(self, "_perm_epoch", None) != epoch:
            g = torch.Generator().manual_seed(self.cfg.split_seed * 1000003 + epoch)
            self._perm_epoch, self._perm_cache = epoch, torch.randperm(len(self.train), generator=g)
        return self._perm_cache

    def train_rows(self, step: int, micro: int, micro_batch: int, accum: int) -> torch.Tensor:
        """Indices of the packed training sequences this rank reads at (step, micro)."""
        start = ((step * accum + micro) * self.world + self.rank) * micro_batch
        g = torch.arange(start, start + micro_batch)
        n = len(self.train)
        epochs = (g // n).tolist()
        perms = {e: self._perm(e) for e in set(epochs)}
        return torch.stack([perms[e][i] for e, i in zip(epochs, (g % n).tolist())])

    def train_batch(self, step: int, micro: int, micro_batch: int, accum: int):
        """(inputs, targets), each [B, S] int64, for this rank at (step, micro)."""
        seq = self.train.seqs_NS1[self.train_rows(step, micro, micro_batch, accum)]
        return seq[:, :-1], seq[:, 1:]

    def val_batches(self, n_batches: int, micro_batch: int):
        """The same evaluation batches every time: the first sequences of the validation split."""
        n = len(self.val)
        for b in range(n_batches):
            start = (b * self.world + self.rank) * micro_batch
            seq = self.val.seqs_NS1[torch.arange(start, start + micro_batch) % n]
            yield seq[:, :-1], seq[:, 1:]

"""Tokenize once: stream documents through `datasets`, tokenize them in worker processes and write
memory-mapped token shards with a manifest (`mode data prepare`).

Layout of one prepared directory (`<data.prepared_dir>/<name>-<hash of the data keys>/`):

    manifest.json               written last; its presence means every shard is complete
    train_00000.bin ...         tokens (uint16 when the vocabulary fits, else uint32), each document
                                followed by EOS; a shard ends at a document boundary
    train_00000.docs.npy ...    int64 end offset of every document inside its shard
    train_00000.bytes.npy ...   int64 UTF-8 bytes of every document's text (exact eval/bpb)
    val_00000.bin ...           the same for the validation split

A prepare writes into `<name>.tmp/` and renames it into place, under a lock file, so a killed prepare
never leaves a manifest pointing at a partial shard, and the next one (or a waiting rank) starts
clean. This module does not import torch: tokenizer workers start in a fraction of a second.
"""
from __future__ import annotations

import codecs
import contextlib
import glob
import hashlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import sys
import sysconfig
import tempfile
import threading
import time
from collections import deque
from dataclasses import asdict
from fcntl import LOCK_EX, flock  # by name: a test replaces this module's flock only
from pathlib import Path

import numpy as np

from mode.config import ConfigError, DataConfig, is_int, looks_local
from mode.lifeline import NO_FLOCK, alive

MANIFEST = "manifest.json"
MARKER = ".mode-prepare"  # proves a directory was created by this module (safe to delete)
FORMAT = "mode-prepared-v1"
PROGRESS = "progress.json"  # inside <name>.tmp/: what a killed prepare had completed
EXT_FORMAT = {".txt": "text", ".text": "text", ".md": "text", ".py": "text", ".rst": "text", ".json": "json",
              ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".tsv": "tsv"}
# Keys that decide which tokens are written; everything else (seq_len, workers, where) reads the same data.
# hub_config is left out while empty: data prepared before the key existed keeps its directory.
KEY_FIELDS = ("source", "format", "text_key", "hub_split", "hub_config", "sample_by", "val_source", "tokenizer",
              "eos_token", "val_fraction", "max_documents", "split_seed")
HELD_OUT_NAMES = ("validation", "valid", "val", "dev", "test", "eval", "heldout", "holdout")
# Data files only (not code: a Go package holds foo_test.go, a C project test.c), with wikitext's .raw/.tokens.
DATA_SUFFIXES = (".txt", ".text", ".json", ".jsonl", ".parquet", ".csv", ".tsv", ".raw", ".tokens")
EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "<|im_end|>")


def held_out_named(f: str) -> bool:
    """A data file named as a held-out split: the whole name (validation.txt), the name of a
    numbered shard (validation-00000-of-00001.parquet, as the hub names them) or the last part of
    a dotted/dashed name (wiki.valid.raw, corpus_test.jsonl); not Test_cricket.txt or dev_log.txt."""
    p = Path(f)
    if p.suffix.lower() not in DATA_SUFFIXES:
        return False
    parts = re.split(r"[._-]", p.stem.lower())
    shard = parts[0] in HELD_OUT_NAMES and all(x.isdigit() or x == "of" for x in parts[1:])
    return shard or parts[-1] in HELD_OUT_NAMES


def glob_root(spec: str) -> str:
    """A local source's path, or a glob's fixed prefix (the directory its matches lie under)."""
    root = os.path.expanduser(spec)
    if re.search(r"[*?[]", root):
        root = os.path.join(".", *itertools.takewhile(lambda x: not re.search(r"[*?[]", x), Path(root).parts))
    return root


def held_out(f: str, spec: str) -> tuple[str, str] | None:
    """("file", f) for a data file named as a held-out split, ("folder", F) for one under a folder F
    so named (validation/, test/: train/ + test/ layouts) between the source `spec` (a directory, or
    a glob's fixed prefix) and the file; else None."""
    if held_out_named(f):
        return "file", f
    if Path(f).suffix.lower() not in DATA_SUFFIXES:
        return None
    root = glob_root(spec)
    if not os.path.isdir(root):  # a file: nothing between
        return None
    parts = Path(os.path.relpath(f, root)).parts[:-1]
    for i, part in enumerate(parts):
        if part.lower() in HELD_OUT_NAMES:
            return "folder", os.path.normpath(os.path.join(root, *parts[: i + 1]))
    return None


# ----------------------------------------------------------------------------------------------
# Tokenizers


class ByteTokenizer:
    """UTF-8 bytes plus an end-of-document token: no vocabulary file, no download."""

    vocab_size = 257
    eos_id = 256
    identity = {"kind": "byte", "sha256": hashlib.sha256(b"mode-byte-tokenizer-v1").hexdigest()}

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes of text each token id stands for (EOS: none)."""
        return np.array([1] * 256 + [0], dtype=np.int64)

    def spec(self) -> dict:
        return {"kind": "byte"}


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer from a tokenizer.json file."""

    def __init__(self, file: str, eos_id: int, identity: dict):
        from tokenizers import Tokenizer

        self.file, self.eos_id, self.identity = file, eos_id, identity
        self.tok = Tokenizer.from_file(file)
        # ids + 1, not their count: a vocabulary with holes has ids past its count (uint16 would wrap them)
        self.vocab_size = max(self.tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int32) for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids if int(i) != self.eos_id])

    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes of text each token id stands for; special tokens count none. Byte-level BPE
        tokens are spelled one character per byte; SentencePiece's `▁` is a space, `<0xNN>` one byte."""
        decoder = json.loads(self.tok.to_str()).get("decoder") or {}
        byte_level = "ByteLevel" in json.dumps(decoder)
        special = {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
        out = np.zeros(self.vocab_size, dtype=np.int64)
        for i in range(self.vocab_size):
            piece = self.tok.id_to_token(i)
            if i in special or piece is None:
                continue
            if byte_level:
                out[i] = len(piece)
            elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
                out[i] = 1
            elif "▁" in piece:
                out[i] = len(piece.replace("▁", " ").encode("utf-8"))
            else:
                out[i] = len(self.tok.decode([i]).encode("utf-8"))
        return out

    def spec(self) -> dict:
        return {"kind": "hf", "file": self.file, "eos_id": self.eos_id, "identity": self.identity}


def tokenizer_from_spec(spec: dict):
    return ByteTokenizer() if spec["kind"] == "byte" else HFTokenizer(spec["file"], spec["eos_id"], spec["identity"])


def _tokenizer_file(name: str) -> Path:
    if not name.strip():  # Path("") is the current directory: it would be looked in for tokenizer.json
        raise ConfigError("data.tokenizer", name, "`byte`, a directory holding tokenizer.json, a tokenizer.json "
                                                  "file or a hub name (an unset shell variable?)")
    p = Path(name).expanduser()
    if p.is_dir():
        if not (p / "tokenizer.json").is_file():
            raise ConfigError("data.tokenizer", name, "a directory holding tokenizer.json (this one has none)")
        return p / "tokenizer.json"
    if p.is_file():
        return p
    if looks_local(name):
        raise ConfigError("data.tokenizer", name, "`byte`, an existing directory holding tokenizer.json, "
                                                  "a tokenizer.json file, or a hub name in the local cache")
    from huggingface_hub import try_to_load_from_cache

    f = try_to_load_from_cache(name, "tokenizer.json")
    if not isinstance(f, str):
        raise ConfigError("data.tokenizer", name, "a hub tokenizer present in the local Hugging Face cache "
                          f"(not found there; on a machine with network: `hf download {name} tokenizer.json "
                          "tokenizer_config.json`), a local directory, or `byte`")
    return Path(f)


def build_tokenizer(cfg: DataConfig):
    """The configured tokenizer; refuses one without a known end-of-sequence token (never invents an id)."""
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    from tokenizers import Tokenizer

    f = _tokenizer_file(cfg.tokenizer)
    try:
        tok = Tokenizer.from_file(str(f))
    except Exception as e:  # noqa: BLE001 - a corrupt file is a config problem, named in one line
        raise ConfigError("data.tokenizer", cfg.tokenizer, f"a valid tokenizer.json ({str(e).splitlines()[0]})")
    eos = cfg.eos_token
    if eos:
        if tok.token_to_id(eos) is None:
            raise ConfigError("data.eos_token", eos, f"a token of the tokenizer {cfg.tokenizer}")
    else:
        conf = f.parent / "tokenizer_config.json"
        named = json.loads(conf.read_text()).get("eos_token") if conf.is_file() else None
        named = named.get("content") if isinstance(named, dict) else named
        eos = next((t for t in (named, *EOS_NAMES) if t and tok.token_to_id(t) is not None), None)
        if eos is None:
            raise ConfigError("data.eos_token", "", f"the end-of-document token of {cfg.tokenizer}: it has no "
                              f"recognised one ({', '.join(EOS_NAMES)}); name one of its tokens")
    identity = {"kind": "hf", "name": cfg.tokenizer, "eos_token": eos,
                "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
    return HFTokenizer(str(f), tok.token_to_id(eos), identity)


# ----------------------------------------------------------------------------------------------
# Sources: documents streamed through `datasets`


def stdlib_files() -> list[str]:
    """The running interpreter's standard-library sources: a real corpus present on every machine."""
    return sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))


def _inside(path: str, root: str) -> bool:
    """`path` (followed through links) is `root` (a real path) or below it."""
    path = os.path.realpath(path)
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def source_files(spec: str, key: str, prepared_dir: str = "") -> list[str]:
    """Files of a local source (file, directory searched recursively, or glob); [] for a hub name.
    Nothing under `prepared_dir` (a source folder holding data.prepared_dir would read the prepared
    shards, manifests and locks as text, and find itself changed by every prepare)."""
    if spec == "stdlib":
        return stdlib_files()
    if not looks_local(spec):
        return []
    prepared = os.path.realpath(os.path.expanduser(prepared_dir)) if prepared_dir else None
    if prepared and _inside(glob_root(spec), prepared):
        raise ConfigError("data.prepared_dir", prepared_dir, f"a directory that does not hold {key}={spec} (its "
                          "prepared files would be read as text)")
    files = []
    for m in sorted(glob.glob(os.path.expanduser(spec))):
        if os.path.isdir(m):
            files += sorted(f for f in glob.glob(os.path.join(m, "**", "*"), recursive=True)
                            if os.path.isfile(f) and not Path(f).name.startswith("."))
        elif os.path.isfile(m):
            files.append(m)
    if prepared:
        files = [f for f in files if not _inside(f, prepared)]
    if not files:
        raise ConfigError(key, spec, "an existing file, a directory with files, or a glob matching files")
    return files


def is_dataset_repo(spec: str) -> bool:
    """A local directory laid out as a hub dataset repository (a clone): its README.md's YAML header
    lists `configs:`, so `datasets` reads it by config and split like the hub dataset."""
    readme = Path(spec).expanduser() / "README.md"
    if not readme.is_file():
        return False
    text = readme.read_text(encoding="utf-8", errors="replace")
    if not text.startswith("---"):
        return False
    import yaml

    try:
        header = yaml.safe_load(text[3:].split("\n---", 1)[0])
    except yaml.YAMLError:
        return False
    return isinstance(header, dict) and "configs" in header


def _format(cfg: DataConfig, files: list[str], key: str, spec: str) -> str:
    if cfg.format != "auto":
        return cfg.format
    fmts = {EXT_FORMAT.get(Path(f).suffix.lower(), "text") for f in files}
    if len(fmts) > 1:
        raise ConfigError(key, spec, f"files of one format (found {', '.join(sorted(fmts))}); set data.format "
                          "or narrow the glob")
    return fmts.pop()


def check_utf8(files: list[str], key: str, spec: str) -> None:
    """Refuse binary and non-UTF-8 text files before any worker starts (streamed, ~1 GB/s)."""
    for f in files:
        dec, pos = codecs.getincrementaldecoder("utf-8")(), 0
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                if b"\0" in chunk:
                    raise ConfigError(key, spec, f"UTF-8 text files; {f} is binary (NUL byte at {pos + chunk.index(0)})")
                try:
                    dec.decode(chunk)
                except UnicodeDecodeError as e:
                    raise ConfigError(key, spec, f"UTF-8 text files; {f} is not UTF-8 (byte {pos + e.start})") from None
                pos += len(chunk)
            try:
                dec.decode(b"", final=True)
            except UnicodeDecodeError:
                raise ConfigError(key, spec, f"UTF-8 text files; {f} ends inside a UTF-8 character") from None


def open_documents(cfg: DataConfig, which: str, exclude: tuple[str, ...] = ()):
    """(an iterator of document strings, its description, the local files read) for `source` or
    `val_source`, leaving out the files `exclude` names (val_source's: by real path, so that a link
    to one, or a path through a linked directory, is that file); every check that can fail runs
    here, before a worker starts."""
    import datasets
    import huggingface_hub

    datasets.disable_progress_bars()
    # Retries, warnings and the json builder's own "Failed to load JSON" error log would break the
    # one-line error (the exception that follows carries the same message).
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    huggingface_hub.utils.logging.set_verbosity_error()
    key = "data.source" if which == "source" else "data.val_source"
    spec = getattr(cfg, which)
    hub_split = cfg.hub_split
    if which == "val_source" and not looks_local(spec):  # a split of the hub source
        if (looks_local(cfg.source) or cfg.source == "stdlib") and not is_dataset_repo(cfg.source):
            raise ConfigError(key, spec, "an existing file, directory or glob (a split name needs a hub data.source)")
        if spec == cfg.hub_split:  # every training document would be held out: none left to train on
            raise ConfigError(key, spec, f"a split other than data.hub_split={cfg.hub_split!r} (the validation "
                              "documents are never trained on)")
        spec, hub_split = cfg.source, cfg.val_source
    repo = is_dataset_repo(spec)
    exclude = {os.path.realpath(f) for f in exclude}
    files = [f for f in source_files(spec, key, cfg.prepared_dir) if os.path.realpath(f) not in exclude]
    local = (looks_local(spec) or spec == "stdlib") and not repo
    if cfg.hub_config and local:
        raise ConfigError("data.hub_config", cfg.hub_config, "empty for local files (a config name selects a subset "
                          "of a hub dataset or of a local dataset repository whose README.md lists `configs:`)")
    # A data file named as a held-out split beside the training files: with val_fraction alone, whole
    # files would be drawn into either split (a text file is one document), and the validation file
    # trained on. Refused: the user says which file is which.
    held = list(dict.fromkeys(h for f in files if (h := held_out(f, spec))))
    names = (f"files and folders named {'/'.join(HELD_OUT_NAMES)} (files: or numbered shards of them, or names "
             "ending in them)")
    if which == "source" and held and spec != "stdlib" and not repo:
        kind, path = held[0]
        more = f" (and {len(held) - 1} more)" if len(held) > 1 else ""
        if cfg.val_source:  # another held-out file beside the one named: it would be trained on
            raise ConfigError("data.source", spec, f"training files only; besides data.val_source={cfg.val_source} "
                              f"it holds the held-out {kind} {path}{more}, which would be trained on: name the "
                              f"training files (a file or glob), or leave {names} out of it")
        raise ConfigError("data.val_source", "", f"the held-out {kind} in data.source={spec}: set "
                          f"data.val_source={path}{more} (its documents become the validation set and are never "
                          f"trained on), or leave {names} out of data.source")
    if local:
        if not files:
            raise ConfigError(key, spec, "files that are not also the validation source")
        fmt = _format(cfg, files, key, spec)
        if fmt in ("text", "json", "csv", "tsv"):  # JSON is UTF-8 text too (RFC 8259); a bad byte otherwise surfaces mid-prepare
            check_utf8(files, key, spec)
        if fmt == "text" and cfg.sample_by == "document" and len(files) == 1 and which == "source" \
                and not cfg.val_source and os.path.getsize(files[0]):  # one document: all trained on or all held out
            raise ConfigError(key, spec, "a source of several documents; one text file is one document with "
                              "data.sample_by=document, so it would all go to training or all to validation: set "
                              "data.sample_by=paragraph or line, or a validation source data.val_source")
        # utf-8-sig: a byte-order mark (Windows editors write one) is not text of the first document
        kw = ({"sample_by": cfg.sample_by, "encoding": "utf-8-sig"} if fmt == "text"
              else {"sep": "\t"} if fmt == "tsv" else {})
        try:  # tsv: the csv builder with tabs
            ds = datasets.load_dataset("csv" if fmt == "tsv" else fmt, data_files=files, split="train", streaming=True,
                                       **kw)
        except StopIteration:  # the json builder infers its schema from the first row: an empty file has none
            raise ConfigError(key, spec, "a corpus with at least one document (it is empty)") from None
        except Exception as e:  # noqa: BLE001
            raise ConfigError(key, spec, f"readable {fmt} files ({_first_line(e)})") from None
        desc = {"kind": "local", "spec": spec, "format": fmt, "files": len(files)}
    else:  # a hub dataset, or a local clone of one: the same `load_dataset(spec, name=, split=)` call
        try:
            ds = datasets.load_dataset(spec, name=cfg.hub_config or None, split=hub_split, streaming=True)
        except Exception as e:  # noqa: BLE001 - offline, no such dataset, config or split: one line, no traceback
            msg = " ".join(str(e).split())
            if "config" in msg.lower() and "reach" not in msg.lower():  # no such config, or one must be named
                raise ConfigError("data.hub_config", cfg.hub_config, f"a config of {spec} ({msg[:300]})") from None
            k, v = "data.source", cfg.source
            if "split" in msg.lower():
                k, v = ("data.hub_split", hub_split) if which == "source" else (key, cfg.val_source)
            raise ConfigError(k, v, "a local file/dir/glob or a reachable hub dataset and split "
                              f"({_first_line(e)})") from None
        desc = {"kind": "repo" if repo else "hub", "name": spec, "config": cfg.hub_config, "split": hub_split}
    it = iter(ds)
    try:
        first = next(it, None)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(key, spec, f"readable documents ({_first_line(e)})") from None
    if first is None:
        raise ConfigError(key, spec, "a corpus with at least one document (it is empty)")
    if cfg.text_key not in first:
        raise ConfigError("data.text_key", cfg.text_key, f"one of the source's columns {sorted(first)}")

    def docs():
        rows = itertools.chain([first], _local_rows(it, key, spec) if local else it)
        if cfg.max_documents:
            rows = itertools.islice(rows, cfg.max_documents)
        for i, row in enumerate(rows):
            text = row.get(cfg.text_key)
            if not isinstance(text, str):
                got = "no such column" if cfg.text_key not in row else f"{type(text).__name__}"
                raise ConfigError("data.text_key", cfg.text_key, f"a column of strings in every row (row {i + 1} of "
                                  f"{spec}: {got})")
            yield text

    return docs(), desc, files


def _local_rows(it, key: str, spec: str):
    """Rows of a local source; a file that cannot be parsed past its first block (a malformed JSON
    line deep in a large file) is bad input, found mid-prepare: one config error line (a hub stream's
    mid-way failure stays a runtime error, resumable after its last complete shard)."""
    try:
        yield from it
    except Exception as e:  # noqa: BLE001 - pyarrow, json and datasets raise many kinds
        if isinstance(e, MemoryError) or (isinstance(e, OSError) and e.errno is not None):
            raise  # the machine, not the data (EIO, ESTALE, ENOSPC): a runtime fault, whose progress
            # the next prepare resumes; a config error would delete it (pyarrow's parse errors carry no errno)
        raise ConfigError(key, spec, f"readable documents ({_first_line(e)})") from None


def _first_line(e: BaseException) -> str:
    s = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return f"{type(e).__name__}: {s[:200]}"


def current_files(cfg: DataConfig) -> set[str]:
    """The local files the source and val_source name now (absolute paths, as fingerprinted)."""
    out = set()
    for spec, key in ((cfg.source, "data.source"), (cfg.val_source, "data.val_source")):
        if spec and (looks_local(spec) or spec == "stdlib"):
            try:
                out |= {os.path.abspath(f) for f in source_files(spec, key, cfg.prepared_dir)}
            except ConfigError:  # matches nothing now: the fingerprint's files are reported gone
                pass
    return out


def fingerprint(files: list[str]) -> list:
    """What the local source files were when prepared: a change makes the manifest stale."""
    return [[os.path.abspath(f), (st := os.stat(f)).st_size, st.st_mtime_ns] for f in files]


# ----------------------------------------------------------------------------------------------
# Tokenizing in worker processes


_TOK = None


def _exit_with_parent(parent: int, scratch: str) -> None:
    # A worker holds both ends of the pool's task queue, so its parent's death (SIGKILL) never
    # reaches it as EOF: it waited for tasks for good (seen), and the scratch batches stayed.
    while os.getppid() == parent:
        time.sleep(1.0)
    shutil.rmtree(scratch, ignore_errors=True)
    os._exit(1)


def _init_worker(spec: dict, scratch: str | None = None) -> None:
    global _TOK
    if scratch is not None:  # a pool's worker
        threading.Thread(target=_exit_with_parent, args=(os.getppid(), scratch), name="mode-parent",
                         daemon=True).start()
        # Ctrl-C reaches the whole process group: the parent stops the pool (its one line, exit 130);
        # a worker's own KeyboardInterrupt only printed a traceback beside it
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: data.num_workers is the knob
    _TOK = tokenizer_from_spec(spec)


def _encode(texts: list[str]):
    """(tokens with EOS after each document, tokens per document, 8-byte text hashes, UTF-8 bytes per document)."""
    ids = _TOK.encode_batch(texts)
    eos = np.array([_TOK.eos_id], dtype=np.int64)
    flat = np.concatenate([np.concatenate([x.astype(np.int64), eos]) for x in ids])
    lens = np.array([len(x) + 1 for x in ids], dtype=np.int64)
    raw = [t.encode("utf-8") for t in texts]
    # of the text without surrounding whitespace: a paragraph last in one file keeps its final newline
    hashes = np.array([int.from_bytes(hashlib.blake2b(t.strip().encode("utf-8"), digest_size=8).digest(), "little")
                       for t in texts], dtype=np.uint64)
    return flat, lens, hashes, np.array([len(r) for r in raw], dtype=np.int64)


SCRATCH = "mode-prepare-"  # + host-pid-random: a prepare's scratch directory under $TMPDIR
BATCH_FILE = re.compile(r"\d+\.npz")  # what its workers write there


def remove_dead_scratch() -> None:
    """Remove the scratch directories of prepares on this host whose process is gone (a SIGKILL of
    a whole prepare, workers included, leaves one): ours by name, host and dead pid, holding only
    batch files; anything else (a live pid, another host's, a file of the user's inside) is kept."""
    host = socket.gethostname()
    pattern = re.compile(re.escape(f"{SCRATCH}{host}-") + r"(\d+)-\w+")
    for d in Path(tempfile.gettempdir()).glob(f"{SCRATCH}*"):
        m = pattern.fullmatch(d.name)
        if not m or alive(int(m.group(1))) or d.is_symlink() or not d.is_dir():
            continue
        try:
            if all(BATCH_FILE.fullmatch(f.name) and f.is_file() and not f.is_symlink() for f in d.iterdir()):
                shutil.rmtree(d)
        except OSError:
            pass  # another prepare removed it meanwhile, or it is not ours to remove


def _encode_to_file(texts: list[str], path: str) -> str:
    """_encode with the arrays left in a file: a worker killed while it sends a large result leaves half a
    message in the result pipe, and ProcessPoolExecutor then waits for the rest forever (seen here: 1 in
    ~25 kills); a short path is one atomic pipe write."""
    arrays = _encode(texts)
    try:
        np.savez(path, *arrays)
    except OSError as e:  # zipfile names no file: a full $TMPDIR is told as that place, not the prepared_dir
        e.filename = e.filename or path
        raise
    return path


def _batches(docs, max_chars: int = 1 << 20, max_docs: int = 4096):
    """(batch of non-empty documents, documents read from the source so far, empty ones included)."""
    batch, size, read = [], 0, 0
    for t in docs:
        read += 1
        if not t.strip():
            continue  # empty documents (blank lines with sample_by=line) carry no text
        batch.append(t)
        size += len(t)
        if size >= max_chars or len(batch) >= max_docs:
            yield batch, read
            batch, size = [], 0
    if batch:
        yield batch, read


@contextlib.contextmanager
def encoder(tok, workers: int):
    """A function mapping an iterator of documents to (encoded batch, documents read), in order;
    with several workers, a bounded number of batches is in flight (the reader never runs ahead
    of memory)."""
    if workers <= 1:
        old = os.environ.get("TOKENIZERS_PARALLELISM")
        _init_worker(tok.spec())
        try:
            yield lambda docs: ((_encode(b), read) for b, read in _batches(docs))
        finally:
            os.environ.pop("TOKENIZERS_PARALLELISM") if old is None else os.environ.update(TOKENIZERS_PARALLELISM=old)
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    def load(path: str):
        with np.load(path) as z:
            out = tuple(z[f"arr_{i}"] for i in range(len(z.files)))
        os.unlink(path)
        return out

    # Not multiprocessing.Pool: a worker that dies there loses its task and the prepare waits for it
    # forever; here the pool breaks and the next result or submit says so.
    remove_dead_scratch()
    with tempfile.TemporaryDirectory(prefix=f"{SCRATCH}{socket.gethostname()}-{os.getpid()}-") as tmp, \
            ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_init_worker,
                                initargs=(tok.spec(), tmp)) as pool:
        def run(docs):
            pending = deque()
            try:
                for n, (b, read) in enumerate(_batches(docs)):
                    pending.append((pool.submit(_encode_to_file, b, os.path.join(tmp, f"{n}.npz")), read))
                    if len(pending) >= 2 * workers:
                        r, read = pending.popleft()
                        yield load(r.result()), read
                while pending:
                    r, read = pending.popleft()
                    yield load(r.result()), read
            except BrokenProcessPool:
                raise RuntimeError("a tokenizer worker process died (killed, out of memory: see `dmesg`, or, from "
                                   "your own script, one without `if __name__ == \"__main__\":`, which each "
                                   "spawned worker runs again); run the prepare again to resume after its last "
                                   "complete shard, or lower data.num_workers") from None

        # SIGTERM (scancel, a time limit, `kill`) as an exit, so the pool stops and the batches in
        # the scratch directory go with it; by default the process vanished and left both behind.
        main = threading.current_thread() is threading.main_thread()  # only there can a handler be set
        before = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main else None
        try:
            yield run
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)  # the running batches only, then the scratch
            raise
        finally:
            if main:  # (None: a handler set outside Python; the default then)
                signal.signal(signal.SIGTERM, signal.SIG_DFL if before is None else before)


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


class ShardWriter:
    """Appends documents' tokens to `<split>_NNNNN.bin`; a shard ends at a document boundary."""

    def __init__(self, root: Path, split: str, dtype, shard_tokens: int, state: dict | None = None):
        self.root, self.split, self.dtype, self.shard_tokens = root, split, np.dtype(dtype), shard_tokens
        self.shards, self.tokens, self.documents, self.bytes = [], 0, 0, 0
        if state:  # resuming: the shards listed in the progress file are complete
            self.shards, self.tokens, self.documents, self.bytes = (state[k] for k in ("shards", "tokens",
                                                                                       "documents", "bytes"))
        self._f, self._ends, self._bytes = None, [], []

    def add(self, flat, lens, nbytes) -> None:
        if not len(lens):
            return
        if self._f is None:
            name = f"{self.split}_{len(self.shards):05d}"
            self._name, self._f, self._n = name, open(self.root / f"{name}.bin", "wb"), 0
        if len(flat) and int(flat.max()) > np.iinfo(self.dtype).max:  # never wrap an id silently
            raise ValueError(f"token id {int(flat.max())} does not fit {np.dtype(self.dtype).name}")
        self._f.write(flat.astype(self.dtype).tobytes())
        self._ends.append(self._n + np.cumsum(lens))
        self._bytes.append(np.asarray(nbytes, dtype=np.int64))
        self._n += int(lens.sum())
        self.tokens += int(lens.sum())
        self.documents += len(lens)
        self.bytes += int(np.sum(nbytes))
        if self._n >= self.shard_tokens:
            self.close()

    def close(self) -> None:
        if self._f is None:
            return
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        ends = np.concatenate(self._ends)
        np.save(self.root / f"{self._name}.docs.npy", ends)
        np.save(self.root / f"{self._name}.bytes.npy", np.concatenate(self._bytes))
        self.shards.append({"file": f"{self._name}.bin", "docs": f"{self._name}.docs.npy",
                            "doc_bytes": f"{self._name}.bytes.npy", "tokens": self._n, "documents": len(ends)})
        self._f, self._ends, self._bytes = None, [], []

    def summary(self) -> dict:
        return {"tokens": self.tokens, "documents": self.documents, "bytes": self.bytes, "shards": self.shards}


def val_mask(first_index: int, n: int, fraction: float, seed: int) -> np.ndarray:
    """Documents [first_index, first_index + n) held out for validation: every 1/fraction-th one from
    a seeded offset, so exactly floor(fraction * N + phase) of N documents, spread over the source."""
    phase = np.random.default_rng(seed).random()
    i = np.arange(first_index, first_index + n, dtype=np.float64)
    return np.floor((i + 1) * fraction + phase) > np.floor(i * fraction + phase)


# ----------------------------------------------------------------------------------------------
# The prepared directory: naming, manifest, lock


def data_keys(cfg: DataConfig) -> dict:
    d = asdict(cfg)
    return {k: d[k] for k in KEY_FIELDS if d[k] != "" or k != "hub_config"}


def prepared_path(cfg: DataConfig) -> Path:
    """`<prepared_dir>/<source>-<tokenizer>-<hash of the data keys>`: one directory per data config."""
    h = hashlib.sha256(json.dumps(data_keys(cfg), sort_keys=True).encode()).hexdigest()[:12]
    slug = lambda s: re.sub(r"[^A-Za-z0-9]+", "-", Path(s.rstrip("/*")).name or s).strip("-")[:40] or "data"  # noqa: E731
    return Path(cfg.prepared_dir).expanduser() / f"{slug(cfg.source)}-{slug(cfg.tokenizer)}-{h}"


REBUILD = "rebuild it with `mode data prepare --config F --force` (it replaces only that directory)"


def damaged(key_value: str, path: Path, why: str) -> ConfigError:
    """The one line for a prepared directory that cannot be used as it is (`key_value`: data.prepared_dir)."""
    return ConfigError("data.prepared_dir", key_value, f"{path} is damaged ({why}); {REBUILD}")


def _is_name(v) -> bool:
    """A plain file name: a manifest never points outside its directory."""
    return isinstance(v, str) and v not in ("", ".", "..") and "/" not in v and "\\" not in v and "\0" not in v


def manifest_problem(m) -> str | None:
    """What makes a parsed manifest unusable: a missing key, a wrong type, shards that do not add up
    to their split's counts, a file name outside the directory; None when its structure is sound."""
    if not isinstance(m, dict):
        return f"a JSON object expected, found {type(m).__name__}"
    want = {"format": str, "tokenizer": dict, "vocab_size": int, "eos_id": int, "dtype": str, "data": dict,
            "splits": dict, "fingerprint": list, "tokens_per_s": (int, float)}
    for k, t in want.items():
        if k not in m:
            return f"no {k!r}"
        if not isinstance(m[k], t) or isinstance(m[k], bool):
            return f"{k!r} is {type(m[k]).__name__}"
    if m["dtype"] not in ("uint16", "uint32"):
        return f"dtype {m['dtype']!r}, expected 'uint16' or 'uint32'"
    if not is_int(m["vocab_size"], 1) or not is_int(m["eos_id"], 0) or m["eos_id"] >= m["vocab_size"]:
        return f"vocab_size {m['vocab_size']!r} / eos_id {m['eos_id']!r}"
    if not all(isinstance(f, list) and len(f) == 3 and isinstance(f[0], str) and is_int(f[1], 0)
               and is_int(f[2], -(1 << 63)) for f in m["fingerprint"]):
        return "'fingerprint' is not a list of [path, size, mtime_ns]"
    for split in ("train", "val"):
        sp = m["splits"].get(split)
        if not isinstance(sp, dict):
            return f"no split {split!r}"
        for k in ("tokens", "documents", "bytes", "shards"):
            if k not in sp:
                return f"no {split} {k!r}"
            if not (isinstance(sp[k], list) if k == "shards" else is_int(sp[k], 0)):
                return f"{split} {k!r} is {str(sp[k])[:60]}"
        for i, s in enumerate(sp["shards"]):
            if not (isinstance(s, dict) and _is_name(s.get("file")) and _is_name(s.get("docs"))
                    and ("doc_bytes" not in s or _is_name(s["doc_bytes"]))
                    and is_int(s.get("tokens"), 1) and is_int(s.get("documents"), 1)):
                return f"{split} shard {i} is not {{file, docs, [doc_bytes,] tokens, documents}}: {str(s)[:120]}"
        for k in ("tokens", "documents"):
            total = sum(s[k] for s in sp["shards"])
            if total != sp[k]:
                return f"{split} shards hold {total} {k}, the split says {sp[k]}"
    return None


def read_manifest(path: Path, cfg: DataConfig | None = None) -> dict | None:
    """The manifest of a prepared directory (None when it has none). One that cannot be read, is not
    JSON, or lacks a key the readers use is a ConfigError naming it (`mode data prepare --force`
    replaces it: the manifest file marks the directory as this module's)."""
    f = Path(path) / MANIFEST
    if not f.is_file():
        return None
    try:
        m = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # ValueError: JSONDecodeError and UnicodeDecodeError
        why = f"not readable JSON: {_first_line(e)}"
    else:
        why = manifest_problem(m)
        if why is None:
            return m
    raise damaged(cfg.prepared_dir if cfg is not None else str(Path(path).parent), path, f"{MANIFEST}: {why}")


def _size_problem(f: Path, want: int) -> str | None:
    try:
        size = f.stat().st_size
    except FileNotFoundError:
        return f"{f.name} is missing"
    return None if size == want else f"{f.name} is {size:,} bytes, the manifest says {want:,}"


def _npy_problem(f: Path, documents: int) -> str | None:
    """A .npy file as long as its header and the manifest's `documents` 8-byte entries make it (the
    header's length is read from its first bytes; neither the header nor the data is parsed)."""
    try:
        with open(f, "rb") as fh:
            head = fh.read(12)
            size = os.fstat(fh.fileno()).st_size
    except FileNotFoundError:
        return f"{f.name} is missing"
    except OSError as e:
        return f"{f.name} is unreadable ({_first_line(e)})"
    if len(head) < 10 or head[:6] != b"\x93NUMPY" or head[6] not in (1, 2, 3):
        return f"{f.name} is not a .npy file"
    offset = 10 + int.from_bytes(head[8:10], "little") if head[6] == 1 else 12 + int.from_bytes(head[8:12], "little")
    want = offset + 8 * documents
    return None if size == want else f"{f.name} is {size:,} bytes, the manifest says {want:,}"


def damaged_files(path: Path, manifest: dict) -> list[str]:
    """Every shard file, document-boundary and document-bytes array whose size is not what the
    manifest says, or that is missing (a stat, and 12 bytes of each .npy: cheap at every start)."""
    item = np.dtype(manifest["dtype"]).itemsize
    bad = []
    for split in ("train", "val"):
        for s in manifest["splits"][split]["shards"]:
            bad.append(_size_problem(path / s["file"], s["tokens"] * item))
            bad += [_npy_problem(path / s[k], s["documents"]) for k in ("docs", "doc_bytes") if k in s]
    return [b for b in bad if b]


def check_manifest(cfg: DataConfig, path: Path, manifest: dict, tok) -> None:
    """Refuse prepared data that no longer matches the config, the tokenizer or the source files,
    or whose files are not what the manifest says (a truncated or missing shard)."""
    why = manifest_problem(manifest)
    if why is not None:
        raise damaged(cfg.prepared_dir, path, f"{MANIFEST}: {why}")
    why = []
    if manifest.get("format") != FORMAT:
        why.append(f"format {manifest.get('format')!r}, expected {FORMAT!r}")
    old, new = manifest.get("data", {}), data_keys(cfg)
    why += [f"data.{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k)]
    # data.format=auto now reads .csv/.tsv by column: data prepared when they were read as text is stale
    tabular = [p for p, _, _ in manifest.get("fingerprint", []) if Path(p).suffix.lower() in (".csv", ".tsv")]
    as_text = any((manifest.get(s) or {}).get("format") == "text" for s in ("source", "val_source"))
    if cfg.format == "auto" and tabular and as_text:
        why.append(f"{tabular[0]} is now read as {EXT_FORMAT[Path(tabular[0]).suffix.lower()]}, was read as text")
    if manifest.get("tokenizer", {}).get("sha256") != tok.identity["sha256"]:
        why.append("the tokenizer file changed")
    if manifest.get("eos_id") != tok.eos_id or manifest.get("vocab_size") != tok.vocab_size:
        why.append("the tokenizer's EOS id or vocabulary size changed")
    old_fp = {p: (s, m) for p, s, m in manifest.get("fingerprint", [])}
    added = sorted(current_files(cfg) - set(old_fp))
    if added:  # a file added to a source directory or glob would never be trained on
        why.append(f"{added[0]} is new" + (f" (and {len(added) - 1} more)" if len(added) > 1 else ""))
    for p, (s, m) in old_fp.items():
        if not os.path.exists(p):
            why.append(f"{p} is gone")
        elif (os.path.getsize(p), os.stat(p).st_mtime_ns) != (s, m):
            why.append(f"{p} changed")
        if len(why) > 3:
            break
    if why:
        raise ConfigError("data.prepared_dir", cfg.prepared_dir,
                          f"{path} is stale ({'; '.join(why[:4])}); {REBUILD}; a run with checkpoints from the "
                          "old data will not resume on the rebuilt data")
    bad = damaged_files(path, manifest)
    if bad:
        more = f"; and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise damaged(cfg.prepared_dir, path, "; ".join(bad[:3]) + more)


@contextlib.contextmanager
def _lock(path: Path):
    """Exclusive lock on `<dir>.lock`: one process prepares, the others wait for it. The file holds
    the holder's pid and host and exists only while held: its holder deletes it on the way out,
    failed or not (a killed holder's file stays: harmless under flock, which the kernel released).
    Where the filesystem has no flock, the file's creation (O_EXCL) is the lock."""
    while True:
        try:
            fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL), True
        except FileExistsError:
            try:
                fd, created = os.open(path, os.O_RDWR), False
            except FileNotFoundError:
                continue  # its holder just deleted it
        try:
            flock(fd, LOCK_EX)
        except OSError as e:
            os.close(fd)
            if e.errno not in NO_FLOCK:
                raise
            yield from _exclusive_file_lock(path, created)
            return
        # The holder we waited for deleted the file; a newcomer may hold a new one at the same path
        # (and may delete it at any moment: no exists-then-stat).
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # while still holding it: a waiter on this file sees it gone and retries
        os.close(fd)


def _exclusive_file_lock(path: Path, created: bool):
    """The lock without flock: whoever creates the file holds it. A file naming a pid of this host
    that is no longer running is a killed holder's: taken over. Others are waited for."""
    told = False
    while not created:
        try:
            holder = path.read_text()
        except FileNotFoundError:
            holder = ""
        pid, _, host = holder.strip().partition(" ")
        if host == socket.gethostname() and pid.isdigit() and not alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                if path.read_text() == holder:  # still the dead holder's (narrows the race of two takers)
                    path.unlink()
        elif not told and holder:
            print(f"waiting for {path} (held by pid {pid} on {host or '?'}; delete it if that process is gone)",
                  file=sys.stderr, flush=True)
            told = True
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
            created = True
        except FileExistsError:
            time.sleep(0.2)
    path.write_text(f"{os.getpid()} {socket.gethostname()}\n")
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


# Every name a prepare writes into its directory (and its `.tmp`): anything else is a user's.
OURS = re.compile(rf"^((train|val)_\d{{5,}}\.(bin|docs\.npy|bytes\.npy)|{re.escape(MANIFEST)}|{re.escape(MARKER)}"
                  rf"|{re.escape(PROGRESS)}(\.new)?|val_hashes(\.new)?\.npy)$")


def _check_ours(path: Path) -> None:
    """A directory this module made (a prepare's marker or manifest is inside) holding nothing but
    what it writes (it is deleted whole), else ConfigError."""
    if not ((path / MARKER).is_file() or (path / MANIFEST).is_file()):
        raise ConfigError("data.prepared_dir", str(path.parent),
                          f"a directory mode can manage; {path} was not written by `mode data prepare`: move it away")
    foreign = sorted(p.name for p in path.iterdir() if not OURS.match(p.name))
    if foreign:
        raise ConfigError("data.prepared_dir", str(path.parent), f"a directory mode can manage; {path} holds "
                          f"{', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}, which `mode data prepare` "
                          "did not write (replacing the directory would delete it): move it away")


def _remove_ours(path: Path) -> None:
    """Delete a directory only if this module made it."""
    _check_ours(path)
    shutil.rmtree(path)


def check_place(cfg: DataConfig) -> None:
    """data.prepared_dir can be a directory: no file on its path (else ConfigError, nothing written)."""
    out = prepared_path(cfg)
    base = next(p for p in (out.parent, *out.parent.parents) if p.exists())
    if not base.is_dir():
        raise ConfigError("data.prepared_dir", cfg.prepared_dir, f"a directory path ({base} is a file)")
    from mode.rundir import RUN_PROOFS, check_outside_runs

    # the prepared directories would become foreign entries of a run, which then refuses to resume
    check_outside_runs(cfg.prepared_dir, "data.prepared_dir", proofs=RUN_PROOFS)


def prepare(cfg: DataConfig, force: bool = False, progress: bool = True) -> Path:
    """Prepare the data of `cfg` unless a matching manifest exists; returns the prepared directory.
    Safe to call from every rank at once: the first takes the lock and prepares, the rest wait."""
    tok = build_tokenizer(cfg)
    out = prepared_path(cfg)
    if not force:
        manifest = read_manifest(out, cfg)
        if manifest is not None:
            # Prepared already: no lock. A manifest exists only in a complete directory (it is renamed
            # into place whole), and every rank of a job comes here at start-up: through the lock they
            # would check the manifest one at a time.
            check_manifest(cfg, out, manifest, tok)
            return out
    import multiprocessing as mp

    if getattr(mp.current_process(), "_inheriting", False):  # multiprocessing's own flag: importing __main__
        # A tokenizer worker (spawned) runs the calling script again; without the guard it prepared
        # too and waited for the lock its parent holds while the parent waited for it: a hang.
        raise RuntimeError("a tokenizer worker ran the calling script again and reached its data prepare: put the "
                           "script's code under `if __name__ == \"__main__\":` (spawned workers import it)")
    check_place(cfg)
    from mode.rundir import parents_made

    with parents_made(out.parent, undo_on=(ConfigError,), key="data.prepared_dir", value=cfg.prepared_dir):  # bad
        # input: the directories made for it go too
        return _prepare_locked(cfg, tok, out, force, progress)


def _prepare_locked(cfg: DataConfig, tok, out: Path, force: bool, progress: bool) -> Path:
    with _lock(out.parent / f"{out.name}.lock"):
        try:
            manifest = read_manifest(out, cfg)
            if manifest is not None:
                check_manifest(cfg, out, manifest, tok)
        except ConfigError:  # stale or damaged (its manifest file makes the directory ours)
            if not force:
                raise
            _check_ours(out)  # replaced once the new one is complete: a bad row found mid-way keeps it
        else:
            if manifest is not None and not force:
                return out
            if manifest is not None:  # --force over current data: rebuilt all the same (keys outside the
                _check_ours(out)      # directory's name may differ: data.shard_tokens), then swapped in
            elif out.exists():
                raise ConfigError("data.prepared_dir", cfg.prepared_dir,
                                  f"a directory mode can manage; {out} exists without a manifest: move it away")
        tmp = out.parent / f"{out.name}.tmp"
        if tmp.exists() and not (tmp / MARKER).is_file():
            _remove_ours(tmp)  # refuses: not ours
        tmp.mkdir(exist_ok=True)  # a killed prepare's leftovers are resumed (or cleared) by _write_shards
        (tmp / MARKER).write_text(f"pid {os.getpid()}\n")
        try:
            try:
                manifest = _write_shards(cfg, tok, tmp, progress)
            except OSError as e:  # a shard's write names no file: name where they go (a full disk's place)
                e.filename = e.filename or str(tmp)
                raise
            f = tmp / MANIFEST
            f.write_text(json.dumps(manifest, indent=1))
            with open(f) as fh:
                os.fsync(fh.fileno())
            (tmp / MARKER).unlink()
            if out.exists():  # --force over a stale or damaged directory: swapped out, then deleted
                old = out.parent / f"{out.name}.old"
                if old.exists():
                    _remove_ours(old)
                os.rename(out, old)
                os.rename(tmp, out)
                _remove_ours(old)
            else:
                os.rename(tmp, out)  # atomic: the directory appears complete or not at all
        except ConfigError:
            shutil.rmtree(tmp, ignore_errors=True)  # bad input: nothing worth resuming
            raise
    return out


def progress_bar(desc: str, t0: float | None = None):
    """A tqdm bar on a terminal; in a log file (every cluster job) its carriage-return redraws
    would be all the log holds, so there one plain line a minute and one at the end. `t0`: when
    the work began (time.perf_counter): the bar opens at the first result, by which time the
    workers may have done most of it ("4.7M tokens in 0 s")."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(desc=desc, unit="tok", unit_scale=True, dynamic_ncols=True, file=sys.stderr)
        if t0 is not None:  # tqdm measures from start_t, on its own clock (time.time)
            bar.start_t -= time.perf_counter() - t0
        return bar
    return PlainProgress(desc, 60.0, t0)


class PlainProgress:
    """tqdm's update/close, printed as plain lines: `<desc>: N tokens in T s (R tokens/s)`."""

    def __init__(self, desc: str, every_s: float, t0: float | None = None):
        self.desc, self.every_s, self.n = desc, every_s, 0
        self.last = time.perf_counter()
        self.t0 = self.last if t0 is None else t0

    def update(self, n: int) -> None:
        self.n += n
        if time.perf_counter() - self.last >= self.every_s:
            self.last = time.perf_counter()
            self._line("")

    def close(self) -> None:
        self._line(", done")

    def _line(self, end: str) -> None:
        dt = time.perf_counter() - self.t0
        print(f"{self.desc}: {self.n:,} tokens in {dt:.0f} s ({self.n / max(dt, 1e-9):,.0f} tokens/s){end}",
              file=sys.stderr, flush=True)


def _write_shards(cfg: DataConfig, tok, tmp: Path, progress: bool) -> dict:
    """Tokenize into `tmp`. Whenever a shard completes, both splits' open shards are closed and
    progress.json records them with the source position, so a killed prepare resumes there."""
    t0 = time.perf_counter()
    val_docs = None
    if cfg.val_source:
        val_docs, val_desc, val_files = open_documents(cfg, "val_source")
    else:
        val_desc, val_files = None, []
    docs, desc, files = open_documents(cfg, "source", tuple(val_files))
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    key = {"data": data_keys(cfg), "tokenizer": tok.identity, "fingerprint": fingerprint(files + val_files)}
    st = _resume_state(tmp, key)
    train = ShardWriter(tmp, "train", dtype, cfg.shard_tokens, st and st["train"])
    val = ShardWriter(tmp, "val", dtype, cfg.shard_tokens, st and st["val"])
    resumed_tokens = train.tokens + val.tokens  # written by a killed prepare: not this process's rate
    phase, read, n, dup = (st["phase"], st["read"], st["n"], st["dup"]) if st else (
        "val" if val_docs is not None else "train", 0, 0, 0)
    seen = set(np.load(tmp / "val_hashes.npy").tolist()) if st and (tmp / "val_hashes.npy").is_file() else set()
    workers = cfg.num_workers or usable_cores()
    bar = None

    def save_hashes():  # whole or not at all: a kill mid-write must not leave a torn file
        np.save(tmp / "val_hashes.new.npy", np.array(sorted(seen), dtype=np.uint64))
        os.replace(tmp / "val_hashes.new.npy", tmp / "val_hashes.npy")

    def checkpoint(phase, read):
        train.close()
        val.close()
        if phase == "val":  # the hashes of the validation documents read so far, before progress says so:
            save_hashes()   # a resume must still keep every one of them out of training
        f = tmp / (PROGRESS + ".new")
        f.write_text(json.dumps({**key, "phase": phase, "read": read, "n": n, "dup": dup,
                                 "train": train.summary(), "val": val.summary()}))
        os.replace(f, tmp / PROGRESS)

    with encoder(tok, workers) as encode:
        def stream(it, skip):
            nonlocal bar
            for (r, done) in encode(itertools.islice(it, skip, None)):
                if progress and bar is None:  # opened at the first batch: a bad source prints only its error
                    bar = progress_bar(f"prepare {tmp.name.removesuffix('.tmp')}", t0)
                if bar is not None:
                    bar.update(len(r[0]))
                shards = len(train.shards) + len(val.shards)
                yield r
                if len(train.shards) + len(val.shards) > shards:
                    checkpoint(phase, skip + done)

        if phase == "val":
            for flat, lens, hashes, nbytes in stream(val_docs, read):
                val.add(flat, lens, nbytes)
                seen.update(hashes.tolist())
            save_hashes()
            phase, read = "train", 0
            checkpoint(phase, read)
        if val_docs is not None:
            for flat, lens, hashes, nbytes in stream(docs, read):
                keep = np.array([h not in seen for h in hashes.tolist()], dtype=bool)
                dup += int((~keep).sum())
                _split_add(train, flat, lens, keep, nbytes)
        else:
            for flat, lens, hashes, nbytes in stream(docs, read):
                is_val = val_mask(n, len(lens), cfg.val_fraction, cfg.split_seed)
                n += len(lens)
                _split_add(val, flat, lens, is_val, nbytes)
                _split_add(train, flat, lens, ~is_val, nbytes)
    train.close()
    val.close()
    if bar is not None:
        bar.close()
    _refuse_empty(cfg, train.tokens, val.tokens, train.documents)
    for f in (PROGRESS, "val_hashes.npy"):
        (tmp / f).unlink(missing_ok=True)
    dt = time.perf_counter() - t0
    return {"format": FORMAT, "created_by": "mode data prepare", "tokenizer": tok.identity,
            "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "dtype": np.dtype(dtype).name,
            "source": desc, "val_source": val_desc, "data": data_keys(cfg),
            "splits": {"train": train.summary(), "val": val.summary()},
            "train_documents_dropped_as_validation_duplicates": dup,
            "fingerprint": key["fingerprint"], "seconds": round(dt, 3), "resumed": bool(st),
            "tokens_per_s": round((train.tokens + val.tokens - resumed_tokens) / max(dt, 1e-9)), "workers": workers}


def data_identity(manifest: dict) -> dict:
    """What a checkpoint records of the tokens it was trained on: the tokenizer, and each split's
    token, document and byte counts (not its sharding, which may change, nor the source's paths and
    mtimes: a corpus moved or copied to another disk is the same data). A rebuild after an edit that
    keeps every count (a same-length edit with a byte tokenizer) goes unseen."""
    return {"tokenizer_sha256": manifest["tokenizer"]["sha256"],
            "splits": {k: {f: v.get(f) for f in ("tokens", "documents", "bytes")}
                       for k, v in sorted(manifest["splits"].items())}}


def data_change(old: dict, new: dict) -> str | None:
    """How the data a checkpoint recorded (data_identity) differs from `new`, or None."""
    if old == new:
        return None
    if old.get("tokenizer_sha256") != new["tokenizer_sha256"]:
        return "the tokenizer file changed"
    counts = [f"{k} {f} {v} -> {new['splits'].get(k, {}).get(f)}" for k, c in (old.get("splits") or {}).items()
              for f, v in c.items() if new["splits"].get(k, {}).get(f) != v]
    return "; ".join(counts) or "its splits changed"


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity (a SLURM allocation or `taskset` on a big
    node), not every core of the machine."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _refuse_empty(cfg: DataConfig, train_tokens: int, val_tokens: int, train_documents: int) -> None:
    if train_tokens == 0:
        held = "" if cfg.val_source or not val_tokens else (
            f"; every document went to validation (data.val_fraction={cfg.val_fraction}: a text file is one document "
            "with data.sample_by=document): set data.sample_by=paragraph or line, add documents, or set data.val_source")
        raise ConfigError("data.source", cfg.source, "a corpus with at least one non-empty training document" + held)
    if val_tokens == 0:
        if cfg.val_source:
            raise ConfigError("data.val_source", cfg.val_source, "a source with at least one non-empty document")
        raise ConfigError("data.val_fraction", cfg.val_fraction, f"a fraction that holds out at least one of the "
                          f"{train_documents} documents (or set data.val_source)")


def count_tokens(cfg: DataConfig, tok, enough: int) -> dict:
    """The checks of a prepare without its work (`mode train --print-config`): the sources are opened
    and read as a prepare reads them, but only until each split holds `enough` tokens, and nothing is
    written. Returns the tokens counted per split (the exact totals when a split has fewer)."""
    count = {"train": 0, "val": 0}
    documents = 0

    def take(split, texts):
        nonlocal documents
        for t in texts:
            if t.strip():  # as _batches: empty documents carry no text
                count[split] += len(tok.encode(t)) + 1
                documents += split == "train"
            if count[split] >= enough:
                return

    if cfg.val_source:  # (training documents that duplicate validation ones are not looked for here)
        val_docs, _, val_files = open_documents(cfg, "val_source")
        docs, _, _ = open_documents(cfg, "source", tuple(val_files))
        take("val", val_docs)
        take("train", docs)
    else:
        docs, _, _ = open_documents(cfg, "source")
        for i, t in enumerate(t for t in docs if t.strip()):  # numbered as prepare numbers documents
            split = "val" if val_mask(i, 1, cfg.val_fraction, cfg.split_seed)[0] else "train"
            take(split, [t])
            if min(count.values()) >= enough:
                break
    _refuse_empty(cfg, count["train"], count["val"], documents)
    return count


def _resume_state(tmp: Path, key: dict) -> dict | None:
    """The progress of a killed prepare of the same data into `tmp`, with every file it did not
    complete removed; None (and an empty `tmp`) when there is nothing to resume."""
    f = tmp / PROGRESS
    st = json.loads(f.read_text()) if f.is_file() else None
    if st is not None and any(st.get(k) != v for k, v in key.items()):
        st = None  # another config or changed source files: start over
    keep = {MARKER, PROGRESS} | ({"val_hashes.npy"} if st else set())  # (val phase too: the documents read so far)
    if st:
        keep |= {x[k] for sp in ("train", "val") for x in st[sp]["shards"] for k in ("file", "docs", "doc_bytes")
                 if k in x}
    for p in tmp.iterdir():
        if p.name not in keep:
            p.unlink()
    return st


def _split_add(w: ShardWriter, flat, lens, keep, nbytes) -> None:
    """Add the documents of a batch selected by `keep`."""
    if keep.all():
        w.add(flat, lens, nbytes)
    elif keep.any():
        w.add(flat[np.repeat(keep, lens)], lens[keep], nbytes[keep])

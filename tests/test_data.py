"""Prepared data: `datasets` sources -> memmap shards + manifest, the sampler, val_source, sample_by,
tokenizers, bits per byte, and every bad input stopping in one line before anything starts."""
import dataclasses
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import mode.prepare as prep
from mode.config import ConfigError, DataConfig, load_config
from mode.data import ByteTokenizer, DataModule, check_data, permute, stdlib_files
from tests.util import PY, ROOT, TINY, env, mode_cli, no_flock, orphan_semaphores, process_group, scalars

DOCS = [f"document number {i} " * (5 + i) for i in range(30)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    (d / "docs.jsonl").write_text("\n".join(json.dumps({"body": t}) for t in DOCS))
    (d / "txt").mkdir()
    for i, t in enumerate(DOCS):
        (d / "txt" / f"{i:02d}.txt").write_text(t)
    import datasets

    datasets.Dataset.from_dict({"text": DOCS}).to_parquet(str(d / "docs.parquet"))
    datasets.Dataset.from_dict({"id": list(range(len(DOCS))), "text": DOCS}).to_csv(str(d / "docs.csv"), index=False)
    datasets.Dataset.from_dict({"id": list(range(len(DOCS))), "text": DOCS}).to_csv(str(d / "docs.tsv"), index=False,
                                                                                   sep="\t")
    return d


def dcfg(tmp_path, **kw) -> DataConfig:
    kw.setdefault("num_workers", 1)  # in-process: the fast tier starts no process
    kw.setdefault("seq_len", 8)
    kw.setdefault("val_fraction", 0.2)
    return DataConfig(prepared_dir=str(tmp_path / "prepared"), **kw)


def documents(path: Path, split: str, tok=ByteTokenizer()) -> list[str]:
    """Decode a prepared split back into documents through the stored boundaries."""
    m = prep.read_manifest(path)
    out = []
    for s in m["splits"][split]["shards"]:
        toks = np.fromfile(path / s["file"], dtype=m["dtype"])
        ends = np.load(path / s["docs"])
        assert ends[-1] == len(toks) and (toks[ends - 1] == m["eos_id"]).all()  # EOS closes each document
        for a, b in zip(np.r_[0, ends[:-1]], ends):
            out.append(tok.decode(toks[a:b - 1].tolist()))
    return out


@pytest.mark.parametrize("fmt", ["jsonl", "txt", "parquet", "csv", "tsv"])
def test_local_formats_give_the_same_documents(corpus, tmp_path, fmt):
    # csv/tsv: was read as plain text (a .csv trained on its commas, quotes and ids)
    src = corpus / ("txt" if fmt == "txt" else f"docs.{fmt}")
    cfg = dcfg(tmp_path, source=str(src), text_key="body" if fmt == "jsonl" else "text")
    path = prep.prepare(cfg, progress=False)
    train, val = documents(path, "train"), documents(path, "val")
    assert sorted(train + val) == sorted(DOCS) and not set(train) & set(val)
    assert len(val) == 6  # exactly val_fraction of 30 documents
    m = prep.read_manifest(path)
    assert m["dtype"] == "uint16" and m["eos_id"] == 256 and m["vocab_size"] == 257
    assert m["splits"]["train"]["bytes"] == sum(len(t.encode()) for t in train)
    assert m["splits"]["val"]["tokens"] == sum(len(t.encode()) + 1 for t in val)
    assert m["data"]["source"] == str(src) and m["tokenizer"]["kind"] == "byte"
    # windows overlap by one token: every token after the first is a target exactly once
    dm = DataModule(cfg)
    w = dm.train.windows(range(dm.n_train), 8)
    assert torch.equal(w[1:, 0], w[:-1, -1]) and dm.n_train == (m["splits"]["train"]["tokens"] - 1) // 8


def test_csv_prepared_as_text_before_is_stale_and_csv_with_tsv_is_refused(corpus, tmp_path):
    """Data prepared from a .csv before csv sources were read by column (as plain text, under the
    same directory name) is refused as stale, not trained on; a .csv beside a .tsv is one line
    (one separator would misread the other file's rows as one column)."""
    from mode.data import open_prepared

    cfg = dcfg(tmp_path, source=str(corpus / "docs.csv"))
    path = prep.prepare(cfg, progress=False)
    m = prep.read_manifest(path)
    assert m["source"]["format"] == "csv"
    m["source"]["format"] = "text"  # as that earlier prepare wrote it
    (path / prep.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ConfigError, match=r"is stale \(.*docs.csv is now read as csv, was read as text"):
        open_prepared(cfg)
    assert prep.prepare(cfg, force=True, progress=False) == path  # --force rebuilds it
    open_prepared(cfg)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for ext in ("csv", "tsv"):
        shutil.copy(corpus / f"docs.{ext}", mixed / f"docs.{ext}")
    with pytest.raises(ConfigError, match=r"files of one format \(found csv, tsv\)"):
        prep.prepare(dcfg(tmp_path / "m", source=str(mixed)), progress=False)


def test_default_workers_are_the_cores_this_process_may_use(corpus, tmp_path, monkeypatch):
    """data.num_workers=0 on a big node where the job was given one core (SLURM's cpuset, taskset):
    one tokenizer process, not one per core of the machine."""
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    path = prep.prepare(dcfg(tmp_path, source=str(corpus / "docs.parquet"), num_workers=0), progress=False)
    assert prep.read_manifest(path)["workers"] == 1


def test_permutation_is_a_bijection_and_depends_on_the_seed():
    for n in (1, 2, 3, 7, 64, 1000, 4097):
        p = permute(np.arange(n), n, seed=5)
        assert sorted(p.tolist()) == list(range(n))
    a, b = permute(np.arange(1000), 1000, 1), permute(np.arange(1000), 1000, 2)
    assert not np.array_equal(a, b) and not np.array_equal(a, np.arange(1000))
    big = 635_000_000  # 1.3T tokens / 2048: per-index, no table of n entries
    idx = np.array([0, 1, 12345, big - 1])
    assert np.array_equal(permute(idx, big, 3), permute(idx, big, 3)) and (permute(idx, big, 3) < big).all()


def test_rank_shards_are_disjoint_and_make_the_global_batch(corpus, tmp_path):
    cfg = dcfg(tmp_path, source=str(corpus / "docs.parquet"))
    one = DataModule(cfg, 0, 1)
    ranks = [DataModule(cfg, r, 2) for r in range(2)]
    for step in range(3):
        for micro in range(2):
            glob, _ = one.train_batch(step, micro, 4, 2)
            parts = [dm.train_batch(step, micro, 2, 2)[0] for dm in ranks]
            assert torch.equal(torch.cat(parts), glob)
            rows = [set(dm.train_rows(step, micro, 2, 2).tolist()) for dm in ranks]
            assert not rows[0] & rows[1]
    # position is a pure function of the step: a restarted module continues identically
    assert torch.equal(DataModule(cfg, 1, 2).train_batch(5, 1, 2, 2)[0], ranks[1].train_batch(5, 1, 2, 2)[0])
    # evaluation too: the ranks' halves are the world-1 eval batches, each window read once
    for glob, *parts in zip(one.val_batches(3, 4), *(dm.val_batches(3, 2) for dm in ranks)):
        assert torch.equal(torch.cat([x for x, _ in parts]), glob[0])
        assert not torch.equal(parts[0][0], parts[1][0])


def test_each_epoch_reads_every_window_once_in_a_new_order(corpus, tmp_path):
    dm = DataModule(dcfg(tmp_path, source=str(corpus / "docs.parquet")))
    n = dm.n_train
    first = [int(dm.train_rows(s, 0, 1, 1)) for s in range(n)]
    second = [int(dm.train_rows(s, 0, 1, 1)) for s in range(n, 2 * n)]
    assert sorted(first) == sorted(second) == list(range(n)) and first != second


def test_windows_crossing_shards_equal_one_stream(corpus, tmp_path, monkeypatch):
    one = DataModule(dcfg(tmp_path / "a", source=str(corpus / "docs.parquet")))
    real = prep._batches
    monkeypatch.setattr(prep, "_batches", lambda docs: real(docs, max_docs=1))  # a shard per ~document
    many = DataModule(dcfg(tmp_path / "b", source=str(corpus / "docs.parquet"), shard_tokens=50))
    assert len(many.train.maps) > 10 and many.n_train == one.n_train
    rows = list(range(one.n_train))
    assert torch.equal(many.train.windows(rows, 8), one.train.windows(rows, 8))
    assert documents(many.path, "train") == documents(one.path, "train")


def test_more_shards_than_the_soft_open_file_limit(tmp_path, monkeypatch):
    """Each memory-mapped shard holds a file descriptor. Bug caught: a prepared corpus with more
    shards than the soft limit (1,024 is common; the 1.3T-token preset makes ~5,000) failed to
    open with `Too many open files`. The soft limit is raised within the hard one; past the hard
    one, one config error line."""
    import resource

    d = tmp_path / "c"
    d.mkdir()
    docs = [f"doc {i} " * 3 for i in range(150)]
    (d / "docs.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in docs))
    real = prep._batches
    monkeypatch.setattr(prep, "_batches", lambda docs: real(docs, max_docs=1))  # a shard per document
    cfg = dcfg(tmp_path, source=str(d / "docs.jsonl"), shard_tokens=1, val_fraction=0.1)
    path = prep.prepare(cfg, progress=False)
    m = prep.read_manifest(path)
    n_shards = len(m["splits"]["train"]["shards"]) + len(m["splits"]["val"]["shards"])
    assert n_shards == 150
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd"))
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 60, limits[1]))  # room for 60 more files
        dm = DataModule(cfg)
        w = dm.train.windows(range(dm.n_train), 8)
        assert len(w) == dm.n_train and resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= n_shards
        del dm, w
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)
    monkeypatch.setattr(resource, "getrlimit", lambda what: (100, 120))  # a hard limit below the shards
    with pytest.raises(ConfigError, match=r"^config error: data.shard_tokens=1: shards few enough to keep open: "
                                          r"this prepared data has 150 and the hard limit of open files is 120") as e:
        check_data(load_config(None, [f"data.source={d / 'docs.jsonl'}", f"data.prepared_dir={tmp_path / 'prepared'}",
                                      "data.shard_tokens=1", "data.val_fraction=0.1", "data.seq_len=8",
                                      "data.num_workers=1"]))
    # Bug caught: the advice (`mode data prepare --force`) found the data current and did nothing:
    # data.shard_tokens is not in the directory's name. The command it names now rebuilds it.
    shard_tokens = int(re.search(r"--force data.shard_tokens=(\d+)`$", str(e.value)).group(1))
    monkeypatch.setattr(prep, "_batches", real)
    assert prep.prepare(dataclasses.replace(cfg, shard_tokens=shard_tokens), force=True, progress=False) == path
    m = prep.read_manifest(path)
    assert [len(m["splits"][s]["shards"]) for s in ("train", "val")] == [1, 1]


@pytest.mark.parametrize("name", ["validation.txt", "test.jsonl", "validation-00000-of-00001.parquet",
                                  "wiki.valid.raw", "eval.txt", "heldout.txt"])
def test_a_held_out_file_in_the_source_needs_val_source(tmp_path, name):
    """Bug caught: a folder with train.txt and validation.txt was two documents, one drawn at random as
    the validation set: with split_seed 0, 1 or 2 the model trained on validation.txt. Refused in one
    line naming the key to set, before anything is written; a code file named test.py is not held out."""
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "train.txt").write_text("training text " * 50)
    if name.endswith(".parquet"):  # the hub's shard naming
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": ["held out"]}), d / name)
        (d / "train.txt").unlink()
        pq.write_table(pa.table({"text": ["training text"] * 5}), d / "train-00000-of-00001.parquet")
    else:
        (d / name).write_text(json.dumps({"text": "held out"}) if name.endswith(".jsonl") else "held out text " * 5)
    with pytest.raises(ConfigError, match=rf"^config error: data.val_source='': the held-out file in "
                                          rf"data.source={d}: set data.val_source={d / name} "):
        prep.prepare(dcfg(tmp_path, source=str(d)), progress=False)
    assert not (tmp_path / "prepared").exists() or not any((tmp_path / "prepared").iterdir())
    if name.endswith(".parquet"):
        return  # (the rest adds text files)
    (d / name).unlink()
    (d / "test.py").write_text("def test():\n    pass\n" * 20)
    (d / "foo_test.go").write_text("package foo\n" * 20)  # code, and titles that merely start with a split name
    (d / "Test_cricket.txt").write_text("a cricket match between nations " * 20)
    (d / "more.txt").write_text("more training text " * 50)
    path = prep.prepare(dcfg(tmp_path, source=str(d), val_fraction=0.5), progress=False)
    assert prep.read_manifest(path)["splits"]["val"]["documents"] >= 1


def test_a_second_held_out_file_beside_val_source_is_refused(tmp_path):
    """Bug caught: following the refusal's own advice for a folder of train.txt, validation.txt and
    test.txt (data.val_source=folder/test.txt) trained on validation.txt without a word: the
    held-out check was skipped whenever data.val_source was set."""
    d = tmp_path / "fold"
    d.mkdir()
    for name in ("train", "validation", "test"):
        (d / f"{name}.txt").write_text("\n\n".join(f"{name} paragraph {i} " * 8 for i in range(12)))
    with pytest.raises(ConfigError, match=r"^config error: data.val_source='': the held-out file in "
                                          rf"data.source={d}: set data.val_source={d / 'test.txt'} \(and 1 more\)"):
        prep.prepare(dcfg(tmp_path, source=str(d), sample_by="paragraph"), progress=False)
    with pytest.raises(ConfigError, match=rf"^config error: data.source='{d}': training files only; besides "
                                          rf"data.val_source={d / 'test.txt'} it holds the held-out file "
                                          rf"{d / 'validation.txt'}, which would be trained on"):
        prep.prepare(dcfg(tmp_path, source=str(d), val_source=str(d / "test.txt"), sample_by="paragraph"),
                     progress=False)
    assert not (tmp_path / "prepared").exists() or not any((tmp_path / "prepared").iterdir())
    path = prep.prepare(dcfg(tmp_path, source=str(d / "train.txt"), val_source=str(d / "test.txt"),
                             sample_by="paragraph"), progress=False)
    assert all(x.startswith("train") for x in documents(path, "train"))


def test_a_byte_order_mark_is_not_text_and_a_linked_val_source_is_the_source(tmp_path):
    """Bugs caught: a UTF-8 byte-order mark (Windows editors write one) stayed in the first
    document's tokens (bytes 239 187 191); a data.val_source that is a link to a file of data.source
    dropped every training document as a duplicate and then asked for "a corpus with at least one
    non-empty training document"."""
    d = tmp_path / "c"
    d.mkdir()
    (d / "a.txt").write_bytes("\ufeff".encode() + "\n\n".join(f"alpha {i} " * 6 for i in range(8)).encode())
    (d / "b.txt").write_text("\n\n".join(f"bravo {i} " * 6 for i in range(8)))
    path = prep.prepare(dcfg(tmp_path, source=str(d), sample_by="paragraph"), progress=False)
    docs = documents(path, "train") + documents(path, "val")
    assert "\ufeff" not in "".join(docs) and sum(x.startswith("alpha 0 ") for x in docs) == 1
    (tmp_path / "val.txt").symlink_to(d / "b.txt")
    with pytest.raises(ConfigError, match=r"data.source=.*files that are not also the validation source"):
        prep.prepare(dcfg(tmp_path, source=str(d / "b.txt"), val_source=str(tmp_path / "val.txt"),
                          sample_by="paragraph"), progress=False)
    path = prep.prepare(dcfg(tmp_path, source=str(d), val_source=str(tmp_path / "val.txt"), sample_by="paragraph"),
                        progress=False)
    assert all(x.startswith("alpha") for x in documents(path, "train"))


def test_a_held_out_file_reached_through_a_linked_directory_is_the_validation_source(tmp_path):
    """Bug caught: the checks without a prepare (`--print-config`, `mode compare`'s first pass, the
    dry runs) left val_source's files out of data.source by absolute path, the prepare by real path:
    through a linked directory (/scratch -> /lustre/...) a grid was refused ("besides
    data.val_source=.../validation.txt it holds the held-out file .../validation.txt") that
    `mode data prepare` then prepared. Both compare real paths now."""
    real = tmp_path / "real" / "ds"
    real.mkdir(parents=True)
    for name in ("train", "validation"):
        (real / f"{name}.txt").write_text("\n\n".join(f"{name} paragraph {i} " * 8 for i in range(12)))
    (tmp_path / "link").symlink_to(tmp_path / "real")
    ds = tmp_path / "link" / "ds"
    cfg = dcfg(tmp_path, source=str(ds), val_source=str(ds / "validation.txt"), sample_by="paragraph")
    counted = prep.count_tokens(cfg, ByteTokenizer(), 10 ** 9)  # exact totals: below `enough`
    path = prep.prepare(cfg, progress=False)
    assert all(x.startswith("train") for x in documents(path, "train"))
    assert all(x.startswith("validation") for x in documents(path, "val"))
    assert counted == {split: prep.read_manifest(path)["splits"][split]["tokens"] for split in ("train", "val")}


def test_a_validation_paragraph_is_never_trained_on_whatever_its_final_newline(tmp_path):
    """Bug caught: training documents equal to a validation document were dropped by a hash of the
    exact text, and a file's last paragraph keeps its final newline: a paragraph last in one file
    and inside the other was trained on. Compared without surrounding whitespace now."""
    a, b, c, e = ("alpha " * 30, "bravo " * 30, "charlie " * 30, "delta " * 30)
    (tmp_path / "train.txt").write_text(f"{a}\n\n{b}\n\n{c}\n")
    (tmp_path / "val.txt").write_text(f"{c}\n\n{e}\n")
    (tmp_path / "val2.txt").write_text(f"{e}\n\n{c}\n\n{a}")  # and the other way round: c last, a unterminated
    for val in ("val.txt", "val2.txt"):
        cfg = dcfg(tmp_path / f"prep-{val}", source=str(tmp_path / "train.txt"), val_source=str(tmp_path / val),
                   sample_by="paragraph")
        path = prep.prepare(cfg, progress=False)
        train = [x.strip() for x in documents(path, "train")]
        held = {x.strip() for x in documents(path, "val")}
        assert not held & set(train), (val, train)
        assert prep.read_manifest(path)["train_documents_dropped_as_validation_duplicates"] == 3 - len(train)


def test_a_prepared_dir_inside_the_source_folder_is_not_read_as_source(tmp_path):
    """Bug caught: with data.prepared_dir inside the data.source folder (data/prepared beside a corpus
    in data/), the first prepare read its own lock file as a training document, then found its data
    stale (manifest.json "new"), and `--force` refused the folder's mix of json and text files."""
    d = tmp_path / "data"
    d.mkdir()
    for name in ("a", "b"):
        (d / f"{name}.txt").write_text("\n\n".join(f"{name} paragraph {i} " * 8 for i in range(10)))
    cfg = DataConfig(source=str(d), sample_by="paragraph", prepared_dir=str(d / "prepared"), num_workers=1,
                     seq_len=8, val_fraction=0.2)
    path = prep.prepare(cfg, progress=False)
    m = prep.read_manifest(path)
    assert sorted(Path(f[0]).name for f in m["fingerprint"]) == ["a.txt", "b.txt"]
    assert all("paragraph" in x for x in documents(path, "train") + documents(path, "val"))
    prep.check_manifest(cfg, path, m, prep.build_tokenizer(cfg))  # current, not stale
    assert prep.prepare(cfg, progress=False) == path and prep.prepare(cfg, force=True, progress=False) == path
    for holder in (d, tmp_path):  # a prepared_dir at or above the source: refused before anything is written
        with pytest.raises(ConfigError, match=rf"^config error: data.prepared_dir='{holder}': a directory that does "
                                              rf"not hold data.source={d} "):
            prep.prepare(dataclasses.replace(cfg, prepared_dir=str(holder)), progress=False)


@pytest.mark.parametrize("held", ["validation", "test", "Valid"])
@pytest.mark.parametrize("glob_spec", [False, True])
def test_a_held_out_folder_in_the_source_needs_val_source(tmp_path, held, glob_spec):
    """Bug caught: only file names were looked at, so d/train/ + d/validation/ (or test/: aclImdb's
    layout) was one pool: the validation folder's documents were trained on and validation drawn from
    both. Refused in one line naming the folder to set as val_source; the same with a glob over the
    folders. A held-out name above the source (the user chose it) or on a code folder is not."""
    d = tmp_path / "corpus"
    for sub, text in (("train", "training text "), (held, "held out text ")):
        (d / sub).mkdir(parents=True)
        for i in range(3):
            (d / sub / f"part{i}.jsonl").write_text(json.dumps({"text": text * 20}) + "\n")
    spec = str(d / "*" / "*.jsonl") if glob_spec else str(d)
    with pytest.raises(ConfigError, match=rf"^config error: data.val_source='': the held-out folder in "
                                          rf"data.source={re.escape(spec)}: set data.val_source={d / held} "):
        prep.prepare(dcfg(tmp_path, source=spec), progress=False)
    path = prep.prepare(dcfg(tmp_path, source=spec, val_source=str(d / held)), progress=False)
    m = prep.read_manifest(path)
    assert m["splits"]["train"]["documents"] == 3 and m["splits"]["val"]["documents"] == 3
    # the user pointed at the held-out folder itself, or code sits in a test/ folder: nothing to refuse
    prep.prepare(dcfg(tmp_path, source=str(d / held), val_fraction=0.4), progress=False)
    code = tmp_path / "project"
    for f, text in (("src/a.txt", "training text " * 20), ("src/b.txt", "more text " * 20),
                    ("test/test_x.py", "def test():\n    pass\n" * 20)):
        (code / f).parent.mkdir(parents=True, exist_ok=True)
        (code / f).write_text(text)
    prep.prepare(dcfg(tmp_path, source=str(code), val_fraction=0.4), progress=False)


def test_prepared_dir_in_or_at_a_run_or_where_nothing_can_be_made_is_one_config_error(tmp_path):
    """Bugs caught: data.prepared_dir=RUN or RUN/checkpoints was accepted (only paths below RUN were
    looked at, and `mode data prepare` looked at none): its prepared directories became foreign
    entries of that run, which then refused to resume or start fresh ("which mode did not write").
    A prepared_dir under /proc was a FileNotFoundError traceback line, exit 1."""
    import dataclasses

    from tests.util import fake_run

    _, run = fake_run(tmp_path, "dense")
    before = sorted(run.rglob("*"))
    for place in (run, run / "checkpoints", run / "data"):
        with pytest.raises(ConfigError, match=rf"^config error: data.prepared_dir='{place}': a path outside the run "
                                              rf"directory {run}: "):
            prep.prepare(dataclasses.replace(dcfg(tmp_path), prepared_dir=str(place)), progress=False)
    assert sorted(run.rglob("*")) == before
    with pytest.raises(ConfigError, match=r"^config error: data.prepared_dir='/proc/mode-x/p': a place where a "
                                          r"directory can be made \(/proc/mode-x"):
        prep.prepare(dataclasses.replace(dcfg(tmp_path), prepared_dir="/proc/mode-x/p"), progress=False)


def test_val_source_is_never_trained_on(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    paras = [f"paragraph {i} " * 4 for i in range(40)]
    val = paras[:5] + ["held out only " * 3]
    (d / "train.txt").write_text("\n\n".join(paras))  # the first 5 paragraphs also appear in validation
    (d / "validation.txt").write_text("\n\n".join(val))
    cfg = dcfg(tmp_path, source=str(d), val_source=str(d / "validation.txt"), sample_by="paragraph")
    path = prep.prepare(cfg, progress=False)
    train_docs, val_docs = documents(path, "train"), documents(path, "val")
    assert sorted(val_docs) == sorted(val)  # validation.txt is not read as training data
    assert sorted(train_docs) == sorted(paras[5:])  # duplicates of validation documents are dropped
    assert prep.read_manifest(path)["train_documents_dropped_as_validation_duplicates"] == 5


@pytest.mark.parametrize("sample_by", ["document", "paragraph", "line"])
def test_sample_by_splits_text_as_the_datasets_text_builder(tmp_path, sample_by):
    d = tmp_path / "c"
    d.mkdir()
    texts = ["alpha one\nalpha two\n\nalpha three\n", "beta one\n\nbeta two\nbeta three\n\n\ngamma\n"]
    for i, t in enumerate(texts):
        (d / f"{i}.txt").write_text(t)
    path = prep.prepare(dcfg(tmp_path, source=str(d), sample_by=sample_by, val_fraction=0.5), progress=False)
    got = sorted(documents(path, "train") + documents(path, "val"))
    # by hand: a file; blocks between blank lines (datasets keeps the line breaks inside); lines
    want = {"document": texts,
            "paragraph": [p for t in texts for p in t.split("\n\n")],
            "line": [ln for t in texts for ln in t.splitlines()]}[sample_by]
    assert got == sorted(w for w in want if w.strip())


def _bpe(tmp_path, special=("[UNK]", "</s>"), vocab=300):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(DOCS + ["héllo wörld ☃ 日本"], trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=list(special), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    d = tmp_path / "tok"
    d.mkdir(exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    return d


def test_tokenizer_dir_file_and_eos(corpus, tmp_path):
    d = _bpe(tmp_path)
    for spec in (str(d), str(d / "tokenizer.json")):  # a directory or the file itself
        tok = prep.build_tokenizer(DataConfig(tokenizer=spec))
        assert tok.decode(tok.encode("document number 3")) == "document number 3"
        assert tok.eos_id == tok.tok.token_to_id("</s>")
    # token bytes add up to the UTF-8 length of any text, multi-byte characters split or not
    text = "héllo wörld ☃ 日本 document 7"
    assert int(tok.token_bytes()[tok.encode(text)].sum()) == len(text.encode("utf-8"))
    cfg = dcfg(tmp_path, source=str(corpus / "docs.parquet"), tokenizer=str(d))
    path = prep.prepare(cfg, progress=False)
    assert sorted(documents(path, "train", tok) + documents(path, "val", tok)) == sorted(DOCS)


VAL_DOCS = ["hello world, this is the first held out document", " a document that starts with a space",
            "héllo wörld again, with accents", "the last document of the validation source"]


def _metaspace(tmp_path):
    """A SentencePiece-style tokenizer: Metaspace prepends `▁` to every document (a space its text lacks)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    tok.decoder = decoders.Metaspace(prepend_scheme="always")
    tok.train_from_iterator(DOCS + VAL_DOCS, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"]))
    d = tmp_path / "sp"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    return d, tok


def test_val_bytes_are_the_evaluated_texts_utf8_bytes_with_a_prepending_tokenizer(tmp_path, monkeypatch, capsys):
    """eval/bpb's denominator: each evaluation window's UTF-8 bytes equal those of the text its targets
    cover, by the tokenizer's own offsets (float-free, per window). The token table alone counts the
    prepended `▁` of each document as a byte: that over-count must not reach eval/bpb."""
    tok_dir, hf = _metaspace(tmp_path)
    (tmp_path / "val.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in VAL_DOCS))
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in DOCS))
    S = 5
    cfg = dcfg(tmp_path, source=str(tmp_path / "train.jsonl"), val_source=str(tmp_path / "val.jsonl"),
               tokenizer=str(tok_dir), seq_len=S, shard_tokens=16)
    batches = prep._batches
    monkeypatch.setattr(prep, "_batches", lambda docs: batches(docs, max_docs=1))  # several val shards
    path = prep.prepare(cfg, progress=False)
    dm = DataModule(cfg)
    # independent reference: a token covers the text from the previous token's end to its own end
    # (offsets are characters; a prepended `▁` covers none), EOS covers what no token did
    stream, ref = [], []
    for text in VAL_DOCS:
        enc = hf.encode(text, add_special_tokens=False)
        byte_at = np.cumsum([0] + [len(c.encode()) for c in text])
        ends = np.maximum.accumulate([e for _, e in enc.offsets])
        covered = byte_at[np.r_[0, ends]]
        stream += enc.ids + [dm.tokenizer.eos_id]
        ref += np.diff(covered).tolist() + [len(text.encode()) - covered[-1]]
    assert np.array_equal(dm.val.read(0, dm.val.n_tokens), stream)
    assert len(dm.val.shards) > 1 and sum(ref) == sum(len(t.encode()) for t in VAL_DOCS)
    ref = np.array(ref)
    window = [int(ref[w * S + 1:w * S + S + 1].sum()) for w in range(dm.n_val)]
    assert [dm.val_bytes(k, 1) for k in range(1, dm.n_val + 1)] == np.cumsum(window).tolist()
    assert dm.val_bytes(2, dm.n_val) == 2 * sum(window)  # windows evaluated twice count twice
    table = sum(int(dm.token_bytes_V[dm.val.read(w * S + 1, S)].sum()) for w in range(dm.n_val))
    assert table > sum(window)  # the table alone over-counts: the check above would catch that
    # data prepared before per-document bytes were kept: the table, and a note that says so
    m = prep.read_manifest(path)
    for shard in m["splits"]["val"]["shards"]:
        del shard["doc_bytes"]
    (path / prep.MANIFEST).write_text(json.dumps(m))
    assert DataModule(cfg).val_bytes(1, dm.n_val) == table and "mode data prepare --force" in capsys.readouterr().err


def test_tokenizer_without_eos_must_be_given_one(tmp_path):
    d = _bpe(tmp_path, special=("[UNK]",))
    with pytest.raises(ConfigError, match=r"data.eos_token='': the end-of-document token"):
        prep.build_tokenizer(DataConfig(tokenizer=str(d)))
    with pytest.raises(ConfigError, match=r"data.eos_token='<nope>': a token of"):
        prep.build_tokenizer(DataConfig(tokenizer=str(d), eos_token="<nope>"))
    tok = prep.build_tokenizer(DataConfig(tokenizer=str(d), eos_token="[UNK]"))
    assert tok.eos_id == tok.tok.token_to_id("[UNK]") < tok.vocab_size  # never a new id


def test_hub_tokenizer_from_the_local_cache(tmp_path, monkeypatch):
    """A hub name resolves through the offline cache layout (models--org--name/snapshots/REV/)."""
    src = _bpe(tmp_path) / "tokenizer.json"
    snap = tmp_path / "hf" / "models--someorg--tiny-bpe" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "tokenizer.json").write_bytes(src.read_bytes())
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text("abc123")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hf"))
    tok = prep.build_tokenizer(DataConfig(tokenizer="someorg/tiny-bpe"))
    assert tok.identity["name"] == "someorg/tiny-bpe" and tok.eos_id == tok.tok.token_to_id("</s>")
    with pytest.raises(ConfigError, match="data.tokenizer='someorg/absent': a hub tokenizer present in the local"):
        prep.build_tokenizer(DataConfig(tokenizer="someorg/absent"))


def test_force_keeps_the_old_prepared_data_until_the_new_is_complete(tmp_path):
    """Bug caught: `mode data prepare --force` deleted the stale directory first, then met a bad row
    in the changed source: the error left no prepared data at all (hours to rebuild at scale)."""
    src = tmp_path / "docs.jsonl"
    rows = [{"text": f"document number {i} " * 20} for i in range(40)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, [f"data.source={src}", f"data.prepared_dir={tmp_path / 'p'}", "data.num_workers=1",
                             "data.seq_len=16"])
    path = check_data(cfg)
    before = sorted((f.name, f.stat().st_size) for f in path.iterdir())
    src.write_text(src.read_text() + json.dumps({"text": None}) + "\n")
    with pytest.raises(ConfigError, match="a column of strings in every row"):
        prep.prepare(cfg.data, force=True, progress=False)
    assert sorted((f.name, f.stat().st_size) for f in path.iterdir()) == before  # the old data, whole
    src.write_text("".join(json.dumps(r) + "\n" for r in rows + rows[:5]))
    assert prep.prepare(cfg.data, force=True, progress=False) == path
    check_data(cfg)
    assert sorted(q.name for q in path.parent.iterdir() if not q.name.endswith(".lock")) == [path.name]


def test_a_bad_row_leaves_no_prepared_directories_behind(tmp_path):
    """Bug caught: a source with a bad row deep inside (found mid-prepare) was refused, but the
    data.prepared_dir it had made (and its parents) stayed behind, empty."""
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " * 30 if i != 30 else None}) + "\n" for i in range(40)))
    (tmp_path / "keep").mkdir()  # an existing parent is not the prepare's to remove
    cfg = load_config(None, [f"data.source={src}", f"data.prepared_dir={tmp_path / 'keep' / 'a' / 'p'}",
                             "data.num_workers=1", "data.seq_len=16"])
    with pytest.raises(ConfigError, match=r"row 31 of"):
        check_data(cfg)
    assert list((tmp_path / "keep").iterdir()) == []


def test_a_read_error_mid_prepare_is_a_runtime_fault_not_bad_input():
    """Bug caught: an I/O error reading a local source (EIO, a stale NFS handle) was turned into a
    config error, and the prepare deleted its resumable progress as if the data were bad. A parse
    error stays bad input (one config error line)."""
    import errno

    def rows(exc):
        yield {"text": "a document"}
        raise exc

    with pytest.raises(OSError) as e:
        list(prep._local_rows(rows(OSError(errno.EIO, "Input/output error")), "data.source", "x.jsonl"))
    assert e.value.errno == errno.EIO and not isinstance(e.value, ConfigError)
    with pytest.raises(ConfigError, match="readable documents"):
        list(prep._local_rows(rows(ValueError("JSON parse error")), "data.source", "x.jsonl"))
    with pytest.raises(ConfigError, match="readable documents"):  # pyarrow's corrupt-file OSError: no errno
        list(prep._local_rows(rows(OSError("Couldn't deserialize thrift")), "data.source", "x.parquet"))


def test_stale_manifest_is_refused_and_force_rebuilds(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    (d / "a.txt").write_text("first document " * 40)
    (d / "b.txt").write_text("second document " * 40)
    cfg = load_config(None, [f"data.source={d}", f"data.prepared_dir={tmp_path / 'p'}", "data.num_workers=1",
                             "data.seq_len=16", "data.val_fraction=0.5"])
    path = check_data(cfg)
    os.utime(d / "a.txt", ns=(1, 1))  # the source changed after it was prepared
    with pytest.raises(ConfigError) as e:
        check_data(cfg)
    assert "is stale" in str(e.value) and "a.txt changed" in str(e.value) and "--force" in str(e.value)
    assert prep.prepare(cfg.data, force=True, progress=False) == path
    check_data(cfg)
    # Bug caught: a file added to a source directory was never trained on, and nothing said so
    (d / "c.txt").write_text("third document " * 40)
    with pytest.raises(ConfigError, match=r"is stale \(.*c.txt is new\)"):
        check_data(cfg)
    (d / "c.txt").unlink()
    check_data(cfg)
    # a manifest that names other data keys (copied by hand) is refused too
    m = json.loads((path / "manifest.json").read_text())
    m["data"]["split_seed"] = 7
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ConfigError, match=r"data.split_seed: 7 -> 1234"):
        check_data(cfg)


def test_force_never_deletes_a_users_file_inside_a_prepared_directory(tmp_path):
    """Bug caught: `--force` over a stale prepared directory removed it whole (rmtree), so a user's
    notes or a run directory put inside it went too, although the error asking for --force says it
    "replaces only that directory". Now refused in one line before any work, the files kept."""
    d = tmp_path / "c"
    d.mkdir()
    (d / "a.txt").write_text("first document " * 40)
    (d / "b.txt").write_text("second document " * 40)
    cfg = dcfg(tmp_path, source=str(d), seq_len=16, val_fraction=0.5)
    path = prep.prepare(cfg, progress=False)
    (path / "NOTES.txt").write_text("mine")
    (path / "run").mkdir()
    (path / "run" / "config.yaml").write_text("mine too")
    before = sorted(p.relative_to(path) for p in path.rglob("*"))
    for stale in (False, True):  # --force rebuilds current data too (another data.shard_tokens)
        if stale:
            os.utime(d / "a.txt", ns=(1, 1))
        with pytest.raises(ConfigError, match=r"holds NOTES.txt, run, which `mode data prepare` did not write"):
            prep.prepare(cfg, force=True, progress=False)
        assert sorted(p.relative_to(path) for p in path.rglob("*")) == before
    assert not list(path.parent.glob("*.tmp")) and not list(path.parent.glob("*.old"))
    (path / "NOTES.txt").unlink()
    shutil.rmtree(path / "run")
    assert prep.prepare(cfg, force=True, progress=False) == path  # moved away: --force rebuilds it


def test_a_prepare_killed_while_reading_validation_still_keeps_it_out_of_training(tmp_path, monkeypatch):
    """Bug caught: the validation documents' hashes were saved only when the validation phase ended,
    so a prepare killed after a validation shard and resumed forgot them: training documents equal
    to those validation documents were trained on (3,929 of 6,898 in the audit's corpus)."""
    d = tmp_path / "c"
    d.mkdir()
    val_lines = [f"validation line number {i} " * 3 for i in range(40)]
    (d / "heldout.txt").write_text("\n".join(val_lines) + "\n")
    (d / "train.txt").write_text("\n".join(val_lines + [f"training line {i} " * 3 for i in range(40)]) + "\n")
    kw = dict(source=str(d / "train.txt"), val_source=str(d / "heldout.txt"), sample_by="line", shard_tokens=300)
    real = prep._batches
    monkeypatch.setattr(prep, "_batches", lambda docs: real(docs, max_docs=2))
    clean = prep.prepare(dcfg(tmp_path / "clean", **kw), progress=False)
    cfg = dcfg(tmp_path / "p", **kw)
    out = prep.prepared_path(cfg)
    tmp = out.parent / f"{out.name}.tmp"
    add = prep.ShardWriter.add

    def dies_in_validation(self, *a):  # killed once a validation shard is recorded as done
        f = tmp / "progress.json"
        if f.is_file() and json.loads(f.read_text())["phase"] == "val" and json.loads(f.read_text())["val"]["shards"]:
            raise KeyboardInterrupt
        return add(self, *a)

    monkeypatch.setattr(prep.ShardWriter, "add", dies_in_validation)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(cfg, progress=False)
    monkeypatch.setattr(prep.ShardWriter, "add", add)
    assert prep.prepare(cfg, progress=False) == out
    train, val = documents(out, "train"), documents(out, "val")
    assert sorted(val) == sorted(val_lines) and not set(train) & set(val)
    assert prep.read_manifest(out)["splits"] == prep.read_manifest(clean)["splits"]


def test_token_ids_past_the_vocabulary_count_are_not_wrapped(tmp_path):
    """Bug caught: a tokenizer whose ids have holes (4 tokens, one of them id 65539) counted a
    vocabulary of 4: its shards were uint16 and id 65539 was stored as 3."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel({"</s>": 0, "<unk>": 1, "alpha": 2, "beta": 65539}, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    hf = prep.build_tokenizer(DataConfig(tokenizer=str(tmp_path / "tok")))
    assert hf.vocab_size == 65540 and hf.encode("alpha beta").tolist() == [2, 65539]
    (tmp_path / "c").mkdir()
    for i in range(4):
        (tmp_path / "c" / f"{i}.txt").write_text("alpha beta " * (i + 2))
    path = prep.prepare(dcfg(tmp_path, source=str(tmp_path / "c"), tokenizer=str(tmp_path / "tok"),
                             val_fraction=0.25), progress=False)
    m = prep.read_manifest(path)
    assert m["dtype"] == "uint32"
    toks = np.concatenate([np.fromfile(path / s["file"], dtype=m["dtype"]) for s in m["splits"]["train"]["shards"]])
    assert 65539 in toks.tolist() and 3 not in toks.tolist()


def test_leftovers_of_a_killed_prepare_are_replaced(corpus, tmp_path):
    cfg = dcfg(tmp_path, source=str(corpus / "docs.parquet"))
    out = prep.prepared_path(cfg)
    tmp = out.parent / f"{out.name}.tmp"
    tmp.mkdir(parents=True)
    (tmp / prep.MARKER).write_text("pid 1\n")
    (tmp / "train_00000.bin").write_bytes(b"\1\2\3")  # a partial shard
    assert prep.prepare(cfg, progress=False) == out and not tmp.exists()
    assert sorted(documents(out, "train") + documents(out, "val")) == sorted(DOCS)
    # a directory that mode did not write is never deleted
    (out.parent / "x.tmp").mkdir()
    with pytest.raises(ConfigError, match="was not written by"):
        prep._remove_ours(out.parent / "x.tmp")


@pytest.mark.parametrize("val", ["fraction", "val_source"])
def test_interrupted_prepare_resumes_after_its_last_complete_shard(corpus, tmp_path, monkeypatch, val):
    extra = {"val_source": str(corpus / "txt" / "0[0-4].txt")} if val == "val_source" else {}
    real = prep._batches
    monkeypatch.setattr(prep, "_batches", lambda docs: real(docs, max_docs=2))
    clean = prep.prepare(dcfg(tmp_path / "clean", source=str(corpus / "txt"), shard_tokens=100, **extra),
                         progress=False)
    cfg = dcfg(tmp_path / "p", source=str(corpus / "txt"), shard_tokens=100, **extra)
    add, calls = prep.ShardWriter.add, []

    def dies(self, *a):
        calls.append(1)
        if len(calls) == 12:
            raise KeyboardInterrupt  # killed mid-way
        return add(self, *a)

    monkeypatch.setattr(prep.ShardWriter, "add", dies)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(cfg, progress=False)
    monkeypatch.setattr(prep.ShardWriter, "add", add)
    out = prep.prepared_path(cfg)
    tmp = out.parent / f"{out.name}.tmp"
    progress = json.loads((tmp / "progress.json").read_text())
    assert not out.exists() and progress["train"]["shards"] and progress["read"] > 0
    first = (tmp / "train_00000.bin").stat().st_ino
    clock = iter(range(10**6))  # whole seconds: the manifest's rate and time are exact
    with monkeypatch.context() as mp:
        mp.setattr(prep.time, "perf_counter", lambda: float(next(clock)))
        assert prep.prepare(cfg, progress=False) == out and not tmp.exists()
    m, mc = prep.read_manifest(out), prep.read_manifest(clean)
    assert m["resumed"] and m["splits"] == mc["splits"] and (out / "train_00000.bin").stat().st_ino == first
    # the rate is this process's: tokens the killed prepare wrote are not divided by its time (bug: they were)
    total, before = (sum(x[k]["tokens"] for k in ("train", "val")) for x in (m["splits"], progress))
    assert 0 < before < total and m["tokens_per_s"] == round((total - before) / m["seconds"]), (m, before)
    for f in sorted(clean.glob("*.bin")) + sorted(clean.glob("*.npy")):
        assert f.read_bytes() == (out / f.name).read_bytes(), f.name
    assert not (set(documents(out, "train")) & set(documents(out, "val")))


@pytest.mark.parametrize("fs", ["flock", "no_flock"])
def test_concurrent_prepares_build_once_and_the_others_wait(corpus, tmp_path, monkeypatch, fs):
    """Every rank calls prepare at start-up: the lock lets one build, the others get its result
    (also where flock is not supported and the lock file's creation is the lock)."""
    import threading

    if fs == "no_flock":
        no_flock(monkeypatch, prep)

    calls, real = [], prep._write_shards

    def counted(*a, **kw):
        calls.append(1)
        time.sleep(0.5)  # the others arrive while it works
        return real(*a, **kw)

    monkeypatch.setattr(prep, "_write_shards", counted)
    cfg = dcfg(tmp_path, source=str(corpus / "docs.parquet"))
    out, errors = [], []

    def rank():
        try:
            out.append(prep.prepare(cfg, progress=False))
        except Exception as e:  # noqa: BLE001 - reported below: a waiter must never fail
            errors.append(repr(e))

    # Bug caught: a waiter that got the lock of a file its holder had replaced stat()ed the path
    # after checking it exists, while the new holder could delete it in between (FileNotFoundError).
    threads = [threading.Thread(target=rank) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(calls) == 1 and len(out) == 5 and len(set(out)) == 1 and prep.read_manifest(out[0])
    assert not list(out[0].parent.glob("*.lock"))


def test_prepared_data_is_opened_without_waiting_for_the_lock(corpus, tmp_path):
    """Every rank opens the prepared data at start-up. Bug caught: each took the exclusive lock to
    read and check the manifest, so a job's ranks queued behind one another (and behind any
    prepare of the same directory): start-up grew with the number of ranks."""
    import fcntl
    import threading

    cfg = dcfg(tmp_path, source=str(corpus / "docs.parquet"))
    out = prep.prepare(cfg, progress=False)
    lock = out.parent / f"{out.name}.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another process holds the lock (e.g. a `--force` rebuild waiting to start)
    got = []
    t = threading.Thread(target=lambda: got.append(prep.prepare(cfg, progress=False)), daemon=True)
    try:
        t.start()
        t.join(10)
        assert got == [out], "opening prepared data waited for the lock"
    finally:
        os.unlink(lock)  # as a holder leaves it: a waiter sees its file gone and returns
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        t.join(30)
    # a stale directory is still refused, and --force still rebuilds it under the lock
    m = prep.read_manifest(out)
    m["data"]["split_seed"] = 7
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ConfigError, match="is stale"):
        prep.prepare(cfg, progress=False)
    assert prep.prepare(cfg, force=True, progress=False) == out and prep.read_manifest(out)["data"]["split_seed"] == 1234


def _repo(tmp_path) -> tuple[Path, dict]:
    """A local dataset repository laid out as on the hub: two configs, each with its own files and
    train/validation splits, listed in README.md's YAML header (what `load_dataset(dir, name=)` reads)."""
    d = tmp_path / "repo"
    docs = {c: {sp: [f"{c} {sp} document {i} " * (3 + i) for i in range(n)]
                for sp, n in (("train", 12), ("validation", 3))} for c in ("alpha", "beta")}
    for c, splits in docs.items():
        (d / c).mkdir(parents=True)
        for sp, texts in splits.items():
            (d / c / f"{sp}.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts))
    (d / "README.md").write_text("---\nconfigs:\n" + "".join(
        f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train.jsonl\n"
        f"  - split: validation\n    path: {c}/validation.jsonl\n" for c in docs) + "---\n# two configs\n")
    return d, docs


def test_hub_config_picks_the_configuration(tmp_path):
    """data.hub_config goes to `load_dataset(..., name=)`: each config's own documents are written,
    into a directory of their own (it is a data key), and a hub split as val_source reads that config."""
    d, docs = _repo(tmp_path)
    paths = {}
    for c in ("alpha", "beta"):
        cfg = dcfg(tmp_path, source=str(d), hub_config=c, val_source="validation")
        paths[c] = prep.prepare(cfg, progress=False)
        assert sorted(documents(paths[c], "train")) == sorted(docs[c]["train"])
        assert sorted(documents(paths[c], "val")) == sorted(docs[c]["validation"])
        m = prep.read_manifest(paths[c])
        assert m["data"]["hub_config"] == c and m["source"]["config"] == c
    assert paths["alpha"] != paths["beta"]
    with pytest.raises(ConfigError, match=r"^config error: data.hub_config='gamma': a config of .*'alpha', 'beta'"):
        prep.prepare(dcfg(tmp_path, source=str(d), hub_config="gamma"), progress=False)
    with pytest.raises(ConfigError, match=r"^config error: data.hub_config='': a config of .*missing"):
        prep.prepare(dcfg(tmp_path, source=str(d)), progress=False)  # several configs: one must be named
    with pytest.raises(ConfigError, match=r"^config error: data.hub_config='en': empty for local files"):
        prep.prepare(dcfg(tmp_path, source=str(d / "alpha"), hub_config="en"), progress=False)
    # the training split as val_source (bug caught: "a corpus with at least one non-empty training document")
    with pytest.raises(ConfigError, match=r"^config error: data.val_source='validation': a split other than "
                                          r"data.hub_split='validation' \(the validation documents are never trained"):
        prep.prepare(dcfg(tmp_path, source=str(d), hub_config="alpha", hub_split="validation",
                          val_source="validation"), progress=False)


def test_hub_config_is_part_of_the_prepared_data_identity(tmp_path):
    """Two configs differing only in hub_config never share a prepared directory, and a manifest
    written without it is refused with it (copied by hand into the other's place)."""
    plain = dcfg(tmp_path, source="allenai/c4")
    en, de = (dcfg(tmp_path, source="allenai/c4", hub_config=c) for c in ("en", "de"))
    assert len({prep.prepared_path(c) for c in (plain, en, de)}) == 3
    assert prep.data_keys(en)["hub_config"] == "en" and "hub_config" not in prep.data_keys(plain)
    d = tmp_path / "c"
    d.mkdir()
    (d / "a.txt").write_text("some document " * 30)
    (d / "b.txt").write_text("another document " * 30)
    made = prep.prepare(dcfg(tmp_path, source=str(d), val_fraction=0.5), progress=False)
    m = prep.read_manifest(made)
    with pytest.raises(ConfigError, match=r"is stale \(data.hub_config: None -> 'en'"):
        prep.check_manifest(dcfg(tmp_path, source=str(d), val_fraction=0.5, hub_config="en"), made, m,
                            ByteTokenizer())


def test_unreachable_hub_name_with_a_config_is_one_line_naming_the_source(tmp_path, monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # unreachable, without waiting
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    for split in ("", "validation"):
        cfg = dcfg(tmp_path, source="no-such-org-zz/no-such-dataset", hub_config="en", val_source=split)
        with pytest.raises(ConfigError) as e:
            prep.prepare(cfg, progress=False)
        line = str(e.value)
        assert "\n" not in line and line.startswith("config error: data.source='no-such-org-zz/no-such-dataset': ")
    assert not (tmp_path / "prepared").exists()  # nothing left: the lock file, and the directories it made


@pytest.mark.parametrize("fs", ["flock", "no_flock"])
def test_a_failed_prepare_leaves_no_lock_file(tmp_path, monkeypatch, fs):
    if fs == "no_flock":
        no_flock(monkeypatch, prep)
    d = tmp_path / "c"
    d.mkdir()
    (d / "docs.jsonl").write_text(json.dumps({"body": "x"}))
    with pytest.raises(ConfigError, match="data.text_key"):
        prep.prepare(dcfg(tmp_path, source=str(d / "docs.jsonl")), progress=False)
    assert not (tmp_path / "prepared").exists()
    # and a lock file left by an older version (a previous success) is used, then removed
    cfg = dcfg(tmp_path, source=str(d / "docs.jsonl"), text_key="body", val_fraction=0.5)
    lock = prep.prepared_path(cfg).parent / f"{prep.prepared_path(cfg).name}.lock"
    if fs == "flock":
        lock.parent.mkdir(parents=True)  # an existing directory is kept (emptied of the lock)
        lock.write_text("")
    with pytest.raises(ConfigError, match="at least one"):  # one document: not enough for two splits
        prep.prepare(cfg, progress=False)
    assert not lock.exists() and (list((tmp_path / "prepared").iterdir()) == [] if fs == "flock"
                                  else not (tmp_path / "prepared").exists())


def test_without_flock_a_lock_file_of_a_dead_process_is_taken_over_and_a_live_one_waited_for(
        corpus, tmp_path, monkeypatch):
    import socket
    import threading

    no_flock(monkeypatch, prep)
    cfg = dcfg(tmp_path, source=str(corpus / "docs.parquet"))
    out = prep.prepared_path(cfg)
    lock = out.parent / f"{out.name}.lock"
    out.parent.mkdir(parents=True)
    dead = int(Path("/proc/sys/kernel/pid_max").read_text())  # pids are below pid_max: none runs as it
    lock.write_text(f"{dead} {socket.gethostname()}\n")
    assert prep.prepare(cfg, progress=False) == out and not lock.exists()
    # a live holder (this process, as another prepare would be) is waited for
    cfg2 = dcfg(tmp_path, source=str(corpus / "docs.parquet"), split_seed=5)
    out2 = prep.prepared_path(cfg2)
    lock2 = out2.parent / f"{out2.name}.lock"
    lock2.write_text(f"{os.getpid()} {socket.gethostname()}\n")
    t = threading.Thread(target=prep.prepare, args=(cfg2,), kwargs={"progress": False})
    t.start()
    time.sleep(1.0)
    assert t.is_alive() and not out2.exists()
    lock2.unlink()  # the holder finishes
    t.join(30)
    assert not t.is_alive() and prep.read_manifest(out2) and not lock2.exists()


def test_embedded_default_corpus_exists(tmp_path):
    files = stdlib_files()
    assert len(files) > 50 and any(f.endswith("os.py") for f in files)
    dm = DataModule(dcfg(tmp_path, max_documents=10, seq_len=64, val_fraction=0.2))
    assert dm.n_train > 100 and ByteTokenizer().decode(dm.train.windows([0], 64)[0].tolist())


# ----------------------------------------------------------------------------------------------
# Damaged prepared data: the manifest says what every file holds; a file or a manifest that is not
# that is one `config error:` line (rebuild with --force) at every open, --print-config included.


def _several_shards(corpus, tmp_path, monkeypatch):
    """(the tiny training arguments, their config) over the corpus in several shards per split."""
    real = prep._batches
    monkeypatch.setattr(prep, "_batches", lambda docs: real(docs, max_docs=2))  # a shard per ~200 tokens
    common = ["--config", str(ROOT / "configs/tiny/dense.yaml"), *TINY, f"data.source={corpus / 'docs.parquet'}",
              f"data.prepared_dir={tmp_path / 'p'}", "data.num_workers=1", "data.max_documents=0",
              "data.shard_tokens=200", "data.seq_len=16"]
    return common, load_config(common[1], common[2:])


def _one_config_line(main, argv, capsys) -> str:
    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("config error: data.prepared_dir=") and not out, err
    return lines[0]


def test_a_cut_or_missing_shard_file_is_one_config_error_and_force_rebuilds_it(corpus, tmp_path, monkeypatch,
                                                                                capsys):
    """Bug caught: a split's token counts came from its shard files' sizes, not from the manifest:
    the audit cut `train_00000.bin` from 8.8 MB to 100 KB and training ran and exited 0 on ~1% of
    the corpus. Every shard, document-boundary and document-bytes file is compared with the manifest
    when prepared data is opened (training, `--print-config`, `mode data prepare`)."""
    from mode.data import TokenSplit
    from mode.train import main

    common, cfg = _several_shards(corpus, tmp_path, monkeypatch)
    path = check_data(cfg)
    m = prep.read_manifest(path)
    assert len(m["splits"]["train"]["shards"]) > 3 and len(m["splits"]["val"]["shards"]) > 1
    full = DataModule(cfg.data).train.n_tokens
    assert full == m["splits"]["train"]["tokens"]

    def cut(f):  # to a tenth, whole tokens: nothing but the size tells
        os.truncate(f, f.stat().st_size // 10 // 2 * 2)

    def shorter_array(f):  # a valid .npy with one entry fewer than the manifest's documents
        np.save(f, np.load(f)[:-1])

    damages = [("train_00000.bin", cut, r"train_00000.bin is \d+ bytes, the manifest says [\d,]+"),
               ("train_00001.bin", os.unlink, "train_00001.bin is missing"),
               ("val_00001.bin", lambda f: f.write_bytes(f.read_bytes() + b"\1\0\2\0"),  # grown by 2 tokens
                r"val_00001.bin is [\d,]+ bytes"),
               ("train_00002.docs.npy", cut, "train_00002.docs.npy is"),
               ("train_00001.docs.npy", shorter_array, r"train_00001.docs.npy is [\d,]+ bytes, the manifest says"),
               ("val_00001.docs.npy", lambda f: f.write_bytes(b"garbage"), "val_00001.docs.npy is not a .npy file"),
               ("val_00000.bytes.npy", os.unlink, "val_00000.bytes.npy is missing")]
    for name, damage, needle in damages:
        damage(path / name)
        for write in (True, False):  # the start, and --print-config
            with pytest.raises(ConfigError) as e:
                check_data(cfg, write=write)
            msg = str(e.value)
            assert msg.startswith(f"config error: data.prepared_dir='{tmp_path / 'p'}': {path} is damaged ("), msg
            assert re.search(needle, msg) and "`mode data prepare --config F --force`" in msg, msg
        with pytest.raises(ConfigError, match=needle):
            DataModule(cfg.data)
        with pytest.raises(ConfigError, match=needle):  # `mode data prepare` without --force keeps it
            prep.prepare(cfg.data, progress=False)
        if name == "train_00000.bin":  # through `mode train` and its --print-config: one line, no run.dir
            for extra in ([], ["--print-config"]):
                line = _one_config_line(main, [*common, f"run.dir={tmp_path / 'run'}", *extra], capsys)
                assert re.search(needle, line) and not (tmp_path / "run").exists(), line
                # the rebuild command names this config and its data/model overrides (was `--config F`)
                own = [a for a in common[2:] if a.startswith(("data.", "model."))]
                assert own and f"`mode data prepare {shlex.join(common[:2] + own)} --force`" in line, line
            # a shard cut after the open was checked is refused by the reader too
            with pytest.raises(ConfigError, match=r"train_00000.bin holds \d+ tokens, the manifest says"):
                TokenSplit(path, m["splits"]["train"], m["dtype"])
        assert prep.prepare(cfg.data, force=True, progress=False) == path
        assert prep.read_manifest(path)["splits"] == m["splits"] and DataModule(cfg.data).train.n_tokens == full
        check_data(cfg, write=False)


def test_a_malformed_manifest_is_one_config_error_and_force_rebuilds_it(corpus, tmp_path, monkeypatch, capsys):
    """Bug caught: a manifest.json that is valid JSON but lacks a key or has a wrong type stopped the
    start with `KeyError: 'bytes'` / `AttributeError` tracebacks (--print-config passed some), and
    `mode data prepare --force` kept it (its check compared only a few keys). Now one config error
    naming the manifest; --force replaces the directory (its manifest file makes it mode's), while
    a directory mode did not write is still never deleted."""
    from mode.train import main

    common, cfg = _several_shards(corpus, tmp_path, monkeypatch)
    path = check_data(cfg)
    good = (path / "manifest.json").read_text()
    splits = json.loads(good)["splits"]

    def edit(change):
        m = json.loads(good)
        change(m)
        return json.dumps(m)

    cases = [
        (edit(lambda m: m["splits"]["train"].pop("bytes")), "no train 'bytes'"),
        (edit(lambda m: m.update(splits=[])), "'splits' is list"),
        (edit(lambda m: m.pop("dtype")), "no 'dtype'"),
        (edit(lambda m: m.update(dtype="float64")), "dtype 'float64'"),
        (edit(lambda m: m.update(tokenizer="byte")), "'tokenizer' is str"),
        (edit(lambda m: m.update(fingerprint=[["a.txt", 3]])), "'fingerprint' is not a list of"),
        (edit(lambda m: m["splits"]["val"]["shards"][0].update(tokens="12")), "val shard 0 is not"),
        (edit(lambda m: m["splits"]["train"]["shards"][1].pop("docs")), "train shard 1 is not"),
        (edit(lambda m: m["splits"]["train"]["shards"][0].update(file="../../etc/passwd")), "train shard 0 is not"),
        (edit(lambda m: m["splits"]["train"].update(tokens=m["splits"]["train"]["tokens"] * 100)),
         "train shards hold"),
        ("[]", "a JSON object expected, found list"),
        (good[:len(good) // 2], "not readable JSON: JSONDecodeError"),
    ]
    for text, needle in cases:
        (path / "manifest.json").write_text(text)
        for write in (True, False):
            with pytest.raises(ConfigError) as e:
                check_data(cfg, write=write)
            msg = str(e.value)
            assert msg.startswith(f"config error: data.prepared_dir='{tmp_path / 'p'}': {path} is damaged "
                                  f"(manifest.json: {needle}"), msg
            assert "`mode data prepare --config F --force`" in msg, msg
        with pytest.raises(ConfigError, match="is damaged"):
            DataModule(cfg.data)
        with pytest.raises(ConfigError, match="is damaged"):
            prep.prepare(cfg.data, progress=False)
        assert prep.prepare(cfg.data, force=True, progress=False) == path
        assert prep.read_manifest(path)["splits"] == splits
        check_data(cfg)
    (path / "manifest.json").write_text(cases[0][0])  # through `mode train`: one line, no run.dir
    line = _one_config_line(main, [*common, f"run.dir={tmp_path / 'run'}"], capsys)
    assert "is damaged (manifest.json: no train 'bytes')" in line and not (tmp_path / "run").exists()
    # a directory mode did not write (no manifest, no marker) is never deleted, --force or not
    import shutil

    shutil.rmtree(path)
    path.mkdir()
    (path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="exists without a manifest: move it away"):
        prep.prepare(cfg.data, force=True, progress=False)
    assert (path / "notes.txt").read_text() == "mine"


# ----------------------------------------------------------------------------------------------
# Bad input: one `config error:` line, exit 2, nothing in run.dir; then the corrected command runs.


def _bad_inputs(tmp_path):
    """(overrides, the error line's needle, setup(common args) run first or None) of every bad data input."""
    d = tmp_path / "bad"
    d.mkdir()
    (d / "empty.txt").write_text("")
    (d / "empty.jsonl").write_text("")
    (d / "short.txt").write_text("tiny")
    (d / "bin.txt").write_bytes(b"text\0\1\2binary")
    (d / "latin1.txt").write_bytes("caf\xe9 ol\xe9".encode("latin-1"))
    # JSON files too (a later row: the first rows read fine, datasets failed mid-prepare with exit 1)
    (d / "latin1.jsonl").write_bytes(b"\n".join([json.dumps({"text": t}).encode() for t in DOCS[:3]]
                                                + ['{"text": "caf\xe9"}'.encode("latin-1")]))
    (d / "bin.jsonl").write_bytes(b"\x00\x01\x89PNG\x00" * 20)
    (d / "docs.jsonl").write_text("\n".join(json.dumps({"body": t}) for t in DOCS))
    (d / "nulls.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in [DOCS[0], None, *DOCS[2:]]))
    (d / "one.txt").write_text("\n\n".join(DOCS))
    repo, _ = _repo(tmp_path)
    tok = _bpe(tmp_path)
    stale = [f"data.source={d}/docs.jsonl", "data.text_key=body", f"data.tokenizer={tok}"]

    def prepared_then_tokenizer_changed(common):
        from mode.cli import main as cli_main

        assert cli_main(["data", "prepare", *common, *stale]) == 0
        _bpe(tmp_path, vocab=280)  # tokenizer.json rewritten (retrained) after its data was prepared

    return [
        ([f"data.source={d}/missing.txt"], "config error: data.source=", None),
        ([f"data.source={d}/*.nomatch"], "config error: data.source=", None),
        ([f"data.source={d}/docs.jsonl"], "config error: data.text_key='text': one of the source's columns ['body']",
         None),
        ([f"data.source={d}/empty.txt"], "a corpus with at least one non-empty training document", None),
        # was: "readable json files (StopIteration: StopIteration)" (datasets infers a schema from no row)
        ([f"data.source={d}/empty.jsonl"], "empty.jsonl': a corpus with at least one document (it is empty)", None),
        # was: tokenized whole, then "a corpus with at least one non-empty training document" (it had one)
        ([f"data.source={d}/one.txt"], "one text file is one document with data.sample_by=document", None),
        # was: "a column of strings (got NoneType)", no row or file named (rows count from 1, as lines do)
        ([f"data.source={d}/nulls.jsonl"], f"a column of strings in every row (row 2 of {d}/nulls.jsonl: NoneType)",
         None),
        ([f"data.source={d}/short.txt", "data.val_source=" + f"{d}/short.txt"], "config error: data.source=", None),
        ([f"data.source={d}/docs.jsonl", "data.text_key=body", "data.seq_len=4000", "model.max_seq_len=4096"],
         "config error: data.seq_len=4000: < the val split's", None),
        ([f"data.source={d}/bin.txt"], "is binary (NUL byte at 4)", None),
        ([f"data.source={d}/latin1.txt"], "latin1.txt is not UTF-8 (byte 3)", None),
        ([f"data.source={d}/latin1.jsonl"], "latin1.jsonl is not UTF-8 (byte", None),
        ([f"data.source={d}/bin.jsonl"], "bin.jsonl is binary (NUL byte at 0)", None),
        (["data.source=no-such-org-zz/no-such-dataset"], "config error: data.source='no-such-org-zz/no-such-dataset'",
         None),
        (["data.source=no-such-org-zz/no-such-dataset", "data.hub_config=en"],
         "config error: data.source='no-such-org-zz/no-such-dataset'", None),
        ([f"data.source={repo}", "data.hub_config=gamma"], "config error: data.hub_config='gamma': a config of", None),
        ([f"data.source={d}/docs.jsonl", "data.text_key=body", "data.val_source=validation"],
         "config error: data.val_source='validation': an existing file", None),
        (stale, "is stale (the tokenizer file changed", prepared_then_tokenizer_changed),
        # was "a directory holding tokenizer.json (this one has none)": "" read as the current directory
        (["data.tokenizer="], "config error: data.tokenizer='': `byte`, a directory holding tokenizer.json", None),
        # was `error: FileExistsError` at the start (and passed --print-config)
        ([f"data.prepared_dir={d}/short.txt/p"], f"config error: data.prepared_dir='{d}/short.txt/p': a directory path "
                                                 f"({d}/short.txt is a file)", None),
    ]


def test_data_prepare_checks_the_vocabulary_before_tokenizing(tmp_path, corpus, capsys):
    """Bug caught: `mode data prepare` compared model.vocab_size with the tokenizer only after the
    whole corpus was tokenized (hours at cluster scale); `mode train` checked it first."""
    from mode.cli import main

    tok = _bpe(tmp_path, vocab=400)  # more than the tiny preset's model.vocab_size=320
    prepared = tmp_path / "prepared"
    rc = main(["data", "prepare", "--config", str(ROOT / "configs/tiny/dense.yaml"), f"data.source={corpus / 'txt'}",
               f"data.tokenizer={tok}", f"data.prepared_dir={prepared}", "data.num_workers=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("config error: model.vocab_size=320: >= the tokenizer's"), err
    assert not prepared.exists()


def test_an_evaluation_larger_than_the_validation_split_is_one_warning(tmp_path, corpus):
    """Bug caught: a small validation split (a val_source of one short document) was read over and
    over by every evaluation (val_rows wraps), silently. The start says so once, with the repeat
    factor the evaluation really has; an evaluation that fits, or none, says nothing."""
    from mode.console import eval_repeat_warning

    over = [f"data.source={corpus / 'txt'}", f"data.prepared_dir={tmp_path / 'p'}", "data.num_workers=1",
            "data.seq_len=16", "data.val_fraction=0.1", "train.micro_batch_size=8"]
    cfg = load_config(ROOT / "configs/tiny/dense.yaml", [*over, "train.eval_batches=10"])
    prep.prepare(cfg.data, progress=False)
    dm = DataModule(cfg.data)
    rows = [r for b in dm.val_rows(10, 8) for r in b]
    assert len(set(rows)) == dm.n_val < len(rows)  # every window, read len(rows) / n_val times
    line = eval_repeat_warning(cfg, dm.n_val, 1)
    assert line.startswith(f"warning: an evaluation reads 80 windows (train.eval_batches=10 x train.micro_batch_size=8 "
                           f"x 1 rank(s)) but the validation split holds {dm.n_val} of data.seq_len=16: each is "
                           f"evaluated about {80 / dm.n_val:.3g} times"), line
    fits = load_config(ROOT / "configs/tiny/dense.yaml", [*over, "train.eval_batches=1", "train.micro_batch_size=1"])
    assert eval_repeat_warning(fits, dm.n_val, 1) is None
    assert eval_repeat_warning(load_config(ROOT / "configs/tiny/dense.yaml", [*over, "train.eval_every=0"]),
                               dm.n_val, 1) is None


def test_data_prepare_says_when_the_data_was_prepared_already(tmp_path, corpus, capsys):
    """A rerun found the data prepared and did nothing, yet printed `prepared ...` with a rate, as if
    it had tokenized the corpus again."""
    from mode.cli import main

    argv = ["data", "prepare", "--config", str(ROOT / "configs/tiny/dense.yaml"), f"data.source={corpus / 'txt'}",
            f"data.prepared_dir={tmp_path / 'prepared'}", "data.num_workers=1", "log.progress=false"]
    outs = []
    # overrides may come before --config, as for `mode train` (bug caught: `unrecognized arguments`);
    # --force rebuilds current data (data.shard_tokens is not in its name: the only way to change it)
    for args in (argv, [*argv[:2], argv[4], *argv[2:4], *argv[5:]], argv + ["--force"]):
        assert main(args) == 0
        outs.append(capsys.readouterr().out.strip())
    for o in (outs[0], outs[2]):
        assert o.startswith("prepared ") and "tokens/s over the whole prepare)" in o, outs
    assert outs[1].startswith("already prepared ") and outs[1].endswith(", when it was made)"), outs


@pytest.mark.parametrize("print_config", [False, True])
def test_each_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch, print_config):
    """Through `mode train` (and `--print-config`, which makes the same checks without preparing)."""
    import datasets.config
    import huggingface_hub.constants

    from mode.train import main

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # an unreachable hub, without waiting
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    prepared = tmp_path / "prepared"
    common = ["--config", str(ROOT / "configs/tiny/dense.yaml"), *TINY, f"data.prepared_dir={prepared}",
              "data.num_workers=1", "data.max_documents=0"]
    for i, (overrides, needle, setup) in enumerate(_bad_inputs(tmp_path)):
        run = tmp_path / f"run{i}"
        if setup:
            setup(common)
        before = sorted(prepared.rglob("*")) if prepared.exists() else None
        capsys.readouterr()
        rc = main([*common, *overrides, f"run.dir={run}"] + (["--print-config"] if print_config else []))
        out, err = capsys.readouterr()
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("config error:") and needle in lines[0], (overrides, err)
        assert not run.exists() and not out
        if print_config:  # not even the prepared directory is written
            assert (sorted(prepared.rglob("*")) if prepared.exists() else None) == before, overrides
    # nothing half-prepared is left behind, no lock file either (the seq_len case prepared valid data:
    # seq_len only cuts windows; the stale case's data was prepared by its setup)
    assert not list(prepared.glob("*.tmp")) and not list(prepared.glob("*.lock"))
    assert len(list(prepared.glob("*/"))) == 1 + (not print_config)


def _breaks_mid_stream(tmp_path) -> Path:
    """Two jsonl files, the second malformed: its error comes from the stream after the first
    file's documents were read (in a large file, past the json builder's first 10 MB block)."""
    d = tmp_path / "two"
    d.mkdir()
    (d / "a.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in DOCS))
    (d / "b.jsonl").write_text('{"text": "an unterminated string\n')
    return d


def test_a_source_that_breaks_mid_stream_is_one_config_error(tmp_path):
    # Bug caught: the parse error of a later file escaped as a runtime `error:` (exit 1) and left
    # the half-written <name>.tmp/ behind.
    d = _breaks_mid_stream(tmp_path)
    with pytest.raises(ConfigError, match=rf"^config error: data.source='{d}': readable documents \(ArrowInvalid"):
        prep.prepare(dcfg(tmp_path, source=str(d)), progress=False)
    assert not (tmp_path / "prepared").exists()


@pytest.mark.slow
def test_bad_json_sources_print_exactly_one_line(tmp_path):
    """Through the CLI, so every stderr writer counts (the json builder's own "Failed to load JSON"
    log line came before the config error line: two lines)."""
    d = tmp_path / "bad"
    d.mkdir()
    (d / "rows.jsonl").write_text('{"text": "an unterminated string\n')
    (d / "latin1.jsonl").write_bytes('{"text": "caf\xe9"}'.encode("latin-1"))
    for src, needle in ((d / "rows.jsonl", "readable documents"), (_breaks_mid_stream(tmp_path), "readable documents"),
                        (d / "latin1.jsonl", "is not UTF-8")):
        r = mode_cli("data", "prepare", "--config", "configs/tiny/dense.yaml", f"data.source={src}",
                     "data.num_workers=1", f"data.prepared_dir={tmp_path / 'p'}", "log.progress=false", check=False)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("config error: data.source="), r.stderr
        assert needle in lines[0], r.stderr
    assert not (tmp_path / "p").exists()


def test_print_config_writes_no_prepared_data(tmp_path, capsys, monkeypatch):
    """`mode train --print-config` on a fresh source checks it (a wrong text_key is still its one line)
    and prints the config, without creating data.prepared_dir."""
    from mode.train import main

    src = tmp_path / "docs.jsonl"
    src.write_text("\n".join(json.dumps({"body": t}) for t in DOCS))
    monkeypatch.chdir(tmp_path)  # the default data.prepared_dir is relative: data/prepared
    args = ["--print-config", "--config", str(ROOT / "configs/tiny/dense.yaml"), *TINY, f"data.source={src}",
            "data.num_workers=1", "run.dir=run"]
    assert main(args + ["data.text_key=body"]) == 0
    assert "text_key: body" in capsys.readouterr().out
    assert main(args) == 2
    assert capsys.readouterr().err.strip().startswith("config error: data.text_key='text': one of the source's")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl"]  # no data/, no run/
    # the check it made is the one training makes: the same config then prepares and passes it
    check_data(load_config(str(ROOT / "configs/tiny/dense.yaml"), [*TINY, f"data.source={src}", "data.text_key=body",
                                                                   "data.num_workers=1"]))
    assert (tmp_path / "data" / "prepared").is_dir()


def test_data_prepare_bad_options_are_one_line(capsys):
    from mode.cli import main as cli_main

    for argv, needle in ((["data", "prepare"], "required: --config"),
                         (["data", "prepare", "--config", "x.yaml", "--bogus"], "unrecognized arguments: --bogus")):
        with pytest.raises(SystemExit) as e:
            raise SystemExit(cli_main(argv))
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err


@pytest.mark.slow
def test_corrected_command_runs_without_fresh_and_bpb_matches_a_hand_computation(tmp_path):
    """A wrong text_key stops before run.dir exists; the corrected command trains (auto-prepare)
    and its eval/bpb equals sum(nats) / ln 2 / UTF-8 bytes of the evaluated text, computed here
    in float64 from the saved weights and the decoded text."""
    tok_dir = _bpe(tmp_path)
    src = tmp_path / "docs.jsonl"
    src.write_text("\n".join(json.dumps({"body": t}) for t in DOCS))
    base = ["--config", "configs/tiny/dense.yaml", *TINY, f"data.source={src}", f"data.tokenizer={tok_dir}",
            f"data.prepared_dir={tmp_path / 'prepared'}", "data.num_workers=2", "data.val_fraction=0.3",
            "data.max_documents=0", "data.seq_len=16", "train.max_steps=3", "train.eval_batches=2",
            "train.micro_batch_size=2", f"run.dir={tmp_path / 'run'}"]
    r = mode_cli("train", *base, check=False)
    assert r.returncode == 2 and r.stderr.strip().startswith("config error: data.text_key='text'")
    assert not (tmp_path / "run").exists()
    mode_cli("train", *base, "data.text_key=body")
    bpb = scalars(tmp_path / "run", "eval/bpb")[3]

    from mode.generate import load_run

    model, tok, cfg = load_run(tmp_path / "run")
    dm = DataModule(cfg.data)
    nats, text = 0.0, b""
    with torch.no_grad():
        for x, y in dm.val_batches(2, 2):
            logp = torch.log_softmax(model(x).logits.double(), -1)
            nats -= logp.gather(-1, y[..., None]).sum().item()
            for row in y.tolist():  # each target token's text, EOS contributes none
                text += b"".join(tok.decode([t]).encode() for t in row if t != tok.eos_id)
    assert text and bpb == pytest.approx(nats / math.log(2) / len(text), rel=1e-4)
    # the report shows it beside the eval loss
    mode_cli("analyze", tmp_path / "run", "--out", tmp_path / "report")
    report = (tmp_path / "report" / "report.md").read_text()
    assert "eval bits/byte" in report and f"{bpb:.4f}" in report


def test_a_checkpoint_of_another_config_or_data_is_refused_before_workers_start(tmp_path):
    """Both refusals came from the workers, after DeepSpeed had started (and built its op): a
    config.yaml written back with another value than the checkpoint trained with, and data rebuilt
    since the checkpoint. preflight (every launcher, `mode compare`, `--print-config`) now reads the
    newest checkpoint's config.json and data.json and refuses in the same one line."""
    from mode import checkpoint as ckpt
    from mode.config import dump_config
    from mode.train import preflight
    from tests.util import fake_checkpoint

    src, run = tmp_path / "docs.jsonl", tmp_path / "run"
    src.write_text("\n".join(json.dumps({"text": t}) for t in DOCS))
    over = [*TINY, f"data.source={src}", f"data.prepared_dir={tmp_path / 'p'}", "data.num_workers=1",
            "data.val_fraction=0.3", "data.seq_len=16", f"run.dir={run}"]
    cfg = load_config(ROOT / "configs/tiny/dense.yaml", over)
    assert preflight(cfg, lock=False) is None  # prepares; nothing to resume
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(cfg))
    trained = json.loads(json.dumps(cfg.to_dict()))
    data = prep.data_identity(prep.read_manifest(prep.prepared_path(cfg.data)))
    fake_checkpoint(run, 2, {}, config=trained, data=data)
    assert preflight(cfg, lock=False) is not None  # the same config and data: resumes
    other = json.loads(json.dumps(load_config(ROOT / "configs/tiny/dense.yaml", [*over, "optim.weight_decay=0.5"]).to_dict()))
    fake_checkpoint(run, 4, {}, config=other, data=data)
    with pytest.raises(ConfigError, match=r"checkpoint step_00000004 was trained with a different config \(optim.weight_decay"):
        preflight(cfg, lock=False)
    rebuilt = json.loads(json.dumps(data))
    rebuilt["splits"]["train"]["tokens"] += 1
    fake_checkpoint(run, 6, {}, config=trained, data=rebuilt)
    with pytest.raises(ConfigError, match=r"checkpoint step_00000006 was trained on other data than .*train tokens"):
        preflight(cfg, lock=False)
    # damaged after the save, as JSON or not (its manifest no longer vouches): the resume falls back past
    # it, so the start is not refused for it (nor does a record of another shape raise a traceback)
    other_counts = json.loads(json.dumps(rebuilt))
    other_counts["splits"]["train"]["tokens"] += 1
    for damaged in ("{not json", json.dumps(other_counts), json.dumps({**data, "splits": 7}), "7"):
        (ckpt.checkpoints_dir(run) / "step_00000006" / ckpt.DATA).write_text(damaged)
        preflight(cfg, lock=False)
    # a finished run (DONE at train.max_steps) on since-rebuilt data: nothing to resume, `finished` says so
    fake_checkpoint(run, 8, {}, config=trained, data=rebuilt)
    (run / "DONE").write_text("")
    done = load_config(ROOT / "configs/tiny/dense.yaml", [*over, "train.max_steps=8"])
    (run / "config.yaml").write_text(dump_config(done))
    preflight(done, lock=False)
    with pytest.raises(ConfigError, match="step_00000008 was trained on other data"):  # not finished: refused
        preflight(load_config(ROOT / "configs/tiny/dense.yaml",
                              [*over, "train.max_steps=9", "train.allow_schedule_change=true"]), lock=False)


@pytest.mark.slow
def test_a_checkpoint_does_not_resume_on_rebuilt_data_of_other_content(tmp_path):
    """Bug caught: a source file edited and rebuilt with `mode data prepare --force` (as the stale-data
    line asks) passed every resume check: the run resumed and trained on other tokens, silently (and
    run_info.json's tokenizer_sha256 was rewritten). Each checkpoint records its data's identity
    (tokenizer, split counts); the same corpus copied back (another mtime) and rebuilt still resumes."""
    src = tmp_path / "docs.jsonl"
    original = "\n".join(json.dumps({"text": t}) for t in DOCS)
    src.write_text(original)
    cfg = ["--config", "configs/tiny/dense.yaml", *TINY, f"data.source={src}", f"data.prepared_dir={tmp_path / 'p'}",
           "data.num_workers=1", "data.val_fraction=0.3", "data.seq_len=16", "train.max_steps=4",
           "checkpoint.every=2", "train.micro_batch_size=2", "train.eval_every=0"]
    run = [*cfg, f"run.dir={tmp_path / 'run'}"]
    mode_cli("train", *run, "train.stop_at=2", threads=1)
    src.write_text(original.replace("number", "no."))  # edited: fewer bytes and tokens
    mode_cli("data", "prepare", *cfg, "--force", threads=1)
    before = sorted((tmp_path / "run" / "checkpoints").rglob("*"))
    r = mode_cli("train", *run, check=False, threads=1)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("config error:")]
    assert r.returncode == 2 and "resumed from" not in r.stderr and len(lines) == 1, r.stderr[-3000:]
    assert "step_00000002 was trained on other data than" in lines[0] and "train tokens " in lines[0], lines[0]
    assert sorted((tmp_path / "run" / "checkpoints").rglob("*")) == before
    src.write_text(original)  # the corpus as it was, copied back (a new mtime: the prepared data is stale)
    mode_cli("data", "prepare", *cfg, "--force", threads=1)
    r = mode_cli("train", *run, threads=1)
    assert "resumed from" in r.stderr and "step_00000002 at step 2" in r.stderr, r.stderr[-3000:]


def word_files(d: Path, n: int, words_per_file: int) -> Path:
    """`n` text files of random words (a corpus whose size the caller picks), in a new directory `d`."""
    d.mkdir()
    rng = np.random.default_rng(0)
    words = np.array(["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"])
    for i in range(n):
        (d / f"{i:03d}.txt").write_text(" ".join(rng.choice(words, words_per_file)))
    return d


@pytest.mark.slow
def test_killed_prepare_restarts_cleanly(tmp_path):
    """SIGKILL `mode data prepare` while it writes shards: no manifest points at a partial shard,
    the next prepare resumes after the last complete shard (keeping it) and builds exactly what
    an uninterrupted one does."""
    d = word_files(tmp_path / "big", 40, 150_000)
    args = ["data", "prepare", "--config", "configs/tiny/dense.yaml", f"data.source={d}", "data.num_workers=2",
            "data.shard_tokens=2000000", f"data.prepared_dir={tmp_path / 'p'}"]
    sems = {p.name for p in Path("/dev/shm").glob("sem.mp-*")}
    # (its own TMPDIR: the workers, killed with it, cannot remove their scratch batches)
    p = subprocess.Popen([PY, "-m", "mode.cli", *args], cwd=ROOT, env={**env(1), "TMPDIR": str(tmp_path)},
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and not any((tmp_path / "p").glob("*.tmp/train_00001.bin")):
        time.sleep(0.02)
    # SIGKILL the CLI and its tokenizer workers mid-way through shard 1, but not multiprocessing's
    # resource tracker: it unlinks the pool's named semaphores once they are gone (killing it too
    # left 6 in /dev/shm per run).
    for pid, cmd in process_group(p.pid):
        if "resource_tracker" not in cmd:
            os.kill(pid, signal.SIGKILL)
    p.wait()
    deadline = time.time() + 30
    while any("resource_tracker" in cmd for _, cmd in process_group(p.pid)) and time.time() < deadline:
        time.sleep(0.1)
    assert not orphan_semaphores(sems), f"the killed prepare left semaphores: {orphan_semaphores(sems)}"
    assert not any((tmp_path / "p").glob("*/manifest.json")), "a killed prepare must not publish a manifest"
    (tmp,) = (tmp_path / "p").glob("*.tmp")
    done = json.loads((tmp / "progress.json").read_text())["train"]["shards"]
    assert done, "the kill came too late to test a resume"
    kept = {s["file"]: (tmp / s["file"]).stat().st_ino for s in done}
    mode_cli(*args, extra_env={"TMPDIR": str(tmp_path)})
    assert not list(tmp_path.glob("mode-prepare-*")), "the rerun left the killed prepare's scratch"
    mode_cli(*args[:-1], f"data.prepared_dir={tmp_path / 'clean'}")
    (a,), (b,) = (tmp_path / "p").glob("*/manifest.json"), (tmp_path / "clean").glob("*/manifest.json")
    assert not list((tmp_path / "p").glob("*.tmp"))
    for f in sorted(a.parent.glob("*.bin")) + sorted(a.parent.glob("*.npy")):
        assert f.read_bytes() == (b.parent / f.name).read_bytes(), f.name
    ma, mb = json.loads(a.read_text()), json.loads(b.read_text())
    assert ma["splits"] == mb["splits"] and ma["splits"]["train"]["tokens"] > 5_000_000
    assert ma["resumed"] and not mb["resumed"]
    assert {f: (a.parent / f).stat().st_ino for f in kept} == kept  # complete shards were kept, not rewritten


@pytest.mark.slow
def test_the_audits_cut_shard_and_a_malformed_manifest_stop_mode_train_in_one_line(tmp_path):
    """End to end through the CLI. Bug caught: with `train_00000.bin` cut to ~1% of its size,
    `mode train` ran and exited 0 on ~1% of the corpus; with a manifest lacking a split's 'bytes',
    it died with a `KeyError: 'bytes'` traceback. Both are now one config error line (exit 2, no
    run.dir) naming the directory and the damage; `mode data prepare --force` rebuilds it and the
    same command trains."""
    d = word_files(tmp_path / "corpus", 20, 3000)
    data = ["--config", "configs/tiny/dense.yaml", *TINY, f"data.source={d}", "data.max_documents=0",
            "data.num_workers=1", f"data.prepared_dir={tmp_path / 'p'}"]
    train = [*data, "train.max_steps=2", f"run.dir={tmp_path / 'run'}"]
    mode_cli("data", "prepare", *data)
    (path,) = (tmp_path / "p").glob("*/manifest.json")
    path, text = path.parent, path.read_text()
    splits = json.loads(text)["splits"]

    def one_line(*args, needle):
        r = mode_cli(*args, check=False)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
        assert lines[0].startswith(f"config error: data.prepared_dir='{tmp_path / 'p'}': {path} is damaged ("), lines
        # the command to copy: this config and its data and model overrides (was `--config F`)
        hint = shlex.join(["mode", "data", "prepare", *[a for a in data if not a.startswith(("train.", "log."))],
                           "--force"])
        assert needle in lines[0] and f"`{hint}`" in lines[0], lines
        assert not (tmp_path / "run").exists()
        return hint

    m = json.loads(text)
    del m["splits"]["train"]["bytes"]
    (path / "manifest.json").write_text(json.dumps(m))
    one_line("train", *train, needle="manifest.json: no train 'bytes'")
    (path / "manifest.json").write_text(text)  # (--print-config and `data prepare` refusals: the fast tier)
    f = path / "train_00000.bin"
    assert f.stat().st_size > 300_000
    os.truncate(f, f.stat().st_size // 100 // 2 * 2)  # whole tokens: only the size tells
    hint = one_line("train", *train, needle="train_00000.bin is ")
    mode_cli(*shlex.split(hint)[1:])  # the command the line gives
    mode_cli("train", *train)
    assert json.loads((path / "manifest.json").read_text())["splits"] == splits
    assert scalars(tmp_path / "run", "train/loss")


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_prepare_stopped_by_a_signal_leaves_no_worker_or_scratch_behind(tmp_path, sig):
    """Bug caught: SIGTERM (scancel, a time limit) or SIGKILL of `mode data prepare` left its
    tokenizer workers running for good (each holds both ends of the pool's task queue, so the
    parent's death never reached them) and the batches in flight in $TMPDIR. Now SIGTERM stops the
    pool (exit 143) and a worker exits, removing the scratch, within a second of its parent's
    death; the next prepare resumes."""
    d = word_files(tmp_path / "big", 20, 150_000)
    args = ["data", "prepare", "--config", "configs/tiny/dense.yaml", f"data.source={d}", "data.num_workers=2",
            "data.shard_tokens=2000000", f"data.prepared_dir={tmp_path / 'p'}"]
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    p = subprocess.Popen([PY, "-m", "mode.cli", *args], cwd=ROOT, env={**env(1), "TMPDIR": str(scratch)},
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not any((tmp_path / "p").glob("*.tmp/train_00000.bin")):
            time.sleep(0.02)
        workers = [pid for pid, cmd in process_group(p.pid) if "spawn_main" in cmd]
        assert len(workers) == 2 and list(scratch.glob("mode-prepare-*")), process_group(p.pid)
        os.kill(p.pid, getattr(signal, sig))
        rc = p.wait(timeout=30)
        deadline = time.time() + 10
        while time.time() < deadline and any(pid in workers for pid, _ in process_group(p.pid)):
            time.sleep(0.1)
        left = process_group(p.pid)
    finally:
        for pid, _ in process_group(p.pid):
            os.kill(pid, signal.SIGKILL)
    assert rc == (143 if sig == "SIGTERM" else -9), (rc, p.stderr.read()[-2000:])
    assert not any(pid in workers for pid, _ in left), left
    assert not list(scratch.iterdir()), list(scratch.rglob("*"))
    assert not any((tmp_path / "p").glob("*/manifest.json"))
    mode_cli(*args)  # resumes
    assert len(list((tmp_path / "p").glob("*/manifest.json"))) == 1


def test_scratch_of_a_dead_prepare_on_this_host_is_removed_and_nothing_else(tmp_path, monkeypatch):
    """A SIGKILL of a whole prepare (workers included: nobody left to clean up) left its batches in
    $TMPDIR for good. The next prepare removes such a directory when it can prove it a dead
    prepare's: the name (this host, a pid no longer running) and nothing but batch files inside."""
    import socket
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([PY, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, host = int(gone.stdout), socket.gethostname()

    def scratch(name: str, *files: str) -> Path:
        d = tmp_path / name
        d.mkdir()
        for f in files:
            (d / f).write_bytes(b"PK")
        return d

    removed = [scratch(f"mode-prepare-{host}-{dead}-ab_12", "0.npz", "17.npz"), scratch(f"mode-prepare-{host}-{dead}-x")]
    kept = [scratch(f"mode-prepare-{host}-{os.getpid()}-live1", "3.npz"),  # a running prepare's
            scratch(f"mode-prepare-{host}-{dead}-user", "3.npz", "notes.txt"),  # a file mode does not write
            scratch(f"mode-prepare-otherhost-{dead}-far", "3.npz"),  # another node's pids are not ours to judge
            scratch("mode-prepare-old_style", "3.npz"), scratch(f"not-mode-{host}-{dead}-x", "3.npz")]
    (tmp_path / f"mode-prepare-{host}-{dead}-link").symlink_to(kept[0])
    prep.remove_dead_scratch()
    assert not any(d.exists() for d in removed)
    assert all(d.is_dir() and any(d.iterdir()) for d in kept)
    assert (tmp_path / f"mode-prepare-{host}-{dead}-link").is_symlink() and (kept[0] / "3.npz").is_file()


# Kills one of two tokenizer workers at the worst moment it can catch: inside a write (the old result
# pipe carried ~8 MB per batch, so a kill there left half a message); within 5 s of the first result
# it kills one anyway. Prints what happened as JSON.
_KILL_A_WORKER = r"""
import json, os, signal, sys, threading, time
from pathlib import Path
import mode.prepare as prep

def workers():
    kids = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            kids += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    out = []
    for k in kids:
        try:
            cmd = Path(f"/proc/{k}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmd:
            out.append(k)
    return out

def in_write(pid):
    try:
        return Path(f"/proc/{pid}/syscall").read_text().split()[0] == "1"  # x86-64 write
    except (OSError, IndexError):
        return False

if __name__ == "__main__":
    out = {}
    def consume(it):
        try:
            for _ in it:
                pass
        except RuntimeError as e:
            out["error"] = str(e)
    docs = (f"document {i} " * 400 for i in range(100_000))  # a few hundred batches
    with prep.encoder(prep.ByteTokenizer(), 2) as run:
        it = run(docs)
        next(it)  # both workers up and busy
        t = threading.Thread(target=consume, args=(it,), daemon=True)
        t.start()
        t0 = time.time()
        while t.is_alive() and "killed" not in out:
            for p in workers():
                if in_write(p) or time.time() - t0 > 5:
                    os.kill(p, signal.SIGKILL)
                    out["killed"] = "in a write" if in_write(p) else "anywhere"
                    break
        t.join()
    print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_tokenizer_worker_that_dies_ends_the_prepare_in_one_line(tmp_path):
    """Bugs caught: with multiprocessing.Pool a worker that died (killed, out of memory) lost its task
    and the prepare waited for it forever, holding the prepare lock every later start waits on (seen:
    trainers stuck for an hour). With ProcessPoolExecutor, a worker killed while it sent its batch's
    tokens left half a message in the result pipe and the pool waited for the rest forever (1 in 26
    kills at random, every kill inside a write), and a kill seen first by `submit` raised CPython's
    raw "A child process terminated abruptly" (5 in 26). Now the prepare stops in one line, and the
    workers' scratch files are gone."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    p = subprocess.Popen([PY, "-c", _KILL_A_WORKER], cwd=ROOT, env={**env(), "TMPDIR": str(scratch)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=150)  # ~15 s when it works
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise AssertionError("the prepare waits for the dead worker's batch forever") from None
    assert p.returncode == 0, stderr[-3000:]
    out = json.loads(stdout.splitlines()[-1])
    assert "killed" in out, out
    assert out.get("error", "").startswith("a tokenizer worker process died ("), out
    assert "\n" not in out["error"], out
    assert not list(scratch.iterdir()), list(scratch.iterdir())


def test_a_refused_write_during_prepare_names_its_place(tmp_path):
    """Bug caught (fault walkthrough, a full disk): a prepare whose shard write failed said only
    "error: OSError: [Errno 27] File too large" (or "no space left on device", naming no place): the
    file object's write names no file. Now the prepared data's directory is named, and a worker's
    batch file in $TMPDIR (another filesystem, often) names that file. A real refused write:
    RLIMIT_FSIZE (EFBIG past 64 KB), in-process."""
    import resource

    from mode.errors import one_line

    d = tmp_path / "src"
    d.mkdir()
    (d / "a.txt").write_text("\n\n".join(f"paragraph {i} " * 40 for i in range(600)))  # ~290 KB of tokens
    cfg = dcfg(tmp_path, source=str(d), sample_by="paragraph")
    tok = prep.build_tokenizer(cfg)
    limit, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, limit[1]))
        with pytest.raises(OSError) as shard:
            prep.prepare(cfg, progress=False)
        prep._init_worker(tok.spec())
        with pytest.raises(OSError) as batch:
            prep._encode_to_file([(d / "a.txt").read_text()], str(tmp_path / "0.npz"))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
    line, code = one_line(shard.value)
    assert code == 1 and str(prep.prepared_path(cfg)) + ".tmp" in line, line
    line, code = one_line(batch.value)
    assert code == 1 and str(tmp_path / "0.npz") in line, line


@pytest.mark.slow
def test_a_script_without_the_main_guard_fails_instead_of_hanging(tmp_path):
    """Bug caught (headline review): a script without `if __name__ == "__main__":` that prepared data
    with several workers hung for good (0 CPU): each spawned worker ran the script again, reached
    the prepare, and waited for the lock its parent held while the parent waited for the worker.
    Now the worker refuses, the pool breaks, and the script fails with the advice, no process left."""
    d = tmp_path / "src"
    d.mkdir()
    (d / "a.txt").write_text("\n\n".join(f"paragraph {i} " * 30 for i in range(3000)))
    script = tmp_path / "no_guard.py"
    script.write_text("from mode.config import DataConfig\nfrom mode.prepare import prepare\n"
                      f"prepare(DataConfig(source={str(d)!r}, sample_by='paragraph', num_workers=2, "
                      f"prepared_dir={str(tmp_path / 'prepared')!r}), progress=False)\n")
    proc = subprocess.Popen([PY, str(script)], env=env(1), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if process_group(proc.pid) else None
    assert proc.returncode != 0 and 'if __name__ == "__main__":' in err.strip().splitlines()[-1], err[-2000:]
    time.sleep(1)
    assert [c for _, c in process_group(proc.pid) if c] == []  # its workers went with it (a zombie has no cmdline)


def test_the_prepare_rate_counts_from_the_start_not_from_the_first_result(tmp_path, monkeypatch, capsys):
    """Bug caught (README walkthrough): the progress line opened at the first encoded batch, so its
    clock missed the work done before it (with workers, most of a small corpus): "4,698,556 tokens in
    0 s (31,542,231 tokens/s)" beside "3,959,149 tokens/s over the whole prepare". Here one batch
    takes over a second to encode, all of it before the first result."""
    real = prep._encode
    monkeypatch.setattr(prep, "_encode", lambda texts: (time.sleep(1.2), real(texts))[1])
    d = tmp_path / "src"
    d.mkdir()
    (d / "a.txt").write_text("\n\n".join(f"paragraph {i} " * 8 for i in range(50)))
    prep.prepare(dcfg(tmp_path, source=str(d), sample_by="paragraph"), progress=True)
    line = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("prepare ")][-1]
    n, secs, rate = re.search(r": ([\d,]+) tokens in (\d+) s \(([\d,]+) tokens/s\)", line).groups()
    assert int(secs) >= 1 and int(rate.replace(",", "")) <= int(n.replace(",", "")) / 1.2, line

"""datasets-based loading, packing, split, rank sharding and tokenizers."""
import json

import pytest
import torch

from mode.config import ConfigError, DataConfig
from mode.data import ByteTokenizer, DataModule, stdlib_files

DOCS = [f"document number {i} " * (5 + i) for i in range(30)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    (d / "docs.jsonl").write_text("\n".join(json.dumps({"body": t}) for t in DOCS))
    for i, t in enumerate(DOCS):
        (d / "txt").mkdir(exist_ok=True)
        (d / "txt" / f"{i:02d}.txt").write_text(t)
    import datasets

    datasets.Dataset.from_dict({"text": DOCS}).to_parquet(str(d / "docs.parquet"))
    return d


def _all_tokens(dm):
    seqs = torch.cat([dm.train.seqs_NS1, dm.val.seqs_NS1])
    return seqs


@pytest.mark.parametrize("fmt", ["jsonl", "txt", "parquet"])
def test_local_formats_give_same_documents(corpus, fmt):
    src = {"jsonl": corpus / "docs.jsonl", "txt": corpus / "txt", "parquet": corpus / "docs.parquet"}[fmt]
    dm = DataModule(DataConfig(source=str(src), text_key="body" if fmt == "jsonl" else "text", seq_len=16,
                               val_fraction=0.2))
    eos = ByteTokenizer.eos_id
    n_tokens = sum(len(t.encode()) + 1 for t in DOCS)
    # every document ends with EOS; windows overlap by exactly one token
    got = int((dm.train.seqs_NS1[:, :-1] == eos).sum() + (dm.val.seqs_NS1[:, :-1] == eos).sum())
    assert got <= len(DOCS)
    s = dm.train.seqs_NS1
    assert torch.equal(s[1:, 0], s[:-1, -1])
    total = (len(dm.train) + len(dm.val)) * 16
    assert n_tokens - 2 * 16 <= total <= n_tokens


def test_split_is_deterministic_and_disjoint(corpus):
    cfg = DataConfig(source=str(corpus / "docs.parquet"), seq_len=8, val_fraction=0.2)
    a, b = DataModule(cfg), DataModule(cfg)
    assert torch.equal(a.train.seqs_NS1, b.train.seqs_NS1) and torch.equal(a.val.seqs_NS1, b.val.seqs_NS1)
    c = DataModule(DataConfig(source=cfg.source, seq_len=8, val_fraction=0.2, split_seed=99))
    assert not torch.equal(a.val.seqs_NS1, c.val.seqs_NS1)


def test_rank_shards_are_disjoint_and_make_the_global_batch(corpus):
    cfg = DataConfig(source=str(corpus / "docs.parquet"), seq_len=8, val_fraction=0.2)
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


def test_epochs_reshuffle(corpus):
    dm = DataModule(DataConfig(source=str(corpus / "docs.parquet"), seq_len=8, val_fraction=0.2))
    n = len(dm.train)
    first = torch.cat([dm.train_batch(s, 0, 1, 1)[0] for s in range(n)])
    second = torch.cat([dm.train_batch(s, 0, 1, 1)[0] for s in range(n, 2 * n)])
    assert sorted(map(tuple, first.tolist())) == sorted(map(tuple, second.tolist()))
    assert not torch.equal(first, second)


def test_hf_tokenizer_from_local_dir(corpus, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    dm = DataModule(DataConfig(source=str(corpus / "docs.parquet"), tokenizer=str(tmp_path), seq_len=8,
                               val_fraction=0.2))
    assert dm.tokenizer.eos_id == tok.token_to_id("</s>")
    assert int(dm.train.seqs_NS1.max()) < dm.tokenizer.vocab_size
    with pytest.raises(ConfigError):
        DataConfig(tokenizer=str(tmp_path / "missing")).validate()


def test_embedded_default_corpus_exists():
    files = stdlib_files()
    assert len(files) > 50 and any(f.endswith("os.py") for f in files)
    dm = DataModule(DataConfig(max_documents=10, seq_len=64))
    assert len(dm.train) > 100 and ByteTokenizer().decode(dm.train.seqs_NS1[0].tolist())

"""Stop sequences end generation (issues #14 and #11 item 5).

The reference is the same model generating WITHOUT stop strings, its text cut by hand at the first
occurrence of the stop string, and the tokens kept through the one whose characters complete that
occurrence (counted from the tokens' lengths, not with the library's helpers). A test tokenizer
whose tokens are several characters long lets a stop string span tokens or sit inside one.
Shape legend: B rows, V vocabulary.
"""
import json
import random

import pytest
import torch

from mode.data import ByteTokenizer
from mode.generate import cut_at_stop, generate_ids
from tests.test_sampling import PROMPTS, model_of

N = 20  # new tokens
ALPHABET = "abcdefghijklmnopqrstuvwxyz\n "


class PieceTokenizer:
    """Token v decodes to PIECES[v] (1-6 characters); decode joins the pieces."""

    def __init__(self, vocab: int, seed: int = 0):
        rng = random.Random(seed)
        self.pieces = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 6))) for _ in range(vocab)]

    def decode(self, ids) -> str:
        return "".join(self.pieces[int(i)] for i in ids)


def varied(case: str, *extra):
    """A tiny model whose greedy text wanders (untied, random head) instead of repeating its input."""
    model = model_of(case, "model.tie_embeddings=false", *extra)
    with torch.no_grad():
        model.head.weight.copy_(torch.randn(model.head.weight.shape, generator=torch.Generator().manual_seed(7)))
    return model


def token_ends(tok, ids) -> list[int]:
    """ends[s] = characters of text through token s."""
    ends, n = [], 0
    for i in ids:
        n += len(tok.pieces[i]) if isinstance(tok, PieceTokenizer) else len(tok.decode([i]))
        ends.append(n)
    return ends


def stop_in(text: str, ends: list[int], kind: str, min_step: int) -> str:
    """A stop string whose FIRST occurrence in `text` lies strictly inside token s ('inside': characters
    of the token on both sides) or starts in an earlier token and ends in token s ('across'); s from
    min_step on, else the latest s before it (a periodic text has new substrings only early)."""
    for s in [*range(max(1, min_step), len(ends)), *range(min(min_step, len(ends)) - 1, 0, -1)]:
        lo, hi = ends[s - 1], ends[s]  # token s holds text[lo:hi]
        spans = ([(a, b) for a in range(lo + 1, hi) for b in range(a + 2, hi)] if kind == "inside"
                 else [(a, b) for a in range(max(0, lo - 3), lo) for b in range(lo + 1, hi + 1)])
        for a, b in spans:
            if text.find(text[a:b]) == a:
                return text[a:b]
    pytest.fail(f"no {kind} stop string in {text!r}")


def reference(tok, full_ids: list[int], stops: list[str]) -> tuple[list[int], str]:
    """(ids through the token completing the first stop occurrence, text cut before it); single
    stop strings per row, or several where the earliest one also completes first."""
    text = tok.decode(full_ids)
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return full_ids, text
    start, s = min(hits)
    ends = token_ends(tok, full_ids)
    m = next(k + 1 for k, e in enumerate(ends) if e >= start + len(s))
    return full_ids[:m], text[:start]


def per_row_stops(tok, full):
    """Rows stopping at different steps: inside a token, across tokens, never, at the first token."""
    texts = [tok.decode(f) for f in full]
    ends = [token_ends(tok, f) for f in full]
    return [[stop_in(texts[0], ends[0], "inside", 2)],
            [stop_in(texts[1], ends[1], "across", 6)],
            ["#", "never here"],
            ["#", texts[3][: ends[3][0]]]]  # the first token's whole text


class Forwards:
    """Counts the model's forward calls and the rows each one carried."""

    def __init__(self, model):
        self.rows = []
        self.handle = model.register_forward_hook(lambda m, args, out: self.rows.append(args[0].shape[0]))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


@pytest.mark.parametrize("case,temperature", [("mod", 0.0), ("mode_staged", 0.0), ("mode_integrated", 0.0),
                                              ("mode_integrated", 1.0)])
def test_stop_equals_generation_without_stop_cut_at_the_first_occurrence(case, temperature):
    model = varied(case)
    tok = PieceTokenizer(model.cfg.vocab_size)
    kw = dict(temperature=temperature, seed=3, top_k=8 if temperature else 0)
    full = generate_ids(model, PROMPTS, N, **kw)
    assert all(len(f) == N for f in full)
    stops = per_row_stops(tok, full)
    got = generate_ids(model, PROMPTS, N, stop=stops, decode=tok.decode, **kw)
    want = [reference(tok, f, s) for f, s in zip(full, stops)]
    for i, (ids, (ref_ids, ref_text)) in enumerate(zip(got, want)):
        assert ids == ref_ids, (i, stops[i])
        assert cut_at_stop(tok.decode(ids), stops[i]) == ref_text, i
    if case == "mod" and temperature == 0:  # the step-by-step reference path (runs to the end, then cuts) agrees
        assert generate_ids(model, PROMPTS, N, stop=stops, decode=tok.decode, prefill=False, **kw) == got
    lens = [len(ids) for ids in got]
    assert lens[2] == N and lens[3] == 1 and len(set(lens)) == 4, lens  # four rows, four different steps
    # the kinds of stop string the test means to cover, checked on the reference
    ends0 = token_ends(tok, want[0][0])
    assert ends0[-2] < len(want[0][1]) and len(want[0][1]) + len(stops[0][0]) < ends0[-1]  # inside the last token
    assert len(want[1][1]) < token_ends(tok, want[1][0])[-2]  # began before the last token


@pytest.mark.parametrize("case", ["mod", "mode_integrated"])
def test_finished_rows_leave_the_batch_and_fewer_steps_run(case):
    model = varied(case)
    tok = PieceTokenizer(model.cfg.vocab_size)
    with Forwards(model) as plain:
        full = generate_ids(model, PROMPTS, N, temperature=0)
    assert plain.rows == [4] * N  # prefill, then N - 1 decode steps of every row
    texts, ends = [tok.decode(f) for f in full], [token_ends(tok, f) for f in full]
    stops = [[stop_in(texts[0], ends[0], "inside", 3)], [stop_in(texts[1], ends[1], "across", 9)],
             [texts[2][: ends[2][0]]], [stop_in(texts[3], ends[3], "across", 5)]]
    m = [len(reference(tok, f, s)[0]) for f, s in zip(full, stops)]
    assert max(m) < N and len(set(m)) >= 3, m
    with Forwards(model) as cut:
        got, tr = generate_ids(model, PROMPTS, N, temperature=0, stop=stops, decode=tok.decode, return_trace=True)
    assert [len(g) for g in got] == m
    # A row that finished at step j (its j+1-th token completed a stop) is in no later forward.
    assert cut.rows == [4] + [sum(k > j + 1 for k in m) for j in range(max(m) - 1)], (cut.rows, m)
    assert len(cut.rows) == max(m) < len(plain.rows)
    # The rows that went on decoded from the right caches: every logit equals the row's own full
    # causal forward, computed alone (float64 comparison of fp32 values).
    with torch.no_grad():
        for i, p in enumerate(PROMPTS):
            L = len(p) + m[i] - 1
            assert int(tr.valid_BT[i].sum()) == L
            ref_LV = model(tr.tokens_BT[i : i + 1, :L], routing="causal").logits[0].double()
            torch.testing.assert_close(tr.logits_BTV[i, :L].double(), ref_LV, rtol=1e-5, atol=1e-5)
            assert tr.tokens_BT[i, len(p) : len(p) + m[i]].tolist() == full[i][: m[i]]


def test_stop_needs_decode_and_non_empty_strings():
    model = varied("mod")
    with pytest.raises(ValueError, match="decode"):
        generate_ids(model, PROMPTS, 4, stop=["x"])
    with pytest.raises(ValueError, match="non-empty"):
        generate_ids(model, PROMPTS, 4, stop=[""], decode=str)
    with pytest.raises(ValueError, match="one list of strings per prompt"):
        generate_ids(model, PROMPTS, 4, stop=[["x"], ["y"]], decode=str)


# ------------------------------------------------------------------------------------------------
# lm-eval's generate_until

TOK = ByteTokenizer()
L_MAX = 128


def byte_model(case):
    """`varied` over bytes; ids from 128 on get zero head rows, so the greedy text is ASCII (one
    character per token) and never EOS."""
    model = varied(case, "model.vocab_size=320", f"model.max_seq_len={L_MAX}")
    with torch.no_grad():
        model.head.weight[128:] = 0.0
    return model


def gen_alone(model, context: str, n: int) -> list[int]:
    """The harness's prompt (EOS + context, cut from the left to fit), generated alone, no stop."""
    prompt = ([TOK.eos_id] + TOK.encode(context).tolist())[-(L_MAX + 1 - n):]
    return generate_ids(model, [prompt], n, temperature=0, eos_id=TOK.eos_id, vocab_limit=TOK.vocab_size)[0]


CONTEXTS = ["def f(x):\n    return", "import os\n", "class A:\n    pass\n" * 3, "x = [i * i for i in range(10)]",
            "while True:", "print("]


@pytest.mark.parametrize("case", ["mode_integrated"])
def test_generate_until_batches_rows_and_stops_each_at_its_own_sequence(case):
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is the [eval] extra")  # noqa: F841
    from lm_eval.api.instance import Instance

    from mode.harness import ModeLM

    model = byte_model(case)
    n = 24
    full = [gen_alone(model, c, n) for c in CONTEXTS]
    texts, ends = [TOK.decode(f) for f in full], [token_ends(TOK, f) for f in full]
    assert all(len(f) == n for f in full), "an EOS would end a row early"
    assert all(t.isascii() for t in texts), "one character per byte: token_ends counts them"
    untils = [[stop_in(texts[0], ends[0], "across", 3)], [stop_in(texts[1], ends[1], "across", 10)],
              ["\x00never"], [texts[3][:1]], [stop_in(texts[4], ends[4], "across", 16), "\x00never"],
              [stop_in(texts[5], ends[5], "across", 6)]]
    want = [reference(TOK, f, u) for f, u in zip(full, untils)]
    assert len({len(ids) for ids, _ in want}) >= 4  # rows stop at different steps
    lm = ModeLM(model=model, tokenizer=TOK, batch_size=8)
    reqs = [Instance("generate_until", {}, (c, {"until": u, "max_gen_toks": n, "do_sample": False}), i)
            for i, (c, u) in enumerate(zip(CONTEXTS, untils))]
    with Forwards(model) as fw:
        got = lm.generate_until(reqs)
    assert got == [text for _, text in want]
    assert fw.rows[0] == len(CONTEXTS)  # one batch: greedy rows cannot affect each other
    assert len(fw.rows) == n and fw.rows[-1] == 1  # only the row without a hit ran to max_gen_toks
    assert sum(fw.rows) < len(CONTEXTS) * n


@pytest.mark.slow  # lm-eval's whole pipeline (task building, datasets): ~10 s
def test_simple_evaluate_generate_until_stops_at_the_stop_sequence(tmp_path):
    pytest.importorskip("lm_eval", reason="lm-eval is the [eval] extra")
    import lm_eval
    from lm_eval.tasks import TaskManager

    from mode.harness import ModeLM

    model = byte_model("mode_staged")
    n = 32
    full = [gen_alone(model, c, n) for c in CONTEXTS]
    texts = [TOK.decode(f) for f in full]
    # One stop string for the task: two characters that several rows reach at different steps.
    counts: dict = {}
    for t in texts:
        for a in range(1, len(t) - 1):
            if t.find(t[a : a + 2]) == a:
                counts.setdefault(t[a : a + 2], set()).add(a)
    stop = max(counts, key=lambda s: (len(counts[s]), -min(counts[s])))
    assert len(counts[stop]) >= 2, counts
    docs = [{"context": c, "target": ""} for c in CONTEXTS]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "stop_task.yaml").write_text(
        "task: stop_task\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path / 'docs.jsonl'}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: \"{{context}}\"\ndoc_to_target: \"{{target}}\"\n"
        f"generation_kwargs:\n  until: {json.dumps([stop])}\n  max_gen_toks: {n}\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    tm = TaskManager(include_path=str(tmp_path), include_defaults=False)
    lm = ModeLM(model=model, tokenizer=TOK, batch_size=4)
    with Forwards(model) as fw:
        res = lm_eval.simple_evaluate(model=lm, tasks=["stop_task"], task_manager=tm, log_samples=True)
    resps = {s["doc"]["context"]: s["resps"][0][0] for s in res["samples"]["stop_task"]}
    want = {c: reference(TOK, f, [stop])[1] for c, f in zip(CONTEXTS, full)}
    assert resps == want
    assert sum(stop in t for t in texts) >= 2 and sum(fw.rows) < len(CONTEXTS) * n


# ------------------------------------------------------------------------------------------------
# Bad options of the other run-reading commands: one line, exit 2 (like `mode generate`)


@pytest.mark.parametrize("argv,needle", [
    (["eval", "--tasks", "x"], "required: --run"),
    (["eval", "--run", "r", "--tasks", "x", "--batch-size", "z"], "--batch-size: invalid int value"),
    (["export", "--run", "r"], "required: --out"),
    (["export", "--run", "r", "--out", "o", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_eval_and_export_bad_options_are_one_line(argv, needle, capsys):
    from mode.cli import main as cli_main

    with pytest.raises(SystemExit) as e:
        raise SystemExit(cli_main(argv))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and needle in err, err

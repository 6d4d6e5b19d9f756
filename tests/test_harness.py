"""lm-evaluation-harness integration (`mode eval`); the export itself is tests/test_export.py.

Log-likelihoods are checked against the model's own logits, log-softmaxed in float64 by hand,
window by window as the docstring of mode/harness.py defines them; the requests go through
lm-eval's own `Instance` objects and `ModeLM` (the class lm-eval's registry hands out as `mode`).
Shape legend: S sequence, V vocabulary.
"""
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is the [eval] extra")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402

from mode.cli import main as cli_main  # noqa: E402
from mode.data import ByteTokenizer  # noqa: E402
from mode.generate import generate_ids  # noqa: E402
from mode.harness import ModeLM, windows  # noqa: E402
from tests.util import HARNESS_L as L  # noqa: E402
from tests.util import HARNESS_PRESETS, ROOT, fake_run, mode_cli, tiny_model  # noqa: E402

PRESETS = HARNESS_PRESETS
TOK = ByteTokenizer()


def logprobs_ref(model, inp: list[int], tgt: list[int], routing="causal"):
    """float64 log-probs of `tgt`, the tokens after the last len(tgt) positions of `inp`."""
    with torch.no_grad():
        logits_SV = model(torch.tensor([inp]), routing=routing).logits[0].double()
    lp_SV = logits_SV - torch.logsumexp(logits_SV, -1, keepdim=True)
    rows = range(len(inp) - len(tgt), len(inp))
    return [float(lp_SV[r, t]) for r, t in zip(rows, tgt)], all(int(logits_SV[r].argmax()) == t for r, t in zip(rows, tgt))


def stream_ref(model, s: list[int], start: int):
    """(sum of log-probs, all greedy) of s[start:], windows written out by hand: the next run of
    at most L targets s[p:end] is predicted from the (at most) L tokens right before s[end - 1]."""
    total, greedy, p = 0.0, True, start
    while p < len(s):
        end = min(p + L, len(s))
        lps, g = logprobs_ref(model, s[max(0, end - 1 - L) : end - 1], s[p:end])
        total, greedy, p = total + sum(lps), greedy and g, end
    return total, greedy


def rolling_ref(model, text: str) -> float:
    """Full windows: inputs s[k*L:(k+1)*L] predict s[k*L+1:(k+1)*L+1]; the last partial run is
    predicted from the L tokens right before it."""
    return stream_ref(model, [TOK.eos_id] + TOK.encode(text).tolist(), 1)[0]


DOCS = ["def f(x):\n    return x + 1\n", "a" * 5, "import os\n" * 9, "x = [i * i for i in range(10)]  # squares\n" * 2]


def test_rolling_windows_score_every_token_once():
    for n in (1, 5, L - 1, L, L + 1, 2 * L, 2 * L + 7):
        ids = list(range(100, 100 + n))
        wins = windows([-1] + ids, 1, L)  # a rolling document: EOS, then its tokens
        scored = []
        for inp, k in wins:
            assert 1 <= len(inp) <= L and 1 <= k <= len(inp)
            stream = [-1] + ids
            start = stream.index(inp[0]) if inp[0] != -1 else 0
            assert stream[start : start + len(inp)] == inp  # a contiguous piece of the stream
            scored += stream[start + len(inp) - k + 1 : start + len(inp) + 1]
        assert scored == ids  # each token exactly once, in order
        assert all(len(inp) == L for inp, _ in wins) or n < L  # long documents: full context


@pytest.mark.parametrize("preset", PRESETS)
def test_loglikelihood_rolling_equals_sum_of_logprobs(preset):
    model, _ = tiny_model(preset)
    assert max(len(d) for d in DOCS) > 2 * L  # some documents need several windows
    lm = ModeLM(model=model, tokenizer=TOK, batch_size=3)
    assert lm.scorer.batch_size == (1 if preset == "moe+capped" else 3)  # causal routing, dropless: rows batch
    reqs = [Instance("loglikelihood_rolling", {}, (d,), i) for i, d in enumerate(DOCS)]
    got = lm.loglikelihood_rolling(reqs)
    for d, g in zip(DOCS, got):
        assert abs(g - rolling_ref(model, d)) <= 1e-4, (preset, d)


@pytest.mark.parametrize("preset", PRESETS)
def test_topk_scoring_batches_rows_only_for_a_dense_model(preset):
    """Bug caught: `--routing topk` scored every model one request at a time, the dense model too,
    whose rows nothing couples; a routed model's top-k over the padded sequence must stay alone."""
    model, _ = tiny_model(preset)
    lm = ModeLM(model=model, tokenizer=TOK, routing="topk", batch_size=3)
    assert lm.scorer.batch_size == (3 if preset == "dense" else 1)
    alone = ModeLM(model=model, tokenizer=TOK, routing="topk", batch_size=1)
    reqs = [Instance("loglikelihood_rolling", {}, (d,), i) for i, d in enumerate(DOCS)]
    for a, b in zip(lm.loglikelihood_rolling(reqs), alone.loglikelihood_rolling(reqs)):
        assert abs(a - b) <= 1e-4, (preset, a, b)


@pytest.mark.parametrize("preset", PRESETS)
def test_loglikelihood_equals_direct_computation(preset):
    model, _ = tiny_model(preset)
    pairs = [("def f(x):\n    return", " x + 1"), ("", "hello"), ("abc", "d"), ("q" * 40, "rs tu"),
             ("The answer is ", "42"), ("x", ""), ("ctx ", "a continuation longer than max_seq_len tokens")]
    lm = ModeLM(model=model, tokenizer=TOK, batch_size=4)
    got = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)])
    for (ctx, cont), (ll, greedy) in zip(pairs, got):
        n_space = len(ctx) - len(ctx.rstrip())  # the harness's convention: trailing spaces go to the continuation
        ctx, cont = ctx[: len(ctx) - n_space], ctx[len(ctx) - n_space :] + cont
        s = [TOK.eos_id] + TOK.encode(ctx + cont).tolist()
        n = len(TOK.encode(cont))
        if n <= L:  # one window: the context cut from the left to L inputs
            lps, ref_greedy = logprobs_ref(model, s[:-1][-L:], s[len(s) - n :]) if n else ([], True)
            ref = sum(lps)
        else:
            ref, ref_greedy = stream_ref(model, s, len(s) - n)
        assert abs(ll - ref) <= 1e-4 and greedy == ref_greedy, (preset, ctx, cont)
    # top-k routing is allowed: each row scored alone with the training-time routing
    topk = ModeLM(model=model, tokenizer=TOK, routing="topk", batch_size=4)
    ll, _ = topk.loglikelihood([Instance("loglikelihood", {}, ("abc", "d"), 0)])[0]
    assert abs(ll - logprobs_ref(model, [TOK.eos_id, 97, 98, 99], [100], routing="topk")[0][0]) <= 1e-4


def test_an_unknown_model_arg_is_one_config_error():
    """Bug caught (README walkthrough): ModeLM took **kwargs, so model_args="run=R,rouitng=topk" scored
    under causal routing without a word; lm-eval's own extra, max_batch_size, is still accepted."""
    from mode.config import ConfigError

    model, _ = tiny_model("mod")
    with pytest.raises(ConfigError, match=r"^config error: model_args='rouitng=topk': keys of run, routing"):
        get_model("mode").create_from_arg_string("rouitng=topk", {"model": model, "tokenizer": TOK})
    lm = get_model("mode").create_from_arg_string("routing=topk", {"model": model, "tokenizer": TOK, "batch_size": 2,
                                                                   "max_batch_size": 4, "device": "cpu"})
    assert lm.scorer.routing == "topk"


def test_mode_is_registered_with_lm_eval():
    assert get_model("mode") is ModeLM


@pytest.mark.parametrize("preset", ["mod", "moe"])
def test_generate_until_stops_at_the_stop_sequence(preset):
    model, _ = tiny_model(preset)
    lm = ModeLM(model=model, tokenizer=TOK)
    ctx = "def f("
    full = TOK.decode(generate_ids(model, [[TOK.eos_id] + TOK.encode(ctx).tolist()], 16, temperature=0,
                                   eos_id=TOK.eos_id, vocab_limit=TOK.vocab_size)[0])
    assert len(full) >= 4, full
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    reqs = [Instance("generate_until", {}, (ctx, {"until": [stop], "max_gen_toks": 16}), 0),
            Instance("generate_until", {}, (ctx, {"until": ["\x00never"], "max_gen_toks": 16}), 1)]
    cut, whole = lm.generate_until(reqs)
    assert cut == full[: full.index(stop)] and stop not in cut
    assert whole == full


def test_sampled_requests_draw_their_own_samples_with_the_tasks_top_k_and_top_p():
    """Bugs caught: every sampled request drew with seed 0, so lm-eval's `repeats` copies (pass@k,
    self-consistency) were identical; a task's top_k / top_p were ignored. Each sampled request is
    checked against generate_ids called directly with the seed, top_k and top_p it should get."""
    model, _ = tiny_model("mod")
    ctx, n = "def f(", 12
    prompt = [TOK.eos_id] + TOK.encode(ctx).tolist()
    kw = {"until": ["\x00never"], "max_gen_toks": n, "do_sample": True, "temperature": 1.0}

    def direct(seed, top_k=0, top_p=1.0):
        return TOK.decode(generate_ids(model, [prompt], n, temperature=1.0, seed=seed, top_k=top_k, top_p=top_p,
                                       eos_id=TOK.eos_id, vocab_limit=TOK.vocab_size)[0])

    lm = ModeLM(model=model, tokenizer=TOK, seed=5)
    reqs = [Instance("generate_until", {}, (ctx, dict(kw)), i) for i in range(4)]  # 4 repeats of one request
    outs = lm.generate_until(reqs)
    assert outs == [direct(5 + i) for i in range(4)] and len(set(outs)) > 1, outs
    assert lm.generate_until(reqs) == outs  # a rerun draws the same samples
    narrow = lm.generate_until([Instance("generate_until", {}, (ctx, {**kw, "top_k": 3, "top_p": 0.5}), 0)])
    assert narrow == [direct(5, top_k=3, top_p=0.5)]


def test_a_null_or_largest_task_seed_draws_as_documented():
    """Bugs caught: a task's `seed: null` (the default, check_gen_kwargs says) drew with seed 0 + i
    instead of the scorer's seed N + i; the largest seed check_gen_kwargs allows (2**64 - 1) crashed
    request 1 mid-evaluation (seed 2**64: 'Overflow when unpacking long long'). torch.Generator reads
    s and s + 2**64 alike, so request 1 draws with seed 0."""
    model, _ = tiny_model("mod")
    ctx, n = "def f(", 12
    prompt = [TOK.eos_id] + TOK.encode(ctx).tolist()
    kw = {"until": ["\x00never"], "max_gen_toks": n, "do_sample": True, "temperature": 1.0}

    def direct(seed):
        return TOK.decode(generate_ids(model, [prompt], n, temperature=1.0, seed=seed, eos_id=TOK.eos_id,
                                       vocab_limit=TOK.vocab_size)[0])

    lm = ModeLM(model=model, tokenizer=TOK, seed=5)
    null = [Instance("generate_until", {}, (ctx, {**kw, "seed": None}), i) for i in range(2)]
    assert lm.generate_until(null) == [direct(5), direct(6)]
    top = [Instance("generate_until", {}, (ctx, {**kw, "seed": 2**64 - 1}), i) for i in range(2)]
    assert lm.generate_until(top) == [direct(2**64 - 1), direct(0)]


# ----------------------------------------------------------------------------------------------
# Bad input: one line, exit 2, nothing written.


def _one_line_error(capsys, argv, needle):
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("config error:") and needle in err, err


def test_bad_input_one_line_and_nothing_written(tmp_path, capsys):
    _, run = fake_run(tmp_path, "mod")
    empty = tmp_path / "empty_run"  # a run that never reached a checkpoint
    empty.mkdir()
    (empty / "config.yaml").write_text((run / "config.yaml").read_text())
    (tmp_path / "tasks").mkdir()  # a task whose data file is missing
    (tmp_path / "tasks" / "gone.yaml").write_text(_json_task("gone_ppl", tmp_path / "nope.jsonl"))
    before = sorted(tmp_path.rglob("*"))
    inc = ["--include-path", str(ROOT / "configs/eval")]
    _one_line_error(capsys, ["eval", "--run", str(empty), "--tasks", "stdlib_ppl", *inc], "complete checkpoint")
    _one_line_error(capsys, ["eval", "--run", str(run), "--tasks", "gone_ppl", "--include-path", str(tmp_path / "tasks")],
                    "data could not be loaded")
    _one_line_error(capsys, ["eval", "--run", str(run), "--tasks", "stdlib_ppl", "--routing", "sideways"], "--routing")
    # a results file beside the run's own entries: the run would be refused on every later start
    _one_line_error(capsys, ["eval", "--run", str(run), "--tasks", "stdlib_ppl", *inc, "--out", str(run / "r.json")],
                    f"outside the run directory {run} (or its eval/)")
    assert sorted(tmp_path.rglob("*")) == before  # nothing written, nothing left behind


def test_eval_reads_the_newest_checkpoint_that_verifies(tmp_path, capsys):
    """Bug caught: `mode eval` scored a newer checkpoint without MANIFEST.json (resume: "its save
    never finished") unverified; with none that verifies it is one line, exit 1, nothing written."""
    from mode import checkpoint as ckpt
    from tests.util import fake_checkpoint

    model, run = fake_run(tmp_path, "mod")  # step 3
    newer = fake_checkpoint(run, 5, tiny_model("mod", seed=2)[0].state_dict())
    (newer / ckpt.MANIFEST).unlink()
    lm = ModeLM(run=str(run), device="cpu")
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"checkpoint {newer} is unusable (no manifest: its save never finished)"), line
    assert lm.source == ckpt.step_dir(newer.parent, 3) / ckpt.MODEL
    for (k, v), (k2, v2) in zip(model.state_dict().items(), lm.scorer.model.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k
    (lm.source.parent / ckpt.MANIFEST).unlink()
    before = sorted(tmp_path.rglob("*"))
    assert cli_main(["eval", "--run", str(run), "--tasks", "stdlib_ppl", "--include-path",
                     str(ROOT / "configs/eval")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and err[-1].startswith(f"error: no checkpoint of {run} verifies"), err
    assert sorted(tmp_path.rglob("*")) == before


def _json_task(name: str, data) -> str:
    """The shipped stdlib_ppl task as a plain `dataset_path: json` YAML reading `data`."""
    y = (ROOT / "configs/eval/stdlib_ppl.yaml").read_text().replace("task: stdlib_ppl", f"task: {name}")
    y = y.replace("custom_dataset: !function local_json.load", "dataset_path: json")
    assert "dataset_path: json" in y and "test: data/stdlib_ppl.jsonl" in y
    return y.replace("test: data/stdlib_ppl.jsonl", f"test: {data}")


def test_shipped_task_runs_from_any_directory(tmp_path, capsys, monkeypatch):
    """The example YAMLs read their data relative to their own directory (configs/eval/local_json.py),
    not the current one: from elsewhere they score the same documents."""
    model, run = fake_run(tmp_path, "dense")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "r.json"
    assert cli_main(["eval", "--run", str(run), "--tasks", "stdlib_ppl", "--include-path", str(ROOT / "configs/eval"),
                     "--limit", "1", "--out", str(out)]) == 0, capsys.readouterr().err
    written = json.loads(out.read_text())
    assert written["mode"]["weights"].endswith("model.pt")  # which checkpoint was scored
    res = written["results"]["stdlib_ppl"]
    doc = json.loads((ROOT / "configs/eval/data/stdlib_ppl.jsonl").read_text().splitlines()[0])["text"]
    assert res["bits_per_byte,none"] == pytest.approx(-rolling_ref(model, doc) / len(doc.encode()) / math.log(2), abs=1e-5)


@pytest.mark.parametrize("preset,safe", [("moe", True), ("moe+capped", False)])
def test_causal_scores_of_a_capacity_capped_moe_say_they_look_ahead(tmp_path, capsys, preset, safe):
    """Bug caught: with model.moe.inference_capacity_factor set, the window's tokens share expert
    slots, so a token's experts depend on later tokens; the results file still said "causal:
    sampling-time routing (no lookahead)" and the console only "routing=causal". The file must say
    sampling_safe false with the reason, and the console warn; a dropless MoE stays sampling-safe."""
    _, run = fake_run(tmp_path, preset)
    out = tmp_path / "r.json"
    assert cli_main(["eval", "--run", str(run), "--tasks", "stdlib_ppl", "--include-path", str(ROOT / "configs/eval"),
                     "--limit", "1", "--out", str(out)]) == 0, capsys.readouterr().err
    entry, printed = json.loads(out.read_text())["mode"], capsys.readouterr().out
    assert entry["sampling_safe"] is safe, entry
    assert ("inference_capacity_factor=1.0" in entry["note"] and "lookahead" in entry["note"]) is not safe, entry
    assert (f"warning: {entry['note']}" in printed) is not safe, printed


def test_own_task_with_relative_data_says_where_it_was_read_from(tmp_path, capsys, monkeypatch):
    """A `dataset_path: json` task's relative data_files are read (by datasets) from the current
    directory: the one line says so instead of only "file not found"."""
    _, run = fake_run(tmp_path, "dense")
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "mine.yaml").write_text(_json_task("mine_ppl", "data/mine.jsonl"))
    monkeypatch.chdir(tmp_path)
    _one_line_error(capsys, ["eval", "--run", str(run), "--tasks", "mine_ppl", "--include-path", str(tmp_path / "tasks")],
                    f"read from the current directory {tmp_path}: run from")
    assert not (run / "eval").exists()


def test_a_task_reading_beside_its_yaml_is_not_told_about_the_current_directory(tmp_path, capsys, monkeypatch):
    """Bug caught: a copy of the example task (custom_dataset: local_json, data relative to the YAML)
    whose data file was missing, run from a directory above it (the repo root, as the README does),
    got the hint "relative data paths are read from the current directory ... use local_json": the
    loader it already used."""
    _, run = fake_run(tmp_path, "dense")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    shutil.copy(ROOT / "configs/eval/local_json.py", tasks)
    yaml_text = (ROOT / "configs/eval/stdlib_ppl.yaml").read_text()
    (tasks / "mine.yaml").write_text(yaml_text.replace("task: stdlib_ppl", "task: mine_ppl")
                                     .replace("data/stdlib_ppl.jsonl", "data/missing.jsonl"))
    monkeypatch.chdir(tmp_path)
    assert cli_main(["eval", "--run", str(run), "--tasks", "mine_ppl", "--include-path", "tasks"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(tasks / "data" / "missing.jsonl") in err[0], err
    assert "current directory" not in err[0], err


def test_own_task_with_missing_or_malformed_data_says_what_is_wrong(tmp_path, capsys, monkeypatch):
    """Bugs caught: a missing data file at an absolute path got the "relative paths are read from the
    current directory" hint; malformed JSON printed datasets' own log line first, then a generic
    "An error occurred while generating the dataset" as the one line."""
    _, run = fake_run(tmp_path, "dense")
    (tmp_path / "tasks").mkdir()
    gone, bad = tmp_path / "data" / "gone.jsonl", tmp_path / "data" / "bad.jsonl"
    bad.parent.mkdir()
    bad.write_text('{"text": "abc"\n')
    (tmp_path / "tasks" / "gone.yaml").write_text(_json_task("gone_ppl", str(gone)))
    (tmp_path / "tasks" / "bad.yaml").write_text(_json_task("bad_ppl", str(bad)))
    monkeypatch.chdir(ROOT)
    argv = ["eval", "--run", str(run), "--include-path", str(tmp_path / "tasks"), "--tasks"]
    assert cli_main([*argv, "gone_ppl"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gone.jsonl" in err[0] and "current directory" not in err[0], err
    assert cli_main([*argv, "bad_ppl"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: --tasks='bad_ppl'") and "JSON" in err[0], err
    assert "An error occurred while generating" not in err[0]
    assert not (run / "eval").exists()


def _generate_task(name: str, gen_kwargs: str) -> str:
    """The shipped stdlib_complete task (generate_until) with its own generation_kwargs block (`until`
    the newline unless given: lm-eval warns about a task without one)."""
    y = (ROOT / "configs/eval/stdlib_complete.yaml").read_text().replace("task: stdlib_complete", f"task: {name}")
    y = y.replace("custom_dataset: !function local_json.load", "dataset_path: json")
    y = y.replace("test: data/stdlib_complete.jsonl", f"test: {ROOT / 'configs/eval/data/stdlib_complete.jsonl'}")
    block = '  until: ["\\n"]\n  max_gen_toks: 48\n  do_sample: false\n'
    assert "dataset_path: json" in y and block in y
    lines = gen_kwargs.split(";") + ([] if "until" in gen_kwargs else ['until: ["\\n"]'])
    return y.replace(block, "".join(f"  {line}\n" for line in lines))


BAD_GEN_KWARGS = {  # generation_kwargs lines -> the line mode eval prints; what each did before
    "max_gen_toks: abc": "generation_kwargs.max_gen_toks='abc': an integer >= 1",  # ValueError mid-evaluation
    "until: 5": "generation_kwargs.until=5: non-empty strings",  # TypeError
    "top_p: -1": "generation_kwargs.top_p=-1: in (0, 1]",  # RuntimeError
    "seed: 1180591620717411303424": "generation_kwargs.seed=1180591620717411303424: an integer in [-2**63, 2**64)",
    "top_p: 0": "generation_kwargs.top_p=0: in (0, 1]",  # became 1.0
    "do_sample: true;temperature: nan": "generation_kwargs.temperature=nan: a finite number >= 0",  # ran greedy
    "do_sample: true;temperature: -1": "generation_kwargs.temperature=-1.0: a finite number >= 0",  # ran greedy
    "max_gen_toks: -5": "generation_kwargs.max_gen_toks=-5: an integer >= 1",  # became 1
    "do_sample: 'no'": "generation_kwargs.do_sample='no': true or false",  # sampled
}


def test_bad_generation_kwargs_of_a_task_are_one_line_before_anything_is_generated(tmp_path, capsys, monkeypatch):
    """Bugs caught: a task's generation_kwargs were read only while generating (mid-evaluation
    errors) or changed silently, though `mode generate` refuses the same values. Now checked by the
    same rules (mode.generate.check_sampling) when the task is loaded, before anything is evaluated."""
    import mode.harness as h

    evaluated = []
    monkeypatch.setattr(h, "ModeLM", lambda **kw: None)  # the task check needs no model
    monkeypatch.setattr("lm_eval.simple_evaluate", lambda **kw: evaluated.append(kw))
    (tmp_path / "tasks").mkdir()
    for i, kw in enumerate(BAD_GEN_KWARGS):
        (tmp_path / "tasks" / f"g{i}.yaml").write_text(_generate_task(f"gen{i}", kw))
    argv = ["eval", "--run", str(tmp_path / "run"), "--include-path", str(tmp_path / "tasks"), "--tasks"]
    for i, (kw, line) in enumerate(BAD_GEN_KWARGS.items()):
        _one_line_error(capsys, [*argv, f"gen{i}"], f"config error: task gen{i}: {line}")
    assert evaluated == [] and not (tmp_path / "run").exists()
    # lm-eval's own Python API reaches the model with generation_kwargs mode eval never saw: checked there too
    model, _ = tiny_model("mod")
    lm = ModeLM(model=model, tokenizer=TOK)
    ok = Instance("generate_until", {}, ("def f(", {"until": ["\n"], "max_gen_toks": 4}), 0)
    bad = Instance("generate_until", {}, ("def f(", {"until": ["\n"], "max_gen_toks": 4, "top_p": 0}), 1)
    with pytest.raises(h.ConfigError, match=r"generation_kwargs.top_p=0: in \(0, 1\]"):
        lm.generate_until([ok, bad])


def test_a_tasks_unimplemented_generation_kwargs_are_one_warning_line(tmp_path, capsys):
    """Bug caught: keys mode does not implement (num_beams: a beam search) were dropped silently, so
    the task was scored greedy with no notice. Now one warning line per task names them; the task
    still loads (standard tasks carry harmless extras), and lm-eval's own do_sample is no extra."""
    import mode.harness as h

    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "b.yaml").write_text(_generate_task("beams", "num_beams: 4;repetition_penalty: 1.1"))
    (tmp_path / "tasks" / "p.yaml").write_text(_generate_task("plain", "do_sample: false;max_gen_toks: 8"))
    h._task_manager(["beams", "plain"], str(tmp_path / "tasks"))
    assert capsys.readouterr().err.strip().splitlines() == [
        "warning: task beams: generation_kwargs num_beams, repetition_penalty ignored "
        "(mode implements max_gen_toks, temperature, top_k, top_p, until, seed, do_sample)"]
    assert h.check_gen_kwargs({"until": ["\n"], "do_sample": False, "max_gen_toks": 4}) == []


@pytest.mark.parametrize("until", ['""', '["", "\\n"]', "null", "[]"])
def test_an_empty_until_string_is_no_stop_sequence(until):
    """Bug caught: a bare `until: ""` was refused while the same empty string in a list was skipped
    (lm-eval's generate_until reads it as no stop sequence). Both mean none now; the request ends
    at max_gen_toks."""
    import yaml

    from mode.harness import check_gen_kwargs

    kw = {"until": yaml.safe_load(until), "max_gen_toks": 4}
    assert check_gen_kwargs(kw) == []
    model, _ = tiny_model("dense")
    (out,) = ModeLM(model=model, tokenizer=TOK).generate_until([Instance("generate_until", {}, ("def f(", kw), 0)])
    assert len(TOK.encode(out)) <= 4


def test_without_lm_eval_one_line_says_how_to_install(tmp_path, capsys, monkeypatch):
    import mode.harness

    monkeypatch.setattr(mode.harness, "ModeLM", None)  # what the module holds when `import lm_eval` fails
    _, run = fake_run(tmp_path, "dense")
    assert cli_main(["eval", "--run", str(run), "--tasks", "stdlib_ppl"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install -e '.[eval]'" in err[0]


@pytest.mark.slow  # an unknown name is only unknown after indexing lm-eval's ~15k built-in tasks (~25 s)
def test_unknown_task_is_one_line(tmp_path):
    _, run = fake_run(tmp_path, "mod")
    r = mode_cli("eval", "--run", run, "--tasks", "stdlib_ppl,no_such_task_xyz", "--include-path", "configs/eval",
                 check=False)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        r.stderr.strip()] and "config error: --tasks='no_such_task_xyz'" in r.stderr, r.stderr
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.yaml"]


@pytest.mark.slow  # a standard task: indexing lm-eval's built-in tasks (~25 s)
def test_standard_task_without_its_data_or_the_hub_is_one_line(tmp_path):
    """arc_easy with an empty HF cache and a hub that refuses connections: one line naming the task,
    the cache and why the hub is out of reach, instead of ~50 s of datasets' retry log lines."""
    _, run = fake_run(tmp_path, "dense")
    r = mode_cli("eval", "--run", run, "--tasks", "arc_easy", "--limit", "2", check=False, timeout=60,  # hang guard
                 extra_env={"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": "http://127.0.0.1:9"})
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1, r.stderr
    assert err[0].startswith("config error: --tasks='arc_easy': its data is neither in the local Hugging Face cache")
    assert str(tmp_path / "hf") in err[0] and "http://127.0.0.1:9" in err[0] and "--include-path" in err[0]
    assert not (run / "eval").exists()


# ----------------------------------------------------------------------------------------------
# End to end through the CLI: a run as the trainer leaves it (no training needed: log-likelihood
# plumbing does not depend on the weights), exported, evaluated on the shipped example tasks.


@pytest.mark.slow
def test_export_eval_generate_end_to_end(tmp_path):
    model, run = fake_run(tmp_path, "mod")
    mode_cli("export", "--run", run, "--out", tmp_path / "export")
    out = tmp_path / "results.json"
    r = mode_cli("eval", "--run", tmp_path / "export", "--tasks", "mode_example", "--include-path", "configs/eval",
                 "--limit", "3", "--batch-size", "4", "--out", out)
    res = json.loads(out.read_text())
    assert res["mode"]["routing"] == "causal"
    assert set(res["results"]) >= {"stdlib_ppl", "stdlib_next_line", "stdlib_complete"}
    assert 0 <= res["results"]["stdlib_next_line"]["acc,none"] <= 1
    assert "| stdlib_ppl | bits_per_byte |" in r.stdout
    # bits per byte of the 3 documents, from the model's own logits (byte tokenizer: 1 token = 1 byte)
    docs = [json.loads(ln)["text"] for ln in (ROOT / "configs/eval/data/stdlib_ppl.jsonl").read_text().splitlines()[:3]]
    nats = -sum(rolling_ref(model, d) for d in docs)
    n_bytes = sum(len(d.encode()) for d in docs)
    assert abs(res["results"]["stdlib_ppl"]["bits_per_byte,none"] - nats / n_bytes / math.log(2)) <= 1e-5
    # multiple choice through the harness: acc = the gold choice has the highest log P(choice | context),
    # each computed here from the model's logits (the choice follows the context directly)
    def ll(ctx, cont):
        s = [TOK.eos_id] + TOK.encode(ctx + cont).tolist()
        return stream_ref(model, s, len(s) - len(TOK.encode(cont)))[0]

    mc = [json.loads(ln) for ln in (ROOT / "configs/eval/data/stdlib_next_line.jsonl").read_text().splitlines()[:3]]
    hits = [max(range(len(d["choices"])), key=lambda j: ll(d["context"], d["choices"][j])) == d["gold"] for d in mc]
    assert res["results"]["stdlib_next_line"]["acc,none"] == pytest.approx(sum(hits) / 3)
    # the run directory itself, with top-k routing, and its default results path
    mode_cli("eval", "--run", run, "--tasks", "stdlib_next_line", "--include-path", "configs/eval", "--limit", "2",
             "--routing", "topk")
    res = json.loads((run / "eval" / "results_stdlib_next_line_topk_limit2.json").read_text())  # --limit in the name
    assert res["mode"]["routing"] == "topk" and "stdlib_next_line" in res["results"]
    g = mode_cli("generate", "--run", tmp_path / "export", "--prompt", "def ", "--max-new-tokens", "4")
    assert g.stdout.startswith("=== [0] 4 tokens ===\ndef ")  # mode generate's header, then prompt + sample


# ----------------------------------------------------------------------------------------------
# Where the results go: checked before anything is evaluated (the harness itself is a stub here).


@pytest.fixture
def stub_harness(monkeypatch):
    """mode eval with a stub harness: no model is loaded, no task indexed. Returns the list of
    evaluations started (so a test can say none was)."""
    import mode.harness as h

    started = []

    def simple_evaluate(**kw):
        started.append(kw["tasks"])
        return {"results": {t: {"acc,none": 0.5} for t in kw["tasks"]}}

    monkeypatch.setattr(h, "ModeLM", lambda **kw: object())
    monkeypatch.setattr(h, "_task_manager", lambda tasks, include_path: (None, False))
    monkeypatch.setattr(lm_eval, "simple_evaluate", simple_evaluate)
    return started


def test_an_explicit_out_in_the_runs_own_eval_folder_is_made(tmp_path, capsys, stub_harness):
    """Bug caught: `--out RUN/eval/x.json` (the README's place for results) was refused ("a file in
    an existing directory (RUN/eval does not exist)") until a default-path eval had made RUN/eval."""
    (tmp_path / "run").mkdir()
    out = tmp_path / "run" / "eval" / "x.json"
    assert cli_main(["eval", "--run", str(tmp_path / "run"), "--tasks", "t1", "--out", str(out)]) == 0, \
        capsys.readouterr().err
    assert json.loads(out.read_text())["results"] == {"t1": {"acc,none": 0.5}} and stub_harness == [["t1"]]
    _one_line_error(capsys, ["eval", "--run", str(tmp_path / "run"), "--tasks", "t1", "--out",
                             str(tmp_path / "run" / "other" / "x.json")], "does not exist)")


def test_an_out_ending_in_a_slash_or_an_empty_option_is_refused(tmp_path, capsys, stub_harness):
    """Bug caught (README walkthrough): `--out results/` (a new directory, as typed) wrote the results
    as a file named `results`: pathlib drops the trailing slash."""
    (tmp_path / "run").mkdir()
    _one_line_error(capsys, ["eval", "--run", str(tmp_path / "run"), "--tasks", "t1", "--out",
                             f"{tmp_path / 'results'}/"], "a file path, not a directory (it ends in /)")
    assert not (tmp_path / "results").exists() and stub_harness == []
    # an empty --out (an unset $OUT) was taken as none: the results went to RUN/eval/ instead
    _one_line_error(capsys, ["eval", "--run", str(tmp_path / "run"), "--tasks", "t1", "--out", ""],
                    "--out='': a non-empty path (an unset shell variable?)")
    assert not (tmp_path / "run" / "eval").exists() and stub_harness == []
    # an empty --include-path was taken as none: the built-in tasks indexed (~25 s), a local task "unknown"
    _one_line_error(capsys, ["eval", "--run", str(tmp_path / "run"), "--tasks", "t1", "--include-path", ""],
                    "--include-path='': a non-empty path (an unset shell variable?)")
    assert stub_harness == []


def test_eval_refuses_to_overwrite_a_file_it_did_not_write(tmp_path, capsys, stub_harness):
    """Bug caught: `mode eval ... --out notes.txt` silently replaced an existing file (unlike `mode
    export`, which refuses). An existing --out is now replaced only when it is a results file mode
    eval wrote (its `mode` entry says written_by: mode eval); anything else is one line, nothing run."""
    argv = ["eval", "--run", str(tmp_path / "run"), "--tasks", "t1"]
    for name, text in (("notes.txt", "my notes\n"), ("r.json", '{"results": {"mine": 1}}'), ("x.json", "[1, 2]")):
        f = tmp_path / name
        f.write_text(text)
        _one_line_error(capsys, [*argv, "--out", str(f)], f"--out={str(f)!r}: a new file or a results file mode eval "
                                                          "wrote (this file is not one: mode eval will not overwrite it)")
        assert f.read_text() == text
    assert stub_harness == []
    out = tmp_path / "results.json"
    for _ in range(2):  # its own results file: a rerun replaces it
        assert cli_main([*argv, "--out", str(out)]) == 0, capsys.readouterr().err
        assert json.loads(out.read_text())["mode"]["written_by"] == "mode eval"
    old = json.loads(out.read_text())  # written before the written_by, weights and sampling_safe keys existed
    del old["mode"]["written_by"], old["mode"]["weights"], old["mode"]["sampling_safe"]
    out.write_text(json.dumps(old))
    assert cli_main([*argv, "--out", str(out)]) == 0, capsys.readouterr().err
    assert len(stub_harness) == 3


def test_eval_default_out_never_replaces_a_users_file_and_stays_a_valid_name(tmp_path, capsys, stub_harness):
    """Bugs caught: the default RUN/eval/results_<tasks>_<routing>.json was overwritten even when a
    user's file sat there (only an explicit --out was checked); and many task names joined into
    one file name passed the filesystem's 255 bytes (a traceback after evaluating)."""
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    mine = run / "eval" / "results_t1_causal.json"
    mine.write_text('{"my": "notes"}')
    _one_line_error(capsys, ["eval", "--run", str(run), "--tasks", "t1"], "mode eval will not overwrite it; pass --out")
    assert mine.read_text() == '{"my": "notes"}' and stub_harness == []
    tasks = [f"a_rather_long_benchmark_task_name_{i:02d}" for i in range(24)]
    assert cli_main(["eval", "--run", str(run), "--tasks", ",".join(tasks)]) == 0, capsys.readouterr().err
    [written] = [p for p in (run / "eval").iterdir() if p != mine]
    assert len(written.name.encode()) <= 255 and written.name.startswith(f"results_{tasks[0]}+23more-")
    assert sorted(json.loads(written.read_text())["results"]) == sorted(tasks)


def test_a_limited_evaluation_never_replaces_the_full_one(tmp_path, capsys, stub_harness):
    """Bug caught (README walkthrough): `--limit 5`, a smoke test, wrote the default file of the full
    evaluation (results_<tasks>_<routing>.json, mode eval's own, so replaced without a word)."""
    run = tmp_path / "run"
    run.mkdir()
    for limit in ([], ["--limit", "5"], ["--limit", "0.25"]):
        assert cli_main(["eval", "--run", str(run), "--tasks", "t1", *limit]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in (run / "eval").iterdir()) == [
        "results_t1_causal.json", "results_t1_causal_limit0.25.json", "results_t1_causal_limit5.json"]


@pytest.mark.parametrize("a,b", [(1234567, 1234568), (0.1234561, 0.1234564), (10**7, 10**7 + 1)])
def test_limits_that_differ_never_share_a_results_file(a, b):
    """Bug caught (README walkthrough): `_limit{limit:g}` kept 6 significant digits, so --limit 1234567
    and --limit 1234568 (or two fractions alike to 6 digits) named one file and the second run
    replaced the first's results."""
    from mode.harness import default_out_name

    names = {default_out_name(["t1"], "causal", float(x)) for x in (a, b)}
    assert len(names) == 2 and default_out_name(["t1"], "causal", 1234567.0).endswith("_limit1234567.json")
    assert default_out_name(["t1"], "causal", 5.0).endswith("_limit5.json")  # names the earlier rule gave stay
    assert default_out_name(["t1"], "causal", 0.25).endswith("_limit0.25.json")


def test_eval_checks_that_the_out_location_is_writable_before_evaluating(tmp_path, capsys, stub_harness):
    """Bug caught: the output location was only written after the whole evaluation, so an unwritable
    --out lost the results (PermissionError at the end). Then os.access checked it, which says yes to
    root everywhere and to /proc and /sys: a real file is created and removed there first."""
    import os

    places = [Path("/proc")]  # refuses new files for root too
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() != 0:
        places.append(ro)
    try:
        for place in places:
            _one_line_error(capsys, ["eval", "--run", str(tmp_path / "run"), "--tasks", "t1", "--out",
                                     str(place / "r.json")], f"--out={str(place / 'r.json')!r}: a writable location ({place}: ")
    finally:
        ro.chmod(0o755)
    assert stub_harness == [] and list(ro.iterdir()) == []
    (tmp_path / "notes.md").write_text("mine")  # a parent that is a file is named as one
    _one_line_error(capsys, ["eval", "--run", str(tmp_path / "run"), "--tasks", "t1", "--out",
                             str(tmp_path / "notes.md" / "r.json")], f"({tmp_path / 'notes.md'} is a file)")


def test_results_that_cannot_be_written_leave_no_file_and_name_theirs(tmp_path):
    """Bug caught: on a full disk (the writability check before evaluating writes an empty file, so it
    passes) `mode eval` left `.r.json.tmp` beside --out and said only `error: no space left on
    device`. A real failed write here: a file size limit (RLIMIT_FSIZE: EFBIG past 16 bytes)."""
    import resource
    import signal

    from mode.errors import one_line
    from mode.harness import write_results

    out = tmp_path / "eval" / "r.json"
    limit, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (16, limit[1]))
        with pytest.raises(OSError) as e:
            write_results(out, {"results": {"t": {"acc": 0.5}}})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
    assert list(out.parent.iterdir()) == []
    line, code = one_line(e.value)
    assert code == 1 and str(out) in line, line
    write_results(out, {"results": {}})  # and with room, the file whole
    assert json.loads(out.read_text()) == {"results": {}} and list(out.parent.iterdir()) == [out]


@pytest.mark.parametrize("limit", ["nan", "inf", "1.5", "1e19"])
def test_eval_non_finite_limit_is_one_config_error(tmp_path, capsys, stub_harness, limit):
    """Bug caught: `mode eval --limit nan` passed the `> 0` check and died in int() with a ValueError
    line (inf: OverflowError); 1.5 scored one document silently."""
    _one_line_error(capsys, ["eval", "--run", str(tmp_path / "run"), "--tasks", "t1", "--limit", limit],
                    f"config error: --limit={float(limit)!r}: a finite number > 0")
    assert stub_harness == []

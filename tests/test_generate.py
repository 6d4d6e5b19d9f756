"""KV-cache generation with causal depth routing, batched over prompts of different lengths.

Shape legend: B rows, T steps, V vocab.
"""
import shutil

import pytest
import torch

from mode.config import Config, ModConfig, ModelConfig, dump_config
from mode.data import ByteTokenizer
from mode.generate import cli_generate, generate, generate_ids, latest_checkpoint, load_run
from mode.mod import MoDBlock
from mode.model import build_model


def tiny(layers="every_other", causal="predictor", vocab=320, seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, d_model=32, n_layers=4, n_heads=2, d_ff=64, max_seq_len=64,
                      mod=ModConfig(layers=layers, capacity=0.25, causal=causal))
    model = build_model(cfg).eval()
    for b in model.blocks:  # an untrained predictor/router outputs ~0: spread it so rows route differently
        if isinstance(b, MoDBlock):
            lin = b.router.predictor[2] if b.router.predictor is not None else b.router.router
            torch.nn.init.normal_(lin.weight, std=3.0 / lin.weight.shape[1] ** 0.5)
    return model


PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [3, 1, 4, 1, 5], [7]]


@pytest.mark.parametrize("layers,causal", [("every_other", "predictor"), ("every_other", "aux_loss"), ("none", "none")])
def test_cached_logits_equal_full_causal_forward(layers, causal):
    model = tiny(layers, causal)
    _, tr = generate_ids(model, PROMPTS, max_new_tokens=9, temperature=1.0, seed=3, return_trace=True)
    T = tr.logits_BTV.shape[1]
    assert T == max(len(p) for p in PROMPTS) + 9 - 1
    for i, p in enumerate(PROMPTS):  # prompts were fed, then samples
        assert tr.tokens_BT[i, : len(p)].tolist() == p
    caches = model.new_caches(len(PROMPTS), T)  # re-run step by step to read the caches afterwards
    with torch.no_grad():
        for t in range(T):
            model(tr.tokens_BT[:, t : t + 1], routing="causal", pos_BS=torch.full((len(PROMPTS), 1), t), caches=caches)
        full = model(tr.tokens_BT[:, :T], routing="causal")
    v = tr.valid_BT  # each row computes its prompt and new tokens (prefill, then decoding)
    torch.testing.assert_close(tr.logits_BTV[v], full.logits.float()[v], rtol=1e-5, atol=1e-5)
    routed = [i for i, b in enumerate(model.blocks) if isinstance(b, MoDBlock)]
    assert len(routed) == (2 if layers == "every_other" else 0)
    for i, (b, c) in enumerate(zip(model.blocks, caches)):
        if i in routed:  # the routed layer cached exactly the tokens it processed, per row
            processed_B = b.last_selected_BS.sum(1)
            assert torch.equal(c.len_B, processed_B)
            assert 0 < int(processed_B.min()) and int(processed_B.max()) < T
            assert len(set(c.len_B.tolist())) > 1, "rows should route differently"
        else:
            assert c.len_B.tolist() == [T] * len(PROMPTS)


def test_rows_do_not_interact_and_greedy_is_deterministic():
    model = tiny()
    both = generate_ids(model, PROMPTS, 6, temperature=0)
    alone = [generate_ids(model, [p], 6, temperature=0)[0] for p in PROMPTS]
    assert both == alone
    assert all(len(o) == 6 for o in both)


def test_sampling_seeded_topk_and_vocab_limit():
    model = tiny()
    a = generate_ids(model, PROMPTS, 8, temperature=1.5, top_k=5, seed=1, vocab_limit=50)
    b = generate_ids(model, PROMPTS, 8, temperature=1.5, top_k=5, seed=1, vocab_limit=50)
    c = generate_ids(model, PROMPTS, 8, temperature=1.5, top_k=5, seed=2, vocab_limit=50)
    assert a == b and a != c
    assert all(0 <= t < 50 for row in a for t in row)


def test_a_tiny_temperature_is_greedy_and_a_stop_string_is_one_string():
    """Bugs caught: logits / 1e-45 overflowed to inf and the softmax to NaN (a RuntimeError); a
    plain string as `stop` was read as its characters (stopping at the first one)."""
    from mode.generate import _stop_rows

    model = tiny()
    greedy = generate_ids(model, PROMPTS, 6, temperature=0)
    assert generate_ids(model, PROMPTS, 6, temperature=1e-45, seed=3) == greedy
    with pytest.raises(ValueError, match="temperature"):
        generate_ids(model, PROMPTS, 2, temperature=float("inf"))
    assert _stop_rows("\n\n", 2) == [["\n\n"], ["\n\n"]]


def test_eos_stops_a_row_and_length_limit():
    model = tiny()
    greedy = generate_ids(model, [[5]], 10, temperature=0)[0]
    cut = generate_ids(model, [[5]], 10, temperature=0, eos_id=greedy[3])[0]
    assert cut == greedy[: greedy.index(greedy[3])]
    with pytest.raises(ValueError, match="max_seq_len"):
        generate_ids(model, [[1] * 60], 10)


def test_generate_text_and_load_run(tmp_path):
    model = tiny(vocab=320)
    tok = ByteTokenizer()
    outs = generate(model, tok, ["def ", ""], max_new_tokens=5, temperature=0.8, seed=0)
    assert len(outs) == 2 and all(isinstance(o, str) for o in outs)
    # A run dir as the trainer leaves it: config.yaml and checkpoints/step_*/model.pt; a .tmp
    # (incomplete) newer checkpoint and an older one must both be ignored.
    cfg = Config(model=model.cfg)
    cfg.data.seq_len = 32
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    from tests.util import fake_checkpoint

    for step, m in ((5, tiny(seed=1)), (10, model), (20, tiny(seed=2))):
        d = fake_checkpoint(tmp_path, step, m.state_dict())
    d.rename(d.with_name(d.name + ".tmp"))  # step 20 still being written
    assert latest_checkpoint(tmp_path).name == "step_00000010"
    loaded, tok2, cfg2 = load_run(tmp_path)
    assert cfg2.model.mod.layers == "every_other" and not loaded.training
    for (k, v), (k2, v2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    cfg.data.source = str(tmp_path / "moved.txt")  # the training data is gone: sampling still works
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    assert load_run(tmp_path)[2].model == cfg.model
    texts = cli_generate(str(tmp_path), ["ab"], max_new_tokens=4, temperature=0.0, seed=0)
    assert texts == ["ab" + generate(model, tok, ["ab"], 4, temperature=0.0)[0]]


def test_a_config_yaml_written_back_with_another_model_key_is_refused(tmp_path):
    """Bug caught: generate, eval and export built the model from config.yaml alone; one written back
    by hand with another model.rope_theta or model.mod.capacity loaded the checkpoint silently (same
    shapes) and sampled a model that was never trained. The checkpoint's own record decides; keys
    that leave the trained function as it is (sampling-time capacity, loss weights) may differ."""
    from mode.config import ConfigError, dump_config, load_config
    from tests.util import fake_run

    model, run = fake_run(tmp_path, "mode_integrated")
    trained = run / "trained.yaml"
    (run / "config.yaml").rename(trained)
    cfg = load_config(trained)
    for key, value in (("model.rope_theta", 500.0), ("model.mod.capacity", 0.5), ("model.moe.top_k", 1)):
        other = load_config(trained, [f"{key}={value}"])
        (run / "config.yaml").write_text(dump_config(other))
        with pytest.raises(ConfigError) as e:
            load_run(run)
        line = str(e.value)
        assert "\n" not in line and f"differs from the config checkpoint step_00000003 was trained with ({key}: " in line
        assert line.count(" -> ") == 1, line  # only the key that changed
    other = load_config(trained, ["model.moe.inference_capacity_factor=1.0", "model.moe.lb_loss_weight=0.1"])
    (run / "config.yaml").write_text(dump_config(other))
    loaded, _, cfg2 = load_run(run)
    assert cfg2.model.moe.inference_capacity_factor == 1.0 and cfg2.model.rope_theta == cfg.model.rope_theta
    for (k, v), (k2, v2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)


# ----------------------------------------------------------------------------------------------
# Which checkpoint the readers of weights (generate, eval, export: load_run) take: resume's rule.


def damage(d, how: str) -> None:
    """Damage checkpoint directory d as the bug reports found it."""
    from mode import checkpoint as ckpt

    if "no manifest" in how:
        (d / ckpt.MANIFEST).unlink()
    if "truncated" in how:
        f = d / ckpt.MODEL
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def run_with_two_checkpoints(tmp_path):
    """A run dir (config.yaml) with step 2 holding `good`'s weights and step 4 other weights;
    returns (run dir, good, step 4's directory)."""
    from tests.util import fake_checkpoint

    good = tiny(seed=1)
    cfg = Config(model=good.cfg)
    cfg.data.seq_len = 32
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    fake_checkpoint(tmp_path, 2, good.state_dict())
    return tmp_path, good, fake_checkpoint(tmp_path, 4, tiny(seed=2).state_dict())


@pytest.mark.parametrize("how", ["no manifest", "truncated, no manifest", "truncated"])
def test_readers_skip_a_newest_checkpoint_resume_would_not_use(tmp_path, capsys, how):
    """Bugs caught: a checkpoint without MANIFEST.json (resume: "its save never finished") was read
    unverified: its weights sampled with exit 0, or, truncated, `error: RuntimeError:
    PytorchStreamReader failed reading zip archive` instead of falling back to the previous one."""
    from mode import checkpoint as ckpt
    from mode.cli import main

    run, good, newest = run_with_two_checkpoints(tmp_path)
    damage(newest, how)
    before = sorted(p.name for p in newest.parent.iterdir())
    loaded, tok, _ = load_run(run)
    for (k, v), (k2, v2) in zip(good.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k  # step 2's weights
    why = {"no manifest": "no manifest: its save never finished", "truncated, no manifest": "no manifest",
           "truncated": "model.pt is"}[how]
    assert ckpt.newest_verified(newest.parent, move_aside=False, log=lambda s: None) == ckpt.step_dir(newest.parent, 2)
    capsys.readouterr()
    assert main(["generate", "--run", str(run), "--prompt", "ab", "--max-new-tokens", "4", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert out == f"=== [0] 4 tokens ===\nab{generate(good, tok, ['ab'], 4, temperature=0.0)[0]}\n"
    [line] = err.strip().splitlines()  # one line: which checkpoint was skipped and why
    assert line.startswith(f"checkpoint {newest} is unusable ({why}") and "falling back" in line, line
    assert sorted(p.name for p in newest.parent.iterdir()) == before  # reading never changes a run


def test_readers_with_no_checkpoint_that_verifies_say_so_in_one_line(tmp_path, capsys):
    """Every checkpoint damaged: one line per skipped checkpoint, then `error: ...` (exit 1, as any
    runtime fault), not a traceback and not a sample from unverified weights."""
    from mode import checkpoint as ckpt
    from mode.cli import main

    run, _, newest = run_with_two_checkpoints(tmp_path)
    damage(newest, "truncated")
    damage(ckpt.step_dir(newest.parent, 2), "no manifest")
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint of .* verifies"):
        load_run(run)
    capsys.readouterr()
    assert main(["generate", "--run", str(run), "--prompt", "ab", "--max-new-tokens", "4"]) == 1
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 3, lines
    assert "step_00000004 is unusable (model.pt is" in lines[0] and "falling back" in lines[0], lines
    assert "step_00000002 is unusable (no manifest" in lines[1] and "no earlier one is left" in lines[1], lines
    assert lines[2] == (f"error: no checkpoint of {run} verifies (step_00000004, step_00000002: each reported "
                        "above), so there are no weights to read"), lines
    for step in (2, 4):  # a run with no checkpoint at all is still bad input (exit 2), as before
        shutil.rmtree(ckpt.step_dir(newest.parent, step))
    assert main(["generate", "--run", str(run), "--prompt", "ab"]) == 2
    assert "none yet; train it first" in capsys.readouterr().err


@pytest.mark.parametrize("preset", ["moe", "moe+capped"])
def test_a_batch_whose_prompts_share_expert_slots_is_said(tmp_path, capsys, preset):
    """Bug caught: with model.moe.inference_capacity_factor set, the prompts of one `mode generate`
    share expert slots (a prompt's output depends on the others), and nothing said so; `mode eval`
    warned. One prompt, or dropless experts: no warning."""
    from tests.util import fake_run

    _, run = fake_run(tmp_path, preset)
    for prompts in (["a"], ["a", "bc"]):
        cli_generate(str(run), prompts, 2, temperature=0)
        said = "share expert slots" in capsys.readouterr().err
        assert said is (preset == "moe+capped" and len(prompts) > 1), (preset, prompts)

"""`mode export`: a portable model (safetensors + config + tokenizer) that `load_run` reads back
with the same logits and the same tokenizer as the run it came from. Needs no lm-eval."""
import json
import os
import re
import shutil
import stat
from pathlib import Path

import pytest
import torch

from mode.cli import main as cli_main
from mode.config import dump_config, load_config
from mode.data import ByteTokenizer
from mode.generate import load_run
from mode.model import build_model
from tests.util import HARNESS_SMALL, ROOT, TINY, deepspeed_train, fake_checkpoint, fake_run, scalars, tiny_model

TOK = ByteTokenizer()


@pytest.mark.parametrize("preset", ["mod", "moe"])
def test_export_gives_the_same_logits(tmp_path, preset, monkeypatch):
    model, run = fake_run(tmp_path, preset)
    (tmp_path / "out").mkdir()  # an existing empty directory is fine
    monkeypatch.chdir(tmp_path)  # relative paths, as typed: export.json records both absolute
    assert cli_main(["export", "--run", run.name, "--out", "out"]) == 0
    info = json.loads((tmp_path / "out" / "export.json").read_text())
    assert info["run"] == str(run.resolve()) and Path(info["checkpoint"]).is_absolute(), info  # was cwd-relative
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == ["config.yaml", "export.json", "model.safetensors"]
    from safetensors import safe_open  # a plain tensor container: opening it runs no pickle

    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert names == set(model.state_dict()) - {"head.weight"}  # tied to embed.weight: stored once
    loaded, tok, cfg = load_run(tmp_path / "out")
    assert cfg.model == model.cfg
    ids = torch.tensor([[TOK.eos_id] + TOK.encode("for i in range(3):").tolist()])
    with torch.no_grad():
        for routing in ("causal", "topk"):
            assert torch.equal(model(ids, routing=routing).logits, loaded(ids, routing=routing).logits)
    shutil.rmtree(run)  # the export stands alone


def test_a_damaged_exports_weights_are_refused_in_one_line_naming_the_file(tmp_path, capsys):
    """Bug caught: an export's model.safetensors was read back unverified: bytes flipped inside a
    tensor loaded and sampled from damaged weights, and a damaged header was `error: SafetensorError:
    ...` naming no file. export.json records the file's sha256 now; load_run checks it."""
    import hashlib

    _, run = fake_run(tmp_path, "mod")
    out = tmp_path / "out"
    assert cli_main(["export", "--run", str(run), "--out", str(out)]) == 0
    weights = out / "model.safetensors"
    info = json.loads((out / "export.json").read_text())
    assert info["weights_sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    good = weights.read_bytes()
    for where in (len(good) - 40, 3):  # inside the last tensor; inside the header's length
        bad = bytearray(good)
        bad[where] ^= 0xFF
        weights.write_bytes(bytes(bad))
        assert cli_main(["generate", "--run", str(out), "--prompt", "x", "--max-new-tokens", "1"]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {weights} is damaged"), err
    info.pop("weights_sha256")  # an export from before the hash: the reader's own error, naming the file
    (out / "export.json").write_text(json.dumps(info))
    assert cli_main(["generate", "--run", str(out), "--prompt", "x", "--max-new-tokens", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: cannot read {weights}: SafetensorError"), err
    weights.write_bytes(good)
    assert cli_main(["generate", "--run", str(out), "--prompt", "x", "--max-new-tokens", "1"]) == 0


def test_an_exports_config_yaml_edited_with_another_model_key_is_refused(tmp_path):
    """Bug caught: an export's config.yaml edited by hand (model.rope_theta, model.norm_eps) loaded
    its weights silently into a model never trained (the run's checkpoints record their config;
    exports did not). export.json records the model config; a sampling-time key may differ."""
    from mode.config import ConfigError, dump_config, load_config

    model, run = fake_run(tmp_path, "mode_integrated")
    out = tmp_path / "out"
    assert cli_main(["export", "--run", str(run), "--out", str(out)]) == 0
    trained = json.loads(json.dumps(load_config(run / "config.yaml").to_dict()["model"]))
    assert json.loads((out / "export.json").read_text())["model"] == trained
    exported = (out / "config.yaml").read_text()
    for key, value in (("model.rope_theta", 500000.0), ("model.norm_eps", 10.0)):
        (out / "config.yaml").write_text(exported)
        edited = load_config(out / "config.yaml", [f"{key}={value}"])
        (out / "config.yaml").write_text(dump_config(edited))
        with pytest.raises(ConfigError, match=rf"config the export was trained with \({re.escape(key)}: "):
            load_run(out)
    (out / "config.yaml").write_text(exported)
    cfg = load_config(out / "config.yaml", ["model.moe.inference_capacity_factor=1.0"])
    (out / "config.yaml").write_text(dump_config(cfg))
    assert load_run(out)[2].model.moe.inference_capacity_factor == 1.0


def test_export_creates_missing_parent_directories(tmp_path):
    """README's `mode export --run runs/tiny/mod --out exports/tiny_mod` in a checkout without exports/."""
    model, run = fake_run(tmp_path, "mod")
    out = tmp_path / "exports" / "sub" / "tiny_mod"
    assert cli_main(["export", "--run", str(run), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "export.json", "model.safetensors"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny_mod"]  # no temporary directory left
    ids = torch.tensor([[TOK.eos_id] + TOK.encode("x = 1").tolist()])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, load_run(out)[0](ids).logits)


def test_export_to_a_name_of_up_to_255_bytes(tmp_path):
    """Bug caught (README walkthrough): the temporary directory `.<name>.export-tmp-<pid>` was over the
    filesystem's 255-byte limit for a legal --out name of 240 bytes, so the export failed."""
    _, run = fake_run(tmp_path, "mod")
    out = tmp_path / ("a" + "é" * 120)  # 241 bytes; 200 of them end inside an é
    assert cli_main(["export", "--run", str(run), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "export.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, run.name])  # no temporary left


def test_export_where_no_directory_can_be_made_is_one_config_error(tmp_path, capsys):
    """Bug caught (README walkthrough): `--out /proc/x` (root may write there by os.access, yet no
    directory can be made) was `error: FileNotFoundError: ... '/proc/.x.export-tmp-<pid>'`, exit 1,
    naming a temporary directory instead of --out."""
    _, run = fake_run(tmp_path, "mod")
    capsys.readouterr()
    assert cli_main(["export", "--run", str(run), "--out", "/proc/x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "config error: --out='/proc/x': a place where a directory can be made (/proc: No such file or " \
                  "directory)", err


def test_export_of_a_run_whose_data_moved_records_the_runs_data_source(tmp_path):
    """Bug caught: sampling stands stdlib in for a training source that has moved, and the export
    wrote that stand-in as the run's data source (`source: stdlib`)."""
    import yaml

    model, run = fake_run(tmp_path, "mod")
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["data"]["source"], cfg["data"]["val_source"] = str(tmp_path / "gone" / "train"), str(tmp_path / "gone" / "val")
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert cli_main(["export", "--run", str(run), "--out", str(tmp_path / "out")]) == 0
    data = yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())["data"]
    assert (data["source"], data["val_source"]) == (cfg["data"]["source"], cfg["data"]["val_source"])
    ids = torch.tensor([[TOK.eos_id] + TOK.encode("x = 1").tolist()])
    with torch.no_grad():  # and the export still loads (the same stand-in)
        assert torch.equal(model(ids).logits, load_run(tmp_path / "out")[0](ids).logits)


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o027, 0o640)], ids=["umask022", "umask027"])
def test_exported_weights_are_as_readable_as_the_config(tmp_path, umask, mode):
    """safetensors creates its file 0600 whatever the umask: on a shared cluster colleagues could
    read the export's config but not its weights. Every file gets what the umask gives."""
    _, run = fake_run(tmp_path, "dense")
    old = os.umask(umask)
    try:
        assert cli_main(["export", "--run", str(run), "--out", str(tmp_path / "out")]) == 0
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "out").iterdir()}
    assert modes == {"config.yaml": mode, "export.json": mode, "model.safetensors": mode}, modes


def _hf_tokenizer(d, eos_in_config: str | None = None):
    """A small BPE tokenizer.json in d; with `eos_in_config`, a tokenizer_config.json naming that
    EOS token while the vocabulary also holds `</s>` (which the built-in list would pick)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel()
    tk.train_from_iterator(["def f(x): return x"] * 20,
                           trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>", "<|end|>"]))
    d.mkdir()
    tk.save(str(d / "tokenizer.json"))
    if eos_in_config:
        (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos_in_config}))
    return tk


@pytest.mark.parametrize("spec", ["directory", "tokenizer.json", "eos from tokenizer_config.json"])
def test_export_with_a_hugging_face_tokenizer(tmp_path, spec):
    """The export carries the tokenizer the run used, whichever way the run named it, and the same
    EOS id (generation stops and every scored text starts with it)."""
    eos = "<|end|>" if spec.startswith("eos") else None
    tk = _hf_tokenizer(tmp_path / "tok", eos_in_config=eos)
    name = tmp_path / "tok" / "tokenizer.json" if spec == "tokenizer.json" else tmp_path / "tok"
    cfg = load_config(ROOT / "configs/tiny/dense.yaml", HARNESS_SMALL + [f"data.tokenizer={name}"])
    model = build_model(cfg.model)
    fake_checkpoint(tmp_path / "run", 1, model.state_dict())
    (tmp_path / "run" / "config.yaml").write_text(dump_config(cfg))
    _, run_tok, _ = load_run(tmp_path / "run")
    assert run_tok.eos_id == tk.token_to_id(eos or "</s>")
    assert cli_main(["export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    shutil.rmtree(tmp_path / "tok")  # the export carries its own copy
    _, tok, _ = load_run(tmp_path / "out")
    assert tok.encode("def f(x)").tolist() == tk.encode("def f(x)").ids
    assert tok.eos_id == run_tok.eos_id


def test_export_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    _, run = fake_run(tmp_path, "mod")
    empty = tmp_path / "empty_run"  # a run that never reached a checkpoint
    empty.mkdir()
    (empty / "config.yaml").write_text((run / "config.yaml").read_text())
    (tmp_path / "taken").mkdir()  # a non-empty export target holding a user's file
    (tmp_path / "taken" / "mine.txt").write_text("user data")
    before = sorted(tmp_path.rglob("*"))
    for argv, needle in ((["--run", str(run), "--out", str(tmp_path / "taken")], "--out"),
                         (["--run", str(empty), "--out", str(tmp_path / "new")], "complete checkpoint"),
                         (["--run", str(tmp_path / "nowhere"), "--out", str(tmp_path / "new")], "--run"),
                         (["--run", str(run), "--out", str(tmp_path / "new"), "--bogus"], "--bogus"),
                         (["--run", str(run), "--out", str(tmp_path / "taken" / "mine.txt" / "x")], "not a directory"),
                         (["--run", str(run), "--out", str(run / "export")], f"outside the run directory {run}:")):
        try:
            rc = cli_main(["export", *argv])
        except SystemExit as e:  # a bad option: argparse exits (mode's parser prints one line first)
            rc = e.code
        assert rc == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err
    assert sorted(tmp_path.rglob("*")) == before  # nothing written, nothing left behind
    assert (tmp_path / "taken" / "mine.txt").read_text() == "user data"


def test_export_takes_the_newest_checkpoint_that_verifies(tmp_path, capsys):
    """Bug caught: a newer checkpoint without MANIFEST.json (resume: "its save never finished") was
    exported unverified; now it is named in one line and the previous one, which verifies, exported."""
    from mode import checkpoint as ckpt

    model, run = fake_run(tmp_path, "mod")  # step 3
    newer = fake_checkpoint(run, 5, tiny_model("mod", seed=2)[0].state_dict())
    (newer / ckpt.MANIFEST).unlink()
    assert cli_main(["export", "--run", str(run), "--out", str(tmp_path / "out")]) == 0
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"checkpoint {newer} is unusable (no manifest: its save never finished)"), line
    info = json.loads((tmp_path / "out" / "export.json").read_text())
    assert info["checkpoint"] == str((ckpt.step_dir(newer.parent, 3) / ckpt.MODEL).resolve()), info
    ids = torch.tensor([[TOK.eos_id] + TOK.encode("x = 1").tolist()])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, load_run(tmp_path / "out")[0](ids).logits)
    (ckpt.step_dir(newer.parent, 3) / ckpt.MANIFEST).unlink()  # none left: one line, exit 1, nothing written
    before = sorted(tmp_path.rglob("*"))
    assert cli_main(["export", "--run", str(run), "--out", str(tmp_path / "out2")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and err[-1].startswith(f"error: no checkpoint of {run} verifies"), err
    assert sorted(tmp_path.rglob("*")) == before


def test_export_whose_tokenizer_file_vanished_says_it_could_not_read_it(tmp_path, capsys, monkeypatch):
    """Bug caught: any OSError during the export was reported as the output's ("cannot write OUT:
    FileNotFoundError ..."), also when the run's tokenizer file it copies was gone."""
    _hf_tokenizer(tmp_path / "tok")
    cfg = load_config(ROOT / "configs/tiny/dense.yaml", HARNESS_SMALL + [f"data.tokenizer={tmp_path / 'tok'}"])
    fake_checkpoint(tmp_path / "run", 1, build_model(cfg.model).state_dict())
    (tmp_path / "run" / "config.yaml").write_text(dump_config(cfg))
    import mode.generate as gen

    real = gen.load_run

    def then_deleted(*a, **kw):  # the tokenizer is read, then removed before the export copies it
        got = real(*a, **kw)
        (tmp_path / "tok" / "tokenizer.json").unlink()
        return got

    monkeypatch.setattr(gen, "load_run", then_deleted)
    assert cli_main(["export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: cannot read {tmp_path / 'tok' / 'tokenizer.json'}: No such file"), err
    assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists(), err


def test_export_to_a_full_disk_is_one_line(tmp_path, capsys, monkeypatch):
    """Bug caught: safetensors reports a full disk as its own error type, with the OS error only in
    its text: `error: SafetensorError: Error while serializing: I/O error: No space left on device
    (os error 28) (run again with --debug for the traceback)`."""
    from safetensors import SafetensorError

    from mode import export as ex

    _, run = fake_run(tmp_path, "dense")

    def full(model, path):
        Path(path).write_bytes(b"part")  # what a writer leaves before the disk fills
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(ex, "save_weights", full)
    out = tmp_path / "new" / "out"
    assert cli_main(["export", "--run", str(run), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: cannot write {out}: no space left on device"), err
    assert len(err.splitlines()) == 1 and "SafetensorError" not in err and "--debug" not in err, err
    assert not (tmp_path / "new").exists()  # no temporary directory, no parent made for it

    def unrelated(model, path):  # anything else is not blamed on the disk
        raise SafetensorError("Error while serializing: the tensors share memory")

    monkeypatch.setattr(ex, "save_weights", unrelated)
    assert cli_main(["export", "--run", str(run), "--out", str(out)]) == 1
    assert "SafetensorError: Error while serializing: the tensors share memory" in capsys.readouterr().err


def test_export_to_a_real_full_disk_is_one_line(tmp_path, capsys):
    """The same on a real full file system (a 64 KiB tmpfs; needs mount rights, else skipped)."""
    import subprocess

    _, run = fake_run(tmp_path, "dense")
    disk = tmp_path / "disk"
    disk.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        code = cli_main(["export", "--run", str(run), "--out", str(disk / "out")])
        left = sorted(p.name for p in disk.iterdir())
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: cannot write {disk / 'out'}: no space left on device ("), err
    assert f"MiB free on the filesystem of {disk})" in err and left == [], (err, left)


@pytest.mark.slow
def test_an_expert_parallel_deepspeed_run_exports_every_expert(tmp_path):
    """The cluster MoE preset trains with model.moe.backend=deepspeed and expert parallelism.
    Bug caught: its layers need torch.distributed, so `mode generate`/`mode eval` of such a run
    failed at the first forward, and `mode export` wrote rank 0's experts only (2 of 4). The
    export (native backend, every expert) must reproduce the trainer's own eval/loss, computed
    under the engine by the DeepSpeed layers with the experts split over 2 ranks."""
    from mode.data import DataModule

    run = tmp_path / "run"
    deepspeed_train(2, "configs/tiny/moe.yaml", *TINY, "model.moe.backend=deepspeed", "model.moe.num_experts=4",
                    "model.moe.capacity_factor=1.0", "model.moe.ep_size=2", "train.micro_batch_size=2",
                    "train.max_steps=2", "checkpoint.every=2", f"data.prepared_dir={tmp_path / 'prepared'}",
                    f"run.dir={run}")
    assert cli_main(["export", "--run", str(run), "--out", str(tmp_path / "out")]) == 0
    model, _, cfg = load_run(tmp_path / "out")
    assert cfg.model.moe.backend == "native" and cfg.model.moe.num_experts == 4
    # Each rank evaluated its own micro-batches (expert capacity counts a rank's tokens): the same
    # batches, one forward each, log-softmaxed in float64; the trainer averages over batches and ranks.
    losses = []
    with torch.no_grad():
        for rank in range(2):
            for x, y in DataModule(cfg.data, rank, 2).val_batches(cfg.train.eval_batches, cfg.train.micro_batch_size):
                lp = torch.log_softmax(model(x, routing="topk").logits.double(), -1)
                losses.append(-lp.gather(-1, y[..., None]).mean().item())
    assert sum(losses) / len(losses) == pytest.approx(scalars(run, "eval/loss")[2], rel=1e-5)
    ids = torch.tensor([[TOK.eos_id] + TOK.encode("def f(x):").tolist()])
    with torch.no_grad():  # the run directory itself reads the same way
        assert torch.equal(load_run(run)[0](ids).logits, model(ids).logits)

"""Nothing lost, ever (#16): run directories, verified checkpoints with fallback, one writer per run,
no orphans, one-line errors. Each test reproduces a fault and checks the new behaviour; tests that
start a process or train are marked slow."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.malformed import all_cases, run_case
from tests.util import (PY, ROOT, TINY, env, fake_checkpoint, free_port, main_guarded, mode_cli, mode_here, scalars,
                        side_by_side)

CFG = "configs/tiny/dense.yaml"


def one_line(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.strip()]


# ----------------------------------------------------------------------------------------------
# 1. Run directories.


def test_run_dir_tilde_is_expanded():
    from mode.config import load_config

    assert load_config(CFG, ["run.dir=~/runs/x"]).run.dir == str(Path.home() / "runs" / "x")


@pytest.mark.parametrize("value", ["", " ", ".", "..", "/", "~"])
def test_run_dir_never_empty_cwd_or_parent(tmp_path, monkeypatch, value):
    from mode import rundir
    from mode.config import ConfigError

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # not a parent of the current directory
    (tmp_path / "home").mkdir()
    (tmp_path / "keep.txt").write_text("mine")
    for fresh in (False, True):
        with pytest.raises(ConfigError, match="run.dir"):
            rundir.check(value, fresh)
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_run_dir_tilde_on_the_command_line_is_the_home_directory(tmp_path, monkeypatch):
    """`run.dir=~` was read as YAML's null: `run.dir=None: a value of type str`, which told the user
    nothing; a bare `~` is the home directory, refused as one (the README: `~` is expanded)."""
    from mode.config import ConfigError, load_config

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    from mode import rundir

    cfg = load_config(ROOT / "configs/tiny/dense.yaml", ["run.dir=~"])
    assert Path(cfg.run.dir).expanduser() == tmp_path / "home"
    with pytest.raises(ConfigError, match=r"^config error: run.dir=.*: a directory that is neither .* home directory"):
        rundir.check(cfg.run.dir, False)


def test_run_dir_below_a_file_is_refused_by_the_check(tmp_path):
    """Bug caught: run.dir=FILE/sub passed the check (and --print-config); the start then died with
    `error: NotADirectoryError` instead of a config error."""
    from mode import rundir
    from mode.config import ConfigError

    (tmp_path / "notes.txt").write_text("mine")
    for value in ("notes.txt", "notes.txt/sub", "notes.txt/a/b"):
        with pytest.raises(ConfigError, match=r"(is a file|this path is a file)"):
            rundir.check(str(tmp_path / value), False)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_fresh_refuses_a_directory_mode_did_not_write(tmp_path):
    from mode import rundir
    from mode.config import ConfigError

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "thesis.tex").write_text("years of work")
    (notes / "tb").mkdir()  # looks a bit like a run, but holds a foreign file
    for fresh in (True, False):
        with pytest.raises(ConfigError, match="thesis.tex"):
            rundir.check(str(notes), fresh)
    assert (notes / "thesis.tex").read_text() == "years of work"


def test_a_refused_run_dir_is_refused_before_the_data_is_prepared(tmp_path):
    """Bug caught: the pre-launch check prepared the data (minutes to hours for a hub corpus, and
    a tqdm bar on the console) before it looked at run.dir, so `run.fresh=true` on a user's
    directory was refused only after the whole prepare, which it had written to disk."""
    from mode.config import ConfigError, load_config
    from mode.train import preflight

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "thesis.tex").write_text("years of work")
    prepared = tmp_path / "prepared"
    cfg = load_config(CFG, [*TINY, f"run.dir={notes}", "run.fresh=true", f"data.prepared_dir={prepared}"])
    with pytest.raises(ConfigError, match="thesis.tex"):
        preflight(cfg)
    assert not prepared.exists()  # nothing prepared, nothing written
    assert sorted(p.name for p in notes.iterdir()) == ["thesis.tex"]


def test_a_run_dir_through_dot_dot_is_checked_as_the_directory_it_names(tmp_path):
    """Bug caught: `run.dir=notes/x/..` was checked as a directory that does not exist (every check
    skipped), then DirLock made `x` and the run overwrote notes/config.yaml; the same path on an
    existing run resumed it under a changed config. The path is folded before any check."""
    from mode.config import ConfigError, load_config
    from mode.train import preflight

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "config.yaml").write_text("my own config: keep")
    for through in (f"{notes}/x/..", f"{notes}/./x/y/../../"):
        cfg = load_config(CFG, [*TINY, f"run.dir={through}", f"data.prepared_dir={tmp_path / 'p' / '..' / 'prep'}"])
        assert cfg.run.dir == str(notes) and cfg.data.prepared_dir == str(tmp_path / "prep")
        with pytest.raises(ConfigError, match="config.yaml"):
            preflight(cfg)
    assert sorted(p.name for p in notes.iterdir()) == ["config.yaml"] and not (tmp_path / "prep").exists()


@pytest.mark.slow
def test_a_start_that_fails_before_training_leaves_no_run_dir(tmp_path):
    """Bug caught: a start that passed the pre-launch check and then failed building the model
    (here: out of memory) left run.dir holding LOCK and config.yaml, and the corrected command
    was refused as "a run with a different config"."""
    d = tmp_path / "new" / "run"
    r = train_1t(*TINY, "train.max_steps=2", "model.d_ff=100000000000", f"run.dir={d}", check=False)
    assert r.returncode == 1 and len(one_line(r.stderr)) == 1, r.stderr[-3000:]
    assert not (tmp_path / "new").exists()  # and the parent it made
    train_1t(*TINY, "train.max_steps=2", "train.eval_every=0", f"run.dir={d}")  # the corrected command
    assert (d / "DONE").exists()


def test_fresh_empties_only_a_mode_run(tmp_path):
    from mode import rundir

    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run / "tb").mkdir()
    (run / "config.yaml").write_text("model: {}\n")
    (run / "DONE").write_text("{}")
    assert rundir.is_mode_run(run) and not rundir.is_mode_run(tmp_path)
    lock = rundir.DirLock(run)
    rundir.check(str(run), True, lock=False)
    rundir.empty_run_dir(run)
    assert sorted(p.name for p in run.iterdir()) == ["LOCK"]  # the lock of the new run stays
    lock.release()


def test_deepspeed_recovery_scripts_beside_the_checkpoints_are_part_of_a_run(tmp_path):
    """Bug caught: at ZeRO 1/2 DeepSpeed's save copies zero_to_fp32.py and zero_to_torch.py into
    checkpoints/; the directory then no longer looked like mode's, so every stopped ZeRO run (the
    cluster preset's ZeRO 1) was refused on resume ("not a mode run"), and a run whose first save
    failed after DeepSpeed wrote them could neither resume nor start over. A file of another name
    there, or the scripts alone, still do not make a run."""
    from mode import rundir
    from mode.config import ConfigError

    run = tmp_path / "run"
    ck = run / "checkpoints"
    (ck / "step_00000002").mkdir(parents=True)
    (run / "config.yaml").write_text("model: {}\n")
    for name in rundir.DEEPSPEED_SCRIPTS:
        (ck / name).write_text("# DeepSpeed's\n")
    assert rundir.is_mode_run(run)
    rundir.check(str(run), False, lock=False)  # resumable
    (ck / "notes.txt").write_text("mine")
    assert not rundir.is_mode_run(run)
    with pytest.raises(ConfigError, match=r"not a mode run \(its checkpoints holds what mode does not write there\)"):
        rundir.check(str(run), False, lock=False)  # (it said "no LOCK, ... or step_N checkpoints" beside them)
    (ck / "notes.txt").unlink()
    (ck / "step_00000002").rmdir()
    assert not rundir.is_mode_run(run)  # the scripts prove nothing alone...
    (run / "run_info.json").write_text('{"world_size": 1}')
    assert rundir.is_mode_run(run)  # ...nor stop a run whose first save failed after them from resuming
    rundir.check(str(run), True, lock=False)  # or from starting over


@pytest.mark.parametrize("entry", ["config.yaml", "eval"])
def test_a_directory_that_is_not_a_run_is_never_written_or_emptied(tmp_path, monkeypatch, capsys, entry):
    """Bug caught: `mode train --config exp/config.yaml run.dir=exp run.fresh=true` deleted the user's
    own config (every entry had a name mode writes); without fresh the start overwrote it."""
    from mode.cli import main

    exp = tmp_path / "exp"
    exp.mkdir()
    mine = (ROOT / CFG).read_text() + "# my notes\n"
    if entry == "config.yaml":
        (exp / entry).write_text(mine)
    else:
        (exp / entry).mkdir()
        (exp / entry / "results.json").write_text(mine)
    cfg = exp / "config.yaml" if entry == "config.yaml" else ROOT / CFG
    monkeypatch.chdir(tmp_path)
    for fresh in (["run.fresh=true"], []):
        assert main(["train", "--print-config", "--config", str(cfg), *TINY, f"run.dir={exp}", *fresh]) == 2
        lines = one_line(capsys.readouterr().err)
        assert len(lines) == 1 and lines[0].startswith(f"config error: run.dir={str(exp)!r}"), lines
        assert f"holds {entry} but is not a mode run" in lines[0], lines
    assert sorted(p.name for p in exp.rglob("*")) == sorted([entry] + (["results.json"] if entry == "eval" else []))
    assert next(p for p in exp.rglob("*") if p.is_file()).read_text() == mine


@pytest.mark.parametrize("layout", ["lightning", "tensorboard", "tmp_in_checkpoints"])
def test_another_tools_experiment_folder_is_not_a_run(tmp_path, layout):
    """Bug caught: a folder holding a `checkpoints/` (or `tb/`) beside a `config.yaml` had only names
    mode writes, so it counted as a run: run.fresh=true deleted another tool's checkpoints and config,
    and every save deleted any `*.tmp` directory inside checkpoints/. A name is no proof: a run's
    LOCK, run_info.json or step_N checkpoints are."""
    from mode import checkpoint as ckpt
    from mode import rundir
    from mode.config import ConfigError

    exp = tmp_path / "exp"
    (exp / "checkpoints").mkdir(parents=True)
    (exp / "config.yaml").write_text("lr: 0.1\n")
    if layout == "lightning":
        (exp / "checkpoints" / "epoch=9.ckpt").write_text("weights")
    elif layout == "tensorboard":
        (exp / "tb").mkdir()
        (exp / "tb" / "events.out.tfevents.1.host.1.0").write_text("their events")
    else:  # a run of mode's, with a user's directory inside checkpoints/
        (exp / "checkpoints" / "old.tmp").mkdir()
        (exp / "checkpoints" / "old.tmp" / "important.txt").write_text("mine")
        (exp / "checkpoints" / "step_00000002.tmp").mkdir()  # a save of ours cut short
        ckpt.rotate(exp / "checkpoints", keep=1)
        assert sorted(p.name for p in (exp / "checkpoints").iterdir()) == ["old.tmp"]
    before = sorted((p.relative_to(exp), p.read_text() if p.is_file() else None) for p in exp.rglob("*"))
    for fresh in (True, False):
        with pytest.raises(ConfigError, match="is not a mode run"):
            rundir.check(str(exp), fresh)
    assert sorted((p.relative_to(exp), p.read_text() if p.is_file() else None) for p in exp.rglob("*")) == before


def test_fresh_keeps_the_live_slurm_log_and_a_slurm_only_directory_starts(tmp_path):
    """launch/slurm.sbatch writes run.dir/slurm/ (the job's log, being written) before the trainer
    starts: that directory is new, fresh or not, and fresh never deletes the log."""
    from mode import rundir

    run = tmp_path / "run"
    (run / "slurm").mkdir(parents=True)
    (run / "slurm" / "job-7.out").write_text("mode: job 7\n")
    for fresh in (True, False):
        rundir.check(str(run), fresh)  # a new run: not refused
    assert not rundir.is_mode_run(run)  # and nothing to empty
    (run / "checkpoints").mkdir()
    (run / "config.yaml").write_text("model: {}\n")
    (run / "run_info.json").write_text('{"world_size": 1}')
    assert rundir.is_mode_run(run)
    lock = rundir.DirLock(run)
    rundir.check(str(run), True, lock=False)
    rundir.empty_run_dir(run)
    assert sorted(p.name for p in run.iterdir()) == ["LOCK", "slurm"]
    assert (run / "slurm" / "job-7.out").read_text() == "mode: job 7\n"
    lock.release()


def test_wandb_without_the_package_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    """Bug caught: log.wandb=true passed the pre-launch check and failed on rank 0 after run.dir was
    created. wandb is a dev dependency, so its absence is simulated: None in sys.modules is how
    Python marks a module that cannot be imported."""
    from mode.cli import main

    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    args = ["train", "--print-config", "--config", str(ROOT / CFG), *TINY, f"run.dir={run}"]
    assert main([*args, "log.wandb=true"]) == 2
    lines = one_line(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith("config error: log.wandb=True: "), lines
    assert "pip install -e '.[wandb]'" in lines[0] and not run.exists(), lines
    assert main(args) == 0  # the same start without W&B passes


def test_wandb_online_without_a_login_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    """Bug caught: log.wandb=true (online, the default) with no W&B login passed the pre-launch check;
    rank 0 then stopped at wandb.init ("No API key configured") after writing config.yaml, tb/ and
    a lock into run.dir. wandb's own credential lookup is asked, with no credentials anywhere."""
    pytest.importorskip("wandb", reason="optional extra: pip install -e '.[wandb]'")
    from mode.cli import main

    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    args = ["train", "--print-config", "--config", str(ROOT / CFG), *TINY, f"run.dir={run}", "log.wandb=true"]
    assert main(args) == 2
    lines = one_line(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith("config error: log.wandb_mode='online': offline"), lines
    assert not run.exists()
    assert main([*args, "log.wandb_mode=offline"]) == 0
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)  # a key in the environment is a login
    assert main(args) == 0 and not run.exists()


# ----------------------------------------------------------------------------------------------
# 3. One writer per run (in-process part: the lock itself).


def test_fresh_keeps_eval_and_wandb_and_deletes_checkpoints_before_the_config(tmp_path, monkeypatch):
    """Bug caught: run.fresh=true deleted eval/ and wandb/ whole (a user's results there, or a whole
    run nested in eval/, or W&B offline runs not yet synced). And a wipe killed half-way could
    leave checkpoints without their config.yaml (deleted in directory order)."""
    from mode import rundir

    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run / "config.yaml").write_text("model: {}\n")
    (run / "run_info.json").write_text('{"world_size": 1}')
    (run / "eval" / "mine").mkdir(parents=True)
    (run / "eval" / "mine" / "notes.txt").write_text("keep")
    (run / "wandb" / "offline-run-1").mkdir(parents=True)
    assert rundir.is_mode_run(run)
    order = []
    real_rmtree, real_unlink = shutil.rmtree, Path.unlink
    monkeypatch.setattr(shutil, "rmtree", lambda p, *a, **k: (order.append(Path(p).name), real_rmtree(p, *a, **k)))
    monkeypatch.setattr(Path, "unlink", lambda p, *a, **k: (order.append(p.name), real_unlink(p, *a, **k)))
    rundir.empty_run_dir(run)
    assert sorted(p.name for p in run.iterdir()) == ["eval", "wandb"]
    assert (run / "eval" / "mine" / "notes.txt").read_text() == "keep" and (run / "wandb" / "offline-run-1").is_dir()
    assert order[0] == "checkpoints" and order[-1] == "config.yaml", order


def test_a_run_dir_or_prepared_dir_inside_another_run_is_refused(tmp_path):
    """Bug caught: run.dir=RUN/nested (or data.prepared_dir=RUN/prep) was accepted; the outer run
    then held a foreign entry and could be neither resumed nor started fresh. A compare runs_dir
    (its LOCK beside its first run) is no run: its runs start."""
    from mode import rundir
    from mode.config import ConfigError, load_config
    from mode.train import preflight

    outer = tmp_path / "outer"
    (outer / "checkpoints" / "step_00000002").mkdir(parents=True)
    (outer / "run_info.json").write_text('{"world_size": 1}')
    for inner in (outer / "nested", outer / "tb" / "nested", outer / "checkpoints" / "x" / "y"):
        with pytest.raises(ConfigError, match=f"run.dir=.*: a path outside the run directory {outer}"):
            rundir.check(str(inner), False)
    cfg = load_config(CFG, [*TINY, f"run.dir={tmp_path / 'other'}", f"data.prepared_dir={outer / 'prep'}"])
    with pytest.raises(ConfigError, match=f"data.prepared_dir=.*: a path outside the run directory {outer}"):
        preflight(cfg, prepare_data=False)
    assert sorted(p.name for p in outer.iterdir()) == ["checkpoints", "run_info.json"]  # nothing written

    # a walk-only (--x) parent, as many clusters' /home: it cannot be listed, and is no run
    real_iterdir = Path.iterdir

    def walk_only(p):
        if p == tmp_path:
            raise PermissionError(13, "Permission denied", str(p))
        return real_iterdir(p)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Path, "iterdir", walk_only)
        (tmp_path / "run_info.json").write_text("{}")  # a proof name there: it must try to list tmp_path
        rundir.check(str(tmp_path / "fresh_run"), False)
        (tmp_path / "run_info.json").unlink()

    grid = tmp_path / "grid"  # mode compare's runs_dir while it starts its first run
    lock = rundir.DirLock(grid)
    rundir.check(str(grid / "dense"), False)
    (grid / "dense").mkdir()
    assert rundir.run_broken_by(grid / "dense", below_only=True, proofs=rundir.RUN_PROOFS) is None
    lock.release()


def test_a_run_with_checkpoints_but_no_config_is_not_resumed_under_another_config(tmp_path):
    """Bug caught: with config.yaml gone (deleted, or a wipe killed half-way), the checkpoints
    resumed under whatever config the start had: an LR schedule change went unchecked."""
    from mode.config import ConfigError, load_config
    from mode.train import check_run_dir

    d = tmp_path / "run"
    (d / "checkpoints" / "step_00000004").mkdir(parents=True)
    (d / "run_info.json").write_text('{"world_size": 1}')
    with pytest.raises(ConfigError, match=r"holds 1 checkpoints but no config.yaml"):
        check_run_dir(load_config(CFG, [*TINY, f"run.dir={d}", "optim.lr=0.5"]))
    assert check_run_dir(load_config(CFG, [*TINY, f"run.dir={d}", "run.fresh=true"])) is None


def test_a_config_written_back_from_a_checkpoints_config_json_resumes(tmp_path):
    """Bug caught: config.yaml written back from a checkpoint's config.json (JSON is YAML; the
    no-config refusal asks for this) was refused as another config: PyYAML reads `1e-06` (no dot) as
    a string, and the saved config was compared as written (`model.norm_eps: '1e-06' -> 1e-06`). A
    real difference is still refused."""
    import json

    from mode.config import ConfigError, load_config
    from mode.train import check_run_dir

    d = tmp_path / "run"
    (d / "checkpoints" / "step_00000004").mkdir(parents=True)
    (d / "run_info.json").write_text('{"world_size": 1}')
    cfg = load_config(CFG, [*TINY, f"run.dir={d}"])
    assert cfg.model.norm_eps < 1e-4 and "e-0" in json.dumps(cfg.model.norm_eps)  # written without a dot
    (d / "config.yaml").write_text(json.dumps(cfg.to_dict(), indent=1))
    assert check_run_dir(cfg)["model"]["norm_eps"] == cfg.model.norm_eps
    with pytest.raises(ConfigError, match=r"holds a run with a different config \(optim.weight_decay: 0.1 -> 0.5\)"):
        check_run_dir(load_config(CFG, [*TINY, f"run.dir={d}", "optim.weight_decay=0.5"]))


def test_a_key_added_by_hand_to_a_runs_config_is_named_not_answered_with_run_fresh(tmp_path):
    """Bug caught: a typo added by hand to run.dir/config.yaml (`train.max_stepz: 5`) was refused as
    "a different config ... pass run.fresh=true to start over": advice that deletes the run for a
    line to remove. The key is named as not a config key; the run itself still resumes."""
    import json

    from mode.config import ConfigError, load_config
    from mode.train import check_run_dir

    d = tmp_path / "run"
    (d / "checkpoints" / "step_00000004").mkdir(parents=True)
    (d / "run_info.json").write_text('{"world_size": 1}')
    cfg = load_config(CFG, [*TINY, f"run.dir={d}"])
    saved = cfg.to_dict()
    saved["train"]["max_stepz"] = 5
    (d / "config.yaml").write_text(json.dumps(saved))
    with pytest.raises(ConfigError, match=r"has train.max_stepz=5, which is not a config key") as e:
        check_run_dir(cfg)
    assert "run.fresh" not in str(e.value)
    del saved["train"]["max_stepz"]
    (d / "config.yaml").write_text(json.dumps(saved))
    assert check_run_dir(cfg) is not None


def test_a_requeued_slurm_job_resumes_the_run_it_started_fresh(tmp_path):
    """Bug caught: a job with run.fresh=true that SLURM requeued re-ran its command and deleted what
    it had trained before the requeue. Fresh still holds for another job, a first start and a
    second start in one interactive allocation (no restart count)."""
    from mode.config import load_config
    from mode.train import requeued_fresh_start

    d = tmp_path / "run"
    d.mkdir()
    (d / "run_info.json").write_text('{"world_size": 1, "slurm_job_id": "77"}')
    fresh = load_config(CFG, [*TINY, f"run.dir={d}", "run.fresh=true"])
    assert requeued_fresh_start(fresh, {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"})
    for env_ in ({"SLURM_JOB_ID": "78", "SLURM_RESTART_COUNT": "1"}, {"SLURM_JOB_ID": "77"},
                 {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "0"}, {}):
        assert not requeued_fresh_start(fresh, env_), env_
    assert not requeued_fresh_start(load_config(CFG, [*TINY, f"run.dir={d}"]),
                                    {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"})


def test_lock_probes_do_not_block_each_other(tmp_path):
    """Bug caught: the probe (every rank of a start runs one at the same moment) took the lock
    exclusively, so two probes at once read as "in use by" a dead holder and failed the start."""
    import fcntl
    import threading

    from mode import rundir

    d = tmp_path / "run"
    d.mkdir()
    (d / "LOCK").write_text(json.dumps({"pid": 999999, "host": "old", "started": 0}))
    with open(d / "LOCK", "rb") as other_probe:
        fcntl.flock(other_probe, fcntl.LOCK_SH | fcntl.LOCK_NB)  # another rank's probe, mid-flight
        rundir.check_lock(d)
        threading.Timer(0.1, fcntl.flock, (other_probe, fcntl.LOCK_UN)).start()
        rundir.DirLock(d).release()  # the writer waits out the probe instead of failing


def test_dir_lock_is_exclusive_and_names_the_holder(tmp_path):
    from mode import rundir
    from mode.config import ConfigError

    lock = rundir.DirLock(tmp_path / "run")
    with pytest.raises(ConfigError, match=f"in use by pid {os.getpid()} on "):
        rundir.check_lock(tmp_path / "run")
    with pytest.raises(ConfigError, match=f"in use by pid {os.getpid()} on "):
        rundir.DirLock(tmp_path / "run")
    lock.release()
    assert (tmp_path / "run" / "LOCK").read_text() == ""  # released cleanly: no holder recorded
    rundir.check_lock(tmp_path / "run")
    rundir.DirLock(tmp_path / "run").release()


def test_lock_of_a_dead_holder_is_taken_over_with_a_message(tmp_path, capsys):
    from mode import rundir

    d = tmp_path / "run"
    d.mkdir()
    (d / "LOCK").write_text(json.dumps({"pid": 999999, "host": "node7", "started": 0, "cmd": "mode train"}))
    rundir.check_lock(d)  # nobody holds the flock: not refused
    lock = rundir.DirLock(d)
    err = capsys.readouterr().err
    assert "taking over the lock of pid 999999 on node7" in err and "no longer running" in err
    assert json.loads((d / "LOCK").read_text())["pid"] == os.getpid()
    lock.release()


def _no_flock(monkeypatch):
    from mode import rundir
    from tests.util import no_flock

    no_flock(monkeypatch, rundir)
    monkeypatch.setattr(rundir.DirLock, "SETTLE_S", 0.01)


def test_without_flock_the_holders_record_is_the_lock(tmp_path, monkeypatch, capsys):
    """Bug caught: on a filesystem without flock every start failed with `OSError: [Errno 38]
    Function not implemented`, naming neither LOCK nor the cause. Now the record in LOCK is the
    lock: a live holder refuses; a released (emptied) record, a dead or pid-reused holder of this
    host, and an earlier run of this SLURM job (a requeue) are taken over; a record of another host,
    or one that cannot be parsed, refuses with the file to empty if no holder is left."""
    import socket

    from mode import rundir
    from mode.config import ConfigError
    from mode.lifeline import start_time

    _no_flock(monkeypatch)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    d, host = tmp_path / "run", socket.gethostname()
    lock = rundir.DirLock(d)
    rec = json.loads((d / "LOCK").read_text())
    assert rec["pid"] == os.getpid() and rec["pid_start"] == start_time(os.getpid()) and rec["host"] == host
    lock.release()
    assert (d / "LOCK").read_text() == ""
    rundir.check_lock(d)

    def holder(**kw):
        (d / "LOCK").write_text(json.dumps({"pid": os.getppid(), "pid_start": start_time(os.getppid()),
                                            "host": host, "started": 0, "cmd": "mode train", **kw}))

    holder()  # a live process of this host (our parent)
    for second in (rundir.check_lock, rundir.DirLock):
        with pytest.raises(ConfigError, match=f"in use by pid {os.getppid()} on {host} .*stop it$"):
            second(d)
    for stale in ({"pid": 999999}, {"pid_start": "0"},  # dead; pid reused; our own (a restarted container)
                  {"pid": os.getpid(), "pid_start": start_time(os.getpid())}):
        holder(**stale)
        rundir.check_lock(d)
        lock = rundir.DirLock(d)
        assert "taking over the lock of pid" in capsys.readouterr().err
        lock.release()

    holder(host="node7", pid=999999)
    for second in (rundir.check_lock, rundir.DirLock):
        with pytest.raises(ConfigError, match=f"pid 999999 on node7 .*if it is gone, empty {d / 'LOCK'}"):
            second(d)
    # a requeued SLURM job (same id, higher restart count) takes its own earlier record, on any node
    holder(host="node7", pid=999999, slurm_job="77", slurm_restart=0)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    with pytest.raises(ConfigError, match="pid 999999 on node7"):
        rundir.check_lock(d)  # the same run of the job: still someone else's
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    rundir.check_lock(d)
    rundir.DirLock(d).release()
    monkeypatch.delenv("SLURM_JOB_ID")

    (d / "LOCK").write_text('{"pid": 12')  # torn: may be a live holder's
    for second in (rundir.check_lock, rundir.DirLock):
        with pytest.raises(ConfigError, match=f"record is unreadable: if no start is running, empty {d / 'LOCK'}"):
            second(d)
    assert (d / "LOCK").read_text() == '{"pid": 12'


def test_without_flock_a_starter_whose_record_was_overwritten_backs_off(tmp_path, monkeypatch):
    """Two starters found LOCK free at once and both wrote: the one whose record did not survive
    refuses and leaves the winner's record in place."""
    from mode import rundir
    from mode.config import ConfigError

    _no_flock(monkeypatch)
    d = tmp_path / "run"
    d.mkdir()
    other = {"pid": os.getppid(), "host": "node7", "started": 1.0, "cmd": "mode train"}

    def other_writes_meanwhile(s):
        (d / "LOCK").write_text(json.dumps(other))

    monkeypatch.setattr(rundir.time, "sleep", other_writes_meanwhile)
    with pytest.raises(ConfigError, match=f"in use by pid {os.getppid()} on node7"):
        rundir.DirLock(d)
    assert json.loads((d / "LOCK").read_text()) == other


# ----------------------------------------------------------------------------------------------
# 2. Verified checkpoints (the verification and fallback on real torch files; training below).


def _fake_checkpoint(root: Path, step: int, seed: int) -> Path:
    from mode import checkpoint as ckpt

    d = ckpt.step_dir(root, step)
    d.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    torch.save({"w": torch.randn(64, 64, generator=g)}, d / "mp_rank_00_model_states.pt")
    torch.save({"m": torch.randn(64, 64, generator=g)}, d / "optim_states.pt")
    ckpt.write_manifest(d, step)
    return d


def _damage(d: Path, how: str) -> None:
    f = d / "mp_rank_00_model_states.pt"
    data = bytearray(f.read_bytes())
    if how == "flipped":  # 16 bytes inside the tensor record
        mid = len(data) // 2
        data[mid:mid + 16] = bytes(b ^ 0xFF for b in data[mid:mid + 16])
        f.write_bytes(bytes(data))
    elif how == "truncated":
        f.write_bytes(bytes(data[: len(data) // 3]))
    elif how == "emptied":
        f.write_bytes(b"")
    elif how == "grown":  # bytes appended: was named "truncated"
        f.write_bytes(bytes(data) + b"garbage")
    elif how == "file-less":
        for p in d.iterdir():
            p.unlink()
    elif how == "file missing":
        f.unlink()
    elif how == "no manifest":
        (d / "MANIFEST.json").unlink()


@pytest.mark.parametrize("how", ["flipped", "truncated", "emptied", "grown", "file-less", "file missing",
                                 "no manifest"])
def test_damaged_newest_checkpoint_falls_back_to_the_newest_verified(tmp_path, how):
    from mode import checkpoint as ckpt

    root = tmp_path / "checkpoints"
    _fake_checkpoint(root, 2, 0)
    good = _fake_checkpoint(root, 4, 1)
    bad = _fake_checkpoint(root, 6, 2)
    assert ckpt.verify(bad) is None
    _damage(bad, how)
    lines = []
    cause = {"flipped": "damaged", "truncated": "truncated", "emptied": "emptied", "grown": "grown",
             "file-less": "empty directory",
             "file missing": "is missing", "no manifest": "no manifest"}[how]
    assert cause in (ckpt.verify(bad) or ""), ckpt.verify(bad)  # the line names what is wrong
    assert ckpt.newest_verified(root, log=lines.append) == good
    assert len(lines) == 1 and "step_00000006" in lines[0] and "falling back" in lines[0], lines
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000004", "step_00000006.bad"]


def test_config_and_run_info_are_replaced_whole(tmp_path, monkeypatch):
    """Bug caught: config.yaml was rewritten in place at every start, so a crash mid-write left it
    empty and the run unresumable (the message then sent the user to run.fresh=true, which deletes
    the checkpoints). A write that fails now leaves the old file whole, and the run still a run."""
    from mode import rundir

    run = tmp_path / "run"
    run.mkdir()
    (run / "LOCK").write_text("")
    rundir.write_atomic(run / "config.yaml", "model: {d_model: 32}\n")
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError):
        rundir.write_atomic(run / "config.yaml", "model: {d_model: 64}\n" * 1000)  # the crash, mid-write
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert (run / "config.yaml").read_text() == "model: {d_model: 32}\n"
    # Bug caught: the failed write left .config.yaml.tmp behind; a start that failed so in a run.dir it
    # had made then could not remove the directory, and every later start (fresh too) refused it as
    # holding a file mode did not write. A write that fails removes its temporary file.
    assert sorted(p.name for p in run.iterdir()) == ["LOCK", "config.yaml"]
    # A kill mid-write leaves it: each file written so (train.py: config.yaml, run_info.json; loggers.py:
    # metrics.jsonl, rewritten on resume) leaves one the run dir checks must take for the run's own.
    for name in ("config.yaml", "run_info.json", "metrics.jsonl"):
        (run / f".{name}.tmp").write_text("partial")
        assert rundir.is_mode_run(run)
        rundir.check(str(run), False, lock=False)
        rundir.check(str(run), True, lock=False)  # fresh may empty it


def test_a_run_whose_every_checkpoint_is_damaged_is_refused_not_restarted(tmp_path):
    """Bug caught: with every checkpoint unusable the run silently restarted from step 0 in its own
    directory (a second series of the same steps in its logs), each damaged one reported as "falling
    back to the previous one". Now the last line says none is left and the resume is refused."""
    from mode import checkpoint as ckpt
    from mode.config import ConfigError

    root = tmp_path / "checkpoints"
    for step in (2, 4):
        _damage(_fake_checkpoint(root, step, step), "flipped")
    lines = []
    assert ckpt.newest_verified(root, log=lines.append) is None
    assert "falling back" in lines[0] and "no earlier one is left" in lines[1], lines
    with pytest.raises(ConfigError, match=r"^config error: run.fresh=False: true to start over \(it deletes "
                                          r"checkpoints/; move it away first to keep it\): no checkpoint in "):
        ckpt.resume_point(root, 0)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002.bad", "step_00000004.bad"]  # kept
    assert ckpt.resume_point(tmp_path / "none", 0) is None  # a new run has nothing to resume: no error


def test_manifest_is_written_only_after_every_file_it_vouches_for_is_on_disk(tmp_path, monkeypatch):
    """Bug caught: only the manifest was fsynced, so after a power loss a manifest could survive while
    the files it lists (still in the page cache) did not: a "verified" checkpoint with lost data."""
    from mode import checkpoint as ckpt

    d = tmp_path / "step_00000002"
    (d / "zero").mkdir(parents=True)
    for name in ("model.pt", "rng_rank0.pt", "zero/optim_states.pt"):
        (d / name).write_bytes(os.urandom(1000))
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(a, b):
        events.append(("replace", str(b)))
        real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    ckpt.write_manifest(d, 2)
    published = events.index(("replace", str(d / ckpt.MANIFEST)))
    synced_before = {p for kind, p in events[:published] if kind == "fsync"}
    needed = {str(d / n) for n in ("model.pt", "rng_rank0.pt", "zero/optim_states.pt", "zero", "",
                                   ckpt.MANIFEST + ".part")}
    assert {os.path.normpath(p) for p in needed} <= synced_before, (needed - synced_before, events)
    assert ("fsync", str(d)) in events[published:], events  # the manifest's rename itself is durable
    assert ckpt.verify(d) is None


def test_readers_of_weights_fall_back_without_touching_the_run(tmp_path):
    # Bug caught: sampling / eval / export reading the layout with their own glob and regex, e.g. a
    # `.tmp` or `.bad` directory or a checkpoint without weights taken for the newest one.
    from mode import checkpoint as ckpt

    root = ckpt.checkpoints_dir(tmp_path)
    old = fake_checkpoint(tmp_path, 1, {"w": torch.zeros(2)})  # an older checkpoint (fake_checkpoint writes its manifest)
    good = _fake_checkpoint(root, 4, 1)
    torch.save({"w": torch.ones(2)}, good / ckpt.MODEL)
    ckpt.write_manifest(good, 4)
    bad = _fake_checkpoint(root, 6, 2)
    torch.save({"w": torch.ones(2)}, bad / ckpt.MODEL)
    ckpt.write_manifest(bad, 6)
    _damage(bad, "flipped")
    _fake_checkpoint(root, 8, 3)  # verifies, but holds no model.pt (DeepSpeed's files only)
    fake_checkpoint(tmp_path, 9, {"w": torch.ones(2)}).rename(root / "step_00000009.tmp")
    before = sorted(p.name for p in root.iterdir())
    lines = []
    assert ckpt.newest_weights(tmp_path, log=lines.append) == good
    assert len(lines) == 1 and "step_00000006" in lines[0] and "falling back" in lines[0], lines
    assert sorted(p.name for p in root.iterdir()) == before  # nothing moved aside: reading never changes a run
    assert ckpt.latest_step(tmp_path) == 8 and ckpt.step_of(old) == 1  # the trainer's view: newest with a manifest
    with pytest.raises(ValueError):
        ckpt.step_of(root / "step_00000009.tmp")
    assert ckpt.latest_step(tmp_path / "nowhere") is None


def test_rotation_keeps_the_newest_verified_and_ignores_unfinished(tmp_path):
    from mode import checkpoint as ckpt

    root = tmp_path / "checkpoints"
    for s in (2, 4, 6):
        _fake_checkpoint(root, s, s)
    (root / "step_00000008").mkdir()  # no manifest: never counted as a kept checkpoint
    ckpt.rotate(root, keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000006", "step_00000008"]
    assert ckpt.latest(root).name == "step_00000006"


def test_rotation_deletes_only_the_files_a_checkpoint_manifest_lists(tmp_path, capsys):
    """Bug caught: rotation removed an old checkpoint with rmtree, so a user's file put into
    checkpoints/step_N/ after the save (notes, an export) was deleted with it, silently, although a
    start never treats such a file as mode's. Now the checkpoint's own files go, the user's stays
    (the directory, without a manifest, no longer counts) and one line says so; a checkpoint whose
    manifest cannot be read proves nothing, so it is moved aside, not deleted."""
    from mode import checkpoint as ckpt

    root = tmp_path / "checkpoints"
    for s in (2, 4, 6, 8):
        _fake_checkpoint(root, s, s)
    (root / "step_00000002" / "notes.txt").write_text("mine")
    (root / "step_00000004" / "sub").mkdir()
    (root / "step_00000004" / "sub" / "export.bin").write_text("mine too")
    (root / "step_00000006" / ckpt.MANIFEST).write_text('{"files": {"../../notes.md": {}}}')  # hand-edited
    ckpt.rotate(root, keep=1)
    assert (root / "step_00000002" / "notes.txt").read_text() == "mine"
    assert (root / "step_00000004" / "sub" / "export.bin").read_text() == "mine too"
    assert sorted(p.name for p in (root / "step_00000002").iterdir()) == ["notes.txt"]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000004", "step_00000006.bad",
                                                       "step_00000008"]
    assert [c.name for c in ckpt.complete_checkpoints(root)] == ["step_00000008"]
    err = capsys.readouterr().err
    assert "kept notes.txt in" in err and "kept sub/export.bin in" in err and "moved to step_00000006.bad" in err
    ckpt.rotate(root, keep=1)  # nothing more to do, nothing more said
    assert capsys.readouterr().err == ""


def test_fresh_refuses_a_run_whose_checkpoint_holds_a_users_file(tmp_path):
    """Bug caught: run.fresh=true removed checkpoints/ with rmtree, so a user's file put into a saved
    checkpoint (notes, an export) went with it, although rotation keeps such a file. Now the start is
    refused before anything is written, naming the file; a checkpoint holding only its own files
    (and a partial save, which has no manifest) is still started over."""
    from mode import rundir
    from mode.config import ConfigError

    run = tmp_path / "run"
    ck = run / "checkpoints"
    _fake_checkpoint(ck, 2, 2)
    _fake_checkpoint(ck, 4, 4)
    (run / "config.yaml").write_text("model: {}\n")
    (ck / "step_00000006.tmp").mkdir()
    (ck / "step_00000004" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"step_00000004 holds notes.txt, which its checkpoint manifest does not"):
        rundir.check(str(run), True, lock=False)
    rundir.check(str(run), False, lock=False)  # resuming deletes nothing: not refused
    assert (ck / "step_00000004" / "notes.txt").read_text() == "mine"
    (ck / "step_00000004" / "notes.txt").unlink()
    rundir.check(str(run), True, lock=False)
    rundir.empty_run_dir(run)
    assert not run.exists() or not any(run.iterdir())


def test_write_failures_name_the_cause():
    import errno

    from mode.checkpoint import io_cause

    assert "no space left on device" in io_cause(OSError(errno.ENOSPC, "No space left on device"), Path("/tmp"))
    assert "read-only file system" in io_cause(OSError(errno.EROFS, "Read-only file system"), Path("/tmp"))
    assert "permission denied" in io_cause(PermissionError(errno.EACCES, "denied", "/x/ck"), Path("/tmp"))
    # a name over the filesystem's limit: Path.exists() raises ENAMETOOLONG itself (was a second traceback)
    long = Path("/tmp") / ("a" * 300) / "results.json"
    assert io_cause(OSError(errno.ENAMETOOLONG, "File name too long", str(long)), long).startswith("file name too long")
    # a filesystem with no free space that is not full (/proc): a missing directory is not a full disk
    assert io_cause(FileNotFoundError(errno.ENOENT, "No such file or directory", "/proc/nope"), Path("/proc/nope")) \
        == "FileNotFoundError: [Errno 2] No such file or directory: '/proc/nope'"


def test_disk_full_while_logging_names_the_runs_filesystem(tmp_path):
    """Bug caught: a disk filling between checkpoints stopped the run at a metrics flush, whose
    OSError names no file, and the line read "no space left on device (75603.3 MiB free on the
    filesystem of .)": the current directory's free space, not the full one's."""
    import errno

    from mode.checkpoint import io_cause
    from mode.config import load_config
    from mode.errors import one_line as line_of
    from mode.loggers import Loggers

    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "size=64k")
    try:
        (disk / "run").mkdir()
        log = Loggers(load_config(ROOT / CFG), disk / "run", True)
        with pytest.raises(OSError) as e:
            for step in range(100_000):
                log.write({"train/loss": 1.0, "train/tokens_seen": step * 64, "train/flops_seen": step * 1e9}, step)
        said, code = line_of(e.value)
        with pytest.raises(OSError):
            log.close()  # its buffered line cannot be written either
    finally:
        _umount(disk)
    assert e.value.errno == errno.ENOSPC and code == 1
    assert said == f"error: no space left on device (0.0 MiB free on the filesystem of {disk / 'run'})", said
    assert io_cause(OSError(errno.ENOSPC, "No space left on device"), None) == "no space left on device"


def test_accumulator_state_round_trip_continues_the_same_sums():
    from mode.metrics import Accumulator

    a, b = Accumulator(), Accumulator()
    for v in (1.0, 2.5):
        a.add({"loss": torch.tensor(v)})
    b.load_state_dict(a.state_dict(), "cpu")
    for acc in (a, b):
        acc.add({"loss": torch.tensor(4.0)})
    assert a.read() == b.read() == {"loss": (1.0 + 2.5 + 4.0) / 3}


# ----------------------------------------------------------------------------------------------
# 5. One-line errors: every malformed input is refused with exactly one `config error:` line.

CASES = all_cases()


@pytest.mark.parametrize("kind,name,spec", CASES, ids=[f"{k}:{n}" for k, n, _ in CASES])
def test_malformed_input_is_one_config_error_line(tmp_path, kind, name, spec):
    res = run_case(kind, spec, tmp_path)
    assert res["clean"], res


def test_there_are_at_least_100_malformed_cases():
    assert len(CASES) >= 100


def test_print_config_of_a_good_config_still_works(tmp_path, monkeypatch, capsys):
    from mode.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "--print-config", "--config", str(ROOT / CFG), *TINY, "run.dir=runs/x"]) == 0
    assert "d_model: 32" in capsys.readouterr().out
    assert not (tmp_path / "runs").exists()  # print-config writes nothing


def test_debug_flag_shows_the_traceback(tmp_path, monkeypatch):
    from mode.cli import main
    from mode.config import ConfigError

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MODE_DEBUG", "0")  # restored (unset) afterwards: main sets it for its children
    with pytest.raises(ConfigError):
        main(["--debug", "train", "--print-config", "--config", str(ROOT / CFG), "optim.lr=.inf"])


def test_a_config_error_is_said_once_per_node_not_once_per_rank(monkeypatch, capsys):
    """Bug caught: under `deepspeed --num_gpus N --module mode.train` every rank checks the config
    and each printed the same `config error:` line (N lines). Then (CI, a 2-rank start under load):
    the silent rank 1 exited first, its launcher killed rank 0 before rank 0's line was out, and the
    user saw only "exits with return code = 2". Now the node's other ranks wait for the launcher to
    end them (here: the wait is where the launcher's kill lands) and say the line only if they outlive
    the wait. Runtime faults stay per rank, at once."""
    from mode import errors
    from mode.config import ConfigError
    from mode.errors import guarded

    class Killed(BaseException):
        pass

    def bad(argv):
        raise ConfigError("optim.lr", float("inf"), "a finite number")

    def broken(argv):
        raise RuntimeError("rank-local fault")

    def launcher_kills(seconds):
        assert seconds == errors.QUIET_RANK_WAIT_S >= 10
        raise Killed

    line = ["config error: optim.lr=inf: a finite number"]
    for local_rank in (None, "0", "1", "3"):
        if local_rank is None:
            monkeypatch.delenv("LOCAL_RANK", raising=False)
        else:
            monkeypatch.setenv("LOCAL_RANK", local_rank)
        monkeypatch.setattr(errors.time, "sleep", launcher_kills)
        if local_rank in (None, "0"):
            assert guarded(bad, []) == 2 and one_line(capsys.readouterr().err) == line
        else:
            with pytest.raises(Killed):
                guarded(bad, [])
            assert capsys.readouterr().err == ""  # nothing said before the wait
            monkeypatch.setattr(errors.time, "sleep", lambda s: None)  # outlived it: the first rank did not fail
            assert guarded(bad, []) == 2 and one_line(capsys.readouterr().err) == line
        monkeypatch.setattr(errors.time, "sleep", launcher_kills)
        assert guarded(broken, []) == 1 and "rank-local fault" in capsys.readouterr().err


def test_an_experiment_yaml_with_a_duplicated_variant_is_refused(tmp_path, monkeypatch, capsys):
    """Bug caught: `mode compare` read its experiment YAML with PyYAML's default loader, which keeps
    the last of two same-named variants silently (a whole arm of the comparison vanished)."""
    from mode.cli import main
    from mode.config import ConfigError

    from analysis.isoflop import load_budgets

    monkeypatch.chdir(tmp_path)
    cfg = ROOT / CFG
    dup = tmp_path / "dup.yaml"
    dup.write_text(f"name: x\nruns_dir: {tmp_path / 'runs'}\nbudgets: 1.0e15\nvariants:\n"
                   f"  dense: {{config: {cfg}}}\n  dense: {{config: {cfg}, overrides: [model.n_layers=3]}}\n")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"name: x\xff\x00\n")
    for path, why in ((dup, "duplicate key 'dense'"), (binary, "not UTF-8")):
        assert main(["compare", str(path), "--dry-run"]) == 2
        lines = one_line(capsys.readouterr().err)
        assert len(lines) == 1 and lines[0].startswith("config error: ") and why in lines[0], lines
    assert not (tmp_path / "runs").exists()
    with pytest.raises(ConfigError, match="duplicate key 'dense'"):
        load_budgets(dup)  # `mode analyze --experiment` reads it the same way


def test_other_commands_refuse_bad_arguments_in_one_line(tmp_path, monkeypatch, capsys):
    from mode.cli import main

    monkeypatch.chdir(tmp_path)
    cases = [["flops", "--config", str(ROOT / CFG), "--match", str(ROOT / CFG), "--knob", "model.n_layers"],
             ["compare", str(ROOT / "configs/experiments/quickstart.yaml"), "--seeds", "a,b", "--dry-run"],
             ["generate", "--run", str(tmp_path / "missing"), "--prompt", "x"]]
    (tmp_path / "norun").mkdir()
    (tmp_path / "norun" / "config.yaml").write_text((ROOT / CFG).read_text())
    cases.append(["generate", "--run", str(tmp_path / "norun"), "--prompt", "x"])
    for args in cases:
        assert main(args) == 2, args
        lines = one_line(capsys.readouterr().err)
        assert len(lines) == 1 and lines[0].startswith("config error: "), (args, lines)


@pytest.mark.parametrize("args,start", [
    (["analyze", "nothere"], "config error: RUNS_DIR='nothere': an existing directory"),
    (["analyze", ".", "--outt", "x"], "mode analyze: error: unrecognized arguments"),
    (["train", "--config", "x.yaml", "--bogus"], "mode train: error: unrecognized arguments: --bogus"),
    (["train", "train.max_steps=2"], "mode train: error: the following arguments are required: --config"),
    (["compare", "x.yaml", "--bogus"], "mode compare: error: unrecognized arguments: --bogus"),
    (["compare", "x.yaml", "--poll", "soon"], "mode compare: error: argument --poll"),
    (["launch", "--config", "x.yaml", "--bogus"], "python -m launch.run: error: unrecognized arguments: --bogus"),
    (["launch", "--num_gpus", "two", "--config", "x.yaml"], "python -m launch.run: error: argument --num_gpus"),
])
def test_a_bad_option_or_argument_is_one_line(tmp_path, monkeypatch, capsys, args, start):
    """Bug caught: `mode analyze` (a missing RUNS_DIR or a mistyped option), `mode train`, `mode
    compare` and `python -m launch.run` printed argparse's usage block before the error, unlike the
    other commands and the README ("Errors are one line")."""
    import launch.run
    from mode.cli import main

    monkeypatch.chdir(tmp_path)
    try:
        code = launch.run.main(args[1:]) if args[0] == "launch" else main(args)
    except SystemExit as e:  # argparse's exit, as `mode` exits from the command line
        code = e.code
    assert code == 2, args
    lines = one_line(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith(start), (args, lines)
    assert list(tmp_path.iterdir()) == []


def test_top_level_help_and_unknown_command(capsys):
    """`mode --help` lists the commands on stdout (exit 0); a mistyped command is named in one line (exit 2)."""
    from mode.cli import COMMANDS, main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: mode {") and all(c in out for c in COMMANDS)
    # one line of what each command does (it was the usage line alone), and --debug
    from mode.cli import SUMMARIES

    assert list(SUMMARIES) == list(COMMANDS) and all(f"  {c:<9}{w}" in out for c, w in SUMMARIES.items())
    assert "--debug (any command" in out
    assert main(["data", "--help"]) == 0 and capsys.readouterr().out.startswith("usage: mode data prepare")
    assert main(["trian", "--config", "x.yaml"]) == 2
    lines = one_line(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith("mode: error: unknown command 'trian'") and "train" in lines[0]


def test_a_mistyped_data_subcommand_is_named(capsys):
    """Bug caught: `mode data prepar ...` (or `mode data --config ...`, `prepare` left out) printed only
    the usage line, never saying what was wrong with the command."""
    from mode.cli import main

    for args, named in ((["data", "prepar", "--config", "x.yaml"], "'prepar'"),
                        (["data", "--config", "x.yaml"], "'--config'")):
        assert main(args) == 2
        lines = one_line(capsys.readouterr().err)
        assert lines == [f"mode data: error: unknown subcommand {named} (one of prepare); usage: mode data prepare "
                         "--config F [--force] [dotted.key=value ...]"], lines
    assert main(["data"]) == 2  # nothing given: the usage alone
    assert one_line(capsys.readouterr().err) == ["usage: mode data prepare --config F [--force] [dotted.key=value ...]"]


def test_generate_with_too_many_new_tokens_is_one_line(tmp_path, monkeypatch, capsys):
    """Bug caught: the error blamed --max-new-tokens with a bound from the first prompt (negative
    for a prompt too long on its own; one the longest prompt then refused again)."""
    from mode.cli import main
    from mode.config import dump_config, load_config
    from mode.model import build_model

    cfg = load_config(CFG, [*TINY, "model.max_seq_len=64"])
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    fake_checkpoint(tmp_path, 1, build_model(cfg.model).state_dict())
    monkeypatch.chdir(tmp_path)

    def gen(*args):
        code = main(["generate", "--run", str(tmp_path), *args])
        return code, one_line(capsys.readouterr().err)

    assert gen("--prompt", "ab", "--max-new-tokens", "62")[0] == 0
    # 3 prompt tokens (with the leading EOS) + 63 new need 65 positions > 64
    code, lines = gen("--prompt", "ab", "--max-new-tokens", "63")
    assert code == 2 and len(lines) == 1 and lines[0].startswith("config error: --max-new-tokens=63: at most 62: "
                                                                 "prompt 0, the longest, has 3 tokens"), lines
    long = "b" * 50  # the bound comes from the longest prompt, and following it works
    n_long = 1 + len(load_run_tokenizer(tmp_path).encode(long))
    code, lines = gen("--prompt", "x", "--prompt", long, "--max-new-tokens", "100")
    assert code == 2 and lines[0].startswith(f"config error: --max-new-tokens=100: at most {65 - n_long}: prompt 1"), lines
    assert gen("--prompt", "x", "--prompt", long, "--max-new-tokens", str(65 - n_long))[0] == 0
    # a prompt too long on its own is the prompt's fault, whatever the count
    code, lines = gen("--prompt", "x", "--prompt", "a b " * 40, "--max-new-tokens", "1")
    assert code == 2 and len(lines) == 1 and lines[0].startswith("config error: --prompt="), lines
    assert "at most 64 tokens" in lines[0] and "prompt 1 has" in lines[0], lines
    # temperatures: inf is refused in one line; a tiny one samples (the argmax), no NaN
    code, lines = gen("--prompt", "ab", "--temperature", "inf")
    assert code == 2 and lines == ["config error: --temperature=inf: a finite number >= 0 (0 = greedy)"], lines
    tiny_t = gen("--prompt", "ab", "--temperature", "1e-45", "--max-new-tokens", "5")
    assert tiny_t[0] == 0
    capsys.readouterr()


def load_run_tokenizer(run):
    from mode.generate import load_run

    return load_run(str(run), "cpu")[1]


def test_changing_the_moe_backend_is_not_a_resumption(tmp_path):
    from mode.config import ConfigError, dump_config, load_config
    from mode.train import check_run_dir

    d = tmp_path / "run"
    moe = ["model.moe.layers=every", "model.moe.num_experts=2", f"run.dir={d}"]
    d.mkdir()
    (d / "tb").mkdir()
    (d / "LOCK").write_text("")  # a run that ended (its lock released)
    (d / "config.yaml").write_text(dump_config(load_config(CFG, [*TINY, *moe])))
    with pytest.raises(ConfigError, match="model.moe.backend: 'native' -> 'deepspeed'"):
        check_run_dir(load_config(CFG, [*TINY, *moe, "model.moe.backend=deepspeed"]))
    # compiling changes how blocks run, not the weights' names: a resume may switch it (README, Speed)
    assert check_run_dir(load_config(CFG, [*TINY, *moe, "train.compile=true"])) is not None


def test_a_reader_falls_back_past_a_checkpoint_rotated_away_while_it_reads(tmp_path, monkeypatch):
    """Bug caught: sampling from a live run lists its checkpoints, and the run's checkpoint.keep
    rotation may delete one before it is verified: verify raised FileNotFoundError and `mode
    generate` failed instead of reporting it and taking the next one."""
    from mode import checkpoint as ckpt

    run = tmp_path / "run"
    older = fake_checkpoint(run, 2, {"w": torch.zeros(3)})
    rotated = fake_checkpoint(run, 4, {"w": torch.ones(3)})
    listed = ckpt.step_dirs

    def listed_then_rotated(root):
        dirs = listed(root)
        shutil.rmtree(rotated)  # the training process, between the reader's listing and its read
        return dirs

    monkeypatch.setattr(ckpt, "step_dirs", listed_then_rotated)
    lines = []
    assert ckpt.newest_weights(run, log=lines.append) == older
    assert len(lines) == 1 and "step_00000004" in lines[0] and "removed while it was being read" in lines[0], lines


def test_a_manifest_damaged_inside_still_parsing_falls_back(tmp_path):
    """Bug caught: a manifest whose JSON parsed but whose entries were damaged ("bztes" for "bytes",
    a list for the file table) crashed the resume with KeyError instead of falling back; and a
    second checkpoint moved aside (step_N.bad2) made the run unrecognisable (refused on resume)."""
    from mode import checkpoint as ckpt
    from mode import rundir

    root = tmp_path / "run" / "checkpoints"
    good = _fake_checkpoint(root, 2, 0)
    for i, damage in enumerate([lambda t: t.replace('"bytes"', '"bztes"', 1),
                                lambda t: json.dumps({"step": 4, "files": list(json.loads(t)["files"])}),
                                lambda t: json.dumps({"step": 4, "files": {"x": 3}})]):
        bad = _fake_checkpoint(root, 4, 1)
        m = bad / "MANIFEST.json"
        m.write_text(damage(m.read_text()))
        assert ckpt.verify(bad) == "unreadable MANIFEST.json", i
        assert ckpt.newest_verified(root, log=lambda s: None) == good
    assert sorted(p.name for p in root.iterdir()) == [
        "step_00000002", "step_00000004.bad", "step_00000004.bad2", "step_00000004.bad3"]
    (root.parent / "run_info.json").write_text('{"world_size": 1}')
    assert rundir.is_mode_run(root.parent)


def test_a_finished_run_without_checkpoints_is_not_silently_retrained(tmp_path):
    """Bug caught: a finished run whose checkpoints/ was removed (to save disk) trained again from
    step 0 on the same command, appending a second series to its metrics and TensorBoard logs."""
    from mode.config import ConfigError, dump_config, load_config
    from mode.train import check_run_dir

    d = tmp_path / "run"
    (d / "checkpoints").mkdir(parents=True)
    (d / "LOCK").write_text("")
    cfg = load_config(CFG, [*TINY, f"run.dir={d}"])
    (d / "config.yaml").write_text(dump_config(cfg))
    check_run_dir(cfg)  # a run that never reached a checkpoint starts (again)
    (d / "DONE").write_text("{}")
    with pytest.raises(ConfigError, match=r"finished \(DONE\) but holds no checkpoint .* pass run.fresh=true"):
        check_run_dir(cfg)
    check_run_dir(load_config(CFG, [*TINY, f"run.dir={d}", "run.fresh=true"]))  # fresh retrains


def test_prepared_data_inside_the_run_dir_is_refused_before_preparing(tmp_path, capsys):
    """Bug caught: data.prepared_dir inside run.dir prepared the data there, then the start refused
    its own run directory ("holds data, which mode did not write")."""
    from mode.train import main

    run = tmp_path / "run"
    for prepared in (run / "data", run):
        assert main(["--config", str(ROOT / CFG), *TINY, f"run.dir={run}", f"data.prepared_dir={prepared}"]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"config error: data.prepared_dir={str(prepared)!r}: a directory outside run.dir ({run})"]
    assert not run.exists()


@pytest.mark.parametrize("text", ["", "[2]", '{"world_size": "2"}', '{"world_size": 1.5}'])
def test_a_damaged_run_info_is_one_line_naming_it(tmp_path, text):
    """Bug caught: an empty run_info.json stopped the start with `error: JSONDecodeError: Expecting
    value`, naming neither the file nor what to do; a world_size that is no whole number was reported
    as "saved at world size 2" to a launch of world size 2. One written before world_size was
    recorded resumes at any world size; the finished-run hint reads a damaged one as unknown."""
    from mode.config import ConfigError, load_config
    from mode.train import check_world, saved_world

    d = tmp_path / "run"
    (d / "checkpoints" / "step_00000002").mkdir(parents=True)
    (d / "checkpoints" / "step_00000002" / "MANIFEST.json").write_text("{}")
    (d / "run_info.json").write_text(text)
    with pytest.raises(ConfigError, match="its run_info.json is damaged"):
        check_world(load_config(CFG, [*TINY, f"run.dir={d}"]), 2)
    assert saved_world(d) is None
    (d / "run_info.json").write_text("{}")
    check_world(load_config(CFG, [*TINY, f"run.dir={d}"]), 2)


def test_print_config_refuses_a_run_saved_at_another_world_size(tmp_path, capsys, monkeypatch):
    """Bug caught: `mode train --print-config` (the dry run that accepts only what a start accepts)
    printed the config of a run saved at world size 2 for a launch of 1, which a start refuses."""
    from mode.config import dump_config, load_config

    run = tmp_path / "run"
    args = [*TINY, "train.max_steps=6", f"run.dir={run}"]
    fake_checkpoint(run, 2, {})
    (run / "config.yaml").write_text(dump_config(load_config(CFG, args)))
    (run / "run_info.json").write_text(json.dumps({"world_size": 2}))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    r = mode_here(capsys, monkeypatch, "train", "--print-config", "--config", CFG, *args)
    assert r.returncode == 2 and r.stderr.startswith(f"config error: run.dir={str(run)!r} was saved at world size 2 "
                                                     "and this launch has world size 1"), r.stderr
    monkeypatch.setenv("WORLD_SIZE", "2")
    r = mode_here(capsys, monkeypatch, "train", "--print-config", "--config", CFG, *args)
    assert r.returncode == 0 and "max_steps: 6" in r.stdout, r.stderr


def test_a_tilde_of_no_user_is_one_config_error_line(tmp_path, capsys, monkeypatch):
    """Bug caught: `~name/...` of no user of the machine (a typo for `~/name`) stopped `mode analyze`,
    `mode compare --runs-dir` and `mode eval --out` with `error: RuntimeError: Could not determine
    home directory.` (exit 1), naming neither the option nor the path. (Config keys: tests/malformed.py.)"""
    exp = tmp_path / "exp.yaml"
    exp.write_text(f"variants:\n  dense: {{config: {ROOT / CFG}}}\n")
    bad = "~nosuchuser_mode/x"
    for args, key in ((["analyze", bad], "RUNS_DIR"), (["analyze", str(tmp_path), "--out", bad], "--out"),
                      (["compare", exp, "--dry-run", "--runs-dir", bad], "--runs-dir"),
                      (["eval", "--run", str(tmp_path), "--tasks", "x", "--out", bad], "--out")):
        r = mode_here(capsys, monkeypatch, *args)
        lines = r.stderr.splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"config error: {key}={bad!r}: "), r.stderr
        assert "~user names a user" in lines[0] or args[0] == "eval", lines  # (eval: its --out's directory is missing)


def test_stale_build_lock_is_detected(tmp_path, monkeypatch):
    """A lock is stale when no process holds it open (torch's FileBaton keeps it open while it builds or
    loads), whatever its age: a start killed seconds ago left one that hangs every later start."""
    from mode.lifeline import stale_build_locks

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    fd = os.open(lock, os.O_CREAT | os.O_EXCL)  # as FileBaton.try_acquire
    try:
        assert stale_build_locks(confirm_s=0.01) == []  # held: a build or load is under way
    finally:
        os.close(fd)
    assert stale_build_locks(confirm_s=0.01) == [lock]  # its holder is gone, the file is seconds old


@pytest.mark.slow  # starts a process
def test_a_busy_holder_of_a_build_lock_is_not_called_stale(tmp_path, monkeypatch):
    """Bug caught (a 2-rank CI run failed): rank 0 held the lock while loading the op, opening and
    closing files; one of its fds closed between listing and reading them and the whole process was
    skipped, so rank 1's pre-launch check called the held lock stale and exited 2."""
    from mode.lifeline import stale_build_locks

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    # files open below the lock's fd number, closed and reopened all the time
    churn = ("import os, sys\nfds = [os.open(os.devnull, os.O_RDONLY) for _ in range(500)]\n"
             "os.open(sys.argv[1], os.O_CREAT | os.O_EXCL)\nprint(flush=True)\n"
             "while True:\n    for fd in fds:\n        os.close(fd)\n"
             "    fds = [os.open(os.devnull, os.O_RDONLY) for _ in fds]\n")
    holder = subprocess.Popen([sys.executable, "-c", churn, str(lock)], stdout=subprocess.PIPE)
    try:
        holder.stdout.readline()
        assert [stale_build_locks(confirm_s=0.01) for _ in range(20)] == [[]] * 20
    finally:
        holder.kill()
        holder.wait()


def test_a_holder_whose_fds_churn_mid_scan_still_holds_its_lock(tmp_path):
    """Fast twin of the test above (same process, a thread churns fds below the lock's): a fd that
    closes between listing and reading must not end the scan of its process before the lock's fd."""
    import threading

    from mode.lifeline import _in_use

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # let the churning thread run between listing and reading
    lock = tmp_path / "lock"
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(500)]
    lock_fd = os.open(lock, os.O_CREAT | os.O_EXCL)
    stop = threading.Event()

    def churn():
        nonlocal fds
        while not stop.is_set():
            for fd in fds:
                os.close(fd)
            fds = [os.open(os.devnull, os.O_RDONLY) for _ in fds]

    t = threading.Thread(target=churn)
    t.start()
    try:
        assert [_in_use(lock) for _ in range(20)] == [True] * 20
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old_interval)
        for fd in fds + [lock_fd]:
            os.close(fd)


def test_on_a_network_filesystem_an_unheld_lock_is_stale_only_once_its_build_is_quiet(tmp_path, monkeypatch):
    """A builder on another node holds the lock where this host cannot see it: there, a lock is stale
    only when nothing in its build directory changed for remote_quiet_s."""
    from mode import lifeline

    mounts = "/dev/vda / ext4 rw 0 0\nserver:/export /shared nfs4 rw 0 0\nserver:/x /shared/x\\040y lustre rw 0 0\n"
    assert lifeline.fs_type(Path("/shared/venv/torch_extensions"), mounts) == "nfs4"
    assert lifeline.fs_type(Path("/sharedother/venv"), mounts) == "ext4"
    assert lifeline.fs_type(Path("/shared/x y/ext"), mounts) == "lustre"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(lifeline, "fs_type", lambda path: "nfs4")  # this machine has no NFS server to mount
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.write_text("")
    (lock.parent / ".ninja_log").write_text("")
    assert lifeline.stale_build_locks(confirm_s=0.01, remote_quiet_s=60) == []  # maybe building elsewhere
    old = time.time() - 120
    os.utime(lock, (old, old))
    assert lifeline.stale_build_locks(confirm_s=0.01, remote_quiet_s=60) == []  # ninja's log just changed
    os.utime(lock.parent / ".ninja_log", (old, old))
    assert lifeline.stale_build_locks(confirm_s=0.01, remote_quiet_s=60) == [lock]


@pytest.mark.slow
def test_a_live_build_is_not_called_stale(tmp_path, monkeypatch):
    from mode.lifeline import stale_build_locks

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.write_text("")
    builder = subprocess.Popen(["sleep", "60"], cwd=lock.parent)  # stands where ninja would run
    try:
        assert stale_build_locks() == []
    finally:
        builder.kill()
        builder.wait()
    assert stale_build_locks() == [lock]


@pytest.mark.slow
def test_stale_build_lock_refuses_the_start_in_one_line(tmp_path):
    lock = tmp_path / "ext" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")  # left seconds ago by a killed start
    r = subprocess.run([PY, "-m", "mode.cli", "train", "--config", CFG, *TINY, f"run.dir={tmp_path / 'run'}"],
                       cwd=ROOT, env=dict(env(1), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext")), capture_output=True,
                       text=True, timeout=120)
    lines = one_line(r.stderr)
    assert r.returncode == 2 and len(lines) == 1 and f"rm {lock}" in lines[0], r.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_start_waiting_on_a_build_whose_builder_dies_stops_in_one_line(tmp_path):
    """The builder holds the lock through the start's pre-launch check, then is killed while the start
    waits on the lock inside DeepSpeed's op load: torch would wait forever; the start stops in one line."""
    lock = tmp_path / "ext" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen([PY, "-c", "import os, sys, time; os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); "
                               "print(flush=True); time.sleep(600)", str(lock)], stdout=subprocess.PIPE)
    prepared = tmp_path / "prepared"
    holder.stdout.readline()  # it holds the lock
    start = subprocess.Popen([PY, "-m", "mode.cli", "train", "--config", CFG, *TINY, f"run.dir={tmp_path / 'run'}",
                              f"data.prepared_dir={prepared}"], cwd=ROOT, text=True, stderr=subprocess.PIPE,
                             env=dict(env(1), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext")))
    try:
        deadline = time.time() + 120
        while not list(prepared.glob("*/manifest.json")):  # the pre-launch check (lock first, data last) passed
            assert start.poll() is None and time.time() < deadline, start.stderr.read()
            time.sleep(0.2)
        holder.kill()
        _, err = start.communicate(timeout=60)
    finally:
        for p in (holder, start):  # a hung start (the bug) must not outlive the test
            p.kill()
            p.wait()
    lines = one_line(err)
    assert start.returncode == 2 and len(lines) == 1 and f"rm {lock}" in lines[0], err


# ----------------------------------------------------------------------------------------------
# End to end, through the CLI.


def test_fresh_on_a_users_directory_deletes_nothing(tmp_path, monkeypatch, capsys):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "thesis.tex").write_text("years of work")
    r = mode_here(capsys, monkeypatch, "train", "--config", CFG, *TINY, f"run.dir={notes}", "run.fresh=true")
    lines = one_line(r.stderr)
    assert r.returncode == 2 and len(lines) == 1 and "thesis.tex" in lines[0], lines
    assert sorted(p.name for p in notes.iterdir()) == ["thesis.tex"]
    # an empty run.dir (an unset shell variable) with fresh: the current directory (ROOT) is untouched
    cwd_before = sorted(p.name for p in ROOT.iterdir())
    r = mode_here(capsys, monkeypatch, "train", "--config", CFG, *TINY, "run.dir=", "run.fresh=true")
    assert r.returncode == 2 and one_line(r.stderr)[0].startswith("config error: run.dir=''"), r.stderr
    assert sorted(p.name for p in ROOT.iterdir()) == cwd_before


CKPT_RUN = [*TINY, "train.max_steps=8", "train.log_every=3", "train.eval_every=0", "checkpoint.every=2",
            "checkpoint.keep=3", "optim.warmup_steps=2"]


def tensorboard_steps(run_dir, tag: str) -> list[int]:
    """The steps of `tag` as TensorBoard itself loads them (its EventAccumulator over tb/: the view
    a researcher opens), duplicates included."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(Path(run_dir) / "tb"), size_guidance={"scalars": 0})
    ea.Reload()
    return [e.step for e in ea.Scalars(tag)]


def train_1t(*args, **kw):
    """mode train with one thread: runs compared bit for bit must sum in the same order."""
    return mode_cli("train", "--config", CFG, *args, threads=1, **kw)


@pytest.fixture(scope="module")
def stopped_at_6(tmp_path_factory):
    """An uninterrupted run and the same run stopped at step 6 (checkpoints 2, 4, 6), side by side."""
    d = tmp_path_factory.mktemp("fallback")
    side_by_side(lambda: train_1t(*CKPT_RUN, f"run.dir={d / 'ref'}"),
                 lambda: train_1t(*CKPT_RUN, "train.stop_at=6", f"run.dir={d / 'stopped'}"))
    return d


@pytest.mark.slow
@pytest.mark.parametrize("how", ["flipped", "truncated"])
def test_fallback_checkpoint_losses_equal_an_uninterrupted_run(tmp_path, how, stopped_at_6):
    """The newest checkpoint is damaged: the run says so in one line, resumes from the previous one,
    and its logged losses (log_every=3 does not divide checkpoint.every=2) equal an uninterrupted run's."""
    d = tmp_path / "run"
    shutil.copytree(stopped_at_6 / "stopped", d)
    ck = d / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["step_00000002", "step_00000004", "step_00000006"]
    _damage(ck / "step_00000006", how)

    r = train_1t(*CKPT_RUN, f"run.dir={d}")
    complaints = [ln for ln in one_line(r.stderr) if "step_00000006" in ln]
    assert len(complaints) == 1 and "unusable" in complaints[0], r.stderr
    assert f"resumed from {ck / 'step_00000004'} at step 4" in r.stderr
    a, b = scalars(stopped_at_6 / "ref", "train/loss"), scalars(d, "train/loss")
    assert list(a) == [3, 6, 8] and a == b, (a, b)  # bit for bit, the step-6 mean included
    assert (ck / "step_00000006.bad").is_dir() and (d / "DONE").exists()
    # Bug caught: metrics.jsonl kept the stopped process's step-6 row (logged past the checkpoint
    # resumed from) beside the resumed run's; the resume point is recorded for TensorBoard's readers
    rows = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}
    assert len(logged) == len([r for r in rows if "train/loss" in r]) and logged == pytest.approx(a, rel=1e-6), rows
    assert [r["step"] for r in json.loads((d / "run_info.json").read_text())["resumes"]] == [4]
    # Bug caught: TensorBoard itself showed the stopped process's step-6 points beside the resumed run's
    # (two points at step 6, on the tokens and MFLOPs axes too): the resume rewrites its event files
    for tag in ("train/loss", "train/loss_vs_tokens", "train/loss_vs_mflops"):
        steps = tensorboard_steps(d, tag)
        assert len(steps) == 3 and len(set(steps)) == 3, (tag, steps)
    assert tensorboard_steps(d, "train/loss") == [3, 6, 8]


@pytest.mark.slow
def test_a_restart_before_the_first_checkpoint_logs_each_step_once(tmp_path, stopped_at_6):
    """Bug caught: a run killed before its first checkpoint starts over at step 0, and that start was
    not taken for a resume: metrics.jsonl kept the dead process's rows beside the new ones (steps
    logged twice, and steps the new process never trained), and run_info.json recorded no resume,
    so `mode analyze` showed the dead process's points past where the new one stopped."""
    from analysis.tb import load_run_log

    d = tmp_path / "run"
    shutil.copytree(stopped_at_6 / "ref", d)  # its logs (steps 3, 6, 8) stand for the dead process's
    shutil.rmtree(d / "checkpoints")
    (d / "DONE").unlink()
    train_1t(*CKPT_RUN, "train.stop_at=4", f"run.dir={d}")
    rows = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [3], rows
    assert [r["step"] for r in json.loads((d / "run_info.json").read_text())["resumes"]] == [0]
    assert [p.step for p in load_run_log(d).scalars["train/loss"]] == [3]
    assert tensorboard_steps(d, "train/loss") == [3]  # TensorBoard's own view: the dead process's 6, 8 gone
    train_1t(*CKPT_RUN, f"run.dir={d}")  # and on to the end: one row per logged step, the reference's
    rows = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines()]
    logged = [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r]
    ref = scalars(stopped_at_6 / "ref", "train/loss")
    assert [s for s, _ in logged] == [3, 6, 8] and dict(logged) == pytest.approx(ref, rel=1e-6), logged


@pytest.mark.slow
def test_log_series_is_exact_across_a_resume_at_any_cadence(tmp_path):
    run = [*TINY, "train.max_steps=10", "train.log_every=4", "train.eval_every=0", "checkpoint.every=3",
           "optim.warmup_steps=2"]
    side_by_side(lambda: train_1t(*run, f"run.dir={tmp_path / 'ref'}"),
                 lambda: train_1t(*run, "train.stop_at=7", f"run.dir={tmp_path / 'run'}"))
    train_1t(*run, f"run.dir={tmp_path / 'run'}")
    for tag in ("train/loss", "train/aux_loss"):
        a, b = scalars(tmp_path / "ref", tag), scalars(tmp_path / "run", tag)
        assert list(a) == [4, 8, 10] and a == b, (tag, a, b)


NAN_SCRIPT = '''
import json, sys
import torch
from mode import checkpoint as ckpt
from mode.config import load_config
from mode.train import Trainer

a = json.loads(sys.argv[1])
t = Trainer(load_config(a["config"], a["overrides"]))
step = t.train_step
def poisoned(acc):
    step(acc)
    if t.step == a["poison_after"]:  # the weights themselves turn NaN (not the gradient)
        with torch.no_grad():
            t.model.blocks[0].mlp.mlp.w_in.weight.fill_(float("nan"))
t.train_step = poisoned
try:
    t.fit()
    print("RESULT " + json.dumps({"error": None}))
except ckpt.CheckpointError as e:
    print("RESULT " + json.dumps({"error": str(e), "step": t.step}))
'''


@pytest.mark.slow
def test_a_nonfinite_state_is_never_saved_and_the_good_checkpoint_survives(tmp_path):
    d = tmp_path / "run"
    script = tmp_path / "nan.py"
    script.write_text(main_guarded(NAN_SCRIPT))
    args = {"config": CFG, "poison_after": 3,
            "overrides": [*TINY, "train.max_steps=8", "train.eval_every=0", "checkpoint.every=2", "checkpoint.keep=1",
                          "train.max_consecutive_nonfinite=9", f"run.dir={d}"]}
    r = subprocess.run([PY, str(script), json.dumps(args)], cwd=ROOT, env=dict(env(1), PYTHONPATH=str(ROOT)),
                       capture_output=True, text=True, timeout=300)
    res = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    assert res["error"] and "not saving step 4: non-finite weights" in res["error"], (res, r.stderr[-2000:])
    assert "blocks.0.mlp.mlp.w_in.weight" in res["error"] and "step_00000002" in res["error"]
    from mode import checkpoint as ckpt

    ck = d / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["step_00000002"]  # keep=1 rotated nothing away
    assert ckpt.verify(ck / "step_00000002") is None


# ----------------------------------------------------------------------------------------------
# One writer per run, compare's signals, orphans.

LONG = [*TINY, "train.max_steps=100000", "train.eval_every=0", "train.log_every=10", "checkpoint.every=0"]


def _popen(args, **kw):
    return subprocess.Popen([PY, "-m", "mode.cli", *map(str, args)], cwd=ROOT, env=env(1), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, **kw)


def _wait_for(pred, timeout=180, what=""):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.1)


def _holder(d: Path) -> dict:
    try:
        return json.loads((d / "LOCK").read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _stop(p):
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


@pytest.mark.slow
def test_second_trainer_on_a_live_run_exits_2_and_the_first_finishes(tmp_path, monkeypatch, capsys):
    from mode.cli import main

    d = tmp_path / "run"
    run = [*TINY, "train.max_steps=500", "train.eval_every=0", "train.log_every=100", "checkpoint.every=250"]
    first = _popen(["train", "--config", CFG, *run, f"run.dir={d}"])
    try:
        _wait_for(lambda: (d / "tb").is_dir() or first.poll() is not None, what="the first trainer")
        assert first.poll() is None, first.communicate()[1][-3000:]
        monkeypatch.chdir(ROOT)
        rc = main(["train", "--config", CFG, *run, f"run.dir={d}"])  # the second writer: the real CLI, in-process
        was_running = first.poll() is None
        out, err = first.communicate(timeout=900)
    finally:
        _stop(first)
    lines = one_line(capsys.readouterr().err)
    assert was_running, "the first trainer finished before the second started: make it longer"
    assert rc == 2 and len(lines) == 1, lines
    assert f"in use by pid {first.pid} on " in lines[0] and "cli.py train --config" in lines[0], lines
    assert first.returncode == 0 and (d / "DONE").exists(), err[-3000:]
    assert sorted(scalars(d, "train/loss")) == list(range(100, 501, 100))


@pytest.mark.slow
def test_second_compare_refused_and_sigterm_stops_the_trainer(tmp_path, capsys):
    exp = tmp_path / "exp.yaml"
    exp.write_text(f"name: lock\nruns_dir: {tmp_path / 'runs'}\nseeds: [0]\n"
                   f"overrides: {json.dumps(LONG)}\nvariants:\n  dense: {{config: {ROOT / CFG}}}\n")
    run = tmp_path / "runs" / "dense_seed0"
    first = _popen(["compare", exp])
    try:
        _wait_for(lambda: _holder(run).get("pid") or first.poll() is not None, what="the trainer's lock")
        assert first.poll() is None, first.communicate()[1][-3000:]
        trainer = _holder(run)["pid"]
        from mode.compare import main as compare  # the second compare in-process: refused before any handler

        capsys.readouterr()
        rc = compare([str(exp)])
        lines = one_line(capsys.readouterr().err)
        assert rc == 2 and len(lines) == 1 and f"in use by pid {first.pid}" in lines[0], lines
        assert _alive(trainer)

        os.kill(first.pid, signal.SIGTERM)  # to compare only, not its group
        t0 = time.monotonic()
        rc = first.wait(timeout=60)
        _wait_for(lambda: not _alive(trainer), timeout=30, what="the trainer to exit")
        dt = time.monotonic() - t0
    finally:
        _stop(first)
    print(f"\nSIGTERM to compare -> compare and its trainer gone in {dt:.1f}s")
    assert rc == 128 + signal.SIGTERM and dt < 10, (rc, dt)
    assert _holder(run) == {} or not _alive(_holder(run)["pid"])
    from mode.rundir import check_lock

    check_lock(run)  # free: the next compare may resume it


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["deepspeed.launcher.launch", "deepspeed.launcher.runner"])
def test_ranks_exit_when_their_launcher_is_killed(tmp_path, victim):
    from tests.test_launch import processes_mentioning, rank_pid

    d = tmp_path / "run"
    cmd = [PY, "-u", "-m", "deepspeed.launcher.runner", "--hostfile", "/dev/null/none", "--num_gpus", "2",
           "--master_port", str(free_port()), "--module", "mode.train", "--config", CFG, *LONG,
           "train.micro_batch_size=2", f"run.dir={d}"]
    log = open(tmp_path / "ds.log", "w")
    p = subprocess.Popen(cmd, cwd=ROOT, env=env(1), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for(lambda: (d / "tb").is_dir() or p.poll() is not None, timeout=300, what="training to start")
        assert p.poll() is None, (tmp_path / "ds.log").read_text()[-3000:]
        ranks = [rank_pid(r, f"run.dir={d}") for r in (0, 1)]
        assert None not in ranks, processes_mentioning(str(d))
        target = p.pid if victim.endswith("runner") else \
            [pid for pid, c in processes_mentioning(f"run.dir={d}") if victim in c][0]
        os.kill(target, signal.SIGKILL)
        t0 = time.monotonic()
        _wait_for(lambda: not any(_alive(r) for r in ranks), timeout=30, what="the ranks to exit")
        dt = time.monotonic() - t0
    finally:
        _stop(p)
        for pid, _ in processes_mentioning(f"run.dir={d}"):
            os.kill(pid, signal.SIGKILL)
    print(f"\nSIGKILL of {victim} -> both ranks gone in {dt:.1f}s")
    assert dt < 10, dt


# ----------------------------------------------------------------------------------------------
# Disk full and read-only, on real (tmpfs) file systems: needs mount rights (root), else skipped.


def _mount_tmpfs(path: Path, opts: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.mark.slow
def test_disk_full_at_a_checkpoint_is_one_line_naming_the_cause(tmp_path):
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "size=300k")  # config, TensorBoard files fit; the first checkpoint does not
    try:
        r = mode_cli("train", "--config", CFG, *TINY, "train.max_steps=4", "train.eval_every=0",
                     "checkpoint.every=2", f"run.dir={disk / 'run'}", check=False)
        lines = one_line(r.stderr)
        leftovers = sorted(p.name for p in (disk / "run" / "checkpoints").iterdir())
    finally:
        _umount(disk)
    assert r.returncode == 1 and len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith("error: cannot write checkpoint") and "no space left on device" in lines[0], lines
    assert leftovers == []  # the partial save was removed, giving the space back


@pytest.mark.slow
def test_read_only_checkpoints_are_refused_before_any_step(tmp_path):
    d = tmp_path / "run"
    (d / "tb").mkdir(parents=True)
    (d / "LOCK").write_text("")  # a run that started once (its lock released)
    _mount_tmpfs(d / "checkpoints", "ro,size=1m")
    try:
        r = mode_cli("train", "--config", CFG, *TINY, "train.max_steps=4", f"run.dir={d}", check=False)
    finally:
        _umount(d / "checkpoints")
    lines = one_line(r.stderr)
    assert r.returncode == 2 and len(lines) == 1 and "read-only" in lines[0], r.stderr[-3000:]
    assert sorted(p.name for p in d.iterdir()) == ["LOCK", "checkpoints", "tb"]  # nothing written


def test_a_lock_the_disk_refuses_is_one_line_and_leaves_no_run_dir(tmp_path, monkeypatch):
    """Bug caught (fault walkthrough, a full disk): DirLock's buffered write failed, then close() in
    __del__ flushed it again: `error: no space left on device` (no place named) followed by a
    10-line `Exception ignored in: DirLock.__del__` traceback, and the new run.dir stayed holding
    LOCK. A real refused write here: a file size limit (RLIMIT_FSIZE: EFBIG past 8 bytes)."""
    import gc
    import resource

    from mode import rundir
    from mode.errors import one_line

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)  # where "Exception ignored in" goes
    limit, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (8, limit[1]))
        with pytest.raises(OSError) as e:
            rundir.DirLock(tmp_path / "run")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
    gc.collect()
    assert not unraisable, unraisable
    line, code = one_line(e.value)
    assert code == 1 and str(tmp_path / "run" / "LOCK") in line, line
    assert not (tmp_path / "run").exists()
    lock = rundir.DirLock(tmp_path / "run")  # with room: taken, and released whole
    assert json.loads((tmp_path / "run" / "LOCK").read_text())["pid"] == os.getpid()
    lock.release()
    assert (tmp_path / "run" / "LOCK").read_text() == ""


def test_a_dangling_symlink_run_dir_is_one_config_error(tmp_path):
    """Bug caught (fault walkthrough): `run.dir` a symbolic link to nothing passed every check
    (`exists()` is False: taken for a new path), then the start failed after DeepSpeed's init with
    `error: FileExistsError` (a loop: `RuntimeError: Symlink loop`), exit 1, both ranks started."""
    from mode import rundir
    from mode.config import ConfigError

    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for name in ("dangling", "loop"):
        with pytest.raises(ConfigError, match=rf"^config error: run.dir='{tmp_path / name}': an existing directory "
                                              r"or a new path \(.* is a symbolic link to .*, which does not exist\)"):
            rundir.check(str(tmp_path / name), fresh=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "loop"]
    (tmp_path / "nothing").mkdir()  # the link's target made: a run may go there
    assert rundir.check(str(tmp_path / "dangling"), fresh=False) == tmp_path / "dangling"


def test_a_run_with_a_crash_damaged_lock_or_run_info_is_still_a_run(tmp_path):
    """Bug caught (fault walkthrough): a LOCK left holding NUL bytes (a crash) or an emptied or cut
    run_info.json made the run "not a mode run (its run_info.json holds what mode does not write
    there)": neither resumable nor startable over, and the message meant for it ("its run_info.json
    is damaged ...; delete it") never reached. With step checkpoints proving the run, text that is no
    JSON at all is damage; a user's own JSON file of that name still refuses."""
    from mode import rundir
    from mode.config import ConfigError
    from tests.util import fake_run

    _, run = fake_run(tmp_path, "dense")
    for name, content in (("LOCK", "\0" * 64), ("run_info.json", ""), ("run_info.json", '{"world_size": 1, "tok')):
        (run / name).write_text(content)
        assert rundir.check(str(run), fresh=False) == run, (name, content)
        (run / name).unlink()
    (run / "run_info.json").write_text(json.dumps({"my": "notes"}))  # valid JSON, not mode's: a user's
    with pytest.raises(ConfigError, match="its run_info.json holds what mode does not write there"):
        rundir.check(str(run), fresh=False)

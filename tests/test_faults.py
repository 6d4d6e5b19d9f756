"""Surviving faults: a rank killed mid-run, a kill during a checkpoint save, non-finite losses and
gradients, and a run directory written by an incompatible config."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import textwrap
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.test_launch import (COMMON, EP, EP_CONFIG, kill_groups, logs, processes_mentioning, rank_pid, run_two_nodes,
                               start_two_nodes, wait_all)
from tests.util import PY, ROOT, TINY, env, free_port, main_guarded, mode_cli, scalars, side_by_side

CFG = "configs/tiny/dense.yaml"


# ----------------------------------------------------------------------------------------------
# (a) One rank of a two-node job killed with SIGKILL.


@pytest.mark.slow
def test_sigkill_of_one_rank_ends_the_job_and_rerun_resumes_exactly(tmp_path):
    """Two simulated nodes training the expert-parallel model (all-to-all between the nodes)."""
    steps = 24
    run = [*COMMON, *EP, f"train.max_steps={steps}", "checkpoint.every=4", "checkpoint.keep=2"]
    killed = tmp_path / "killed"
    port = free_port()
    cmd = [EP_CONFIG, *run, f"run.dir={killed}"]
    procs = start_two_nodes(tmp_path, *cmd, port=port, log_prefix="kill")
    try:
        deadline = time.monotonic() + 240
        while not (killed / "checkpoints" / "step_00000008").is_dir():  # mid-run: a checkpoint exists
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), logs(tmp_path, "kill")
            time.sleep(0.02)
        victim = rank_pid(1, f"run.dir={killed}")  # the rank on the second node
        assert victim is not None, processes_mentioning(str(killed))
        os.kill(victim, signal.SIGKILL)
        t_kill = time.monotonic()
        rcs = wait_all(procs, 60)
        dt = time.monotonic() - t_kill
    finally:
        kill_groups(procs)
    print(f"\nSIGKILL of rank 1 -> both launchers exited in {dt:.1f}s (exit codes {rcs})")
    assert all(rc != 0 for rc in rcs), (rcs, logs(tmp_path, "kill"))
    assert dt < 30, dt
    time.sleep(0.5)
    assert processes_mentioning(f"run.dir={killed}") == []  # nothing left behind
    assert not (killed / "DONE").exists()

    def rerun():
        procs = start_two_nodes(tmp_path, *cmd, port=port, log_prefix="resume")  # the same command again
        return wait_all(procs, 300)

    ref = tmp_path / "ref"  # the uninterrupted run, trained beside the rerun (own hostfile and logs)
    (tmp_path / "ref_launch").mkdir()
    _, rcs = side_by_side(lambda: run_two_nodes(tmp_path / "ref_launch", EP_CONFIG, *run, f"run.dir={ref}"), rerun)
    assert rcs == [0, 0], logs(tmp_path, "resume")
    resumed_at = [ln for ln in (tmp_path / "resume0.log").read_text().splitlines() if "resumed from" in ln]
    assert resumed_at and int(resumed_at[0].split("step_")[1][:8]) >= 8, logs(tmp_path, "resume")
    a, b = scalars(ref, "train/loss"), scalars(killed, "train/loss")
    assert list(a) == list(b) == list(range(1, steps + 1))
    assert b[steps] == a[steps] and b == a, (a, b)  # the same final loss, bit for bit


# ----------------------------------------------------------------------------------------------
# Trainer-API scripts, each in its own process (a Trainer joins a process group for its lifetime).

SCRIPT = textwrap.dedent('''
    import json, math, sys, time
    import torch
    import mode.checkpoint as ckpt
    from mode.config import load_config
    from mode.train import NonFiniteError, Trainer

    a = json.loads(sys.argv[1])
    t = Trainer(load_config(a["config"], a["overrides"]))
    nan = float("nan")
    current = lambda: t.step + 1  # the step being computed (TensorBoard numbering)

    # non-finite loss: a block's output (the last one's unless nan_block says) becomes NaN
    t.model.blocks[a.get("nan_block", -1)].register_forward_hook(
        lambda m, i, out: out * nan if m.training and current() in a.get("nan_forward", []) else None)
    # non-finite gradient only (finite loss): one weight's gradient becomes NaN
    w = dict(t.model.named_parameters())["blocks.0.mlp.mlp.w_in.weight"]
    w.register_hook(lambda g: g * nan if current() in a.get("nan_grad", []) else g)

    if a.get("slow_save_at"):  # keep the save of that step in progress (its .tmp written) until killed
        rng_state = ckpt.rng_state
        def slow():
            if t.step == a["slow_save_at"]:
                print("SAVING", flush=True)
                time.sleep(600)
            return rng_state()
        ckpt.rng_state = slow

    change = {}
    train_step = t.train_step
    state = lambda: {**dict(t.model.named_parameters()), **dict(t.model.named_buffers())}  # thresholds are buffers
    def watched(acc):
        s = current()
        before = {n: p.detach().clone() for n, p in state().items()}
        try:
            train_step(acc)
        finally:
            change[s] = max((p.detach() - before[n]).abs().max().item() for n, p in state().items())
    t.train_step = watched

    out = {"error": None}
    try:
        t.fit()
    except NonFiniteError as e:
        out["error"] = str(e)
    out.update(change=change, skipped=t.engine.skipped_steps, step=t.step, logs_closed=t.log.jsonl.closed,
               finite=all(bool(torch.isfinite(p).all()) for p in state().values()))
    print("RESULT " + json.dumps(out), flush=True)
''')


def trainer_script(tmp_path: Path, args: dict, threads: int = 2, **kw) -> subprocess.Popen:
    script = tmp_path / "fault_script.py"
    script.write_text(main_guarded(SCRIPT))
    e = dict(env(threads), PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.Popen([PY, str(script), json.dumps(args)], cwd=ROOT, env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def run_script(tmp_path: Path, args: dict, threads: int = 2) -> dict:
    p = trainer_script(tmp_path, args, threads)
    try:
        out, err = p.communicate(timeout=300)
    finally:
        p.kill()  # a timed-out script must not train on as an orphan (no-op once it has exited)
    assert p.returncode == 0, err[-3000:]
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert line, out + err[-3000:]
    return json.loads(line[-1][len("RESULT "):])


# ----------------------------------------------------------------------------------------------
# (b) A kill while a checkpoint is being written.


@pytest.mark.slow
def test_kill_during_checkpoint_save_leaves_previous_checkpoint_loadable(tmp_path):
    run = [*TINY, "train.max_steps=8", "train.log_every=1", "train.eval_every=0", "checkpoint.every=2",
           "checkpoint.keep=3", "optim.warmup_steps=2"]
    d = tmp_path / "run"
    ck = d / "checkpoints"

    def killed_while_saving():
        p = trainer_script(tmp_path, {"config": CFG, "overrides": [*run, f"run.dir={d}"], "slow_save_at": 6},
                           threads=1)  # one thread in all three runs: the losses are compared bit for bit
        watchdog = threading.Timer(240, p.kill)  # never wait on a stuck child
        watchdog.start()
        try:
            saving = any(line.strip() == "SAVING" for line in p.stdout)  # stops at SAVING (or EOF)
            tmp_there = (ck / "step_00000006.tmp").is_dir()  # DeepSpeed's files of step 6 are being written
            p.send_signal(signal.SIGKILL)
            p.wait(30)
        finally:
            watchdog.cancel()
            p.kill()
            _, err = p.communicate()
        return saving, tmp_there, err

    # the uninterrupted reference trains beside it
    _, (saving, tmp_there, err) = side_by_side(
        lambda: mode_cli("train", "--config", CFG, *run, f"run.dir={tmp_path / 'ref'}", threads=1), killed_while_saving)
    assert saving and tmp_there, err[-3000:]
    assert sorted(x.name for x in ck.iterdir()) == ["step_00000002", "step_00000004", "step_00000006.tmp"]

    r = mode_cli("train", "--config", CFG, *run, f"run.dir={d}", threads=1)  # the same run again
    assert f"resumed from {ck / 'step_00000004'} at step 4" in r.stderr, r.stderr[-3000:]
    assert (d / "DONE").exists() and not list(ck.glob("*.tmp"))  # the partial save was discarded
    a, b = scalars(tmp_path / "ref", "train/loss"), scalars(d, "train/loss")
    assert list(b) == list(range(1, 9)) and a == b


# ----------------------------------------------------------------------------------------------
# (c) Non-finite loss or gradient: skip and count, or stop naming the step and layer stats.

NF = [*TINY, "train.max_steps=8", "train.log_every=1", "train.eval_every=0", "checkpoint.every=0",
      "optim.warmup_steps=2"]


# The five runs below are independent: a module fixture starts them two at a time, side by side.
NF_CASES = {
    # the MoD model with a calibrated threshold: the NaN reaches layer 1's router, whose EMA steps in
    # the forward (bug caught: a skipped step left it NaN for good, and moved it even when finite)
    "skip_zero0": {"nan_forward": [3], "nan_block": 0, "nan_grad": [6], "config": "configs/tiny/mod.yaml",
                   "overrides": ["deepspeed.zero_stage=0", "model.mod.causal=threshold"]},
    "skip_zero2": {"nan_forward": [3], "nan_grad": [6], "overrides": ["deepspeed.zero_stage=2"]},
    # bf16 at ZeRO 1 accumulates in fp32: DeepSpeed's BF16_Optimizer checks the norm of its fp32 sum
    "skip_zero1_bf16": {"nan_forward": [3], "nan_grad": [6], "overrides": ["deepspeed.zero_stage=1",
                                                                           "deepspeed.precision=bf16"]},
    "stop": {"nan_grad": [3], "overrides": ["train.nonfinite=stop"]},
    "too_many": {"nan_forward": [3, 4, 5], "overrides": ["train.max_consecutive_nonfinite=3"]},
}


@pytest.fixture(scope="module")
def nonfinite(tmp_path_factory):
    """{case: (run dir, the script's RESULT)} for NF_CASES."""
    root = tmp_path_factory.mktemp("nonfinite")

    def case(name):
        d = root / name
        d.mkdir()
        args = dict({"config": CFG, **NF_CASES[name]}, overrides=[*NF, *NF_CASES[name]["overrides"], f"run.dir={d / 'run'}"])
        return d / "run", run_script(d, args, threads=1)

    return dict(zip(NF_CASES, side_by_side(*(lambda n=n: case(n) for n in NF_CASES))))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["skip_zero0", "skip_zero2", "skip_zero1_bf16"])
def test_nonfinite_steps_are_skipped_and_counted(nonfinite, case):
    d, res = nonfinite[case]
    assert res["error"] is None and res["step"] == 8 and res["finite"], res
    change = {int(k): v for k, v in res["change"].items()}
    assert change[3] == 0.0 and change[6] == 0.0, change  # the bad steps left every weight as it was
    assert all(change[s] > 0 for s in (1, 2, 4, 5, 7, 8)), change  # the others trained
    assert res["skipped"] == 2
    skipped = scalars(d, "train/skipped_steps")
    assert [skipped[s] for s in range(1, 9)] == [0, 0, 1, 1, 1, 2, 2, 2]
    loss = scalars(d, "train/loss")
    assert math.isnan(loss[3]) and all(math.isfinite(loss[s]) for s in (1, 2, 4, 5, 6, 7, 8))
    assert (d / "DONE").exists()


@pytest.mark.slow
def test_nonfinite_stop_policy_names_step_and_layers(nonfinite):
    d, res = nonfinite["stop"]
    msg = res["error"]
    assert msg and "at step 3" in msg and "policy stop" in msg, res
    assert "blocks.0.mlp.mlp.w_in.weight" in msg.split("weight norms")[0]  # the layer whose gradient was bad
    assert "weight norms: embed.weight: |w|=" in msg and "blocks.1.mlp.mlp.w_out.weight: |w|=" in msg
    assert res["step"] == 3 and res["finite"] and res["change"]["3"] == 0.0
    assert not (d / "DONE").exists()
    assert res["logs_closed"]  # bug caught: a fault left the loggers open (W&B never finished)


@pytest.mark.slow
def test_nonfinite_too_many_in_a_row_stops(nonfinite):
    _, res = nonfinite["too_many"]
    assert res["error"] and "at step 5 (3 in a row, policy skip)" in res["error"], res
    assert res["finite"] and [res["change"][s] for s in ("3", "4", "5")] == [0.0, 0.0, 0.0]
    assert res["skipped"] == 3


@pytest.mark.slow
def test_nonfinite_steps_in_a_row_are_counted_across_a_resume(tmp_path):
    """Bug caught: the count of non-finite steps in a row started again at 0 on a resume, so a run
    time-boxed (train.stop_at) between its bad steps never met max_consecutive_nonfinite: 2 skipped
    steps before the checkpoint and 1 after trained on, where the uninterrupted run stops."""
    run = [*NF, "train.max_consecutive_nonfinite=3", "checkpoint.every=4", f"run.dir={tmp_path / 'run'}"]
    first = run_script(tmp_path, {"config": CFG, "nan_forward": [3, 4], "overrides": [*run, "train.stop_at=4"]},
                       threads=1)
    assert first["error"] is None and first["step"] == 4 and first["skipped"] == 2, first
    res = run_script(tmp_path, {"config": CFG, "nan_forward": [5], "overrides": run}, threads=1)
    assert res["error"] and "at step 5 (3 in a row, policy skip)" in res["error"], res
    assert res["skipped"] == 3 and res["change"]["5"] == 0.0 and res["finite"], res


# ----------------------------------------------------------------------------------------------
# (d) A run directory written by an incompatible config.


@pytest.mark.slow
def test_incompatible_run_dir_is_refused_unless_fresh(tmp_path):
    d = tmp_path / "run"
    run = [*TINY, "train.max_steps=2", "train.eval_every=0", f"run.dir={d}"]
    mode_cli("train", "--config", CFG, *run)
    saved = (d / "config.yaml").read_text()

    r = mode_cli("train", "--config", CFG, *run, "model.d_model=48", "optim.lr=0.01", check=False)
    assert r.returncode == 2
    errors = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and errors[0].startswith("config error: run.dir="), r.stderr
    assert "model.d_model: 32 -> 48" in errors[0] and "optim.lr: 0.003 -> 0.01" in errors[0]
    assert "run.fresh=true" in errors[0]
    assert (d / "config.yaml").read_text() == saved  # untouched

    # Keys that may change on resumption are not a different experiment (a longer schedule is
    # allowed explicitly).
    mode_cli("train", "--config", CFG, *run, "train.max_steps=3", "train.log_every=1", "train.allow_schedule_change=true")
    assert yaml.safe_load((d / "config.yaml").read_text())["train"]["max_steps"] == 3

    r = mode_cli("train", "--config", CFG, *run, "model.d_model=48", "run.fresh=true")
    assert "resumed" not in r.stderr and (d / "DONE").exists()
    assert yaml.safe_load((d / "config.yaml").read_text())["model"]["d_model"] == 48


# ----------------------------------------------------------------------------------------------
# (e) A rank that finished exits cleanly.


def test_a_finished_rank_destroys_its_process_group_before_exit(tmp_path, monkeypatch):
    """Bug caught: `mode train` returned with its gloo process group alive, and gloo's threads, torn
    down at interpreter exit, abort the process now and then ("terminate called without an active
    exception", SIGABRT: the launcher's exit code 250) after the run had finished and saved: here 1
    of 7 two-rank launches; two bare gloo ranks exiting so aborted 4 times in 12, none in 12 with
    destroy_process_group() (what torch's docs ask for at the end of main). The trainer is a stand-in
    that joins a world of one as eng.init_distributed does, then trains nothing."""
    import torch.distributed as dist

    from mode import train
    from tests.util import free_port

    class Finished:
        def __init__(self, cfg):
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
            self.rank, self.step = 0, cfg.train.max_steps

        def fit(self):
            return {}

    monkeypatch.setattr(train, "Trainer", Finished)
    monkeypatch.setattr(train, "preflight", lambda cfg, **kw: None)  # no data prepared for a run that trains nothing
    if dist.is_initialized():  # the world of one an earlier in-process test of this worker keeps (test_bf16, test_moe)
        dist.destroy_process_group()
    try:
        assert train.main(["--config", CFG, f"run.dir={tmp_path / 'run'}"]) == 0
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

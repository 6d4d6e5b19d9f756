"""Cluster launch paths against real cluster software on this machine: a single-node SLURM 22.05
(munge, slurmctld, slurmd) and pdsh over a loopback sshd with two hostnames, both brought up by
launch/dev/local_cluster.sh. Skipped, with the reason, where Debian's `slurmctld slurmd
slurm-client munge openssh-server pdsh` are not installed or we are not root."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from mode.compare import SLURM_ACTIVE
from tests.test_launch import EP_CONFIG, EP_RUN, STEPS, assert_losses_equal
from tests.util import PY, ROOT, TINY, env, free_port, scalars

CLUSTER = ROOT / "launch" / "dev" / "local_cluster.sh"
CLUSTER_DIR = Path(os.environ.get("MODE_CLUSTER_DIR", "/tmp/mode-local-cluster"))
RUN = [*TINY, "train.micro_batch_size=2", "train.log_every=1", "train.eval_every=0", "optim.warmup_steps=2"]


# ----------------------------------------------------------------------------------------------
# Without any daemon: the wrapper's own checks.


def test_zero_ranks_are_refused_before_launch(tmp_path, capsys):
    import launch.run as lr

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("a slots=1\nb slots=0\n")
    for args in (["--num_gpus", "0"], ["--hostfile", str(hostfile)]):
        assert lr.main([*args, "--validate-only", "--config", "configs/tiny/dense.yaml",
                        f"run.dir={tmp_path / 'r'}"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"config error: {args[0]}="), err
    assert not (tmp_path / "r").exists()


def test_a_bad_env_value_is_refused_before_the_data_is_prepared(tmp_path, capsys):
    """--env is checked with the launcher options, before validation prepares the data (whose
    progress bar made the refusal more than one line)."""
    import launch.run as lr

    prepared = tmp_path / "prepared"
    assert lr.main(["--env", "A=b\nc", "--validate-only", "--config", "configs/tiny/dense.yaml",
                    f"data.prepared_dir={prepared}", f"run.dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "config error: --env='A=b\\nc': a value without newlines or leading/trailing whitespace", err
    assert not prepared.exists() and not (tmp_path / "r").exists()


@pytest.mark.slow  # starts the shell wrapper (and Python)
def test_multinode_wrapper_without_node_rank_is_one_config_error(tmp_path):
    r = subprocess.run(["bash", str(ROOT / "launch" / "deepspeed_multinode.sh"), "--config", "configs/tiny/dense.yaml",
                        f"run.dir={tmp_path / 'r'}"], cwd=ROOT, env=dict(env(1), NO_SSH="1", PYTHON=PY),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "config error: --node_rank=None: this node's rank (required with --no_ssh)"], r.stderr


@pytest.mark.slow  # starts bash
@pytest.mark.parametrize("ntasks, nodes, expect", [("2", "1", "--num_gpus 2"), ("4", "2", "--num_gpus 2"),
                                                   ("3", "2", "config error: SLURM_NTASKS=3: a multiple of")])
def test_sbatch_ranks_per_node_from_ntasks_alone(tmp_path, ntasks, nodes, expect):
    """`sbatch -n N` without --ntasks-per-node (a script without the template's header) sets SLURM_NTASKS
    and no SLURM_NTASKS_PER_NODE: ranks per node are N / nodes (was 1, silently), refused if uneven.
    The template runs up to its validation, with stand-ins for scontrol and the interpreter."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho node0\n")
    (bin_dir / "py").write_text('#!/usr/bin/env bash\necho "$@" >&2\nexit 3\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    e = {k: v for k, v in env(1).items() if not k.startswith("SLURM_") and k != "GPUS_PER_NODE"}
    e.update(PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON=str(bin_dir / "py"), SLURM_JOB_ID="7",
             SLURM_JOB_NODELIST="node0", SLURM_NNODES=nodes, SLURM_NTASKS=ntasks, SLURM_SUBMIT_DIR=str(tmp_path))
    r = subprocess.run(["bash", str(ROOT / "launch" / "slurm.sbatch"), "--config", "configs/tiny/dense.yaml"],
                       env=e, capture_output=True, text=True, timeout=60)
    if expect.startswith("config error"):
        assert r.returncode == 2 and r.stderr.strip().startswith(expect) and len(r.stderr.splitlines()) == 1, r.stderr
    else:
        assert r.returncode == 3 and "--validate-only" in r.stderr and expect in r.stderr, r.stderr


def test_env_values_and_arguments_survive_the_remote_shell():
    """The pdsh runner exports `KEY=<value>` and passes the arguments (config, overrides) inside the
    remote shell command; what DeepSpeed's PDSHRunner builds from our env-file line and our argument
    must evaluate back to the original (bash as the remote shell, as over ssh). pdsh's own %h/%n/%%
    substitution is applied here as pdsh applies it; the ssh test below runs real pdsh."""
    from deepspeed.launcher.multinode_runner import PDSHRunner

    import launch.run as lr

    class Runner(PDSHRunner):  # DeepSpeed's own add_export and parse_user_args, nothing else
        def __init__(self, user_args):
            self.exports, self.args = {}, type("Args", (), {"user_args": user_args})()

    values = ['a$HOME "c"', "back\\slash `x` 'q'", "plain/value:1", "sp ace", 'x"', "$(date)", "é ü", "!bang", "",
              "100% %h", "%n%%", "run.dir=/r/x$y %h", "a*b?[c]", "~user", "a;b|c&d", '"q q"', "x\\ y"]
    runner = Runner([lr.pdsh_arg(v) for v in values])
    for i, v in enumerate(values):
        runner.add_export(f"V{i}", lr.shell_value(v))
    script = "".join(f"export {k}={v}; " for k, v in runner.exports.items())
    script += " ".join(f'printf "%s\\0" "$V{i}";' for i in range(len(values)))
    script += ' printf "%s\\0" ' + " ".join(runner.parse_user_args()) + ";"
    pdsh = {"%": "%", "h": "mode-node1", "n": "1", "u": "root"}  # pdsh's substitution of the remote command
    script = re.sub(r"%([%hnu])", lambda m: pdsh[m[1]], script)
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True, cwd="/").stdout
    assert out.split("\0")[:-1] == values + values


def test_a_pdsh_launch_passes_its_arguments_in_the_remote_shells_form(tmp_path, monkeypatch, capsys):
    """What the test above evaluates is what a two-host launch hands DeepSpeed's runner (--dry-run
    prints it): the overrides were passed as typed, and the remote shell re-parsed them."""
    import shlex

    import launch.run as lr

    monkeypatch.chdir(ROOT)
    hostfile = write_hosts(tmp_path / "hostfile", "mode-node0", "mode-node1")
    args = ["configs/tiny/dense.yaml", f"run.dir={tmp_path}/r $x %h", "train.max_steps=3"]
    assert lr.main(["--hostfile", str(hostfile), "--dry-run", "--config", *args]) == 0
    cmd = shlex.split(capsys.readouterr().out.strip().splitlines()[-1])
    assert cmd[cmd.index("--config") + 1:] == [lr.pdsh_arg(a) for a in args]
    assert lr.pdsh_arg(args[1]) != args[1] and lr.pdsh_arg(args[2]) == args[2]  # plain ones stay readable


# ----------------------------------------------------------------------------------------------
# The local cluster.


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (the local SLURM and sshd run as root)"
    need = ["munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sshd", "pdsh", "ssh"]
    gone = [b for b in need if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if gone:
        return (f"{', '.join(gone)} not installed (apt-get install slurmctld slurmd slurm-client munge "
                "openssh-server pdsh)")
    return None


@pytest.fixture(scope="module")
def cluster():
    """Bring the local cluster up (or reuse it) and stop, by PID, what this module started."""
    reason = _missing()
    if reason:
        pytest.skip(reason)
    was_up = subprocess.run(["bash", str(CLUSTER), "status"], capture_output=True).returncode == 0
    r = subprocess.run(["bash", str(CLUSTER), "up"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    e = {}
    for line in (CLUSTER_DIR / "env.sh").read_text().splitlines():
        k, v = line.removeprefix("export ").split("=", 1)
        e[k] = v.strip('"')
    yield e
    if not was_up:
        subprocess.run(["bash", str(CLUSTER), "down"], capture_output=True, timeout=120)


def cluster_env(cluster: dict, **extra) -> dict:
    return dict(env(1), **cluster, PYTHON=PY, MODE_ROOT=str(ROOT), **extra)


def job_field(cluster: dict, job: str, key: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], env=cluster_env(cluster), capture_output=True,
                         text=True).stdout
    return next((f.split("=", 1)[1] for f in out.split() if f.startswith(key + "=")), "")


def wait_job(cluster: dict, job: str, timeout: float) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        state = job_field(cluster, job, "JobState")
        if state and state not in SLURM_ACTIVE:
            return state
        time.sleep(1)
    reason = job_field(cluster, job, "Reason")  # why it waits: Resources (the node is held), Priority, ...
    subprocess.run(["scancel", job], env=cluster_env(cluster))
    raise AssertionError(f"job {job} still {state} (reason: {reason}) after {timeout:.0f}s; queue: "
                         + subprocess.run(["squeue", "-h", "-o", "%i %j %T %R"], env=cluster_env(cluster),
                                          capture_output=True, text=True).stdout.replace("\n", "; "))


@pytest.mark.slow
def test_sbatch_two_cpu_ranks_train_with_checkpoints_and_events(tmp_path, cluster):
    """A CPU partition: no GPUs allocated, --ntasks-per-node=2 sets two ranks; the job log and the
    hostfile end up in run.dir, nothing in the submit directory. SLURM_CPUS_PER_GPU in the job's
    environment (what the README's GPU line, `sbatch --cpus-per-gpu=8`, exports) reached the
    template's srun as an option of its own: `Invalid generic resource (gres) specification` here."""
    submit_dir, run = tmp_path / "submit", tmp_path / "run"
    submit_dir.mkdir()
    sbatch = ["sbatch", "--parsable", "--ntasks-per-node=2", str(ROOT / "launch" / "slurm.sbatch"), "--config",
              str(ROOT / "configs/tiny/dense.yaml"), *RUN, "train.max_steps=4", "checkpoint.every=2",
              f"data.prepared_dir={tmp_path / 'prepared'}",  # the default (data/prepared) is relative to the cwd
              f"run.dir={run}"]
    job = subprocess.run(sbatch, cwd=submit_dir, env=cluster_env(cluster, SLURM_CPUS_PER_GPU="8"),
                         capture_output=True, text=True, check=True).stdout.strip()
    state = wait_job(cluster, job, 600)
    log = run / "slurm" / f"job-{job}.out"
    assert state == "COMPLETED", (state, log.read_text() if log.exists() else list(submit_dir.iterdir()))
    assert list(submit_dir.iterdir()) == []  # the default log moved to run.dir
    text = log.read_text()
    assert f"mode: job {job}: 1 nodes x 2 ranks (--ntasks-per-node)" in text and "OMP_NUM_THREADS=1" in text, text
    assert (run / "slurm" / f"hostfile.{job}").read_text().strip().endswith(" slots=2")
    assert (run / "DONE").exists() and json.loads((run / "run_info.json").read_text())["world_size"] == 2
    from mode.checkpoint import latest_step

    assert latest_step(run) == 4
    assert list(scalars(run, "train/loss")) == [1, 2, 3, 4]

    # Zero ranks (the old `division by 0` that trained nothing): the job fails in one line, exit 2.
    job = subprocess.run([*sbatch[:-1], f"run.dir={tmp_path / 'zero'}"], cwd=submit_dir,
                         env=cluster_env(cluster, GPUS_PER_NODE="0"), capture_output=True, text=True,
                         check=True).stdout.strip()
    assert wait_job(cluster, job, 120) == "FAILED" and job_field(cluster, job, "ExitCode") == "2:0"
    line = ("config error: GPUS_PER_NODE=0: ranks per node >= 1 (from GPUS_PER_NODE; request --gpus-per-node=N or "
            "--ntasks-per-node=N)")
    log = submit_dir / f"slurm-{job}.out"  # no run.dir yet: SLURM's log stays where it is
    assert log.read_text().strip().splitlines() == [line], log.read_text()
    assert not (tmp_path / "zero").exists()

    # A requeued job appends to its log (the template's --open-mode=append) instead of truncating it.
    for cmd in (["requeue", job], ["update", f"JobId={job}", "StartTime=now"]):  # requeue waits 2 min otherwise
        subprocess.run(["scontrol", *cmd], env=cluster_env(cluster), check=True)
    assert wait_job(cluster, job, 120) == "FAILED" and job_field(cluster, job, "Restarts") == "1"
    assert log.read_text().strip().splitlines() == [line, line], log.read_text()


@pytest.mark.slow
def test_the_moved_job_log_keeps_slurms_own_lines_across_a_requeue(tmp_path, cluster):
    """Bug caught: the template moved SLURM's default log into run.dir by copying it and deleting the
    original, but slurmstepd keeps writing to the file it opened: its own lines ("*** JOB n ...
    CANCELLED AT ... DUE TO TIME LIMIT ***", the only word on why a job stopped) went to a deleted
    file. Now a hard link: a running job requeued, then cancelled, leaves both of SLURM's lines in
    <run.dir>/slurm/job-<id>.out, in order with the attempts' own, and nothing in the submit directory."""
    from mode.rundir import check_lock

    submit_dir, run = tmp_path / "submit", tmp_path / "run"
    submit_dir.mkdir()
    sbatch = ["sbatch", "--parsable", "--ntasks-per-node=1", "--time=15",  # a limit: a killed test leaves no job for good
              str(ROOT / "launch" / "slurm.sbatch"), "--config",
              str(ROOT / "configs/tiny/dense.yaml"), *RUN, "train.max_steps=100000", "checkpoint.every=100000",
              f"data.prepared_dir={tmp_path / 'prepared'}", f"run.dir={run}"]
    job = subprocess.run(sbatch, cwd=submit_dir, env=cluster_env(cluster), capture_output=True, text=True,
                         check=True).stdout.strip()
    log = run / "slurm" / f"job-{job}.out"

    def training(restarts: str) -> None:  # this attempt's trainer holds the run's lock
        end = time.monotonic() + 300
        while True:
            state = job_field(cluster, job, "JobState")
            assert time.monotonic() < end and state in SLURM_ACTIVE, \
                log.read_text() if log.exists() else list(submit_dir.iterdir())
            if state == "PENDING":  # a requeued job waits 2 min before it may start again otherwise
                subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=cluster_env(cluster))
            if job_field(cluster, job, "Restarts") == restarts and state == "RUNNING":
                try:
                    check_lock(run)
                except Exception:
                    return
            time.sleep(0.5)

    try:
        training("0")
        subprocess.run(["scontrol", "requeue", job], env=cluster_env(cluster), check=True)
        training("1")
        subprocess.run(["scancel", job], env=cluster_env(cluster), check=True)
    finally:
        subprocess.run(["scancel", job], env=cluster_env(cluster))
    assert wait_job(cluster, job, 120) == "CANCELLED"
    lines = log.read_text().splitlines()
    slurms = f"*** JOB {job} ON "  # slurmstepd's own line, e.g. "*** JOB 42 ON vm CANCELLED AT <time> ***"

    def where(ok) -> int:
        return next((i for i, ln in enumerate(lines) if ok(ln)), -1)

    at = [where(lambda ln: f"mode: job {job}: 1 nodes" in ln),
          where(lambda ln: slurms in ln and "CANCELLED AT" in ln and "DUE TO JOB REQUEUE" in ln),
          where(lambda ln: f"mode: job {job} (restart 1): 1 nodes" in ln),
          where(lambda ln: slurms in ln and "CANCELLED AT" in ln and "REQUEUE" not in ln)]
    assert -1 not in at and at == sorted(at), (at, lines)
    assert list(submit_dir.iterdir()) == [] and sorted(p.name for p in log.parent.glob("job-*")) == [log.name]


@pytest.mark.slow
def test_sbatch_gpus_per_task_gives_each_nodes_launcher_all_of_its_gpus(tmp_path, cluster):
    """Bug caught: `sbatch --ntasks-per-node=2 --gpus-per-task=1` allocates two GPUs on the node and the
    template starts two ranks there, but srun read the SLURM_GPUS_PER_TASK sbatch exports as its own
    option: its one task per node, the node's launcher (and so both ranks), got one GPU
    (CUDA_VISIBLE_DEVICES=0; on a node whose devices SLURM constrains, rank 1's GPU did not exist). The local cluster's
    fake GPUs (local_cluster.sh, MODE_CLUSTER_GPUS) are allocated like real ones; the launcher is a
    stand-in that records what SLURM gave its task (no training: the ranks take their devices from it)."""
    node = subprocess.run(["scontrol", "show", "node", "-o"], env=cluster_env(cluster), capture_output=True,
                          text=True).stdout
    if not re.search(r"\bGres=gpu:([2-9]|\d\d)", node):
        pytest.skip(f"the local cluster declares fewer than 2 GPUs ({node.strip()}): restart it (local_cluster.sh "
                    "down, then up) with MODE_CLUSTER_GPUS=2, the default")
    submit_dir, run, seen = tmp_path / "submit", tmp_path / "run", tmp_path / "seen"
    submit_dir.mkdir()
    py = tmp_path / "py"  # the interpreter: validation runs for real; each node's launcher records its step's GPUs
    py.write_text(f'#!/usr/bin/env bash\nfor a in "$@"; do [[ $a == --validate-only ]] && exec {PY} "$@"; done\n'
                  'while [[ $# -gt 0 && $1 != --num_gpus ]]; do shift; done\n'
                  f'echo "node=$SLURM_NODEID ranks=$2 CUDA_VISIBLE_DEVICES=${{CUDA_VISIBLE_DEVICES-unset}} '
                  f'SLURM_STEP_GPUS=${{SLURM_STEP_GPUS-}}" >> {seen}\n')
    py.chmod(0o755)
    job = subprocess.run(["sbatch", "--parsable", "--ntasks-per-node=2", "--gpus-per-task=1",
                          str(ROOT / "launch" / "slurm.sbatch"), "--config", str(ROOT / "configs/tiny/dense.yaml"),
                          *RUN, f"data.prepared_dir={tmp_path / 'prepared'}", f"run.dir={run}"],
                         cwd=submit_dir, env={**cluster_env(cluster), "PYTHON": str(py)}, capture_output=True,
                         text=True, check=True).stdout.strip()
    state = wait_job(cluster, job, 300)
    log = run / "slurm" / f"job-{job}.out"
    text = log.read_text() if log.exists() else str(list(submit_dir.iterdir()))
    assert state == "COMPLETED" and f"mode: job {job}: 1 nodes x 2 ranks (GPUs allocated per node)" in text, text
    assert seen.read_text().splitlines() == ["node=0 ranks=2 CUDA_VISIBLE_DEVICES=0,1 SLURM_STEP_GPUS=0,1"], \
        (seen.read_text(), text)


@pytest.mark.slow
def test_sbatch_chdir_runs_the_job_in_that_directory(tmp_path, cluster):
    """Bug caught: the template began with `cd "$SLURM_SUBMIT_DIR"`, undoing `sbatch --chdir=<dir>` (the
    batch script starts in the job's working directory): submitted from elsewhere, a relative --config
    was `config error: ... an existing YAML file`, and SLURM's log in <dir> was looked for in the submit
    directory, never moved. Now the config, run.dir and data.prepared_dir are relative to <dir>, and
    the log ends up in run.dir."""
    submit_dir, work = tmp_path / "submit", tmp_path / "work"
    submit_dir.mkdir()
    (work / "configs" / "tiny").mkdir(parents=True)
    shutil.copy(ROOT / "configs/tiny/dense.yaml", work / "configs/tiny/dense.yaml")
    job = subprocess.run(["sbatch", "--parsable", f"--chdir={work}", "--ntasks-per-node=1",
                          str(ROOT / "launch" / "slurm.sbatch"), "--config", "configs/tiny/dense.yaml", *RUN,
                          "train.max_steps=2", "checkpoint.every=2", "data.prepared_dir=prepared", "run.dir=run"],
                         cwd=submit_dir, env=cluster_env(cluster), capture_output=True, text=True,
                         check=True).stdout.strip()
    state = wait_job(cluster, job, 300)
    run = work / "run"
    log = run / "slurm" / f"job-{job}.out"
    left = sorted(p.name for p in work.glob("slurm-*.out"))
    assert state == "COMPLETED", (state, log.read_text() if log.exists() else
                                  [(work / n).read_text() for n in left] or list(submit_dir.iterdir()))
    assert left == [] and list(submit_dir.iterdir()) == []  # SLURM's log moved to run.dir
    assert f"mode: job {job}: 1 nodes x 1 ranks (--ntasks-per-node)" in log.read_text() and f"run.dir {run}" in \
        log.read_text(), log.read_text()
    assert (run / "DONE").exists() and (work / "prepared").is_dir() and list(scalars(run, "train/loss")) == [1, 2]


@pytest.mark.slow
def test_compare_on_slurm_reports_failed_jobs_then_waits_and_writes_the_report(tmp_path, cluster):
    """num_gpus 0 (a CPU partition). First every job fails (zero ranks forced through sbatch's
    --export): reported by name, state and log, and not resubmitted by the next call; with the
    experiment fixed, --resubmit submits them again, --wait waits, and the report is written."""
    exp = {"name": "grid", "runs_dir": str(tmp_path / "runs"), "launcher": "slurm", "nproc": 1, "seeds": [0],
           "overrides": [*RUN, "train.max_steps=3", "checkpoint.every=3"],
           "launcher_options": {"num_gpus": 0, "submit": True, "sbatch_args": ["--export=ALL,GPUS_PER_NODE=0"]},
           "variants": {"dense": {"config": str(ROOT / "configs/tiny/dense.yaml")},
                        "mod": {"config": str(ROOT / "configs/tiny/mod.yaml")}}}
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(exp))
    slurm_dir = tmp_path / "runs" / "slurm"

    def compare(*args):
        return subprocess.run([PY, "-m", "mode.cli", "compare", str(path), "--poll", "1", *args], cwd=ROOT,
                              env=cluster_env(cluster), capture_output=True, text=True, timeout=900)

    r = compare("--wait")
    assert r.returncode == 1 and "report:" not in r.stdout, r.stderr
    jobs = {n: (slurm_dir / f"{n}_seed0.jobid").read_text().strip() for n in ("dense", "mod")}
    for name, job in jobs.items():
        log = slurm_dir / f"{name}_seed0-{job}.out"
        assert (f"failed: {name}_seed0: job {job} FAILED without finishing the run (no checkpoint); log: {log}"
                in r.stderr), r.stderr
        assert "config error: GPUS_PER_NODE=0" in log.read_text()
    script = (slurm_dir / "dense_seed0.sh").read_text()
    assert f"export PYTHON={PY}\n" in script and "--ntasks-per-node=1" in script and "--gpus-per-node" not in script
    assert f"export SLURM_CONF={cluster['SLURM_CONF']}\n" in script and "--open-mode=append" in script

    r = compare("--no-wait")  # the failures are not resubmitted silently
    assert r.returncode == 1 and r.stderr.count("not resubmitted") == 2, r.stderr
    assert {n: (slurm_dir / f"{n}_seed0.jobid").read_text().strip() for n in jobs} == jobs

    exp["launcher_options"]["sbatch_args"] = []
    path.write_text(yaml.safe_dump(exp))
    r = compare("--resubmit", "--wait")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == f"report: {tmp_path / 'runs' / 'report' / 'report.md'}"
    assert r.stderr.count("submitted job") == 2 and "waiting for 2 job(s)" in r.stderr
    for name in jobs:
        d = tmp_path / "runs" / f"{name}_seed0"
        assert (d / "DONE").exists() and list(scalars(d, "train/loss")) == [1, 2, 3]
        job = (slurm_dir / f"{name}_seed0.jobid").read_text().strip()
        assert job != jobs[name] and job_field(cluster, job, "JobState") == "COMPLETED"


@pytest.mark.slow
def test_compare_wait_shows_why_a_job_stays_pending(tmp_path, cluster):
    """A job its partition cannot run as submitted (two nodes on this one-node partition) stays
    PENDING forever; `--wait` printed only `PENDING`, now SLURM's reason and what to do."""
    exp = {"name": "grid", "runs_dir": str(tmp_path / "runs"), "launcher": "slurm", "nproc": 1, "seeds": [0],
           "overrides": RUN, "launcher_options": {"num_gpus": 0, "submit": True, "sbatch_args": ["--nodes=2"]},
           "variants": {"dense": {"config": str(ROOT / "configs/tiny/dense.yaml")}}}
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(exp))
    proc = subprocess.Popen([PY, "-m", "mode.cli", "compare", str(path), "--poll", "1", "--wait"], cwd=ROOT,
                            env=cluster_env(cluster), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    job_file = tmp_path / "runs" / "slurm" / "dense_seed0.jobid"
    try:
        end, lines = time.monotonic() + 120, []
        for line in proc.stderr:  # until compare reports the pending job
            lines.append(line)
            if "PENDING" in line or time.monotonic() > end:
                break
        job = job_file.read_text().strip()
        assert re.fullmatch(rf"dense_seed0: job {job} PENDING \(reason: Partition(NodeLimit|Config); this "
                            r"partition cannot run it as submitted: scancel it, fix sbatch_args\)", lines[-1].strip()), lines
    finally:
        if job_file.exists():
            subprocess.run(["scancel", job_file.read_text().strip()], env=cluster_env(cluster))
        proc.wait(timeout=120)
    assert proc.returncode == 1


@pytest.mark.slow
def test_compare_waits_for_the_job_its_script_submitted_through_a_controller_outage(tmp_path, cluster):
    """`submit: false`: compare writes the scripts, the user runs one (as its hint says), then
    `mode compare --wait`. Bugs caught: the script recorded no job id, so `--wait` refused the run
    as in use by another writer (the job's trainer holds its lock) or printed the same hint again;
    and a poll while slurmctld did not answer (squeue "Socket timed out") read as UNKNOWN: the
    running job was reported failed (exit 1, and --resubmit would have started a second job).
    The job outlives the outage (a job ending while slurmctld is stopped stays COMPLETING until
    the controller restarts); once compare follows it again, it is cancelled, and compare must
    report that state, CANCELLED, by name."""
    import threading

    from mode.rundir import check_lock

    exp = {"name": "grid", "runs_dir": str(tmp_path / "runs"), "launcher": "slurm", "nproc": 1, "seeds": [0],
           "overrides": [*RUN, "train.max_steps=100000", "checkpoint.every=100000"],  # cancelled long before
           "launcher_options": {"num_gpus": 0, "submit": False, "sbatch_args": ["--time=15"]},  # no job left for good
           "variants": {"dense": {"config": str(ROOT / "configs/tiny/dense.yaml")}}}
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(exp))
    run, job_file = tmp_path / "runs" / "dense_seed0", tmp_path / "runs" / "slurm" / "dense_seed0.jobid"
    cmd = [PY, "-m", "mode.cli", "compare", str(path), "--poll", "1"]
    r = subprocess.run([*cmd, "--no-wait"], cwd=ROOT, env=cluster_env(cluster), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "submit with: bash" in r.stderr and not job_file.exists(), r.stderr
    sub = subprocess.run(["bash", str(tmp_path / "runs" / "slurm" / "dense_seed0.sh")], env=cluster_env(cluster),
                         capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job = job_file.read_text().strip()
    assert job and sub.stdout.strip().split(";")[0] == job  # recorded where compare looks, and printed
    ctld = int((CLUSTER_DIR / "slurmctld.pid").read_text())
    lines: list[str] = []

    def wait_for(needle: str, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not any(needle in ln for ln in lines):
            assert time.monotonic() < end and proc.poll() is None, (needle, lines)
            time.sleep(0.5)

    proc = None
    try:
        end = time.monotonic() + 300
        while True:  # until the job's trainer holds the run's lock
            assert time.monotonic() < end and job_field(cluster, job, "JobState") in SLURM_ACTIVE, list(run.glob("*"))
            try:
                check_lock(run)
            except Exception:
                break
            time.sleep(0.5)
        proc = subprocess.Popen([*cmd, "--wait"], cwd=ROOT, env=cluster_env(cluster), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
        reader.start()
        wait_for(f"job {job} RUNNING", 120)
        os.kill(ctld, signal.SIGSTOP)  # the controller stops answering; the job keeps training
        try:
            wait_for(f"job {job} UNREACHABLE", 180)
        finally:
            os.kill(ctld, signal.SIGCONT)
        n = len(lines)
        end = time.monotonic() + 120
        while not any(f"job {job} RUNNING" in ln for ln in lines[n:]):  # followed again after the outage
            assert time.monotonic() < end and proc.poll() is None, lines
            time.sleep(0.5)
        assert job_field(cluster, job, "JobState") == "RUNNING"  # the job outlived the outage
        subprocess.run(["scancel", job], env=cluster_env(cluster), check=True)
        proc.stdout.read()  # not communicate(): it would take stderr's last lines from the reader
        proc.wait(timeout=300)
        reader.join(10)
    finally:
        os.kill(ctld, signal.SIGCONT)
        if proc is not None and proc.poll() is None:
            proc.kill()
        subprocess.run(["scancel", job], env=cluster_env(cluster))
    assert wait_job(cluster, job, 120) == "CANCELLED"  # left the queue: the node is free for the next test
    err = "".join(lines)
    assert f"job {job} is queued or running" in err and "submitted job" not in err and "UNKNOWN" not in err, err
    assert proc.returncode == 1 and f"failed: dense_seed0: job {job} CANCELLED without finishing the run" in err, err
    assert job_file.read_text().strip() == job


@pytest.mark.slow
def test_compare_adopts_a_job_queued_for_a_run_whose_id_was_not_recorded(tmp_path, cluster):
    """Bug caught (cluster walkthrough): an sbatch that timed out ("Socket timed out", a busy
    controller) after SLURM had queued the job left no job id; the next `mode compare` submitted the
    run again: two jobs, one run (the second failed on the run's lock, `--wait` refused the run as in
    use). Here the job is queued held (no training) and its recorded id removed, as such an sbatch
    leaves it: compare finds it by name and log path and does not submit a second job; a same-named
    job of another grid (another runs_dir) is not taken for it."""
    def grid(runs_dir: Path) -> Path:
        exp = {"name": "grid", "runs_dir": str(runs_dir), "launcher": "slurm", "nproc": 1, "seeds": [0],
               "overrides": [*RUN, "train.max_steps=4"],
               "launcher_options": {"num_gpus": 0, "submit": True, "sbatch_args": ["--hold"]},
               "variants": {"dense": {"config": str(ROOT / "configs/tiny/dense.yaml")}}}
        path = runs_dir.parent / f"{runs_dir.name}.yaml"
        path.write_text(yaml.safe_dump(exp))
        return path

    def compare(path: Path) -> str:
        r = subprocess.run([PY, "-m", "mode.cli", "compare", str(path), "--no-wait"], cwd=ROOT,
                           env=cluster_env(cluster), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stderr

    def queued() -> list[str]:
        return subprocess.run(["squeue", "-h", "-n", "grid-dense_seed0", "-o", "%i"], env=cluster_env(cluster),
                              capture_output=True, text=True, check=True).stdout.split()

    mine, other = grid(tmp_path / "mine"), grid(tmp_path / "other")
    try:
        assert "submitted job" in compare(other)
        assert "submitted job" in compare(mine)
        job_file = tmp_path / "mine" / "slurm" / "dense_seed0.jobid"
        job = job_file.read_text().strip()
        assert len(queued()) == 2
        job_file.unlink()  # what an sbatch that timed out after queueing the job leaves
        err = compare(mine)
        assert f"found job {job} queued for it without a recorded id" in err and "submitted job" not in err, err
        assert len(queued()) == 2 and job_file.read_text().strip() == job
    finally:
        for j in queued():
            subprocess.run(["scancel", j], env=cluster_env(cluster))


@pytest.mark.slow
def test_a_cluster_restarted_after_its_daemons_died_does_not_revive_their_jobs(tmp_path, cluster):
    """Bug caught (CI): the machine restarted while a job ran; `local_cluster.sh up` started slurmctld on
    its saved state, which revived the dead job as RUNNING. It held the node's CPUs for good and every
    job after it stayed PENDING. Here a job holding both CPUs dies with the daemons (SIGKILL, as a
    reboot leaves them); after `up`, that job is gone from the queue and a new one runs."""
    ce = cluster_env(cluster)
    mark = tmp_path / "started"
    old = subprocess.run(["sbatch", "--parsable", "-J", "mode-revived", "-n", "2", "-o", str(tmp_path / "old.out"),
                          "--wrap", f"echo $$ > {mark}.tmp; mv {mark}.tmp {mark}; exec sleep 600"], env=ce, capture_output=True, text=True,
                         check=True).stdout.strip()
    end = time.monotonic() + 120
    while not mark.exists():
        assert time.monotonic() < end, job_field(cluster, old, "JobState")
        time.sleep(0.5)
    daemons = [int((CLUSTER_DIR / f"{d}.pid").read_text()) for d in ("slurmctld", "slurmd")]
    steps = subprocess.run(["pgrep", "-f", rf"slurmstepd: \[{old}\."], capture_output=True, text=True).stdout.split()
    for pid in [*daemons, *map(int, steps), int(mark.read_text())]:  # the daemons, the job's stepd, its sleep
        os.kill(pid, signal.SIGKILL)
    for pid in daemons:
        end = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists():
            assert time.monotonic() < end, pid
            time.sleep(0.2)
    r = subprocess.run(["bash", str(CLUSTER), "up"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    queue = subprocess.run(["squeue", "-h", "-o", "%i %j %T"], env=ce, capture_output=True, text=True,
                           check=True).stdout
    assert "mode-revived" not in queue, queue
    new = subprocess.run(["sbatch", "--parsable", "-n", "2", "-o", str(tmp_path / "new.out"), "--wrap", "true"],
                         env=ce, capture_output=True, text=True, check=True).stdout.strip()
    assert wait_job(cluster, new, 120) == "COMPLETED"


@pytest.mark.slow
def test_a_pid_file_naming_a_pid_another_process_took_is_not_a_running_daemon(tmp_path):
    """Bug caught: after a reboot a PID file of the local cluster can name a PID that another process
    has since taken; `local_cluster.sh` read it as the daemon running, so `up` did not start it (SLURM
    then never came up) and `down` would have killed that other process. Each PID file here names a
    live `sleep`: every daemon reads as stopped (status, which `up` and `down` ask the same way)."""
    other = subprocess.Popen(["sleep", "60"])
    try:
        for f in ("munge/munged.pid", "slurmctld.pid", "slurmd.pid", "ssh/sshd.pid"):
            (tmp_path / f).parent.mkdir(exist_ok=True)
            (tmp_path / f).write_text(f"{other.pid}\n")
        r = subprocess.run(["bash", str(CLUSTER), "status"], env={**os.environ, "MODE_CLUSTER_DIR": str(tmp_path)},
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and r.stdout.split() == ["munged:", "stopped", "slurmctld:", "stopped", "slurmd:",
                                                          "stopped", "sshd:", "stopped"], r.stdout + r.stderr
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


# ----------------------------------------------------------------------------------------------
# pdsh over ssh: two "nodes" (mode-node0 = 127.0.0.1, mode-node1 = 127.0.0.2).


def write_hosts(path: Path, *hosts: str) -> Path:
    path.write_text("".join(f"{h} slots=1\n" for h in hosts))
    return path


@pytest.mark.slow
def test_pdsh_two_nodes_match_one_node(tmp_path, cluster, one_launcher):
    """One command on node 0 starts both nodes over ssh (no --master_addr: the first host is the
    master); DS_ACCELERATOR and OMP_NUM_THREADS reach the remote ranks through the env file, so the
    expert-parallel losses are those of one launcher with two ranks (tests/conftest.py), bit for bit."""
    hostfile = write_hosts(tmp_path / "hostfile", "mode-node0", "mode-node1")
    run = tmp_path / "two_nodes"
    r = subprocess.run([PY, "-m", "launch.run", "--hostfile", hostfile, "--ssh_port", cluster["MODE_SSH_PORT"],
                        "--master_port", str(free_port()), "--config", EP_CONFIG, *EP_RUN, f"run.dir={run}"],
                       cwd=ROOT, env=env(1), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "--master_addr=mode-node0" in r.stdout + r.stderr
    assert_losses_equal(one_launcher, run, STEPS)
    assert not (run / "deepspeed_env").exists()


@pytest.mark.parametrize("killed", ["launch.run", "mode compare"])
@pytest.mark.slow
def test_sigkill_of_the_pdsh_launcher_or_of_compare_leaves_no_rank_training(tmp_path, cluster, killed):
    """Bug caught: over pdsh the ranks live under sshd, not under this machine's launcher, so SIGKILL
    of launch.run (or of `mode compare` above it) left the runner, pdsh and both nodes' ranks training
    with nothing watching (they reached step 4338 in 40 s), and the env file's directory behind. A
    watchdog process of its own stops this job on every node."""
    from tests.test_launch import processes_mentioning

    hostfile = write_hosts(tmp_path / "hostfile", "mode-node0", "mode-node1")
    tmp = tmp_path / "tmp"  # launch.run's temporary env-file directory goes here (TMPDIR)
    tmp.mkdir()
    log = tmp_path / "launch.log"
    if killed == "launch.run":
        run = tmp_path / "run"
        cmd = [PY, "-m", "launch.run", "--hostfile", str(hostfile), "--ssh_port", cluster["MODE_SSH_PORT"],
               "--master_port", str(free_port()), "--config", "configs/tiny/dense.yaml", *RUN,
               "train.max_steps=100000", f"run.dir={run}"]
    else:
        grid = {"name": "grid", "runs_dir": str(tmp_path / "runs"), "launcher": "deepspeed", "seeds": [0],
                "launcher_options": {"hostfile": str(hostfile), "ssh_port": int(cluster["MODE_SSH_PORT"]),
                                     "master_port": free_port()},
                "overrides": [*RUN, "train.max_steps=100000"],
                "variants": {"dense": {"config": str(ROOT / "configs/tiny/dense.yaml")}}}
        (tmp_path / "grid.yaml").write_text(yaml.safe_dump(grid))
        run = tmp_path / "runs" / "dense_seed0"
        cmd = [PY, "-m", "mode.cli", "compare", str(tmp_path / "grid.yaml")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(env(1), TMPDIR=str(tmp)), stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 600
        while not list(run.glob("tb/events.out.tfevents.*")):  # both ranks are past their rendezvous
            assert proc.poll() is None and time.monotonic() < end, log.read_text()[-3000:]
            time.sleep(1)
        assert len([pid for pid, c in processes_mentioning(str(run)) if "-m mode.train" in c]) == 2
        assert [p.name for p in tmp.iterdir()][0].startswith("mode-launch-")
        proc.kill()
        proc.wait()
        end = time.monotonic() + 60
        while (processes_mentioning(str(run)) or list(tmp.iterdir())) and time.monotonic() < end:
            time.sleep(0.5)
        assert processes_mentioning(str(run)) == [] and list(tmp.iterdir()) == [], log.read_text()[-3000:]
        # the watchdog's line; under compare launch.run may have got in first (PR_SET_PDEATHSIG: SIGTERM)
        assert re.search(r"(is gone|SIGTERM): stopping this job's ranks on every node", log.read_text())
    finally:
        for pid, _ in processes_mentioning(str(run)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_unreachable_host_is_refused_in_one_line(tmp_path, cluster):
    """127.0.0.3 has no sshd: refused before DeepSpeed starts, instead of ranks waiting for it for
    the rendezvous timeout; nothing is written into run.dir, and the data is not prepared first (it
    was: a large corpus took hours before the refusal)."""
    hostfile = write_hosts(tmp_path / "hostfile", "mode-node0", "127.0.0.3")
    t0 = time.monotonic()
    r = subprocess.run([PY, "-m", "launch.run", "--hostfile", hostfile, "--ssh_port", cluster["MODE_SSH_PORT"],
                        "--config", "configs/tiny/dense.yaml", *RUN, f"data.prepared_dir={tmp_path / 'prepared'}",
                        f"run.dir={tmp_path / 'run'}"],
                       cwd=ROOT, env=env(1), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and time.monotonic() - t0 < 60, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"config error: --hostfile='{hostfile}': "), r.stderr
    assert "127.0.0.3 is not: ssh: connect to host 127.0.0.3 port " in lines[0], lines
    assert "deepspeed" not in r.stdout and not (tmp_path / "run").exists() and not (tmp_path / "prepared").exists()


@pytest.mark.slow
def test_ranks_over_ssh_get_the_environment_and_ctrl_c_stops_only_this_job(tmp_path, cluster):
    """The ranks started over ssh hold DS_ACCELERATOR, OMP_NUM_THREADS, DEEPSPEED_TIMEOUT and an --env
    value with shell syntax and pdsh's %-codes, unchanged, and run.dir with both in its name (pdsh
    made %h the host's name: each node its own directory). Ctrl-C: DeepSpeed's own handler would
    `pkill -f "<python> -u -m deepspeed.launcher.launch"` on every node (a decoy with that command
    line stands for another job); the wrapper stops only this job's launchers, which stop their ranks."""
    from tests.test_launch import processes_mentioning

    decoy = subprocess.Popen(["bash", "-c", f'exec -a "{PY} -u -m deepspeed.launcher.launch" sleep 900'])
    hostfile = write_hosts(tmp_path / "hostfile", "mode-node0", "mode-node1")
    run = tmp_path / "run $x %h 'q'"
    log = tmp_path / "launch.log"
    probe = 'a$HOME "c" `x` \\ %h %n %%'
    proc = subprocess.Popen([PY, "-m", "launch.run", "--hostfile", str(hostfile), "--ssh_port", cluster["MODE_SSH_PORT"],
                             "--master_port", str(free_port()), "--env", f"MODE_PROBE={probe}", "--config",
                             "configs/tiny/dense.yaml", *RUN, "train.max_steps=100000", f"run.dir={run}"], cwd=ROOT,
                            env=dict(env(1), DEEPSPEED_TIMEOUT="7"), stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 600
        while not list(run.glob("tb/events.out.tfevents.*")):  # both ranks are past their rendezvous
            assert proc.poll() is None and time.monotonic() < end, log.read_text()[-3000:]
            time.sleep(1)
        ranks = [pid for pid, cmd in processes_mentioning(str(run)) if "-m mode.train" in cmd]
        assert len(ranks) == 2, processes_mentioning(str(run))
        for pid in ranks:
            environ = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
            assert "SSH_CONNECTION" in environ  # started over ssh, not inherited from this process
            assert (environ["DS_ACCELERATOR"], environ["OMP_NUM_THREADS"], environ["DEEPSPEED_TIMEOUT"],
                    environ["MODE_PROBE"]) == ("cpu", "1", "7", probe)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 130, log.read_text()[-3000:]
        end = time.monotonic() + 30
        while processes_mentioning(str(run)) and time.monotonic() < end:
            time.sleep(0.5)
        assert processes_mentioning(str(run)) == [], log.read_text()[-3000:]
        assert decoy.poll() is None  # DeepSpeed's handler would have killed it
        assert "stopping this job's ranks on every node" in log.read_text()
    finally:
        decoy.kill()
        if proc.poll() is None:
            proc.kill()

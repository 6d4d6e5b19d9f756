"""Launch wrappers: config validation before any worker starts, and multi-node runs simulated on one
machine (two DeepSpeed launchers with `--no_ssh --node_rank 0/1`, the SLURM template under a fake
`srun`, torchrun with two nodes) training an expert-parallel model, each matching one launcher."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.util import PY, ROOT, TINY, env, free_port, scalars

# The expert-parallel model: DeepSpeed MoE in every other block, experts split over 2 ranks.
EP_CONFIG = "configs/tiny/moe.yaml"
EP = ["model.moe.backend=deepspeed", "model.moe.ep_size=2", "model.moe.layers=every_other",
      "model.moe.num_experts=4"]
COMMON = [*TINY, "train.micro_batch_size=2", "train.log_every=1", "train.eval_every=0", "optim.warmup_steps=2"]


# ----------------------------------------------------------------------------------------------
# Helpers shared with test_faults.py.


def launch_run(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "launch.run", *map(str, args)], cwd=ROOT, env=env(1), capture_output=True,
                          text=True, timeout=timeout)


def write_hostfile(path: Path) -> Path:
    path.write_text("node0 slots=1\nnode1 slots=1\n")  # two simulated nodes, one rank each
    return path


def start_two_nodes(tmp_path: Path, config: str, *overrides, port: int, log_prefix: str = "node") -> list:
    """One `python -m launch.run --no_ssh --node_rank R` per simulated node (what each SLURM task runs)."""
    hostfile = write_hostfile(tmp_path / "hostfile")
    procs = []
    for r in (0, 1):
        cmd = [PY, "-m", "launch.run", "--hostfile", hostfile, "--no_ssh", "--node_rank", r, "--num_nodes", 2,
               "--master_addr", "127.0.0.1", "--master_port", port, "--config", config, *overrides]
        log = open(tmp_path / f"{log_prefix}{r}.log", "w")
        procs.append(subprocess.Popen(list(map(str, cmd)), cwd=ROOT, env=env(1), stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def wait_all(procs, timeout: float) -> list[int]:
    end = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(0.1, end - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        kill_groups(procs)
        raise


def kill_groups(procs) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def logs(tmp_path: Path, prefix: str = "node") -> str:
    return "\n".join(f"== {f.name}\n" + f.read_text()[-4000:] for f in sorted(tmp_path.glob(f"{prefix}*.log")))


def run_two_nodes(tmp_path: Path, config: str, *overrides, timeout: float = 300, log_prefix: str = "node") -> None:
    procs = start_two_nodes(tmp_path, config, *overrides, port=free_port(), log_prefix=log_prefix)
    rcs = wait_all(procs, timeout)
    assert rcs == [0, 0], logs(tmp_path, log_prefix)


def processes_mentioning(text: str) -> list[tuple[int, str]]:
    """Live processes whose command line contains `text` (zombies excluded)."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (p / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmd and state != "Z":
            out.append((int(p.name), cmd))
    return out


def rank_pid(rank: int, marker: str) -> int | None:
    """pid of the training process of global rank `rank` whose command line contains `marker`."""
    for pid, cmd in processes_mentioning(marker):
        if "mode.train" not in cmd or "deepspeed.launcher" in cmd:
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    return None


def assert_losses_equal(a_dir: Path, b_dir: Path, steps: int) -> None:
    a, b = scalars(a_dir, "train/loss"), scalars(b_dir, "train/loss")
    assert list(a) == list(b) == list(range(1, steps + 1)), (a, b)
    assert a == b  # same ranks, same collectives: bit for bit


# ----------------------------------------------------------------------------------------------
# Validation before launch.


@pytest.mark.slow
def test_wrapper_refuses_bad_config_before_any_worker_starts(tmp_path):
    t0 = time.monotonic()
    r = launch_run("--num_gpus", 2, "--config", "configs/tiny/dense.yaml", "model.n_heads=5",
                   f"run.dir={tmp_path / 'r'}")
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "config error" in ln]
    assert len(lines) == 1 and lines[0].startswith("config error: model.n_heads=5"), r.stderr
    assert "deepspeed.launcher" not in r.stderr + r.stdout and not (tmp_path / "r").exists()

    # The world size the launcher would start is checked against the expert-parallel size.
    hostfile = write_hostfile(tmp_path / "hostfile")
    r = launch_run("--hostfile", hostfile, "--num_gpus", 3, "--no_ssh", "--node_rank", 0, "--config",
                   "configs/tiny/dense.yaml", "model.moe.layers=every_other", "model.moe.backend=deepspeed",
                   "model.moe.ep_size=4", "model.moe.num_experts=4", f"run.dir={tmp_path / 'r'}")
    assert r.returncode == 2 and "config error: model.moe.ep_size=4: a divisor of the world size 6" in r.stderr, \
        r.stderr

    # A run directory written by another config is refused before launch, naming the difference.
    run = tmp_path / "old"
    run.mkdir()
    from mode.config import dump_config, load_config

    (run / "config.yaml").write_text(dump_config(load_config("configs/tiny/dense.yaml", [*TINY, f"run.dir={run}"])))
    (run / "tb").mkdir()  # a run (its released LOCK says so), not a user's directory holding a config.yaml
    (run / "LOCK").write_text("")
    r = launch_run("--num_gpus", 2, "--config", "configs/tiny/dense.yaml", *TINY, "model.d_model=64",
                   f"run.dir={run}")
    assert r.returncode == 2 and "config error: run.dir=" in r.stderr and "model.d_model: 32 -> 64" in r.stderr, \
        r.stderr
    r = launch_run("--hostfile", tmp_path / "missing", "--config", "configs/tiny/dense.yaml")
    assert r.returncode == 2 and "config error: --hostfile=" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 300  # not a rendezvous timeout (10 min); generous: CI shares its cores


def saved_run(d: Path, overrides: list[str], world: int) -> Path:
    """A run directory as a run at `world` ranks leaves it after its step-2 checkpoint (the files the
    pre-launch checks read: config.yaml, run_info.json, a checkpoint with its manifest)."""
    from mode import checkpoint as ckpt
    from mode.config import dump_config, load_config

    step = ckpt.step_dir(ckpt.checkpoints_dir(d), 2)
    step.mkdir(parents=True)
    (step / ckpt.MODEL).write_bytes(b"weights")
    ckpt.write_manifest(step, 2)
    (d / "config.yaml").write_text(dump_config(load_config("configs/tiny/dense.yaml", [*overrides, f"run.dir={d}"])))
    (d / "run_info.json").write_text(f'{{"world_size": {world}}}')
    (d / "LOCK").write_text("")
    return d


@pytest.mark.slow
def test_wrapper_refuses_what_only_the_ranks_refused_before(tmp_path):
    """Bug caught: the world size on resume (and before that data and backend errors) were checked
    only inside the ranks, so every rank printed the error after the launcher had started them."""
    run = saved_run(tmp_path / "run", TINY, world=1)
    before = sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*"))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    cases = {"run.dir=": ("configs/tiny/dense.yaml", [*TINY, f"run.dir={run}"]),  # saved at 1 rank, launched at 2
             "data.source=": ("configs/tiny/dense.yaml", [*TINY, f"data.source={tmp_path / 'missing.txt'}",
                                                          f"run.dir={tmp_path / 'r1'}"]),
             "data.": ("configs/tiny/dense.yaml", [*TINY, f"data.source={empty}", f"data.prepared_dir={tmp_path}/p",
                                                   f"run.dir={tmp_path / 'r2'}"]),  # found only by preparing it
             "model.moe.backend='megablocks'": ("configs/tiny/moe.yaml", [*TINY, "model.moe.backend=megablocks",
                                                                          "deepspeed.precision=bf16",
                                                                          f"run.dir={tmp_path / 'r3'}"])}
    for start, (config, overrides) in cases.items():
        r = launch_run("--num_gpus", 2, "--master_port", free_port(), "--config", config, *overrides)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"config error: {start}"), (start, r)
        assert "deepspeed.launcher" not in r.stderr + r.stdout and r.stdout == "", (start, r)
        if start == "run.dir=":
            assert "saved at world size 1 and this launch has world size 2" in lines[0], lines
    assert sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*")) == before
    assert not any((tmp_path / f"r{i}").exists() for i in (1, 2, 3))


def test_torchrun_on_several_nodes_needs_the_master_address(capsys):
    """Bug caught: `--launcher torchrun --num_nodes 2` without --master_addr (or launch/torchrun.sh
    without MASTER_ADDR) sent every node to its own 127.0.0.1, where it waited for the others until
    the rendezvous timed out. Refused in one line before anything starts."""
    from launch.run import main

    assert main(["--launcher", "torchrun", "--num_nodes", "2", "--node_rank", "1", "--num_gpus", "1", "--dry-run",
                 "--config", "configs/tiny/dense.yaml"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("config error: --master_addr"), err
    script = (ROOT / "launch" / "torchrun.sh").read_text()
    assert '--master_addr "${MASTER_ADDR:-}"' in script  # the script passes no default address for it to take


def test_overrides_may_come_before_the_options_as_for_mode_train(capsys, tmp_path):
    """Bug caught: `python -m launch.run --num_gpus 2 model.d_model=64 --config F run.dir=X` (accepted
    by `mode train`) failed with `unrecognized arguments`; so did `mode flops`."""
    import json

    from launch.run import main
    from mode.cli import main as cli_main
    from mode.config import load_config
    from mode.flops import count

    assert main(["--num_gpus", "1", "model.d_model=64", "--dry-run", "--config", "configs/tiny/dense.yaml",
                 f"run.dir={tmp_path / 'r'}"]) == 0, capsys.readouterr().err
    assert f"--config configs/tiny/dense.yaml model.d_model=64 run.dir={tmp_path / 'r'}" in capsys.readouterr().out
    assert cli_main(["flops", "model.d_model=64", "--config", "configs/tiny/dense.yaml", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["params"] == count(load_config("configs/tiny/dense.yaml",
                                                                             ["model.d_model=64"]))["params"]


def test_ports_and_node_ranks_are_checked_before_launch(capsys, monkeypatch):
    """Bug caught: a port outside 1-65535, a node rank outside 0..nodes-1, and torchrun on several
    nodes without --node_rank (rank 0 on every node) passed --dry-run and failed only once the
    launcher or the rendezvous ran. Each is refused in one line, naming the option."""
    from launch.run import main

    cases = {("--master_port", "99999"): "config error: --master_port=99999: an integer port 1-65535",
             ("--master_port", "-1"): "config error: --master_port=-1: an integer port 1-65535",
             ("--ssh_port", "0"): "config error: --ssh_port=0: an integer port 1-65535",
             ("--no_ssh", "--node_rank", "-1"): "config error: --node_rank=-1: this node's rank, 0 <= R < 1",
             ("--launcher", "torchrun", "--num_nodes", "2", "--node_rank", "5", "--master_addr", "n0"):
                 "config error: --node_rank=5: this node's rank, 0 <= R < 2",
             ("--launcher", "torchrun", "--num_nodes", "2", "--master_addr", "n0"):
                 "config error: --node_rank=None: this node's rank (required with --launcher torchrun"}
    for args, start in cases.items():
        assert main([*args, "--num_gpus", "1", "--dry-run", "--config", "configs/tiny/dense.yaml"]) == 2, args
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(start), (args, err)
    assert main(["--launcher", "torchrun", "--num_nodes", "2", "--node_rank", "1", "--master_addr", "n0",
                 "--master_port", "65535", "--num_gpus", "1", "--dry-run", "--config", "configs/tiny/dense.yaml"]) == 0
    assert "--node-rank=1 --master-addr=n0 --master-port=65535" in capsys.readouterr().out
    monkeypatch.setenv("MASTER_PORT", "abc")  # was `error: ValueError`, exit 1
    assert main(["--num_gpus", "1", "--dry-run", "--config", "configs/tiny/dense.yaml"]) == 2
    assert capsys.readouterr().err.strip() == "config error: MASTER_PORT='abc': an integer port 1-65535"
    monkeypatch.setenv("MASTER_PORT", "29555")
    assert main(["--num_gpus", "1", "--dry-run", "--config", "configs/tiny/dense.yaml"]) == 0
    assert "--master_port 29555" in capsys.readouterr().out
    script = (ROOT / "launch" / "torchrun.sh").read_text()
    assert "NODE_RANK:-0" not in script and '--node_rank "$NODE_RANK"' in script  # no default rank to take


@pytest.mark.slow
def test_dry_run_prints_launcher_commands(tmp_path):
    hostfile = write_hostfile(tmp_path / "hostfile")
    r = launch_run("--hostfile", hostfile, "--no_ssh", "--node_rank", 1, "--master_addr", "10.0.0.1",
                   "--env", "NCCL_DEBUG=WARN", "--dry-run", "--config", "configs/tiny/dense.yaml", "train.max_steps=3")
    assert r.returncode == 0, r.stderr
    assert "-m deepspeed.launcher.runner --hostfile" in r.stdout and "--no_ssh --node_rank=1" in r.stdout
    assert "--master_addr 10.0.0.1" in r.stdout and "NCCL_DEBUG=WARN" in r.stdout
    assert "--module mode.train --config configs/tiny/dense.yaml train.max_steps=3" in r.stdout
    r = launch_run("--launcher", "torchrun", "--num_nodes", 2, "--node_rank", 1, "--num_gpus", 4,
                   "--master_addr", "10.0.0.1", "--dry-run", "--config", "configs/tiny/dense.yaml")
    assert r.returncode == 0, r.stderr
    assert "torch.distributed.run --nnodes=2 --nproc-per-node=4 --node-rank=1 --master-addr=10.0.0.1" in r.stdout


@pytest.mark.slow
def test_launch_scripts_run_the_checkouts_python_and_name_a_wrong_one(tmp_path):
    """Bug caught: the scripts ran `python3` on PATH, which (no venv active, as the README's examples
    are typed) lacks torch: a chained traceback, the error handler itself importing torch."""
    import sys

    e = {k: v for k, v in env(1).items() if k not in ("PYTHON", "VIRTUAL_ENV")}
    cmd = ["bash", "launch/torchrun.sh", "--dry-run", "--config", "configs/tiny/dense.yaml"]
    r = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and f"{ROOT}/.venv/bin/python -u -m torch.distributed.run" in r.stdout, r.stdout + r.stderr
    bare = sys._base_executable  # the interpreter the venv was made from: no torch there
    if subprocess.run([bare, "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip("the base interpreter has torch")
    r = subprocess.run(cmd, cwd=ROOT, env={**e, "PYTHON": bare}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.splitlines() == [
        f"error: {bare} cannot import torch (not mode's environment: use .venv/bin/python, which `make install` "
        "creates, or set PYTHON= for the launch scripts)"], r.stderr


def test_one_node_of_a_hostfile_needs_no_ssh(tmp_path, capsys):
    """Bug caught: one node of a hostfile (`--num_nodes 1`, or a one-host file) runs its ranks on this
    machine, but DeepSpeed's runner, given no --master_addr, first ssh'd to the first host (its ssh
    check, then `hostname -I` for the address): without ssh a RuntimeError traceback after the
    config was validated. The local address and --no_ssh_check are passed; several nodes keep node 0."""
    from launch.run import main

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("no-such-host.invalid slots=1\nother.invalid slots=1\n")
    common = ["--hostfile", str(hostfile), "--dry-run", "--config", "configs/tiny/dense.yaml",
              f"run.dir={tmp_path / 'run'}"]
    assert main(["--num_nodes", "1", *common]) == 0
    cmd = capsys.readouterr().out
    assert "--no_ssh_check --master_addr 127.0.0.1 " in cmd, cmd
    assert main(["--no_ssh", "--node_rank", "1", *common]) == 0
    cmd = capsys.readouterr().out
    assert "--master_addr no-such-host.invalid " in cmd and "--no_ssh_check" not in cmd, cmd


@pytest.mark.slow  # starts bash
def test_slurm_template_steps_keep_the_jobs_environment_under_export_none(tmp_path):
    """Bug caught: `sbatch --export=NONE` (SBATCH_EXPORT=NONE, a site default at some centres) leaves
    SLURM_EXPORT_ENV=NONE in the job, which srun reads as its own --export: each node's launcher started
    without HOSTFILE, GPUS_PER_NODE, MASTER_ADDR (`--hostfile '' --num_gpus ''`: the job failed). The
    step asks for --export=ALL. Fake scontrol/srun (srun dropping the environment as SLURM does)."""
    bin_dir, run_dir, out = tmp_path / "bin", tmp_path / "run", tmp_path / "args"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/usr/bin/env bash\n[[ $2 == hostnames ]] && echo n0\nexit 0\n')
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\nall=0\nwhile [[ $1 == --* ]]; do [[ $1 == --export=ALL ]] && all=1; shift; done\n"
        'if [[ $all == 0 && ${SLURM_EXPORT_ENV:-ALL} == NONE ]]; then exec env -i PATH="$PATH" SLURM_NODEID=0 "$@"; fi\n'
        'SLURM_NODEID=0 exec "$@"\n')
    (bin_dir / "py").write_text(  # the interpreter: --validate-only prints run.dir; the launcher records its args
        f'#!/usr/bin/env bash\nfor a in "$@"; do [[ $a == --validate-only ]] && {{ echo {run_dir}; exit 0; }}; done\n'
        f'printf "%s\\n" "$@" > {out}\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    e = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": str(bin_dir / "py"),
         "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n0", "SLURM_NNODES": "1",
         "SLURM_NTASKS_PER_NODE": "2", "SLURM_CPUS_ON_NODE": "4", "SLURM_EXPORT_ENV": "NONE"}
    r = subprocess.run(["bash", str(ROOT / "launch" / "slurm.sbatch"), "--config", "c.yaml", "x.y=1"], env=e,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    args = out.read_text().splitlines()
    assert args[args.index("--hostfile") + 1] == f"{run_dir}/slurm/hostfile.77", args
    assert args[args.index("--num_gpus") + 1] == "2" and args[args.index("--master_addr") + 1] == "n0", args
    assert args[-3:] == ["--config", "c.yaml", "x.y=1"], args
    # Bug caught: a MASTER_ADDR the submitting shell exported (a torchrun launch's, say) became the
    # job's master though no node of the job has that name: every rank waited for the rendezvous
    # timeout. One of the job's nodes is honoured.
    (bin_dir / "scontrol").write_text('#!/usr/bin/env bash\n[[ $2 == hostnames ]] && printf "n0\\nn1\\n"\nexit 0\n')
    two = {**e, "SLURM_JOB_NODELIST": "n[0-1]", "SLURM_NNODES": "2"}
    for given, master in (({"MASTER_ADDR": "127.0.0.1"}, "n0"), ({"MASTER_ADDR": "n1"}, "n1"),
                          ({"MASTER_ADDR": "n"}, "n0"), ({"MASTER_ADDR": "x", "MODE_MASTER_ADDR": "10.0.0.7"}, "10.0.0.7")):
        r = subprocess.run(["bash", str(ROOT / "launch" / "slurm.sbatch"), "--config", "c.yaml"],
                           env={**two, **given}, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        args = out.read_text().splitlines()
        assert args[args.index("--master_addr") + 1] == master, (given, args)
        assert ("is not a node of job 77 (n0 n1)" in r.stderr) == (master == "n0"), r.stderr
    # Bug caught: a MASTER_PORT exported in the submitting shell became every job's port: two jobs
    # on one node, the second failed with EADDRINUSE. The job id's port, or MODE_MASTER_PORT.
    for given, port in (({}, "20077"), ({"MASTER_PORT": "31555"}, "20077"),
                        ({"MASTER_PORT": "31555", "MODE_MASTER_PORT": "31666"}, "31666"), ({"MODE_MASTER_PORT": "31666"}, "31666")):
        r = subprocess.run(["bash", str(ROOT / "launch" / "slurm.sbatch"), "--config", "c.yaml"],
                           env={**two, **given}, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        args = out.read_text().splitlines()
        assert args[args.index("--master_port") + 1] == port, (given, args)
        assert ("MASTER_PORT=31555 from the submitting shell is ignored" in r.stderr) == (given == {"MASTER_PORT": "31555"})


@pytest.mark.slow  # starts bash
def test_slurm_template_refuses_an_interface_name_as_master_address(tmp_path):
    """Bug caught (cluster review): the README offered MODE_MASTER_ADDR as "an IP or interface name of
    a node", but MODE_MASTER_ADDR=ib0 became every rank's MASTER_ADDR, and torch's store cannot
    connect to an interface name (`timed out ... trying to connect to (lo, port)`, measured with lo):
    a job that waited out its rendezvous. Refused in one line, exit 2, before anything starts."""
    bin_dir, out = tmp_path / "bin", tmp_path / "args"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/usr/bin/env bash\n[[ $2 == hostnames ]] && printf "n0\\nn1\\n"\nexit 0\n')
    (bin_dir / "srun").write_text('#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do shift; done\nSLURM_NODEID=0 exec "$@"\n')
    (bin_dir / "py").write_text(f'#!/usr/bin/env bash\nfor a in "$@"; do [[ $a == --validate-only ]] && '
                                f'{{ echo {tmp_path / "run"}; exit 0; }}; done\nprintf "%s\\n" "$@" > {out}\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    iface = next(p.name for p in sorted(Path("/sys/class/net").iterdir()))  # lo, eth0, ...: this node's
    e = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": str(bin_dir / "py"),
         "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n[0-1]", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "1",
         "SLURM_CPUS_ON_NODE": "2"}
    for given, rc in ((iface, 2), ("10.0.0.7", 0), ("n1", 0), (".", 0)):
        out.unlink(missing_ok=True)
        r = subprocess.run(["bash", str(ROOT / "launch" / "slurm.sbatch"), "--config", "c.yaml"],
                           env={**e, "MODE_MASTER_ADDR": given}, cwd=tmp_path, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == rc, (given, r.stderr)
        if rc:
            assert r.stderr.strip().splitlines() == [
                f"config error: MODE_MASTER_ADDR={iface}: an IP of a node of the job or a name every node resolves to "
                f"one, not a network interface name (the ranks cannot connect to it): use its address (ip -4 addr "
                f"show dev {iface}); NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME choose the interface"], r.stderr
            assert not out.exists() and not (tmp_path / "run").exists()
        else:
            args = out.read_text().splitlines()
            assert args[args.index("--master_addr") + 1] == given, args


def test_environment_reaches_every_node_through_deepspeed_env(tmp_path, monkeypatch):
    """For ssh (pdsh) launches DeepSpeed exports each KEY=VALUE line of $DS_ENV_FILE on every node."""
    import launch.run as lr

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("NCCL_IB_DISABLE", "1")
    monkeypatch.setenv("UNRELATED", "x")
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".deepspeed_env").write_text("USER_VAR=kept\n\n")  # a user's own file keeps working
    env = lr.pass_env(["WANDB_MODE=offline", "EQ=a=b"])
    path = lr.write_deepspeed_env(tmp_path / "run" / "deepspeed_env", env)
    lines = path.read_text().splitlines()
    parsed = dict(line.split("=", 1) for line in lines)  # DeepSpeed's own parsing: every line KEY=VALUE
    assert parsed["OMP_NUM_THREADS"] == "3" and parsed["NCCL_IB_DISABLE"] == "1" and "UNRELATED" not in parsed
    assert parsed["WANDB_MODE"] == "offline" and parsed["EQ"] == "a=b" and parsed["USER_VAR"] == "kept"
    assert parsed["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)
    with pytest.raises(Exception, match="--env"):
        lr.pass_env(["NOVALUE"])


def test_the_users_deepspeed_env_comments_are_dropped_and_its_values_kept(tmp_path, monkeypatch):
    """Bugs caught (cluster walkthrough): a `# NCCL_DEBUG=INFO` line in ./.deepspeed_env was passed on,
    so pdsh's remote command read `export # NCCL_DEBUG=INFO; export ...; cd ...; python ...`: a
    comment; the launch ran nothing and exited 0. And the file's OMP_NUM_THREADS=1 lost to our
    default (cores / ranks), where DeepSpeed itself would have used the file's."""
    import launch.run as lr
    from mode.config import ConfigError

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".deepspeed_env").write_text("# NCCL_DEBUG=INFO\n\n  # indented too\nOMP_NUM_THREADS=1\nUSER_VAR=a=b\n")
    user = lr.user_env()
    assert user == {"OMP_NUM_THREADS": "1", "USER_VAR": "a=b"}
    env = lr.pass_env([], ranks_per_node=1, user=user)
    assert "OMP_NUM_THREADS" not in env  # the file's value is the one
    lines = lr.write_deepspeed_env(tmp_path / "run" / "deepspeed_env", env, shell=True).read_text().splitlines()
    assert not [ln for ln in lines if "#" in ln or not ln.strip()], lines
    parsed = dict(line.split("=", 1) for line in lines)  # DeepSpeed's parsing (a later line wins)
    assert parsed["OMP_NUM_THREADS"] == "1" and parsed["USER_VAR"] == "a=b"
    assert lr.pass_env([], ranks_per_node=1)["OMP_NUM_THREADS"] == str(max(1, os.cpu_count() or 1))  # no file: ours
    (tmp_path / ".deepspeed_env").write_text("export NCCL_DEBUG=INFO\n")
    with pytest.raises(ConfigError, match=r"\.deepspeed_env='export NCCL_DEBUG=INFO': KEY=VALUE lines"):
        lr.user_env()


def test_a_pdsh_launch_from_a_directory_with_a_space_is_refused(tmp_path, monkeypatch, capsys):
    """Bug caught (cluster walkthrough): DeepSpeed's pdsh runner sends `cd <cwd>; <python> ...`
    unquoted, so from `/tmp/a b` every node said `cd: too many arguments`, trained in $HOME, and
    the launch exited 0. Refused in one line before anything starts; one node is not pdsh."""
    import launch.run as lr

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("mode-node0 slots=1\nmode-node1 slots=1\n")
    (tmp_path / "a b").mkdir()
    monkeypatch.chdir(tmp_path / "a b")
    assert lr.main(["--hostfile", str(hostfile), "--dry-run", "--config", str(ROOT / "configs/tiny/dense.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"config error: the working directory={str(tmp_path / 'a b')!r}: a path without spaces or "
                   "shell-special characters for a pdsh launch (DeepSpeed passes it unquoted to every node's shell): "
                   "launch from another directory"), err


def test_a_multinode_launch_without_pdsh_or_ssh_is_refused_before_anything_starts(tmp_path, monkeypatch, capsys):
    """Bug caught (cluster review): with no `pdsh` on PATH a two-host launch prepared the data, then
    DeepSpeed's runner raised `RuntimeError: launcher 'pdsh' not installed.` (a traceback, exit 1);
    with no `ssh`, `error: FileNotFoundError`. Refused in one line, exit 2, nothing written or prepared."""
    import launch.run as lr

    monkeypatch.chdir(ROOT)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("mode-node0 slots=1\nmode-node1 slots=1\n")
    args = ["--hostfile", str(hostfile), "--config", "configs/tiny/dense.yaml", f"run.dir={tmp_path / 'run'}",
            f"data.prepared_dir={tmp_path / 'prepared'}"]
    for have, missing in (("ssh", "pdsh"), ("pdsh", "ssh")):
        bin_dir = tmp_path / f"bin_{have}"
        bin_dir.mkdir()
        (bin_dir / have).write_text("#!/bin/sh\nexit 0\n")  # answers every host
        (bin_dir / have).chmod(0o755)
        monkeypatch.setenv("PATH", str(bin_dir))
        assert lr.main(args) == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"config error: --hostfile={str(hostfile)!r}: a launch on its 2 nodes from this node "
                       f"(DeepSpeed's pdsh runner) needs `{missing}` on PATH, and this node has none: install it, "
                       "or run the command on every node with --no_ssh --node_rank R --master_addr <node 0>"), err
        assert not (tmp_path / "run").exists() and not (tmp_path / "prepared").exists()
    monkeypatch.setenv("PATH", str(tmp_path / "bin_ssh"))
    assert lr.main(["--launcher", "openmpi", *args]) == 2  # another backend: the program DeepSpeed looks for
    assert "(DeepSpeed's openmpi runner) needs `ompi_info` on PATH" in capsys.readouterr().err
    # one node, --no_ssh and --dry-run run neither
    assert lr.main(["--num_nodes", "1", "--dry-run", *args]) == 0
    assert lr.main(["--no_ssh", "--node_rank", "1", "--dry-run", *args]) == 0
    assert lr.main(["--dry-run", *args]) == 0
    assert not (tmp_path / "run").exists()


def test_a_loopback_first_host_of_several_nodes_is_refused_without_master_addr(tmp_path, monkeypatch, capsys):
    """Bug caught (cluster review): a hostfile of several nodes whose first line was `localhost` (or
    127.0.0.1, ::1) made that the master address every node was sent to: each node's ranks waited for
    a rank 0 on their own loopback until the rendezvous timeout. Refused in one line unless
    --master_addr says where node 0 is; one node of such a file, and names that merely resolve to a
    loopback address here (the local cluster's mode-node0/mode-node1), still launch."""
    import launch.run as lr

    monkeypatch.chdir(ROOT)
    hostfile = tmp_path / "hostfile"
    common = ["--hostfile", str(hostfile), "--dry-run", "--config", "configs/tiny/dense.yaml",
              f"run.dir={tmp_path / 'run'}"]
    for first in ("localhost", "127.0.0.1", "127.1.2.3", "::1", "[::1]", "LocalHost", "::ffff:127.0.0.1"):
        hostfile.write_text(f"{first} slots=1\nnode1 slots=1\n")
        for extra in ([], ["--no_ssh", "--node_rank", "1"], ["--launcher", "openmpi"]):
            assert lr.main([*extra, *common]) == 2, (first, extra)
            err = capsys.readouterr().err.strip()
            assert err == (f"config error: --hostfile={str(hostfile)!r}: a first host (node 0: the master address of "
                           f"the 2 nodes) the other nodes can reach; {first} is each node's own loopback: list node 0 "
                           "by a name the other nodes resolve to it, or pass --master_addr <node 0's address>"), err
        assert lr.main(["--master_addr", "10.0.0.1", *common]) == 0
        assert "--master_addr 10.0.0.1 " in capsys.readouterr().out
        assert lr.main(["--num_nodes", "1", *common]) == 0  # one node: its ranks run here, 127.0.0.1
        assert "--master_addr 127.0.0.1 " in capsys.readouterr().out
    for ok in ("mode-node0", "node1", "10.0.0.1", "localhost-gpu01"):
        hostfile.write_text(f"{ok} slots=1\nnode2 slots=1\n")
        assert lr.main(common) == 0, ok
        assert f"--master_addr {ok} " in capsys.readouterr().out
    hostfile.write_text("localhost slots=2\n")
    assert lr.main(common) == 0
    assert lr.is_loopback("localhost.") and not lr.is_loopback("10.1.1.1")
    # --validate-only names no master (slurm.sbatch validates its node list so, then passes --master_addr)
    hostfile.write_text("localhost slots=1\nnode1 slots=1\n")
    assert lr.main(["--validate-only", *[a for a in common if a != "--dry-run"]]) == 0, capsys.readouterr().err


@pytest.mark.slow  # a real launch of DeepSpeed's runner (against stand-ins for ssh and pdsh)
def test_a_pdsh_launch_reaches_the_hosts_with_pdsh_ssh_args_append_only(tmp_path):
    """Bug caught (cluster review): the hosts answered ssh with PDSH_SSH_ARGS_APPEND (`-i key`, as pdsh
    reaches them; the README's check), then DeepSpeed's runner ran its own check of the first host,
    `ssh -o PasswordAuthentication=no host hostname`, without it: `RuntimeError: ... was not
    reachable via ssh`, a traceback for a launch pdsh would have run. The wrapper's check stands."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "ssh").write_text(f'#!/bin/sh\necho "ssh $*" >> {calls}\ncase " $* " in *" -i /k "*) exit 0;; esac\n'
                                 'echo "Permission denied (publickey)." >&2\nexit 255\n')
    (bin_dir / "pdsh").write_text(f'#!/bin/sh\necho "pdsh $*" >> {calls}\nexit 0\n')  # starts nothing
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("mode-node0 slots=1\nmode-node1 slots=1\n")
    r = subprocess.run([PY, "-m", "launch.run", "--hostfile", str(hostfile), "--config", "configs/tiny/dense.yaml",
                        f"run.dir={tmp_path / 'run'}", f"data.prepared_dir={tmp_path / 'prepared'}"], cwd=ROOT,
                       env=dict(env(1), PATH=f"{bin_dir}:{os.environ['PATH']}", PDSH_SSH_ARGS_APPEND="-i /k"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = calls.read_text().splitlines()
    assert sorted(ln for ln in lines if ln.startswith("ssh")) == [
        f"ssh -o BatchMode=yes -o ConnectTimeout=15 -i /k {h} true" for h in ("mode-node0", "mode-node1")], lines
    assert any(ln.startswith("pdsh -S -f 1024 -w mode-node0,mode-node1 ") for ln in lines), lines


# ----------------------------------------------------------------------------------------------
# Simulated multi-node runs of an expert-parallel model.

STEPS = 4
EP_RUN = [*COMMON, *EP, f"train.max_steps={STEPS}"]


# The reference, `one_launcher` (tests/conftest.py): one DeepSpeed launcher starting both ranks of EP_RUN.


@pytest.mark.slow
def test_two_deepspeed_launchers_match_one(tmp_path, one_launcher):
    run_two_nodes(tmp_path, EP_CONFIG, *EP_RUN, f"run.dir={tmp_path / 'run'}")
    assert_losses_equal(one_launcher, tmp_path / "run", STEPS)
    assert (tmp_path / "run" / "DONE").exists()


@pytest.mark.slow
def test_torchrun_two_nodes_match_one_launcher(tmp_path, one_launcher):
    port = free_port()
    procs = []
    for r in (0, 1):
        e = dict(env(1), NNODES="2", NODE_RANK=str(r), GPUS_PER_NODE="1", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), PYTHON=PY)
        procs.append(subprocess.Popen(["bash", "launch/torchrun.sh", "--config", EP_CONFIG, *EP_RUN,
                                       f"run.dir={tmp_path / 'run'}"], cwd=ROOT, env=e,
                                      stdout=open(tmp_path / f"node{r}.log", "w"), stderr=subprocess.STDOUT,
                                      start_new_session=True))
    assert wait_all(procs, 300) == [0, 0], logs(tmp_path)
    assert_losses_equal(one_launcher, tmp_path / "run", STEPS)


@pytest.mark.slow
def test_slurm_template_starts_one_launcher_per_node(tmp_path, one_launcher):
    """launch/slurm.sbatch under a fake `srun` that runs its task once per node on this machine."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\nprintf 'nodeA\\nnodeB\\n'\n")
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\n"
        f"touch {tmp_path / 'srun_ran'}\n"
        "while [[ $1 == --* ]]; do shift; done\n"  # srun's own options
        "pids=(); for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i \"$@\" & pids+=($!); done\n"
        "rc=0; for p in \"${pids[@]}\"; do wait $p || rc=$?; done; exit $rc\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    e = dict(env(1), PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON=PY, MODE_ROOT=str(ROOT),
             SLURM_SUBMIT_DIR=str(tmp_path), SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="nodeA,nodeB", SLURM_NNODES="2",
             SLURM_GPUS_ON_NODE="1", MODE_MASTER_ADDR="127.0.0.1", MODE_MASTER_PORT=str(free_port()))
    config = str(ROOT / EP_CONFIG)
    sbatch = str(ROOT / "launch" / "slurm.sbatch")
    # run.fresh=true: the job writes run.dir/slurm/ before the trainer starts; that directory is new
    # and fresh must not delete the job's own files (its log, the hostfile the nodes read).
    r = subprocess.run(["bash", sbatch, "--config", config, *EP_RUN, f"run.dir={tmp_path / 'run'}", "run.fresh=true"],
                       cwd=tmp_path, env=e, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "2 nodes x 1 ranks (GPUs allocated per node), master 127.0.0.1" in r.stdout
    assert (tmp_path / "run" / "slurm" / "hostfile.4242").read_text() == "nodeA slots=1\nnodeB slots=1\n"
    assert_losses_equal(one_launcher, tmp_path / "run", STEPS)

    # A bad config stops the job on the batch node: srun never runs.
    (tmp_path / "srun_ran").unlink()
    r = subprocess.run(["bash", sbatch, "--config", config, *EP_RUN, "model.moe.ep_size=3",
                        f"run.dir={tmp_path / 'bad'}"], cwd=tmp_path, env=e, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "config error: model.moe.ep_size=3" in r.stderr, r.stderr
    assert not (tmp_path / "srun_ran").exists() and not (tmp_path / "bad").exists()

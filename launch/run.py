"""Validate a training config, then start the DeepSpeed launcher (or torchrun) on one node or many.

    python -m launch.run [launcher options] --config CONFIG [dotted.key=value ...]

The config is resolved and checked (values, the world size against model.moe.ep_size, the
tokenizer's vocabulary, an existing run directory written by another config) *before* any
worker starts: a bad config prints one `config error: ...` line and exits 2. Then, on one node,
this process is replaced (exec) by the launcher, so signals (SIGTERM from SLURM, Ctrl-C) reach it
directly and the exit status is the launcher's; for several nodes it runs DeepSpeed's runner as a
child and passes its exit status on.

Launchers:

- `--launcher deepspeed` (default). With `--hostfile` (lines `host slots=N`) and ssh between
  nodes, one command on the first node starts every node (pdsh, which must be on PATH here, as must
  ssh: else one line, exit 2). Every host must be reachable by
  passwordless ssh from this node (itself included); that is checked first (one line naming the
  host that is not, exit 2). The master address is the first host unless `--master_addr` says
  otherwise (one node of a hostfile runs here: 127.0.0.1, no ssh); `--ssh_port` and `--launcher_args` go to DeepSpeed's runner. With `--no_ssh
  --node_rank R` the same command is run on every node (SLURM: launch/slurm.sbatch). Without a
  hostfile: one node, `--num_gpus` processes. Ctrl-C (SIGTERM) on a pdsh launch stops this job's
  launcher on every node over ssh, not every DeepSpeed launcher there (DeepSpeed's own handler);
  if this process is killed outright, a watchdog process (guard_main) does the same.
- `--launcher pdsh|openmpi|mpich|impi|mvapich|slurm`: DeepSpeed's runner with that multi-node
  backend (`deepspeed` is `pdsh`).
- `--launcher torchrun`: run once per node with `--num_nodes N --node_rank R --master_addr A`.

Environment: `--env KEY=VALUE` (repeatable) and the variables this machine's training needs
(OMP_NUM_THREADS, DS_ACCELERATOR, PYTHONPATH and any MODE_*/NCCL_*/GLOO_* already set) are
exported to every rank on every node: through DeepSpeed's `.deepspeed_env` mechanism (a
temporary file, merged with `~/.deepspeed_env` and `./.deepspeed_env`, selected with DS_ENV_FILE,
removed when the launcher exits; values quoted so that the remote shell gives them back
unchanged) for multi-node launches, and through the environment of the launcher otherwise. On CPU
(DS_ACCELERATOR=cpu) OMP_NUM_THREADS defaults to the node's cores / ranks per node.
"""
from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python launch/run.py` from any directory
    sys.path.insert(0, str(ROOT))

DEFAULT_PORT = 29500
PASS_PREFIXES = ("MODE_", "NCCL_", "GLOO_", "TORCH_", "PYTORCH_", "OMP_", "DS_ACCELERATOR", "DEEPSPEED_TIMEOUT", "HF_",
                 "WANDB_", "TOKENIZERS_PARALLELISM", "PYTHONPATH",
                 "SLURM_JOB_ID", "SLURM_RESTART_COUNT")  # every rank must see a requeue (train.requeued_fresh_start)
DS_BACKENDS = ("pdsh", "openmpi", "mpich", "impi", "mvapich", "slurm")  # DeepSpeed runner's --launcher
SSH_TIMEOUT_S = 15
# what DeepSpeed's runner looks for on PATH before it starts a backend (its backend_exists); missing,
# it raised a traceback (`launcher 'pdsh' not installed.`) after the data was prepared
BACKEND_TOOLS = {"pdsh": "pdsh", "openmpi": "ompi_info", "mpich": "mpirun", "impi": "mpirun", "mvapich": "mpiname",
                 "slurm": "sinfo"}
_SAFE = re.compile(r"[\w@%+=:,./-]*")  # what DeepSpeed's runner exports without wrapping it in double quotes


def _err(key: str, value, allowed: str):
    from mode.config import ConfigError

    return ConfigError(key, value, allowed)


def read_hostfile(path: str | os.PathLike) -> dict[str, int]:
    """`host slots=N` lines (DeepSpeed/OpenMPI format); `#` comments and blank lines ignored."""
    p = Path(path)
    if not p.is_file():
        raise _err("--hostfile", str(path), "an existing file of `host slots=N` lines")
    hosts: dict[str, int] = {}
    for line in p.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) < 2 or not parts[1].startswith("slots=") or not parts[1][6:].isdigit() or parts[0] in hosts:
            raise _err("--hostfile", str(path), f"`host slots=N` lines with distinct hosts (bad line: {line!r})")
        if int(parts[1][6:]) < 1:
            raise _err("--hostfile", str(path), f"`host slots=N` lines with N >= 1 (bad line: {line!r})")
        hosts[parts[0]] = int(parts[1][6:])
    if not hosts:
        raise _err("--hostfile", str(path), "at least one `host slots=N` line")
    return hosts


def local_device_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() or 1
    except Exception:  # noqa: BLE001
        return 1


def plan_nodes(hostfile: str | None, num_nodes: int, num_gpus: int) -> list[tuple[str, int]]:
    """[(host, processes)] the DeepSpeed launcher will use (its own --num_nodes/--num_gpus rules)."""
    if hostfile:
        hosts = list(read_hostfile(hostfile).items())
        if num_nodes > 0:
            if num_nodes > len(hosts):
                raise _err("--num_nodes", num_nodes, f"<= the {len(hosts)} hosts in {hostfile}")
            hosts = hosts[:num_nodes]
    else:
        if num_nodes > 1:
            raise _err("--num_nodes", num_nodes, "1 without --hostfile (give a hostfile for several nodes)")
        hosts = [("localhost", local_device_count())]
    if num_gpus > 0:
        hosts = [(h, num_gpus) for h, _ in hosts]
    return hosts


def is_loopback(host: str) -> bool:
    """A name or address that means "this machine" wherever it is read: localhost, 127.x, ::1. As the
    master address of several nodes every node would wait for its own rank 0. (Only what is written:
    a hostname that merely resolves to a loopback address here, as /etc/hosts names one machine's
    simulated nodes, is the user's to vouch for.)"""
    h = host.strip("[]").lower().rstrip(".")
    if h in ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback") or h.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        return False
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def check_hosts(hostfile: str | None, nodes: list[tuple[str, int]], master_addr: str | None, pdsh: bool,
                loopback: bool = True, keys: tuple[str, str] = ("--hostfile", "--master_addr")) -> None:
    """A multi-node launch's checks of this node's side, made by the launch and by `mode compare`
    (--dry-run too): a loopback first host without a master address, and (`pdsh`: the ranks start
    over pdsh) the paths pdsh passes unquoted. `keys`: what the caller calls the hostfile and the
    master address."""
    if loopback and hostfile and len(nodes) > 1 and not master_addr and is_loopback(nodes[0][0]):
        raise _err(keys[0], hostfile, f"a first host (node 0: the master address of the {len(nodes)} "
                   f"nodes) the other nodes can reach; {nodes[0][0]} is each node's own loopback: list node 0 "
                   f"by a name the other nodes resolve to it, or pass {keys[1]} <node 0's address>")
    if pdsh:  # DeepSpeed's pdsh runner sends `cd <cwd>; <python> ...` unquoted: with a space, the
        # remote `cd` failed and the ranks trained in $HOME, exit 0
        for what, path in (("the working directory", os.getcwd()), ("the python", sys.executable)):
            if not re.fullmatch(r"[\w@+=:,./-]+", path):
                raise _err(what, path, "a path without spaces or shell-special characters for a pdsh launch "
                           "(DeepSpeed passes it unquoted to every node's shell): launch from another directory")


def world_size(launcher: str, hostfile: str | None, num_nodes: int, num_gpus: int) -> int:
    if num_gpus == 0 or num_gpus < -1:  # -1: the default
        raise _err("--num_gpus", num_gpus, "processes per node >= 1 (or leave it out: hostfile slots / visible GPUs)")
    if num_nodes == 0 or num_nodes < -1:
        raise _err("--num_nodes", num_nodes, "nodes >= 1 (or leave it out: every host)")
    if launcher == "torchrun":
        return max(1, num_nodes) * (num_gpus if num_gpus > 0 else local_device_count())
    return sum(n for _, n in plan_nodes(hostfile, num_nodes, num_gpus))


def validate(config: str, overrides: list[str], world: int, node_rank: int | None = None,
             prepare_data: bool = True):
    """Resolve the config for `world` ranks and run the trainer's preflight and world-size check
    here, before any rank starts (the ranks check again, cheaply); raises ConfigError. Only node 0 checks the run
    directory's lock: another node's launcher may start after rank 0 took it. `prepare_data=False`
    (--dry-run): the same data checks, nothing prepared (--validate-only prepares: slurm.sbatch
    prepares the data in its one process before the ranks start)."""
    from mode.config import load_config
    from mode.train import check_world, finished, preflight

    cfg = load_config(config, overrides, world_size=world)
    preflight(cfg, lock=not node_rank, prepare_data=prepare_data)
    if finished(cfg) is None:  # a finished run is a no-op at any world size (the ranks say so)
        check_world(cfg, world)
    return cfg


def pass_env(extra: list[str], ranks_per_node: int = 1, user: dict[str, str] | None = None) -> dict[str, str]:
    """Variables every rank on every node gets; `user`: the user's env files' (user_env), whose
    values our defaults do not override."""
    user = user or {}
    env = {k: v for k, v in os.environ.items() if k.startswith(PASS_PREFIXES) and "\n" not in v and v == v.strip()}
    pp = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join(pp)
    try:
        import torch

        if not torch.cuda.is_available() and "DS_ACCELERATOR" not in user:
            env.setdefault("DS_ACCELERATOR", "cpu")
    except Exception:  # noqa: BLE001
        pass
    if env.get("DS_ACCELERATOR", user.get("DS_ACCELERATOR")) == "cpu" and "OMP_NUM_THREADS" not in user:  # else
        # every rank starts one OpenMP thread per core; a value in the user's .deepspeed_env is theirs
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, ranks_per_node))))
    for kv in extra:
        k, _, v = kv.partition("=")
        if not _ or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise _err("--env", kv, "KEY=VALUE with KEY a shell variable name")
        if "\n" in v or v != v.strip():  # DeepSpeed's env file is line-based and strips values
            raise _err("--env", kv, "a value without newlines or leading/trailing whitespace")
        env[k] = v
    return env


def shell_value(v: str) -> str:
    """The env-file form of `v` that arrives unchanged through the pdsh runner: DeepSpeed wraps a
    value holding anything but [\\w@%+=:,./-] in double quotes for the remote shell, where \\ $ ` "
    would otherwise be interpreted; escaping them (which also guarantees the wrapping) undoes that.
    pdsh itself replaces %h %n %u %% anywhere in the remote command first: % doubles."""
    return (v if _SAFE.fullmatch(v) else re.sub(r'([\\$`"])', r"\\\1", v)).replace("%", "%%")


def pdsh_arg(a: str) -> str:
    """The form of a command-line argument (config path, override) that arrives unchanged through the
    pdsh runner: DeepSpeed wraps one holding a space in double quotes (escaping " itself) and passes
    others bare, to the remote shell; pdsh replaces %h %n %u %% first."""
    a = re.sub(r"([\\$`])", r"\\\1", a) if " " in a else shlex.quote(a)
    return a.replace("%", "%%")


def user_env() -> dict[str, str]:
    """KEY=VALUE lines of the user's ~/.deepspeed_env and ./.deepspeed_env (DeepSpeed's own env files,
    which our launch replaces by one of its own: their lines go into it), as written. Blank and `#`
    lines are skipped: passed on, `export # X=1; export ...; cd ...; python ...` made the remote
    command a comment (a launch that ran nothing, exit 0). Any other line must be KEY=VALUE."""
    out = {}
    for f in (Path.home() / ".deepspeed_env", Path(".deepspeed_env")):
        if not f.is_file():
            continue
        for ln in f.read_text().splitlines():
            if not ln.strip() or ln.lstrip().startswith("#"):
                continue
            k, eq, v = ln.partition("=")
            if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
                raise _err(str(f.absolute()), ln, "KEY=VALUE lines (KEY a shell variable name), blank lines or "
                           "# comments (DeepSpeed exports each line on every node)")
            out[k] = v
    return out


def write_deepspeed_env(path: Path, env: dict[str, str], shell: bool = False) -> Path:
    """DeepSpeed exports each KEY=VALUE line of its env file on every node it starts (multi-node);
    `shell`: values pass through the remote shell (pdsh), so quote them for it. The user's own
    files' lines come first (as they wrote them): a key in `env` (their shell's, --env) wins."""
    lines = [f"{k}={v}" for k, v in user_env().items()]
    lines += [f"{k}={shell_value(v) if shell else v}" for k, v in env.items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def deepspeed_command(config: str, overrides: list[str], *, hostfile: str | None = None, num_nodes: int = -1,
                      num_gpus: int = -1, node_rank: int | None = None, no_ssh: bool = False,
                      master_addr: str | None = None, master_port: int = DEFAULT_PORT,
                      python: str = sys.executable, backend: str | None = None, ssh_port: int | None = None,
                      launcher_args: str | None = None, ssh_check: bool = True) -> list[str]:
    cmd = [python, "-u", "-m", "deepspeed.launcher.runner"]
    if backend:
        cmd += ["--launcher", backend]
    if launcher_args:
        cmd += ["--launcher_args", launcher_args]
    if ssh_port:
        cmd += ["--ssh_port", str(ssh_port)]
    if hostfile:
        cmd += ["--hostfile", str(hostfile)]
    else:  # DeepSpeed reads /job/hostfile by default; a single node must not pick it up
        cmd += ["--hostfile", "/dev/null/none"]
    if num_nodes > 0:
        cmd += ["--num_nodes", str(num_nodes)]
    if num_gpus > 0:
        cmd += ["--num_gpus", str(num_gpus)]
    if no_ssh:
        cmd += ["--no_ssh", f"--node_rank={node_rank or 0}"]
    if not ssh_check:
        cmd += ["--no_ssh_check"]
    if master_addr:
        cmd += ["--master_addr", master_addr]
    cmd += ["--master_port", str(master_port), "--module", "mode.train", "--config", config, *overrides]
    return cmd


def torchrun_command(config: str, overrides: list[str], *, num_nodes: int = 1, num_gpus: int = -1,
                     node_rank: int | None = None, master_addr: str | None = None,
                     master_port: int = DEFAULT_PORT, python: str = sys.executable) -> list[str]:
    nproc = num_gpus if num_gpus > 0 else local_device_count()
    cmd = [python, "-u", "-m", "torch.distributed.run", f"--nnodes={max(1, num_nodes)}", f"--nproc-per-node={nproc}",
           f"--node-rank={node_rank or 0}", f"--master-addr={master_addr or '127.0.0.1'}",
           f"--master-port={master_port}"]
    return cmd + ["-m", "mode.train", "--config", config, *overrides]


def check_tools(hostfile: str, n_nodes: int, backend: str) -> None:
    """The programs a multi-node launch from this node runs, on PATH here: the backend's (pdsh, mpirun,
    ...) and ssh (our reachability check and stop_nodes; DeepSpeed's runner ssh's to the first host)."""
    for prog in (BACKEND_TOOLS[backend], "ssh"):
        if shutil.which(prog) is None:
            raise _err("--hostfile", hostfile, f"a launch on its {n_nodes} nodes from this node (DeepSpeed's {backend} "
                       f"runner) needs `{prog}` on PATH, and this node has none: install it, or run the command on "
                       "every node with --no_ssh --node_rank R --master_addr <node 0>")


def ssh_options(ssh_port: int | None, timeout: float = SSH_TIMEOUT_S) -> list[str]:
    """ssh as pdsh runs it for DeepSpeed (PDSH_SSH_ARGS_APPEND, then the runner's -p), never prompting."""
    return ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(timeout)}",
            *shlex.split(os.environ.get("PDSH_SSH_ARGS_APPEND", ""))] + (["-p", str(ssh_port)] if ssh_port else [])


def check_ssh(hostfile: str, hosts: list[str], ssh_port: int | None, timeout: float = SSH_TIMEOUT_S) -> None:
    """Every host answers passwordless ssh (as pdsh will reach it), else one ConfigError naming the first
    that does not: DeepSpeed checks only the first host, and an unreachable other one would hang the
    ranks until the rendezvous timeout."""
    procs = {h: subprocess.Popen(["ssh", *ssh_options(ssh_port, timeout), h, "true"], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for h in hosts}
    bad = None
    for h, proc in procs.items():
        try:
            _, err = proc.communicate(timeout=timeout + 5)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            err = f"no answer in {timeout + 5:.0f} s"
        if proc.returncode != 0 and bad is None:
            lines = [ln.strip() for ln in (err or "").splitlines() if ln.strip()]
            bad = (h, lines[-1] if lines else f"ssh exited with {proc.returncode}")
    if bad:
        port = f" (port {ssh_port})" if ssh_port else ""
        raise _err("--hostfile", hostfile, f"hosts reachable by passwordless ssh{port} from this node; "
                   f"{bad[0]} is not: {bad[1]}")


def parser() -> argparse.ArgumentParser:
    from mode.errors import OneLineParser, Once  # bad options: one line, exit 2, as `mode`'s commands

    p = OneLineParser(prog="python -m launch.run", description=__doc__.split("\n\n")[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter,
                      epilog="The remaining arguments are `mode train`'s: --config FILE [dotted.key=value ...]")
    p.add_argument("--launcher", choices=("deepspeed", "torchrun", *DS_BACKENDS), default="deepspeed",
                   help="deepspeed (its runner; pdsh over ssh for several nodes), torchrun, or a DeepSpeed "
                        "multi-node backend")
    p.add_argument("--hostfile", default=None, help="`host slots=N` lines (deepspeed launcher)")
    p.add_argument("--num_nodes", "--num-nodes", type=int, default=-1, help="nodes to use (default: all hosts)")
    p.add_argument("--num_gpus", "--num-gpus", type=int, default=-1,
                   help="processes per node (default: hostfile slots / visible GPUs)")
    p.add_argument("--node_rank", "--node-rank", type=int, default=None,
                   help="this node's rank (with --no_ssh, and for torchrun)")
    p.add_argument("--no_ssh", "--no-ssh", action="store_true",
                   help="start only this node's ranks; run the same command on every node (SLURM)")
    p.add_argument("--master_addr", "--master-addr", default=None,
                   help="address of node 0 as every node reaches it (default: first hostfile host, or 127.0.0.1)")
    p.add_argument("--master_port", "--master-port", type=int, default=None,
                   help=f"rendezvous port (default: $MASTER_PORT, else {DEFAULT_PORT})")
    p.add_argument("--ssh_port", "--ssh-port", type=int, default=None, help="ssh port of every node (pdsh)")
    p.add_argument("--launcher_args", "--launcher-args", default=None,
                   help="options for the multi-node backend (pdsh, mpirun, ...), one quoted string")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="export to every rank (repeatable)")
    p.add_argument("--validate-only", action="store_true",
                   help="check the config, print the absolute run.dir and exit (0, or 2 on a bad config)")
    p.add_argument("--dry-run", action="store_true", help="check the config, print the launcher command, exit")
    p.add_argument("--config", required=True, action=Once)
    p.add_argument("overrides", nargs="*", help="dotted.key=value")
    return p


def stop_nodes(hosts: list[str], ssh_port: int | None, master_addr: str, master_port: int) -> None:
    """SIGTERM this job's DeepSpeed launcher on every node (each stops its ranks). DeepSpeed's own
    Ctrl-C handler would `pkill -f "<python> -u -m deepspeed.launcher.launch"` there, every job
    started with this interpreter; a job's master address and port single out its launchers."""
    pattern = (r"deepspeed\.launcher\.launch --world_info=\S+ --node_rank=[0-9]+ "
               rf"--master_addr={re.escape(master_addr)} --master_port={master_port}( |$)")
    procs = [subprocess.Popen(["ssh", *ssh_options(ssh_port), h, f"pkill -TERM -f -- {shlex.quote(pattern)}"],
                              stdin=subprocess.DEVNULL) for h in hosts]
    for proc in procs:
        try:
            proc.wait(timeout=SSH_TIMEOUT_S + 5)
        except subprocess.TimeoutExpired:
            proc.kill()


def guard_main(argv: list[str]) -> int:
    """The watchdog of a pdsh launch: a process of its own session, started by run_multinode. The
    ranks on other nodes live under their sshd, not under this machine's launcher, so a launch.run
    (or `mode compare` above it) killed by SIGKILL left the whole job training with nothing watching
    it. Once launch.run is gone while the runner lives: stop this job's launchers on every node, end
    the runner's process group (pdsh, ssh), remove the env file's directory. Exits with the runner."""
    from mode.lifeline import start_time

    parent, parent_start, runner, runner_start, tmp, ssh_port, master, port, *hosts = argv
    born = {parent: parent_start, runner: runner_start}  # "" when already gone at start

    def alive(pid: str) -> bool:
        return bool(born[pid]) and start_time(int(pid)) == born[pid]

    while alive(runner):
        if not alive(parent):
            print(f"launch.run (pid {parent}) is gone: stopping this job's ranks on every node", file=sys.stderr,
                  flush=True)
            stop_nodes(hosts, int(ssh_port) if ssh_port else None, master, int(port))
            # the nodes' launchers stopped, so the runner ends; not SIGTERM: DeepSpeed's handler would
            # pkill every job's launcher on every node (see stop_nodes); SIGKILL if it lingers
            end = time.monotonic() + 30
            while alive(runner) and time.monotonic() < end:
                time.sleep(0.2)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(runner), signal.SIGKILL)
            shutil.rmtree(tmp, ignore_errors=True)
            return 0
        time.sleep(1)
    # The runner ended. launch.run removes the directory as it returns; killed (or ended by its
    # watchdog thread under compare) it cannot: if it is gone within 10 s, remove it here.
    end = time.monotonic() + 10
    while alive(parent) and time.monotonic() < end:
        time.sleep(0.2)
    if not alive(parent):
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def start_guard(runner_pid: int, tmp: Path, guard: tuple) -> subprocess.Popen:
    from mode.lifeline import start_time

    hosts, ssh_port, master, port = guard
    # start times read here, while both are alive (the runner is this process's unreaped child)
    started = [start_time(pid) or "" for pid in (os.getpid(), runner_pid)]
    return subprocess.Popen([sys.executable, "-c", "import sys, launch.run as r; sys.exit(r.guard_main(sys.argv[1:]))",
                             str(os.getpid()), started[0], str(runner_pid), started[1], str(tmp), str(ssh_port or ""),
                             master, str(port), *hosts], cwd=ROOT, stdin=subprocess.DEVNULL, start_new_session=True)


def run_multinode(cmd: list[str], env: dict[str, str], shell: bool, stop=None, guard: tuple | None = None) -> int:
    """Start DeepSpeed's multi-node runner with our env file in a temporary directory (nothing in
    run.dir: the ranks create it), wait, remove the file. With `stop` (pdsh) the runner runs in its
    own session, so Ctrl-C and SIGTERM reach only this process, which calls `stop()` to end this
    job's processes on every node; a second signal kills the runner. `guard` (hosts, ssh port, master
    address, port): a watchdog process does the same if this process dies by SIGKILL."""
    tmp = Path(tempfile.mkdtemp(prefix="mode-launch-"))
    try:
        env = {**os.environ, **env, "DS_ENV_FILE": str(write_deepspeed_env(tmp / "deepspeed_env", env, shell))}
        proc = subprocess.Popen(cmd, env=env, start_new_session=stop is not None)
        if guard:  # not waited for: it outlives this process by design (and then belongs to init)
            start_guard(proc.pid, tmp, guard)
        signals = []

        def on_signal(signum, _frame):
            signals.append(signum)
            if stop is None:  # same process group: a Ctrl-C reached the runner too (its own handler)
                if signum == signal.SIGTERM:
                    proc.send_signal(signal.SIGTERM)
            elif len(signals) == 1:
                print(f"launch.run: {signal.Signals(signum).name}: stopping this job's ranks on every node "
                      "(again to kill the launcher)", file=sys.stderr, flush=True)
                stop()
            else:
                os.killpg(proc.pid, signal.SIGKILL)

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        deadline = None
        while (rc := proc.poll()) is None:
            if signals and stop and deadline is None:
                deadline = time.monotonic() + 30
            if deadline and time.monotonic() > deadline:  # the nodes' launchers stopped, the runner did not
                os.killpg(proc.pid, signal.SIGKILL)
            time.sleep(0.2)
        if signals:
            return 128 + signals[0]
        return rc if rc >= 0 else 128 - rc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
    a = parser().parse_intermixed_args(argv)  # overrides before or after the options, as in `mode train`
    from mode.compare import PORT, is_port  # the rule of an experiment's launcher_options
    from mode.config import ConfigError

    backend = a.launcher if a.launcher in DS_BACKENDS else None
    multinode = pdsh = False
    try:
        if a.no_ssh and a.node_rank is None:
            raise _err("--node_rank", None, "this node's rank (required with --no_ssh)")
        if a.launcher == "torchrun" and a.num_nodes > 1 and not a.master_addr:
            # without it every node waits on its own 127.0.0.1 until the rendezvous times out
            raise _err("--master_addr", None, "node 0's address (required with --launcher torchrun on several nodes)")
        if a.launcher == "torchrun" and a.num_nodes > 1 and a.node_rank is None:  # else rank 0 on every node
            raise _err("--node_rank", None, "this node's rank (required with --launcher torchrun on several nodes)")
        if a.master_port is None:  # the environment's, as torchrun and deepspeed read it
            port = os.environ.get("MASTER_PORT", str(DEFAULT_PORT))
            if not (port.isdigit() and is_port(int(port))):
                raise _err("MASTER_PORT", port, PORT)
            a.master_port = int(port)
        for key, port in (("--master_port", a.master_port), ("--ssh_port", a.ssh_port)):
            if port is not None and not is_port(port):  # else refused only at rendezvous, after the ranks start
                raise _err(key, port, PORT)
        world = world_size(a.launcher, a.hostfile, a.num_nodes, a.num_gpus)
        nodes = plan_nodes(a.hostfile, a.num_nodes, a.num_gpus) if a.launcher != "torchrun" else []
        n_nodes = max(1, a.num_nodes) if a.launcher == "torchrun" else len(nodes)
        if a.node_rank is not None and not 0 <= a.node_rank < n_nodes:
            raise _err("--node_rank", a.node_rank, f"this node's rank, 0 <= R < {n_nodes} (the number of nodes)")
        multinode = bool(a.hostfile) and not a.no_ssh and len(nodes) > 1
        pdsh = multinode and backend in (None, "pdsh")  # over ssh, through pdsh and the remote shell
        # (slurm.sbatch validates without a master address: the loopback rule is for a launch)
        check_hosts(a.hostfile, nodes, a.master_addr, pdsh, loopback=not a.validate_only)
        if multinode and not a.dry_run and not a.validate_only:  # before anything is prepared or started
            check_tools(a.hostfile, len(nodes), backend or "pdsh")
        # the user's env files count only where DeepSpeed would read them: a multi-node launch
        env = pass_env(a.env, max((n for _, n in nodes), default=max(1, a.num_gpus)), user_env() if multinode else {})
        ssh = pdsh and not a.dry_run and not a.validate_only
        # after the cheap checks; with ssh, the hosts are asked before data is prepared (hours for a large corpus)
        cfg = validate(a.config, a.overrides, world, a.node_rank, prepare_data=not a.dry_run and not ssh)
        if ssh:
            check_ssh(a.hostfile, [h for h, _ in nodes], a.ssh_port)
            cfg = validate(a.config, a.overrides, world, a.node_rank)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    if a.validate_only:
        print(f"config ok: {a.config} ({world} ranks, run.dir={cfg.run.dir})", file=sys.stderr)
        print(Path(cfg.run.dir).resolve())
        return 0
    if a.launcher == "torchrun":
        cmd = torchrun_command(a.config, a.overrides, num_nodes=a.num_nodes, num_gpus=a.num_gpus,
                               node_rank=a.node_rank, master_addr=a.master_addr, master_port=a.master_port)
    else:
        master = a.master_addr
        # one node of a hostfile: DeepSpeed starts its ranks here, yet without an address it ssh'd to the
        # first host (a traceback where there is no ssh) for its ssh check and `hostname -I`. pdsh: check_ssh
        # asked every host as pdsh reaches them; DeepSpeed's own check of the first host leaves out
        # PDSH_SSH_ARGS_APPEND (`-i key`, `-l user`): a traceback for a launch pdsh would have run
        one_node = bool(a.hostfile) and len(nodes) < 2
        if master is None and a.hostfile:  # node 0, not DeepSpeed's `hostname -I` guess (asked over ssh)
            master = "127.0.0.1" if one_node else nodes[0][0]
        args = [a.config, *a.overrides]
        if pdsh:  # arrive unchanged
            args = [pdsh_arg(x) for x in args]
        cmd = deepspeed_command(args[0], args[1:], hostfile=a.hostfile, num_nodes=a.num_nodes,
                                num_gpus=a.num_gpus, node_rank=a.node_rank, no_ssh=a.no_ssh, master_addr=master,
                                master_port=a.master_port, backend=backend, ssh_port=a.ssh_port,
                                launcher_args=a.launcher_args, ssh_check=not one_node and not pdsh)
    if a.dry_run:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())) + " \\\n  " + shlex.join(cmd))
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    if multinode:
        hosts = [h for h, _ in nodes]
        stop = (lambda: stop_nodes(hosts, a.ssh_port, master, a.master_port)) if pdsh else None
        if pdsh and os.environ.get("MODE_WATCH_PARENT") == "1":  # under `mode compare`: end with it
            from mode.lifeline import die_with_launcher

            die_with_launcher()
        guard = (hosts, a.ssh_port, master, a.master_port) if pdsh else None
        return run_multinode(cmd, env, shell=pdsh, stop=stop, guard=guard)
    os.execvpe(cmd[0], cmd, {**os.environ, **env})
    return 0  # not reached


if __name__ == "__main__":
    from mode.errors import guarded

    sys.exit(guarded(main, sys.argv[1:]))

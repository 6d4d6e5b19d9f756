"""Validate a training config, then start the DeepSpeed launcher (or torchrun) on one node or many.

    python -m launch.run [launcher options] --config CONFIG [dotted.key=value ...]

The config is resolved and checked (values, the world size against model.moe.ep_size, the
tokenizer's vocabulary, an existing run directory written by another config) *before* any
worker starts: a bad config prints one `config error: ...` line and exits 2. Then this process
is replaced (exec) by the launcher, so signals (SIGTERM from SLURM, Ctrl-C) reach it directly
and the exit status is the launcher's.

Launchers:

- `--launcher deepspeed` (default). With `--hostfile` (lines `host slots=N`) and ssh between
  nodes, one command on the first node starts every node (pdsh). With `--no_ssh --node_rank R`
  the same command is run on every node (SLURM: launch/slurm.sbatch). Without a hostfile: one
  node, `--num_gpus` processes.
- `--launcher torchrun`: run once per node with `--num_nodes N --node_rank R --master_addr A`.

Environment: `--env KEY=VALUE` (repeatable) and the variables this machine's training needs
(OMP_NUM_THREADS, DS_ACCELERATOR, PYTHONPATH and any MODE_*/NCCL_*/GLOO_* already set) are
exported to every rank on every node: through DeepSpeed's `.deepspeed_env` mechanism (written
to `<run.dir>/deepspeed_env`, merged with `~/.deepspeed_env` and `./.deepspeed_env`, selected
with DS_ENV_FILE) for ssh launches, and through the environment of the launcher otherwise.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python launch/run.py` from any directory
    sys.path.insert(0, str(ROOT))

DEFAULT_PORT = 29500
PASS_PREFIXES = ("MODE_", "NCCL_", "GLOO_", "TORCH_", "OMP_", "DS_ACCELERATOR", "HF_", "PYTHONPATH")


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


def world_size(launcher: str, hostfile: str | None, num_nodes: int, num_gpus: int) -> int:
    if launcher == "torchrun":
        return max(1, num_nodes) * (num_gpus if num_gpus > 0 else local_device_count())
    return sum(n for _, n in plan_nodes(hostfile, num_nodes, num_gpus))


def validate(config: str, overrides: list[str], world: int, node_rank: int | None = None):
    """Resolve the config for `world` ranks and run the trainer's preflight; raises ConfigError.
    Only node 0 checks the run directory's lock: another node's launcher may start after rank 0
    took it."""
    from mode.config import load_config
    from mode.train import preflight

    cfg = load_config(config, overrides, world_size=world)
    preflight(cfg, lock=not node_rank)
    return cfg


def pass_env(extra: list[str]) -> dict[str, str]:
    """Variables every rank on every node gets."""
    env = {k: v for k, v in os.environ.items() if k.startswith(PASS_PREFIXES) and "\n" not in v}
    pp = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join(pp)
    try:
        import torch

        if not torch.cuda.is_available():
            env.setdefault("DS_ACCELERATOR", "cpu")
    except Exception:  # noqa: BLE001
        pass
    for kv in extra:
        if "=" not in kv:
            raise _err("--env", kv, "KEY=VALUE")
        k, v = kv.split("=", 1)
        env[k] = v
    return env


def write_deepspeed_env(path: Path, env: dict[str, str]) -> Path:
    """DeepSpeed exports each KEY=VALUE line of its env file on every node it starts over ssh."""
    lines = []
    for f in (Path.home() / ".deepspeed_env", Path(".deepspeed_env")):  # keep the user's own file working
        if f.is_file():
            lines += [ln for ln in f.read_text().splitlines() if "=" in ln]
    lines += [f"{k}={v}" for k, v in env.items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def deepspeed_command(config: str, overrides: list[str], *, hostfile: str | None = None, num_nodes: int = -1,
                      num_gpus: int = -1, node_rank: int | None = None, no_ssh: bool = False,
                      master_addr: str | None = None, master_port: int = DEFAULT_PORT,
                      python: str = sys.executable) -> list[str]:
    cmd = [python, "-u", "-m", "deepspeed.launcher.runner"]
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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launch.run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="The remaining arguments are `mode train`'s: "
                                       "--config FILE [dotted.key=value ...]")
    p.add_argument("--launcher", choices=("deepspeed", "torchrun"), default="deepspeed")
    p.add_argument("--hostfile", default=None, help="`host slots=N` lines (deepspeed launcher)")
    p.add_argument("--num_nodes", "--num-nodes", type=int, default=-1, help="nodes to use (default: all hosts)")
    p.add_argument("--num_gpus", "--num-gpus", type=int, default=-1,
                   help="processes per node (default: hostfile slots / visible GPUs)")
    p.add_argument("--node_rank", "--node-rank", type=int, default=None,
                   help="this node's rank (with --no_ssh, and for torchrun)")
    p.add_argument("--no_ssh", "--no-ssh", action="store_true",
                   help="start only this node's ranks; run the same command on every node (SLURM)")
    p.add_argument("--master_addr", "--master-addr", default=None,
                   help="address of node 0 (default: first hostfile host, or 127.0.0.1)")
    p.add_argument("--master_port", "--master-port", type=int, default=int(os.environ.get("MASTER_PORT", DEFAULT_PORT)))
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="export to every rank (repeatable)")
    p.add_argument("--validate-only", action="store_true", help="check the config and exit (0 or 2)")
    p.add_argument("--dry-run", action="store_true", help="check the config, print the launcher command, exit")
    p.add_argument("--config", required=True)
    p.add_argument("overrides", nargs="*", help="dotted.key=value")
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    from mode.config import ConfigError

    try:
        if a.no_ssh and a.node_rank is None:
            raise _err("--node_rank", None, "this node's rank (required with --no_ssh)")
        world = world_size(a.launcher, a.hostfile, a.num_nodes, a.num_gpus)
        cfg = validate(a.config, a.overrides, world, a.node_rank)
        env = pass_env(a.env)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    if a.validate_only:
        print(f"config ok: {a.config} ({world} ranks, run.dir={cfg.run.dir})", file=sys.stderr)
        return 0
    if a.launcher == "torchrun":
        cmd = torchrun_command(a.config, a.overrides, num_nodes=a.num_nodes, num_gpus=a.num_gpus,
                               node_rank=a.node_rank, master_addr=a.master_addr, master_port=a.master_port)
    else:
        master = a.master_addr
        if master is None and a.hostfile and len(plan_nodes(a.hostfile, a.num_nodes, a.num_gpus)) > 1 and a.no_ssh:
            master = plan_nodes(a.hostfile, a.num_nodes, a.num_gpus)[0][0]
        cmd = deepspeed_command(a.config, a.overrides, hostfile=a.hostfile, num_nodes=a.num_nodes,
                                num_gpus=a.num_gpus, node_rank=a.node_rank, no_ssh=a.no_ssh, master_addr=master,
                                master_port=a.master_port)
    if a.dry_run:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())) + " \\\n  " + shlex.join(cmd))
        return 0
    if a.launcher == "deepspeed" and a.hostfile and not a.no_ssh:
        env_file = write_deepspeed_env(Path(cfg.run.dir).resolve() / "deepspeed_env", env)
        env["DS_ENV_FILE"] = str(env_file)  # absolute: os.path.join(dir, abs) is abs
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(cmd[0], cmd, {**os.environ, **env})
    return 0  # not reached


if __name__ == "__main__":
    from mode.errors import guarded

    sys.exit(guarded(main, sys.argv[1:]))

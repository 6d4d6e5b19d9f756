"""`mode compare EXPERIMENT.yaml [--dry-run] [--only VARIANT ...] [dotted.key=value ...]`

Expands an experiment grid (variants x seeds) into runs, runs them one after another through the
launcher the experiment names, then writes the comparison report (analysis.report.analyze) and
prints its path as the last line: `report: <path>`.

Experiment format::

    name: quickstart
    runs_dir: runs/quickstart        # relative to the current directory (the repo root for `make demo`),
                                     # `~` expanded; not the current directory, a parent of it or $HOME
    launcher: local                  # local | deepspeed | slurm (below)
    nproc: 1                         # processes (ranks) per run for `local`
    seeds: [0]                       # default seeds of every variant
    overrides: ["train.max_steps=200"]   # dotted.key=value applied to every variant
    launcher_options: {}             # launcher-specific, below
    variants:                        # name -> base config (relative to this YAML) + its own overrides/seeds
      dense: {config: ../tiny/dense.yaml}
      moe_dropping: {config: ../tiny/moe_dropping.yaml, seeds: [0, 1], overrides: ["model.moe.capacity_factor=0.5"]}
    match_flops: {variants: [dense, moe_dropping], tolerance: 0.02}   # checked before anything runs
    budgets: [1.0e15, 3.0e15]        # training FLOPs: the report's isoFLOP section groups runs by them

Each run is `<variant>_seed<k>` with run directory `runs_dir/<variant>_seed<k>` and the overrides
`run.dir=...`, `run.name=<variant>`, `train.seed=<k>` applied last (after the experiment's, the
variant's, and those given on the command line, none of which may set these three keys: one
`config error:` line says what to use instead, `runs_dir:`, the variant's name, `seeds:`). Data
order is the same for every variant and seed: it depends on data.split_seed only, which the
experiment should not vary.

Launchers:

- `local`: `nproc: 1` runs `python -m mode.cli train` in a subprocess; `nproc > 1` runs the
  DeepSpeed launcher on this machine (`--num_gpus nproc`; on CPU one OpenMP thread per rank
  unless OMP_NUM_THREADS is set).
- `deepspeed`: the launch wrapper (`python -m launch.run`) with `launcher_options`
  `hostfile` (relative to the current directory), `num_nodes`, `num_gpus` (per node),
  `master_addr`, `master_port`, `ssh_port`, `launcher_args` (passed to DeepSpeed's runner), `env`
  (mapping exported to every rank on every node). Without a hostfile (one node) and without
  `master_port`, each run gets a free port instead of DeepSpeed's 29500.
- `slurm`: writes one replayable submit script per unfinished run to `runs_dir/slurm/<run>.sh`
  (the environment the job needs: this interpreter as PYTHON, PYTHONPATH, PATH, SLURM_CONF, the
  variables launch/run.py passes to ranks, GPUS_PER_NODE set from the grid (a value in the user's
  shell would change the jobs' world size), then `sbatch --nodes N --gpus-per-node G
  [sbatch_args] launch/slurm.sbatch --config ...`; with `num_gpus: 0`, for partitions without
  GPUs, `--ntasks-per-node nproc` instead) and, with `launcher_options.submit: true`, runs it
  (once: a job still queued or running is not submitted again). Job logs (appended on requeue):
  `runs_dir/slurm/<run>-<jobid>.out`. `launcher_options`: `num_nodes` (1), `num_gpus` (per node;
  default nproc), `sbatch_args` (list, e.g. ["--partition=gpu", "--time=12:00:00"]), `submit`
  (false), `env` (mapping exported to the job), `script` (an sbatch script of your own instead of
  launch/slurm.sbatch, taking the same arguments). A run whose recorded job is still queued or running
  is not refused as in use by another writer: the rerun waits for that job. `--wait` (the default
  when stdin is a terminal; `--no-wait` to return at once) polls the jobs (squeue, then scontrol/sacct for the final
  state) and writes the report when every run is done. A job that ended without finishing its
  run (FAILED, CANCELLED, TIMEOUT, NODE_FAIL, OUT_OF_MEMORY, PREEMPTED, or COMPLETED before train.max_steps)
  is reported with its state and log and is not submitted again unless `--resubmit` is given
  (it then resumes from its newest checkpoint); the exit status is then 1 and no report is
  written. A job that COMPLETED at the run's train.stop_at stopped as asked: the report is
  written from what exists. With `submit: false` nothing is submitted: run the scripts (each
  records its job id in runs_dir/slurm/<run>.jobid), then `--wait` waits for those jobs. A poll
  that the controller does not answer (UNREACHABLE) keeps the job waited for, never resubmitted.

runs_dir holds only what compare writes (LOCK, experiment.json, `<variant>_seed<k>` run directories,
slurm/, reports): a runs_dir that is a file or a mode run, or holds anything else (a user's files, an
experiment.json that is not compare's plan, a report/ no mode report wrote), and a report_dir that
is a file or holds a user's report, are refused when the experiment is read (`config error:
runs_dir=...` / `report_dir=...`, exit 2), before anything is written or run.

Before the first run starts every run's config is resolved and checked (values, world size vs.
expert-parallel size, tokenizer, an existing run directory of an incompatible config): a bad
grid stops with one `config error: variant V (seed k): ...` line, exit 2. Invoking the same
command again skips runs whose directory holds DONE and resumes interrupted ones from their
newest complete checkpoint. Progress: `[i/N] run` lines, then each run's own progress bar.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from mode.config import NAME_RE, Config, ConfigError, is_int, is_number, parse_yaml, user_path

ROOT = Path(__file__).resolve().parents[1]
LAUNCHERS = ("local", "deepspeed", "slurm")
EXPERIMENT_KEYS = ("name", "description", "runs_dir", "report_dir", "launcher", "launcher_options", "nproc", "seeds",
                   "overrides", "variants", "match_flops", "budgets")
VARIANT_KEYS = ("config", "seeds", "overrides", "description")
LAUNCHER_OPTIONS = {"local": (),
                    "deepspeed": ("hostfile", "num_nodes", "num_gpus", "master_addr", "master_port", "ssh_port",
                                  "launcher_args", "env"),
                    "slurm": ("num_nodes", "num_gpus", "sbatch_args", "submit", "script", "env")}
MAX_NPROC = 1024  # ranks per node: more than any node holds (GPUs, or CPU cores for CPU ranks)


@dataclass
class Experiment:
    path: Path
    name: str
    runs_dir: Path
    report_dir: Path | None
    launcher: str
    options: dict
    nproc: int
    seeds: list[int]
    overrides: list[str]
    variants: dict[str, dict]
    match_flops: dict = field(default_factory=dict)  # {variants: [...], tolerance: 0.02}
    budgets: list[float] | None = None  # training FLOP budgets that group the report's isoFLOP section


@dataclass
class GridRun:
    variant: str
    seed: int
    config: str
    overrides: list[str]
    cfg: Config | None = None
    status: str = "new"  # new | resume | done
    resume_step: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.variant}_seed{self.seed}"

    @property
    def dir(self) -> Path:
        return Path(self.cfg.run.dir)


# ----------------------------------------------------------------------------------------------
# Reading the experiment.


def _bad(path: Path, what: str) -> ConfigError:
    return ConfigError("experiment", msg=f"experiment {path}: {what}")


def _str_list(v, path: Path, key: str) -> list[str]:
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise _bad(path, f"{key} must be a list of dotted.key=value strings, got {v!r}")
    for x in v:
        if "=" not in x:
            raise _bad(path, f"{key}: {x!r} is not dotted.key=value")
    return list(v)


def _seed_list(v, path: Path, key: str) -> list[int]:
    if not isinstance(v, list) or not v or not all(is_int(x) for x in v):
        raise _bad(path, f"{key} must be a non-empty list of integers, got {v!r}")
    return list(dict.fromkeys(v))


def _unknown(d: dict, allowed, path: Path, where: str, none_allowed: str = "none") -> None:
    import difflib

    for k in d:
        if k not in allowed:
            close = difflib.get_close_matches(str(k), allowed, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise _bad(path, f"unknown key {where}{k}{hint}; allowed: {', '.join(allowed) or none_allowed}")


PORT = "an integer port 1-65535"  # also launch.run's --master_port/--ssh_port


def is_port(v) -> bool:
    return is_int(v, 1) and v <= 65535


def _check_options(o: dict, launcher: str, path: Path) -> None:
    """Types and ranges of launcher_options, before any command is built from them (an sbatch_args
    string would be split into characters, num_nodes 0 would be a world of 0 ranks)."""
    rules = {"num_nodes": (lambda v: is_int(v, 1), "an integer >= 1"),
             "num_gpus": ((lambda v: is_int(v, 0), "an integer >= 0 (0: a partition without GPUs, nproc "
                           "ranks per node)") if launcher == "slurm" else (lambda v: is_int(v, 1),
                                                                          "an integer >= 1 (processes per node)")),
             "master_port": (is_port, PORT),
             "ssh_port": (is_port, PORT),
             "launcher_args": (lambda v: isinstance(v, str), "one string of options for pdsh/mpirun"),
             "hostfile": (lambda v: isinstance(v, str) and v != "", "a path"),
             "master_addr": (lambda v: isinstance(v, str) and v != "", "a host name or address"),
             "script": (lambda v: isinstance(v, str) and Path(v).is_file(), "an existing sbatch script"),
             "sbatch_args": (lambda v: isinstance(v, list) and all(isinstance(a, str) for a in v),
                             'a list of strings, e.g. ["--partition=gpu", "--time=12:00:00"]'),
             "submit": (lambda v: isinstance(v, bool), "true or false"),
             "env": (lambda v: isinstance(v, dict) and all(
                         isinstance(k, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)
                         and (isinstance(x, str) or is_number(x)) for k, x in v.items()),
                     "a mapping of shell variable names to strings or numbers")}
    for k, v in o.items():
        ok, allowed = rules[k]
        if not ok(v):
            raise _bad(path, f"launcher_options.{k}={v!r}: {allowed}")


def load_experiment(path: str | os.PathLike, runs_dir: str | None = None) -> Experiment:
    """runs_dir (`--runs-dir`) replaces the experiment's runs_dir and its report_dir."""
    from mode.rundir import check_place

    path = Path(user_path(str(path), "EXPERIMENT"))  # paths in YAML get `~` expanded here: no shell expands them
    if not path.is_file():
        raise ConfigError("EXPERIMENT", str(path), "an existing experiment YAML file")
    try:
        raw = parse_yaml(path.read_bytes().decode("utf-8")) or {}  # a duplicated key (variant) is refused
    except UnicodeDecodeError as e:
        raise _bad(path, f"not UTF-8 text (byte {e.start}); an experiment YAML is expected")
    except yaml.YAMLError as e:
        raise _bad(path, f"not valid YAML ({' '.join(str(e).split())})")
    if not isinstance(raw, dict):
        raise _bad(path, "the top level must be a mapping")
    _unknown(raw, EXPERIMENT_KEYS, path, "")
    for key in ("name", "runs_dir", "report_dir"):  # a list or number would become a directory named "['a']"
        if raw.get(key) is not None and not isinstance(raw[key], str):
            raise _bad(path, f"{key}={raw[key]!r}: a string (it names a directory)")
    launcher = raw.get("launcher", "local")
    if launcher not in LAUNCHERS:
        raise _bad(path, f"launcher={launcher!r}: one of {', '.join(LAUNCHERS)}")
    options = raw.get("launcher_options") or {}
    if not isinstance(options, dict):
        raise _bad(path, "launcher_options must be a mapping")
    options = {k: user_path(v, f"launcher_options.{k}") if k in ("hostfile", "script") and isinstance(v, str) else v
               for k, v in options.items()}
    _unknown(options, LAUNCHER_OPTIONS[launcher], path, "launcher_options.",
             f"none with launcher {launcher} (ranks per node: nproc)")
    _check_options(options, launcher, path)
    nproc = raw.get("nproc", 1)
    if not is_int(nproc, 1) or nproc > MAX_NPROC:
        raise _bad(path, f"nproc={nproc!r}: an integer 1-{MAX_NPROC} (ranks per node)")
    variants = raw.get("variants")
    if not isinstance(variants, dict) or not variants:
        raise _bad(path, "variants must be a non-empty mapping of name -> {config: ..., overrides: [...]}")
    for name, v in variants.items():
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise _bad(path, f"variant name {name!r}: letters, digits, _ . - (it names a directory)")
        if not isinstance(v, dict) or "config" not in v:
            raise _bad(path, f"variants.{name} must be a mapping with a `config:` path")
        _unknown(v, VARIANT_KEYS, path, f"variants.{name}.")
    match = raw.get("match_flops") or {}
    if not isinstance(match, dict):
        raise _bad(path, f"match_flops={match!r}: a mapping {{variants: [a, b, ...], tolerance: 0.02}}")
    if match:  # a misspelled key or variant would silently switch the FLOP guard off
        _unknown(match, ("variants", "tolerance"), path, "match_flops.")
        names = match.get("variants")
        if not (isinstance(names, list) and all(isinstance(n, str) and n in variants for n in names)
                and len(set(names)) == len(names) >= 2):  # [dense, dense] would compare a variant with itself
            raise _bad(path, f"match_flops.variants={names!r}: a list of two or more of the variants, each once "
                             f"({', '.join(map(str, variants))})")
        tol = match.get("tolerance", 0.02)
        if not is_number(tol) or not 0 <= tol < 1:
            raise _bad(path, f"match_flops.tolerance={tol!r}: a fraction in [0, 1), e.g. 0.02")
    from analysis.isoflop import parse_budgets  # the one reader of `budgets:` (also `mode analyze --experiment`)

    budgets = parse_budgets(raw)
    report_dir = raw.get("report_dir")
    if runs_dir is not None:  # a rerun elsewhere: its report goes with it
        runs, report_dir = check_place(runs_dir, "--runs-dir"), None
        check_runs_dir(runs, "--runs-dir", runs_dir)
    else:  # the same refusal as a run.dir: the grid's LOCK, plan and report go there
        shown = str(raw.get("runs_dir") or f"runs/{raw.get('name') or path.stem}")
        runs = check_place(shown, "runs_dir")
        check_runs_dir(runs, "runs_dir", shown)
    if report_dir:  # checked now, not after hours of training: a file, or a user's report.md, is refused
        from analysis.outdir import check_report_dir
        from mode.rundir import REPORT, check_outside_runs, run_broken_by

        shown, report_dir = str(report_dir), user_path(str(report_dir), "report_dir")
        if run_broken_by(report_dir, REPORT) not in (None, runs.resolve()):  # runs_dir may hold reports
            check_outside_runs(shown, "report_dir", owned=REPORT)
        check_report_dir(report_dir, "report_dir", shown)
    return Experiment(path=path, name=str(raw.get("name") or path.stem), runs_dir=runs,
                      report_dir=Path(report_dir) if report_dir else None,
                      launcher=launcher, options=options, nproc=nproc,
                      seeds=_seed_list(raw.get("seeds", [0]), path, "seeds"),
                      overrides=_str_list(raw.get("overrides"), path, "overrides"), variants=variants,
                      match_flops=match, budgets=budgets)


# What `mode compare` writes into runs_dir: nothing else is ever found there unless a user put it.
PLAN = "experiment.json"  # write_plan
GRID_RUN_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*_seed\d+$")  # <variant>_seed<k>: a run directory of a grid
SLURM_FILE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*_seed\d+(\.sh|\.jobid|-\d+\.out)$")  # run_slurm, sbatch


def is_plan(path: Path) -> bool:
    """Is this file an experiment.json that write_plan wrote (so a rerun may replace it)?"""
    try:
        plan = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (isinstance(plan, dict) and set(plan) == {"experiment", "name", "launcher", "runs"}
            and isinstance(plan["runs"], list)
            and all(isinstance(r, dict) and set(r) == {"name", "variant", "seed", "config", "overrides", "dir"}
                    for r in plan["runs"]))


def not_written_by_compare(d: Path) -> list[str]:
    """The entries of runs_dir `d` that `mode compare` did not write (see _not_compares)."""
    return [why for p in sorted(d.iterdir()) if (why := _not_compares(d, p)) is not None]


def _not_compares(d: Path, p: Path) -> str | None:
    """None when entry `p` of runs_dir `d` is one `mode compare` writes: its LOCK, its plan
    (experiment.json, as write_plan writes it), slurm/ holding only its scripts, job ids and job
    logs, report directories (analysis/outdir.py: `report/` new, empty or a mode report's, or any
    directory with the report marker) and run directories `<variant>_seed<k>` that are new (empty,
    or only the SLURM job's slurm/) or mode runs (of this grid, an earlier one with other seeds or
    variants, or another grid sharing runs_dir). A runs_dir a report was written into (report_dir =
    runs_dir) may hold its files. Else how to name it."""
    from analysis.outdir import REPORT_FILES, has_marker, is_report_dir
    from mode.rundir import JOB_LOGS, LOCK, is_mode_run

    n = p.name
    if n == LOCK and p.is_file() and not p.is_symlink():
        return None
    if n == PLAN and p.is_file() and not p.is_symlink():
        return None if is_plan(p) else f"{n} (not mode compare's plan)"
    if n == f".{PLAN}.tmp" and p.is_file() and not p.is_symlink():  # a write_plan killed part-way
        return None
    if n == "slurm" and p.is_dir() and not p.is_symlink() and all(SLURM_FILE_RE.match(q.name) for q in p.iterdir()):
        return None
    if p.is_dir() and not p.is_symlink() and (has_marker(p) or (n == "report" and is_report_dir(p))):
        return None
    if GRID_RUN_RE.match(n) and p.is_dir() and not p.is_symlink():
        # new (nothing but the SLURM job's own log, as mode/rundir.py counts it) or a mode run
        return None if all(q.name == JOB_LOGS for q in p.iterdir()) or is_mode_run(p) else f"{n} (not a mode run)"
    if REPORT_FILES.match(n) and has_marker(d):
        return None
    return n


def check_outside_grids(out: str, key: str) -> None:
    """ConfigError (nothing written) when writing `out` (an export, an eval results file) would put
    an entry into a `mode compare` runs_dir that compare did not write: the grid would then be
    refused. Inside one of its runs or reports is their own writers' concern."""
    path = Path(user_path(out, key)).resolve()
    for below, d in zip((path, *path.parents), path.parents):
        try:
            if (d / PLAN).is_file() and is_plan(d / PLAN):
                if not below.exists() or _not_compares(d, below) is not None:
                    raise ConfigError(key, out, f"a path outside the mode compare runs_dir {d} (or inside one of its "
                                                "runs): a runs_dir holding anything else is refused by mode compare")
                return
        except OSError:  # unreadable: not provably a grid
            pass


def check_runs_dir(d: Path, key: str, shown: str) -> None:
    """Refuse (ConfigError, before anything is written) a runs_dir that is a file, a mode run (the
    grid's entries would stop it resuming) or holds entries mode compare did not write."""
    from mode.checkpoint import CHECKPOINTS
    from mode.rundir import check_outside_runs, existing_base
    from mode.rundir import shown as listed

    if d.exists() and not d.is_dir():
        raise ConfigError(key, shown, "a directory for the grid (this path is a file)")
    existing_base(d, key, shown)
    check_outside_runs(shown, key, below_only=True)  # a grid inside a run would stop that run resuming
    if not d.is_dir():
        return
    run = [n for n in (CHECKPOINTS, "tb", "run_info.json") if (d / n).exists()]
    if run:
        raise ConfigError(key, shown, f"a directory for the grid, not a mode run directory (it holds {', '.join(run)}"
                                      "): the grid's runs, experiment.json and LOCK would stop that run from resuming")
    foreign = not_written_by_compare(d)
    if foreign:
        raise ConfigError(key, shown, f"a new or empty directory or a mode compare runs_dir; it holds "
                                      f"{listed(foreign)}, which mode compare did not write, so it will not write a "
                                      "grid into it")


# Set by compare for each run, after every other override: a user's value would be dropped silently.
SET_PER_RUN = {"run.dir": "runs_dir: (or --runs-dir; each run is runs_dir/<variant>_seed<k>)",
               "run.name": "the variant's name", "train.seed": "seeds: (or --seeds)"}


def _not_per_run(overrides: list[str], where: str) -> None:
    for ov in overrides:
        key = ov.split("=", 1)[0].strip()
        if key in SET_PER_RUN:
            raise ConfigError(key, msg=f"{where}{ov}: set by mode compare for each run; use {SET_PER_RUN[key]} "
                                       "instead")


def expand(exp: Experiment, only: list[str] | None = None, extra: list[str] | None = None) -> list[GridRun]:
    """variants x seeds -> runs (experiment order, seeds ascending as listed)."""
    _not_per_run(exp.overrides, f"experiment {exp.path}: overrides: ")
    _not_per_run(extra or [], "")
    if only:
        unknown = [v for v in only if v not in exp.variants]
        if unknown:
            raise ConfigError("--only", msg=f"--only {' '.join(unknown)}: not a variant of {exp.path} "
                              f"(variants: {', '.join(exp.variants)})")
    runs = []
    for name, v in exp.variants.items():
        if only and name not in only:
            continue
        seeds = _seed_list(v["seeds"], exp.path, f"variants.{name}.seeds") if "seeds" in v else exp.seeds
        config = v["config"]
        if not isinstance(config, str):
            raise _bad(exp.path, f"variants.{name}.config must be a path")
        cfg_path = (exp.path.parent / user_path(config, f"variants.{name}.config")).resolve()
        own = _str_list(v.get("overrides"), exp.path, f"variants.{name}.overrides")
        _not_per_run(own, f"experiment {exp.path}: variants.{name}.overrides: ")
        for s in seeds:
            run_dir = exp.runs_dir / f"{name}_seed{s}"
            ov = [*exp.overrides, *own, *(extra or []), f"run.dir={run_dir}", f"run.name={name}", f"train.seed={s}"]
            runs.append(GridRun(variant=name, seed=s, config=str(cfg_path), overrides=ov))
    return runs


# ----------------------------------------------------------------------------------------------
# Launch commands.


def _launch():
    """launch/run.py: the one place that knows how to call the DeepSpeed launcher."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import launch.run as lr

    return lr


def world_size(exp: Experiment) -> int:
    o = exp.options
    if exp.launcher == "local":
        return exp.nproc
    if exp.launcher == "slurm":
        return int(o.get("num_nodes", 1)) * slurm_ranks_per_node(exp)
    lr = _launch()
    hostfile = o.get("hostfile")
    return lr.world_size("deepspeed", hostfile, int(o.get("num_nodes", -1)),
                         int(o.get("num_gpus", -1 if hostfile else exp.nproc)))


def child_env(exp: Experiment) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("PYTHONUNBUFFERED", "1")
    import torch

    # slurm: the job's nodes decide (launch/run.py on each node), not this machine: a login node
    # without GPUs must not write DS_ACCELERATOR=cpu into the jobs of a GPU partition.
    if not torch.cuda.is_available() and exp.launcher != "slurm":
        env.setdefault("DS_ACCELERATOR", "cpu")
        if exp.launcher == "local" and exp.nproc > 1:
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // exp.nproc)))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):  # a nested run must not join our group
        env.pop(k, None)
    env["MODE_WATCH_PARENT"] = "1"  # a trainer started by compare ends with it (mode/lifeline.py)
    if exp.launcher == "slurm":  # slurm.sbatch takes it as ranks per node: the grid was validated for these
        env["GPUS_PER_NODE"] = str(slurm_ranks_per_node(exp))
    return env


def command(exp: Experiment, run: GridRun) -> list[str]:
    o, py = exp.options, sys.executable
    if exp.launcher == "local":
        if exp.nproc == 1:
            return [py, "-m", "mode.cli", "train", "--config", run.config, *run.overrides]
        from mode.engine import free_port

        return _launch().deepspeed_command(run.config, run.overrides, num_gpus=exp.nproc, master_port=free_port())
    if exp.launcher == "deepspeed":
        cmd = [py, "-m", "launch.run", "--launcher", "deepspeed"]
        for k in ("hostfile", "num_nodes", "num_gpus", "master_addr", "master_port", "ssh_port", "launcher_args"):
            if o.get(k) is not None:  # --launcher_args=-S: a separate "-S" would be read as an option
                cmd += [f"--{k}={o[k]}"] if k == "launcher_args" else [f"--{k}", str(o[k])]
        if "num_gpus" not in o and "hostfile" not in o:
            cmd += ["--num_gpus", str(exp.nproc)]
        if "hostfile" not in o and "master_port" not in o:
            # one node: a free port, so two grids (or a grid and a `deepspeed` job) on one machine
            # do not both take DeepSpeed's 29500; several nodes must agree on theirs. (MASTER_PORT is
            # not passed on: child_env drops it, a nested run must not join our group.)
            from mode.engine import free_port

            cmd += ["--master_port", str(free_port())]
        for k, v in (o.get("env") or {}).items():
            cmd += ["--env", f"{k}={v}"]
        return cmd + ["--config", run.config, *run.overrides]
    # slurm: ranks per node = GPUs per node, or tasks per node on a partition without GPUs
    logs = exp.runs_dir.resolve() / "slurm"
    gpus = int(o.get("num_gpus", exp.nproc))
    ranks = [f"--gpus-per-node={gpus}"] if gpus > 0 else [f"--ntasks-per-node={exp.nproc}"]
    cmd = ["sbatch", f"--job-name={exp.name}-{run.name}", f"--output={logs}/{run.name}-%j.out", "--open-mode=append",
           f"--nodes={int(o.get('num_nodes', 1))}", *ranks, *[str(a) for a in o.get("sbatch_args") or []],
           "--parsable", str(o.get("script", ROOT / "launch" / "slurm.sbatch"))]
    return cmd + ["--config", run.config, *run.overrides]


def slurm_ranks_per_node(exp: Experiment) -> int:
    gpus = int(exp.options.get("num_gpus", exp.nproc))
    return gpus if gpus > 0 else exp.nproc


# ----------------------------------------------------------------------------------------------
# Validation and status.


def validate(exp: Experiment, runs: list[GridRun], prepare_data: bool = True, extra: list[str] | None = None) -> None:
    """Resolve and preflight every run before any starts; a failure names the variant and seed.
    `prepare_data=False` (--dry-run): the same data checks, nothing prepared or written. `extra`:
    the command-line overrides, for the match_flops variants that --only leaves out."""
    from mode.config import load_config
    from mode.train import check_world, finished, preflight

    world = world_size(exp)
    # Every run is checked before any data is prepared (a later variant's bad value must not wait
    # for, or follow, an earlier one's prepare), then the data is prepared.
    for prepare in (False, True) if prepare_data else (False,):
        for r in runs:
            try:
                if not prepare:
                    r.cfg = load_config(r.config, r.overrides, world_size=world)
                # slurm: the writer holding the lock may be this grid's own job, which a rerun waits for
                preflight(r.cfg, lock=slurm_active_job(exp, r) is None, prepare_data=prepare)
                if not prepare:  # once: a done run's checkpoint is hashed whole to be called done
                    r.status, r.resume_step = status(r)
                    if r.status != "done" and finished(r.cfg) is None:  # as launch.run: else refused at its start
                        check_world(r.cfg, world)
            except ConfigError as e:
                # a grid's runs live under runs_dir, so the way out of a run.dir clash is another --runs-dir
                text = str(e).removeprefix("config error: ").replace("another run.dir", "another --runs-dir")
                raise ConfigError("variant", msg=f"variant {r.variant} (seed {r.seed}, {r.config}): {text}") from None
        if not prepare:
            check_matched_flops(exp, [*runs, *_matched_left_out(exp, runs, extra, world)])
            if any(r.status != "done" for r in runs):  # a grid all done launches nothing
                check_launch_hosts(exp)


def check_launch_hosts(exp: Experiment) -> None:
    """launch.run's host checks of a deepspeed grid with a hostfile, before each run fails them at its
    start. Its runs go over pdsh (compare passes no --no_ssh and no other backend)."""
    o = exp.options
    if exp.launcher == "deepspeed" and o.get("hostfile"):
        lr = _launch()
        nodes = lr.plan_nodes(o["hostfile"], int(o.get("num_nodes", -1)), int(o.get("num_gpus", -1)))
        lr.check_hosts(o["hostfile"], nodes, o.get("master_addr"), pdsh=len(nodes) > 1,
                       keys=("launcher_options.hostfile", "launcher_options.master_addr"))


def _matched_left_out(exp: Experiment, runs: list[GridRun], extra: list[str] | None, world: int) -> list[GridRun]:
    """One run of each match_flops variant that --only leaves out, with the same command-line
    overrides: a selected variant retuned on the command line is still checked against the others."""
    from mode.config import load_config

    names, have, out = exp.match_flops.get("variants", []), {r.variant for r in runs}, {}
    for r in expand(exp, None, extra):
        if r.variant in names and r.variant not in have | out.keys():
            try:
                r.cfg = load_config(r.config, r.overrides, world_size=world)
            except ConfigError as e:
                raise ConfigError("variant", msg=f"variant {r.variant} (left out by --only; match_flops compares it): "
                                  f"{str(e).removeprefix('config error: ')}") from None
            out[r.variant] = r
    return list(out.values())


def check_matched_flops(exp: Experiment, runs: list[GridRun]) -> dict[str, float]:
    """`match_flops: {variants: [a, b, ...], tolerance: 0.02}` promises those variants the same
    forward FLOPs per token (as `mode flops` counts them); refuse the grid if it does not hold."""
    from mode.flops import count

    flops = {r.variant: count(r.cfg)["forward_flops_per_token"] for r in runs}
    names = [v for v in exp.match_flops.get("variants", []) if v in flops]
    tol = float(exp.match_flops.get("tolerance", 0.02))
    if names:
        lo, hi = min(flops[v] for v in names), max(flops[v] for v in names)
        if hi > lo * (1 + tol):
            detail = ", ".join(f"{v}={flops[v]:.4g}" for v in names)
            raise ConfigError("match_flops", msg=f"match_flops: forward FLOPs/token differ by {hi / lo - 1:.1%} "
                              f"> {tol:.0%} ({detail}); retune the variants' knobs (mode flops --match)")
    return flops


def status(run: GridRun, ran: bool = False) -> tuple[str, int]:
    """("new" | "resume" | "done", step). `ran`: asked after the run's trainer (or its job) ran, when
    run.fresh, applied by that start, no longer says what the directory holds (a fresh grid's
    finished runs were reported as "exited 0 without finishing the run (no checkpoint)")."""
    from mode import checkpoint as ckpt

    d = run.dir
    if run.cfg.run.fresh and not ran:  # the trainer deletes the directory and starts over
        return "new", 0
    step = ckpt.latest_step(d)
    if step is None:
        return "new", 0
    # the trainer's own rule (mode.train.finished): finished = DONE and an intact checkpoint at max_steps
    # (a damaged one: the trainer's start reports it and falls back, so it is a run to resume)
    done = (d / "DONE").exists() and step >= run.cfg.train.max_steps
    return ("done", step) if done and ckpt.verify(ckpt.latest(ckpt.checkpoints_dir(d))) is None else ("resume", step)


def resume_hint(run: GridRun, rc: int = 1) -> str:
    # with run.fresh=true (on the command line or in the experiment) the same command would delete
    # the runs again, this one's progress included: a last override turns it off
    cmd = "the same command with run.fresh=false added" if run.cfg.run.fresh else "the same command"
    if rc == 3:  # mode.train's exit on non-finite values: a plain resume replays the same steps
        return (f"it stopped on a non-finite loss or gradient (its message is above); invoke {cmd} to resume it from "
                "its last checkpoint, where the same steps are likely to meet it again unless a setting changes "
                "(train.nonfinite=skip steps past them)")
    if rc == 2:  # a config error (one line, above), refused before anything trained: nothing to resume
        return f"it was refused before training (its message is above); correct that, then invoke {cmd}"
    return f"invoke {cmd}{'' if run.cfg.run.fresh else ' again'} to resume it"


def describe(run: GridRun) -> str:
    if run.status == "done":
        return "done, skipped"
    if run.status == "resume":
        return f"resuming from step {run.resume_step}/{run.cfg.train.max_steps}"
    return f"new run, {run.cfg.train.max_steps} steps"


# ----------------------------------------------------------------------------------------------
# Running.


# States of a job SLURM still holds (queued, held, running or stopped with its allocation). PREEMPTED is
# not one: SLURM's "job terminated due to preemption" is final (a requeued job shows REQUEUED/PENDING),
# and sacct keeps answering it, so waiting on it never ended.
SLURM_ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                "RESIZING", "SUSPENDED", "STAGE_OUT", "SIGNALING", "STOPPED", "SPECIAL_EXIT", "RESV_DEL_HOLD")
# slurm_job_state's answer when SLURM's controller did not answer: the job may still run, so it is
# waited for and never resubmitted (a second job would train the same run.dir).
UNREACHABLE = "UNREACHABLE"
SLURM_HELD = (*SLURM_ACTIVE, UNREACHABLE)
SECRET_RE = re.compile(r"TOKEN|SECRET|PASSWORD|KEY", re.I)  # never written into a script file


def slurm_job_state(job: str) -> str:
    """The job's state: squeue while SLURM holds it, then scontrol (until MinJobAge) or sacct;
    UNKNOWN when none of them knows the job any more, UNREACHABLE when squeue or scontrol failed
    otherwise (e.g. "Socket timed out": the controller is down or busy, the job may be running)."""
    unreachable = False
    for cmd, pick in ((["squeue", "-h", "-j", job, "-o", "%T"], lambda out: out.split()[0]),
                      (["scontrol", "show", "job", "-o", job], lambda out: re.search(r"JobState=(\S+)", out)[1]),
                      (["sacct", "-n", "-X", "-P", "-j", job, "-o", "State"], lambda out: out.split()[0])):
        if shutil.which(cmd[0]) is None:
            continue
        r = subprocess.run(cmd, capture_output=True, text=True)
        try:
            if r.returncode == 0 and r.stdout.strip():
                return pick(r.stdout.strip())
        except (IndexError, TypeError):
            pass
        # "Invalid job id": the tool no longer knows the job. sacct fails without accounting: no answer.
        unreachable |= r.returncode != 0 and cmd[0] != "sacct" and "invalid job id" not in r.stderr.lower()
    return UNREACHABLE if unreachable else "UNKNOWN"


# Pending reasons of a job its partition cannot run as submitted: SLURM keeps it queued regardless.
NEVER_STARTS = ("PartitionNodeLimit", "PartitionConfig", "PartitionTimeLimit", "BadConstraints")


def slurm_pending_reason(job: str) -> str:
    """Why SLURM keeps a job pending (squeue's %r: Resources, Priority, PartitionNodeLimit, ...)."""
    r = subprocess.run(["squeue", "-h", "-j", job, "-o", "%r"], capture_output=True, text=True)
    reason = r.stdout.strip() if r.returncode == 0 else ""
    hint = "; this partition cannot run it as submitted: scancel it, fix sbatch_args" if reason in NEVER_STARTS else ""
    return f" (reason: {reason}{hint})" if reason and reason != "None" else ""


def slurm_active_job(exp: Experiment, run: GridRun) -> str | None:
    """The job recorded for this run (runs_dir/slurm/<run>.jobid) if SLURM still holds it queued or running."""
    if exp.launcher != "slurm":
        return None
    job_file = exp.runs_dir / "slurm" / f"{run.name}.jobid"
    job = job_file.read_text().strip() if job_file.is_file() else ""
    return job if job and slurm_job_state(job) in SLURM_HELD else None


def slurm_script(exp: Experiment, run: GridRun, env: dict) -> str:
    """A submit script that replays this submission: cwd, interpreter, environment, sbatch line."""
    lr = _launch()
    named = ("PATH", "VIRTUAL_ENV", "SLURM_CONF", "PYTHONUNBUFFERED", "GPUS_PER_NODE")
    keep = {k: v for k, v in env.items()
            if (k.startswith(lr.PASS_PREFIXES) or k in named) and not SECRET_RE.search(k) and "\n" not in v}
    keep.update({k: str(v) for k, v in (exp.options.get("env") or {}).items()})
    keep.update(PYTHON=sys.executable, MODE_ROOT=str(ROOT))
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(keep.items()))
    job_file = shlex.quote(str(exp.runs_dir.resolve() / "slurm" / f"{run.name}.jobid"))
    return (f"#!/usr/bin/env bash\n# {run.name}: {describe(run)}. Written by `mode compare {exp.path}`;\n"
            f"# running it submits the run again, records the job id where `mode compare --wait` looks for\n"
            f"# it and prints it.\nset -euo pipefail\n"
            f"cd {shlex.quote(os.getcwd())}\n{exports}job=$({shlex.join(command(exp, run))})\n"
            f"printf '%s\\n' \"${{job%%;*}}\" > {job_file}\nprintf '%s\\n' \"$job\"\n")


def slurm_queued_job(exp: Experiment, run: GridRun) -> str | None:
    """A job SLURM holds for this run though no job id was recorded: an sbatch that timed out
    ("Socket timed out", a busy controller) may have queued it all the same. Found by its name and
    told apart from another grid's same-named job by its log path (inside this grid's runs_dir)."""
    if shutil.which("squeue") is None:
        return None
    r = subprocess.run(["squeue", "-h", "--me", "-n", f"{exp.name}-{run.name}", "-o", "%i"], capture_output=True,
                       text=True)
    for job in r.stdout.split() if r.returncode == 0 else []:
        out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
        if f"StdOut={_slurm_log(exp, run, job)}" in out.split():
            return job
    return None


def _slurm_log(exp: Experiment, run: GridRun, job: str) -> Path:
    return exp.runs_dir.resolve() / "slurm" / f"{run.name}-{job}.out"


def _stopped_as_asked(run: GridRun, state: str) -> bool:
    """A job that COMPLETED at the run's train.stop_at did what it was asked (as with the local launcher).
    Reads the run's state first: run.status and run.resume_step are current afterwards."""
    run.status, run.resume_step = status(run, ran=True)
    stop = run.cfg.train.stop_at
    run.extra["stopped"] = state == "COMPLETED" and run.status == "resume" and stop > 0 and run.resume_step == stop
    return run.extra["stopped"]


def _unfinished(exp: Experiment, run: GridRun, job: str, state: str) -> str:
    run.status, run.resume_step = status(run, ran=True)
    where = f"stopped at step {run.resume_step}" if run.status == "resume" else "no checkpoint"
    return (f"{run.name}: job {job} {state} without finishing the run ({where}); log: {_slurm_log(exp, run, job)}")


def run_slurm(exp: Experiment, runs: list[GridRun], env: dict, log, resubmit: bool = False) -> tuple[dict, list[str]]:
    """Write (and, with submit: true, submit) a script per unfinished run. Returns the jobs queued or
    running ({run name: job id}) and one line per run whose last job ended without finishing it."""
    out = exp.runs_dir / "slurm"
    out.mkdir(parents=True, exist_ok=True)
    active, failed = {}, []
    for i, r in enumerate(runs, 1):
        tag = f"[{i}/{len(runs)}] {r.name}"
        if r.status == "done":
            log(f"{tag}: {describe(r)}")
            continue
        script = out / f"{r.name}.sh"
        script.write_text(slurm_script(exp, r, env))
        script.chmod(0o755)
        job_file = out / f"{r.name}.jobid"  # written by the script (also when the user runs it)
        job = job_file.read_text().strip() if job_file.is_file() else ""
        if not job and exp.options.get("submit") and (job := slurm_queued_job(exp, r) or ""):
            job_file.write_text(job + "\n")
            log(f"{tag}: found job {job} queued for it without a recorded id (an earlier sbatch that timed out); "
                "adopted, not submitted again")
        if job:
            state = slurm_job_state(job)
            if state in SLURM_HELD:
                log(f"{tag}: job {job} is queued or running ({state})" if state != UNREACHABLE else
                    f"{tag}: SLURM did not answer about job {job} (squeue/scontrol failed): taken as queued or "
                    "running, not submitted again")
                active[r.name] = job
                continue
            r.status, r.resume_step = status(r, ran=True)  # validate() looked while the job ran: finished since?
            if r.status == "done":
                log(f"{tag}: done (job {job} {state})")
                continue
            if not resubmit and _stopped_as_asked(r, state):
                log(f"{tag}: job {job} stopped it at step {r.resume_step} (train.stop_at)")
                continue
            if not resubmit:
                failed.append(_unfinished(exp, r, job, state))
                log(f"{tag}: job {job} ended ({state}) without finishing the run; not resubmitted "
                    "(--resubmit submits it again)")
                continue
        if not exp.options.get("submit"):
            log(f"{tag}: {describe(r)}; submit with: bash {script}")
            continue
        res = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
        if res.returncode != 0 or not res.stdout.strip():
            job = slurm_queued_job(exp, r)  # a timeout after the controller queued it: the job exists
            if job is None:
                raise RuntimeError(f"{r.name}: sbatch failed ({res.returncode}): {res.stderr.strip()}; if SLURM "
                                   f"queued it all the same (a timeout), the next `mode compare` finds it by its "
                                   f"name {exp.name}-{r.name} and does not submit it again")
            log(f"{tag}: sbatch said it failed ({res.stderr.strip()[:200]}), yet SLURM holds job {job} for it: adopted")
        else:
            job = res.stdout.strip().splitlines()[-1].split(";")[0]
        job_file.write_text(job + "\n")  # the script wrote it too: this process reads what sbatch said
        active[r.name] = job
        log(f"{tag}: submitted job {job} ({describe(r)}); log: {_slurm_log(exp, r, job)}")
    return active, failed


def wait_slurm(exp: Experiment, runs: list[GridRun], active: dict, log, poll_s: float) -> list[str]:
    """Poll until every job has left the queue; one line per run that its job did not finish."""
    by_name = {r.name: r for r in runs}
    last: dict[str, str] = {}
    failed = []
    while active:
        for name, job in list(active.items()):
            state = slurm_job_state(job)
            shown = state + (slurm_pending_reason(job) if state == "PENDING" else "")
            if shown != last.get(name):
                log(f"{name}: job {job} {shown}" + (" (SLURM did not answer: squeue/scontrol failed; polling "
                                                    "again, the job may still run)" if state == UNREACHABLE else ""))
                last[name] = shown
            if state in SLURM_HELD:
                continue
            del active[name]
            r = by_name[name]
            if _stopped_as_asked(r, state):
                log(f"{name}: stopped at step {r.resume_step} (train.stop_at)")
            elif r.status != "done":
                failed.append(_unfinished(exp, r, job, state))
        if active:
            time.sleep(poll_s)
    return failed


class Stopped(Exception):
    def __init__(self, signum: int):
        self.signum = signum


def _raise_stopped(signum, frame):
    raise Stopped(signum)


def run_one(exp: Experiment, run: GridRun, env: dict) -> int:
    """Run one job in its own process group; SIGTERM/SIGINT to compare stop the whole job (launcher
    and ranks): a stopped compare leaves no trainer behind. Returns the exit code (128 + signal)."""
    proc = subprocess.Popen(command(exp, run), env=env, start_new_session=True)  # the run's bar passes through
    try:
        return proc.wait()
    except (Stopped, KeyboardInterrupt) as e:
        sig = e.signum if isinstance(e, Stopped) else signal.SIGINT
        print(f"stopping {run.name} (signal {signal.Signals(sig).name}); {resume_hint(run)}",
              file=sys.stderr, flush=True)
        for s, wait in ((sig, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, s)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        return 128 + int(sig)


def report(exp: Experiment) -> Path:
    from analysis.report import analyze

    return Path(analyze(exp.runs_dir, exp.report_dir, exp.budgets))


def write_plan(exp: Experiment, runs: list[GridRun]) -> None:
    """experiment.json: each run's config and overrides as last started. A run already finished keeps
    its entry (a rerun with another execution key, e.g. train.log_every, skips it: it was not
    trained with that)."""
    exp.runs_dir.mkdir(parents=True, exist_ok=True)
    path = exp.runs_dir / PLAN
    before = {e["name"]: e for e in json.loads(path.read_text())["runs"]} if is_plan(path) else {}
    entries = [{"name": r.name, "variant": r.variant, "seed": r.seed, "config": r.config,
                "overrides": r.overrides, "dir": str(r.dir)} for r in runs]
    plan = {"experiment": str(exp.path), "name": exp.name, "launcher": exp.launcher,
            "runs": [before.get(e["name"], e) if r.status == "done" else e for r, e in zip(runs, entries)]}
    from mode.rundir import write_atomic

    write_atomic(path, json.dumps(plan, indent=1) + "\n")  # whole or not at all: a torn plan blocks the grid


def main(argv=None) -> int:
    from mode.errors import OneLineParser  # bad options: one line, exit 2

    p = OneLineParser(prog="mode compare", description="Run an experiment grid, then write its report.",
                      epilog="Invoking it again skips finished runs and resumes interrupted ones.")
    p.add_argument("experiment", metavar="EXPERIMENT.yaml", nargs="?")  # required: checked below
    p.add_argument("--dry-run", action="store_true", help="validate every run and print the plan; start nothing")
    p.add_argument("--only", nargs="+", metavar="VARIANT", default=None, help="run only these variants")
    p.add_argument("--runs-dir", default=None, help="override the experiment's runs_dir (e.g. a longer rerun)")
    p.add_argument("--seeds", default=None, metavar="0,1,...", help="override every variant's seeds (comma-separated)")
    p.add_argument("--wait", action=argparse.BooleanOptionalAction, default=None,
                   help="launcher slurm: poll the jobs and write the report when they finish (default: when "
                        "stdin is a terminal)")
    p.add_argument("--poll", type=float, default=30.0, metavar="SECONDS", help="seconds between polls with --wait")
    p.add_argument("--resubmit", action="store_true",
                   help="launcher slurm: submit again the runs whose job ended without finishing them")
    p.add_argument("overrides", nargs="*", default=[], metavar="dotted.key=value",  # a default: not "required"
                   help="applied to every run")
    argv = list(sys.argv[1:] if argv is None else argv)
    a = p.parse_intermixed_args(argv)  # overrides may come before or after the options
    # `--only dense mod EXP.yaml k=v`: nargs="+" takes every word after --only, and the first
    # override may then fill EXPERIMENT.yaml; give back what is not a variant
    words = [*([a.experiment] if a.experiment else []), *a.overrides, *(a.only or [])]
    yaml = [v for v in a.only or [] if v.endswith((".yaml", ".yml"))]
    misplaced = a.experiment is None or "=" in a.experiment and not a.experiment.endswith((".yaml", ".yml"))
    if misplaced and len(yaml) == 1:
        a.experiment = yaml[0]
    elif a.experiment is None:
        p.error("the following arguments are required: EXPERIMENT.yaml")
    only = [v for v in a.only or [] if "=" not in v and v != a.experiment] or None
    # in command-line order: of a key given twice, the last value wins (as in `mode train`)
    extra = sorted((w for w in words if "=" in w and w != a.experiment),
                   key=lambda w: argv.index(w) if w in argv else len(argv))
    a.overrides, a.only = extra, only  # as again_command repeats them

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        if not (a.poll > 0 and math.isfinite(a.poll)):  # time.sleep(-1) raised after the first poll
            raise ConfigError("--poll", a.poll, "a positive number of seconds")
        exp = load_experiment(a.experiment, a.runs_dir)
        if a.seeds:
            try:
                seeds = [int(x) for x in a.seeds.split(",")]
            except ValueError:
                raise ConfigError("--seeds", a.seeds, "comma-separated integers, e.g. 0,1,2") from None
            exp.seeds = _seed_list(seeds, exp.path, "--seeds")
            for v in exp.variants.values():
                v.pop("seeds", None)
        runs = expand(exp, only, extra)
        if not a.dry_run:
            from mode.rundir import check_lock

            check_lock(exp.runs_dir, key="runs_dir")  # name the other compare, not its trainer
        validate(exp, runs, prepare_data=not a.dry_run, extra=extra)  # a dry run on a login node streams no corpus
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    n = len(runs)
    todo = sum(r.status != "done" for r in runs)
    log(f"experiment {exp.name}: {n} runs ({todo} to run) in {exp.runs_dir}, launcher {exp.launcher}")
    env = child_env(exp)
    # a trainer stopped at train.stop_at names the command that continues it: under a grid, this one
    env["MODE_CONTINUE_COMMAND"] = again_command(a, *(["--resubmit"] if exp.launcher == "slurm" else []), stop_at=False)
    if a.dry_run:
        for i, r in enumerate(runs, 1):
            log(f"[{i}/{n}] {r.name}: {describe(r)}")
            print(shlex.join(command(exp, r)))
        return 0
    from mode import rundir

    try:  # one compare per grid: a second would start a second trainer on the same run directories
        lock = rundir.DirLock(exp.runs_dir, key="runs_dir")
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise_stopped)
    try:
        return _run_all(a, exp, runs, env, log, lock)
    except Stopped as e:
        return 128 + int(e.signum)


def again_command(a, *flags: str, stop_at: bool = True) -> str:
    """`mode compare` with the user's own grid arguments (experiment, overrides, --runs-dir, --only,
    --seeds, --poll) and `flags`: a hint without them would target the grid's default runs.
    `stop_at=False`: the command that continues stopped runs, with train.stop_at=0 in place of the
    user's (the stop may come from the experiment's overrides or a run's config file)."""
    only = a.only or []
    over = a.overrides if stop_at else [
        *(v for v in a.overrides if not v.startswith("train.stop_at=")), "train.stop_at=0"]
    cmd = ["mode", "compare", a.experiment, *over]
    if a.runs_dir is not None:
        cmd += ["--runs-dir", a.runs_dir]
    if a.seeds:
        cmd += ["--seeds", a.seeds]
    if a.poll != 30.0:
        cmd += ["--poll", f"{a.poll:g}"]
    cmd += [*flags, *(["--only", *only] if only else [])]  # last: --only takes the words after it
    return shlex.join(cmd)


def stopped_line(stopped: list[str], again: str) -> str:
    return f"{len(stopped)} run(s) stopped at train.stop_at ({', '.join(stopped)}); `{again}` continues them"


def _run_all(a, exp: Experiment, runs: list[GridRun], env: dict, log, lock) -> int:
    n = len(runs)
    todo = sum(r.status != "done" for r in runs)
    write_plan(exp, runs)

    if exp.launcher == "slurm":
        try:
            active, failed = run_slurm(exp, runs, env, log, resubmit=a.resubmit)
        except RuntimeError as e:
            log(str(e))
            return 1
        submitted = set(active)
        wait = a.wait if a.wait is not None else sys.stdin.isatty()
        if wait and active:
            log(f"waiting for {len(active)} job(s) (polling every {a.poll:g}s; Ctrl-C stops waiting, not the jobs)")
            try:
                failed += wait_slurm(exp, runs, active, log, a.poll)
            except Stopped as e:  # main() turns SIGINT/SIGTERM into Stopped
                log(f"stopped waiting; the jobs keep running (`{again_command(a, '--wait')}` waits again)")
                return 128 + int(e.signum)
        for line in failed:
            log(f"failed: {line}")
        if failed:
            log(f"{len(failed)} run(s) did not finish; no report. `{again_command(a, '--resubmit')}` resumes them")
            return 1
        pending = [r for r in runs if r.status != "done" and not r.extra.get("stopped")]
        unsubmitted = [r for r in pending if r.name not in submitted]
        if unsubmitted and not exp.options.get("submit"):  # the scripts record their job ids for --wait
            log(f"{len(unsubmitted)} run(s) not submitted (submit: false); submit the scripts above (bash "
                f"{exp.runs_dir / 'slurm'}/<run>.sh), then `{again_command(a, '--wait')}` waits for them and "
                "writes the report")
            return 0
        if pending:
            log(f"{len(pending)} run(s) not finished; `{again_command(a, '--wait')}` waits for them and "
                "writes the report")
            return 0
        stopped = [r.name for r in runs if r.extra.get("stopped")]
        if stopped:  # the report is written from what exists, as with the local launcher
            log(stopped_line(stopped, again_command(a, '--resubmit', stop_at=False)))
    else:
        t_all = time.perf_counter()
        for i, r in enumerate(runs, 1):
            log(f"[{i}/{n}] {r.name} ({r.dir}): {describe(r)}")
            if r.status == "done":
                continue
            t0 = time.perf_counter()
            rc = run_one(exp, r, env)
            dt = time.perf_counter() - t0
            if rc != 0:
                log(f"[{i}/{n}] {r.name}: failed (exit {rc}) after {dt:.0f}s; {resume_hint(r, rc)}")
                return rc if 0 < rc < 256 else 1
            r.status, r.resume_step = status(r, ran=True)
            stop = r.cfg.train.stop_at
            if r.status != "done" and not (r.status == "resume" and stop > 0 and r.resume_step >= stop):
                # exit 0 with nothing to show for it (e.g. a launcher whose remote command ran nothing)
                where = f"stopped at step {r.resume_step}" if r.status == "resume" else "no checkpoint"
                log(f"[{i}/{n}] {r.name}: exited 0 without finishing the run ({where}) after {dt:.0f}s; "
                    f"its output is above; {resume_hint(r)}")
                return 1
            state = "done" if r.status == "done" else f"stopped at step {r.resume_step} (train.stop_at)"
            log(f"[{i}/{n}] {r.name}: {state} in {dt:.0f}s")
        stopped = [r.name for r in runs if r.status != "done"]
        if stopped:  # (train.stop_at) the report is written from what exists
            log(stopped_line(stopped, again_command(a, stop_at=False)) + "; writing the report")
        elif todo:
            log(f"all runs finished in {time.perf_counter() - t_all:.0f}s; writing the report")
    try:
        path = report(exp)
    except ImportError as e:
        log(f"warning: the analysis package is not importable ({e}); runs are in {exp.runs_dir}, no report")
        return 1
    print(summary_section(path), flush=True)  # the table on the console, not only in the file
    print(f"report: {path}", flush=True)
    lock.release()
    return 0


def summary_section(report_md: Path) -> str:
    """The report's summary table (its first section), as printed at the end of `mode compare`."""
    text = Path(report_md).read_text()
    start = text.find("## Summary per variant")
    if start < 0:
        return ""
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None].strip()


if __name__ == "__main__":
    sys.exit(main())

"""`mode compare`: an experiment grid runs end to end, skips finished runs, resumes interrupted ones,
refuses a bad grid before anything starts, hands runs to the DeepSpeed and SLURM launchers, and hands
its `budgets:` to the report."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.util import PY, ROOT, TINY, env, mode_cli, mode_here, scalars

STEPS = 6


def experiment(tmp_path: Path, launcher: str = "local", **extra) -> Path:
    exp = {"name": "grid", "runs_dir": str(tmp_path / "runs"), "launcher": launcher, "nproc": 1, "seeds": [0],
           "overrides": [*TINY, f"train.max_steps={STEPS}", "train.log_every=1", "train.eval_every=3",
                         "checkpoint.every=2", "optim.warmup_steps=2"],
           "variants": {"dense": {"config": str(ROOT / "configs/tiny/dense.yaml")},
                        "mod": {"config": str(ROOT / "configs/tiny/mod.yaml"),
                                "overrides": ["model.mod.capacity=0.25"]}},
           **extra}
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(exp, sort_keys=False))
    return path


def last_line(r) -> str:
    return r.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_grid_runs_skips_finished_and_resumes_interrupted(tmp_path, capsys, monkeypatch):
    exp = experiment(tmp_path)
    runs = tmp_path / "runs"

    # An invocation that stops every run at step 4 (a time-boxed job); a report is written anyway.
    r = mode_cli("compare", exp, "train.stop_at=4")
    assert "[1/2] dense_seed0" in r.stderr and "[2/2] mod_seed0" in r.stderr
    assert "stopped at step 4" in r.stderr
    assert last_line(r) == f"report: {runs / 'report' / 'report.md'}"
    assert not (runs / "dense_seed0" / "DONE").exists()
    # bug caught: it ended with "all runs finished" and no word of how to continue them
    hint = re.search(r"2 run\(s\) stopped at train.stop_at \(dense_seed0, mod_seed0\); `(mode compare [^`]*)` "
                     "continues them", r.stderr)
    assert hint and "all runs finished" not in r.stderr, r.stderr[-3000:]
    assert shlex.split(hint.group(1)) == ["mode", "compare", str(exp), "train.stop_at=0"]
    # each trainer's own stop line names that command too, not a `mode train` of one run
    said = re.findall(r"the run resumes from its checkpoint with: (.*)", r.stdout)
    assert said == [hint.group(1)] * 2, r.stdout[-3000:]

    # The command it gives resumes both from step 4 and finishes them.
    r = mode_cli(*shlex.split(hint.group(1))[1:])
    assert r.stderr.count("resuming from step 4/6") == 2, r.stderr[-3000:]
    for name, variant in (("dense_seed0", "dense"), ("mod_seed0", "mod")):
        d = runs / name
        assert (d / "DONE").exists()
        assert list(scalars(d, "train/loss")) == list(range(1, STEPS + 1))
        cfg = yaml.safe_load((d / "config.yaml").read_text())
        assert cfg["run"]["name"] == variant and cfg["train"]["seed"] == 0 and cfg["run"]["dir"] == str(d)
    assert yaml.safe_load((runs / "mod_seed0" / "config.yaml").read_text())["model"]["mod"]["capacity"] == 0.25
    report = runs / "report" / "report.md"
    assert last_line(r) == f"report: {report}" and "dense" in report.read_text() and "mod" in report.read_text()
    # the summary table is on the console too, just before the report's path
    table = r.stdout[r.stdout.index("## Summary per variant"):r.stdout.rindex("report: ")]
    assert "| `dense` | 1 |" in table and "| `mod` | 1 |" in table and table in report.read_text()
    plan = json.loads((runs / "experiment.json").read_text())
    assert [x["name"] for x in plan["runs"]] == ["dense_seed0", "mod_seed0"]

    # Everything done: nothing is trained again (in-process: no trainer may start).
    t0 = time.monotonic()
    r = mode_here(capsys, monkeypatch, "compare", exp)
    assert r.returncode == 0 and r.stderr.count("done, skipped") == 2 and "DeepSpeed" not in r.stderr
    assert last_line(r) == f"report: {report}"
    print(f"\nsecond invocation with every run done: {time.monotonic() - t0:.1f}s")
    # bug caught: a rerun with another execution key skipped every run but wrote that key into the
    # plan (experiment.json said train.log_every=3 for runs trained with 1)
    plan = (runs / "experiment.json").read_text()
    r = mode_here(capsys, monkeypatch, "compare", exp, "train.log_every=3")
    assert r.returncode == 0 and r.stderr.count("done, skipped") == 2, r.stderr
    assert (runs / "experiment.json").read_text() == plan


@pytest.mark.slow
def test_bad_grid_is_refused_before_any_run_starts(tmp_path, capsys, monkeypatch):
    exp = experiment(tmp_path, seeds=[0, 1])
    spec = yaml.safe_load(exp.read_text())
    spec["variants"]["mod"]["overrides"] = ["model.mod.capacity=1.5"]
    exp.write_text(yaml.safe_dump(spec))
    r = mode_cli("compare", exp, check=False)
    assert r.returncode == 2
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1 and errors[0].startswith("config error: variant mod (seed 0"), r.stderr
    assert "model.mod.capacity=1.5" in errors[0] and not (tmp_path / "runs").exists()

    r = mode_here(capsys, monkeypatch, "compare", exp, "--only", "moe")  # (the process's one-line check: above)
    assert r.returncode == 2 and "config error: --only moe: not a variant" in r.stderr

    spec["variants"]["mod"] = {"confg": "x.yaml"}
    exp.write_text(yaml.safe_dump(spec))
    r = mode_here(capsys, monkeypatch, "compare", exp)
    assert r.returncode == 2 and "variants.mod must be a mapping with a `config:` path" in r.stderr


@pytest.mark.parametrize("poll", ["-1", "0", "nan", "inf"])
def test_a_poll_interval_that_is_not_positive_is_refused_first(tmp_path, capsys, monkeypatch, poll):
    """Bug caught: --poll -1 was accepted; the wait crashed at its first time.sleep, jobs submitted."""
    exp = experiment(tmp_path)
    r = mode_here(capsys, monkeypatch, "compare", exp, "--dry-run", "--poll", poll)
    assert r.returncode == 2 and r.stderr.strip() == f"config error: --poll={float(poll)!r}: a positive number of seconds"


def test_dry_run_expands_variants_and_seeds(tmp_path, capsys, monkeypatch):
    exp = experiment(tmp_path, seeds=[0, 1], nproc=2)
    r = mode_here(capsys, monkeypatch, "compare", exp, "--dry-run", "--only", "mod")
    cmds = r.stdout.strip().splitlines()
    assert len(cmds) == 2 and "[2/2] mod_seed1: new run, 6 steps" in r.stderr
    assert all("deepspeed.launcher.runner" in c and "--num_gpus 2" in c and "--module mode.train" in c for c in cmds)
    assert cmds[1].endswith(f"run.dir={tmp_path / 'runs' / 'mod_seed1'} run.name=mod train.seed=1")
    assert not (tmp_path / "runs").exists()

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=2\nnode1 slots=2\n")
    exp = experiment(tmp_path, launcher="deepspeed", launcher_options={
        "hostfile": str(hostfile), "num_nodes": 2, "num_gpus": 2, "master_port": 29511, "env": {"NCCL_DEBUG": "WARN"}})
    r = mode_here(capsys, monkeypatch, "compare", exp, "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "-m launch.run --launcher deepspeed --hostfile" in r.stdout and "--num_nodes 2 --num_gpus 2" in r.stdout
    assert "--env NCCL_DEBUG=WARN" in r.stdout


def test_dry_run_refuses_a_loopback_first_host_as_the_launch_would(tmp_path, capsys, monkeypatch):
    """Bug caught: `mode compare --dry-run` ("validate every run") passed a grid whose hostfile of
    several nodes starts with localhost; each run then failed launch.run's check at its start. The
    dry run now makes launch.run's host checks, named by the grid's keys; one node, or a master
    address, passes as there."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\nnode1 slots=2\n")
    opts = {"hostfile": str(hostfile), "num_gpus": 2, "master_port": 29511}
    r = mode_here(capsys, monkeypatch, "compare", experiment(tmp_path, launcher="deepspeed", launcher_options=opts),
                  "--dry-run")
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert r.stderr.strip() == (
        f"config error: launcher_options.hostfile={str(hostfile)!r}: a first host (node 0: the master address of "
        "the 2 nodes) the other nodes can reach; localhost is each node's own loopback: list node 0 by a name the "
        "other nodes resolve to it, or pass launcher_options.master_addr <node 0's address>"), r.stderr
    for ok in ({"master_addr": "10.0.0.1"}, {"num_nodes": 1}):
        r = mode_here(capsys, monkeypatch, "compare",
                      experiment(tmp_path, launcher="deepspeed", launcher_options={**opts, **ok}), "--dry-run")
        assert r.returncode == 0, (ok, r.stderr)


@pytest.mark.slow  # prepares the tiny corpus (a real start's checks)
def test_slurm_launcher_writes_and_submits_each_run_once(tmp_path, capsys, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "sbatch.log"
    (bin_dir / "sbatch").write_text(f"#!/usr/bin/env bash\necho \"$@\" >> {log}\necho 1000$RANDOM\n")
    (bin_dir / "squeue").write_text("#!/usr/bin/env bash\necho RUNNING\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    exp = experiment(tmp_path, launcher="slurm", launcher_options={
        "num_nodes": 2, "num_gpus": 4, "sbatch_args": ["--partition=gpu"]})
    r = mode_here(capsys, monkeypatch, "compare", exp)
    assert r.returncode == 0, r.stderr
    script = tmp_path / "runs" / "slurm" / "dense_seed0.sh"
    text = script.read_text()
    assert "sbatch --job-name=grid-dense_seed0" in text and "--nodes=2 --gpus-per-node=4 --partition=gpu" in text
    assert f"{ROOT / 'launch' / 'slurm.sbatch'} --config" in text and "run.name=dense" in text
    assert "submit with: bash" in r.stderr and not r.stdout.strip() and not log.exists()
    # submit: false submits nothing: the hint says to run the scripts (which record their job ids) first
    assert "2 run(s) not submitted (submit: false); submit the scripts above" in r.stderr, r.stderr

    spec = yaml.safe_load(exp.read_text())
    spec["launcher_options"]["submit"] = True
    exp.write_text(yaml.safe_dump(spec))
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")  # these sbatch/squeue (real SLURM: test_cluster.py)
    r = mode_here(capsys, monkeypatch, "compare", exp)
    assert r.returncode == 0 and r.stderr.count("submitted job 1000") == 2 and len(log.read_text().splitlines()) == 2
    assert "--parsable" in log.read_text()
    r = mode_here(capsys, monkeypatch, "compare", exp)
    assert r.returncode == 0 and r.stderr.count("is queued or running") == 2 and len(log.read_text().splitlines()) == 2


@pytest.mark.slow
def test_deepspeed_launcher_runs_the_grid(tmp_path):
    """launcher: deepspeed (here one node, two ranks) goes through launch/run.py."""
    exp = experiment(tmp_path, launcher="deepspeed", launcher_options={"num_gpus": 2, "env": {"MODE_TEST_VAR": "1"}})
    r = mode_cli("compare", exp, "--only", "dense", "train.max_steps=2", "train.micro_batch_size=2")
    d = tmp_path / "runs" / "dense_seed0"
    assert (d / "DONE").exists() and json.loads((d / "run_info.json").read_text())["world_size"] == 2
    assert list(scalars(d, "train/loss")) == [1, 2]
    assert last_line(r) == f"report: {tmp_path / 'runs' / 'report' / 'report.md'}"


# ----------------------------------------------------------------------------------------------
# `budgets:` (no process starts: the report is written from saved run logs).

BUDGETS = [1e12, 1e13]


def isoflop_grid(tmp_path: Path, budgets) -> tuple[Path, Path, dict[float, float]]:
    """An isoFLOP compare grid as its runs leave it: variants `dense_d<width>_c<budget>` (three sizes
    at each of two budgets, each run 15% over its budget, as sizing by rounding leaves them) with
    config.yaml, run_info.json and an eval/loss event file. Returns (experiment YAML, runs_dir,
    {budget: params of the size whose loss is lowest})."""
    from torch.utils.tensorboard import SummaryWriter

    from mode.config import load_config
    from mode.flops import count

    runs_dir = tmp_path / "runs"
    variants, best = {}, {}
    base = {d: load_config(ROOT / "configs/tiny/dense.yaml", [f"model.d_model={d}", f"model.d_ff={4 * d}"])
            for d in (64, 128, 256)}
    for c, budget in enumerate(BUDGETS):
        sizes = {}
        for d, cfg in base.items():
            name = f"dense_d{d}_c{c}"
            tokens_per_step = cfg.train.micro_batch_size * cfg.data.seq_len
            n = count(cfg)
            steps = round(1.15 * budget / (3 * n["forward_flops_per_token"] * tokens_per_step))
            over = [f"model.d_model={d}", f"model.d_ff={4 * d}", f"train.max_steps={steps}"]
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=steps),
                                      run=dataclasses.replace(cfg.run, name=name, dir=str(runs_dir / name)))
            sizes[name] = (cfg, n, tokens_per_step)
            variants[name] = {"config": str(ROOT / "configs/tiny/dense.yaml"), "overrides": over}
        mid = math.log10(sizes[f"dense_d128_c{c}"][1]["params"])
        best[budget] = sizes[f"dense_d128_c{c}"][1]["params"]
        for name, (cfg, n, tokens_per_step) in sizes.items():
            d = runs_dir / f"{name}_seed0"
            d.mkdir(parents=True)
            (d / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
            (d / "run_info.json").write_text(json.dumps({"name": name, "seed": 0, "world_size": 1,
                                                        "params": n["params"], "tokens_per_step": tokens_per_step,
                                                        "forward_flops_per_token": n["forward_flops_per_token"]}))
            w = SummaryWriter(str(d / "tb"))  # an exact parabola in log10(params), lowest at d=128
            w.add_scalar("eval/loss", 3.0 - 0.2 * c + 0.5 * (math.log10(n["params"]) - mid) ** 2, cfg.train.max_steps)
            w.close()
            (d / "DONE").write_text("{}")
    exp = tmp_path / "grid.yaml"
    exp.write_text(yaml.safe_dump({"name": "iso", "runs_dir": str(runs_dir), "variants": variants,
                                   **({"budgets": budgets} if budgets is not None else {})}))
    return exp, runs_dir, best


def isoflop_rows(report_md: Path) -> list[list[str]]:
    text = report_md.read_text()
    section = text[text.index("## isoFLOP"):].split("\n## ")[0]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in section.splitlines() if ln.startswith("| `")]


def test_budgets_of_a_compare_grid_group_the_isoflop_section_of_its_report(tmp_path, monkeypatch):
    # Bug caught: `budgets:` accepted by `mode compare` but never handed to the report (runs were
    # then grouped by clusters of their own FLOPs, 15% off the named budgets), and a second, looser
    # reader of it in `mode analyze --experiment`.
    from analysis import isoflop, report
    from analysis.tb import load_runs
    from mode import compare

    exp_path, runs_dir, best = isoflop_grid(tmp_path, [1.0e12, "1e13"])  # YAML 1.1 reads 1e13 as a string
    exp = compare.load_experiment(exp_path)
    assert exp.budgets == BUDGETS
    md = compare.report(exp)
    rows = isoflop_rows(md)
    assert [r[:2] for r in rows] == [["`dense`", "1e+12"], ["`dense`", "1e+13"]]  # one curve, the named budgets
    for r, budget in zip(rows, BUDGETS):  # the vertex of the exact parabola: the middle size
        assert float(r[2]) == pytest.approx(best[budget], rel=2e-3) and r[4] == "parabola"
    assert "`budgets: [1e+12, 1e+13]`" in md.read_text()

    # the control: without budgets the runs group under clusters of their own FLOPs
    clustered = sorted({p.budget for p in isoflop.collect_points(load_runs(runs_dir))})
    assert len(clustered) == 2 and all(1.1 < c / b < 1.2 for c, b in zip(clustered, BUDGETS))

    # `mode analyze --experiment` hands the report the same budgets
    seen = []
    monkeypatch.setattr(report, "analyze", lambda runs, out, budgets: seen.append(budgets) or md)
    assert report.main([str(runs_dir), "--experiment", str(exp_path)]) == 0
    assert seen == [BUDGETS]


@pytest.mark.parametrize("value", [-1e12, 0, [], [1e12, "lots"], True, [1e12, float("nan")], {"a": 1e12}])
def test_a_bad_budget_is_one_config_error_before_anything_runs(tmp_path, capsys, value):
    from analysis.isoflop import BUDGETS_ALLOWED
    from analysis.report import main as analyze_main
    from mode import compare

    exp = experiment(tmp_path, budgets=value)
    parsed = yaml.safe_load(exp.read_text())["budgets"]
    line = f"config error: budgets={parsed!r}: {BUDGETS_ALLOWED}"
    assert compare.main([str(exp), "--dry-run"]) == 2
    assert capsys.readouterr().err.splitlines() == [line]
    (tmp_path / "runs").mkdir()
    assert analyze_main([str(tmp_path / "runs"), "--experiment", str(exp)]) == 2
    assert capsys.readouterr().err.splitlines() == [line]
    assert list((tmp_path / "runs").iterdir()) == []  # nothing written


@pytest.mark.parametrize("launcher,key,value", [
    ("slurm", "num_nodes", 0),  # a world of 0 ranks
    ("slurm", "num_gpus", -1),  # was taken as a CPU partition
    ("slurm", "num_gpus", "abc"),  # was a ValueError traceback line
    ("slurm", "num_gpus", 1.5),  # was truncated to 1
    ("slurm", "sbatch_args", "--partition=gpu"),  # was split into characters
    ("slurm", "submit", "yes"),
    ("slurm", "env", ["A=1"]),
    ("deepspeed", "num_gpus", 0),
    ("deepspeed", "master_port", 70000),
    ("deepspeed", "env", {"NOT A NAME": "1"}),
])
def test_a_bad_launcher_option_is_one_config_error_before_anything_runs(tmp_path, capsys, launcher, key, value):
    from mode import compare

    exp = experiment(tmp_path, launcher=launcher, launcher_options={key: value})
    assert compare.main([str(exp), "--dry-run"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"config error: experiment {exp}: launcher_options.{key}={value!r}: "), err
    assert not (tmp_path / "runs").exists()


def test_a_missing_experiment_yaml_is_the_only_argument_named_required(capsys):
    """Bug caught: `mode compare --dry-run` (the YAML forgotten) said `the following arguments are
    required: EXPERIMENT.yaml, dotted.key=value`, but the overrides are optional."""
    from mode import compare

    for argv in (["--dry-run"], ["--only", "dense", "mod", "--dry-run"]):
        with pytest.raises(SystemExit) as e:
            compare.main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.splitlines()
        assert err == ["mode compare: error: the following arguments are required: EXPERIMENT.yaml"], err


@pytest.mark.parametrize("order", [
    ["--only", "mod", "EXP", "train.max_steps=4", "--dry-run"],
    ["--only", "mod", "EXP", "--dry-run", "train.max_steps=4"],  # the override filled EXPERIMENT.yaml
    ["--only", "mod", "train.max_steps=2", "--dry-run", "EXP", "train.max_steps=4"],  # the first value won
    ["EXP", "--only", "mod", "--dry-run", "train.max_steps=4"]])
def test_only_followed_by_the_experiment_yaml_runs_those_variants(tmp_path, capsys, monkeypatch, order):
    """Bugs caught: `mode compare --only mod EXP.yaml` (the flag first, as a user types it) was
    refused as if the YAML were missing (`--only` takes every word after it); with an option and an
    override after the YAML, the override was read as the experiment file; of a key given twice,
    the value written first won."""
    exp = experiment(tmp_path)
    r = mode_here(capsys, monkeypatch, "compare", *[str(exp) if w == "EXP" else w for w in order])
    assert r.returncode == 0, r.stderr
    assert re.findall(r"\] (\w+)_seed0: new run, (\d+) steps", r.stderr) == [("mod", "4")], r.stderr
    assert all(c.split(" run.dir=")[0].endswith("train.max_steps=4") for c in r.stdout.strip().splitlines()), r.stdout


def test_a_grid_run_trained_under_another_config_points_at_another_runs_dir(tmp_path, capsys, monkeypatch):
    """Bug caught: a grid rerun with a changed variant said "use another run.dir", a key a grid's
    runs do not take from the user (compare sets each run.dir under runs_dir): the way out is
    --runs-dir, which the line now names."""
    from mode.config import load_config

    exp = experiment(tmp_path)
    run = tmp_path / "runs" / "dense_seed0"
    run.mkdir(parents=True)
    old = load_config(str(ROOT / "configs/tiny/dense.yaml"), [*TINY, "optim.weight_decay=0.5", f"run.dir={run}"])
    (run / "config.yaml").write_text(yaml.safe_dump(old.to_dict()))
    (run / "run_info.json").write_text(json.dumps({"name": "dense", "seed": 0, "world_size": 1}))
    r = mode_here(capsys, monkeypatch, "compare", exp, "--dry-run")
    assert r.returncode == 2
    line = r.stderr.strip()
    assert "\n" not in line and "holds a run with a different config" in line and "optim.weight_decay" in line, line
    assert line.endswith("use another --runs-dir"), line


def test_a_launcher_option_under_launcher_local_says_none_are_allowed(tmp_path, capsys):
    """Bug caught: `launcher: local` takes no launcher_options, and the line ended in an empty
    `allowed: ` (a user who copied num_gpus from a deepspeed grid learned nothing from it)."""
    from mode import compare

    exp = experiment(tmp_path, launcher="local", launcher_options={"num_gpus": 2})
    assert compare.main([str(exp), "--dry-run"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0] == (f"config error: experiment {exp}: unknown key launcher_options.num_gpus; "
                                        "allowed: none with launcher local (ranks per node: nproc)"), err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("match,expect", [
    ({"variants": ["dense", "mdo"]}, "match_flops.variants=['dense', 'mdo']: a list of two or more of the variants"),
    ({"variants": ["dense"]}, "match_flops.variants=['dense']: a list of two or more"),
    ({"variants": ["dense", "mod"], "tolerence": 0.5}, "unknown key match_flops.tolerence (did you mean tolerance?)"),
    ({"variants": ["dense", "mod"], "tolerance": 2}, "match_flops.tolerance=2: a fraction in [0, 1)"),
    (["dense", "mod"], "match_flops=['dense', 'mod']: a mapping"),
    ({"variants": ["dense", "dense"]}, "match_flops.variants=['dense', 'dense']: a list of two or more of the "
                                       "variants, each once"),  # was accepted: dense compared with itself
    ({"variants": [["dense"], "mod"]}, "match_flops.variants=[['dense'], 'mod']: a list"),  # was a TypeError
])
def test_a_bad_match_flops_is_refused_not_skipped(tmp_path, capsys, match, expect):
    """Bug caught: an unknown variant or a misspelled key in match_flops was dropped silently, which
    switched the matched-FLOP guard off (dense vs mod here differ by far more than 2%)."""
    from mode import compare

    exp = experiment(tmp_path, match_flops=match)
    assert compare.main([str(exp), "--dry-run"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"config error: experiment {exp}: ") and expect in err[0], err
    assert not (tmp_path / "runs").exists()


def test_only_still_checks_match_flops_against_the_variants_it_leaves_out(tmp_path, capsys):
    """Bug caught: match_flops was checked over the selected runs alone, so `--only mod` with a
    command-line override that broke the match (capacity 1.0 -> 0.25 here) trained unchecked."""
    from mode import compare

    exp = experiment(tmp_path, match_flops={"variants": ["dense", "mod"], "tolerance": 0.1},
                     variants={"dense": {"config": str(ROOT / "configs/tiny/dense.yaml")},
                               "mod": {"config": str(ROOT / "configs/tiny/mod.yaml"),
                                       "overrides": ["model.mod.capacity=1.0"]}})
    for only in ([], ["--only", "mod"]):  # matched as written
        assert compare.main([str(exp), *only, "--dry-run"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert compare.main([str(exp), "--only", "mod", "--dry-run", "model.mod.capacity=0.25"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("config error: match_flops: forward FLOPs/token differ by "), err
    assert "dense=" in err[0] and "mod=" in err[0], err
    assert not (tmp_path / "runs").exists()


def test_export_and_eval_out_refuse_a_grids_runs_dir(tmp_path, capsys):
    """Bug caught: `mode export --out RUNS/x` and `mode eval --out RUNS/x.json` wrote into a compare
    runs_dir (they refused only paths inside a run), and every later `mode compare` of that grid was
    refused ("it holds x, which mode compare did not write"). Refused in one line, nothing written;
    paths beside the grid, and the grid itself, stay as they were."""
    import importlib.util

    from mode import compare
    from mode.cli import main as cli_main
    from tests.util import fake_run

    exp = experiment(tmp_path)
    ex = compare.load_experiment(str(exp), None)
    runs = compare.expand(ex)
    compare.validate(ex, runs, prepare_data=False)
    compare.write_plan(ex, runs)
    _, run = fake_run(tmp_path / "runs", "dense", name="dense_seed0")
    before = sorted((tmp_path / "runs").rglob("*"))
    outs = [["export", "--run", str(run), "--out", str(tmp_path / "runs" / "my_export")],
            ["export", "--run", str(run), "--out", str(tmp_path / "runs" / "sub" / "my_export")]]
    if importlib.util.find_spec("lm_eval"):  # the [eval] extra
        outs.append(["eval", "--run", str(run), "--tasks", "stdlib_ppl", "--out", str(tmp_path / "runs" / "r.json")])
    for argv in outs:
        assert cli_main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"config error: --out={argv[-1]!r}: a path outside the mode compare "
                                                   f"runs_dir {tmp_path / 'runs'}"), err
    assert sorted((tmp_path / "runs").rglob("*")) == before
    assert compare.not_written_by_compare(tmp_path / "runs") == []  # the grid would still be accepted
    assert cli_main(["export", "--run", str(run), "--out", str(tmp_path / "my_export")]) == 0  # beside the grid


def test_a_run_saved_at_another_world_size_is_refused_before_the_grid_starts(tmp_path, capsys):
    """Bug caught (cluster review): a grid run saved at world size 2, its grid now at 1 (nproc or
    num_gpus changed), passed validation (`--dry-run`: "resuming from step 2/6"), then its launch was
    refused at start, after compare had taken the lock and written its plan; with slurm, a FAILED job.
    Refused with the other runs' checks: one line naming the variant, nothing written."""
    from mode import checkpoint as ckpt
    from mode import compare
    from mode.config import dump_config, load_config

    exp = experiment(tmp_path)
    ex = compare.load_experiment(str(exp), None)
    [r] = compare.expand(ex, only=["dense"])
    r.cfg = load_config(r.config, r.overrides)
    r.dir.mkdir(parents=True)
    (r.dir / "config.yaml").write_text(dump_config(r.cfg))
    step = ckpt.step_dir(ckpt.checkpoints_dir(r.dir), STEPS)
    step.mkdir(parents=True)
    (step / "model.pt").write_bytes(b"weights")
    ckpt.write_manifest(step, STEPS)
    (r.dir / "run_info.json").write_text(json.dumps({"world_size": 2}))
    before = tree(tmp_path / "runs")
    assert compare.main([str(exp), "--only", "dense", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"config error: variant dense (seed 0, {r.config}): run.dir={str(r.dir)!r} was saved at world "
                   "size 2 and this launch has world size 1: resume it with 2 process(es), or start over with "
                   "run.fresh=true or another --runs-dir"], err
    assert tree(tmp_path / "runs") == before
    (r.dir / "DONE").write_text("{}")  # finished: a no-op at any world size (as for launch.run)
    assert compare.main([str(exp), "--only", "dense", "--dry-run"]) == 0
    assert "(0 to run)" in capsys.readouterr().err
    (r.dir / "DONE").unlink()
    (r.dir / "run_info.json").write_text(json.dumps({"world_size": 1}))
    assert compare.main([str(exp), "--only", "dense", "--dry-run"]) == 0
    assert f"dense_seed0: resuming from step {STEPS}/{STEPS}" in capsys.readouterr().err


def test_a_run_stopped_on_non_finite_values_is_not_called_resumable_as_is(tmp_path):
    """Bug caught: a grid run that stopped on a non-finite loss (mode.train's exit 3) was followed by
    "invoke the same command again to resume it", which replays the same steps into the same stop.
    Exit 3 says why and what changes it; other failures keep the plain hint (run.fresh: with its undo)."""
    from mode import compare

    for fresh in (False, True):
        ex = compare.load_experiment(str(experiment(tmp_path, overrides=[*TINY, f"run.fresh={fresh}"])), None)
        [r, _] = compare.expand(ex)
        compare.validate(ex, [r], prepare_data=False)
        plain = "invoke the same command with run.fresh=false added to resume it" if fresh \
            else "invoke the same command again to resume it"
        assert compare.resume_hint(r, 1) == plain
        h = compare.resume_hint(r, 3)
        assert h.startswith("it stopped on a non-finite loss or gradient") and "train.nonfinite=skip" in h, h
        assert ("run.fresh=false added" in h) is fresh, h
        # exit 2: refused before training (an unreachable ssh host, a bad key): nothing to resume, and
        # the same command alone fails the same way (it said "invoke the same command again to resume it")
        h = compare.resume_hint(r, 2)
        assert h.startswith("it was refused before training") and "resume" not in h, h
        assert ("run.fresh=false added" in h) is fresh, h


@pytest.mark.parametrize("key,value,allowed", [
    ("runs_dir", ["a"], "a string (it names a directory)"),  # was run.dir=['a']/dense_seed0
    ("runs_dir", 5, "a string (it names a directory)"),
    ("report_dir", ["r"], "a string (it names a directory)"),
    ("name", [1, 2], "a string (it names a directory)"),  # was runs_dir runs/[1, 2]
    ("name", {"a": 1}, "a string (it names a directory)"),
    ("nproc", 10**30, "an integer 1-1024 (ranks per node)"),  # only >= 1 was checked
])
def test_experiment_keys_of_the_wrong_type_are_refused(tmp_path, capsys, key, value, allowed):
    """Bug caught: a list, mapping or number as name/runs_dir/report_dir was turned into a path
    string, and any nproc >= 1 was accepted."""
    from mode import compare

    exp = experiment(tmp_path, **{key: value})
    assert compare.main([str(exp), "--dry-run"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"config error: experiment {exp}: {key}={value!r}: {allowed}"]
    assert compare.load_experiment(experiment(tmp_path, nproc=1024)).nproc == 1024


@pytest.mark.parametrize("where", ["command line", "overrides", "variant overrides"])
@pytest.mark.parametrize("ov,use", [("train.seed=5", "use seeds: (or --seeds) instead"),
                                    ("run.dir=elsewhere", "use runs_dir: (or --runs-dir;"),
                                    ("run.name=other", "use the variant's name instead")])
def test_keys_compare_sets_per_run_are_refused_not_overridden(tmp_path, capsys, where, ov, use):
    """Bug caught: `mode compare exp.yaml train.seed=5` (or run.dir=, run.name=, also in the YAML's
    overrides) ran with compare's own value, appended last (seed 0 here), and said nothing."""
    from mode import compare

    exp = experiment(tmp_path)
    args = [str(exp), "--dry-run"]
    if where == "command line":
        args.append(ov)
        prefix = ""
    elif where == "overrides":
        spec = yaml.safe_load(exp.read_text())
        spec["overrides"].append(ov)
        exp.write_text(yaml.safe_dump(spec))
        prefix = f"experiment {exp}: overrides: "
    else:
        spec = yaml.safe_load(exp.read_text())
        spec["variants"]["mod"]["overrides"].append(ov)
        exp.write_text(yaml.safe_dump(spec))
        prefix = f"experiment {exp}: variants.mod.overrides: "
    assert compare.main(args) == 2
    err = capsys.readouterr().err.splitlines()
    line = f"config error: {prefix}{ov}: set by mode compare for each run; {use}"
    assert len(err) == 1 and err[0].startswith(line), err
    assert not (tmp_path / "runs").exists()


def test_good_launcher_options_pass_the_check(tmp_path):
    from mode.compare import load_experiment

    for launcher, o in (("slurm", {"num_nodes": 2, "num_gpus": 0, "sbatch_args": ["--partition=cpu"], "submit": True,
                                   "env": {"NCCL_DEBUG": "WARN", "X": 1}}),
                        ("deepspeed", {"hostfile": "h", "num_nodes": 1, "num_gpus": 2, "master_port": 29511})):
        assert load_experiment(experiment(tmp_path, launcher=launcher, launcher_options=o)).options == o


def test_slurm_script_leaves_the_accelerator_to_the_job_nodes(tmp_path, monkeypatch):
    """`mode compare` on a login node without GPUs: the submit script must not export
    DS_ACCELERATOR=cpu (it would train a GPU partition's job on its CPUs); a value the user
    exported is kept."""
    import torch

    from mode import compare
    from mode.config import load_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    exp = compare.load_experiment(experiment(tmp_path, launcher="slurm", launcher_options={"num_gpus": 8}))
    run = compare.expand(exp)[0]
    run.cfg = load_config(run.config, run.overrides)
    assert "DS_ACCELERATOR" not in compare.slurm_script(exp, run, compare.child_env(exp))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert "export DS_ACCELERATOR=cpu\n" in compare.slurm_script(exp, run, compare.child_env(exp))
    local = compare.load_experiment(experiment(tmp_path, launcher="local", nproc=2))
    monkeypatch.delenv("DS_ACCELERATOR")
    assert compare.child_env(local)["DS_ACCELERATOR"] == "cpu"  # this machine runs the ranks


def test_slurm_jobs_get_the_grids_ranks_per_node_not_the_shells(tmp_path, monkeypatch):
    """slurm.sbatch takes GPUS_PER_NODE as ranks per node: one left in the user's shell changed the
    jobs' world size behind the grid's validation, and the replay script lacked it."""
    from mode import compare
    from mode.config import load_config

    monkeypatch.setenv("GPUS_PER_NODE", "7")
    for o, ranks in (({"num_gpus": 0}, "2"), ({"num_gpus": 4}, "4")):
        exp = compare.load_experiment(experiment(tmp_path, launcher="slurm", nproc=2, launcher_options=o))
        run = compare.expand(exp)[0]
        run.cfg = load_config(run.config, run.overrides)
        env = compare.child_env(exp)
        assert env["GPUS_PER_NODE"] == ranks
        assert f"export GPUS_PER_NODE={ranks}\n" in compare.slurm_script(exp, run, env)


def test_follow_up_hints_keep_the_users_grid_arguments(tmp_path):
    """The printed `--wait`/`--resubmit` commands name the same runs: --runs-dir, --only, --seeds and
    overrides were dropped, so following a hint targeted the grid's default runs_dir."""
    import argparse
    import shlex

    from mode import compare

    # (main() hands it the overrides in command-line order, those --only took among them)
    a = argparse.Namespace(experiment="my grid.yaml", overrides=["train.max_steps=9", "train.stop_at=4", "x.y=1"],
                           only=["dense"], runs_dir="runs/long", seeds="0,1", poll=5.0)
    hint = compare.again_command(a, "--wait")
    assert shlex.split(hint) == ["mode", "compare", "my grid.yaml", "train.max_steps=9", "train.stop_at=4", "x.y=1",
                                 "--runs-dir", "runs/long", "--seeds", "0,1", "--poll", "5", "--wait", "--only", "dense"]
    hint = compare.again_command(a, "--resubmit", stop_at=False)  # what continues runs stopped at stop_at
    assert shlex.split(hint) == ["mode", "compare", "my grid.yaml", "train.max_steps=9", "x.y=1", "train.stop_at=0", "--runs-dir",
                                 "runs/long", "--seeds", "0,1", "--poll", "5", "--resubmit", "--only", "dense"]
    b = argparse.Namespace(experiment="g.yaml", overrides=[], only=None, runs_dir=None, seeds=None, poll=30.0)
    assert compare.again_command(b, "--resubmit") == "mode compare g.yaml --resubmit"


def test_slurm_job_that_completed_at_stop_at_stopped_as_asked(tmp_path, monkeypatch):
    """A job COMPLETED at the run's train.stop_at is not a failure (it was `COMPLETED without finishing
    the run`, exit 1), neither while waiting nor when compare is invoked again; an early COMPLETED is."""
    from mode import compare
    from mode.config import load_config

    exp = compare.load_experiment(experiment(tmp_path, launcher="slurm", launcher_options={"num_gpus": 0,
                                                                                           "submit": True}))
    runs = compare.expand(exp, ["dense"], ["train.stop_at=4"])
    for r in runs:
        r.cfg = load_config(r.config, r.overrides)
    (exp.runs_dir / "slurm").mkdir(parents=True)
    (exp.runs_dir / "slurm" / "dense_seed0.jobid").write_text("12\n")
    monkeypatch.setattr(compare, "slurm_job_state", lambda job: "COMPLETED")
    for step, stopped in ((4, True), (2, False)):
        monkeypatch.setattr(compare, "status", lambda run, ran=False: ("resume", step))
        failed = compare.wait_slurm(exp, runs, {"dense_seed0": "12"}, lambda m: None, 0)
        assert (failed == []) == stopped and runs[0].extra["stopped"] == stopped, failed
        active, failed = compare.run_slurm(exp, runs, {}, lambda m: None)
        assert active == {} and (failed == []) == stopped, failed


@pytest.mark.slow  # prepares the grid's data
def test_a_local_run_that_exited_0_without_training_is_a_failure(tmp_path, monkeypatch, capsys):
    """Bug caught (cluster walkthrough): a launcher that exited 0 having trained nothing (a `#` line in
    .deepspeed_env made pdsh's remote command a comment) was reported "stopped at step 0
    (train.stop_at)" with train.stop_at unset, then the report failed on "no run directories"."""
    from mode import compare

    exp = experiment(tmp_path)
    monkeypatch.setattr(compare, "run_one", lambda exp, run, env: 0)  # the launch that ran nothing
    assert compare.main([str(exp), "--only", "dense"]) == 1
    err = capsys.readouterr().err
    assert "dense_seed0: exited 0 without finishing the run (no checkpoint)" in err and "train.stop_at" not in err, err


def test_slurm_job_that_finished_its_run_after_validation_is_not_a_failure(tmp_path, monkeypatch):
    """validate() reads each run's state while its job still runs (minutes for a big grid's data
    checks); a job that finished the run before run_slurm asked SLURM was reported `COMPLETED without
    finishing the run (no checkpoint)`, exit 1 and no report, and --resubmit submitted it again."""
    from mode import compare
    from mode.config import load_config

    exp = compare.load_experiment(experiment(tmp_path, launcher="slurm", launcher_options={"num_gpus": 0,
                                                                                           "submit": True}))
    runs = compare.expand(exp, ["dense"])
    for r in runs:
        r.cfg = load_config(r.config, r.overrides)
        r.status, r.resume_step = "resume", 2  # what validate() saw
    (exp.runs_dir / "slurm").mkdir(parents=True)
    (exp.runs_dir / "slurm" / "dense_seed0.jobid").write_text("12\n")
    monkeypatch.setattr(compare, "slurm_job_state", lambda job: "COMPLETED")
    monkeypatch.setattr(compare, "status", lambda run, ran=False: ("done", STEPS))  # what the run directory holds now
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail(f"submitted again: {a}"))
    for resubmit in (False, True):
        active, failed = compare.run_slurm(exp, runs, {}, lambda m: None, resubmit=resubmit)
        assert active == {} and failed == [] and runs[0].status == "done", failed


@pytest.mark.slow  # starts fake squeue/scontrol/sacct scripts
def test_preempted_slurm_job_is_final_and_a_stopped_or_held_one_is_not(tmp_path, monkeypatch):
    """PREEMPTED is a final state (SLURM: "terminated due to preemption"; a requeued job shows
    REQUEUED/PENDING): it was taken as queued or running, so `--wait` polled a preempted job forever
    (sacct keeps answering PREEMPTED) and reruns never reported it. STOPPED, SPECIAL_EXIT and
    RESV_DEL_HOLD jobs keep their place in the queue: taken as ended, `--resubmit` submitted a second
    job for the same run."""
    from mode import compare
    from mode.config import load_config

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text("#!/usr/bin/env bash\n")  # newer SLURM: a job it forgot prints nothing
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho 'slurm_load_jobs error: Invalid job id specified'"
                                      " >&2\nexit 1\n")
    (bin_dir / "sacct").write_text("#!/usr/bin/env bash\necho PREEMPTED\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    assert compare.slurm_job_state("12") == "PREEMPTED"

    exp = compare.load_experiment(experiment(tmp_path, launcher="slurm", launcher_options={"num_gpus": 0}))
    runs = compare.expand(exp, ["dense"])
    for r in runs:
        r.cfg = load_config(r.config, r.overrides)
    (exp.runs_dir / "slurm").mkdir(parents=True)
    (exp.runs_dir / "slurm" / "dense_seed0.jobid").write_text("12\n")
    assert compare.slurm_active_job(exp, runs[0]) is None
    monkeypatch.setattr(compare, "status", lambda run, ran=False: ("resume", 2))
    polls = []

    def state(job):
        polls.append(job)
        assert len(polls) < 5, "still waiting for a preempted job"
        return "PREEMPTED"

    monkeypatch.setattr(compare, "slurm_job_state", state)
    failed = compare.wait_slurm(exp, runs, {"dense_seed0": "12"}, lambda m: None, 0)
    assert len(failed) == 1 and "job 12 PREEMPTED without finishing the run" in failed[0], failed
    for held in ("STOPPED", "SPECIAL_EXIT", "RESV_DEL_HOLD"):
        monkeypatch.setattr(compare, "slurm_job_state", lambda job: held)
        active, failed = compare.run_slurm(exp, runs, {}, lambda m: None, resubmit=True)
        assert active == {"dense_seed0": "12"} and failed == [], (held, active, failed)


def test_deepspeed_grid_passes_runner_options_to_the_launch_wrapper(tmp_path):
    """ssh_port and launcher_args reach launch/run.py (a cluster whose sshd is not on port 22)."""
    from mode import compare

    exp = compare.load_experiment(experiment(tmp_path, launcher="deepspeed", launcher_options={
        "hostfile": "h", "ssh_port": 2222, "launcher_args": "-R ssh", "master_addr": "n0"}))
    cmd = compare.command(exp, compare.expand(exp)[0])
    i = cmd.index("launch.run")
    assert cmd[i - 1:i + 10] == ["-m", "launch.run", "--launcher", "deepspeed", "--hostfile", "h", "--master_addr",
                                 "n0", "--ssh_port", "2222", "--launcher_args=-R ssh"], cmd
    import launch.run as lr

    a = lr.parser().parse_args(cmd[i + 1:])
    assert (a.ssh_port, a.launcher_args, a.master_addr) == (2222, "-R ssh", "n0")
    # one word starting with '-' (pdsh -S, mpirun --oversubscribe): passed as `--launcher_args -S`, every run
    # ended at once with "argument --launcher_args: expected one argument"
    for opt in ("-S", "--oversubscribe"):
        exp = compare.load_experiment(experiment(tmp_path, launcher="deepspeed", launcher_options={
            "hostfile": "h", "launcher_args": opt}))
        cmd = compare.command(exp, compare.expand(exp)[0])
        assert lr.parser().parse_args(cmd[cmd.index("launch.run") + 1:]).launcher_args == opt


@pytest.mark.slow  # starts `mode compare`
def test_ctrl_c_while_waiting_for_slurm_jobs_says_they_keep_running(tmp_path):
    """Ctrl-C in `--wait` stops the waiting, not the jobs, and says so (it exited 130 silently:
    compare's signal handler raised Stopped past the KeyboardInterrupt handler)."""

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/usr/bin/env bash\necho 4242\n")
    (bin_dir / "squeue").write_text("#!/usr/bin/env bash\necho RUNNING\n")
    (bin_dir / "scancel").write_text(f"#!/usr/bin/env bash\ntouch {tmp_path / 'cancelled'}\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    exp = experiment(tmp_path, launcher="slurm", launcher_options={"num_gpus": 0, "submit": True})
    err = tmp_path / "err.txt"
    proc = subprocess.Popen([PY, "-m", "mode.cli", "compare", str(exp), "--wait", "--poll", "0.2"], cwd=ROOT,
                            env=dict(env(1), PATH=f"{bin_dir}:{os.environ['PATH']}"), stdout=subprocess.DEVNULL,
                            stderr=open(err, "w"))
    try:
        end = time.monotonic() + 120
        while "job 4242 RUNNING" not in err.read_text():
            assert proc.poll() is None and time.monotonic() < end, err.read_text()
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    assert err.read_text().strip().splitlines()[-1] == (
        f"stopped waiting; the jobs keep running (`mode compare {exp} --poll 0.2 --wait` waits again)")
    assert not (tmp_path / "cancelled").exists()


def test_dry_run_prepares_no_data_and_the_real_run_does(tmp_path, monkeypatch):
    """`mode compare --dry-run` and `launch.run --dry-run` check the data without preparing it: on a
    cluster preset a prepare streams the hub corpus (hours, on a login node). `--validate-only`
    (slurm.sbatch, one process before the ranks) does prepare."""
    import launch.run as lr
    from mode import compare

    monkeypatch.chdir(tmp_path)  # DeepSpeed/launcher side files land here, not in the repo
    prepared = tmp_path / "prepared"
    exp = experiment(tmp_path, overrides=[*TINY, "train.max_steps=2", f"data.prepared_dir={prepared}"])
    assert compare.main([str(exp), "--dry-run"]) == 0
    cmd = [f"--config={ROOT / 'configs/tiny/dense.yaml'}", *TINY, f"data.prepared_dir={prepared}",
           f"run.dir={tmp_path / 'run'}"]
    assert lr.main(["--num_gpus", "2", "--dry-run", *cmd]) == 0
    assert not prepared.exists() and not (tmp_path / "runs").exists() and not (tmp_path / "run").exists()
    assert lr.main(["--num_gpus", "2", "--validate-only", *cmd]) == 0
    assert any(prepared.rglob("manifest.json")), sorted(prepared.rglob("*"))


def test_a_later_variants_bad_value_is_refused_before_any_data_is_prepared(tmp_path, monkeypatch, capsys):
    """Bug caught: the first variant's data was prepared (minutes to hours) before the second
    variant's config was even read."""
    from mode import compare

    monkeypatch.chdir(tmp_path)
    prepared = tmp_path / "prepared"
    exp = experiment(tmp_path, overrides=[*TINY, "train.max_steps=2", f"data.prepared_dir={prepared}"])
    doc = yaml.safe_load(exp.read_text())
    doc["variants"]["mod"]["overrides"] = ["model.mod.capacity=[0.5,0.5,0.5]"]
    exp.write_text(yaml.safe_dump(doc))
    assert compare.main([str(exp)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: variant mod (seed 0"), err
    assert not prepared.exists() and not (tmp_path / "runs").exists()


def finished_run(exp, run, env):
    """A stand-in for run_one: what a trainer leaves (config, run info, a final checkpoint, DONE)."""
    from mode import checkpoint as ckpt

    final = ckpt.step_dir(ckpt.checkpoints_dir(run.dir), run.cfg.train.max_steps)
    final.mkdir(parents=True, exist_ok=True)
    (final / "model.pt").write_bytes(b"weights")
    ckpt.write_manifest(final, run.cfg.train.max_steps)  # one that verifies
    (run.dir / "config.yaml").write_text(yaml.safe_dump(run.cfg.to_dict()))
    (run.dir / "run_info.json").write_text(json.dumps({"name": run.variant, "seed": run.seed, "world_size": 1}))
    (run.dir / "DONE").write_text("{}")
    return 0


def test_a_fresh_grid_that_finished_is_not_a_failure(tmp_path, monkeypatch, capsys):
    """Bug caught: with run.fresh=true (the command line or the experiment) compare read each run's
    state after its trainer finished as "new" (fresh: what the start deletes), so the first finished
    run was reported "exited 0 without finishing the run (no checkpoint)", exit 1, and the other
    variants never ran (a SLURM job: "COMPLETED without finishing", and --resubmit retrained it)."""
    from mode import compare
    from mode.config import load_config

    monkeypatch.setattr(compare, "run_one", finished_run)
    exp = stub_grid(tmp_path)
    for _ in range(2):  # a fresh grid over finished runs trains them again
        assert compare.main([str(exp), "run.fresh=true"]) == 0
        err = capsys.readouterr().err
        assert err.count(": done in ") == 2 and "without finishing" not in err, err
    runs = compare.expand(compare.load_experiment(exp), None, ["run.fresh=true"])
    for r in runs:
        r.cfg = load_config(r.config, r.overrides)
        assert compare.status(r) == ("new", 0) and compare.status(r, ran=True) == ("done", 2)


def test_tilde_in_runs_dir_is_the_home_directory(tmp_path, monkeypatch, capsys):
    """Bug caught: `runs_dir: ~/x` (or `--runs-dir '~/x'`) was taken literally: the runs went to
    $HOME/x (run.dir expands `~`) but the grid's LOCK and experiment.json to ./~/x, and the report
    found no runs there (exit 1). The trainer is replaced by a stub that leaves a finished run."""
    from mode import compare

    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)

    monkeypatch.setattr(compare, "run_one", finished_run)
    exp = experiment(tmp_path, runs_dir="~/grid", report_dir="~/rep",
                     overrides=[*TINY, "train.max_steps=2", f"data.prepared_dir={tmp_path / 'prepared'}"])
    assert compare.main([str(exp), "--dry-run", "--only", "dense"]) == 0
    out, err = capsys.readouterr()
    assert f"in {home / 'grid'}, launcher local" in err and f"run.dir={home / 'grid' / 'dense_seed0'} " in out
    assert compare.main([str(exp), "--only", "dense"]) == 0
    assert capsys.readouterr().out.strip().endswith(f"report: {home / 'rep' / 'report.md'}")
    assert sorted(p.name for p in (home / "grid").iterdir()) == ["LOCK", "dense_seed0", "experiment.json"]
    assert compare.main([str(exp), "--only", "dense", "--runs-dir", "~/rerun"]) == 0  # report_dir goes with it
    assert capsys.readouterr().out.strip().endswith(f"report: {home / 'rerun' / 'report' / 'report.md'}")
    assert sorted(p.name for p in (home / "rerun").iterdir()) == ["LOCK", "dense_seed0", "experiment.json", "report"]
    assert not (cwd / "~").exists() and not (tmp_path / "~").exists()


@pytest.mark.parametrize("value", [".", "..", "/", "~", "~/", "HOME"])
@pytest.mark.parametrize("flag", [False, True])
def test_runs_dir_never_cwd_a_parent_of_it_or_home(tmp_path, monkeypatch, capsys, value, flag):
    """A grid's LOCK, plan, report and run directories go into runs_dir: refused as run.dir is."""
    from mode import compare

    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))  # not a parent of cwd: refused as $HOME itself
    monkeypatch.chdir(cwd)
    value = str(home) if value == "HOME" else value
    exp = experiment(tmp_path, **({} if flag else {"runs_dir": value}))
    before = sorted(tmp_path.rglob("*"))
    assert compare.main([str(exp), "--dry-run", *(["--runs-dir", value] if flag else [])]) == 2
    key = "--runs-dir" if flag else "runs_dir"
    assert capsys.readouterr().err.splitlines() == [
        f"config error: {key}={value!r}: a directory that is neither the current directory, a parent of it nor "
        "the home directory (e.g. runs/NAME)"]
    assert sorted(tmp_path.rglob("*")) == before  # nothing written


# ----------------------------------------------------------------------------------------------
# runs_dir and report_dir hold only what `mode compare` writes (the trainer is a stub: no process starts).


def stub_trainer(monkeypatch) -> list[str]:
    """Replace the trainer with one that leaves a finished run (config, run info, a tb/ event file, a
    complete checkpoint, DONE); returns the names of the runs it was asked to train."""
    from torch.utils.tensorboard import SummaryWriter

    from mode import checkpoint as ckpt
    from mode import compare

    started = []

    def finished_run(exp, run, env):
        started.append(run.name)
        run.dir.mkdir(parents=True, exist_ok=True)
        (run.dir / "config.yaml").write_text(yaml.safe_dump(run.cfg.to_dict()))
        (run.dir / "run_info.json").write_text(json.dumps({"name": run.variant, "seed": run.seed, "world_size": 1}))
        w = SummaryWriter(str(run.dir / "tb"))
        w.add_scalar("eval/loss", 3.0 + run.seed, run.cfg.train.max_steps)
        w.close()
        step = ckpt.step_dir(ckpt.checkpoints_dir(run.dir), run.cfg.train.max_steps)
        step.mkdir(parents=True)
        (step / "model.pt").write_bytes(b"weights")
        ckpt.write_manifest(step, run.cfg.train.max_steps)
        (run.dir / "DONE").write_text("{}")
        return 0

    monkeypatch.setattr(compare, "run_one", finished_run)
    return started


def test_compare_calls_a_run_done_exactly_when_the_trainer_does(tmp_path):
    """Bug caught: compare called a run done when DONE existed and config.yaml's max_steps equalled
    the grid's, the trainer when DONE existed and the newest checkpoint reached max_steps: with a
    lower max_steps (or an unreadable config.yaml) compare "resumed" a run the trainer then left
    alone as finished. Both now apply the trainer's rule (mode.train.finished)."""
    from mode import checkpoint as ckpt
    from mode import compare
    from mode.config import load_config
    from mode.train import finished

    exp = compare.load_experiment(stub_grid(tmp_path))
    [run] = compare.expand(exp, only=["dense"])
    run.cfg = load_config(run.config, run.overrides)
    step = ckpt.step_dir(ckpt.checkpoints_dir(run.dir), 6)
    step.mkdir(parents=True)
    (step / "model.pt").write_bytes(b"weights")
    ckpt.write_manifest(step, 6)
    (run.dir / "config.yaml").write_text("train: {max_steps: 6}\n")
    for max_steps, done, want in ((4, True, "done"), (6, True, "done"), (8, True, "resume"), (6, False, "resume")):
        (run.dir / "DONE").write_text("{}") if done else (run.dir / "DONE").unlink()
        run.cfg.train.max_steps = max_steps
        assert compare.status(run)[0] == want, (max_steps, done)
        assert (finished(run.cfg) is not None) == (want == "done"), (max_steps, done)
    (run.dir / "config.yaml").write_bytes(b"\xff\x00")  # unreadable: the rule does not read it
    (run.dir / "DONE").write_text("{}")
    assert compare.status(run)[0] == "done" and finished(run.cfg) is not None
    # Bug caught (resume review): a final checkpoint with a flipped byte counted as finished ("already
    # finished ... nothing to do", and compare skipped it); the start's verification falls back from it
    (step / "model.pt").write_bytes(b"weightz")
    assert compare.status(run)[0] == "resume" and finished(run.cfg) is None
    run.cfg.train.max_steps, run.cfg.train.stop_at = 10, 6  # the same for a run at its train.stop_at
    (run.dir / "DONE").unlink()
    assert finished(run.cfg) is None
    (step / "model.pt").write_bytes(b"weights")
    assert finished(run.cfg) is not None and "train.stop_at=6" in finished(run.cfg)


def test_validating_a_grid_hashes_a_done_runs_checkpoint_once(tmp_path, monkeypatch):
    """Bug caught: validate() verified a done run's last checkpoint (sha256 of every file, gigabytes
    at scale) in compare's status and again in the trainer's finished() (and status once more in
    the data-preparing pass): a rerun of a finished grid hashed every checkpoint two to three times."""
    from mode import checkpoint as ckpt
    from mode import compare
    from mode.config import dump_config, load_config

    exp = compare.load_experiment(stub_grid(tmp_path))
    [run] = compare.expand(exp, only=["dense"])
    cfg = load_config(run.config, run.overrides)
    run_dir = Path(cfg.run.dir)
    step = ckpt.step_dir(ckpt.checkpoints_dir(run_dir), 2)
    step.mkdir(parents=True)
    (step / "model.pt").write_bytes(b"weights")
    ckpt.write_manifest(step, 2)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    (run_dir / "DONE").write_text("{}")
    seen, verify = [], ckpt.verify
    monkeypatch.setattr(ckpt, "verify", lambda d: seen.append(d) or verify(d))
    compare.validate(exp, [run], prepare_data=False)
    assert (run.status, run.resume_step, seen) == ("done", 2, [step])


def stub_grid(tmp_path: Path, **extra) -> Path:
    return experiment(tmp_path, overrides=[*TINY, "train.max_steps=2", f"data.prepared_dir={tmp_path / 'prepared'}"],
                      **extra)


def tree(d: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(d)): (p.read_bytes() if p.is_file() else None) for p in sorted(d.rglob("*"))}


def _users_runs_dir(kind: str, runs: Path) -> tuple[str, str]:
    """Fill runs_dir as a user might have; (key, what the one line says about it)."""
    runs.mkdir(parents=True)
    if kind == "notes":
        (runs / "notes.txt").write_text("my notes\n")
        return "runs_dir", "it holds notes.txt, which mode compare did not write"
    if kind == "plan":  # a user's own experiment.json beside compare's run directories
        (runs / "experiment.json").write_text(json.dumps({"my": "experiment"}))
        return "runs_dir", "it holds experiment.json (not mode compare's plan), which mode compare did not write"
    if kind == "report":  # the user's own report/ where compare's default report goes
        (runs / "report").mkdir()
        (runs / "report" / "report.md").write_text("# my report\n")
        (runs / "report" / "summary.json").write_text("{}")
        return "runs_dir", "it holds report, which mode compare did not write"
    if kind == "stray":  # a directory named like a grid's run, holding a user's files
        (runs / "photos_seed1").mkdir()
        (runs / "photos_seed1" / "holiday.jpg").write_bytes(b"jpeg")
        return "runs_dir", "it holds photos_seed1 (not a mode run), which mode compare did not write"
    if kind == "mode_run":  # runs_dir is itself a run: the grid's entries would stop it resuming
        (runs / "checkpoints").mkdir()
        (runs / "tb").mkdir()
        (runs / "config.yaml").write_text("run: {name: mine}\n")
        (runs / "run_info.json").write_text(json.dumps({"name": "mine", "seed": 0, "world_size": 1}))
        return "runs_dir", "not a mode run directory (it holds checkpoints, tb, run_info.json)"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["notes", "plan", "report", "stray", "mode_run"])
def test_compare_refuses_a_runs_dir_holding_what_it_did_not_write(tmp_path, monkeypatch, capsys, kind):
    """Bug caught: nothing checked runs_dir's contents: `mode compare` silently replaced a user's
    experiment.json and report/report.md + summary.json there, and with runs_dir set to a mode run
    directory it wrote dense_seed0/ and experiment.json into that run, which then could not resume.
    Now one config error line before anything is written or any run starts."""
    from mode import compare, rundir

    started = stub_trainer(monkeypatch)
    runs = tmp_path / "runs"
    key, says = _users_runs_dir(kind, runs)
    before = tree(runs)
    exp = stub_grid(tmp_path)
    assert compare.main([str(exp), "--only", "dense"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"config error: {key}={str(runs)!r}: ") and says in err[0], err
    assert started == [] and tree(runs) == before  # nothing ran, nothing written
    if kind == "mode_run":
        rundir.check(str(runs), False)  # still resumable


def test_compare_refuses_a_report_dir_holding_a_users_report_before_training(tmp_path, monkeypatch, capsys):
    """Bug caught: report_dir was written after all training without a look at what it held: a
    user's report.md, summary.json and figures there were replaced. Refused at load now (one line)."""
    from mode import compare

    started = stub_trainer(monkeypatch)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "report.md").write_text("# my paper draft\n")
    (mine / "loss_vs_step.png").write_bytes(b"my figure")
    exp = stub_grid(tmp_path, report_dir=str(mine))
    assert compare.main([str(exp), "--only", "dense"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"config error: report_dir={str(mine)!r}: a new or empty directory, or one a mode report was "
                   "written to; it holds loss_vs_step.png, report.md and no .mode-report, so the report will not "
                   "overwrite them"], err
    assert started == [] and not (tmp_path / "runs").exists()
    assert (mine / "report.md").read_text() == "# my paper draft\n" and sorted(p.name for p in mine.iterdir()) == [
        "loss_vs_step.png", "report.md"]


@pytest.mark.parametrize("key", ["runs_dir", "report_dir"])
def test_runs_dir_or_report_dir_inside_a_run_is_refused_at_load(tmp_path, monkeypatch, capsys, key):
    """Bug caught: a runs_dir or report_dir below a mode run directory was accepted: the grid's
    runs or the report became an entry of that run, which `mode train` then refused to resume."""
    from mode import compare, rundir

    started = stub_trainer(monkeypatch)
    run = tmp_path / "mine"
    _users_runs_dir("mode_run", run)
    before = tree(run)
    inside = run / "sub"
    exp = stub_grid(tmp_path, **{key: str(inside)})
    for argv in ([str(exp), "--dry-run"], [str(exp), "--only", "dense"]):
        assert compare.main(argv) == 2
        err = capsys.readouterr().err.splitlines()
        assert err == [f"config error: {key}={str(inside)!r}: a path outside the run directory {run}"
                       + (" (or its report/)" if key == "report_dir" else "")
                       + ": a run holding anything else is refused on resume"], err
    assert started == [] and tree(run) == before
    rundir.check(str(run), False)  # still resumable


def test_a_project_folder_with_its_own_checkpoints_is_no_run(tmp_path, monkeypatch, capsys):
    """The check above must prove a run, not guess from names: a researcher's project folder with
    another tool's checkpoints/ and tb/ (and a LOCK of its own) holding the grid's runs_dir was refused."""
    from mode import compare, rundir

    project = tmp_path / "project"
    for d in ("checkpoints/epoch=3", "tb"):
        (project / d).mkdir(parents=True)
    (project / "tb" / "events.out.tfevents.1.host").write_bytes(b"x")
    (project / "LOCK").write_text("poetry\n")
    (project / "notes.md").write_text("mine\n")
    stub_trainer(monkeypatch)
    exp = stub_grid(tmp_path, runs_dir=str(project / "runs" / "grid"), report_dir=str(project / "report"))
    assert compare.main([str(exp), "--dry-run"]) == 0, capsys.readouterr().err
    assert rundir.run_broken_by(project / "eval" / "r.json") is None


@pytest.mark.parametrize("key", ["runs_dir", "report_dir"])
def test_runs_dir_or_report_dir_that_is_a_file_is_refused_at_load(tmp_path, monkeypatch, capsys, key):
    """Bug caught: `runs_dir:` or `report_dir:` naming an existing file ended in FileExistsError,
    for report_dir only after all training. One config error line at load now, nothing run."""
    from mode import compare

    started = stub_trainer(monkeypatch)
    f = tmp_path / "a_file"
    f.write_text("mine\n")
    exp = stub_grid(tmp_path, **{key: str(f)})
    for argv in ([str(exp), "--dry-run"], [str(exp), "--only", "dense"]):
        assert compare.main(argv) == 2
        err = capsys.readouterr().err.splitlines()
        what = "a directory for the grid" if key == "runs_dir" else "a directory for the report"
        assert err == [f"config error: {key}={str(f)!r}: {what} (this path is a file)"], err
    assert started == [] and f.read_text() == "mine\n" and not (tmp_path / "runs").exists()


def test_rerunning_a_grid_into_its_own_runs_dir_keeps_working(tmp_path, monkeypatch, capsys):
    """The refusals above leave compare's own reruns alone: the same grid again (its LOCK, plan,
    run directories, slurm/ and report), more seeds, another grid sharing runs_dir, a report_dir
    inside runs_dir, and a report written before the .mode-report marker existed."""
    from analysis.outdir import MARKER
    from mode import compare

    started = stub_trainer(monkeypatch)
    runs = tmp_path / "runs"
    exp = stub_grid(tmp_path)
    assert compare.main([str(exp), "--only", "dense"]) == 0, capsys.readouterr().err
    assert (runs / "report" / MARKER).is_file()
    (runs / "slurm").mkdir()  # what a slurm grid leaves there: scripts, job ids, job logs
    for name in ("dense_seed0.sh", "dense_seed0.jobid", "dense_seed0-1234.out"):
        (runs / "slurm" / name).write_text("x\n")
    assert compare.main([str(exp), "--only", "dense"]) == 0, capsys.readouterr().err
    assert compare.main([str(exp), "--only", "dense", "--seeds", "0,1"]) == 0, capsys.readouterr().err
    (runs / "mod_seed0" / "slurm").mkdir(parents=True)  # a SLURM job that failed before its trainer started
    other = tmp_path / "other"
    other.mkdir()
    spec = yaml.safe_load(stub_grid(other).read_text())
    spec.update(runs_dir=str(runs), variants={"wide": spec["variants"]["dense"]}, report_dir=str(runs / "wide_report"))
    (other / "grid.yaml").write_text(yaml.safe_dump(spec))
    assert compare.main([str(other / "grid.yaml")]) == 0, capsys.readouterr().err
    (runs / "report" / MARKER).unlink()  # a report from before the marker: only report files, mode's report.md
    assert compare.main([str(exp), "--only", "dense"]) == 0, capsys.readouterr().err
    assert started == ["dense_seed0", "dense_seed1", "wide_seed0"]
    assert sorted(p.name for p in runs.iterdir()) == ["LOCK", "dense_seed0", "dense_seed1", "experiment.json",
                                                      "mod_seed0", "report", "slurm", "wide_report", "wide_seed0"]
    assert (runs / "report" / MARKER).is_file() and (runs / "wide_report" / MARKER).is_file()


def test_one_node_deepspeed_grid_takes_a_free_port(tmp_path, monkeypatch):
    """Without a hostfile every run went to DeepSpeed's port 29500: a second grid, or any `deepspeed`
    job, on the same machine made the run fail (EADDRINUSE). One node gets a free port (also with
    MASTER_PORT set: child_env does not pass it on); a hostfile or `master_port` keeps the port the
    user gave (several nodes must agree on it)."""
    from mode import compare
    import launch.run as lr

    monkeypatch.delenv("MASTER_PORT", raising=False)
    exp = compare.load_experiment(experiment(tmp_path, launcher="deepspeed", launcher_options={"num_gpus": 2}))
    cmd = compare.command(exp, compare.expand(exp)[0])
    port = lr.parser().parse_args(cmd[cmd.index("launch.run") + 1:]).master_port
    assert port is not None and port != lr.DEFAULT_PORT, cmd
    import socket

    with socket.socket() as s:  # free when chosen: nothing listens there
        s.bind(("127.0.0.1", port))
    for opts in ({"hostfile": "h"}, {"num_gpus": 2, "master_port": 29600}):
        exp = compare.load_experiment(experiment(tmp_path, launcher="deepspeed", launcher_options=opts))
        cmd = compare.command(exp, compare.expand(exp)[0])
        assert lr.parser().parse_args(cmd[cmd.index("launch.run") + 1:]).master_port == opts.get("master_port"), cmd
    monkeypatch.setenv("MASTER_PORT", "29700")
    exp = compare.load_experiment(experiment(tmp_path, launcher="deepspeed", launcher_options={"num_gpus": 2}))
    assert "MASTER_PORT" not in compare.child_env(exp)
    cmd = compare.command(exp, compare.expand(exp)[0])
    assert lr.parser().parse_args(cmd[cmd.index("launch.run") + 1:]).master_port not in (None, lr.DEFAULT_PORT)

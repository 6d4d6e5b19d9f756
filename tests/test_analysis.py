"""analysis/ on REAL event files written by tiny runs of the trainer (`mode train`).

The session fixture trains, in a temporary RUNS_DIR:
  dense_seed0  12 steps with checkpoints at 6 and 12; then the step-12 checkpoint and DONE are
               removed (a crash after logging step 12 but before saving it) and the run is
               resumed to step 16: it restarts from step 6 and re-logs steps 8..12 into a
               second event file, rewriting the first without its own 8..12 (the stopped
               process's); where files still repeat a step (runs resumed before that rewrite),
               the reader merges them (latest write wins);
  dense_seed1  another seed (16 steps: a seed of the same config), so the table shows a spread over seeds;
  mod_seed0, mode_integrated_seed0
               depth routing and integrated MoDE (their tiny presets, or the dense one with
               overrides while the presets do not exist), with routing dumps.
Expected numbers are read independently with tensorboard's EventAccumulator, file by file.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from analysis import isoflop, report, routing, tb
from tests.util import side_by_side

ROOT = Path(__file__).resolve().parents[1]
TINY = ["train.eval_every=6", "train.log_every=2", "model.n_layers=2", "model.d_model=32", "model.d_ff=64",
        "data.max_documents=20", "data.seq_len=64", "model.max_seq_len=64", "train.micro_batch_size=4",
        "train.eval_batches=2", "checkpoint.every=6", "log.routing_dump=true", "log.progress=false"]
LOG_EVERY = 2
# Routed variants: their tiny preset when it exists, else the dense preset made into the variant.
VARIANT_OVERRIDES = {
    "mod": ["model.mod.layers=every_other", "model.mod.capacity=0.25", "run.name=mod"],
    "mode_integrated": ["model.moe.layers=every_other", "model.moe.num_experts=4", "model.moe.num_noop_experts=2",
                        "model.moe.capacity_factor=1.0", "run.name=mode_integrated"],
}


def train(config: str, run_dir: Path, max_steps: int, *overrides: str) -> None:
    cmd = [sys.executable, "-m", "mode.cli", "train", "--config", config, f"run.dir={run_dir}",
           f"train.max_steps={max_steps}", *TINY, *overrides]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}  # two runs share 2 cores (side_by_side)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="session")
def runs_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")

    def dense_seed0():  # resumed from its step-6 checkpoint: steps 7-12 are logged twice, the later write wins
        dense = root / "dense_seed0"
        train("configs/tiny/dense.yaml", dense, 16, "train.stop_at=12")
        shutil.rmtree(dense / "checkpoints" / "step_00000012")
        train("configs/tiny/dense.yaml", dense, 16)  # the same schedule: a seed of dense_seed1's config

    def variant_seed0(variant, overrides):
        if (ROOT / f"configs/tiny/{variant}.yaml").is_file():
            train(f"configs/tiny/{variant}.yaml", root / f"{variant}_seed0", 12)
        else:
            train("configs/tiny/dense.yaml", root / f"{variant}_seed0", 12, *overrides)

    # independent runs, two at a time
    seed1 = ("configs/tiny/dense.yaml", root / "dense_seed1", 16, "train.seed=1")
    side_by_side(dense_seed0, lambda: train(*seed1),
                 *(lambda v=v, o=o: variant_seed0(v, o) for v, o in VARIANT_OVERRIDES.items()))
    return root


@pytest.fixture(scope="session")
def report_dir(runs_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report")
    assert report.analyze(runs_dir, out) == out / "report.md"
    return out


def need(runs_dir: Path, variant: str) -> Path:
    assert (runs_dir / f"{variant}_seed0" / "DONE").is_file()
    return runs_dir / f"{variant}_seed0"


# ----------------------------------------------------------------------------------------------
# An independent reading of the event files: tensorboard's EventAccumulator, one file at a time.


def raw_by_file(run_dir: Path) -> list[dict[str, dict[int, tuple[float, float]]]]:
    """Per event file (oldest first): {tag: {step: (value, wall_time)}}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted((run_dir / "tb").glob("events.out.tfevents.*"), key=lambda p: float(p.name.split(".")[3]))
    out = []
    for f in files:
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        out.append({tag: {e.step: (e.value, e.wall_time) for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]})
    return out


def raw_merged(run_dir: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}}, the latest write by wall time winning."""
    best: dict[str, dict[int, tuple[float, float]]] = {}
    for per_file in raw_by_file(run_dir):
        for tag, pts in per_file.items():
            for step, (value, wall) in pts.items():
                if step not in best.setdefault(tag, {}) or wall >= best[tag][step][1]:
                    best[tag][step] = (value, wall)
    return {tag: {s: v for s, (v, _) in sorted(pts.items())} for tag, pts in best.items()}


def last(series: dict[int, float]) -> float:
    return series[max(series)]


# ----------------------------------------------------------------------------------------------
# Reading.


@pytest.mark.slow
def test_resumed_run_is_merged_latest_write_wins(runs_dir, tmp_path):
    dense = runs_dir / "dense_seed0"
    files = raw_by_file(dense)
    assert len(files) == 2, "the resume should have appended a second event file"
    first, second = files
    # the resume rewrote the stopped process's file without what it logged past the step-6 checkpoint
    assert max(first["train/loss"]) == 6 and min(second["train/loss"]) == 8, (first["train/loss"], second["train/loss"])
    relogged = [8, 10, 12]

    run = tb.load_run_log(dense)
    assert run.variant == "dense" and run.seed == 0 and run.done
    for tag in ("train/loss", "perf/step_time_s", "perf/elapsed_s", "train/tokens"):
        steps, values = run.series(tag)
        assert steps.tolist() == list(range(LOG_EVERY, 17, LOG_EVERY)), (tag, steps)  # continuous, no duplicates
        for step in relogged:  # the second process's
            pt = next(p for p in run.scalars[tag] if p.step == step)
            assert (pt.value, pt.wall_time) == pytest.approx(second[tag][step]), (tag, step)
        for step in (2, 4, 6):  # logged once, by the first process
            assert values[steps.tolist().index(step)] == pytest.approx(first[tag][step][0])
    eval_steps = run.series("eval/loss")[0].tolist()
    assert eval_steps == sorted(set(eval_steps)) and {6, 12, 16} <= set(eval_steps), eval_steps
    assert run.last("eval/loss") == pytest.approx(second["eval/loss"][16][0])
    # cumulative counters survive the resume: tokens grow by tokens_per_step every step
    steps, tokens = run.series("train/tokens")
    np.testing.assert_allclose(tokens, steps * run.info["tokens_per_step"])

    # Where files still repeat steps (a run resumed before that rewrite, its run_info.json without
    # `resumes`), the latest write by wall time wins: the stopped process's points are older
    from torch.utils.tensorboard import SummaryWriter

    old = tmp_path / "dense_seed0"
    shutil.copytree(dense, old)
    info = json.loads((old / "run_info.json").read_text())
    info.pop("resumes")
    (old / "run_info.json").write_text(json.dumps(info))
    w = SummaryWriter(str(old / "tb"))
    for step in relogged:
        w.add_scalar("train/loss", 999.0, step, walltime=first["train/loss"][6][1] + step / 100)  # before the resume
    w.close()
    merged = tb.load_run_log(old)
    steps, values = merged.series("train/loss")
    assert steps.tolist() == list(range(LOG_EVERY, 17, LOG_EVERY))
    for step in relogged:
        assert values[steps.tolist().index(step)] == pytest.approx(second["train/loss"][step][0])


@pytest.mark.slow
def test_rows_are_keyed_by_run_variant_seed_tag_step(runs_dir):
    runs = tb.load_runs(runs_dir)
    assert {r.name for r in runs} >= {"dense_seed0", "dense_seed1"}
    rows = tb.to_rows(runs)
    keys = [(r.run, r.tag, r.step) for r in rows]
    assert len(keys) == len(set(keys))
    by_key = {(r.run, r.tag, r.step): r for r in rows}
    for run in ("dense_seed0", "dense_seed1"):
        for tag, pts in raw_merged(runs_dir / run).items():
            for step, value in pts.items():
                row = by_key[(run, tag, step)]
                assert row.value == pytest.approx(value) and row.variant == "dense"
                assert row.seed == int(run[-1])


@pytest.mark.slow
def test_in_progress_run_with_truncated_event_file_and_no_metadata(runs_dir, tmp_path):
    """A run still writing: last record cut in half, no DONE, no run_info.json yet."""
    src = runs_dir / "dense_seed1"
    live = tmp_path / "runs" / "dense_seed7"
    shutil.copytree(src / "tb", live / "tb")
    f = next((live / "tb").glob("events.out.tfevents.*"))
    data = f.read_bytes()
    f.write_bytes(data[:-7])
    run = tb.load_run_log(live)
    assert run.variant == "dense" and run.seed == 7 and not run.done  # from the directory name
    full = raw_merged(src)
    for tag, pts in run.scalars.items():
        got = {p.step: p.value for p in pts}
        assert set(got) <= set(full[tag]) and all(got[s] == pytest.approx(full[tag][s]) for s in got)
    assert sum(len(p) for p in run.scalars.values()) == sum(len(p) for p in full.values()) - 1  # only the cut one
    out = report.analyze(tmp_path / "runs", tmp_path / "out")
    text = out.read_text()
    assert "dense_seed7" in text and "no DONE" in text


# ----------------------------------------------------------------------------------------------
# The report.


@pytest.mark.slow
def test_table_holds_logged_numbers(runs_dir, report_dir):
    summary = json.loads((report_dir / "summary.json").read_text())
    text = (report_dir / "report.md").read_text()
    dense = summary["dense"]
    assert dense["seeds"] == [0, 1]
    per_run = {r["run"]: r for r in dense["runs"]}
    evals, rates = [], []
    for name in ("dense_seed0", "dense_seed1"):
        raw = raw_merged(runs_dir / name)
        info = json.loads((runs_dir / name / "run_info.json").read_text())
        s = per_run[name]
        assert s["eval_loss"] == pytest.approx(last(raw["eval/loss"]))
        assert s["params"] == info["params"] and s["flops_per_token"] == pytest.approx(info["forward_flops_per_token"])
        # each process's first logged point is its warm-up: the run's first, and dense_seed0's first after its resume
        starts = [0, *(r["step"] for r in info.get("resumes", []))]
        warm = {min(t for t in raw["perf/tokens_per_s"] if t > st) for st in starts}
        assert len(warm) == (2 if name == "dense_seed0" else 1), (name, warm)
        for tag, key in (("perf/tokens_per_s", "tokens_per_s"), ("perf/step_time_s", "step_time_s")):
            assert s[key] == pytest.approx(np.median([v for t, v in raw[tag].items() if t not in warm])), (name, key)
        assert s["eval_loss_causal"] is None and s["dropped_tokens_frac"] is None  # dense logs no routing
        evals.append(last(raw["eval/loss"]))
        rates.append(s["tokens_per_s"])
    assert dense["eval_loss"]["mean"] == pytest.approx(np.mean(evals))
    assert dense["eval_loss"]["std"] == pytest.approx(np.std(evals, ddof=1))
    assert dense["eval_loss"]["n"] == 2
    # the markdown table shows the same numbers
    row = next(line for line in text.splitlines() if line.startswith("| `dense` |"))
    assert f"{np.mean(evals):.4f} ± {np.std(evals, ddof=1):.4f}" in row
    assert f"{np.mean(rates):.0f}" in row or f"{np.mean(rates):.3g}" in row


@pytest.mark.slow
def test_table_routing_columns(runs_dir, report_dir):
    mod_dir = need(runs_dir, "mod")
    raw = raw_merged(mod_dir)
    s = json.loads((report_dir / "summary.json").read_text())["mod"]["runs"][0]
    assert s["eval_loss"] == pytest.approx(last(raw["eval/loss"]))
    assert s["eval_loss_causal"] == pytest.approx(last(raw["eval/loss_causal"]))
    assert s["causal_gap"] == pytest.approx(last(raw["eval/loss_causal"]) - last(raw["eval/loss"]))
    acc = [last(v) for k, v in raw.items() if k.startswith("mod/layer") and k.endswith("/predictor_acc")]
    assert acc, "the MoD run should log predictor accuracy per routed layer"
    assert s["predictor_acc"] == pytest.approx(np.mean(acc))


@pytest.mark.slow
def test_table_expert_columns(runs_dir, report_dir):
    run_dir = need(runs_dir, "mode_integrated")
    raw = raw_merged(run_dir)
    s = json.loads((report_dir / "summary.json").read_text())["mode_integrated"]["runs"][0]
    for key in ("dropped_tokens_frac", "noop_frac"):
        vals = [last(v) for k, v in raw.items() if k.startswith("moe/layer") and k.endswith("/" + key)]
        assert vals, f"the integrated MoDE run should log {key} per MoE layer"
        assert s[key] == pytest.approx(np.mean(vals))
    assert_png(report_dir / "expert_load.png")
    text = (report_dir / "report.md").read_text()
    assert "(expert_load.png)" in text and "load max/mean" in text


def assert_png(path: Path) -> None:
    import matplotlib.image as mpimg

    assert path.is_file() and path.stat().st_size > 2000, path
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(path)
    assert img.shape[0] > 100 and img.shape[1] > 100 and img[..., :3].std() > 0.01, f"{path} looks blank"


@pytest.mark.slow
def test_figures_are_written(report_dir):
    text = (report_dir / "report.md").read_text()
    for name in ("loss_vs_step.png", "loss_vs_flops.png", "loss_vs_time.png", "routing_per_layer.png"):
        assert_png(report_dir / name)
        assert f"({name})" in text


@pytest.mark.slow
def test_routing_analysis(runs_dir, report_dir):
    mod_dir = need(runs_dir, "mod")
    dump = routing.load_dump(mod_dir / "routing.pt")
    L, B, S = dump.engaged_LBS.shape
    assert L == 2 and S == 64
    stats = routing.engagement_vs_entropy(dump)
    n_blocks = dump.engaged_LBS.sum(0).ravel()
    assert stats.n_blocks_T.tolist() == n_blocks.tolist()
    if n_blocks.std() > 0:
        assert stats.pearson_r == pytest.approx(np.corrcoef(n_blocks, dump.entropy_BS.ravel())[0, 1])
    assert sum(b[1] for b in stats.bins) == B * S
    text = (report_dir / "report.md").read_text()
    assert "Pearson" in text
    assert_png(report_dir / "entropy_vs_blocks_mod.png")
    assert_png(report_dir / "routing_heatmap_mod.png")
    # per-layer processed fraction measured on the dump: the routed layer processes ~capacity
    frac = routing.processed_frac_per_layer(dump)
    assert frac[0] == 1.0 and 0 < frac[1] < 1


@pytest.mark.slow
def test_dense_routing_dump_has_no_correlation(runs_dir):
    dump = routing.load_dump(runs_dir / "dense_seed0" / "routing.pt")
    assert dump.engaged_LBS.all()
    assert math.isnan(routing.engagement_vs_entropy(dump).pearson_r)
    assert routing.token_labels(np.array([100, 32, 10, 256, 200]), True) == ["d", "␣", "⏎", "¶", "·"]


@pytest.mark.slow
def test_cli(runs_dir, tmp_path):
    out = tmp_path / "cli_out"
    proc = subprocess.run([sys.executable, "-m", "mode.cli", "analyze", str(runs_dir), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("report.md") and (out / "report.md").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = subprocess.run([sys.executable, "-m", "mode.cli", "analyze", str(empty)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "no run directories" in proc.stderr
    assert list(empty.iterdir()) == []  # an error writes nothing


def test_analyzing_one_run_leaves_it_resumable(tmp_path, capsys):
    """Bug caught: `mode analyze RUN_DIR` wrote RUN_DIR/report, which mode/rundir.py did not count as
    the run's, so resuming the run (or run.fresh=true) was refused: "it holds report, which mode
    did not write". report/ is now the run's; fresh keeps it (mode cannot prove it wrote a report/),
    and --out elsewhere inside the run is refused before anything is written."""
    from mode import rundir

    run = tmp_path / "run"
    _write_run(run, "dense", 0, 2.5)
    for out in ("figs", ".", "tb/figs"):  # tb/ is mode's, but a report in it goes when run.fresh empties tb/
        assert report.main([str(run), "--out", str(run / out)]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"config error: --out={str(run / out)!r}: a path outside the run directory {run} (or its report/): "
            "a run holding anything else is refused on resume"]
    assert sorted(p.name for p in run.iterdir()) == ["DONE", "config.yaml", "run_info.json", "tb"]
    assert not (run / "tb" / "figs").exists()
    assert report.main([str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run / "report" / "report.md")
    for fresh in (False, True):
        rundir.check(str(run), fresh)  # resumable, and fresh may start over
    lock = rundir.DirLock(run)
    rundir.empty_run_dir(run)
    assert sorted(p.name for p in run.iterdir()) == ["LOCK", "report"]
    assert (run / "report" / "report.md").is_file()
    lock.release()


def _write_run(path: Path, name: str, seed: int, eval_loss: float, world: int = 1, **cfg_over) -> None:
    """A run directory as the trainer leaves it: config.yaml, run_info.json, tb/ event file, DONE."""
    import yaml
    from torch.utils.tensorboard import SummaryWriter

    from mode.config import load_config

    cfg = load_config("configs/tiny/dense.yaml", [f"run.name={name}", f"train.seed={seed}", f"run.dir={path}",
                                                  *(f"{k.replace('__', '.')}={v}" for k, v in cfg_over.items())])
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    (path / "run_info.json").write_text(json.dumps({"name": name, "seed": seed, "world_size": world,
                                                    "params": 1000, "forward_flops_per_token": 2000,
                                                    "tokens_per_step": 100}))
    w = SummaryWriter(str(path / "tb"))
    w.add_scalar("eval/loss", eval_loss, 10)
    w.close()
    (path / "DONE").write_text("{}")


def _write_run_with_mfu(d, name: str, seed: int, loss: float, mfu: float, peak: float) -> None:
    """A synthetic run whose perf/mfu divides by `peak` (run_info.json's peak_tflops_per_device)."""
    from torch.utils.tensorboard import SummaryWriter

    _write_run(d, name, seed, loss)
    info = json.loads((d / "run_info.json").read_text())
    info["peak_tflops_per_device"] = peak
    (d / "run_info.json").write_text(json.dumps(info))
    w = SummaryWriter(str(d / "tb"))
    for step in (2, 4, 6):
        w.add_scalar("perf/mfu", mfu, step)
    w.close()


def test_mfu_of_a_run_resumed_under_another_peak_is_called_out(tmp_path):
    """Bug caught: a run resumed under another peak (run_info.json `peaks`) had its MFU median
    taken over rows with two denominators, and the report said nothing (its top-level peak alone
    matched the other runs')."""
    root = tmp_path / "runs"
    for seed in (0, 1):
        _write_run_with_mfu(root / f"dense_seed{seed}", "dense", seed, 2.0, 0.3, 0.5)
    p = root / "dense_seed1" / "run_info.json"
    p.write_text(json.dumps({**json.loads(p.read_text()), "peaks": [
        {"step": 0, "peak_tflops_per_device": 0.11}, {"step": 4, "peak_tflops_per_device": 0.5}]}))
    report.analyze(root, tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    assert "**MFU of one run against several peaks**: `dense_seed1` (0.11, 0.5)" in md, md
    assert "0.11: `dense_seed1`; 0.5: `dense_seed0`, `dense_seed1`" in md  # and the runs' peaks differ
    p.write_text(json.dumps({**json.loads(p.read_text()), "peaks": [{"step": 0, "peak_tflops_per_device": 0.5}]}))
    report.analyze(root, tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    assert "several peaks" not in md and "different peaks" not in md


def test_mfu_above_100_percent_is_called_out(tmp_path):
    """A run whose measured peak was deflated (MFU > 1) is named under the table with its peak."""
    root = tmp_path / "runs"
    for name, mfu, peak in (("dense", 0.3, 0.12), ("mod", 1.54, 0.0197)):
        _write_run_with_mfu(root / f"{name}_seed0", name, 0, 2.0, mfu, peak)
    report.analyze(root, tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    assert "**MFU above 100%** in `mod_seed0` (154% against 0.0197 TFLOP/s)" in md
    assert "`dense_seed0` (" not in md


def test_a_seed_stopped_early_is_compared_at_its_step_and_peak_memory_is_the_largest(tmp_path):
    """Bugs caught: a seed stopped at step 3 (train.stop_at) was averaged, at step 3, with seeds'
    step-6 losses and the table said only "the last evaluation"; a resumed run's peak memory was its
    last process's (each process measures its own peak from zero)."""
    from torch.utils.tensorboard import SummaryWriter

    root = tmp_path / "runs"
    losses = {0: {0: 6.0, 3: 5.0, 6: 4.0}, 1: {0: 6.2, 3: 5.2, 6: 4.2}, 2: {0: 6.1, 3: 5.6}}  # seed 2 stopped
    for seed, evals in losses.items():
        d = root / f"dense_seed{seed}"
        _write_run(d, "dense", seed, 9.9)  # (its eval/loss at step 10 is rewritten below)
        shutil.rmtree(d / "tb")
        w = SummaryWriter(str(d / "tb"))
        for step, v in evals.items():
            w.add_scalar("eval/loss", v, step)
        for step, gb in ((2, 0.7), (4, 0.5), (6, 0.55)):  # resumed after step 2: a new process, a lower peak
            w.add_scalar("perf/memory_gb", gb, step)
        w.close()
        if seed == 2:
            (d / "DONE").unlink()
    out = tmp_path / "out"
    report.analyze(root, out)
    dense = json.loads((out / "summary.json").read_text())["dense"]
    assert dense["eval_step"] == 3 and [r["eval_step"] for r in dense["runs"]] == [3, 3, 3]
    assert dense["eval_loss"]["mean"] == pytest.approx((5.0 + 5.2 + 5.6) / 3) and dense["eval_loss"]["n"] == 3
    assert dense["memory_gb"]["mean"] == pytest.approx(0.7)
    md = (out / "report.md").read_text()
    assert "| variant | seeds | eval step |" in md and "| `dense` | 3 | 3 |" in md, md
    assert "the last evaluation every seed of the variant reached" in md


def test_same_named_runs_with_different_configs_are_kept_apart(tmp_path):
    root = tmp_path / "runs"
    _write_run(root / "a" / "dense_seed0", "dense", 0, 2.0)
    _write_run(root / "a" / "dense_seed1", "dense", 1, 2.2, data__num_workers=7, data__prepared_dir="/elsewhere",
               train__activation_checkpointing="block")  # a seed of the same config, read and kept differently
    _write_run(root / "b" / "dense_seed0", "dense", 0, 5.0, data__tokenizer="byte", train__max_steps=2)
    _write_run(root / "c" / "dense_seed0", "dense", 0, 4.0, world=2)
    out = tmp_path / "out"
    report.analyze(root, out)
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"dense#1", "dense#2", "dense#3"}
    by_path = {Path(r["path"]).relative_to(root).parts[0]: (v, r) for v, row in summary.items() for r in row["runs"]}
    assert by_path["a"][0] == "dense#1" and summary["dense#1"]["eval_loss"] == pytest.approx(
        {"mean": 2.1, "std": float(np.std([2.0, 2.2], ddof=1)), "n": 2})
    assert summary[by_path["b"][0]]["eval_loss"]["mean"] == 5.0 and summary[by_path["c"][0]]["eval_loss"]["n"] == 1
    assert by_path["b"][1]["config_diff"] == {"train.max_steps": 2, "world_size": 1}
    assert by_path["c"][1]["config_diff"] == {"train.max_steps": 300, "world_size": 2}  # the preset's steps
    md = (out / "report.md").read_text()
    assert "do not share one config" in md and "`b/dense_seed0`" in md and "`train.max_steps`" in md
    assert "| `dense_seed0` | `c/dense_seed0` | `dense#3` |" in md


def test_a_pipe_in_a_run_path_does_not_split_a_table_cell(tmp_path):
    root = tmp_path / "runs"  # (run.name refuses `|`; a directory name may hold one)
    _write_run(root / "x|y" / "dense_seed0", "dense", 0, 2.0)
    _write_run(root / "z|w" / "dense_seed0", "dense", 0, 3.0, train__max_steps=2)  # the config-diff table too
    out = tmp_path / "out"
    report.analyze(root, out)
    md = (out / "report.md").read_text()
    assert "`x\\|y/dense_seed0`" in md and "`z\\|w/dense_seed0`" in md
    tables = [[ln for ln in block.splitlines() if ln.startswith("|")] for block in md.split("\n\n")]
    for rows in filter(None, tables):  # GFM splits a row at every unescaped pipe: each row as wide as its header
        widths = {len(re.split(r"(?<!\\)\|", ln)) for ln in rows}
        assert len(widths) == 1, rows


def test_a_seed_run_twice_is_not_counted_as_two_seeds(tmp_path):
    """Bug caught: one config trained twice with seed 0 (through deepspeed and torchrun) was one
    variant with "2 seeds" and a spread of 0: a repeat is not an independent sample."""
    root = tmp_path / "runs"
    _write_run(root / "ds" / "dense_seed0", "dense", 0, 2.0)
    _write_run(root / "ds" / "dense_seed1", "dense", 1, 2.4)
    _write_run(root / "tr" / "dense_seed0", "dense", 0, 2.0)
    out = tmp_path / "out"
    report.analyze(root, out)
    summary = json.loads((out / "summary.json").read_text())
    assert {v: row["seeds"] for v, row in summary.items()} == {"dense#1": [0, 1], "dense#2": [0]}
    assert [r["config_diff"] for r in summary["dense#2"]["runs"]] == [{"repeat": 2}]
    assert "or repeat a seed" in (out / "report.md").read_text()


def test_readme_names_every_key_analyze_does_not_compare():
    """The README's `mode analyze` paragraph is the user's only way to know which runs it averages."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    para = readme[readme.index("`mode analyze DIR` averages only runs"):][:1500]
    missing = [k for k in tb.NOT_COMPARED if f"`{k}*`" not in para and f"`{k}`" not in para]
    assert missing == [], missing


def test_a_run_resumed_with_another_schedule_is_not_a_seed_of_one_trained_on_one(tmp_path):
    """Bug caught: a run stopped at 40 steps and resumed to 60 with train.allow_schedule_change (its
    cosine recomputed mid-run: the LR jumped back up) has the same config.yaml as a plain 60-step
    run, and `mode analyze` averaged the two as seeds. The trainer records the change in
    run_info.json (`schedule_changes`), and the grouping compares it."""
    root = tmp_path / "runs"
    _write_run(root / "dense_seed0", "dense", 0, 2.0, train__max_steps=60)
    _write_run(root / "dense_seed1", "dense", 1, 2.4, train__max_steps=60)
    info = json.loads((root / "dense_seed1" / "run_info.json").read_text())
    info["schedule_changes"] = [{"step": 40, "train.max_steps": [40, 60]}]
    (root / "dense_seed1" / "run_info.json").write_text(json.dumps(info))
    out = tmp_path / "out"
    report.analyze(root, out)
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"dense#1", "dense#2"} and all(v["eval_loss"]["n"] == 1 for v in summary.values())
    diffs = [r["config_diff"] for v in summary.values() for r in v["runs"]]
    assert {"schedule_changes": [{"step": 40, "train.max_steps": [40, 60]}]} in diffs, diffs


# ----------------------------------------------------------------------------------------------
# isoFLOP (pure functions; the grid itself is too expensive for the unit tests).


def test_per_layer_fractions_from_logs_name_where_each_variant_s_came_from(tmp_path):
    """Bug caught: without routing.pt (a run stopped at train.stop_at) every variant's per-layer
    fractions were said to come from "MoD capacity × the fraction a real expert processed
    (`engaged_frac`)", dense and MoD variants too, which have neither experts nor that tag."""
    def run(variant: str, **model) -> tb.RunLog:
        scalars = {"moe/layer1/engaged_frac": [tb.Point(4, 0.8, 0.0)]} if "moe" in model else {}
        return tb.RunLog(tmp_path / f"{variant}_seed0", variant, 0, scalars=scalars,
                         config={"model": {"n_layers": 2, **model}, "data": {"seq_len": 64}})

    mod, moe = {"layers": [1], "capacity": 0.25}, {"layers": [1], "num_experts": 4}
    got = report.per_layer_processed([run("dense"), run("mod", mod=mod), run("moe", moe=moe),
                                      run("staged", mod=mod, moe=moe)])
    assert {v: (f.tolist(), src) for v, (f, src) in got.items()} == {
        "dense": ([1.0, 1.0], "config"), "mod": ([1.0, 0.25], "config-mod"), "moe": ([1.0, 0.8], "logs-moe"),
        "staged": ([1.0, 0.2], "logs")}
    assert "engaged_frac" not in report.SOURCE_TEXT["config"] + report.SOURCE_TEXT["config-mod"]
    assert "MoD" not in report.SOURCE_TEXT["logs-moe"] and "MoD capacity ×" in report.SOURCE_TEXT["logs"]


def test_medians_leave_out_the_warm_up_of_every_process():
    """Bug caught: tokens/s, step time and MFU medians left out only the run's first logged point, so
    a resumed run's first interval after the restart (start-up, compiling: 306 tokens/s beside 1050
    and 3096 in a walkthrough's report) counted. Run_info's resumes say where each process started;
    one written by hand or an older version (no step) changes nothing."""
    pts = [tb.Point(s, v, 0.0) for s, v in [(2, 5.0), (4, 100.0), (6, 110.0), (8, 7.0), (10, 120.0), (12, 130.0)]]
    run = tb.RunLog(Path("/nonexistent/r"), "v", 0, info={"resumes": [{"step": 6}, {"time": 1.0}]},
                    scalars={"perf/tokens_per_s": pts})
    assert report.median_after_warmup(run, "perf/tokens_per_s") == 115.0  # of 100, 110, 120, 130
    run.info = {}
    assert report.median_after_warmup(run, "perf/tokens_per_s") == 110.0  # of 100, 110, 7, 120, 130
    one = tb.RunLog(Path("/nonexistent/r"), "v", 0, scalars={"perf/mfu": pts[:1]})
    assert report.median_after_warmup(one, "perf/mfu") == 5.0  # a single point: itself


def fake_run(variant: str, params: float, fpt: float, steps: int, loss: float) -> tb.RunLog:
    return tb.RunLog(Path(f"/nonexistent/{variant}_{params:g}"), variant, 0,
                     info={"params": params, "forward_flops_per_token": fpt, "tokens_per_step": 1000},
                     config={"train": {"max_steps": steps}},
                     scalars={"eval/loss": [tb.Point(steps, loss, 0.0)]})


def test_isoflop_groups_budgets_and_finds_the_best_size(tmp_path):
    runs = []
    for budget in (1e12, 1e13):
        n_opt = 3e5 * math.sqrt(budget / 1e12)
        for params in (1e5, 3e5, 1e6, 3e6):
            fpt = 6 * params
            steps = round(budget / (3 * fpt * 1000) * (1.1 if params == 1e6 else 1.0))  # sizing is approximate
            loss = 2 + 0.3 * (math.log10(params) - math.log10(n_opt)) ** 2
            runs.append(fake_run("dense", params, fpt, steps, loss))
    points = isoflop.collect_points(runs)
    assert len({p.budget for p in points}) == 2
    assert len(isoflop.collect_points(runs, budgets=[1e12, 1e13])) == 8
    opts = isoflop.optima(isoflop.collect_points(runs, budgets=[1e12, 1e13]))
    assert [o.method for o in opts] == ["parabola", "parabola"]
    assert opts[0].params == pytest.approx(3e5, rel=0.15)
    assert opts[1].params == pytest.approx(3e5 * math.sqrt(10), rel=0.15)
    assert isoflop.size_for_budget(1e14, opts, "dense") == pytest.approx(3e6, rel=0.3)
    lines = isoflop.isoflop_section(runs, tmp_path, budgets=[1e12, 1e13])
    assert any("parabola" in line for line in lines)
    assert_png(tmp_path / "isoflop.png")


def test_isoflop_budget_from_experiment_yaml(tmp_path):
    # one schema, the one `mode compare` reads: the top-level `budgets:` (a number or a list)
    y = tmp_path / "isoflop.yaml"
    y.write_text("budgets: ['3e12', 1.0e12]\nvariants: {}\n")
    assert isoflop.load_budgets(y) == [1e12, 3e12]
    y.write_text("budgets: 2.0e12\n")
    assert isoflop.load_budgets(y) == [2e12]
    y.write_text("isoflop:\n  budgets: [1.0e12]\nflop_budget: 1.0e12\n")  # no longer found at any depth
    assert isoflop.load_budgets(y) is None
    # bugs caught (README walkthrough): `--experiment ""` (an unset variable) was read as no --experiment,
    # and a file that is not UTF-8 was called missing ("an existing experiment YAML file")
    from mode.config import ConfigError

    with pytest.raises(ConfigError, match=r"^config error: --experiment='': a non-empty path"):
        isoflop.load_budgets("")
    y.write_bytes(b"budgets: 1.0e12 # caf\xe9\n")
    with pytest.raises(ConfigError, match=r"a UTF-8 YAML file \(byte 21 is not UTF-8\)"):
        isoflop.load_budgets(y)
    assert isoflop.assign_budgets([0.9e12, 2.5e12, 3.3e12], [1e12, 3e12]) == [1e12, 3e12, 3e12]
    # without named budgets: clusters within 25%
    labels = isoflop.assign_budgets([1.0, 1.1, 5.0, 5.5])
    assert labels[0] == labels[1] != labels[2] == labels[3]
    # fewer than three sizes: the best observed one
    n, loss, method, _ = isoflop.fit_optimum(np.array([1e5, 1e6]), np.array([2.5, 2.1]))
    assert (n, loss, method) == (1e6, 2.1, "observed")


def test_processed_fraction_from_logs_reads_the_layer_plan():
    # Bug caught: capacity re-read as one number (a per-layer schedule, decoupled MLP capacities),
    # or layers guessed from tag names.
    def run_of(mod: dict, moe: dict | None = None, scalars: dict | None = None) -> tb.RunLog:
        model = {"n_layers": 4, "mod": mod, **({"moe": moe} if moe else {})}
        return tb.RunLog(Path("/nonexistent/r"), "v", 0, config={"model": model},
                         scalars={k: [tb.Point(10, v, 0.0)] for k, v in (scalars or {}).items()})

    sched = report.processed_frac_from_logs(run_of({"layers": "every_other", "capacity": [0.5, 0.25]}))
    assert sched.tolist() == [1.0, 0.5, 1.0, 0.25]
    dec = report.processed_frac_from_logs(run_of({"layers": [2], "decoupled": True, "attn_capacity": 0.8,
                                                  "mlp_capacity": 0.5}))
    assert dec.tolist() == [1.0, 1.0, 0.5, 1.0]  # the fraction whose MLP update is computed
    integ = report.processed_frac_from_logs(run_of({"layers": "none"}, {"layers": [1], "num_noop_experts": 2},
                                                   {"moe/layer1/noop_frac": 0.25}))
    assert integ.tolist() == [1.0, 0.75, 1.0, 1.0]  # logged before engaged_frac: 1 - no-op share of routes
    # Bug caught: that formula let a dropping MoE show 1.0 and counted a token with one no-op and
    # one real route as skipped; the logged engaged fraction holds both, scaled by the MoD capacity.
    drop = report.processed_frac_from_logs(run_of({"layers": "none"}, {"layers": [1], "capacity_factor": 0.5},
                                                  {"moe/layer1/engaged_frac": 0.6, "moe/layer1/noop_frac": 0.0}))
    assert drop.tolist() == [1.0, 0.6, 1.0, 1.0]
    staged = report.processed_frac_from_logs(run_of({"layers": [2], "capacity": 0.5}, {"layers": [2]},
                                                    {"moe/layer2/engaged_frac": 0.9}))
    assert staged.tolist() == [1.0, 1.0, 0.45, 1.0]
    assert report.processed_frac_from_logs(tb.RunLog(Path("/x"), "v", 0)) is None  # no config: no guess
    # Bug caught: the nominal capacity was reported, not the k/S the block computes (0.125 of 100
    # tokens is 12 of them, as capacity_k rounds; routing.pt's fraction, measured, said 0.12)
    odd = run_of({"layers": [1], "capacity": 0.125})
    odd.config["data"] = {"seq_len": 100}
    assert report.processed_frac_from_logs(odd).tolist() == [1.0, 0.12, 1.0, 1.0]


def test_isoflop_curves_are_the_runs_that_differ_only_in_size_and_steps():
    # Bug caught: every isoFLOP curve had one size (no section at all) once same-named runs of
    # several sizes were split into `dense#1`, `dense#2` and a compare grid names each size.
    def run(variant: str, d: int, steps: int, **model) -> tb.RunLog:
        cfg = {"model": {"d_model": d, "d_ff": 4 * d, **model}, "train": {"max_steps": steps}, "run": {"name": variant}}
        return tb.RunLog(Path(f"/nonexistent/{variant}"), variant, 0, config=cfg)

    runs = [run("dense_s", 64, 900), run("dense_m", 128, 300), run("mod_s", 64, 900, mod={"capacity": 0.125}),
            run("mod_m", 128, 300, mod={"capacity": 0.125}), run("dense#1", 64, 10), run("dense#2", 96, 5, n_layers=6),
            run("moe", 64, 900, moe={"num_experts": 8})]
    assert isoflop.curve_names(runs) == {"dense_s": "dense", "dense_m": "dense", "dense#1": "dense",
                                         "dense#2": "dense", "mod_s": "mod", "mod_m": "mod", "moe": "moe"}
    # a recipe change (not a size) is another curve; two curves never share a name
    runs[1].config["optim"] = {"lr": 1e-3}
    names = isoflop.curve_names(runs)
    assert names["dense_m"] == "dense_m" and len({names[v] for v in ("dense_s", "dense_m")}) == 2


def test_numbered_variants_sort_by_number():
    """Bug caught (README walkthrough): same-named runs of 12 configs were listed dense#1, dense#10,
    dense#11, dense#12, dense#2, ...: the number compared as text."""
    names = ["zeta#12", "dense#10", "mod", "dense#2", "zeta#3", "dense#1", "moe", "dense", "zeta"]
    assert sorted(names, key=tb.variant_sort_key) == ["dense", "dense#1", "dense#2", "dense#10", "mod", "moe",
                                                      "zeta", "zeta#3", "zeta#12"]


def test_decoupled_routing_is_shown_per_router():
    # Bug caught: a decoupled variant drawn as one bar per layer, the tokens that got both sublayers
    # (~ attn capacity x MLP capacity), instead of each router's own fraction and causal fraction.
    def run_of(variant: str, scalars: dict) -> tb.RunLog:
        return tb.RunLog(Path(f"/nonexistent/{variant}"), variant, 0,
                         scalars={k: [tb.Point(10, v, 0.0)] for k, v in scalars.items()})

    runs = [run_of("dec", {"mod_attn/layer1/processed_frac": 0.4, "mod_attn/layer1/causal_processed_frac": 0.35,
                           "mod_mlp/layer1/processed_frac": 0.25, "mod_mlp/layer1/causal_processed_frac": 0.2}),
            run_of("mod", {"mod/layer1/causal_processed_frac": 0.3})]
    processed = {"dec": {0: 1.0, 1: 0.1, 2: 1.0}, "mod": {0: 1.0, 1: 0.33, 2: 1.0}}
    causal = report.per_layer_metric(runs, "mod", "causal_processed_frac")
    colors = tb.variant_colors(["dec", "mod"])
    report.split_decoupled(runs, processed, causal, colors)
    assert processed == {"mod": {0: 1.0, 1: 0.33, 2: 1.0}, "dec (attn)": {0: 1.0, 1: 0.4, 2: 1.0},
                         "dec (mlp)": {0: 1.0, 1: 0.25, 2: 1.0}}
    assert causal == {"mod": {1: 0.3}, "dec (attn)": {1: 0.35}, "dec (mlp)": {1: 0.2}}
    assert {"dec (attn)", "dec (mlp)"} <= set(colors)


def test_decoupled_routing_around_experts_shows_what_the_experts_processed_on_the_mlp_row(tmp_path):
    """Bug caught (variants walkthrough): decoupled routing around an MoE MLP (integrated MoDE) showed
    the MLP router's capacity alone as processed (50% where 39% of its tokens were dropped), and its
    dropped / no-op / load columns under a third row, the unsplit variant, with processed "—"."""
    from torch.utils.tensorboard import SummaryWriter

    root = tmp_path / "runs"
    d = root / "dec_seed0"
    _write_run(d, "dec", 0, 2.0, model__moe__layers="[1]", model__mod__layers="[1]", model__mod__decoupled="true")
    w = SummaryWriter(str(d / "tb"))
    for tag, v in {"mod_attn/layer1/processed_frac": 0.5, "mod_mlp/layer1/processed_frac": 0.5,
                   "moe/layer1/engaged_frac": 0.6, "moe/layer1/dropped_tokens_frac": 0.25,
                   "moe/layer1/noop_frac": 0.2, "moe/layer1/load_max": 3.0, "moe/layer1/load_mean": 2.0}.items():
        w.add_scalar(tag, v, 10)
    w.close()
    report.analyze(root, tmp_path / "out")
    text = (tmp_path / "out" / "report.md").read_text()
    section = text.split("## Per-layer routing")[1].split("\n## ")[0]
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): [c.strip() for c in line.split("|")[3:-1]]
            for line in section.splitlines() if line.startswith("| `")}
    assert {v for v, _ in rows} == {"`dec (attn)`", "`dec (mlp)`"}, rows
    assert rows["`dec (attn)`", "1"][0] == "50.0%" and rows["`dec (attn)`", "0"][0] == "100.0%"
    mlp = rows["`dec (mlp)`", "1"]
    assert mlp[0] == "30.0%" and "25.0%" in mlp and "20.0%" in mlp and "1.50" in mlp, mlp


def test_last_step_is_the_training_step_not_tokens_or_mflops(tmp_path):
    """The Runs table's last step comes from the step-indexed tags: the trainer also logs
    `*/loss_vs_tokens` and `*/loss_vs_mflops`, whose TensorBoard step is tokens or MFLOPs."""
    from torch.utils.tensorboard import SummaryWriter

    root = tmp_path / "runs"
    _write_run(root / "dense_seed0", "dense", 0, 2.0)
    w = SummaryWriter(str(root / "dense_seed0" / "tb"))
    for step in (10, 20, 30):  # as mode/loggers.py writes them: tokens seen and training MFLOPs as steps
        w.add_scalar("train/loss", 3.0, step)
        w.add_scalar("train/loss_vs_tokens", 3.0, step * 100)
        w.add_scalar("train/loss_vs_mflops", 3.0, step * 600)
    w.add_scalar("eval/loss_vs_mflops", 2.0, 30 * 600)
    w.close()
    report.analyze(root, tmp_path / "out")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [r["last_step"] for r in summary["dense"]["runs"]] == [30]
    assert "| `dense_seed0` | `dense_seed0` | `dense` | 0 | 30 | yes |" in (tmp_path / "out" / "report.md").read_text()


def test_per_layer_routing_of_runs_with_no_training_log_names_no_step(tmp_path):
    """Bug caught: runs stopped before their first train.log_every step (a compare with
    train.stop_at=2, log_every=10) gave "the last training log (step , training batches)"."""
    from torch.utils.tensorboard import SummaryWriter

    root = tmp_path / "runs"
    _write_run(root / "mod_seed0", "mod", 0, 2.0, model__mod__layers="every_other")
    report.analyze(root, tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Per-layer routing" in md and "(step , " not in md, md
    assert "the last training log (none yet: no run has trained to its first train.log_every step)" in md
    w = SummaryWriter(str(root / "mod_seed0" / "tb"))
    w.add_scalar("train/loss", 3.0, 10)
    w.close()
    report.analyze(root, tmp_path / "out")
    assert "the last training log (step 10, training batches)" in (tmp_path / "out" / "report.md").read_text()


def test_analyze_writes_only_into_a_new_empty_or_mode_report_directory(tmp_path, capsys, monkeypatch):
    """Bug caught: `mode analyze RUNS --out DIR` (and `python -m analysis.isoflop --out DIR`) replaced
    report.md, summary.json, isoflop.md and *.png in any existing directory, a user's own included.
    A directory with a user's report.md and no .mode-report marker is now refused in one line before
    anything is written; the defaults RUNS_DIR/report and RUN_DIR/report still work on reruns."""
    from analysis.outdir import MARKER

    runs = tmp_path / "runs"
    _write_run(runs / "dense_seed0", "dense", 0, 2.5)
    _write_run(runs / "dense_seed1", "dense", 1, 2.6)
    mine = tmp_path / "paper"
    mine.mkdir()
    (mine / "report.md").write_text("# my paper draft\n")
    (mine / "summary.json").write_text('{"mine": 1}')
    (mine / "isoflop.md").write_text("my isoflop notes\n")
    before = {p.name: p.read_bytes() for p in mine.iterdir()}
    line = (f"config error: --out={str(mine)!r}: a new or empty directory, or one a mode report was written to; it "
            "holds isoflop.md, report.md, summary.json and no .mode-report, so the report will not overwrite them")
    assert report.main([str(runs), "--out", str(mine)]) == 2
    assert capsys.readouterr().err.splitlines() == [line]
    assert isoflop.main([str(runs), "--out", str(mine)]) == 2
    assert capsys.readouterr().err.splitlines() == [line]
    assert {p.name: p.read_bytes() for p in mine.iterdir()} == before  # nothing written
    # an empty --out (an unset $OUT) was taken as none: the report went to RUNS/report instead
    assert report.main([str(runs), "--out", ""]) == 2 and not (runs / "report").exists()
    assert capsys.readouterr().err.splitlines() == ["config error: --out='': a non-empty path (an unset shell variable?)"]
    monkeypatch.chdir(tmp_path)  # (where a blank --out taken as a path would write)
    for opt in ("--out", "--experiment"):  # the isoFLOP command alone, too
        assert isoflop.main([str(runs), opt, " "]) == 2 and not (runs / "report").exists()
        assert capsys.readouterr().err.splitlines() == [f"config error: {opt}=' ': a non-empty path (an unset shell variable?)"]
    # and an empty RUNS_DIR: was read as the current directory (`mode analyze ''` wrote ./report/)
    for main, allowed in ((report.main, "an existing directory of run directories (or one run directory)"),
                          (isoflop.main, "a directory of run directories (an unset shell variable?)")):
        assert main([""]) == 2 and not (tmp_path / "report").exists()
        assert capsys.readouterr().err.splitlines() == [f"config error: RUNS_DIR='': {allowed}"]
    f = tmp_path / "a_file"
    f.write_text("mine")
    assert report.main([str(runs), "--out", str(f)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"config error: --out={str(f)!r}: a directory for the report (this path is a file)"]

    # reruns: a new directory, then the same one again (its marker), the defaults, one run's report/
    new = tmp_path / "new"
    for _ in range(2):
        assert report.main([str(runs), "--out", str(new)]) == 0
        assert (new / MARKER).is_file() and "dense" in (new / "report.md").read_text()
    for _ in range(2):
        assert report.main([str(runs)]) == 0
        assert (runs / "report" / MARKER).is_file()
        assert report.main([str(runs / "dense_seed0")]) == 0
    (runs / "report" / MARKER).unlink()  # written before the marker existed: report files only, mode's report.md
    assert report.main([str(runs)]) == 0 and (runs / "report" / MARKER).is_file()
    capsys.readouterr()
    (runs / "report" / MARKER).unlink()
    (runs / "report" / "report.md").write_text("# my own report\n")  # the same names, not mode's report
    assert report.main([str(runs)]) == 2
    assert capsys.readouterr().err.startswith(f"config error: --out={str(runs / 'report')!r}: a new or empty")
    assert (runs / "report" / "report.md").read_text() == "# my own report\n"


@pytest.mark.parametrize("content", [b"run: {name: dense}\n\xff\xfe\x00garbage", b"run: [unclosed\n", b"- a list\n"])
def test_a_run_with_an_unreadable_config_yaml_is_left_out_and_the_others_reported(tmp_path, capsys, content):
    """Bug caught: one run's non-UTF-8 config.yaml made `mode analyze` die with UnicodeDecodeError and
    no report at all (an unparsable one was read as an empty config, a variant of its own). The run
    is now left out, named in one stderr line and in the report; the others are reported."""
    runs = tmp_path / "runs"
    _write_run(runs / "dense_seed0", "dense", 0, 2.5)
    _write_run(runs / "dense_seed1", "dense", 1, 2.7)
    _write_run(runs / "mod_seed0", "mod", 0, 2.4)
    (runs / "dense_seed1" / "config.yaml").write_bytes(content)
    assert report.main([str(runs), "--out", str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(tmp_path / "out" / "report.md")
    err = err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: left out 1 run(s) whose config.yaml is unreadable: "
                                               f"{runs / 'dense_seed1'} (config.yaml is not "), err
    md = (tmp_path / "out" / "report.md").read_text()
    assert "**Left out** (1 run(s) whose config.yaml is unreadable" in md and "`dense_seed1` (config.yaml is not" in md
    assert "| `dense` | 1 |" in md and "| `mod` | 1 |" in md and "`dense_seed1` | `dense_seed1`" not in md
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["dense"]["seeds"] == [0] and summary["dense"]["eval_loss"]["mean"] == pytest.approx(2.5)


# ----------------------------------------------------------------------------------------------
# Resumed and damaged event files, written here with torch's SummaryWriter (no training).


def _next_second() -> None:
    """Event files sort by the whole second in their names: a resumed process starts in a later one."""
    import time

    t = int(time.time())
    while int(time.time()) == t:
        time.sleep(0.05)


def test_a_resumed_run_reads_as_an_uninterrupted_one(tmp_path):
    """Bug caught: a process logging every 10 steps died at step 130 after its step-100 checkpoint;
    the resumed one logs every 20 steps from 110. "Latest write per (tag, step) wins" replaced 110
    and 130 but kept the dead process's 120 (and its loss_vs_tokens point), a step the resumed run
    never trained. The resume recorded in run_info.json (as the trainer writes it) drops every
    point written before it past its step (tokens, MFLOPs on those axes)."""
    import time

    from torch.utils.tensorboard import SummaryWriter

    tbd = tmp_path / "tb"
    dead, resumed = {s: 9.0 - s / 100 for s in range(10, 131, 10)}, {s: 5.0 - s / 1000 for s in range(110, 151, 20)}
    resumes = []
    for values in (dead, resumed):
        _next_second()
        if values is resumed:
            resumes.append({"step": 100, "train/tokens_seen": 6400, "train/flops_seen": 6400 * 3e6,
                            "time": time.time()})
        w = SummaryWriter(str(tbd))
        for step, v in values.items():  # as mode/loggers.py writes them: 64 tokens, 192 MFLOPs a step
            w.add_scalar("train/loss", v, step)
            w.add_scalar("train/loss_vs_tokens", v, step * 64)
            w.add_scalar("train/loss_vs_mflops", v, step * 192)
        w.close()
    uninterrupted = {**{s: v for s, v in dead.items() if s <= 100}, **resumed}
    got = tb.read_scalars(tbd, resumes=resumes)
    assert {p.step: p.value for p in got["train/loss"]} == pytest.approx(uninterrupted)
    for tag, per_step in (("train/loss_vs_tokens", 64), ("train/loss_vs_mflops", 192)):
        assert {p.step: p.value for p in got[tag]} == pytest.approx({s * per_step: v for s, v in uninterrupted.items()})
    assert 120 in {p.step for p in tb.read_scalars(tbd)["train/loss"]}  # without the record: the bug


def _record_offsets(data: bytes) -> list[int]:
    """Start of every TFRecord (u64 length, u32 crc, payload, u32 crc) of an intact file."""
    import struct

    out, pos = [], 0
    while pos < len(data):
        out.append(pos)
        pos += 16 + struct.unpack_from("<Q", data, pos)[0]
    return out


@pytest.mark.parametrize("where", ["payload", "length"])
def test_a_damaged_record_in_the_middle_loses_only_itself_and_is_named(tmp_path, capsys, where):
    """Bug caught: flipped bytes in one record in the middle of an event file dropped the rest of
    the file without a word (tensorboard's loader stops at the first bad record): `mode analyze`
    reported the eval loss, logged after it, as missing, exit 0. The reader now skips the damaged
    record, reads on, and names the file on stderr (one line) and in the report; a truncated last
    record (a run killed mid-write) is still read silently."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.compat.proto import event_pb2
    from torch.utils.tensorboard import SummaryWriter

    root = tmp_path / "runs"
    run = root / "dense_seed0"
    _write_run(run, "dense", 0, 2.5)
    shutil.rmtree(run / "tb")  # its event file is written here
    w = SummaryWriter(str(run / "tb"))
    for step in range(1, 21):
        w.add_scalar("train/loss", 4.0 - step / 10, step)
    w.add_scalar("eval/loss", 2.25, 20)
    w.close()
    f = next((run / "tb").glob("events.out.tfevents.*"))
    intact = f.read_bytes()
    acc = EventAccumulator(str(f), size_guidance={"scalars": 0})  # the reference: the intact file
    acc.Reload()
    ref = {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    offsets = _record_offsets(intact)
    i = len(offsets) // 2
    hit = offsets[i]
    lost = event_pb2.Event.FromString(intact[hit + 12:offsets[i + 1] - 4])
    lost_key = (lost.summary.value[0].tag, lost.step)
    assert lost_key[0] == "train/loss" and lost_key in ref
    data = bytearray(intact)
    flip = hit + (2 if where == "length" else 14)  # inside the length field, or inside the payload
    data[flip:flip + 3] = bytes(b ^ 0xFF for b in data[flip:flip + 3])
    f.write_bytes(bytes(data))

    damaged: list[str] = []
    got = {(tag, p.step): p.value for tag, pts in tb.read_scalars(run / "tb", damaged).items() for p in pts}
    assert got == pytest.approx({k: v for k, v in ref.items() if k != lost_key})
    assert len(damaged) == 1 and damaged[0].startswith(f"{f} (") and f"from offset {hit}" in damaged[0]

    assert report.main([str(root), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: 1 event file(s) damaged in the middle: ") and str(f) in err[0]
    md = (tmp_path / "out" / "report.md").read_text()
    assert "**Damaged event files** (1, records lost from the middle)" in md and str(f) in md
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["dense"]["eval_loss"]["mean"] == pytest.approx(ref[("eval/loss", 20)])

    # a half-written last record: read up to it, no warning
    f.write_bytes(intact[:-7])
    damaged = []
    got = {(tag, p.step): p.value for tag, pts in tb.read_scalars(run / "tb", damaged).items() for p in pts}
    assert damaged == [] and got == pytest.approx({k: v for k, v in ref.items() if k != ("eval/loss", 20)})
    assert capsys.readouterr().err == ""


def test_threshold_routers_report_the_threshold_rule_accuracy():
    """Bug caught: a `model.mod.causal=threshold` run, which samples with r - threshold > 0, had its
    router's r > 0 accuracy (router_causal_acc) reported as its causal routing accuracy."""
    import torch

    from mode.config import ModConfig
    from mode.routing.depth import DepthRouter

    torch.manual_seed(0)
    router = DepthRouter(8, ModConfig(causal="threshold"))
    router.threshold.fill_(0.4)
    x = torch.randn(2, 16, 8)
    r = torch.linspace(-1, 1, 32).reshape(2, 16)
    member = (r > 0.3).float()  # top-k membership: the threshold rule gets some right the sign rule gets wrong
    _, m = router.losses(x, r, member)
    assert float(m["threshold_acc"]) != float(m["router_causal_acc"])

    def run_of(metrics: dict) -> tb.RunLog:
        return tb.RunLog(Path("/nonexistent/r"), "mod", 0,
                         scalars={f"mod/layer{i}/{k}": [tb.Point(10, float(v), 0.0)] for i in (1, 3)
                                  for k, v in metrics.items()})

    assert report.causal_routing_acc(run_of(m)) == pytest.approx(float(m["threshold_acc"]))
    assert report.causal_routing_acc(run_of({"router_causal_acc": 0.6})) == pytest.approx(0.6)
    both = {"predictor_acc": 0.9, "threshold_acc": 0.8, "router_causal_acc": 0.6}
    assert report.causal_routing_acc(run_of(both)) == pytest.approx(0.9)


def test_isoflop_leaves_out_runs_not_evaluated_at_their_max_steps(tmp_path):
    """Bug caught: a seed stopped at train.stop_at (or still running) had its last eval loss, at
    an earlier step, averaged with finished seeds' final losses as the loss at its budget."""
    runs = []
    for params, loss in ((1e5, 2.6), (3e5, 2.4), (1e6, 2.5)):
        fpt = 6 * params
        steps = round(1e12 / (3 * fpt * 1000))
        runs.append(fake_run("dense", params, fpt, steps, loss))
        stopped = fake_run("dense", params, fpt, steps, loss + 0.9)  # a second seed, stopped halfway
        stopped.scalars["eval/loss"] = [tb.Point(steps // 2, loss + 0.9, 0.0)]
        runs.append(stopped)
    done = fake_run("dense", 3e5, 6 * 3e5, round(1e12 / (3 * 6 * 3e5 * 1000)), 2.2)
    done.done = True  # a finished third seed of one size
    runs.append(done)
    unfinished: list = []
    points = isoflop.collect_points(runs, unfinished=unfinished)
    assert {p.params: (p.loss, p.n_seeds) for p in points} == {1e5: (2.6, 1), 3e5: (pytest.approx(2.3), 2),
                                                               1e6: (2.5, 1)}
    assert len(unfinished) == 3 and all(not r.done for r in unfinished)
    lines = "\n".join(isoflop.isoflop_section(runs, tmp_path))
    assert "Left out, not evaluated at their `train.max_steps` yet" in lines
    assert all(f"`{r.name}` (eval step {r.last_step('eval/loss')} of {r.cfg('train.max_steps')})" in lines
               for r in unfinished)


def test_figure_links_of_a_variant_named_with_hash_resolve(tmp_path):
    """Bug caught: `![](entropy_vs_blocks_dense#2.png)`: `#2.png` is a URL fragment, the image broken."""
    import torch
    from urllib.parse import unquote, urlsplit

    root = tmp_path / "runs"
    _write_run(root / "a" / "dense_seed0", "dense", 0, 2.0)
    _write_run(root / "b" / "dense_seed0", "dense", 0, 2.2, train__max_steps=7)  # another config: dense#2
    g = torch.Generator().manual_seed(0)
    for d in (root / "a" / "dense_seed0", root / "b" / "dense_seed0"):
        torch.save({"input_ids": torch.randint(0, 256, (2, 16), generator=g),
                    "engaged": torch.rand(2, 2, 16, generator=g) > 0.5, "entropy": torch.rand(2, 16, generator=g),
                    "text": ["x" * 16] * 2}, d / "routing.pt")
    out = tmp_path / "out"
    report.analyze(root, out)
    md = (out / "report.md").read_text()
    links = [line[line.index("](") + 2:-1] for line in md.splitlines() if line.startswith("![")]
    assert any("dense%232" in link for link in links), links
    for link in links:
        u = urlsplit(link)
        assert u.fragment == "" and (out / unquote(u.path)).is_file(), link


def test_expert_work_against_budget_and_the_causal_capacity_mark(tmp_path):
    """The per-variant table compares variants at budgeted FLOPs (experts counted at capacity): a
    dropping MoE shows the expert work it did against that budget, and its causal-routing columns
    are marked: causal evaluation runs its experts dropless, so that gap is dropless − dropping."""
    from torch.utils.tensorboard import SummaryWriter

    from mode.config import load_config
    from mode.mlp import MLP
    from mode.moe.base import MoEBase

    root = tmp_path / "runs"
    moe = {"model__moe__layers": "every_other", "model__moe__top_k": 2, "model__moe__num_experts": 4}
    _write_run(root / "moe_dropping_seed0", "moe_dropping", 0, 2.0, model__moe__capacity_factor=0.75, **moe)
    _write_run(root / "moe_seed0", "moe", 0, 2.1, model__moe__capacity_factor="null", **moe)
    loads = {"moe_dropping": {1: 0.6, 3: 0.7}, "moe": {1: 1.0, 3: 1.0}}
    for v, by_layer in loads.items():
        w = SummaryWriter(str(root / f"{v}_seed0" / "tb"))
        w.add_scalar("eval/loss_causal", 1.9, 10)
        for i, load in by_layer.items():
            w.add_scalar(f"moe/layer{i}/load_mean", load, 10)
        w.close()
    report.analyze(root, tmp_path / "out")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    for v, by_layer in loads.items():  # budgeted expert rows per token from mode's own FLOP count
        cfg = load_config("configs/tiny/dense.yaml", [f"model.moe.{k.split('__')[-1]}={x}" for k, x in moe.items()]
                          + [f"model.moe.capacity_factor={0.75 if v == 'moe_dropping' else 'null'}"]).model
        e = MLP.cost(cfg.d_model, cfg.moe.d_expert or cfg.d_ff, cfg.mlp).flops
        rows = (MoEBase.cost(cfg).flops - 2 * cfg.d_model * (cfg.moe.num_experts + cfg.moe.num_noop_experts)) / e
        assert summary[v]["expert_work"]["mean"] == pytest.approx(np.mean(list(by_layer.values())) * 2 / rows)
    assert summary["moe_dropping"]["expert_work"]["mean"] == pytest.approx(0.65 * 2 / 1.5)
    md = (tmp_path / "out" / "report.md").read_text()
    cells = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]  # noqa: E731
    table = md.split("## Summary per variant", 1)[1].split("\n\n")[1].splitlines()
    head, rows_md = cells(table[0]), {cells(line)[0]: cells(line) for line in table[2:]}
    assert rows_md["`moe_dropping`"][head.index("expert work / budget")] == f"{0.65 * 2 / 1.5:.1%}"
    for name in ("eval loss (causal routing)", "causal − top-k"):
        assert rows_md["`moe_dropping`"][head.index(name)].endswith(" †")
        assert not rows_md["`moe`"][head.index(name)].endswith(" †")  # dropless both ways: a routing gap
    assert "the gap is dropless minus dropping, not a routing-causality gap" in md


def test_mfu_against_different_peaks_is_called_out_and_the_std_is_named(tmp_path):
    """Bug caught (a real 2-seed CPU quickstart grid): the CPU peak is measured at each run's start
    (the best yet on the machine), so seeds of one grid divided by peaks 10x apart. The table showed
    `mod` MFU 17.31% ± 20.54% (seed 0: 31.8% against 0.0119 TFLOP/s, seed 1: 2.8% against 0.121,
    at 517 and 459 tokens/s) with no word, since no run was above 100%. The spread is also the
    sample std (n − 1), which neither the report nor the README said."""
    root = tmp_path / "runs"
    for seed, mfu, peak in ((0, 0.318, 0.0119), (1, 0.028, 0.121)):
        _write_run_with_mfu(root / f"dense_seed{seed}", "dense", seed, 2.0 + seed, mfu, peak)
    report.analyze(root, tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Summary per variant (mean ± sample std over seeds, n − 1)" in md
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["dense"]["eval_loss"]["std"] == pytest.approx(
        np.std([2.0, 3.0], ddof=1))
    assert ("**MFU against different peaks** (TFLOP/s per device, run_info.json): 0.0119: `dense_seed0`; "
            "0.121: `dense_seed1`.") in md, md
    # one peak for all: no note
    for seed in (0, 1):
        p = root / f"dense_seed{seed}" / "run_info.json"
        p.write_text(json.dumps({**json.loads(p.read_text()), "peak_tflops_per_device": 0.121}))
    report.analyze(root, tmp_path / "out")
    assert "MFU against different peaks" not in (tmp_path / "out" / "report.md").read_text()
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "mean ± sample std (n − 1) over seeds" in readme


def test_expert_load_imbalance_is_the_mean_over_seeds_of_each_seeds_imbalance(tmp_path):
    """Bug caught (a real 2-seed CPU quickstart grid): `load max/mean` was the ratio of the seeds'
    mean load_max to their mean load_mean, not the mean of each seed's imbalance as every other
    per-layer column is: mode_integrated layer 1 read 2.09 where its seeds' imbalances were 2.56 and
    1.76 (mean 2.16)."""
    from torch.utils.tensorboard import SummaryWriter

    root = tmp_path / "runs"
    moe = {"model__moe__layers": "every_other", "model__moe__top_k": 2, "model__moe__num_experts": 4,
           "model__moe__capacity_factor": 0.75}
    for seed, mx, mean in ((0, 0.5, 0.2), (1, 0.6, 0.4)):  # imbalances 2.5 and 1.5; ratio of means 1.1 / 0.6
        d = root / f"moe_dropping_seed{seed}"
        _write_run(d, "moe_dropping", seed, 2.0, **moe)
        w = SummaryWriter(str(d / "tb"))
        w.add_scalar("moe/layer1/load_max", mx, 10)
        w.add_scalar("moe/layer1/load_mean", mean, 10)
        w.close()
    assert report.load_imbalance(tb.load_runs(root)) == {"moe_dropping": {1: pytest.approx(2.0)}}
    report.analyze(root, tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    head = next(line for line in md.splitlines() if line.startswith("| variant | layer |"))
    row = next(line for line in md.splitlines() if line.startswith("| `moe_dropping` | 1 |"))
    cells = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]  # noqa: E731
    assert cells(row)[cells(head).index("load max/mean")] == "2.00", (head, row)
    # the table's dropped-token share is of the tokens the MoE layer sees (staged MoDE: the routed ones)
    assert "count only what the MoE layer sees: inside a depth-routed block (staged MoDE)" in " ".join(md.split())


def test_a_seed_with_a_nan_eval_loss_is_not_left_out_of_its_variants_mean(tmp_path):
    """Bug caught: a diverged seed (eval/loss NaN) was read as "not logged": the variant's mean was
    the other seeds' (2 of them) under "3 seeds", so a variant that diverged looked as good as one
    that did not, and the runs table showed "—" for it, as for a run never evaluated."""
    root = tmp_path / "runs"
    losses = (2.0, 2.2, float("nan"))
    for seed, v in enumerate(losses):
        _write_run(root / f"dense_seed{seed}", "dense", seed, v)
    report.analyze(root, tmp_path / "out")

    def strict(c):  # bug caught too: summary.json held bare NaN, which strict JSON readers (JSON.parse) refuse
        raise ValueError(f"not JSON: {c}")

    dense = json.loads((tmp_path / "out" / "summary.json").read_text(), parse_constant=strict)["dense"]
    expect = float(np.mean(np.array(losses, dtype=np.float32), dtype=np.float64))  # TensorBoard stores float32
    assert math.isnan(expect) and dense["eval_loss"]["mean"] is None and dense["eval_loss"]["n"] == len(losses)
    assert [r["eval_loss"] for r in dense["runs"]][2] is None  # null, as in metrics.jsonl
    md = (tmp_path / "out" / "report.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| `dense` |"))
    assert "| nan |" in row and "2.1000" not in row, row
    assert "| `dense_seed2` | `dense_seed2` | `dense` | 2 | 10 | yes | nan |" in md


def test_isoflop_a_diverged_size_is_no_point_and_not_the_optimum(tmp_path):
    """Bug caught: a run whose final eval loss was NaN (diverged) was an isoFLOP point: the parabola
    fit through it was all NaN, and the fallback (argmin, which returns a NaN's index) named the
    diverged size the loss-optimal one, with loss nan."""
    sizes = {1e5: 2.6, 3e5: float("nan"), 1e6: 2.5, 3e6: 2.7}
    runs = []
    for params, loss in sizes.items():
        fpt = 6 * params
        runs.append(fake_run("dense", params, fpt, round(1e12 / (3 * fpt * 1000)), loss))
    finite = {p: v for p, v in sizes.items() if math.isfinite(v)}
    x, y = np.log10(list(finite)), np.array(list(finite.values()))
    c = np.linalg.lstsq(np.stack([x ** 2, x, np.ones_like(x)], 1), y, rcond=None)[0]  # the parabola, independently
    xv = -c[1] / (2 * c[0])
    assert c[0] > 0 and x.min() < xv < x.max()
    diverged: list = []
    (opt,) = isoflop.optima(isoflop.collect_points(runs, diverged=diverged))
    assert (opt.method, opt.params, opt.loss) == ("parabola", pytest.approx(10 ** xv),
                                                  pytest.approx(np.polyval(c, xv)))
    assert [r.info["params"] for r in diverged] == [3e5]
    lines = "\n".join(isoflop.isoflop_section(runs, tmp_path))
    assert f"Left out, final eval loss not finite (diverged): `{diverged[0].name}` (nan)" in lines


def test_isoflop_a_run_far_from_every_named_budget_is_not_put_under_one(tmp_path):
    """Bug caught: with `budgets: [1e12, 3e12]`, a run of the same curve trained at 1e14 (another
    experiment's, sharing runs_dir) went under 3e12, the nearest, and was named that budget's
    loss-optimal size (3e6 params at loss 1.9): the 33x larger budget's loss read as a 3e12 result."""
    grid = {1e5: 2.6, 3e5: 2.4, 1e6: 2.5}
    runs = []
    for params, loss in grid.items():
        fpt = 6 * params
        runs.append(fake_run("dense", params, fpt, round(1e12 / (3 * fpt * 1000)), loss))
    far = fake_run("dense", 3e6, 6 * 3e6, round(1e14 / (3 * 6 * 3e6 * 1000)), 1.9)
    runs.append(far)
    points = isoflop.collect_points(runs, budgets=[1e12, 3e12])
    assert {p.params: p.budget for p in points} == {1e5: 1e12, 3e5: 1e12, 1e6: 1e12,
                                                   3e6: pytest.approx(isoflop.training_budget(far))}
    x, y = np.log10(list(grid)), np.array(list(grid.values()))
    c = np.linalg.lstsq(np.stack([x ** 2, x, np.ones_like(x)], 1), y, rcond=None)[0]  # the 1e12 parabola alone
    opts = {o.budget: o for o in isoflop.optima(points)}
    assert 3e12 not in opts and opts[1e12].params == pytest.approx(10 ** (-c[1] / (2 * c[0])))
    # a run meant for a named budget but sized approximately still goes under it
    assert isoflop.assign_budgets([0.82e12, 1.2e12, 2.5e12], [1e12, 3e12]) == [1e12, 1e12, 3e12]


def test_a_cell_over_fewer_seeds_than_the_variant_has_says_how_many(tmp_path):
    """Bug caught: a seed not evaluated yet (it just started) left the eval-loss mean, which the
    table showed under "3 seeds" with nothing to say it was the mean of 2."""
    from torch.utils.tensorboard import SummaryWriter

    root = tmp_path / "runs"
    losses = {0: 2.0, 1: 2.3}
    for seed, v in losses.items():
        _write_run(root / f"dense_seed{seed}", "dense", seed, v)
    d = root / "dense_seed2"
    _write_run(d, "dense", 2, 9.9)
    shutil.rmtree(d / "tb")
    (d / "DONE").unlink()
    w = SummaryWriter(str(d / "tb"))  # still running: logged a training step, no evaluation yet
    w.add_scalar("train/loss", 5.0, 1)
    w.close()
    report.analyze(root, tmp_path / "out")
    dense = json.loads((tmp_path / "out" / "summary.json").read_text())["dense"]
    vals = np.array(list(losses.values()), dtype=np.float32).astype(np.float64)  # TensorBoard stores float32
    assert dense["seeds"] == [0, 1, 2] and dense["eval_loss"]["n"] == 2
    md = (tmp_path / "out" / "report.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| `dense` |"))
    assert f"| {vals.mean():.4f} ± {vals.std(ddof=1):.4f} (n=2) |" in row, row
    assert "| 1k |" in row, row  # every seed has it: no count


def test_runs_of_different_tokenizers_or_evaluation_text_are_named_in_the_report(tmp_path):
    """Bug caught: a report over runs of two tokenizers (or two validation sets) put their nats per
    token side by side in one table, with nothing saying the numbers are on different scales."""
    root = tmp_path / "runs"
    _write_run(root / "a_seed0", "a", 0, 2.0)
    _write_run(root / "b_seed0", "b", 0, 2.0)
    _write_run(root / "c_seed0", "c", 0, 2.0, data__val_fraction=0.1)
    for name, sha in (("a", "1" * 64), ("b", "2" * 64), ("c", "1" * 64)):
        info = json.loads((root / f"{name}_seed0" / "run_info.json").read_text())
        (root / f"{name}_seed0" / "run_info.json").write_text(json.dumps({**info, "tokenizer_sha256": sha}))
    report.analyze(root, tmp_path / "out")
    md = " ".join((tmp_path / "out" / "report.md").read_text().split())
    assert "**Different tokenizers**: `a_seed0`, `c_seed0`; `b_seed0`" in md, md
    assert "**Different evaluation text**: `a_seed0`, `b_seed0`; `c_seed0`" in md, md
    # one tokenizer and one eval text: nothing said
    solo = tmp_path / "solo"
    _write_run(solo / "a_seed0", "a", 0, 2.0)
    _write_run(solo / "a_seed1", "a", 1, 2.1)
    report.analyze(solo, tmp_path / "out2")
    assert "**Different" not in (tmp_path / "out2" / "report.md").read_text()


def test_seeds_evaluated_at_different_steps_show_the_steps_read(tmp_path):
    """Bug caught: a seed with another train.eval_every had no evaluation at the variant's eval step
    (20) and was read at its last one before it (15), while the table said `20`: a mean of losses
    at two steps passed off as one step's."""
    from torch.utils.tensorboard import SummaryWriter

    root = tmp_path / "runs"
    evals = ({10: 3.0, 20: 2.5}, {15: 2.9, 30: 2.2})  # seed 0 stopped at 20; seed 1 evaluates every 15
    for seed, pts in enumerate(evals):
        d = root / f"dense_seed{seed}"
        _write_run(d, "dense", seed, 9.9)
        shutil.rmtree(d / "tb")
        w = SummaryWriter(str(d / "tb"))
        for step, v in pts.items():
            w.add_scalar("eval/loss", v, step)
        w.close()
    report.analyze(root, tmp_path / "out")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())["dense"]
    assert summary["eval_step"] == 20 and [r["eval_step"] for r in summary["runs"]] == [20, 15]
    assert summary["eval_loss"]["mean"] == pytest.approx((2.5 + 2.9) / 2, rel=1e-6)
    row = next(line for line in (tmp_path / "out" / "report.md").read_text().splitlines()
               if line.startswith("| `dense` |"))
    assert row.startswith("| `dense` | 2 | 15–20 |"), row


def test_a_reports_figures_no_longer_shown_are_removed_and_colours_stay_distinct(tmp_path):
    """Bugs caught: a report rewritten after its variants were renamed (`dense` -> `dense#1`) kept the
    old `routing_heatmap_dense.png` beside the new ones, unreferenced; beyond 10 variants two shared a
    colour (C0..C9 cycled), and seeds 0 and 2 of a variant had the same line style."""
    from urllib.parse import quote

    from analysis.tb import variant_colors

    root, out = tmp_path / "runs", tmp_path / "out"
    _write_run(root / "dense_seed0", "dense", 0, 2.0)
    report.analyze(root, out)
    for name in ("routing_heatmap_olddense.png", "entropy_vs_blocks_olddense.png", "loss_vs_time.png"):
        (out / name).write_bytes(b"an earlier report's figure")
    (out / "mine.png").write_bytes(b"not a report figure name: kept")
    report.analyze(root, out)
    names = {p.name for p in out.iterdir()}
    assert "routing_heatmap_olddense.png" not in names and "entropy_vs_blocks_olddense.png" not in names
    assert "mine.png" in names
    md = (out / "report.md").read_text()
    for name in names - {"mine.png"}:  # every figure left is one the report shows
        assert not name.endswith(".png") or f"]({quote(name)})" in md, name
    colors = variant_colors([f"v{i}" for i in range(15)])
    assert len(set(colors.values())) == 15
    assert len(set(report.SEED_STYLES)) == len(report.SEED_STYLES) >= 3


def test_a_figure_the_disk_refuses_leaves_the_earlier_one_whole(tmp_path, monkeypatch):
    """Bug caught (fault walkthrough, a full disk): `mode analyze` rewrote its figures in place, so a
    report rewritten onto a full disk left loss_vs_step.png cut at 40 KB ("image file is truncated")
    under the earlier report.md. Now written beside and renamed: the earlier figure stays whole.
    A real refused write: RLIMIT_FSIZE (EFBIG past 4 KB)."""
    import resource
    import signal

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from analysis.outdir import save_figure

    path = tmp_path / "loss_vs_step.png"
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([0, 1], [1, 0])
    save_figure(fig, path, dpi=50)
    good = path.read_bytes()
    fig, ax = plt.subplots(figsize=(12, 8))  # a bigger figure: past the limit
    ax.plot(np.random.default_rng(0).normal(size=2000))
    limit, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (max(4096, len(good) + 1), limit[1]))
        with pytest.raises(OSError):
            save_figure(fig, path, dpi=110)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
        plt.close("all")
    assert path.read_bytes() == good and sorted(p.name for p in tmp_path.iterdir()) == ["loss_vs_step.png"]


def test_the_sample_window_text_is_the_window_with_any_tokenizer():
    """Bug caught: with a non-byte tokenizer the report printed the dumped row's whole text (2048
    tokens at seq_len 2048) under "Sample sequence (row 0, first 64 tokens)"."""
    import numpy as np

    from analysis import routing as rt

    S = 200
    ids = np.arange(1000, 1000 + S)[None]  # ids above 255: not the byte tokenizer
    pieces = [f" w{i}" for i in range(S)]
    dump = rt.RoutingDump(ids, np.ones((2, 1, S), bool), np.zeros((1, S)), ["".join(pieces)], [pieces])
    assert rt.window_text(dump, 0, 0, 64) == "".join(pieces[:64])
    assert rt.window_text(dump, 0, 10, 5) == " w10 w11 w12 w13 w14"
    byte = rt.RoutingDump(np.frombuffer(b"hello world", np.uint8).astype(np.int64)[None], np.ones((1, 1, 11), bool),
                          np.zeros((1, 11)), ["hello world"])
    assert rt.window_text(byte, 0, 0, 5) == "hello"

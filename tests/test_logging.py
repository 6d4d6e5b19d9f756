"""Runs a researcher can read (#15): efficiency metrics, loggers, console, honest resumes,
activation checkpointing. The slow tests drive the real CLI and DeepSpeed launcher."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.util import PY, ROOT, TINY, deepspeed_train, env, mode_cli, scalars, side_by_side

CFG = "configs/tiny/dense.yaml"
STEPS = ["train.max_steps=6", "train.log_every=2", "train.eval_every=3", "optim.warmup_steps=2"]


def snapshot(d: Path) -> dict:
    """Every file below d with its size and modification time: what 'writes nothing' compares."""
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(d.rglob("*"))}


def tb_tags(run: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for f in sorted((run / "tb").glob("events.out.tfevents.*")):
        ea = EventAccumulator(str(f), size_guidance={"scalars": 0, "tensors": 0})
        ea.Reload()
        for tag in ea.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in ea.Scalars(tag)})
    return out


def tb_text(run: Path) -> dict[str, list[str]]:
    """Text summaries (tag -> strings) and the hparams plugin's presence."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[str]] = {}
    for f in sorted((run / "tb").glob("events.out.tfevents.*")):
        ea = EventAccumulator(str(f), size_guidance={"tensors": 0})
        ea.Reload()
        for tag in ea.Tags()["tensors"]:
            vals = [e.tensor_proto.string_val[0].decode() for e in ea.Tensors(tag) if e.tensor_proto.string_val]
            out.setdefault(tag, []).extend(vals)
        try:
            if ea.PluginTagToContent("hparams"):
                out.setdefault("_hparams", []).append("yes")
        except KeyError:  # no hparams in this file
            pass
    return out


def readme_logged_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("### What gets logged")
    return text[start:text.index("\n## ", start)]


def documented_tags() -> set[str]:
    return set(re.findall(r"^\| `([^`]+)` \|", readme_logged_section(), flags=re.M))


def generic(tag: str) -> str:
    return re.sub(r"/layer\d+/", "/layerN/", tag)


# ----------------------------------------------------------------------------------------------
# Fast: hand computations and the README's list.


def test_efficiency_is_training_flops_over_peak():
    from mode.metrics import efficiency

    # 2 devices, 1e5 tokens/s in all, 1e6 forward FLOPs/token: 3e11 training FLOP/s = 0.15 TFLOP/s per device
    e = efficiency(1e5, 1e6, 2, 0.5)
    assert e["perf/tflops_per_device"] == pytest.approx(0.15, rel=1e-12)
    assert e["perf/mfu"] == pytest.approx(0.3, rel=1e-12)


@pytest.mark.parametrize("name,precision,peak", [("NVIDIA H200", "bf16", 989.0), ("NVIDIA H100 80GB HBM3", "fp32", 67.0),
                                                  ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
                                                  ("NVIDIA A100-SXM4-40GB", "fp32", 19.5),
                                                  # lower-clocked parts of a family: not the SXM peak
                                                  ("NVIDIA H100 PCIe", "bf16", 756.0), ("NVIDIA H100 NVL", "fp32", 60.0),
                                                  ("NVIDIA H200 NVL", "bf16", 835.0)])
def test_gpu_peak_is_the_datasheet_value_for_the_precision(monkeypatch, name, precision, peak):
    """The MFU denominator on a GPU: NVIDIA's dense (no sparsity) tensor-core bf16 / plain fp32
    TFLOP/s of the SXM parts, chosen by deepspeed.precision. An unknown GPU gives NaN and says so."""
    from mode.metrics import default_peak_tflops

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    got, src = default_peak_tflops(precision)
    assert got == peak and precision in src
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100-SXM2-32GB")
    got, src = default_peak_tflops(precision)
    assert got != got and "perf.peak_tflops" in src


def test_measured_cpu_peak_is_plausible():
    from mode.metrics import measure_matmul_tflops

    t = measure_matmul_tflops(seconds=0.05, n=128)
    assert 1e-4 < t < 10  # one core: between 0.1 GFLOP/s and 10 TFLOP/s


def test_cpu_peak_is_the_best_measured_on_this_machine(tmp_path):
    """Bug caught: a peak measured while other jobs held the cores was 6x too low and MFU read
    over 100%. The peak is the best of this run's measurement and the earlier ones (kept in the
    virtualenv), so one busy moment cannot deflate it; a damaged cache is ignored, not trusted."""
    import json

    from mode.metrics import cpu_peak_tflops

    cache = tmp_path / "mode_cpu_peak.json"
    assert cpu_peak_tflops(0.12, cache)[0] == 0.12  # first run: its own measurement, remembered
    peak, src = cpu_peak_tflops(0.02, cache)  # a busy moment
    assert peak == 0.12 and "0.02 this run" in src
    assert cpu_peak_tflops(0.15, cache)[0] == 0.15 and max(json.loads(cache.read_text()).values()) == 0.15
    cache.write_text("{not json")
    assert cpu_peak_tflops(0.05, cache)[0] == 0.05
    assert cpu_peak_tflops(0.07, None)[0] == 0.07  # outside a virtualenv: nothing kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mode_cpu_peak.json"]  # no temporary left


@pytest.mark.parametrize("native", [False, True])
def test_cpu_peak_of_a_bf16_run_is_measured_in_the_gemms_it_runs(tmp_path, monkeypatch, native):
    """Bug caught: on a CPU with bf16 GEMM kernels (avx512_bf16, AMX: ~2-4x fp32's rate) a bf16 run's
    MFU was measured against the fp32 matmul peak, so it read high. The peak is measured in the
    dtype the step's GEMMs run in (fp32 without bf16 kernels: Fp32Gemms) and remembered apart."""
    import mode.engine
    import mode.metrics as m

    seen = []
    monkeypatch.setattr(mode.engine, "native_bf16_gemms", lambda dev: native)
    monkeypatch.setattr(m, "peak_cache", lambda: tmp_path / "mode_cpu_peak.json")
    real = m.measure_matmul_tflops
    monkeypatch.setattr(m, "measure_matmul_tflops", lambda **kw: (seen.append(kw.get("dtype")), real(0.02, 64, **kw))[1])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _, src = m.default_peak_tflops("bf16")
    assert seen == [torch.bfloat16 if native else torch.float32]
    assert src.startswith(f"measured {'bf16' if native else 'fp32'} matmul"), src
    m.default_peak_tflops("fp32")
    assert seen[-1] == torch.float32
    cache = tmp_path / "c.json"  # a bf16 peak never stands in for the fp32 one, nor the reverse
    assert m.cpu_peak_tflops(0.5, cache, "bf16")[0] == 0.5 and m.cpu_peak_tflops(0.1, cache)[0] == 0.1


def test_prepare_progress_in_a_log_file_is_plain_lines(tmp_path, capsys):
    """Bug caught: with output redirected to a file (every cluster job), preparing the data at the
    start of a run wrote tqdm's carriage-return redraws into the log. Now: plain lines, the last
    one counting every token encoded (the manifest's train + validation tokens)."""
    from mode.config import load_config
    from mode.prepare import prepare, read_manifest

    cfg = load_config(CFG, [*TINY, "data.num_workers=1", f"data.prepared_dir={tmp_path}"])  # 1: in-process
    path = prepare(cfg.data, progress=True)  # under capsys stderr is not a terminal
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("prepare ") and lines[0].endswith(", done"), lines
    splits = read_manifest(path)["splits"]
    assert int(re.search(r": ([\d,]+) tokens", lines[0]).group(1).replace(",", "")) == sum(
        splits[s]["tokens"] for s in ("train", "val"))


def test_the_training_bar_only_when_both_streams_are_a_terminal(monkeypatch):
    """Bug caught: the bar was chosen when stdout was a terminal but drawn on stderr: with stderr
    redirected to a file (`2> err.txt`) the file filled with redraws and the terminal showed no
    progress. Real terminals here (a pseudo-terminal), not a patched isatty."""
    import io
    import os
    import sys

    from mode.console import use_bar

    master, slave = os.openpty()
    with os.fdopen(slave, "w") as tty:
        for out, err, want in ((tty, tty, True), (tty, io.StringIO(), False), (io.StringIO(), tty, False)):
            monkeypatch.setattr(sys, "stdout", out)
            monkeypatch.setattr(sys, "stderr", err)
            assert use_bar(True) is want and use_bar(False) is False
    os.close(master)


@pytest.mark.slow
def test_a_run_on_a_terminal_shows_its_evaluations_above_the_bar(tmp_path):
    """Bug caught (README walkthrough): on a terminal (the tqdm bar) the evaluation losses were never
    printed: the bar's postfix has the training loss only, the eval line was for logs alone. Run on a
    real pseudo-terminal (stdout and stderr), as a user's shell gives it."""
    import os
    import time

    master, slave = os.openpty()
    proc = subprocess.Popen([PY, "-m", "mode.cli", "train", "--config", "configs/tiny/dense.yaml", *TINY,
                             "log.progress=true", "train.max_steps=4", "train.eval_every=2", f"run.dir={tmp_path / 'r'}"],
                            cwd=ROOT, env=env(1), stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    out = b""
    end = time.monotonic() + 300
    while time.monotonic() < end:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the process closed its side
            break
        if not chunk:
            break
        out += chunk
    proc.wait(timeout=60)
    os.close(master)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    assert re.search(r"step 2/4 \| eval/loss \d", text) and re.search(r"step 4/4 \| eval/loss \d", text), text[-3000:]


def test_readme_documents_every_model_metric():
    """Every per-layer tag any preset's forward emits is in README's "What gets logged", decoupled
    routing's included: its `mod_attn/`, `mod_mlp/` tags by the README's rule that they repeat the
    `mod/` rows (bug caught: a decoupled preset failed this test, which read only table rows); and
    every per-layer row the README documents is emitted by one of them (no stale rows)."""
    from mode.config import load_config
    from mode.model import build_model

    docs = documented_tags()
    rule = "logs the same `mod/` tags per sublayer under\n`mod_attn/layerN/` and `mod_mlp/layerN/`"
    assert rule in readme_logged_section()
    docs |= {t.replace("mod/", f"{p}/", 1) for t in docs if t.startswith("mod/") for p in ("mod_attn", "mod_mlp")}
    cases = [(p, []) for p in sorted((ROOT / "configs/tiny").glob("*.yaml"))]
    cases.append((ROOT / "configs/tiny/mod.yaml", ["model.mod.decoupled=true", "model.mod.attn_capacity=0.5"]))
    cases.append((ROOT / "configs/tiny/mod.yaml", ["model.mod.causal=threshold"]))
    emitted = set()
    for preset, over in cases:
        cfg = load_config(preset, ["model.d_model=32", "model.n_heads=2", "model.d_ff=64", "data.seq_len=16", *over])
        torch.manual_seed(0)
        model = build_model(cfg.model).train()
        x = torch.randint(0, 256, (2, 16))
        out = model(x, x)
        assert out.metrics or preset.name == "dense.yaml", preset.name
        missing = {generic(k) for k in out.metrics} - docs
        assert not missing, f"{preset.name} {over}: undocumented tags {missing}"
        emitted |= {generic(k) for k in out.metrics}
    stale = {t for t in documented_tags() if "/layerN/" in t} - emitted
    assert not stale, f"README documents per-layer tags no model emits: {stale}"


def test_continue_command_of_a_multi_process_run_keeps_its_world_size(monkeypatch):
    """Bug caught: a 2-rank run stopped by train.stop_at offered a single-process `mode train`
    command to continue, which the world-size check then refuses; and the command kept
    run.fresh=true, so running it deleted the run it was to continue."""
    from mode.console import continue_command

    # run.fresh=true in the command that continues would delete what the stopped start trained
    args = ["run.dir=r", "train.stop_at=4", "run.fresh=true", "train.max_steps=8"]
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert continue_command("c.yaml", args) == "mode train --config c.yaml run.dir=r train.max_steps=8 train.stop_at=0"
    # run.fresh: true in the config file itself: the command turns it off
    assert continue_command("c.yaml", args, fresh=True).endswith("train.stop_at=0 run.fresh=false")
    monkeypatch.setenv("WORLD_SIZE", "2")
    msg = continue_command("c.yaml", args)
    assert "mode train" not in msg and "single process" not in msg
    assert "2-process launch command" in msg and msg.endswith("--config c.yaml run.dir=r train.max_steps=8 train.stop_at=0")


def test_a_trainer_under_compare_names_the_compare_command_to_continue(monkeypatch):
    """Bug caught: under `mode compare` a trainer stopped at train.stop_at offered a `mode train`
    of its one run (beside compare's own line naming the grid's command). Compare hands its
    command down (MODE_CONTINUE_COMMAND; test_compare runs it end to end)."""
    from mode.console import continue_command

    monkeypatch.delenv("MODE_CONTINUE_COMMAND", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert continue_command("c.yaml", ["train.stop_at=4"]).startswith("mode train ")
    monkeypatch.setenv("MODE_CONTINUE_COMMAND", "mode compare 'my grid.yaml'")
    for world in ("1", "2"):
        monkeypatch.setenv("WORLD_SIZE", world)
        assert continue_command("c.yaml", ["train.stop_at=4"], fresh=True) == "mode compare 'my grid.yaml'"


# ----------------------------------------------------------------------------------------------
# Activation checkpointing.


def _grads_and_saved_bytes(ckpt: bool, **over):
    from mode.config import load_config
    from mode.model import build_model

    args = ["model.d_model=64", "model.n_heads=4", "model.d_ff=256", "model.n_layers=4", "data.seq_len=64",
            *(f"{k}={v}" for k, v in over.items())]
    cfg = load_config(CFG, args)
    torch.manual_seed(0)
    model = build_model(cfg.model).train()
    model.activation_checkpointing = ckpt
    torch.manual_seed(1)
    x = torch.randint(0, 256, (4, 64))
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    torch.manual_seed(2)  # routing randomness (jitter, stochastic top-k) identical in both runs
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x, x)
        (out.loss + out.aux_loss).backward()
    return out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, sum(saved)


@pytest.mark.parametrize("variant", [{}, {"model.mod.layers": "every_other", "model.mod.capacity": 0.25},
                                     {"model.moe.layers": "every", "model.moe.num_experts": 4,
                                      "model.moe.jitter": 0.1}])
def test_activation_checkpointing_same_numbers_less_saved_memory(variant):
    loss_a, grads_a, bytes_a = _grads_and_saved_bytes(False, **variant)
    loss_b, grads_b, bytes_b = _grads_and_saved_bytes(True, **variant)
    assert loss_a == loss_b
    for n in grads_a:
        torch.testing.assert_close(grads_b[n], grads_a[n], rtol=1e-5, atol=1e-7, msg=n)
    # activations kept for backward: each block keeps only its input [B, S, D] instead of its internals
    assert bytes_b < 0.5 * bytes_a, (bytes_a, bytes_b)


def test_activation_checkpointing_rerun_leaves_the_modules_as_the_forward_left_them():
    # Bug caught: the re-run of each block in backward recorded its own aux_loss / last_routing on
    # the routed modules, and their graph kept every routed block's recomputed activations (the
    # attention's q, k, v, the router and predictor inputs) alive until the next forward.
    from mode.config import load_config
    from mode.model import build_model
    from mode.routed import Routed

    cfg = load_config("configs/tiny/mode_staged.yaml", ["model.d_model=32", "model.n_heads=2", "model.d_ff=64"])
    torch.manual_seed(0)
    model = build_model(cfg.model).train()
    model.activation_checkpointing = True
    out = model(*[torch.randint(0, 256, (2, 32))] * 2)
    routed = [m for m in model.modules() if isinstance(m, Routed)]
    left = [(m.aux_loss, getattr(m, "last_routing", None)) for m in routed]
    assert all(a is None for a, _ in left)  # the LM took the losses (no autograd state survives a call)
    (out.loss + out.aux_loss).backward()
    after = [(m.aux_loss, getattr(m, "last_routing", None)) for m in routed]
    assert all(a is b for pair, pair2 in zip(left, after) for a, b in zip(pair, pair2))  # the very same objects
    assert any(r is not None for _, r in left)  # sanity: the MoE layers recorded their routing


PEAK_RSS = """
import json, resource, sys, torch
from mode.config import load_config
from mode.model import build_model
cfg = load_config("configs/tiny/dense.yaml", ["model.d_model=256", "model.n_heads=4", "model.d_ff=1024",
                  "model.n_layers=4", "data.seq_len=1024", "model.max_seq_len=1024"])
torch.manual_seed(0)
model = build_model(cfg.model).train()
model.activation_checkpointing = sys.argv[1] == "block"
x = torch.randint(0, 256, (4, 1024))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux: model, weights, torch
out = model(x, x)
(out.loss + out.aux_loss).backward()
print(json.dumps({"loss": out.loss.item(), "before": before, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


@pytest.mark.slow
def test_activation_checkpointing_lowers_the_peak_memory_of_a_step():
    """The process's real peak RSS over one forward + backward (each setting in a fresh process,
    d_model 256, S 1024, batch 4): the saved activations above are what checkpointing removes,
    and the allocator must actually give that memory back at the peak (measured: +618 MB -> +427 MB)."""
    def peak(mode):
        r = subprocess.run([PY, "-c", PEAK_RSS, mode], cwd=ROOT, env=env(1), capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    plain, ckpt = side_by_side(lambda: peak("none"), lambda: peak("block"))
    assert plain["loss"] == ckpt["loss"]
    grew_plain, grew_ckpt = plain["peak"] - plain["before"], ckpt["peak"] - ckpt["before"]
    assert grew_ckpt < 0.8 * grew_plain, (grew_plain, grew_ckpt)


@pytest.mark.slow
def test_activation_checkpointing_trains_identically(tmp_path):
    common = [*TINY, *STEPS, "model.mod.layers=every_other"]
    side_by_side(lambda: mode_cli("train", "--config", CFG, *common, f"run.dir={tmp_path / 'plain'}", threads=1),
                 lambda: mode_cli("train", "--config", CFG, *common, "train.activation_checkpointing=block",
                                  f"run.dir={tmp_path / 'ac'}", threads=1))
    a, b = scalars(tmp_path / "plain", "train/loss"), scalars(tmp_path / "ac", "train/loss")
    assert list(a) == [2, 4, 6] and a == b  # fp32: bit for bit
    assert scalars(tmp_path / "plain", "eval/loss") == scalars(tmp_path / "ac", "eval/loss")


# ----------------------------------------------------------------------------------------------
# One 2-process run checked from every side.


@pytest.fixture(scope="module")
def two_proc_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("logging") / "run"
    r = deepspeed_train(2, CFG, *TINY, *STEPS, "log.progress=true", "train.micro_batch_size=2",
                        "perf.peak_tflops=0.05", "model.mod.layers=every_other", f"run.dir={run}")
    return run, r.stdout


@pytest.mark.slow
def test_mfu_and_tflops_equal_hand_computation(two_proc_run):
    run, _ = two_proc_run
    info = json.loads((run / "run_info.json").read_text())
    assert info["world_size"] == 2 and info["peak_tflops_per_device"] == 0.05
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "perf/mfu" in r]
    assert [r["step"] for r in logged] == [2, 4, 6]
    for r in logged:
        tflops = 3 * info["forward_flops_per_token"] * r["perf/tokens_per_s"] / 2 / 1e12
        assert r["perf/tflops_per_device"] == pytest.approx(tflops, rel=1e-9)
        assert r["perf/mfu"] == pytest.approx(tflops / 0.05, rel=1e-9)
        assert r["train/tokens_seen"] == r["step"] * info["tokens_per_step"]
        assert r["train/flops_seen"] == pytest.approx(3 * info["forward_flops_per_token"] * r["train/tokens_seen"])
        assert 0.05 < r["perf/memory_gb"] < 64  # peak RSS of a CPU rank
    tb = tb_tags(run)
    # loss against tokens: the same values, tokens as the step
    assert tb["train/loss_vs_tokens"] == {r["train/tokens_seen"]: pytest.approx(r["train/loss"]) for r in logged}
    assert set(tb["eval/loss_vs_tokens"]) == {0, 3 * info["tokens_per_step"], 6 * info["tokens_per_step"]}


@pytest.mark.slow
def test_metrics_jsonl_matches_tensorboard(two_proc_run):
    run, _ = two_proc_run
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)) == [0, 2, 3, 4, 6]  # one line per logged step
    tb = tb_tags(run)
    n = 0
    for r in rows:
        for tag, v in r.items():
            if tag != "step":
                assert tb[tag][r["step"]] == pytest.approx(v, rel=1e-6, abs=1e-30), (tag, r["step"])
                n += 1
    assert n == sum(len(s) for t, s in tb.items() if "_vs_" not in t)  # and nothing in TB that JSONL lacks


@pytest.mark.slow
def test_config_goes_to_tensorboard_and_every_tag_is_documented(two_proc_run):
    run, _ = two_proc_run
    text = tb_text(run)
    cfg_text = next(v for k, v in text.items() if k.startswith("config"))[0]
    assert "max_steps: 6" in cfg_text and "world_size: 2" in cfg_text
    assert "_hparams" in text
    undocumented = {generic(t) for t in tb_tags(run)} - documented_tags()
    assert not undocumented, undocumented
    # and no stale row: every run-level tag the README lists is logged (per-layer rows: the fast test)
    stale = {t for t in documented_tags() if "/layerN/" not in t} - {generic(t) for t in tb_tags(run)}
    assert not stale, stale


@pytest.mark.slow
def test_console_without_a_terminal(two_proc_run):
    _, out = two_proc_run
    assert "\r" not in out  # no tqdm redraws in a log file
    assert re.search(r"params +[\d,]+ total, [\d,]+ active per token", out)
    assert re.search(r"FLOPs +\S+ forward per token", out) and "2 rank(s) on 1 node(s)" in out
    lines = [line for line in out.splitlines() if re.search(r"step \d/6 \| loss", line)]
    assert [line.split()[1] for line in lines] == ["2/6", "4/6", "6/6"]
    assert "MFU" in lines[0] and "tok/s" in lines[0]
    assert "finished at step 6" in out


# ----------------------------------------------------------------------------------------------
# Honest resumes.


@pytest.fixture(scope="module")
def stopped_at_2(tmp_path_factory):
    """A single-process run stopped at step 2 of 6 and what it printed; tests resume copies of it."""
    run = tmp_path_factory.mktemp("stopped") / "run"
    r = mode_cli("train", "--config", CFG, *TINY, *STEPS, f"run.dir={run}", "train.stop_at=2")
    return run, r.stdout


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, copy_function=shutil.copy2)  # copy2: modification times too (snapshot)
    return dst


@pytest.mark.slow
def test_stop_at_says_how_to_continue_and_schedule_change_is_refused(tmp_path, stopped_at_2):
    src, stdout = stopped_at_2
    run = copy_run(src, tmp_path / "run")
    args = ["--config", CFG, *TINY, *STEPS, f"run.dir={run}"]
    m = re.search(r"stopped at step 2 of 6 \(train.stop_at=2\).*with: (mode train .*)$", stdout, flags=re.M)
    assert m and "train.stop_at=2" not in m.group(1) and "train.stop_at=0" in m.group(1), stdout
    assert f"run.dir={src}" in m.group(1)

    before = snapshot(run)
    r = mode_cli("train", *args, "train.max_steps=12", check=False)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: train.max_steps=12:"), r.stderr
    assert "allow_schedule_change" in lines[0] and "Traceback" not in r.stderr
    assert snapshot(run) == before

    # Bug caught: a schedule ending at or before the resumed step trained nothing and wrote a DONE
    # without final metrics (at 2), or exited 0 having done nothing (below 2)
    for end in (2, 1):
        r = mode_cli("train", *args, f"train.max_steps={end}", "train.allow_schedule_change=true", check=False)
        assert r.returncode == 2 and r.stderr.startswith(f"config error: train.max_steps={end}: more than 2,"), r.stderr
        assert snapshot(run) == before

    # allowed: the LR follows the new schedule from the resumed step, and the change is logged.
    # Bug caught: the loaded scheduler state kept the checkpoint's optim.lr as its base: a new peak LR
    # was logged as applied and the old one trained on (3e-3 for the 1.5e-3 asked for here)
    r = mode_cli("train", *args, "train.max_steps=12", "optim.lr=0.0015", "train.allow_schedule_change=true")
    assert "schedule changed at resumed step 2: train.max_steps 6 -> 12, optim.lr 0.003 -> 0.0015" in r.stdout
    from mode.config import load_config
    from mode.engine import lr_lambda

    cfg = load_config(CFG, [*TINY, *STEPS, "train.max_steps=12", "optim.lr=0.0015"])
    lr = scalars(run, "train/lr")
    for step in (4, 8, 12):  # the scheduler has stepped `step` times
        assert lr[step] == pytest.approx(cfg.optim.lr * lr_lambda(cfg)(step), rel=1e-6)
    assert any("schedule changed" in t for v in tb_text(run).values() for t in v)
    assert (run / "DONE").exists()
    # config.yaml now says 12 steps: the change itself is kept for `mode analyze`
    assert json.loads((run / "run_info.json").read_text())["schedule_changes"] == [
        {"step": 2, "train.max_steps": [6, 12], "optim.lr": [0.003, 0.0015]}]


@pytest.mark.parametrize("end", [4, 3])
def test_a_schedule_ending_at_or_before_the_resumed_step_is_refused(tmp_path, end):
    """Bug caught: train.max_steps lowered to the resumed step (with train.allow_schedule_change)
    trained nothing and wrote a DONE without final metrics; below it, exited 0 having done nothing.
    (The same start of a longer schedule passes; the slow test above trains one.)"""
    from mode import checkpoint as ckpt
    from mode.config import ConfigError, dump_config, load_config
    from mode.train import check_run_dir

    run = tmp_path / "run"
    step = ckpt.step_dir(ckpt.checkpoints_dir(run), 4)
    step.mkdir(parents=True)
    ckpt.write_manifest(step, 4)
    (run / "config.yaml").write_text(dump_config(load_config(CFG, [*TINY, "train.max_steps=6", f"run.dir={run}"])))
    allow = [*TINY, "train.allow_schedule_change=true", f"run.dir={run}"]
    with pytest.raises(ConfigError, match=rf"^config error: train.max_steps={end}: more than 4, the step run.dir="):
        check_run_dir(load_config(CFG, [*allow, f"train.max_steps={end}"]), lock=False)
    assert check_run_dir(load_config(CFG, [*allow, "train.max_steps=5"]), lock=False)["train"]["max_steps"] == 6


def test_a_schedule_change_is_recorded_before_config_yaml_forgets_it(tmp_path):
    """Bug caught: the change was written into run_info.json only after the engine was built and the
    checkpoint loaded, but config.yaml (read as the old schedule by the next start) was replaced
    first: a start killed in between left no trace of the change. Recorded first now, once."""
    import yaml

    from mode import checkpoint as ckpt
    from mode.config import load_config
    from mode.train import Trainer

    run = tmp_path / "run"
    step = ckpt.step_dir(ckpt.checkpoints_dir(run), 2)
    step.mkdir(parents=True)
    ckpt.write_manifest(step, 2)
    (run / "run_info.json").write_text(json.dumps({"world_size": 1, "tokens_per_step": 8}))
    saved = yaml.safe_load(yaml.safe_dump(load_config(CFG, [*TINY, "train.max_steps=6"]).to_dict()))
    cfg = load_config(CFG, [*TINY, "train.max_steps=12", "train.allow_schedule_change=true"])
    t = Trainer.__new__(Trainer)  # only the start's bookkeeping, no engine
    t.run_dir = run
    for _ in range(2):  # the second start after one killed before config.yaml was written
        t._record_schedule_change(saved, cfg)
    info = json.loads((run / "run_info.json").read_text())
    assert info["schedule_changes"] == [{"step": 2, "train.max_steps": [6, 12]}] and info["world_size"] == 1
    t._record_schedule_change(saved, load_config(CFG, [*TINY, "train.max_steps=6"]))  # no change: nothing added
    assert json.loads((run / "run_info.json").read_text()) == info


@pytest.mark.slow
def test_rerunning_a_finished_run_writes_nothing(tmp_path):
    run = tmp_path / "run"
    args = [*TINY, *STEPS, f"run.dir={run}"]
    mode_cli("train", "--config", CFG, *args)
    before = snapshot(run)
    done = (run / "DONE").read_text()
    r = mode_cli("train", "--config", CFG, *args)
    assert "already finished at step 6" in r.stdout and snapshot(run) == before
    # the README's DeepSpeed command on the same (single-process) run: also a no-op, metadata intact
    r = deepspeed_train(2, CFG, *args)
    assert "already finished at step 6" in r.stdout and snapshot(run) == before
    assert (run / "DONE").read_text() == done and json.loads(done)["eval/loss"] > 0


@pytest.mark.slow
def test_the_printed_command_continues_a_stop_at_set_in_the_yaml_file(tmp_path):
    """Bug caught: with train.stop_at in the YAML file, the command printed to continue (the same
    without a train.stop_at override) stopped at the same step again: "nothing to do"."""
    import shlex

    cfg = tmp_path / "timebox.yaml"
    cfg.write_text(f"base: {ROOT / CFG}\ntrain: {{stop_at: 2}}\n")
    run = tmp_path / "run"
    r = mode_cli("train", "--config", cfg, *TINY, *STEPS, f"run.dir={run}")
    m = re.search(r"stopped at step 2 of 6 \(train.stop_at=2\).*with: (mode train .*)$", r.stdout, flags=re.M)
    assert m, r.stdout
    r = mode_cli(*shlex.split(m.group(1))[1:])
    assert "at step 2" in r.stderr and "finished at step 6" in r.stdout, r.stdout + r.stderr[-2000:]
    assert (run / "DONE").is_file()


@pytest.mark.slow
def test_a_schedule_edited_into_config_yaml_by_hand_is_refused(tmp_path, stopped_at_2):
    """Bug caught (fault walkthrough): optim.warmup_steps edited in a run's config.yaml, then
    `mode train --config RUN/config.yaml`, resumed on the new schedule without a word (the LR jumped;
    no schedule_changes): the start compared with config.yaml, and the checkpoint's own config
    check skipped the schedule keys. Now refused unless train.allow_schedule_change=true."""
    run = copy_run(stopped_at_2[0], tmp_path / "run")
    cfg = run / "config.yaml"
    text = cfg.read_text()
    assert "  warmup_steps: 2\n" in text
    cfg.write_text(text.replace("  warmup_steps: 2\n", "  warmup_steps: 4\n"))
    edited = cfg.read_text()
    r = mode_cli("train", "--config", cfg, f"run.dir={run}", "train.stop_at=0", check=False)
    lines = [x for x in r.stderr.strip().splitlines() if "error" in x]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith("config error: optim.warmup_steps=4: checkpoint step_00000002") and \
        "allow_schedule_change" in lines[0], lines
    assert cfg.read_text() == edited and not (run / "DONE").exists()
    r = mode_cli("train", "--config", cfg, f"run.dir={run}", "train.stop_at=0", "train.allow_schedule_change=true")
    assert (run / "DONE").exists()


@pytest.mark.slow
def test_rerunning_a_run_already_at_its_stop_at_writes_nothing(tmp_path, stopped_at_2):
    """Bug caught: the same time-boxed command run again (a requeued job) started the engine,
    trained nothing, and rewrote run_info.json and a TensorBoard file."""
    run = copy_run(stopped_at_2[0], tmp_path / "run")
    before = snapshot(run)
    for stop in (2, 1):  # at it, and past it
        r = mode_cli("train", "--config", CFG, *TINY, *STEPS, f"run.dir={run}", f"train.stop_at={stop}")
        assert f"already at step 2 (train.stop_at={stop}): nothing to do" in r.stdout, r.stdout
        assert snapshot(run) == before


def test_the_finished_runs_hint_names_the_saved_world_size(tmp_path):
    """Bug caught (cluster review): a run saved at world size 2, started again at its train.stop_at
    (or after DONE) with 1 process, said "the same command with train.stop_at=0 ... continues it";
    that command, at world size 1, is refused (check_world). The hint names the saved world size."""
    from mode import checkpoint as ckpt
    from mode.config import load_config
    from mode.train import finished

    run = tmp_path / "run"
    step = ckpt.step_dir(ckpt.checkpoints_dir(run), 2)
    step.mkdir(parents=True)
    (step / "model.pt").write_bytes(b"weights")
    ckpt.write_manifest(step, 2)
    (run / "run_info.json").write_text(json.dumps({"world_size": 2}))
    cfg = load_config(CFG, [*TINY, *STEPS, f"run.dir={run}", "train.stop_at=2"])
    same = finished(cfg, 2)
    assert same.endswith("the same command with train.stop_at=0 (or a later step) continues it"), same
    assert finished(cfg) == same  # world unknown: as before
    other = finished(cfg, 1)
    assert other == same + (", launched with 2 process(es) (it was saved at world size 2; this launch's 1 "
                            "would be refused)"), other
    cfg.train.stop_at, cfg.train.max_steps = 0, 2
    (run / "DONE").write_text("{}")
    done = finished(cfg, 4)
    assert "already finished at step 2 (DONE)" in done and done.endswith(
        "allow_schedule_change=true continues, launched with 2 process(es) (it was saved at world size 2; "
        "this launch's 4 would be refused)"), done
    assert finished(cfg, 2).endswith("allow_schedule_change=true continues")
    (run / "run_info.json").write_text("[]")  # unreadable record: no claim about the world size
    assert finished(cfg, 4) == finished(cfg, 2)


@pytest.mark.slow
def test_a_stopped_run_started_at_another_world_size_names_the_one_that_continues_it(tmp_path, stopped_at_2):
    """The start (as each rank of a launch at world size 2 runs it) prints the hint with the saved world size."""
    run = copy_run(stopped_at_2[0], tmp_path / "run")
    args = ["train", "--config", CFG, *TINY, *STEPS, f"run.dir={run}"]
    r = mode_cli(*args, "train.stop_at=2", extra_env={"WORLD_SIZE": "2", "RANK": "0"})
    assert r.stdout.strip().endswith("the same command with train.stop_at=0 (or a later step) continues it, launched "
                                      "with 1 process(es) (it was saved at world size 1; this launch's 2 would be "
                                      "refused)"), r.stdout
    r = mode_cli(*args, "train.stop_at=0", extra_env={"WORLD_SIZE": "2", "RANK": "0"}, check=False)
    assert r.returncode == 2 and "was saved at world size 1 and this launch has world size 2" in r.stderr, r.stderr


@pytest.mark.slow
def test_an_analyzed_run_resumes_to_the_end(tmp_path, stopped_at_2):
    """Bug caught: `mode analyze RUN_DIR` wrote RUN_DIR/report, and resuming the run was then
    refused ("it holds report, which mode did not write")."""
    run = copy_run(stopped_at_2[0], tmp_path / "run")
    r = mode_cli("analyze", run)
    assert r.stdout.strip() == str(run / "report" / "report.md")
    report = (run / "report" / "report.md").read_text()
    r = mode_cli("train", "--config", CFG, *TINY, *STEPS, f"run.dir={run}")
    assert "at step 2" in r.stderr and "finished at step 6" in r.stdout and (run / "DONE").is_file(), r.stderr
    assert (run / "report" / "report.md").read_text() == report  # the report is left as it was


@pytest.mark.slow
def test_a_resume_under_another_peak_is_recorded_and_reported(tmp_path, stopped_at_2):
    """Bug caught: a resume with another perf.peak_tflops (a perf key, allowed to change) or a CPU
    peak measured again rewrote run_info.json's one peak; the rows logged before it had divided by
    the old one, and `mode analyze` took the median over both with no word."""
    run = copy_run(stopped_at_2[0], tmp_path / "run")
    first = json.loads((run / "run_info.json").read_text())["peak_tflops_per_device"]
    mode_cli("train", "--config", CFG, *TINY, *STEPS, f"run.dir={run}", "perf.peak_tflops=123")
    info = json.loads((run / "run_info.json").read_text())
    assert info["peaks"] == [{"step": 0, "peak_tflops_per_device": first},
                             {"step": 2, "peak_tflops_per_device": 123.0}], info
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for row in (r for r in rows if "perf/mfu" in r):  # each row divides by the peak of the start that logged it
        peak = first if row["step"] <= 2 else 123.0
        assert row["perf/mfu"] == pytest.approx(row["perf/tflops_per_device"] / peak, rel=1e-5), row
    mode_cli("analyze", run)
    md = (run / "report" / "report.md").read_text()
    assert f"**MFU of one run against several peaks**: `.` ({first:.3g}, 123)" in md, md


@pytest.mark.slow
def test_resuming_at_another_world_size_is_refused(tmp_path, stopped_at_2):
    run = copy_run(stopped_at_2[0], tmp_path / "run")
    args = [*TINY, *STEPS, f"run.dir={run}"]
    before = snapshot(run)
    r = deepspeed_train(2, CFG, *args, check=False)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "config error: run.dir=" in out and "world size 1" in out, out[-3000:]
    assert out.count("config error:") == 1, out[-3000:]  # said once, not by every rank
    assert snapshot(run) == before
    assert json.loads((run / "run_info.json").read_text())["world_size"] == 1


@pytest.mark.slow
def test_resuming_at_another_world_size_is_refused_without_run_info(tmp_path, stopped_at_2):
    """Bug caught: only run_info.json said the world size a run was saved at, and a damaged one is
    refused with `delete it (the next start writes it again)`; once deleted, two ranks resumed the
    one-rank checkpoint without a word (rank 0 found its RNG state, rank 1 only warned). The
    checkpoint's own record (its client state's world_size) refuses it."""
    run = copy_run(stopped_at_2[0], tmp_path / "run")
    (run / "run_info.json").unlink()
    r = deepspeed_train(2, CFG, *TINY, *STEPS, f"run.dir={run}", check=False)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "resumed from" not in out, out[-3000:]
    assert out.count("config error: run.dir=") == 1 and "saved at world size 1 and this launch has world size 2" in out
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002"]
    assert not (run / "run_info.json").exists()  # nothing of a started run written


@pytest.mark.slow
def test_sampling_refuses_a_config_yaml_the_checkpoint_was_not_trained_with(tmp_path, stopped_at_2):
    """Bug caught: `mode generate` (and eval, export) built the model from config.yaml alone; written
    back by hand with another model.rope_theta it sampled, from the trained weights, a model that
    was never trained. The trainer's checkpoint records its config (config.json, in the manifest)."""
    from mode import checkpoint as ckpt
    from mode.config import dump_config, load_config

    run = copy_run(stopped_at_2[0], tmp_path / "run")
    step = run / "checkpoints" / "step_00000002"
    files = json.loads((step / ckpt.MANIFEST).read_text())["files"]
    assert ckpt.verify(step) is None and ckpt.CONFIG in files and ckpt.DATA in files
    assert set(ckpt.vouched_record(step, ckpt.DATA)) == {"tokenizer_sha256", "splits"}  # what a start checks before workers
    assert ckpt.trained_config(step) == json.loads(json.dumps(load_config(run / "config.yaml").to_dict()))
    gen = ["generate", "--run", run, "--prompt", "def ", "--max-new-tokens", "2"]
    mode_cli(*gen)
    (run / "config.yaml").write_text(dump_config(load_config(run / "config.yaml", ["model.rope_theta=500.0"])))
    r = mode_cli(*gen, check=False)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr[-3000:]
    assert "step_00000002 was trained with (model.rope_theta: 10000.0 -> 500.0)" in r.stderr, r.stderr


@pytest.mark.slow
def test_a_checkpoint_trained_under_another_config_is_refused(tmp_path, stopped_at_2):
    """Bug caught: only config.yaml said what config a run's checkpoints were trained with; one
    written back by hand (as the refusal of a run without it asks: `write back the config it was
    started with`) with another value, here optim.weight_decay, and started with that value resumed
    the checkpoint silently (same shapes: nothing failed to load). Each checkpoint records its config."""
    from mode.config import dump_config, load_config

    run = copy_run(stopped_at_2[0], tmp_path / "run")
    other = [*TINY, *STEPS, "optim.weight_decay=0.5", f"run.dir={run}"]
    assert load_config(CFG, [*TINY, *STEPS]).optim.weight_decay != 0.5
    (run / "config.yaml").write_text(dump_config(load_config(CFG, other)))
    before = snapshot(run)
    r = mode_cli("train", "--config", CFG, *other, check=False)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("config error:")]
    assert r.returncode == 2 and "resumed from" not in r.stderr and len(lines) == 1, r.stderr[-3000:]
    assert "step_00000002 was trained with a different config" in lines[0] and "optim.weight_decay" in lines[0]
    assert {k: v for k, v in snapshot(run).items() if k != "LOCK"} == {k: v for k, v in before.items() if k != "LOCK"}


# ----------------------------------------------------------------------------------------------
# Weights & Biases, offline.


@pytest.mark.slow
def test_wandb_offline_writes_its_run_files(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="optional extra: pip install -e '.[wandb]'")
    monkeypatch.setenv("WANDB_SILENT", "true")  # the CLI's environment is a copy of ours
    run = tmp_path / "run"
    mode_cli("train", "--config", CFG, *TINY, *STEPS, "log.wandb=true", "log.wandb_mode=offline",
             f"run.dir={run}")
    offline = sorted((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 1, list((run / "wandb").iterdir())
    logs = list(offline[0].glob("*.wandb"))
    assert len(logs) == 1
    config, loss = {}, {}
    for rec in wandb_records(logs[0]):
        kind = rec.WhichOneof("record_type")
        if kind == "run":  # the resolved config given at init
            config.update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            if "train/loss" in items:
                loss[rec.history.step.num] = items["train/loss"]
    assert config["train"]["max_steps"] == 6 and config["model"]["d_model"] == 32
    tb = scalars(run, "train/loss")
    assert list(loss) == list(tb) == [2, 4, 6]
    assert all(loss[s] == pytest.approx(tb[s], rel=1e-6) for s in tb)


def wandb_records(path: Path):
    """Records of a W&B transaction log (.wandb): W&B's leveldb-log framing of protobuf Records,
    read here without wandb's own reader (recent wandb ships it in Go only)."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block = Path(path).read_bytes(), 32768
    assert data[:4] == b":W&B", "not a W&B transaction log"
    pos, buf = 7, b""  # 7-byte file header: ident, magic, version
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]  # after a 4-byte CRC
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk: a whole record
            rec = Record()
            rec.ParseFromString(buf)
            yield rec
            buf = b""


@pytest.mark.slow
def test_step_time_and_elapsed_count_every_step_when_an_eval_or_a_stop_falls_between_logs(tmp_path):
    """Bug caught: an evaluation (or a save) between two log steps restarted the interval clock, so
    the next log divided one step's time by two steps: tokens/s, TFLOP/s and MFU doubled there
    (MFU 0.51 between 0.28 and 0.27) and perf/elapsed_s lost the steps before the eval. Every step
    is made to take at least 1 s: no logged step time may be shorter. And the time since the last
    log was left out of a checkpoint saved between logs: the run below stops there (stop_at=3) and
    resumes, and its elapsed time must still cover all 4 steps."""
    run = tmp_path / "run"
    code = ("import sys, time\nimport mode.train as t\nstep = t.Trainer.train_step\n"
            "def slow(self, acc):\n    time.sleep(1.0)\n    step(self, acc)\n"
            "t.Trainer.train_step = slow\nsys.exit(t.main(sys.argv[1:]))")
    for stop in ("train.stop_at=3", "train.stop_at=0"):
        subprocess.run([PY, "-c", code, "--config", CFG, *TINY, "train.max_steps=4", "train.log_every=2",
                        "train.eval_every=3", "checkpoint.every=3", stop, f"run.dir={run}"],
                       cwd=ROOT, env=env(2), check=True, capture_output=True, timeout=600)
    step_time, elapsed = scalars(run, "perf/step_time_s"), scalars(run, "perf/elapsed_s")
    assert list(step_time) == [2, 4] and all(v >= 1.0 for v in step_time.values()), step_time
    assert elapsed[4] >= 4 * 1.0, elapsed


@pytest.mark.parametrize("warmup,max_steps,said", [
    (100, 20, "the learning rate rises to 0.0006 at the last step and never reaches optim.lr=0.003"),
    (20, 20, "the learning rate reaches optim.lr=0.003 only at the last step"),
    (19, 20, None),
])
def test_a_warmup_as_long_as_the_run_is_one_warning_line(warmup, max_steps, said):
    """Bug caught: optim.warmup_steps >= train.max_steps (smoke runs) was accepted in silence, so the
    LR never got to optim.lr. The start now says so, with the peak the schedule really reaches."""
    from mode.config import load_config
    from mode.console import schedule_warning
    from mode.engine import lr_lambda

    cfg = load_config(CFG, ["optim.lr=0.003", f"optim.warmup_steps={warmup}", f"train.max_steps={max_steps}"])
    line = schedule_warning(cfg)
    if said is None:
        assert line is None
        return
    assert line == f"warning: optim.warmup_steps={warmup} >= train.max_steps={max_steps}: {said} (no cosine decay)"
    f = lr_lambda(cfg)  # the LR step i (0-based) trains with: the peak is the last step's
    assert max(range(max_steps), key=f) == max_steps - 1 and f"{0.003 * f(max_steps - 1):.3g}" in line


@pytest.mark.parametrize("over, world", [
    (["deepspeed.precision=bf16", "train.grad_accum=4"], 1),
    (["deepspeed.precision=bf16"], 2),
    (["deepspeed.precision=bf16"], 1),
    (["deepspeed.precision=bf16", "train.grad_accum=4", "deepspeed.zero_stage=1"], 2),
    (["train.grad_accum=4"], 2),
])
def test_bf16_gradients_summed_in_bf16_are_said_at_start(over, world):
    """Bug caught: bf16 at ZeRO 0 (the tiny presets' stage) with gradient accumulation or several
    ranks summed the gradients in bf16 (3.1e-3 relative error at grad_accum 4, test_bf16) in
    silence. The start now says so exactly when DeepSpeed's config sums in bf16: bf16 without
    fp32 accumulation (mode.engine.ds_config) and more than one gradient to sum."""
    from mode.config import load_config
    from mode.console import bf16_sum_warning
    from mode.engine import ds_config

    cfg = load_config(CFG, over)
    ds = ds_config(cfg, world)
    sums_in_bf16 = (ds["bf16"]["enabled"] and ds.get("data_types", {}).get("grad_accum_dtype") != "fp32"
                    and ds["gradient_accumulation_steps"] * world > 1)
    line = bf16_sum_warning(cfg, world)
    assert (line is not None) == sums_in_bf16, (over, world, line)
    if line:
        assert line.startswith("warning: deepspeed.precision=bf16 at deepspeed.zero_stage=0") and \
            f"train.grad_accum={cfg.train.grad_accum} micro-steps x {world} rank(s)" in line and \
            line.endswith("deepspeed.zero_stage=1 does neither"), line


@pytest.mark.slow
def test_a_run_whose_output_reader_went_away_says_so(tmp_path):
    """Bug caught (fault walkthrough): `mode train ... | head -3` ended with exit 141 and nothing on
    stderr: a training run stopped without a word (a closed pipe is quiet for `mode flops | head`)."""
    cmd = (f"{PY} -m mode.cli train --config {CFG} {' '.join(TINY)} {' '.join(STEPS)} run.dir={tmp_path / 'run'} "
           f"2> {tmp_path / 'err'} | head -2")
    subprocess.run(cmd, shell=True, cwd=ROOT, env=env(1), timeout=600, stdout=subprocess.DEVNULL)
    err = (tmp_path / "err").read_text()
    assert "the reader of this run's output went away" in err and "Traceback" not in err, err[-2000:]


@pytest.mark.slow  # its own interpreter: a file size limit for the whole process
def test_a_tensorboard_write_the_disk_refuses_is_one_error_not_a_thread_traceback(tmp_path):
    """Bug caught (fault walkthrough, a full disk while logging): TensorBoard's writer thread printed
    `Exception in thread ...: Traceback ... event_file_writer.py` beside the run's one error line.
    A real refused write here: RLIMIT_FSIZE (EFBIG) past 2 KB of events."""
    code = f"""
import resource, signal, sys
from pathlib import Path
from mode.config import load_config
from mode.errors import one_line
from mode.loggers import Loggers
cfg = load_config({CFG!r}, [])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (2048, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
log = Loggers(cfg, Path({str(tmp_path)!r}), enabled=True)
try:
    for step in range(1, 1000):
        log.write({{"train/loss": 1.0 / step, "train/lr": 0.001}}, step)
except OSError as e:
    print(one_line(e)[0], file=sys.stderr)
"""
    r = subprocess.run([PY, "-c", code], cwd=ROOT, env=env(1), capture_output=True, text=True, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(tmp_path) in lines[0], r.stderr[-3000:]


def _tb_points(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} as TensorBoard's EventAccumulator loads tb_dir, duplicates included."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def test_a_resume_drops_the_stopped_processs_points_from_tensorboards_files_by_each_tags_axis(tmp_path):
    """What TensorBoard shows after a resume from step 4 (tokens 400, 28 MFLOPs) of a process that logged
    up to step 6: one point a step, each tag cut on its own axis; a file with damage before its end is
    left byte for byte; a torn last record goes; a point written before the checkpoint stays."""
    import os
    import time

    from torch.utils.tensorboard import SummaryWriter

    from mode import rundir
    from mode.loggers import EVENT_GLOB, drop_events_after

    tb = tmp_path / "tb"
    w = SummaryWriter(str(tb))
    w.add_text("config", "yaml", 0)
    for step in range(1, 7):  # the stopped process
        w.add_scalar("train/loss", 10.0 - step, step)
        w.add_scalar("train/loss_vs_tokens", 10.0 - step, 100 * step)
        w.add_scalar("train/loss_vs_mflops", 10.0 - step, 7 * step)  # 7 MFLOPs a step
    w.close()
    (old,) = tb.glob(EVENT_GLOB)
    with open(old, "ab") as f:
        f.write(b"\x05\x00\x00")  # a kill mid-write
    before = old.read_bytes()
    # written before the checkpoint resumed from (file touched later): nothing is the stopped process's
    os.utime(old, (time.time() + 100, time.time() + 100))
    drop_events_after(tb, 4, 400, 28, since=time.time() + 50)
    assert old.read_bytes() == before
    (tmp_path / rundir.TB_REWRITE).write_bytes(before)  # a rewrite a kill interrupted
    (tmp_path / "run_info.json").write_text('{"world_size": 1, "forward_flops_per_token": 1, "tokens_per_step": 1}')
    assert rundir.is_mode_run(tmp_path)  # still a run (resumable), and TensorBoard does not read it
    drop_events_after(tb, 4, 400, 28)
    assert not (tmp_path / rundir.TB_REWRITE).exists()
    got = _tb_points(tb)
    assert [s for s, _ in got["train/loss"]] == [1, 2, 3, 4]
    assert [s for s, _ in got["train/loss_vs_tokens"]] == [100, 200, 300, 400]  # not cut at step 4 = 4 tokens
    assert [s for s, _ in got["train/loss_vs_mflops"]] == [7, 14, 21, 28]
    assert got["train/loss"][-1][1] == 6.0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tb))
    ea.Reload()
    assert ea.Tags()["tensors"] == ["config/text_summary"]  # step 0's text kept
    assert old.read_bytes()[-3:] != b"\x05\x00\x00"
    before = old.read_bytes()
    drop_events_after(tb, 4, 400, 28)  # nothing past: the file is not rewritten
    assert old.read_bytes() == before
    drop_events_after(tb, 2, 200, 14, since=old.stat().st_mtime + 1)  # last written before the checkpoint
    assert old.read_bytes() == before
    damaged = bytearray(before)
    damaged[40] ^= 0xFF  # a record in the middle fails its CRC
    old.write_bytes(bytes(damaged))
    drop_events_after(tb, 2, 200, 14)
    assert old.read_bytes() == bytes(damaged)  # left for `mode analyze` to read around and name
    drop_events_after(tb, -1, -1, -1)  # a restart before the first checkpoint: nothing of the old process stays
    assert old.read_bytes() == bytes(damaged)
    old.write_bytes(before)
    drop_events_after(tb, -1, -1, -1)
    assert _tb_points(tb) == {}

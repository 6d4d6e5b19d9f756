"""Malformed inputs a user (or a fault injector) gives `mode train`, and the check that each is refused
cleanly: exit 2 and exactly one stderr line, `config error: ...`, no traceback, nothing written into
run.dir. Shared by tests/test_reliability.py and benchmarks/reliability.py (the RELIABILITY.md table)."""
from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

from tests.util import ROOT, TINY

BASE = str(ROOT / "configs/tiny/dense.yaml")

# (name, overrides) on top of the tiny dense config.
OVERRIDES = [
    *[(f"model.vocab_size={v}", [f"model.vocab_size={v}"]) for v in ("0", "-1", "1.5", "abc", "true", "100")],
    *[(f"model.d_model={v}", [f"model.d_model={v}"]) for v in ("0", "-8", "33", "x", "[32]")],
    *[(f"model.n_layers={v}", [f"model.n_layers={v}"]) for v in ("0", "-1", "2.5")],
    *[(f"model.n_heads={v}", [f"model.n_heads={v}"]) for v in ("0", "3")],
    ("model.d_ff=0", ["model.d_ff=0"]),
    *[(f"model.mlp={v}", [f"model.mlp={v}"]) for v in ("relu", "1")],
    *[(f"model.max_seq_len={v}", [f"model.max_seq_len={v}"]) for v in ("0", "16")],
    *[(f"model.rope_theta={v}", [f"model.rope_theta={v}"]) for v in ("0", "-1", ".inf", ".nan")],
    *[(f"model.norm_eps={v}", [f"model.norm_eps={v}"]) for v in ("0", "-1", ".nan")],
    *[(f"model.init_std={v}", [f"model.init_std={v}"]) for v in ("0", "-0.1")],
    *[(f"model.tie_embeddings={v}", [f"model.tie_embeddings={v}"]) for v in ("maybe", "2")],
    *[(f"model.mod.layers={v}", [f"model.mod.layers={v}"]) for v in ("sometimes", "[9]", "[-1]", "[1,", "5")],
    *[(f"model.mod.capacity={v}", [f"model.mod.capacity={v}"]) for v in ("0", "1.5", "-0.1", ".inf")],
    ("model.mod.gate=relu", ["model.mod.gate=relu"]),
    ("model.mod.routing=random", ["model.mod.routing=random"]),
    ("model.mod.causal=yes", ["model.mod.causal=yes"]),
    ("model.mod.aux_loss_weight=-1", ["model.mod.aux_loss_weight=-1"]),
    ("model.mod.predictor_loss_weight=-1", ["model.mod.predictor_loss_weight=-1"]),
    ("model.mod.predictor_hidden=-1", ["model.mod.predictor_hidden=-1"]),
    ("model.moe.layers=all", ["model.moe.layers=all"]),
    ("model.moe.num_experts=0", ["model.moe.num_experts=0"]),
    ("model.moe.num_noop_experts=-1", ["model.moe.num_noop_experts=-1"]),
    *[(f"model.moe.top_k={v}", [f"model.moe.top_k={v}"]) for v in ("0", "99")],
    ("model.moe.d_expert=-1", ["model.moe.d_expert=-1"]),
    *[(f"model.moe.capacity_factor={v}", [f"model.moe.capacity_factor={v}"]) for v in ("0", "-1", ".inf")],
    ("model.moe.eval_capacity_factor=0", ["model.moe.eval_capacity_factor=0"]),
    ("model.moe.min_capacity=-1", ["model.moe.min_capacity=-1"]),
    ("model.moe.drop_policy=random", ["model.moe.drop_policy=random"]),
    ("model.moe.noop_balance=maybe", ["model.moe.noop_balance=maybe"]),
    ("model.moe.jitter=-1", ["model.moe.jitter=-1"]),
    ("model.moe.lb_loss_weight=-1", ["model.moe.lb_loss_weight=-1"]),
    ("model.moe.z_loss_weight=-1", ["model.moe.z_loss_weight=-1"]),
    ("model.moe.backend=triton", ["model.moe.backend=triton"]),
    ("model.moe.ep_size=3", ["model.moe.backend=deepspeed", "model.moe.ep_size=3"]),
    ("model.moe.ep_size=2 native", ["model.moe.ep_size=2"]),
    ("model.d_model=36 compiled at ZeRO 1", ["train.compile=true", "deepspeed.zero_stage=1", "model.d_model=36",
                                             "model.n_heads=2"]),
    ("megablocks on CPU", ["model.moe.layers=every", "model.moe.backend=megablocks", "deepspeed.precision=bf16"]),
    ("model.d_model.x=5", ["model.d_model.x=5"]),
    ("model.foo=1", ["model.foo=1"]),
    ("modle.d_model=3", ["modle.d_model=3"]),
    ("model..x=1", ["model..x=1"]),
    ("=5", ["=5"]),
    ("no equals sign", ["model.d_model"]),
    ("model=5", ["model=5"]),
    *[(f"data.format={v}", [f"data.format={v}"]) for v in ("xlsx",)],
    *[(f"data.seq_len={v}", [f"data.seq_len={v}"]) for v in ("1", "0")],
    *[(f"data.val_fraction={v}", [f"data.val_fraction={v}"]) for v in ("0", "1")],
    ("data.max_documents=-1", ["data.max_documents=-1"]),
    ("data.source missing file", ["data.source=/nonexistent/corpus.txt"]),
    ("data.tokenizer missing dir", ["data.tokenizer=/nonexistent/tokenizer"]),
    *[(f"train.max_steps={v}", [f"train.max_steps={v}"]) for v in ("0", "-5", "1.5")],
    ("train.stop_at=-1", ["train.stop_at=-1"]),
    ("train.micro_batch_size=0", ["train.micro_batch_size=0"]),
    ("train.grad_accum=0", ["train.grad_accum=0"]),
    ("train.eval_every=-1", ["train.eval_every=-1"]),
    ("train.eval_batches=0", ["train.eval_batches=0"]),
    ("train.log_every=0", ["train.log_every=0"]),
    ("train.nonfinite=ignore", ["train.nonfinite=ignore"]),
    ("train.max_consecutive_nonfinite=0", ["train.max_consecutive_nonfinite=0"]),
    ("train.seed=abc", ["train.seed=abc"]),
    *[(f"train.seed={v}", [f"train.seed={v}"]) for v in ("-1", "9223372036854775808")],  # failed after writing run.dir
    ("data.split_seed=-1", ["data.split_seed=-1"]),
    *[(f"optim.lr={v}", [f"optim.lr={v}"]) for v in ("0", "-1", ".inf", ".nan", "1e999")],
    *[(f"optim.min_lr_ratio={v}", [f"optim.min_lr_ratio={v}"]) for v in ("2", "-0.5")],
    ("optim.warmup_steps=-1", ["optim.warmup_steps=-1"]),
    ("optim.weight_decay=-1", ["optim.weight_decay=-1"]),
    *[(f"optim.beta1={v}", [f"optim.beta1={v}"]) for v in ("1", "-0.1")],
    ("optim.beta2=1.5", ["optim.beta2=1.5"]),
    *[(f"optim.eps={v}", [f"optim.eps={v}"]) for v in ("-1", "0")],
    ("optim.grad_clip=-1", ["optim.grad_clip=-1"]),
    ("checkpoint.every=-1", ["checkpoint.every=-1"]),
    ("checkpoint.keep=0", ["checkpoint.keep=0"]),
    ("log.progress=maybe", ["log.progress=maybe"]),
    ("perf.peak_tflops=.inf", ["perf.peak_tflops=.inf"]),
    *[(f"deepspeed.zero_stage={v}", [f"deepspeed.zero_stage={v}"]) for v in ("3", "4")],
    ("deepspeed.precision=fp16", ["deepspeed.precision=fp16"]),
    ("run.fresh=maybe", ["run.fresh=maybe"]),
    ("run.dir= (empty)", ["run.dir="]),
    ("run.dir=' ' (blank)", ["run.dir= "]),
    ("run.dir=. (cwd)", ["run.dir=."]),
    ("run.dir=.. (parent)", ["run.dir=.."]),
    ("run.dir=/ (root)", ["run.dir=/"]),
    ("run.dir with a 256-byte name", [f"run.dir=runs/{'r' * 256}"]),  # was `error: file name too long`, exit 1
    ("data.prepared_dir with a 256-byte name", [f"data.prepared_dir=data/{'p' * 256}"]),
    ("run.dir=. fresh", ["run.dir=.", "run.fresh=true"]),
    *[(f"run.name={v}", [f"run.name={v}"]) for v in ("a/b", "-x", "n" * 250)],  # a/b: the report's figure path crashed; 250: its file name too long
    # accepted once, then failed after the workers started or trained silently wrong (session 15's audit)
    *[(f"{k}=10**30", [f"{k}={10**30}"]) for k in ("model.n_layers", "model.vocab_size", "data.max_documents")],
    ("model.moe.capacity_factor=1e38", ["model.moe.layers=every", "model.moe.capacity_factor=1e38"]),
    *[(f"model.moe.jitter={v}", [f"model.moe.jitter={v}"]) for v in ("1", "2.5")],
    ("optim.weight_decay=1000 (lr * wd > 1)", ["optim.weight_decay=1000"]),
    ("every_other on one layer", ["model.mod.layers=every_other", "model.n_layers=1"]),
    ("predictor_loss_weight=0, causal=predictor", ["model.mod.layers=every_other", "model.mod.predictor_loss_weight=0"]),
    ("aux_loss_weight=0, causal=aux_loss", ["model.mod.layers=every", "model.mod.causal=aux_loss",
                                             "model.mod.aux_loss_weight=0"]),
    ("data.eos_token with the byte tokenizer", ["data.eos_token=</s>"]),
    # a variant's key on a model with no layer for it: trained the plain model under the variant's name (session 24)
    *[(f"{kv} with no depth-routed layer", [kv]) for kv in ("model.mod.kv=all", "model.mod.decoupled=true",
                                                            "model.mod.gate=sigmoid", "model.mod.routing=stochastic")],
    ("no-op experts with no MoE layer", ["model.moe.num_noop_experts=2"]),
    # `~name` of no user: pathlib's bare RuntimeError "Could not determine home directory", exit 1 (session 25)
    *[(f"{k}=~nouser/x", [f"{k}=~nosuchuser_mode/x"]) for k in ("run.dir", "data.prepared_dir", "data.tokenizer")],
]

# (name, file contents) used as --config.
FILES = [
    ("empty YAML", b""),
    ("only comments", b"# nothing here\n"),
    ("top level is a list", b"- model\n- train\n"),
    ("top level is a scalar", b"hello\n"),
    ("duplicate section", b"model:\n  d_model: 32\nmodel:\n  n_layers: 2\n"),
    ("duplicate key in a section", b"model:\n  d_model: 32\n  d_model: 64\n"),
    ("invalid YAML", b"model:\n  d_model: [32\n"),
    ("tab indentation", b"model:\n\td_model: 32\n"),
    ("binary file", bytes(range(256)) * 4),
    ("latin-1 text", "model:\n  mlp: gelu  # caf\xe9\n".encode("latin-1")),
    ("unknown section", b"modle:\n  d_model: 32\n"),
    ("section is a scalar", b"model: 5\n"),
    ("subsection is a scalar", b"model:\n  mod: 3\n"),
    ("base is a number", b"base: 5\n"),
    ("base is an empty list", b"base: []\n"),
    ("base is missing", b"base: missing.yaml\n"),
    ("base cycle (self)", b"base: SELF\n"),
    ("base cycle (two files)", b"base: OTHER\n"),
    ("integer key", b"model:\n  1: 5\n"),  # YAML keys that are not strings (a TypeError once)
    ("null key", b"model:\n  ~: 5\n"),
    ("boolean key", b"yes: 1\n"),
    ("null key twice", b"model:\n  ~: 5\n  ~: 6\n"),
]

# (name, how the existing run.dir looks) with a valid config.
RUN_DIRS = [
    ("run.dir is a file", "file"),
    ("run.dir holds a user's files", "foreign"),
    ("run.dir holds a user's files, fresh", "foreign_fresh"),
    ("run.dir with an empty config.yaml", "empty_config"),
    ("run.dir with an invalid config.yaml", "invalid_config"),
    ("run.dir of another config", "other_config"),
]

MISC = [
    ("--config does not exist", "missing"),
    ("--config is a directory", "directory"),
    ("--config is empty (an unset shell variable)", "empty"),
]


def all_cases() -> list[tuple[str, str, object]]:
    return ([("override", n, ov) for n, ov in OVERRIDES] + [("file", n, c) for n, c in FILES]
            + [("run_dir", n, k) for n, k in RUN_DIRS] + [("misc", n, k) for n, k in MISC])


def prepare(kind: str, spec, tmp: Path) -> tuple[list[str], Path]:
    """The `mode train` arguments of one case, and the run.dir it names (to check nothing was written)."""
    tmp.mkdir(parents=True, exist_ok=True)
    run_dir = tmp / "run"
    args = ["train", "--print-config", "--config", BASE, *TINY, f"run.dir={run_dir}"]
    if kind == "override":
        return args + list(spec), run_dir
    if kind == "file":
        f = tmp / "bad.yaml"
        content = spec.replace(b"SELF", b"bad.yaml").replace(b"OTHER", b"other.yaml")
        (tmp / "other.yaml").write_text("base: bad.yaml\n")
        f.write_bytes(content)
        return ["train", "--print-config", "--config", str(f), *TINY, f"run.dir={run_dir}"], run_dir
    if kind == "run_dir":
        if spec == "file":
            run_dir.write_text("not a directory\n")
            return args, run_dir
        run_dir.mkdir()
        if spec.startswith("foreign"):
            (run_dir / "thesis.tex").write_text("\\documentclass{article}\n")
            return args + (["run.fresh=true"] if spec.endswith("fresh") else []), run_dir
        (run_dir / "tb").mkdir()
        (run_dir / "config.yaml").write_text({"empty_config": "", "invalid_config": "model: [1,\n",
                                              "other_config": "model:\n  d_model: 48\n"}[spec])
        return args, run_dir
    if spec == "missing":
        return ["train", "--print-config", "--config", str(tmp / "nope.yaml"), f"run.dir={run_dir}"], run_dir
    if spec == "empty":
        return ["train", "--print-config", "--config", "", f"run.dir={run_dir}"], run_dir
    return ["train", "--print-config", "--config", str(tmp), f"run.dir={run_dir}"], run_dir


def snapshot(p: Path) -> dict:
    if p.is_file():
        return {"": p.read_bytes()}
    if not p.is_dir():
        return {}
    return {str(f.relative_to(p)): f.read_bytes() if f.is_file() else None for f in sorted(p.rglob("*"))}


def run_case(kind: str, spec, tmp: Path) -> dict:
    """Run `mode train --print-config ...` in this process, as the CLI would, from tmp as the cwd."""
    from mode.cli import main

    args, run_dir = prepare(kind, spec, tmp)
    before = snapshot(run_dir)
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(tmp)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(args)
    except BaseException as e:  # noqa: BLE001 - escaping the CLI is the failure being counted
        rc, err = -1, io.StringIO(f"Traceback: {type(e).__name__}: {e}")
    finally:
        os.chdir(cwd)
    lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
    clean = rc == 2 and len(lines) == 1 and lines[0].startswith("config error: ") and snapshot(run_dir) == before
    return {"rc": rc, "lines": lines, "clean": clean, "untouched": snapshot(run_dir) == before}

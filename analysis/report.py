"""`mode analyze RUNS_DIR [--out DIR]`: a comparison report (report.md + PNG figures) of many runs.

Per variant, mean ± sample std over seeds of what a paper table needs, loss curves against
steps, training compute and wall-clock, and per-layer routing statistics. How each number is
reduced from its logged series is fixed here and stated in the report (`METRICS`), so the
table can be traced back to TensorBoard:

- eval losses: the value at the last evaluated step;
- throughput and step time: the median over logged points, leaving out the first one
  (it includes start-up and compilation);
- routing fractions (dropped tokens, no-op, predictor accuracy): the last logged value of
  each routed layer, averaged over layers.

Training FLOPs = 3 x forward FLOPs per token x tokens seen (backward ~ 2x forward).
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import quote

import numpy as np

# The helpers isoflop.py shares live in tb.py, so that report -> isoflop is the only edge (no cycle).
from analysis.outdir import save_figure
from analysis.tb import (TRAIN_FLOPS_PER_FORWARD_FLOP, RunLog, damaged_line, forward_flops_per_token, group_by_variant,
                         load_runs, skipped_line, variant_colors, variant_sort_key)
from mode.config import flatten, is_number
from mode.console import si
from mode.prepare import KEY_FIELDS
from mode.rundir import write_atomic


class NoRuns(ValueError):
    """The directory holds no run directories."""


def _rel(path: Path, root: Path) -> str:
    try:
        return str(Path(path).relative_to(root)) or "."
    except ValueError:
        return str(path)


def _last_log_steps(runs: list[RunLog]) -> str:
    steps = sorted({r.series("train/loss")[0][-1] for r in runs if r.series("train/loss")[0].size})
    return ", ".join(map(str, steps)) if len(steps) <= 3 else f"{steps[0]}..{steps[-1]}"


# ----------------------------------------------------------------------------------------------
# Per-run reductions.


def median_after_warmup(run: RunLog, tag: str) -> float | None:
    """Median without each process's first logged point (its warm-up: start-up, compiling, caches),
    the run's first and the first after every resume (run_info.json's `resumes`)."""
    steps, v = run.series(tag)
    if v.size == 0:
        return None
    starts = {0}
    for r in run.info.get("resumes") or []:
        try:
            starts.add(int(r["step"]))
        except (KeyError, TypeError, ValueError):
            continue  # a run_info.json written by hand or by an older version
    warm = np.ones(v.size, dtype=bool)
    for s in starts:
        after = np.flatnonzero(steps > s)
        if after.size:
            warm[after[0]] = False
    return float(np.median(v[warm] if warm.any() else v))


def layer_mean_of_last(run: RunLog, prefix: str, name: str) -> float | None:
    """Mean over routed layers of the last logged `<prefix>/layerN/<name>`."""
    vals = [run.last(f"{prefix}/layer{i}/{name}") for i, names in run.layer_tags(prefix).items() if name in names]
    vals = [v for v in vals if v is not None]
    return float(np.mean(vals)) if vals else None


DEPTH_PREFIXES = ("mod", "mod_attn", "mod_mlp")  # whole-block routers, decoupled attention / MLP routers


def causal_routing_acc(run: RunLog) -> float | None:
    """How often the causal rule agrees with top-k membership, the rule the run decides by at
    sampling time (mode/routing/depth.py): the predictor's accuracy; for `causal=threshold` the
    learned threshold's (`threshold_acc`; its router's r > 0 is not the rule it samples with);
    else, for routers trained with the aux loss only, the router's own sign rule. The mean over
    every depth router (whole-block or decoupled)."""
    for name in ("predictor_acc", "threshold_acc", "router_causal_acc"):
        accs = [a for a in (layer_mean_of_last(run, p, name) for p in DEPTH_PREFIXES) if a is not None]
        if accs:
            return float(np.mean(accs))
    return None


def expert_work_vs_budget(run: RunLog) -> float | None:
    """Expert rows computed per token over the rows its FLOPs budget counts (mode/moe/base.py cost:
    min(E, top_k * min(1, capacity_factor))), the mean over MoE layers of the last training log.
    Computed rows are the kept routes, top_k * `load_mean`: drops and no-op routes leave budget unused."""
    from mode.config import MoEConfig

    moe, load = run.cfg("model.moe"), layer_mean_of_last(run, "moe", "load_mean")
    if not isinstance(moe, dict) or load is None:
        return None
    k, e, cf = (moe.get(n, getattr(MoEConfig, n)) for n in ("top_k", "num_experts", "capacity_factor"))
    return load * k / min(e, k * (1.0 if cf is None else min(1.0, cf)))


def causal_lifts_capacity(run: RunLog) -> bool:
    """Whether the run's MoE layers evaluate under causal routing at another capacity than under
    top-k: eval/loss_causal uses inference_capacity_factor (null: dropless, mode/routing/experts.py),
    eval/loss eval_capacity_factor (null: capacity_factor). Then `causal − top-k` holds that change:
    for a dropping MoE, dropless minus dropping."""
    from mode.config import MoEConfig

    moe = run.cfg("model.moe")
    if not isinstance(moe, dict) or not run.layer_tags("moe"):
        return False
    cf = moe.get("capacity_factor", MoEConfig.capacity_factor)
    topk_cf = moe["eval_capacity_factor"] if moe.get("eval_capacity_factor") is not None else cf
    return moe.get("inference_capacity_factor") != topk_cf


CAPACITY_MARK = "†"  # on the causal-routing cells of variants for which causal_lifts_capacity


def causal_gap(run: RunLog, step: int | None = None) -> float | None:
    a, b = run.at("eval/loss_causal", step), run.at("eval/loss", step)
    return None if a is None or b is None else a - b


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    reduce: Callable[..., float | None]  # (run), or (run, eval step) when at_eval_step
    fmt: Callable[[float], str]
    constant: bool = False  # a property of the model (params, FLOPs): no spread shown when seeds agree
    at_eval_step: bool = False  # reduce(run, step): read at the variant's common evaluation step


def _rate(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


SEED_STYLES = ("-", "--", ":", "-.")  # a variant's runs (seeds) in the loss plots, in order

METRICS: list[Metric] = [
    Metric("eval_loss", "eval loss", lambda r, s: r.at("eval/loss", s), lambda x: f"{x:.4f}", at_eval_step=True),
    # bits per UTF-8 byte of the evaluated text: compares runs with different tokenizers
    Metric("eval_bpb", "eval bits/byte", lambda r, s: r.at("eval/bpb", s), lambda x: f"{x:.4f}", at_eval_step=True),
    Metric("eval_loss_causal", "eval loss (causal routing)", lambda r, s: r.at("eval/loss_causal", s),
           lambda x: f"{x:.4f}", at_eval_step=True),
    Metric("causal_gap", "causal − top-k", causal_gap, lambda x: f"{x:+.4f}", at_eval_step=True),
    Metric("params", "params", lambda r: r.info.get("params"), si, constant=True),
    Metric("flops_per_token", "fwd FLOPs/token", forward_flops_per_token, si, constant=True),
    Metric("tokens_per_s", "tokens/s", lambda r: median_after_warmup(r, "perf/tokens_per_s"), _rate),
    Metric("step_time_s", "step time (s)", lambda r: median_after_warmup(r, "perf/step_time_s"), lambda x: f"{x:.4g}"),
    Metric("mfu", "MFU", lambda r: median_after_warmup(r, "perf/mfu"), lambda x: f"{x:.2%}"),
    # the largest logged: each process (a resume starts one) measures its own peak from zero
    Metric("memory_gb", "peak mem (GB)", lambda r: max(r.series("perf/memory_gb")[1], default=None),
           lambda x: f"{x:.3g}"),
    Metric("dropped_tokens_frac", "dropped tokens", lambda r: layer_mean_of_last(r, "moe", "dropped_tokens_frac"),
           lambda x: f"{x:.2%}"),
    Metric("noop_frac", "no-op", lambda r: layer_mean_of_last(r, "moe", "noop_frac"), lambda x: f"{x:.2%}"),
    Metric("expert_work", "expert work / budget", expert_work_vs_budget, lambda x: f"{x:.1%}"),
    Metric("predictor_acc", "predictor acc", lambda r: causal_routing_acc(r), lambda x: f"{x:.2%}"),
]


def run_peaks(r: RunLog) -> list[float]:
    """The peaks (TFLOP/s per device, alike to 6 digits) the run's perf/mfu rows divide by: one per
    start where it changed (run_info.json `peaks`; runs from before it: `peak_tflops_per_device`)."""
    entries = r.info.get("peaks") or [{"peak_tflops_per_device": r.info.get("peak_tflops_per_device")}]
    vals = [e.get("peak_tflops_per_device") for e in entries if isinstance(e, dict)]
    return sorted({float(f"{p:.6g}") for p in vals if is_number(p) and math.isfinite(p)})


def mfu_peaks(runs: list[RunLog]) -> dict[float, list[RunLog]]:
    """{peak TFLOP/s per device: the runs that logged perf/mfu against it}, lowest peak first; a run
    resumed under another peak is listed under each."""
    out: dict[float, list[RunLog]] = {}
    for r in runs:
        if r.series("perf/mfu")[1].size:
            for peak in run_peaks(r):
                out.setdefault(peak, []).append(r)
    return dict(sorted(out.items()))


# data keys that decide which text a run evaluates on (mode.prepare.KEY_FIELDS without the tokenizer's)
EVAL_TEXT_KEYS = tuple(f"data.{k}" for k in KEY_FIELDS if k not in ("tokenizer", "eos_token"))


def data_mismatch_lines(runs: list[RunLog], runs_dir: Path) -> list[str]:
    """Report paragraphs when the runs' eval numbers are not on one scale: different tokenizers
    (nats per token measure different units: only bits/byte compares) or different eval text."""
    by_sha = all("tokenizer_sha256" in r.info for r in runs)  # run_info.json's, else the config's names

    def tokenizer(r: RunLog) -> str:
        c = flatten(r.config)
        return str(r.info["tokenizer_sha256"] if by_sha else (c.get("data.tokenizer"), c.get("data.eos_token")))

    lines = []
    for what, key, why in (
            ("tokenizers", tokenizer, "eval loss, its curves and the isoFLOP losses are nats per token of different "
             "tokens and do not compare across these groups; eval bits/byte does"),
            ("evaluation text", lambda r: str([flatten(r.config).get(k) for k in EVAL_TEXT_KEYS]),
             f"their data keys ({', '.join(f'`{k}`' for k in EVAL_TEXT_KEYS)}) differ, so no eval column compares "
             "runs across these groups")):
        groups: dict[str, list[RunLog]] = {}
        for r in runs:
            groups.setdefault(key(r), []).append(r)
        if len(groups) > 1:
            lines += [f"**Different {what}**: " + "; ".join(
                f"{', '.join(f'`{_rel(r.path, runs_dir)}`' for r in rs)}" for rs in groups.values())
                + f" — {why}.", ""]
    return lines


def run_summary(run: RunLog, eval_step: int | None = None) -> dict:
    """{metric key: value or None} plus identity and progress of one run; eval metrics at
    `eval_step` (the last evaluation at or before it; None: the last)."""
    # the *_vs_tokens / *_vs_mflops series carry tokens or MFLOPs as their step, not the training step
    steps = [pts[-1].step for tag, pts in run.scalars.items() if pts and not tag.endswith(("_vs_tokens", "_vs_mflops"))]
    read = run.point_at("eval/loss", eval_step)  # the evaluation read
    out = {"run": run.name, "path": str(run.path), "variant": run.variant, "seed": run.seed, "done": run.done,
           "last_step": max(steps) if steps else None, "config_diff": run.config_diff,
           "eval_step": read.step if read else None}
    for m in METRICS:
        v = m.reduce(run, eval_step) if m.at_eval_step else m.reduce(run)
        # a logged NaN (a diverged seed) stays NaN: read as "not logged", the seed left the variant's mean
        out[m.key] = None if v is None else float(v)
    return out


@dataclass(frozen=True)
class Stat:
    """Mean and sample standard deviation over the seeds that have the value (nan when one is nan)."""

    mean: float
    std: float  # nan for a single seed
    n: int

    def format(self, fmt: Callable[[float], str], constant: bool = False) -> str:
        if self.n == 1 or math.isnan(self.std) or (constant and self.std == 0):
            return fmt(self.mean)
        return f"{fmt(self.mean)} ± {fmt(self.std).lstrip('+')}"


def aggregate(values: list[float | None]) -> Stat | None:
    vals = np.array([v for v in values if v is not None], dtype=np.float64)
    if vals.size == 0:
        return None
    return Stat(float(vals.mean()), float(vals.std(ddof=1)) if vals.size > 1 else float("nan"), int(vals.size))


def variant_table(runs: list[RunLog]) -> dict[str, dict]:
    """{variant: {"seeds": [...], "eval_step": int | None, "runs": [run summaries], metric key: Stat | None}}.
    Eval metrics of every seed are read at `eval_step`, the last evaluation all of them reached: a
    seed stopped early (train.stop_at, or still running) is compared at its step, not averaged
    with the others' later losses."""
    table = {}
    for variant, vruns in group_by_variant(runs).items():
        ends = [s for s in (r.last_step("eval/loss") for r in vruns) if s is not None]
        eval_step = min(ends) if ends else None
        summaries = [run_summary(r, eval_step) for r in vruns]
        # seeds with another train.eval_every may have no evaluation at eval_step: each is read at its
        # last one before it, and the table says so (a range) instead of passing it off as eval_step's
        read = sorted({s["eval_step"] for s in summaries if s["eval_step"] is not None})
        row: dict = {"seeds": [r.seed for r in vruns], "eval_step": eval_step, "runs": summaries,
                     "eval_steps_read": read,
                     "causal_lifts_capacity": any(causal_lifts_capacity(r) for r in vruns)}
        for m in METRICS:
            row[m.key] = aggregate([s[m.key] for s in summaries])
        table[variant] = row
    return table


def md_row(cells: list[str]) -> str:
    """One markdown table row; a `|` in a run name, path or value is escaped (GFM splits cells on it,
    even inside backticks)."""
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def table_markdown(table: dict[str, dict]) -> str:
    """The variant table; columns nobody logged are left out (e.g. no MoE in the grid)."""
    metrics = [m for m in METRICS if any(row[m.key] is not None for row in table.values())]
    head = ["variant", "seeds", "eval step"] + [m.label for m in metrics]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for variant, row in table.items():
        read = row["eval_steps_read"]
        cells = [f"`{variant}`", str(len(row["seeds"])), "—" if row["eval_step"] is None
                 else str(row["eval_step"]) if len(read) < 2 else f"{read[0]}–{read[-1]}"]
        # a cell over fewer seeds than the variant has (a seed not evaluated yet) says how many
        cells += ["—" if row[m.key] is None else row[m.key].format(m.fmt, m.constant)
                  + (f" (n={row[m.key].n})" if row[m.key].n < len(row["seeds"]) else "")
                  + (f" {CAPACITY_MARK}" if m.key in ("eval_loss_causal", "causal_gap") and row["causal_lifts_capacity"]
                     else "") for m in metrics]
        lines.append(md_row(cells))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Curves against steps, compute and wall-clock.


def values_at_steps(run: RunLog, tag: str, steps: np.ndarray, per_step: float | None = None) -> np.ndarray | None:
    """A cumulative series that starts at 0 at step 0 (train/tokens, perf/elapsed_s) evaluated
    at arbitrary steps (eval steps need not be logging steps): interpolated between logged
    steps, extrapolated past the last one with `per_step` (default: the mean slope). None when
    the tag was never logged and no per_step is known."""
    s, v = run.series(tag)
    steps = np.asarray(steps, dtype=np.float64)
    if s.size == 0:
        return steps * per_step if per_step else None
    if s[0] > 0:
        s, v = np.concatenate([[0], s]), np.concatenate([[0.0], v])
    if per_step is None:
        per_step = v[-1] / s[-1] if s[-1] > 0 else 0.0
    out = np.interp(steps, s, v)
    return np.where(steps > s[-1], v[-1] + (steps - s[-1]) * per_step, out)


def training_flops_at(run: RunLog, steps: np.ndarray) -> np.ndarray | None:
    fpt = forward_flops_per_token(run)
    tokens = values_at_steps(run, "train/tokens", steps, run.info.get("tokens_per_step"))
    return None if fpt is None or tokens is None else TRAIN_FLOPS_PER_FORWARD_FLOP * fpt * tokens


def elapsed_at(run: RunLog, steps: np.ndarray) -> np.ndarray | None:
    return values_at_steps(run, "perf/elapsed_s", steps, median_after_warmup(run, "perf/step_time_s"))


def plot_loss_curves(runs: list[RunLog], path: Path, x: str) -> Path | None:
    """Train loss (faint) and eval loss (markers) of every run, one colour per variant.
    x: "step", "flops" (cumulative training FLOPs) or "time" (perf/elapsed_s)."""
    import matplotlib.pyplot as plt

    groups = group_by_variant(runs)
    colors = variant_colors(list(groups))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drew = False
    for variant, vruns in groups.items():
        for i, run in enumerate(vruns):
            for tag, style in (("train/loss", dict(alpha=0.3, lw=1)), ("eval/loss", dict(marker="o", ms=3, lw=1.6))):
                steps, loss = run.series(tag)
                if steps.size == 0:
                    continue
                xs = {"step": lambda s: s.astype(np.float64), "flops": lambda s: training_flops_at(run, s),
                      "time": lambda s: elapsed_at(run, s)}[x](steps)
                if xs is None:
                    continue
                if x == "flops":  # the step-0 eval sits at 0 FLOPs, which a log axis cannot show
                    keep = xs > 0
                    xs, loss = xs[keep], loss[keep]
                label = f"{variant} ({tag.split('/')[0]})" if i == 0 else None
                ax.plot(xs, loss, color=colors[variant], label=label, ls=SEED_STYLES[i % len(SEED_STYLES)], **style)
                drew = True
    if not drew:
        plt.close(fig)
        return None
    ax.set_xlabel({"step": "optimizer step",
                   "flops": "training FLOPs (3 × forward FLOPs/token × tokens; log scale, step 0 not shown)",
                   "time": "training wall-clock (s, perf/elapsed_s)"}[x])
    if x == "flops":
        ax.set_xscale("log")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"loss vs {x} (eval: markers, train: faint; seeds: line styles)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: never over a curve
    fig.tight_layout()
    save_figure(fig, path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------
# Per-layer routing.


def run_plan(run: RunLog):
    """The run's layer plan (mode/plan.py) from its saved config, or None (no or foreign config)."""
    from mode.config import ConfigError, ModelConfig, _build
    from mode.plan import layer_plan

    model = run.config.get("model") if isinstance(run.config, dict) else None
    if not isinstance(model, dict):
        return None
    try:
        return layer_plan(_build(ModelConfig, model, "model."))
    except (ConfigError, TypeError, ValueError):
        return None


def processed_frac_from_logs(run: RunLog) -> np.ndarray | None:
    """[L] fraction of tokens whose MLP update each block computes, when no routing dump exists:
    the depth-routing capacity of the block (or of its MLP, decoupled; as whole tokens, k/S) times, in MoE layers, the
    fraction of the tokens it sees that a real expert processed (`engaged_frac`: neither dropped
    nor sent only to no-ops). Runs logged before that tag: 1 − no-op share of routes, which
    ignores drops (approximate)."""
    plan = run_plan(run)
    if plan is None:
        return None
    from mode.config import DataConfig

    data = run.config.get("data") if isinstance(run.config.get("data"), dict) else {}
    seq_len = data.get("seq_len", DataConfig.seq_len)
    frac = np.array([lp.mlp_frac(seq_len) for lp in plan])
    for lp in plan:
        if lp.mlp == "moe":
            frac[lp.index] *= _moe_engaged(run, lp.index)
    return frac


def per_layer_processed(runs: list[RunLog]) -> dict[str, tuple[np.ndarray, str]]:
    """{variant: ([L] processed fraction averaged over seeds, source)}; from routing.pt where
    dumped (measured on an eval batch under top-k routing), else from the logs."""
    from analysis.routing import processed_frac_per_layer, try_load_dump

    out = {}
    for variant, vruns in group_by_variant(runs).items():
        dumps = [processed_frac_per_layer(d) for d in (try_load_dump(r.path / "routing.pt") for r in vruns) if d]
        if dumps and len({d.shape for d in dumps}) == 1:
            out[variant] = (np.mean(dumps, axis=0), "routing.pt")
            continue
        logged = [f for f in (processed_frac_from_logs(r) for r in vruns) if f is not None]
        if logged and len({f.shape for f in logged}) == 1:
            out[variant] = (np.mean(logged, axis=0), _logs_source(next(p for p in map(run_plan, vruns) if p)))
    return out


def _logs_source(plan) -> str:
    """Which of the logs' pieces a variant's per-layer fractions come from (their words in the report)."""
    from mode.plan import has_depth_routing, has_moe

    return {(True, True): "logs", (False, True): "logs-moe", (True, False): "config-mod"}.get(
        (has_depth_routing(plan), has_moe(plan)), "config")


SOURCE_TEXT = {
    "routing.pt": "routing.pt (one eval batch under top-k routing, after the last step)",
    "logs": "the training logs (MoD capacity × the last logged fraction of tokens a real expert processed, "
            "`engaged_frac`; 1 in a layer that routes nothing)",
    "logs-moe": "the training logs (the last logged fraction of tokens a real expert processed, `engaged_frac`; 1 "
                "in a dense layer)",
    "config-mod": "the configuration (MoD capacity as whole tokens, k/S; 1 in a layer that routes nothing)",
    "config": "the configuration (no routing: every block processes every token)"}


def split_decoupled(runs: list[RunLog], processed: dict[str, dict[int, float]], causal: dict[str, dict[int, float]],
                    colors: dict[str, str]) -> set[str]:
    """In place: a variant with decoupled routers (`mod_attn/`, `mod_mlp/` tags) becomes two rows,
    `<variant> (attn)` and `<variant> (mlp)`, each with its own router's processed fraction (top-k
    and causal, from the logs). Its single row would show the tokens that got both sublayers (the
    block contract's "engaged"), about the product of the two capacities, which reads as a bug. In
    an MoE layer the MLP row is the router's fraction × `engaged_frac` (neither dropped nor sent
    only to no-ops), as processed_frac_from_logs has it. Returns the variants split."""
    for sub in ("attn", "mlp"):
        topk = per_layer_metric(runs, f"mod_{sub}", "processed_frac", _moe_engaged if sub == "mlp" else None)
        cz = per_layer_metric(runs, f"mod_{sub}", "causal_processed_frac")
        for variant, frac in topk.items():
            name = f"{variant} ({sub})"
            layers = processed.get(variant, frac)
            processed[name] = {i: frac.get(i, 1.0) for i in layers}
            causal[name] = cz.get(variant, {})
            colors[name] = colors.get(variant, "C0") if sub == "attn" else "C9"
    split = {v.rsplit(" (", 1)[0] for v in processed if v.endswith((" (attn)", " (mlp)"))}
    for variant in split:
        processed.pop(variant, None)
        causal.pop(variant, None)
    return split


def _moe_engaged(run: RunLog, layer: int) -> float:
    """Fraction of the tokens an MoE layer's experts see that a real expert processed (1: not an MoE
    layer, or logged before these tags); runs logged before `engaged_frac`: 1 − no-op share."""
    engaged, noop = (run.last(f"moe/layer{layer}/{t}") for t in ("engaged_frac", "noop_frac"))
    if engaged is not None:
        return engaged
    return 1.0 - noop if noop is not None else 1.0


def per_layer_metric(runs: list[RunLog], prefix: str, name: str, scale=None) -> dict[str, dict[int, float]]:
    """{variant: {layer: last value of <prefix>/layerN/<name>, mean over seeds}} where logged;
    `scale(run, layer)`: a factor for each seed's value before the mean."""
    out = {}
    for variant, vruns in group_by_variant(runs).items():
        acc: dict[int, list[float]] = {}
        for r in vruns:
            for i, names in r.layer_tags(prefix).items():
                if name in names:
                    acc.setdefault(i, []).append(r.last(f"{prefix}/layer{i}/{name}") * (scale(r, i) if scale else 1.0))
        if acc:
            out[variant] = {i: float(np.mean(v)) for i, v in sorted(acc.items())}
    return out


def load_imbalance(runs: list[RunLog]) -> dict[str, dict[int, float]]:
    """{variant: {layer: load_max / load_mean of each seed's last log, mean over seeds}}: 1 = perfectly
    balanced experts (each seed's imbalance, then averaged as every per-layer column: not the ratio of
    the seeds' mean loads)."""
    out = {}
    for variant, vruns in group_by_variant(runs).items():
        acc: dict[int, list[float]] = {}
        for r in vruns:
            for i in r.layer_tags("moe"):
                mx, mean = r.last(f"moe/layer{i}/load_max"), r.last(f"moe/layer{i}/load_mean")
                if mx is not None and mean is not None and mean > 0:
                    acc.setdefault(i, []).append(mx / mean)
        if acc:
            out[variant] = {i: float(np.mean(v)) for i, v in sorted(acc.items())}
    return out


Panel = tuple  # (data {variant: {layer: value}}, ylabel, title[, overlay {variant: {layer: value}}])


def _grouped_bars(ax, data: dict[str, dict[int, float]], colors: dict[str, str], ylabel: str, title: str,
                  overlay: dict[str, dict[int, float]] | None = None) -> None:
    """Bars per (layer, variant); `overlay` values drawn as diamonds (the variant's colour, black edge)
    on the same slots."""
    overlay = overlay or {}
    variants = list(dict.fromkeys([*data, *overlay]))
    layers = sorted({i for d in (*data.values(), *overlay.values()) for i in d})
    width = 0.8 / max(1, len(variants))

    def xs(j: int, d: dict[int, float]) -> list[float]:
        return [layers.index(i) + (j - (len(variants) - 1) / 2) * width for i in d]

    for j, variant in enumerate(variants):
        if variant in data:
            ax.bar(xs(j, data[variant]), list(data[variant].values()), width=width, color=colors[variant],
                   label=variant)
        if variant in overlay:
            ax.plot(xs(j, overlay[variant]), list(overlay[variant].values()), "D", color=colors[variant],
                    mec="k", ms=6, label=f"{variant} (causal routing)")
    ax.set_xticks(range(len(layers)))
    ax.set_xticklabels([str(i) for i in layers])
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, axis="y")


def plot_per_layer(panels: list[Panel], colors: dict[str, str], path: Path) -> Path | None:
    """One grouped bar chart per panel that has data."""
    import matplotlib.pyplot as plt

    panels = [p for p in panels if p[0] or (len(p) > 3 and p[3])]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False)
    for ax, (data, ylabel, title, *overlay) in zip(axes[0], panels):
        _grouped_bars(ax, data, colors, ylabel, title, overlay[0] if overlay else None)
    handles = {}
    for ax in axes[0]:  # one key for all panels, below them, so no bar is hidden
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.tight_layout()
    fig.legend(handles.values(), handles.keys(), fontsize=7, loc="upper center", bbox_to_anchor=(0.5, 0.0),
               ncol=min(4, len(handles)), frameon=False)
    save_figure(fig, path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def per_layer_markdown(columns: list[tuple[str, dict[str, dict[int, float]], Callable[[float], str]]]) -> str:
    """Rows (variant, layer), one column per metric; only layers some metric covers."""
    columns = [c for c in columns if c[1]]
    if not columns:
        return ""
    variants = list(dict.fromkeys(v for _, data, _ in columns for v in data))
    head = ["variant", "layer"] + [c[0] for c in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v in variants:
        for i in sorted({i for _, data, _ in columns for i in data.get(v, {})}):
            cells = [fmt(data[v][i]) if i in data.get(v, {}) else "—" for _, data, fmt in columns]
            lines.append(md_row([f"`{v}`", str(i)] + cells))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# The report.


def _routing_section(runs: list[RunLog], out_dir: Path) -> list[str]:
    """Blocks engaged vs entropy and a routing heatmap per variant that has a routing dump
    (its lowest seed), as markdown lines."""
    from analysis import routing as rt

    lines = []
    for variant, vruns in group_by_variant(runs).items():
        run, dump = next(((r, d) for r in vruns if (d := rt.try_load_dump(r.path / "routing.pt"))), (None, None))
        if run is None:
            continue
        stats = rt.engagement_vs_entropy(dump)
        byte_tokens = run.cfg("data.tokenizer", "byte" if rt.looks_like_bytes(dump) else "") == "byte"
        scatter = rt.plot_engagement_vs_entropy(stats, out_dir / f"entropy_vs_blocks_{variant}.png",
                                                title=f"{variant} (seed {run.seed}): blocks engaged vs entropy")
        width = min(64, dump.input_ids_BS.shape[1])
        heat = rt.plot_routing_heatmap(dump, out_dir / f"routing_heatmap_{variant}.png", width=width,
                                       byte_tokens=byte_tokens, title=f"{variant} (seed {run.seed}): routing, row 0")
        r = "n/a (no variation: every token engages the same blocks)" if math.isnan(stats.pearson_r) \
            else f"{stats.pearson_r:.3f}"
        lines += [f"### `{variant}` (seed {run.seed}, {stats.n_blocks_T.size} tokens)", "",
                  f"Pearson correlation of blocks engaged with prediction entropy: **{r}**", "",
                  "| blocks engaged | tokens | mean entropy (nats) | std |", "|---|---|---|---|"]
        lines += [f"| {k} | {n} | {m:.3f} | {s:.3f} |" for k, n, m, s in stats.bins]
        text = rt.window_text(dump, 0, 0, width).replace("```", "'''")
        # a variant name may hold `#` (`dense#2`) or other URL syntax: percent-encoded in the link
        lines += ["", f"![]({quote(scatter.name)})", "", f"Sample sequence (row 0, first {width} tokens):", "",
                  "```text", text, "```", "", f"![]({quote(heat.name)})", ""]
    return lines


def analyze(runs_dir: str | Path, out_dir: str | Path | None = None, budgets: list[float] | None = None) -> Path:
    """Write report.md, summary.json and figures for every run under runs_dir; return report.md's path.
    out_dir defaults to RUNS_DIR/report (for one run, RUN_DIR/report: a run artefact, mode/rundir.py,
    so the run can still be resumed); it must be new, empty or a mode report's (analysis/outdir.py:
    ConfigError before anything is written), and gets the marker first. A run whose config.yaml is
    unreadable is left out, named on stderr (one line) and in the report. An isoFLOP section is
    added when the runs form an isoFLOP grid; `budgets` (training FLOPs) names its budgets, else
    they are clustered."""
    from analysis.outdir import check_report_dir, make_report_dir, remove_stale_figures

    runs_dir = Path(runs_dir)
    skipped: list[tuple[Path, str]] = []
    runs = load_runs(runs_dir, skipped)
    if not runs:  # before anything is written
        if skipped:
            raise NoRuns(f"no readable run directories under {runs_dir}: {skipped_line(skipped).split(': ', 1)[1]}; "
                         "nothing written")
        raise NoRuns(f"no run directories under {runs_dir} (a run directory holds tb/ or run_info.json); "
                     "nothing written")
    out_dir = Path(out_dir) if out_dir is not None else runs_dir / "report"
    check_report_dir(out_dir, "out_dir")  # never a user's report.md (ConfigError, nothing written)
    if skipped:
        print(skipped_line(skipped), file=sys.stderr)
    damaged = [d for r in runs for d in r.damaged]
    if damaged:
        print(damaged_line(damaged), file=sys.stderr)
    make_report_dir(out_dir)
    import matplotlib

    matplotlib.use("Agg")

    table = variant_table(runs)
    lines = [f"# Comparison report: `{runs_dir}`", ""]
    unfinished = [r.name for r in runs if not r.done]
    lines += [f"{len(runs)} runs, {len(table)} variants."
              + (f" Still running or interrupted (no DONE): {', '.join(unfinished)}." if unfinished else ""), ""]
    if skipped:  # said on stderr too: a run missing from the tables is never silent
        lines += [f"**Left out** ({len(skipped)} run(s) whose config.yaml is unreadable, so which variant they "
                  "are seeds of is unknown): " + "; ".join(f"`{_rel(p, runs_dir)}` ({why})" for p, why in skipped)
                  + ".", ""]
    if damaged:  # on stderr too: points missing from a run's curves and table are never silent
        lines += [f"**Damaged event files** ({len(damaged)}, records lost from the middle): "
                  + "; ".join(damaged) + ".", ""]

    lines += data_mismatch_lines(runs, runs_dir)

    split: dict[str, list[RunLog]] = {}
    for r in sorted((r for r in runs if r.config_diff), key=lambda r: (variant_sort_key(r.variant), str(r.path))):
        split.setdefault(r.variant.partition("#")[0], []).append(r)
    for name, group in split.items():
        keys = list(group[0].config_diff)
        lines += [f"**Runs named `{name}` do not share one config, or repeat a seed**: each config (and each "
                  f"repeat of a seed, key `repeat`) is its own variant (`{name}#k`), never averaged with the "
                  "others. The keys that differ:", "",
                  "| variant | run | " + " | ".join(f"`{k}`" for k in keys) + " |", "|---|---|" + "---|" * len(keys)]
        lines += [md_row([f"`{r.variant}`", f"`{_rel(r.path, runs_dir)}`"] + [str(r.config_diff[k]) for k in keys])
                  for r in group]
        lines.append("")
    lines += ["## Summary per variant (mean ± sample std over seeds, n − 1)", "", table_markdown(table), "",
              "Eval losses are at `eval step`, the last evaluation every seed of the variant reached (a seed "
              "stopped early is not averaged with the others' later losses; a range: seeds evaluated at different steps (another `train.eval_every`), each read at its last evaluation up to the range's end; a seed's nan, a diverged run, makes the "
              "variant's nan; `(n=k)`: only k of the seeds have the value, e.g. one not evaluated yet); tokens/s and step time are "
              "medians over logged points without each process's first (warm-up: the run's first and the first after each resume); routing fractions are the last logged value averaged over routed "
              "layers (predictor acc: of the causal predictor, of the learned threshold (`causal=threshold`), "
              "or of the router's sign rule without either); dropped tokens (a share of tokens) and no-op (a share "
              "of routes) count only what the MoE layer sees: inside a depth-routed block (staged MoDE) the "
              "block's routed tokens, not all tokens (per-layer `processed` below is a share of all tokens). "
              "`eval loss` is under the training routing: top-k over the whole sequence, so a depth router's choice "
              "at a position depends on later tokens' scores (and an MoE's drops on later tokens' routes), which "
              "sampling cannot see; `eval loss (causal routing)` is what sampling gets. "
              "`causal − top-k` is the eval loss under causal (sampling-time) routing minus the eval loss under "
              f"top-k routing; {CAPACITY_MARK}: under causal routing these variants' MoE layers also run at another "
              "capacity (`model.moe.inference_capacity_factor`, null: dropless) than under top-k, so for a dropping "
              "MoE the gap is dropless minus dropping, not a routing-causality gap (for MoDE, both at once). "
              "Variants are compared at budgeted FLOPs (experts counted at capacity); expert work / budget is the "
              "expert rows computed (top_k × `moe/layerN/load_mean`, last log, mean over MoE layers) over the rows "
              "budgeted: below 100% where drops and no-op routes leave budgeted capacity unused. "
              "MFU: median of perf/mfu (training FLOPs = 3 × forward, against the peak in "
              "run_info.json); peak mem: the largest perf/memory_gb logged (each process of a resumed run "
              "measures its own peak).", ""]
    over = [r for r in runs if (median_after_warmup(r, "perf/mfu") or 0.0) > 1.0]
    if over:  # achieved FLOP/s above the peak: the peak, not the run, is wrong
        lines += ["**MFU above 100%** in " + ", ".join(f"`{_rel(r.path, runs_dir)}` "
                  f"({median_after_warmup(r, 'perf/mfu'):.0%} against "
                  f"{r.info.get('peak_tflops_per_device', float('nan')):.3g} TFLOP/s)" for r in over)
                  + ": their peak was measured below what they achieved (a CPU peak measured while other "
                  "jobs held the cores); compare MFU across runs only with one `perf.peak_tflops` for all.", ""]
    peaks = mfu_peaks(runs)
    if len(peaks) > 1:  # each run's MFU has its own denominator: the column (and a seed spread) mixes them
        lines += ["**MFU against different peaks** (TFLOP/s per device, run_info.json): "
                  + "; ".join(f"{p:.3g}: " + ", ".join(f"`{_rel(r.path, runs_dir)}`" for r in rs)
                              for p, rs in peaks.items())
                  + ". Each run's MFU divides by its own peak (on CPU measured at its start, lower while other jobs "
                  "hold the cores), so the MFU column and its spread over seeds compare runs only where the peak is "
                  "the same: compare tokens/s, or rerun with one `perf.peak_tflops` for all.", ""]
    mixed = [r for r in runs if r.series("perf/mfu")[1].size and len(run_peaks(r)) > 1]
    if mixed:  # one median over rows with different denominators
        lines += ["**MFU of one run against several peaks**: " + ", ".join(
            f"`{_rel(r.path, runs_dir)}` ({', '.join(f'{p:.3g}' for p in run_peaks(r))})" for r in mixed)
                  + ": a resumed start measured (or was given, `perf.peak_tflops`) another peak than the rows "
                  "before it (run_info.json `peaks`), so its MFU median mixes denominators; its tokens/s do not.", ""]

    lines += ["## Loss curves", ""]
    for x, name in (("step", "loss_vs_step.png"), ("flops", "loss_vs_flops.png"), ("time", "loss_vs_time.png")):
        if plot_loss_curves(runs, out_dir / name, x) is not None:
            lines += [f"![loss vs {x}]({name})", ""]

    colors = variant_colors(list(table))
    processed = per_layer_processed(runs)
    processed_data = {v: dict(enumerate(f.tolist())) for v, (f, _) in processed.items()}
    causal = per_layer_metric(runs, "mod", "causal_processed_frac")
    split = split_decoupled(runs, processed_data, causal, colors)
    dropped_tok = per_layer_metric(runs, "moe", "dropped_tokens_frac")
    dropped_rt = per_layer_metric(runs, "moe", "dropped_routes_frac")
    noop = per_layer_metric(runs, "moe", "noop_frac")
    imbalance = load_imbalance(runs)
    for metric in (dropped_tok, dropped_rt, noop, imbalance):  # the experts are the MLP's: on its row
        for v in split & set(metric):
            metric[f"{v} (mlp)"] = metric.pop(v)
    pct = lambda x: f"{x:.1%}"  # noqa: E731
    lines += ["## Per-layer routing", ""]
    if processed:
        last_log = _last_log_steps(runs)
        split = sorted(split)
        lines += ["Fraction of tokens each block processes: "
                  + ", ".join(f"`{v}` from {SOURCE_TEXT[src]}" for v, (_, src) in processed.items() if v not in split)
                  + "".join(f"; `{v}` (decoupled routing) one row per router, attention and MLP, from the training "
                            "logs (the MLP's × `engaged_frac` in MoE layers)" for v in split) + ". "
                  "Causal-routing fractions, load, dropped and no-op fractions are the last training log "
                  + (f"(step {last_log}, training batches), not the eval batch." if last_log
                     else "(none yet: no run has trained to its first train.log_every step), not the eval batch."),
                  ""]
    fig = plot_per_layer([(processed_data, "fraction of tokens processed",
                           "per layer: bars top-k" + (", diamonds causal routing" if causal else ""), causal)],
                         colors, out_dir / "routing_per_layer.png")
    if fig:
        lines += [f"![]({fig.name})", ""]
    fig = plot_per_layer([(imbalance, "load_max / load_mean", "expert load imbalance (1 = balanced)"),
                          (dropped_tok, "fraction", "dropped tokens"), (dropped_rt, "fraction", "dropped routes"),
                          (noop, "fraction", "routed to no-op experts")], colors, out_dir / "expert_load.png")
    if fig:
        lines += [f"![]({fig.name})", ""]
    md = per_layer_markdown([("processed", processed_data, pct), ("processed (causal)", causal, pct),
                             ("load max/mean", imbalance, lambda x: f"{x:.2f}"), ("dropped tokens", dropped_tok, pct),
                             ("dropped routes", dropped_rt, pct), ("no-op", noop, pct)])
    if md:
        lines += [md, ""]

    routing_lines = _routing_section(runs, out_dir)
    if routing_lines:
        lines += ["## Routing vs prediction entropy", "",
                  "Per token of one eval batch: the number of blocks that processed it across depth against the "
                  "entropy of the model's next-token prediction there (MoD paper: tokens engaging more blocks "
                  "have higher-entropy predictions).", ""] + routing_lines

    from analysis import isoflop

    iso = isoflop.isoflop_section(runs, out_dir, budgets)
    if iso:
        lines += iso

    lines += ["## Runs", "", "| run | path | variant | seed | last step | done | eval loss |",
              "|---|---|---|---|---|---|---|"]
    for row in table.values():
        for s in row["runs"]:
            ev = "—" if s["eval_loss"] is None else f"{s['eval_loss']:.4f}"
            lines.append(md_row([f"`{s['run']}`", f"`{_rel(Path(s['path']), runs_dir)}`", f"`{s['variant']}`",
                                 str(s["seed"]), str(s["last_step"]), "yes" if s["done"] else "no", ev]))
    path = out_dir / "report.md"
    write_atomic(path, "\n".join(lines) + "\n")
    # strict JSON: a diverged seed's NaN is null (as in metrics.jsonl), which any JSON reader takes
    write_atomic(out_dir / "summary.json", json.dumps(finite_or_null(summary_json(table)), indent=2, allow_nan=False))
    remove_stale_figures(out_dir, ["report.md", "isoflop.md"])  # an earlier report's, no longer shown
    return path


def finite_or_null(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite_or_null(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_or_null(v) for v in x]
    return x


def summary_json(table: dict[str, dict]) -> dict:
    """The table as plain JSON: per variant, per metric {mean, std, n} and the per-run values."""
    out = {}
    for variant, row in table.items():
        out[variant] = {"seeds": row["seeds"], "eval_step": row["eval_step"], "runs": row["runs"]}
        for m in METRICS:
            st = row[m.key]
            out[variant][m.key] = None if st is None else {"mean": st.mean, "std": None if math.isnan(st.std)
                                                            else st.std, "n": st.n}
    return out


def main(argv: list[str] | None = None) -> int:
    from mode.errors import OneLineParser

    p = OneLineParser(prog="mode analyze", description="Comparison report of the runs under RUNS_DIR.")
    p.add_argument("runs_dir", metavar="RUNS_DIR", help="directory holding run directories (or one run directory)")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="output directory (default: RUNS_DIR/report; for one run RUN_DIR/report, which "
                        "resuming or run.fresh=true leaves in place); not elsewhere inside a run directory; "
                        "new, empty or holding an earlier mode report (.mode-report), never a user's files")
    p.add_argument("--experiment", metavar="YAML", default=None,
                   help="experiment YAML; its top-level FLOP `budgets:` group an isoFLOP grid (else budgets are "
                        "clustered), as `mode compare` does")
    args = p.parse_args(argv)
    from analysis.isoflop import load_budgets
    from analysis.outdir import check_report_dir
    from mode.config import ConfigError, refuse_blank, user_path
    from mode.rundir import REPORT, check_outside_runs

    try:
        # `~` in a quoted argument too, as `mode compare`; "" is no directory (Path("") is the cwd)
        runs_dir = Path(user_path(args.runs_dir, "RUNS_DIR"))
        if not runs_dir.is_dir() or not args.runs_dir.strip():
            raise ConfigError("RUNS_DIR", args.runs_dir, "an existing directory of run directories (or one run "
                                                         "directory)")
        refuse_blank("--out", args.out)  # was taken as no --out: the report went to the default
        out = Path(user_path(args.out, "--out")) if args.out else None
        if out is not None:
            check_outside_runs(args.out, "--out", owned=REPORT)
        # a report only into a new or empty directory or a mode report's (never a user's report.md)
        check_report_dir(out if out is not None else runs_dir / REPORT, "--out",
                         args.out if out is not None else str(runs_dir / REPORT))
        path = analyze(runs_dir, out, load_budgets(args.experiment) if args.experiment is not None else None)
    except ConfigError as e:  # bad paths, a bad `budgets:`: one line, nothing written
        print(e, file=sys.stderr)
        return 2
    except NoRuns as e:  # bad input like the others: a `config error:` line, exit 2
        print(ConfigError("RUNS_DIR", args.runs_dir, msg=f"RUNS_DIR={args.runs_dir!r}: {e}"), file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

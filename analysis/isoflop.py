"""isoFLOP analysis (MoD paper fig. 4, Chinchilla "approach 2"): at each fixed training
budget, final eval loss against model size; the best size per variant is where the loss is
lowest, taken from a parabola fitted in log10(params) when three or more sizes exist.

A run's budget is 3 x forward FLOPs/token x tokens/step x train.max_steps (what it was
configured to spend, so runs still in progress are grouped correctly); its loss is the eval loss at
train.max_steps, so a run stopped early or still running is no point (listed apart), nor is one whose final
loss is not finite (diverged; listed apart). Runs are grouped by
the nearest budget named in the experiment YAML (its top-level `budgets:`, read by
`parse_budgets` for `mode compare` and `mode analyze --experiment` alike) within 25%, or else by clustering
budgets within a relative tolerance (the sizing rounds model shapes, so budgets match only
approximately). One curve is the runs whose configs differ only in model size and steps
(`SWEPT`): the variants `dense_s`, `dense_m` of a compare grid, or same-named runs of several
sizes (`dense#1`, `dense#2`).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from analysis.outdir import save_figure
from analysis.tb import (TRAIN_FLOPS_PER_FORWARD_FLOP, RunLog, config_signature, forward_flops_per_token, load_runs,
                         variant_colors, variant_sort_key)
from mode.config import ConfigError, is_number, parse_yaml, refuse_blank
from mode.rundir import write_atomic

BUDGETS_ALLOWED = "a positive FLOP number or a non-empty list of them, e.g. [1.0e15, 3.0e15]"
# What an isoFLOP sweep varies between the runs of one curve: the model's size and, to hold the
# budget, the number of steps.
SWEPT = ("model.d_model", "model.n_layers", "model.n_heads", "model.d_ff", "train.max_steps")


def parse_budgets(experiment: dict) -> list[float] | None:
    """The FLOP budgets of an experiment YAML (its parsed top-level mapping): `budgets:`, one
    positive number or a list of them, sorted; None when absent. The one reader of the key, for
    `mode compare` and `mode analyze --experiment`. Strings such as "1e15" count as numbers (YAML
    1.1 reads an exponent without a dot as a string); anything else is a ConfigError."""
    raw = experiment.get("budgets")
    if raw is None:
        return None
    out = []
    for b in raw if isinstance(raw, list) else [raw]:
        try:
            v = float(b) if isinstance(b, str) or is_number(b) else math.nan
        except ValueError:
            v = math.nan
        if not (math.isfinite(v) and v > 0):
            raise ConfigError("budgets", raw, BUDGETS_ALLOWED)
        out.append(v)
    if not out:
        raise ConfigError("budgets", raw, BUDGETS_ALLOWED)
    return sorted(set(out))


def load_budgets(experiment_yaml: str | Path) -> list[float] | None:
    """`parse_budgets` of an experiment YAML file (`mode analyze --experiment`)."""
    refuse_blank("--experiment", str(experiment_yaml))  # was read as no --experiment
    path = Path(experiment_yaml)
    try:
        raw = parse_yaml(path.read_bytes().decode("utf-8"))  # as `mode compare` reads it: duplicate keys refused
    except OSError:
        raise ConfigError("--experiment", str(path), "an existing experiment YAML file") from None
    except UnicodeDecodeError as e:  # it exists: "an existing ... file" sent the user looking for the wrong fault
        raise ConfigError("--experiment", str(path), f"a UTF-8 YAML file (byte {e.start} is not UTF-8)") from None
    except yaml.YAMLError as e:
        raise ConfigError("--experiment", str(path), f"valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise ConfigError("--experiment", str(path), "an experiment YAML (a mapping at the top level)")
    return parse_budgets(raw)


def curve_names(runs: list[RunLog]) -> dict[str, str]:
    """{variant: the isoFLOP curve it belongs to}. Variants whose configs differ only in `SWEPT`
    keys are one curve, named by the common leading words of their names (`dense_s`, `dense_m`
    -> `dense`; `dense#1`, `dense#2` -> `dense`), or by all their names when none are common."""
    groups: dict[str, set[str]] = {}
    for r in runs:
        sig = {k: v for k, v in config_signature(r).items() if k not in SWEPT}
        groups.setdefault(json.dumps(sorted(sig.items()), default=str), set()).add(r.variant)
    named: dict[str, list[set[str]]] = {}
    for variants in groups.values():
        bases = sorted({v.partition("#")[0] for v in variants})
        common = []
        for parts in zip(*(re.split(r"[_.-]", b) for b in bases)):
            if len(set(parts)) > 1:
                break
            common.append(parts[0])
        name = bases[0] if len(bases) == 1 else "_".join(common) or "+".join(bases)
        named.setdefault(name, []).append(variants)
    out = {}
    for name, sets in named.items():
        for variants in sets:  # two curves that would share a name keep their variants' names
            out.update({v: name if len(sets) == 1 else "+".join(sorted(variants)) for v in variants})
    return out


def training_budget(run: RunLog) -> float | None:
    """Configured training FLOPs of a run, or None when run_info/config lack the pieces."""
    fpt, tps, steps = forward_flops_per_token(run), run.info.get("tokens_per_step"), run.cfg("train.max_steps")
    if fpt is None or tps is None or steps is None:
        return None
    return TRAIN_FLOPS_PER_FORWARD_FLOP * float(fpt) * float(tps) * float(steps)


def assign_budgets(values: list[float], budgets: list[float] | None = None, rtol: float = 0.25) -> list[float]:
    """The budget each value belongs to: the nearest of `budgets` in log space when within rtol of
    it, else (and without budgets) the geometric mean of its cluster (sorted values, a new cluster
    whenever a value exceeds the cluster's smallest by more than rtol)."""
    if budgets:
        logb = np.log(np.asarray(budgets, dtype=np.float64))
        near = [float(budgets[int(np.argmin(np.abs(logb - math.log(v))))]) for v in values]
        # a run far from every named budget (another experiment's in the same runs_dir) is at none of
        # them: under the nearest, its loss would read as that budget's result
        label = [b if abs(math.log(v / b)) <= math.log(1 + rtol) else None for v, b in zip(values, near)]
        rest = [i for i, b in enumerate(label) if b is None]
        for i, b in zip(rest, assign_budgets([values[i] for i in rest], None, rtol)):
            label[i] = b
        return label
    order = np.argsort(values)
    label = [0.0] * len(values)
    cluster: list[int] = []

    def close(members):
        g = float(np.exp(np.mean([math.log(values[m]) for m in members])))
        for m in members:
            label[m] = g

    for i in order:
        if cluster and values[i] > values[cluster[0]] * (1 + rtol):
            close(cluster)
            cluster = []
        cluster.append(int(i))
    if cluster:
        close(cluster)
    return label


@dataclass(frozen=True)
class SizePoint:
    """Final eval loss of one model size at one budget (mean over its seeds)."""

    variant: str
    budget: float
    params: float
    loss: float
    n_seeds: int


@dataclass(frozen=True)
class Optimum:
    variant: str
    budget: float
    params: float  # loss-minimising size (fitted, or best observed)
    loss: float
    method: str  # "parabola" (fit in log10 params) or "observed" (fewer than 3 sizes / no interior minimum)


def final_eval_loss(run: RunLog) -> float | None:
    """eval/loss at the run's train.max_steps (the trainer always evaluates there), or the last one
    of a finished run (DONE); None for a run stopped early (train.stop_at) or still running: its
    loss is not the loss at its budget."""
    steps = run.cfg("train.max_steps")
    pts = [p for p in run.scalars.get("eval/loss", []) if p.step == steps]
    return pts[-1].value if pts else run.last("eval/loss") if run.done else None


def collect_points(runs: list[RunLog], budgets: list[float] | None = None, rtol: float = 0.25,
                   unfinished: list[RunLog] | None = None, diverged: list[RunLog] | None = None) -> list[SizePoint]:
    """Mean final eval loss per (curve, budget, size). Only runs evaluated at their train.max_steps (or
    DONE) count; the others, which have a budget and an eval loss, are appended to `unfinished`, and
    those whose final loss is not finite to `diverged`."""
    usable = [(r, training_budget(r)) for r in runs]
    usable = [(r, b) for r, b in usable if b and r.last("eval/loss") is not None and r.info.get("params")]
    if unfinished is not None:
        unfinished += [r for r, _ in usable if final_eval_loss(r) is None]
    usable = [(r, b) for r, b in usable if final_eval_loss(r) is not None]
    # a NaN point makes the parabola NaN and argmin pick it: a diverged size would read as the optimum
    if diverged is not None:
        diverged += [r for r, _ in usable if not math.isfinite(final_eval_loss(r))]
    usable = [(r, b) for r, b in usable if math.isfinite(final_eval_loss(r))]
    labels = assign_budgets([b for _, b in usable], budgets, rtol)
    curve = curve_names([r for r, _ in usable])
    acc: dict[tuple[str, float, float], list[float]] = {}
    for (r, _), label in zip(usable, labels):
        acc.setdefault((curve[r.variant], label, float(r.info["params"])), []).append(final_eval_loss(r))
    return sorted((SizePoint(v, b, p, float(np.mean(ls)), len(ls)) for (v, b, p), ls in acc.items()),
                  key=lambda s: (variant_sort_key(s.variant), s.budget, s.params))


def fit_optimum(params: np.ndarray, losses: np.ndarray) -> tuple[float, float, str, np.ndarray | None]:
    """(best params, its loss, method, parabola coefficients in log10 params or None).
    The parabola's vertex is used only when it curves upward and lies inside the sampled range."""
    params, losses = np.asarray(params, dtype=np.float64), np.asarray(losses, dtype=np.float64)
    i = int(np.argmin(losses))
    if np.unique(params).size >= 3:
        x = np.log10(params)
        coef = np.polyfit(x, losses, 2)
        if coef[0] > 0:
            xv = -coef[1] / (2 * coef[0])
            if x.min() <= xv <= x.max():
                return float(10 ** xv), float(np.polyval(coef, xv)), "parabola", coef
        return float(params[i]), float(losses[i]), "observed", coef
    return float(params[i]), float(losses[i]), "observed", None


def optima(points: list[SizePoint]) -> list[Optimum]:
    groups: dict[tuple[str, float], list[SizePoint]] = {}
    for p in points:
        groups.setdefault((p.variant, p.budget), []).append(p)
    out = []
    for (variant, budget), pts in groups.items():
        n, loss, method, _ = fit_optimum(np.array([p.params for p in pts]), np.array([p.loss for p in pts]))
        out.append(Optimum(variant, budget, n, loss, method))
    return sorted(out, key=lambda o: (variant_sort_key(o.variant), o.budget))


def scaling_law(opts: list[Optimum], variant: str) -> tuple[float, float] | None:
    """(a, b) of params_opt = a * budget**b fitted in log-log over budgets, or None (< 2 budgets)."""
    pts = [(o.budget, o.params) for o in opts if o.variant == variant]
    if len({b for b, _ in pts}) < 2:
        return None
    b, loga = np.polyfit(np.log([p[0] for p in pts]), np.log([p[1] for p in pts]), 1)
    return float(math.exp(loga)), float(b)


def size_for_budget(budget_flops: float, opts: list[Optimum], variant: str) -> float | None:
    """Compute-optimal parameter count for a training budget, from the isoFLOP optima of one
    variant: the power-law fit across budgets, or the single optimum's size scaled as
    sqrt(budget) (Chinchilla's exponent) when only one budget was run."""
    law = scaling_law(opts, variant)
    if law is not None:
        return law[0] * budget_flops ** law[1]
    mine = [o for o in opts if o.variant == variant]
    if not mine:
        return None
    return mine[0].params * math.sqrt(budget_flops / mine[0].budget)


def plot_isoflop(points: list[SizePoint], opts: list[Optimum], path: str | Path) -> Path:
    """One panel per budget: loss vs params (log x) per variant with its fitted parabola and
    its best size starred; a last panel with optimal size vs budget when several budgets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = sorted({p.budget for p in points})
    variants = sorted({p.variant for p in points}, key=variant_sort_key)
    colors = variant_colors(variants)
    n_panels = len(budgets) + (1 if len(budgets) > 1 else 0)
    fig, axes = plt.subplots(1, n_panels, figsize=(4.5 * n_panels, 4), squeeze=False)
    for ax, budget in zip(axes[0], budgets):
        for v in variants:
            pts = [p for p in points if p.variant == v and p.budget == budget]
            if not pts:
                continue
            n, loss = np.array([p.params for p in pts]), np.array([p.loss for p in pts])
            ax.plot(n, loss, "o", color=colors[v], label=v)
            *_, coef = fit_optimum(n, loss)
            if coef is not None:
                xs = np.linspace(np.log10(n.min()), np.log10(n.max()), 50)
                ax.plot(10 ** xs, np.polyval(coef, xs), "--", color=colors[v], lw=1)
            o = next(o for o in opts if o.variant == v and o.budget == budget)
            ax.plot([o.params], [o.loss], "*", ms=14, color=colors[v], mec="k")
        ax.set_xscale("log")
        ax.set_xlabel("parameters")
        ax.set_ylabel("final eval loss")
        ax.set_title(f"budget {budget:.3g} FLOPs", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if len(budgets) > 1:
        ax = axes[0][-1]
        for v in variants:
            mine = [o for o in opts if o.variant == v]
            ax.plot([o.budget for o in mine], [o.params for o in mine], "*-", color=colors[v], label=v, ms=10)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("training FLOPs")
        ax.set_ylabel("loss-optimal parameters")
        ax.set_title("optimal size vs budget", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path


def is_isoflop_grid(points: list[SizePoint]) -> bool:
    """Some variant was run at two or more sizes for one budget."""
    sizes: dict[tuple[str, float], set] = {}
    for p in points:
        sizes.setdefault((p.variant, p.budget), set()).add(p.params)
    return any(len(s) >= 2 for s in sizes.values())


def isoflop_section(runs: list[RunLog], out_dir: Path, budgets: list[float] | None = None) -> list[str]:
    """Markdown lines (and isoflop.png) when the runs form an isoFLOP grid, else []."""
    unfinished: list[RunLog] = []
    diverged: list[RunLog] = []
    points = collect_points(runs, budgets, unfinished=unfinished, diverged=diverged)
    if not is_isoflop_grid(points):
        return []
    opts = optima(points)
    fig = plot_isoflop(points, opts, Path(out_dir) / "isoflop.png")
    grouping = (f"each run at the nearest budget the experiment names (`budgets: "
                f"[{', '.join(f'{b:.3g}' for b in budgets)}]`) within 25%, other runs at clusters of their "
                "training FLOPs" if budgets else
                "budgets are clusters of the runs' training FLOPs (within 25%; an experiment's `budgets:` names them)")
    lines = ["## isoFLOP", "", "Final eval loss vs parameters at each training budget "
             f"(3 × forward FLOPs/token × tokens/step × max_steps; {grouping}); one curve per variant whose runs "
             "differ only in model size and steps; stars mark the loss-optimal size per variant.",
             "", f"![isoFLOP]({fig.name})", "", "| variant | budget (FLOPs) | optimal params | loss | method |",
             "|---|---|---|---|---|"]
    lines += [f"| `{o.variant}` | {o.budget:.3g} | {o.params:.3g} | {o.loss:.4f} | {o.method} |" for o in opts]
    if unfinished:
        lines += ["", "Left out, not evaluated at their `train.max_steps` yet (stopped early or still running): "
                  + ", ".join(f"`{r.name}` (eval step {r.last_step('eval/loss')} of {r.cfg('train.max_steps')})"
                              for r in unfinished) + "."]
    if diverged:
        lines += ["", "Left out, final eval loss not finite (diverged): "
                  + ", ".join(f"`{r.name}` ({final_eval_loss(r)})" for r in diverged) + "."]
    for v in dict.fromkeys(o.variant for o in opts):
        law = scaling_law(opts, v)
        if law:
            lines.append(f"\n`{v}`: optimal params ≈ {law[0]:.3g} × C^{law[1]:.3f}")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.isoflop",
                                description="isoFLOP curves: final loss vs size per budget, runs under RUNS_DIR.")
    p.add_argument("runs_dir", metavar="RUNS_DIR")
    p.add_argument("--experiment", metavar="YAML", help="experiment YAML naming the FLOP budgets (`budgets:`)")
    p.add_argument("--out", metavar="DIR", help="output directory (default: RUNS_DIR/report)")
    args = p.parse_args(argv)
    from analysis.outdir import check_report_dir, make_report_dir

    out = Path(args.out or Path(args.runs_dir) / "report")
    try:
        refuse_blank("RUNS_DIR", args.runs_dir, "a directory of run directories (an unset shell variable?)")
        refuse_blank("--out", args.out)  # an unset shell variable: not "no option"
        # `is not None`: load_budgets refuses a blank --experiment itself (as `mode analyze` calls it)
        budgets = load_budgets(args.experiment) if args.experiment is not None else None
        check_report_dir(out, "--out")  # never over a user's isoflop.md (nothing written)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    make_report_dir(out)
    lines = isoflop_section(load_runs(args.runs_dir), out, budgets)
    if not lines:
        print("no isoFLOP grid found: no variant has two sizes at one budget", file=sys.stderr)
        return 1
    write_atomic(out / "isoflop.md", "\n".join(lines) + "\n")
    print(out / "isoflop.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

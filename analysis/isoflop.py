"""isoFLOP analysis (MoD paper fig. 4, Chinchilla "approach 2"): at each fixed training
budget, final eval loss against model size; the best size per variant is where the loss is
lowest, taken from a parabola fitted in log10(params) when three or more sizes exist.

A run's budget is 3 x forward FLOPs/token x tokens/step x train.max_steps (what it was
configured to spend, so runs still in progress are grouped correctly). Runs are grouped by
the nearest budget named in the experiment YAML, or else by clustering budgets within a
relative tolerance (the sizing rounds model shapes, so budgets match only approximately).
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from analysis.tb import (TRAIN_FLOPS_PER_FORWARD_FLOP, RunLog, forward_flops_per_token, load_runs, variant_colors,
                         variant_sort_key)


def training_budget(run: RunLog) -> float | None:
    """Configured training FLOPs of a run, or None when run_info/config lack the pieces."""
    fpt, tps, steps = forward_flops_per_token(run), run.info.get("tokens_per_step"), run.cfg("train.max_steps")
    if fpt is None or tps is None or steps is None:
        return None
    return TRAIN_FLOPS_PER_FORWARD_FLOP * float(fpt) * float(tps) * float(steps)


def assign_budgets(values: list[float], budgets: list[float] | None = None, rtol: float = 0.25) -> list[float]:
    """The budget each value belongs to: the nearest of `budgets` in log space, or, without
    budgets, the geometric mean of its cluster (sorted values, a new cluster whenever a value
    exceeds the cluster's smallest by more than rtol)."""
    if budgets:
        logb = np.log(np.asarray(budgets, dtype=np.float64))
        return [float(budgets[int(np.argmin(np.abs(logb - math.log(v))))]) for v in values]
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


def collect_points(runs: list[RunLog], budgets: list[float] | None = None, rtol: float = 0.25) -> list[SizePoint]:
    usable = [(r, training_budget(r)) for r in runs]
    usable = [(r, b) for r, b in usable if b and r.last("eval/loss") is not None and r.info.get("params")]
    labels = assign_budgets([b for _, b in usable], budgets, rtol)
    acc: dict[tuple[str, float, float], list[float]] = {}
    for (r, _), label in zip(usable, labels):
        acc.setdefault((r.variant, label, float(r.info["params"])), []).append(r.last("eval/loss"))
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
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def load_budgets(experiment_yaml: str | Path) -> list[float] | None:
    """FLOP budgets named in an experiment YAML: the first key called `budgets`,
    `flop_budgets`, `budget` or `flop_budget` at any depth (a number or a list; strings like
    "1e15" are accepted since YAML 1.1 reads them as strings)."""
    keys = ("budgets", "flop_budgets", "budget", "flop_budget")

    def find(node):
        if isinstance(node, dict):
            for k in keys:
                if k in node:
                    return node[k]
            for v in node.values():
                found = find(v)
                if found is not None:
                    return found
        elif isinstance(node, list):
            for v in node:
                found = find(v)
                if found is not None:
                    return found
        return None

    raw = find(yaml.safe_load(Path(experiment_yaml).read_text()))
    if raw is None:
        return None
    return sorted(float(b) for b in (raw if isinstance(raw, list) else [raw]))


def is_isoflop_grid(points: list[SizePoint]) -> bool:
    """Some variant was run at two or more sizes for one budget."""
    sizes: dict[tuple[str, float], set] = {}
    for p in points:
        sizes.setdefault((p.variant, p.budget), set()).add(p.params)
    return any(len(s) >= 2 for s in sizes.values())


def isoflop_section(runs: list[RunLog], out_dir: Path, budgets: list[float] | None = None) -> list[str]:
    """Markdown lines (and isoflop.png) when the runs form an isoFLOP grid, else []."""
    points = collect_points(runs, budgets)
    if not is_isoflop_grid(points):
        return []
    opts = optima(points)
    fig = plot_isoflop(points, opts, Path(out_dir) / "isoflop.png")
    lines = ["## isoFLOP", "", "Final eval loss vs parameters at each training budget "
             "(3 × forward FLOPs/token × tokens/step × max_steps); stars mark the loss-optimal size per variant.",
             "", f"![isoFLOP]({fig.name})", "", "| variant | budget (FLOPs) | optimal params | loss | method |",
             "|---|---|---|---|---|"]
    lines += [f"| `{o.variant}` | {o.budget:.3g} | {o.params:.3g} | {o.loss:.4f} | {o.method} |" for o in opts]
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
    out = Path(args.out or Path(args.runs_dir) / "report")
    out.mkdir(parents=True, exist_ok=True)
    budgets = load_budgets(args.experiment) if args.experiment else None
    lines = isoflop_section(load_runs(args.runs_dir), out, budgets)
    if not lines:
        print("no isoFLOP grid found: no variant has two sizes at one budget", file=sys.stderr)
        return 1
    (out / "isoflop.md").write_text("\n".join(lines) + "\n")
    print(out / "isoflop.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

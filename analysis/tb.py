"""Read the scalars of many runs from their TensorBoard event files.

Reads the records itself (tensorboard's own Event protos and compat layers), not through
EventAccumulator: the accumulator reservoir-samples long series (it keeps 10k scalars per tag by
default), and tensorboard's loader stops at the first damaged record, dropping the rest of the
file without a word. Merge rules for resumed runs:

- a resumed run appends new event files to the same tb/ directory, and the trainer records each
  resume in run_info.json (`resumes`: step, train/tokens_seen, train/flops_seen, wall time). A
  point written before a resume past its position is the stopped process's (logged after its
  last checkpoint, never trained by the run that goes on): dropped. The position is the step, or
  for `*_vs_tokens` / `*_vs_mflops` the tokens or MFLOPs seen, their step axes. The trainer also
  rewrites the event files without them when it resumes (mode.loggers.drop_events_after), so that
  TensorBoard's own view has none either (after TensorBoard restarts); files it leaves (damaged
  before their end, mtimes reset by a copy) and runs resumed before it did still hold them;
- per (tag, step) the point with the latest wall time wins (ties: the later file / later
  record): re-logged steps of runs written without a START;
- a half-written or damaged last record (a run killed mid-write) ends the file silently; a
  damaged record with readable ones after it is skipped, the reading goes on at the next record
  that checks, and the file is named (stderr, and the report) since its points there are lost;
- tags a variant never logs (dense has no mod/ or moe/ tags) are simply absent.

A run directory holds config.yaml, run_info.json, tb/, optionally routing.pt and DONE.
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import yaml

from mode.config import EXECUTION_KEYS, flatten
from mode.loggers import EVENT_GLOB, event_records
from mode.routed import TRAIN_FLOPS_PER_FORWARD_FLOP  # noqa: F401  (the trainer's convention; report/isoflop use it)

_SEED_SUFFIX = re.compile(r"^(?P<variant>.+?)[_-]seed(?P<seed>\d+)$")


@dataclass(frozen=True)
class Point:
    """One logged scalar."""

    step: int
    value: float
    wall_time: float


@dataclass(frozen=True)
class Row:
    """One scalar as a flat table row, keyed by run, variant, seed, tag and step."""

    run: str
    variant: str
    seed: int
    tag: str
    step: int
    value: float
    wall_time: float


@dataclass
class RunLog:
    """Everything the analysis reads from one run directory."""

    path: Path
    variant: str
    seed: int
    info: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    scalars: dict[str, list[Point]] = field(default_factory=dict)
    done: bool = False
    config_diff: dict = field(default_factory=dict)
    """Set when other runs share this run's name with another config: the keys that differ, with this run's values."""
    damaged: list[str] = field(default_factory=list)
    """Event files of this run with records lost from the middle (read_scalars), one line each."""

    @property
    def name(self) -> str:
        return self.path.name

    def series(self, tag: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of a tag sorted by step; empty arrays when the tag was never logged."""
        pts = self.scalars.get(tag, [])
        return (np.array([p.step for p in pts], dtype=np.int64), np.array([p.value for p in pts], dtype=np.float64))

    def last(self, tag: str) -> float | None:
        """Value at the highest logged step, or None."""
        pts = self.scalars.get(tag)
        return pts[-1].value if pts else None

    def point_at(self, tag: str, step: int | None):
        """The point at the highest logged step <= `step` (the last one for None), or None."""
        pts = [p for p in self.scalars.get(tag, []) if step is None or p.step <= step]
        return pts[-1] if pts else None

    def at(self, tag: str, step: int | None) -> float | None:
        """Value at the highest logged step <= `step` (the last one for None), or None."""
        p = self.point_at(tag, step)
        return p.value if p else None

    def last_step(self, tag: str) -> int | None:
        pts = self.scalars.get(tag)
        return pts[-1].step if pts else None

    def cfg(self, dotted: str, default=None):
        """A value of the resolved config by dotted key (`train.max_steps`), or `default`."""
        node = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def layer_tags(self, prefix: str) -> dict[int, list[str]]:
        """{layer index: metric names} for tags `<prefix>/layerN/<name>` (prefix `mod` or `moe`)."""
        out: dict[int, list[str]] = {}
        pat = re.compile(rf"^{re.escape(prefix)}/layer(\d+)/(.+)$")
        for tag in self.scalars:
            m = pat.match(tag)
            if m:
                out.setdefault(int(m.group(1)), []).append(m.group(2))
        return dict(sorted(out.items()))

    def rows(self) -> Iterator[Row]:
        for tag, pts in self.scalars.items():
            for p in pts:
                yield Row(self.name, self.variant, self.seed, tag, p.step, p.value, p.wall_time)


# ----------------------------------------------------------------------------------------------
# Event files.


def event_files(tb_dir: str | Path) -> list[Path]:
    """Event files under tb_dir (recursively), oldest first by the timestamp in their names."""
    files = [p for p in Path(tb_dir).rglob(EVENT_GLOB) if p.is_file()]

    def created(p: Path):  # events.out.tfevents.<unix time>.<host>.<pid>.<n>
        parts = p.name.split(".")
        try:
            return (float(parts[3]), p.name)
        except (IndexError, ValueError):
            return (float("inf"), p.name)

    return sorted(files, key=created)


def _events(path: Path, damage: list[tuple[int, int]]):
    """Event protos of one file through tensorboard's read-time compat layers (as EventFileLoader:
    legacy `simple_value` summaries of torch's SummaryWriter become tensors)."""
    from google.protobuf.message import DecodeError
    from tensorboard import data_compat, dataclass_compat
    from tensorboard.compat.proto import event_pb2

    initial_metadata: dict = {}
    for record in event_records(path, damage):
        try:
            event = event_pb2.Event.FromString(record)
        except DecodeError:  # checks but is no Event: not a TensorBoard record
            continue
        yield from dataclass_compat.migrate_event(data_compat.migrate_event(event), initial_metadata)


def _scalars(event) -> Iterator[tuple[str, float]]:
    from tensorboard.util import tensor_util

    for v in event.summary.value if event.HasField("summary") else ():
        if v.HasField("tensor"):
            arr = tensor_util.make_ndarray(v.tensor)
            if arr.size != 1 or arr.dtype.kind not in "fiub":
                continue  # not a scalar (histogram, text, image ...)
            yield v.tag, float(arr.reshape(()))
        elif v.HasField("simple_value"):
            yield v.tag, float(v.simple_value)


def _stale(resumes: list[dict]):
    """(tag, step, wall) -> written before a resume, past its position (module docstring)."""
    limits = []
    for r in resumes:
        try:
            limits.append((float(r["time"]), int(r["step"]), int(r["train/tokens_seen"]),
                           int(float(r["train/flops_seen"]) / 1e6)))  # mode/loggers.py: loss_vs_mflops's step
        except (KeyError, TypeError, ValueError):
            continue  # a run_info.json written by hand or by an older version: nothing known to drop

    def stale(tag: str, step: int, wall: float) -> bool:
        at = 2 if tag.endswith("_vs_tokens") else 3 if tag.endswith("_vs_mflops") else 1
        return any(wall < lim[0] and step > lim[at] for lim in limits)

    return stale


def _damage_line(path: Path, damage: list[tuple[int, int]]) -> str:
    return (f"{path} ({sum(b for _, b in damage)} damaged byte(s) from offset {damage[0][0]}: the points in them "
            "are lost, the rest of the file was read; run.dir/metrics.jsonl holds every logged row)")


def iter_scalar_events(path: str | Path, damaged: list[str] | None = None) -> Iterator[tuple[str, int, float, float]]:
    """(tag, step, value, wall_time) for every scalar in one event file, in file order. A damaged
    record in the middle is skipped and the file named in `damaged` (see mode.loggers.event_records)."""
    damage: list[tuple[int, int]] = []
    for event in _events(Path(path), damage):
        for tag, value in _scalars(event):
            yield tag, int(event.step), value, float(event.wall_time)
    if damage and damaged is not None:
        damaged.append(_damage_line(Path(path), damage))


def read_scalars(tb_dir: str | Path, damaged: list[str] | None = None,
                 resumes: list[dict] | None = None) -> dict[str, list[Point]]:
    """{tag: points sorted by step}, one point per step: points a stopped process logged past the
    resume that followed (run_info.json's `resumes`) dropped, then the latest write by wall time
    wins (module docstring). Event files with records lost from the middle are appended to
    `damaged` (one line each), or, without a list, named on stderr."""
    stale = _stale(resumes or [])
    best: dict[tuple[str, int], tuple[float, int, float]] = {}  # (tag, step) -> (wall, order, value)
    lines: list[str] = []
    order = 0
    for f in event_files(tb_dir):
        damage: list[tuple[int, int]] = []
        for event in _events(f, damage):
            step, wall = int(event.step), float(event.wall_time)
            for tag, value in _scalars(event):
                order += 1
                if stale(tag, step, wall):
                    continue
                key = (tag, step)
                prev = best.get(key)
                if prev is None or (wall, order) >= (prev[0], prev[1]):
                    best[key] = (wall, order, value)
        if damage:
            lines.append(_damage_line(f, damage))
    if damaged is not None:
        damaged += lines
    elif lines:
        print(damaged_line(lines), file=sys.stderr)
    out: dict[str, list[Point]] = {}
    for (tag, step), (wall, _, value) in best.items():
        out.setdefault(tag, []).append(Point(step, value, wall))
    for pts in out.values():
        pts.sort(key=lambda p: p.step)
    return dict(sorted(out.items()))


def damaged_line(damaged: list[str]) -> str:
    """One stderr line naming the event files that lost records from the middle."""
    return f"warning: {len(damaged)} event file(s) damaged in the middle: " + "; ".join(damaged)


# ----------------------------------------------------------------------------------------------
# Run directories.


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and ((path / "tb").is_dir() or (path / "run_info.json").is_file())


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # absent, or being written right now by an in-progress run


class UnreadableRun(ValueError):
    """A run directory whose config.yaml exists but cannot be read as a YAML mapping: its config,
    which decides which runs are seeds of one variant, is unknown, so the run is left out."""


def _read_config(path: Path) -> dict:
    """config.yaml as a mapping; {} when there is none (yet). UnreadableRun when it is there but not
    UTF-8 text, not YAML or not a mapping (a foreign or damaged file: never read as an empty config)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise UnreadableRun(f"config.yaml cannot be read ({e.strerror or e})") from None
    try:
        d = yaml.safe_load(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UnreadableRun(f"config.yaml is not UTF-8 text (byte {e.start})") from None
    except yaml.YAMLError as e:
        raise UnreadableRun(f"config.yaml is not valid YAML ({' '.join(str(e).split())[:120]})") from None
    if d is None:  # empty: the trainer has not written it yet
        return {}
    if not isinstance(d, dict):
        raise UnreadableRun(f"config.yaml is not a mapping (a {type(d).__name__})")
    return d


def load_run_log(path: str | Path) -> RunLog:
    """One run directory. Variant and seed come from run_info.json, else config.yaml
    (run.name, train.seed), else the directory name `<variant>_seed<N>`. UnreadableRun when its
    config.yaml is there but unreadable."""
    path = Path(path)
    info = _read_json(path / "run_info.json")
    config = _read_config(path / "config.yaml")
    m = _SEED_SUFFIX.match(path.name)
    variant = info.get("name") or (config.get("run") or {}).get("name") or (m.group("variant") if m else path.name)
    seed = info.get("seed", (config.get("train") or {}).get("seed", int(m.group("seed")) if m else 0))
    damaged: list[str] = []
    resumes = info.get("resumes") if isinstance(info.get("resumes"), list) else []
    scalars = read_scalars(path / "tb", damaged, resumes) if (path / "tb").is_dir() else {}
    return RunLog(path, str(variant), int(seed), info, config, scalars, (path / "DONE").exists(), damaged=damaged)


def find_run_dirs(runs_dir: str | Path, max_depth: int = 3) -> list[Path]:
    """Run directories at or below runs_dir (a run dir itself counts), sorted by path."""
    root = Path(runs_dir)
    if is_run_dir(root):
        return [root]
    found, frontier = [], [root]
    for _ in range(max_depth):
        nxt = []
        for d in frontier:
            for child in sorted(p for p in d.iterdir() if p.is_dir()) if d.is_dir() else []:
                (found if is_run_dir(child) else nxt).append(child)
        frontier = nxt
    return sorted(found)


def load_runs(runs_dir: str | Path, skipped: list[tuple[Path, str]] | None = None) -> list[RunLog]:
    """Every readable run under runs_dir. A run whose config.yaml is unreadable is left out: appended
    to `skipped` as (path, why) when a list is given (the caller reports it and the runs' `damaged`
    event files), else named on stderr, as are damaged event files."""
    runs, left_out = [], []
    for p in find_run_dirs(runs_dir):
        try:
            runs.append(load_run_log(p))
        except UnreadableRun as e:
            left_out.append((p, str(e)))
    if skipped is not None:
        skipped += left_out
    else:
        if left_out:
            print(skipped_line(left_out), file=sys.stderr)
        if any(r.damaged for r in runs):
            print(damaged_line([d for r in runs for d in r.damaged]), file=sys.stderr)
    return separate_configs(runs)


def skipped_line(skipped: list[tuple[Path, str]]) -> str:
    """One stderr line naming the runs left out and why."""
    return (f"warning: left out {len(skipped)} run(s) whose config.yaml is unreadable: "
            + "; ".join(f"{p} ({why})" for p, why in skipped))


# What a run measures does not depend on its seed, where it lives, how often it logs and saves, or how
# its data is read and its activations kept (the same tokens, the same math: a seed resumed with more
# tokenizer workers or with activation checkpointing is still a seed of its variant); everything else
# (model, data, tokenizer, steps, batch, optimizer, precision) and the world size do.
NOT_COMPARED = ("train.seed",) + EXECUTION_KEYS


def config_signature(run: RunLog) -> dict:
    """The run's resolved config minus seed/run/logging keys, plus its world size and the schedule
    changes it was resumed with (run_info.json)."""
    sig = {k: v for k, v in flatten(run.config).items() if not k.startswith(NOT_COMPARED)}
    if "world_size" in run.info:
        sig["world_size"] = run.info["world_size"]
    if run.info.get("schedule_changes"):  # resumed with another LR schedule (train.allow_schedule_change)
        sig["schedule_changes"] = run.info["schedule_changes"]
    return sig


def separate_configs(runs: list[RunLog]) -> list[RunLog]:
    """Runs named alike (`run.name`) are seeds of one variant only if their configs agree and their
    seeds differ; otherwise each config (and each repeat of a seed: key `repeat`) becomes its own
    variant `<name>#1`, `<name>#2`, ... (first by path) and its runs get `config_diff`, the keys in
    which they differ, so a report never averages unlike runs or counts a seed twice."""
    by_name: dict[str, list[RunLog]] = {}
    for r in runs:
        by_name.setdefault(r.variant, []).append(r)
    for name, group in by_name.items():
        sigs = [config_signature(r) for r in group]
        # a seed run twice with one config (another launcher, a copy) is a repeat, not another sample:
        # the n-th run of a (config, seed) pair, by path, goes into the n-th variant of that config
        seen: dict[str, int] = {}
        for r, s in zip(group, sigs):
            k = json.dumps([sorted(s.items()), r.seed], default=str)
            seen[k] = seen.get(k, 0) + 1
            s["repeat"] = seen[k]
        if max(seen.values()) == 1:
            for s in sigs:
                del s["repeat"]
        keys = [json.dumps(sorted(s.items()), default=str) for s in sigs]
        distinct = list(dict.fromkeys(keys))
        if len(distinct) < 2:
            continue
        all_keys = sorted({k for s in sigs for k in s})
        differing = [k for k in all_keys if len({json.dumps(s.get(k), default=str) for s in sigs}) > 1]
        for r, s, key in zip(group, sigs, keys):
            r.variant = f"{name}#{distinct.index(key) + 1}"
            r.config_diff = {k: s.get(k) for k in differing}
    return runs


def to_rows(runs: list[RunLog]) -> list[Row]:
    """All scalars of all runs as flat rows (run, variant, seed, tag, step, value, wall_time)."""
    return [r for run in runs for r in run.rows()]


def group_by_variant(runs: list[RunLog]) -> dict[str, list[RunLog]]:
    """{variant: runs sorted by seed}, variants in a fixed, readable order."""
    out: dict[str, list[RunLog]] = {}
    for run in runs:
        out.setdefault(run.variant, []).append(run)
    return {v: sorted(out[v], key=lambda r: (r.seed, r.name)) for v in sorted(out, key=variant_sort_key)}


VARIANT_ORDER = ("dense", "mod", "moe", "moe_dropping", "mode_staged", "mode_integrated")


def variant_sort_key(name: str):
    """Baselines first in the order the comparison reads, then anything else alphabetically;
    `dense#2` (a same-named run with another config) sorts with `dense`."""
    base, _, n = name.partition("#")
    num = (0, 0, "") if not n else (1, int(n), "") if n.isdigit() else (2, 0, n)  # dense#2 before dense#10
    return (VARIANT_ORDER.index(base), "", num) if base in VARIANT_ORDER else (len(VARIANT_ORDER), base, num)


def forward_flops_per_token(run: RunLog) -> float | None:
    f = run.info.get("forward_flops_per_token")
    return float(f) if f is not None else run.last("perf/flops_per_token")


def variant_colors(variants: list[str]) -> dict[str, str]:
    """matplotlib's 10 default colours; beyond 10 variants tab20's 20 (else two variants would share one)."""
    if len(variants) <= 10:
        return {v: f"C{i}" for i, v in enumerate(variants)}
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    tab20 = colormaps["tab20"].colors
    return {v: to_hex(tab20[i % len(tab20)]) for i, v in enumerate(variants)}

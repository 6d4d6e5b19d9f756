"""Where a report may be written: a new or empty directory, or one a mode report was written to.

A report (`mode analyze`, `mode compare`, `python -m analysis.isoflop`) writes report.md,
summary.json, isoflop.md and figures under fixed names, which would replace a user's own files of
those names. So it writes only into a directory that is new or empty, or that holds MARKER (written
first, with every report), or, for reports written before the marker existed, that holds nothing
but the files a report writes and whose report.md is a mode report (its first line). Anything else
is refused before anything is written (ConfigError, one line).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from urllib.parse import unquote

from mode.config import ConfigError
from mode.rundir import existing_base
from mode.rundir import shown as shown_names

MARKER = ".mode-report"
HEADER = "# Comparison report: `"  # report.md's first line (analysis/report.py)
# The names a report writes (analysis/report.py, analysis/routing.py via report.py, analysis/isoflop.py).
REPORT_FILES = re.compile(r"^(report\.md|summary\.json|isoflop\.md|isoflop\.png|loss_vs_(step|flops|time)\.png|"
                          r"routing_per_layer\.png|expert_load\.png|(entropy_vs_blocks|routing_heatmap)_.+\.png)$")


def has_marker(d: Path) -> bool:
    try:
        return json.loads((d / MARKER).read_text()).get("written_by") == "mode report"
    except (OSError, ValueError, AttributeError):
        return False


def _old_report(d: Path, names: list[str]) -> bool:
    """A report written before the marker existed: only report files (no marker, not even a foreign
    one), and report.md is mode's."""
    if not all(REPORT_FILES.match(n) for n in names) or not (d / "report.md").is_file():
        return False
    try:
        with open(d / "report.md", "rb") as f:
            return f.readline().decode("utf-8").startswith(HEADER)
    except (OSError, UnicodeDecodeError):
        return False


def is_report_dir(d: Path) -> bool:
    """A directory a report may be written into: absent, empty, or a mode report's (see above)."""
    d = Path(d)
    if not d.exists():
        return True
    if not d.is_dir():
        return False
    names = sorted(p.name for p in d.iterdir())
    return not names or has_marker(d) or _old_report(d, names)


def check_report_dir(out: str | Path, key: str, shown: str | None = None) -> Path:
    """Refuse (ConfigError, nothing written) an output directory a report would overwrite a user's
    files in, a file, a path below a file or a read-only place. `shown`: the value as the user wrote it."""
    d = Path(os.path.expanduser(str(out)))
    value = str(out) if shown is None else shown
    if d.exists() and not d.is_dir():
        raise ConfigError(key, value, "a directory for the report (this path is a file)")
    if d.is_dir() and not is_report_dir(d):
        raise ConfigError(key, value, f"a new or empty directory, or one a mode report was written to; it holds "
                                      f"{shown_names(sorted(p.name for p in d.iterdir()))} and no {MARKER}, so the "
                                      "report will not overwrite them")
    ancestor = existing_base(d, key, value)
    if not os.access(ancestor, os.W_OK):
        raise ConfigError(key, value, f"a writable directory ({ancestor} is not writable)")
    return d


def make_report_dir(d: Path) -> None:
    """Create the checked directory and write the marker first: whatever follows is a mode report's."""
    d.mkdir(parents=True, exist_ok=True)
    if not has_marker(d):
        (d / MARKER).write_text(json.dumps({"written_by": "mode report"}) + "\n")


def remove_stale_figures(d: Path, written: list[str]) -> list[str]:
    """After a report is written into `d` (which holds MARKER): the figures an earlier report wrote
    under names this one no longer uses (a variant renamed `dense` -> `dense#1`), which report.md no
    longer shows. Only report figure names, and never one that `written` (the .md files) refer to."""
    if not has_marker(d):
        return []
    shown = set()
    for name in written:
        try:
            shown |= {unquote(x) for x in re.findall(r"\]\(([^)]+\.png)\)", (d / name).read_text())}  # links quote '#'
        except OSError:
            pass
    stale = sorted(p.name for p in d.iterdir() if p.suffix == ".png" and REPORT_FILES.match(p.name)
                   and p.name not in shown and p.is_file())
    for name in stale:
        (d / name).unlink()
    return stale


def save_figure(fig, path: Path, **kw) -> None:
    """fig.savefig, whole or not at all: written beside and renamed over `path`, so a full disk leaves
    an earlier report's figure as it was (a PNG cut part-way is what report.md would show)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fig.savefig(tmp, format="png", **kw)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise

"""Run directories: what may be written or deleted, and one writer at a time.

A run directory is recognised by what `mode` writes into it (ARTEFACTS). `run.fresh=true` empties
only a directory whose every entry is such an artefact, and never the current directory or a
parent of it; a start into an existing directory that holds anything else is refused, so a
user's files are never overwritten or deleted.

One writer: the live job holds an exclusive `flock` on `<dir>/LOCK` (rank 0 of a trainer, or
`mode compare` on its runs_dir). The kernel drops the lock when the holder dies, however it dies;
the file keeps the holder's pid/host/command so a second writer can be told who holds it, and so
the next holder can say it took over from a dead one.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from mode.checkpoint import CHECKPOINTS, checkpoints_dir
from mode.config import ConfigError

LOCK = "LOCK"
# Everything a run writes at its top level. A branch that adds an artefact adds its name here.
ARTEFACTS = {"config.yaml", "run_info.json", "DONE", "tb", CHECKPOINTS, "routing.pt", "deepspeed_env", LOCK,
             "metrics.jsonl", "wandb", "wandb_id", "eval", "slurm"}  # loggers, `mode eval` results, SLURM logs and hostfiles
# Entries only a run (never a user) writes: a directory with one of them (and nothing foreign) is a run.
SIGNATURES = (CHECKPOINTS, "tb", "run_info.json", LOCK)


def _is_within(a: Path, b: Path) -> bool:
    """a == b or a is inside b (both resolved)."""
    return a == b or b in a.parents


def foreign_entries(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name not in ARTEFACTS)


def is_mode_run(d: Path) -> bool:
    """Every entry is something `mode` writes, and at least one only a run writes."""
    return d.is_dir() and not foreign_entries(d) and any((d / s).exists() for s in SIGNATURES)


def check(run_dir: str, fresh: bool, key: str = "run.dir", lock: bool = True) -> Path:
    """Refuse a run directory that would lose a user's files; raises ConfigError (nothing written)."""
    if not run_dir.strip():
        raise ConfigError(key, run_dir, "a non-empty path (an unset shell variable?)")
    d = Path(os.path.expanduser(run_dir))
    here = Path.cwd().resolve()
    if _is_within(here, d.resolve()):
        raise ConfigError(key, run_dir, "a directory that is neither the current directory nor a parent of it "
                                        "(e.g. runs/NAME)")
    if d.exists() and not d.is_dir():
        raise ConfigError(key, run_dir, "a directory (this path is a file)")
    if d.is_dir():
        foreign = foreign_entries(d)
        if foreign:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            what = "delete (run.fresh=true)" if fresh else "write a run into"
            raise ConfigError(key, run_dir, f"a new, empty or mode run directory; it holds {shown}, which mode did "
                                            f"not write, so it will not {what} it")
        if lock:
            check_lock(d, key)
    ancestor = d
    while not ancestor.exists():
        ancestor = ancestor.parent
    for p in (ancestor, checkpoints_dir(d), d / "tb"):
        if p.exists() and not os.access(p, os.W_OK):
            raise ConfigError(key, run_dir, f"a writable directory ({p} is read-only)")
    return d


def empty_run_dir(d: Path) -> None:
    """run.fresh: delete what a previous run wrote (check() proved it is all ours), not the lock we hold."""
    for p in d.iterdir():
        if p.name == LOCK:
            continue
        assert p.name in ARTEFACTS, p  # check() ran first
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


# ----------------------------------------------------------------------------------------------
# One writer per directory.


def _holder(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def describe_holder(h: dict) -> str:
    if not h:
        return "another process"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.get("started", 0)))
    return f"pid {h.get('pid')} on {h.get('host')} (since {when}: {h.get('cmd', '?')})"


def check_lock(d: Path, key: str = "run.dir") -> None:
    """Refuse if a live process holds d/LOCK (probe only: nothing is created)."""
    path = d / LOCK
    if not path.exists():
        return
    with open(path, "rb") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(key, msg=f"{key}={str(d)!r} is in use by {describe_holder(_holder(path))}; "
                              "wait for it to finish or stop it") from None
        fcntl.flock(f, fcntl.LOCK_UN)


class DirLock:
    """Exclusive lock on d/LOCK for this process's lifetime (or until release())."""

    def __init__(self, d: Path, key: str = "run.dir"):
        d.mkdir(parents=True, exist_ok=True)
        self.path = d / LOCK
        self.f = open(self.path, "a+")
        try:
            fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.f.close()
            raise ConfigError(key, msg=f"{key}={str(d)!r} is in use by {describe_holder(_holder(self.path))}; "
                              "wait for it to finish or stop it") from None
        previous = _holder(self.path)
        if previous:  # released cleanly, the file is empty: its holder died
            print(f"{d}: taking over the lock of {describe_holder(previous)}, which is no longer running",
                  file=sys.stderr)
        self.f.seek(0)
        self.f.truncate()
        self.f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                                 "cmd": " ".join(sys.argv)[:300]}))
        self.f.flush()

    def release(self) -> None:
        if getattr(self, "f", None) is not None and not self.f.closed:
            self.f.truncate(0)
            self.f.flush()
            self.f.close()  # closing the descriptor drops the flock

    def __del__(self):
        self.release()

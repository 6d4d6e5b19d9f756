"""Run directories: what may be written or deleted, and one writer at a time.

A run directory is recognised by what `mode` writes into it: every entry is an ARTEFACT and at
least one is a SIGNATURE, a name only a run writes (a user's own `config.yaml` or `eval/` is not
enough). A start, fresh or not, goes only into a new or empty directory or such a run, never the
current directory, a parent of it or $HOME, so a user's files are never overwritten or deleted.
`run.fresh=true` empties the run but keeps `slurm/`: the SLURM job writes its log and hostfile
there before the trainer starts (launch/slurm.sbatch), and a directory holding only that is new.
It keeps `report/`, `eval/` and `wandb/` too: `mode analyze RUN_DIR`, `mode eval` and the W&B
logger write them there, but the name is no proof that mode wrote what they hold (a user's own
notes or results may be there; W&B's offline runs may not be synced yet), and nothing mode cannot
prove it wrote is deleted. A start is refused inside another run (it would become a foreign
entry that stops the outer run from resuming).

One writer: the live job holds an exclusive `flock` on `<dir>/LOCK` (rank 0 of a trainer, or
`mode compare` on its runs_dir). The kernel drops the lock when the holder dies, however it dies;
the file keeps the holder's pid/host/command so a second writer can be told who holds it, and so
the next holder can say it took over from a dead one. Where the filesystem has no flock (Lustre
mounted without -o flock, NFS without lockd) that record is the lock itself (`DirLock`).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import sys
import time
from fcntl import LOCK_EX, LOCK_NB, LOCK_SH, LOCK_UN, flock  # by name: a test replaces this module's flock only
from pathlib import Path

from mode.checkpoint import CHECKPOINTS, checkpoints_dir, complete_checkpoints, unlisted_files
from mode.config import ConfigError, refuse_blank, user_path
from mode.lifeline import NO_FLOCK, alive, start_time

LOCK = "LOCK"
TB_REWRITE = ".tb_rewrite.tmp"
# Everything a run writes at its top level. A branch that adds an artefact adds its name here.
ARTEFACTS = {"config.yaml", "run_info.json", "DONE", "tb", CHECKPOINTS, "routing.pt", "deepspeed_env", LOCK,
             "metrics.jsonl", "wandb", "wandb_id", "eval", "slurm",  # loggers, `mode eval` results, SLURM logs
             "report",  # `mode analyze RUN_DIR`'s default output: analysing a run must leave it resumable
             ".config.yaml.tmp", ".run_info.json.tmp", ".metrics.jsonl.tmp",  # write_atomic's, left by a crash mid-write
             TB_REWRITE}  # mode.loggers.drop_events_after's (not in tb/: TensorBoard reads any *tfevents* file there)
# (deepspeed_env: launch/run.py wrote DeepSpeed's env file into run.dir before it used a temporary
# directory; runs started then still hold one and must stay resumable)
# Entries only a run (never a user) writes: a directory with one of them (and nothing foreign) is a run.
SIGNATURES = (CHECKPOINTS, "tb", "run_info.json", LOCK)
# What proves a directory *above* a new run.dir to be a run: a LOCK alone does not (a `mode compare`
# runs_dir holds one beside its first run).
RUN_PROOFS = (CHECKPOINTS, "tb", "run_info.json")
RUN_INFO_KEYS = {"world_size", "forward_flops_per_token", "tokens_per_step"}  # some of what train.py writes
STEP_ENTRY = re.compile(r"^step_\d{8}(\.tmp|\.bad\d*)?$")  # mode/checkpoint.py's names (.bad2, ...: _move_aside)
# DeepSpeed's ZeRO save (stages 1, 2) copies its recovery scripts beside the tag directories, into checkpoints/
DEEPSPEED_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
# Written before the trainer starts by the job that starts it (its live log): never emptied by fresh.
JOB_LOGS = "slurm"
# Never deleted by fresh either (see above): a stale report of the old run is rewritten by the next
# analyze, `mode eval` results name the weights they scored, W&B names each run's folder apart.
REPORT = "report"
KEPT_BY_FRESH = (REPORT, "eval", "wandb")


def write_atomic(path: Path, text: str | bytes, tmp: Path | None = None) -> None:
    """Replace `path` whole or not at all (a crash mid-write of config.yaml would leave the run
    unresumable): write `tmp` (default `.<name>.tmp` beside it), fsync, rename over it."""
    tmp = tmp or path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk: leave nothing a later start would take for a foreign file
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def parents_made(d: Path, undo_on: tuple = (BaseException,), key: str | None = None, value=None):
    """`mkdir -p d` for the block; if it raises one of `undo_on`, the directories this made are
    removed again (innermost first, only while empty): a refused command leaves no empty folders.
    With `key`, a place where no directory can be made (/proc, a read-only mount: root passes
    os.access there) is a ConfigError naming key=value."""
    made = missing_dirs(d)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if key is None:
            raise
        remove_made(made)
        raise ConfigError(key, value, f"a place where a directory can be made ({e.filename}: {e.strerror})") from None
    try:
        yield d
    except undo_on:
        remove_made(made)
        raise


def missing_dirs(d: Path) -> list[Path]:
    """d and its parents that do not exist yet, innermost first (what a `mkdir -p d` would make)."""
    return [p for p in (d, *d.parents) if not p.exists()]


def remove_made(made: list[Path]) -> None:
    """Remove the directories a command made (missing_dirs), innermost first, only while empty."""
    for p in made:
        try:
            p.rmdir()
        except OSError:
            break


def _is_within(a: Path, b: Path) -> bool:
    """a == b or a is inside b (both resolved)."""
    return a == b or b in a.parents


def foreign_entries(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name not in ARTEFACTS)


def _signature(p: Path) -> bool | None:
    """Does the SIGNATURE entry `p` hold what mode writes there (True), something else (False), or
    nothing yet (None: an empty directory)? The name alone is no proof: another tool's experiment
    folder may have its own checkpoints/ or tb/ beside a config.yaml, which run.fresh would delete."""
    if p.is_dir() and p.name in (CHECKPOINTS, "tb"):
        entries = list(p.iterdir())
        if not entries:
            return None
        if p.name == CHECKPOINTS:  # step_NNNNNNNN directories, being written (.tmp) or moved aside (.bad)
            steps = [bool(STEP_ENTRY.match(e.name)) and e.is_dir() for e in entries]
            if not all(s or e.name in DEEPSPEED_SCRIPTS and e.is_file() for s, e in zip(steps, entries)):
                return False
            return True if any(steps) else None  # the scripts alone: a first ZeRO save that failed after them
        # TensorBoard event files: consistent with a run, but any TensorBoard user writes them
        return None if all(e.name.startswith("events.out.tfevents.") for e in entries) else False
    try:
        text = p.read_text() if p.is_file() else None
        data = json.loads(text) if text else {}
    except (OSError, ValueError):
        return False
    if text is None or not isinstance(data, dict):
        return False
    if p.name == LOCK:  # emptied when its holder released it, else the holder's pid/host/start
        return not data or {"pid", "host"} <= data.keys()
    return bool(RUN_INFO_KEYS & data.keys())  # run_info.json


def is_mode_run(d: Path, besides: str | None = None, proofs: tuple = SIGNATURES) -> bool:
    """Every entry is something `mode` writes, one only a run writes proves it (a run's LOCK, its
    run_info.json or its step checkpoints), and none of those holds anything else. `besides`: one
    more entry allowed (what a writer would add below a run: is the directory a run without it?).
    `proofs`: the signatures that count."""
    if not d.is_dir() or [n for n in foreign_entries(d) if n != besides]:
        return False
    found = {s: _signature(d / s) for s in proofs if (d / s).exists()}
    if found.get(CHECKPOINTS):  # step checkpoints prove the run: a LOCK or run_info.json that is no JSON at
        # all (cut or zeroed by a crash) is damage to it, not a user's file (a user's JSON still refuses)
        found.update({s: None for s in (LOCK, "run_info.json") if found.get(s) is False and _not_json(d / s)})
    return True in found.values() and False not in found.values()


def _not_json(p: Path) -> bool:
    try:
        json.loads(p.read_text())
    except (OSError, ValueError):
        return p.is_file()
    return False


def check_place(path: str, key: str = "run.dir") -> Path:
    """A directory mode may fill, `~` expanded: not empty, not the current directory or a parent of
    it (`/` included), not $HOME, where a run or a grid would mix with the user's own files.
    Raises ConfigError (nothing written)."""
    refuse_blank(key, path)
    d = Path(user_path(path, key))
    if d.is_symlink() and not d.exists():  # dangling (or a loop): nothing could be made there
        raise ConfigError(key, path, f"an existing directory or a new path ({d} is a symbolic link to "
                                     f"{os.readlink(d)}, which does not exist)")
    if _is_within(Path.cwd().resolve(), d.resolve()) or d.resolve() == Path.home().resolve():
        raise ConfigError(key, path, "a directory that is neither the current directory, a parent of it nor the "
                                     "home directory (e.g. runs/NAME)")
    return d


def run_broken_by(out: str | Path, owned: str | None = None, below_only: bool = False,
                  proofs: tuple = SIGNATURES) -> Path | None:
    """The run directory that writing `out` would add a foreign entry to (a run holds only ARTEFACTS,
    else `mode train` refuses to resume it), or None. `owned`: the one top-level entry of a run this
    writer may fill (`report` for `mode analyze`, `eval` for `mode eval`). `below_only`: `out` itself
    is not looked at (a compare runs_dir, or a run.dir: each holds a LOCK of its own). `proofs`: the
    signatures that prove a run (is_mode_run)."""
    out = Path(out).expanduser().resolve()
    below = out if below_only else None
    for d in (out.parents if below_only else (out, *out.parents)):
        # a run as is_mode_run proves it: a project folder with its own checkpoints/ or tb/ is none.
        # A stat for a proof before any listing: listing every ancestor would fail under a walk-only
        # (--x) parent such as many clusters' /home, and list each big project directory.
        try:
            if (below is None or below.name != owned) and any((d / s).exists() for s in proofs) \
                    and is_mode_run(d, below.name if below is not None else None, proofs):
                return d
        except OSError:  # unreadable: not provably a run
            pass
        below = d
    return None


def check_outside_runs(out: str, key: str, owned: str | None = None, below_only: bool = False,
                       proofs: tuple = SIGNATURES) -> None:
    """ConfigError (nothing written) when writing `out` would break a run: see run_broken_by."""
    broken = run_broken_by(user_path(str(out), key), owned, below_only, proofs)
    if broken is not None:
        where = f" (or its {owned}/)" if owned else ""
        raise ConfigError(key, out, f"a path outside the run directory {broken}{where}: a run holding anything "
                                    "else is refused on resume")


def check(run_dir: str, fresh: bool, key: str = "run.dir", lock: bool = True) -> Path:
    """Refuse a run directory that would lose a user's files; raises ConfigError (nothing written)."""
    d = check_place(run_dir, key)
    check_outside_runs(run_dir, key, below_only=True, proofs=RUN_PROOFS)  # not nested inside another run
    if d.exists() and not d.is_dir():
        raise ConfigError(key, run_dir, "a directory (this path is a file)")
    if d.is_dir():
        what = "delete (run.fresh=true)" if fresh else "write a run into"
        foreign = foreign_entries(d)
        if foreign:
            raise ConfigError(key, run_dir, f"a new, empty or mode run directory; it holds {shown(foreign)}, which "
                                            f"mode did not write, so it will not {what} it")
        entries = sorted(p.name for p in d.iterdir() if p.name != JOB_LOGS)
        if entries and not is_mode_run(d):  # e.g. the user's own config.yaml, which a start would overwrite
            odd = [s for s in SIGNATURES if (d / s).exists() and _signature(d / s) is False]
            why = (f"its {', '.join(odd)} {'holds' if len(odd) == 1 else 'hold'} what mode does not write there" if odd
                   else "no LOCK, run_info.json or step_N checkpoints as mode writes them")
            raise ConfigError(key, run_dir, f"a new, empty or mode run directory; it holds {shown(entries)} but is "
                                            f"not a mode run ({why}), so it will not {what} it")
        if fresh:  # a file put into a saved checkpoint is the user's, and fresh would rmtree it
            for c in complete_checkpoints(checkpoints_dir(d)):
                extra = unlisted_files(c)
                if extra:
                    raise ConfigError(key, run_dir, f"a run whose files are all mode's; {c} holds {shown(extra)}, "
                                                    "which its checkpoint manifest does not list (mode did not "
                                                    "write it), so run.fresh=true will not delete it: move it away")
        if lock:
            check_lock(d, key)
    ancestor = existing_base(d, key, run_dir)
    for p in (ancestor, checkpoints_dir(d), d / "tb"):
        if p.exists() and not os.access(p, os.W_OK):
            raise ConfigError(key, run_dir, f"a writable directory ({p} is read-only)")
    return d


def existing_base(d: Path, key: str, value) -> Path:
    """The nearest existing directory at or above `d` (where its missing parents would be created);
    ConfigError (nothing written) when that is a file: `d` can then never be a directory."""
    base = next(p for p in (d, *d.parents) if p.exists())
    if not base.is_dir():
        raise ConfigError(key, value, f"a directory path ({base} is a file)")
    return base


def shown(names: list[str]) -> str:
    """The first few names of a listing, for a one-line error."""
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def empty_run_dir(d: Path) -> None:
    """run.fresh: delete what a previous run wrote (check() proved it is a run), not the lock we
    hold, the job logs (the live job may be writing one) nor KEPT_BY_FRESH (maybe not mode's).
    Checkpoints go first and config.yaml last: a wipe killed half-way leaves no checkpoint that
    could resume without its config."""
    order = {CHECKPOINTS: 0, "config.yaml": 2}
    for p in sorted(d.iterdir(), key=lambda p: order.get(p.name, 1)):
        if p.name in (LOCK, JOB_LOGS, *KEPT_BY_FRESH):
            continue
        assert p.name in ARTEFACTS, p  # check() ran first
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


# ----------------------------------------------------------------------------------------------
# One writer per directory.


def describe_holder(h: dict) -> str:
    if not h:
        return "another process"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.get("started", 0)))
    return f"pid {h.get('pid')} on {h.get('host')} (since {when}: {h.get('cmd', '?')})"


def _in_use(key: str, d: Path, holder: dict | None, flocked: bool = True) -> ConfigError:
    hint = ""
    if holder is None:
        hint = f" (this filesystem has no flock and the record is unreadable: if no start is running, empty {d / LOCK})"
    elif not flocked and holder.get("host") != socket.gethostname():
        hint = (f" (this filesystem has no flock, so a holder on another host cannot be seen to have died: "
                f"if it is gone, empty {d / LOCK})")
    return ConfigError(key, msg=f"{key}={str(d)!r} is in use by {describe_holder(holder or {})}; "
                                f"wait for it to finish or stop it{hint}")


def _record(path: Path) -> dict | None:
    """The holder's record where there is no flock: {} once released (emptied), None when it cannot
    be read or parsed (a torn write, an NFS error): that may be a live holder's, so it holds."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError:
        return None
    try:
        h = json.loads(text) if text.strip() else {}
    except ValueError:
        return None
    return h if isinstance(h, dict) else None


def _holder(path: Path) -> dict:
    """The holder's record for a message ({} when there is none, or none that parses)."""
    return _record(path) or {}


def _slurm_restarts() -> int:
    n = os.environ.get("SLURM_RESTART_COUNT", "0")
    return int(n) if n.isdigit() else 0


def _held(holder: dict | None) -> bool:
    """Without flock: whether a holder's record stands for a live process. One of this host is asked
    the kernel (pid and start time: pids are reused); one of an earlier run of this SLURM job (a
    requeue, often on another node) is dead, as SLURM ended it first; any other on another host is
    taken as live (its death cannot be seen from here)."""
    if holder is None:
        return True
    if not holder:
        return False  # released cleanly: emptied
    pid, job = holder.get("pid"), os.environ.get("SLURM_JOB_ID")
    if job and holder.get("slurm_job") == job and isinstance(holder.get("slurm_restart"), int) \
            and holder["slurm_restart"] < _slurm_restarts():
        return False
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int):
        return True
    if pid == os.getpid():
        return False  # our own pid in an old record (a restarted container): not a live holder
    return alive(pid) and holder.get("pid_start") in (None, start_time(pid))


def check_lock(d: Path, key: str = "run.dir") -> None:
    """Refuse if a live process holds d/LOCK (probe only: nothing is created). The probe takes a
    shared lock: probes (every rank of a start runs one at once) never block each other, and the
    holder's exclusive lock blocks them all."""
    path = d / LOCK
    if not path.exists():
        return
    with open(path, "rb") as f:
        try:
            flock(f, LOCK_SH | LOCK_NB)
        except BlockingIOError:
            raise _in_use(key, d, _holder(path)) from None
        except OSError as e:
            if e.errno not in NO_FLOCK:
                raise
            if _held(holder := _record(path)):
                raise _in_use(key, d, holder, flocked=False) from None
            return
        flock(f, LOCK_UN)


class DirLock:
    """Exclusive lock on d/LOCK for this process's lifetime (or until release())."""

    def __init__(self, d: Path, key: str = "run.dir"):
        made_dir = not d.exists()
        d.mkdir(parents=True, exist_ok=True)
        self.path = d / LOCK
        made_lock = not self.path.exists()
        # unbuffered: a write a full disk refuses raises here, and nothing is left to flush at close
        # (a buffered file raised again from close() in __del__: a traceback after the error line);
        # not O_APPEND: the record is written from offset 0
        self.f = os.fdopen(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666), "r+b", buffering=0)
        self.flocked = True
        try:
            self._take(d, key)
        except OSError as e:
            self.f.close()
            # without flock another starter's record may be there by now: only ours goes, or nothing
            if made_lock and (self.flocked or _record(self.path) in ({}, None)):
                self.path.unlink(missing_ok=True)
            if made_dir:
                with contextlib.suppress(OSError):
                    d.rmdir()  # only while empty: a start refused by the disk leaves no run.dir
            raise OSError(e.errno, e.strerror, str(self.path)) from e  # names the place

    SETTLE_S = 0.5  # without flock: how long two starters' writes get to land before each reads back

    def _take(self, d: Path, key: str) -> None:
        for wait_s in (0.05, 0.1, 0.2, 0.4, 0.8, None):  # a probe's shared lock lasts microseconds: retry briefly
            try:
                flock(self.f, LOCK_EX | LOCK_NB)
                break
            except BlockingIOError:
                if wait_s is not None:
                    time.sleep(wait_s)
            except OSError as e:
                if e.errno not in NO_FLOCK:
                    raise
                self.flocked = False
                return self._take_without_flock(d, key)
        else:
            self.f.close()
            raise _in_use(key, d, _holder(self.path)) from None
        self._write_record(d)

    def _take_without_flock(self, d: Path, key: str) -> None:
        """No flock here: the holder's record in LOCK is the lock. A live holder's record refuses (one
        on another host always does: its death cannot be seen from here), a dead holder's of this
        host is taken over. Two starters that both found it free both write; the later write wins,
        and the other sees that when it reads the record back (a torn mix of both: neither starts)."""
        if _held(holder := _record(self.path)):
            self.f.close()
            raise _in_use(key, d, holder, flocked=False) from None
        mine = self._write_record(d)
        time.sleep(self.SETTLE_S)
        now = _record(self.path)
        if now != mine:
            self.f.close()  # not release(): the record is the winner's
            raise _in_use(key, d, now, flocked=False)

    def _write_record(self, d: Path) -> dict:
        previous = _holder(self.path)
        if previous:  # released cleanly, the file is empty: its holder died
            print(f"{d}: taking over the lock of {describe_holder(previous)}, which is no longer running",
                  file=sys.stderr)
        self.f.seek(0)
        self.f.truncate()
        record = {"pid": os.getpid(), "pid_start": start_time(os.getpid()), "host": socket.gethostname(),
                  "started": time.time(), "cmd": " ".join(sys.argv)[:300]}
        if os.environ.get("SLURM_JOB_ID"):
            record.update(slurm_job=os.environ["SLURM_JOB_ID"], slurm_restart=_slurm_restarts())
        data = memoryview(json.dumps(record).encode())
        while data:  # a raw write may write part (a disk filling up): the rest raises its OSError
            data = data[self.f.write(data):]
        os.fsync(self.f.fileno())  # NFS shows other hosts a write once it is flushed
        return record

    def release(self) -> None:
        if getattr(self, "f", None) is not None and not self.f.closed:
            try:
                self.f.truncate(0)
                os.fsync(self.f.fileno())
            except OSError:  # a full or read-only disk: the holder's line stays, its flock goes below
                pass
            self.f.close()  # closing the descriptor drops the flock

    def __del__(self):
        self.release()

"""No orphans, no silent hangs at start.

- A rank started by a launcher (DeepSpeed's runner and node-local launch, torchrun, `mode compare`)
  exits within about a second once any of those launcher processes is gone, however it died
  (SIGKILL included): the kernel sends SIGTERM when the parent dies (PR_SET_PDEATHSIG), and a
  watchdog thread checks the launcher ancestors above it once a second.
- The DeepSpeed CPU communication op is built by torch's extension loader, which waits forever on a
  `lock` file left by a build that was killed. The build cache is kept per virtualenv (two checkouts
  never rebuild or lock each other's op); a lock no live process holds is reported before anything
  starts, and one whose holder dies while this process waits on it stops the start in one line.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

LAUNCHER_MARKS = ("deepspeed", "torch.distributed.run", "torchrun", "launch.run", "mode.cli compare",
                  "mode compare", "mode.compare")
PR_SET_PDEATHSIG = 1


# flock's errors where a filesystem has none: Lustre mounted without -o flock, NFS without lockd
NO_FLOCK = (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK)


def alive(pid: int) -> bool:
    """Whether a process of this host with this pid is running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, start time) of a live process, or None (a zombie is dead: nobody reaped it yet)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in "ZX" else (int(fields[1]), fields[19])


def start_time(pid: int) -> str | None:
    """When a live process started, or None: with its pid it names the process (pids are reused)."""
    st = _stat(pid)
    return None if st is None else st[1]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def launcher_ancestors(pid: int | None = None) -> list[tuple[int, str]]:
    """(pid, start time) of the parent and of every launcher process above it, nearest first."""
    out = []
    pid = os.getppid() if pid is None else pid
    while pid > 1:
        st = _stat(pid)
        if st is None:
            break
        if out and not any(m in _cmdline(pid) for m in LAUNCHER_MARKS):
            break  # the parent is always watched; above it, only launchers
        out.append((pid, st[1]))
        pid = st[0]
    return out


def die_with_launcher(poll_s: float = 1.0) -> bool:
    """Under a launcher (RANK set) or `mode compare` (MODE_WATCH_PARENT=1): exit when it dies."""
    if "RANK" not in os.environ and os.environ.get("MODE_WATCH_PARENT") != "1" or not sys.platform.startswith("linux"):
        return False
    watched = launcher_ancestors()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass

    def gone() -> int | None:
        return next((pid for pid, start in watched if start_time(pid) != start), None)

    def watch():
        while True:
            pid = gone()
            if pid is not None:
                print(f"rank {os.environ.get('RANK', 0)} (pid {os.getpid()}): its launcher (pid {pid}) is gone; "
                      "exiting", file=sys.stderr, flush=True)
                os._exit(143)
            time.sleep(poll_s)

    if gone() is not None:  # died before we looked
        os._exit(143)
    threading.Thread(target=watch, name="mode-lifeline", daemon=True).start()
    return True


# ----------------------------------------------------------------------------------------------
# torch extension build locks.


def use_venv_build_cache() -> None:
    """Build torch/DeepSpeed extensions under this virtualenv (unless TORCH_EXTENSIONS_DIR is set),
    one build per path the virtualenv is started by. DeepSpeed writes its source paths, under
    sys.prefix as invoked, into build.ninja: checkouts reaching one virtualenv through a symlink
    and sharing one build directory each found the other's paths there and rebuilt the op (minutes,
    holding the lock every other start waits on) whenever their starts alternated."""
    if sys.prefix == sys.base_prefix:
        return
    real = os.path.realpath(sys.prefix)
    d = os.path.join(real, "torch_extensions")
    if sys.prefix != real:  # reached through a symlink: its own build, named by the path
        d = os.path.join(d, "via-" + hashlib.sha1(sys.prefix.encode()).hexdigest()[:12])
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", d)


def _in_use(lock: Path) -> bool:
    """Does a live process hold `lock` open (torch's FileBaton keeps the file open from its creation
    until the build ends) or work inside its directory (ninja, the compiler)?"""
    d = lock.parent
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cwd = Path(os.readlink(proc / "cwd"))
            fds = list((proc / "fd").iterdir())
        except OSError:
            continue  # gone, or another user's process (which cannot hold this user's cache)
        if cwd == d or d in cwd.parents:
            return True
        for fd in fds:
            try:
                if os.readlink(fd) == str(lock):
                    return True
            except OSError:
                continue  # closed since it was listed: the holder is busy (loading the op), not gone
    return False


def extensions_root() -> Path:
    """Where torch builds extensions (its own rule: cpp_extension._get_build_directory)."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        acc = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
        root = os.path.join(get_default_build_root(), f"py{sys.version_info.major}{sys.version_info.minor}_{acc}")
    return Path(root).resolve()


# Filesystems other hosts write: a lock there may be held by a process this host cannot see.
NETWORK_FS = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "ceph", "glusterfs", "panfs", "wekafs",
              "fuse.sshfs", "fuse.glusterfs", "fuse.beegfs", "9p")


def fs_type(path: Path, mounts: str | None = None) -> str:
    """The type of the filesystem holding `path`: the longest mount point above it in /proc/mounts."""
    if mounts is None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            return ""
    best, kind = "", ""
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        if (str(path) == point or str(path).startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, parts[2]
    return kind


def _quiet_for(d: Path) -> float:
    """Seconds since anything in `d` (the lock, ninja's log, objects) last changed."""
    times = [p.stat().st_mtime for p in d.iterdir()] or [0.0]
    return time.time() - max(times)


def stale_build_locks(confirm_s: float = 0.5, remote_quiet_s: float = 300.0) -> list[Path]:
    """`lock` files of extension builds that nobody holds (a killed build or load leaves one behind,
    and every later load waits on it forever). On a local filesystem only this host's processes can
    hold one: stale when none does, seen twice `confirm_s` apart (a lock is briefly unheld between
    its creation and the open, and between the close and its removal). On a network filesystem a
    builder on another node is invisible here: stale only when, besides, nothing in the build
    directory changed for `remote_quiet_s` (a build writes objects and ninja's log as it goes)."""
    root = extensions_root()
    if not root.is_dir():
        return []
    remote = fs_type(root) in NETWORK_FS

    def unheld():
        out = {}
        for lock in root.glob("*/lock"):
            try:
                ino = lock.stat().st_ino
                if not _in_use(lock) and (not remote or _quiet_for(lock.parent) > remote_quiet_s):
                    out[lock] = ino
            except OSError:
                continue  # removed meanwhile
        return out

    first = unheld()
    if not first:
        return []
    time.sleep(confirm_s)
    second = unheld()
    return sorted(lock for lock, ino in first.items() if second.get(lock) == ino)


def stale_lock_message(lock: Path) -> str:
    return (f"TORCH_EXTENSIONS_DIR: stale build lock {lock} (a build or load of {lock.parent.name} was killed "
            f"and no process holds the lock now; every start would wait on it forever): remove it with `rm {lock}` "
            "and start again")


@contextlib.contextmanager
def watch_build_locks(poll_s: float = 2.0):
    """While the block runs (the trainer's start, where DeepSpeed loads its ops), stop the process with
    the one-line error when a build lock it may be waiting on turns stale: its holder was killed after
    the pre-launch check passed. Torch itself would wait forever without a word."""
    done = threading.Event()

    def watch():
        while not done.wait(poll_s):
            stale = stale_build_locks()
            if stale and not done.is_set():
                print(f"config error: {stale_lock_message(stale[0])}", file=sys.stderr, flush=True)
                os._exit(2)

    t = threading.Thread(target=watch, name="mode-build-locks", daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()

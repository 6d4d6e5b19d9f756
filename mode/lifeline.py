"""No orphans, no silent hangs at start.

- A rank started by a launcher (DeepSpeed's runner and node-local launch, torchrun, `mode compare`)
  exits within about a second once any of those launcher processes is gone, however it died
  (SIGKILL included): the kernel sends SIGTERM when the parent dies (PR_SET_PDEATHSIG), and a
  watchdog thread checks the launcher ancestors above it once a second.
- The DeepSpeed CPU communication op is built by torch's extension loader, which waits forever on a
  `lock` file left by a build that was killed. The build cache is kept per virtualenv (two checkouts
  never rebuild or lock each other's op), and a stale lock is reported before anything starts.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from pathlib import Path

LAUNCHER_MARKS = ("deepspeed", "torch.distributed.run", "torchrun", "launch.run", "mode.cli compare",
                  "mode compare", "mode.compare")
PR_SET_PDEATHSIG = 1


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, start time) of a live process, or None (a zombie is dead: nobody reaped it yet)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in "ZX" else (int(fields[1]), fields[19])


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
        return next((pid for pid, start in watched if (_stat(pid) or (0, None))[1] != start), None)

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
    """Build torch/DeepSpeed extensions under this virtualenv (unless TORCH_EXTENSIONS_DIR is set)."""
    if sys.prefix != sys.base_prefix:
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))


def _building_in(d: Path) -> bool:
    """Does a live process (ninja, the compiler) work inside d?"""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cwd = Path(os.readlink(proc / "cwd"))
            except OSError:
                continue
            if cwd == d or d in cwd.parents:
                return True
    return False


def stale_build_locks(min_age_s: float = 30.0) -> list[Path]:
    """`lock` files of extension builds nobody is running (a killed build leaves one behind and every
    later load waits on it forever)."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")  # torch's own rule (cpp_extension._get_build_directory)
    if root is None:
        acc = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
        root = os.path.join(get_default_build_root(), f"py{sys.version_info.major}{sys.version_info.minor}_{acc}")
    root = Path(root)
    if not root.is_dir():
        return []
    now = time.time()
    stale = []
    for lock in root.glob("*/lock"):
        try:
            age = now - lock.stat().st_mtime
        except OSError:
            continue
        if age > min_age_s and not _building_in(lock.parent.resolve()):
            stale.append(lock)
    return stale

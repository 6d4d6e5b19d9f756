"""One line per failure at the command line: `config error: ...` (exit 2) for bad input, `error: <cause>`
(exit 1) for runtime faults (disk full, read-only, corrupt checkpoint). `--debug` anywhere on the
command line, or MODE_DEBUG=1, shows the traceback instead."""
from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import time
from pathlib import Path

QUIET_RANK_WAIT_S = 30.0  # how long a node's other ranks leave its first rank to report a config error


class OneLineParser(argparse.ArgumentParser):
    """Bad options: one line, exit 2 (no usage block)."""

    def error(self, message):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


class Once(argparse.Action):
    """An option given at most once: `--config a.yaml ... --config b.yaml` (argparse's last wins)
    would train one of two configs without a word."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{option_string} given twice ({getattr(namespace, self.dest)} and {values}): give it once")
        setattr(namespace, self.dest, values)


def wants_debug(argv: list[str]) -> tuple[bool, list[str]]:
    debug = "--debug" in argv or os.environ.get("MODE_DEBUG", "") not in ("", "0")
    return debug, [a for a in argv if a != "--debug"]


def one_line(e: BaseException) -> tuple[str, int]:
    if isinstance(e, ModuleNotFoundError):  # before importing torch below: it may be the missing module
        return (f"error: {sys.executable} cannot import {e.name} (not mode's environment: use .venv/bin/python, "
                "which `make install` creates, or set PYTHON= for the launch scripts)"), 1
    from mode.checkpoint import CheckpointError, io_cause
    from mode.config import ConfigError

    if isinstance(e, ConfigError):
        return str(e), 2
    if isinstance(e, CheckpointError):
        return f"error: {e}", 1
    text = " ".join(str(e).split())
    if isinstance(e, OSError) or "PytorchStreamWriter" in text or "unexpected pos" in text:
        where = getattr(e, "filename", None)  # None: the free space of an unknown place would mislead
        if where is None and not isinstance(e, OSError):  # torch's writer names neither file nor errno
            return f"error: a file could not be written ({text[:300]}); a full disk is the usual cause", 1
        return f"error: {io_cause(e, Path(where) if where else None)}", 1
    return f"error: {type(e).__name__}: {text[:400]} (run again with --debug for the traceback)", 1


def with_own_config(line: str, argv: list[str]) -> str:
    """Messages spell the prepare command `mode data prepare --config F`; from a command given
    `--config`, name that file and its data and model overrides instead (a command to copy)."""
    if "--config F" not in line:
        return line
    cfg = None
    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv):
            cfg = argv[i + 1]
        elif a.startswith("--config="):
            cfg = a.split("=", 1)[1]
    if cfg is None:
        return line
    over = [a for a in argv if "=" in a and a.startswith(("data.", "model."))]  # what a prepare reads
    return line.replace("--config F", shlex.join(["--config", cfg, *over]))


def guarded(fn, argv: list[str], broken_pipe: str | None = None) -> int:
    """fn(argv) -> exit code, with every exception turned into its one line (unless debugging).
    `broken_pipe`: the line for a command whose stopping there is worth one (a training run)."""
    debug, argv = wants_debug(argv)
    try:
        return fn(argv)
    except KeyboardInterrupt:
        if debug:
            raise
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `mode flops ... | head`: the reader left; not a failure worth a line
        # Point stdout at devnull so the interpreter's flush at exit does not raise again (the
        # recipe of Python's signal docs, "Note on SIGPIPE"); 141 is the shell's status for SIGPIPE.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if broken_pipe:
            with contextlib.suppress(OSError):
                print(broken_pipe, file=sys.stderr, flush=True)
        return 141
    except Exception as e:  # noqa: BLE001 - the point: no traceback reaches a user unasked
        if debug:
            raise
        line, code = one_line(e)
        line = with_own_config(line, argv)
        if code == 2 and os.environ.get("LOCAL_RANK") not in (None, "", "0"):
            # A config error is the same on every rank of a node (same arguments, same files): only
            # the node's first rank says it, instead of one identical line per rank. The others wait
            # for it: a rank that exited first had its launcher kill the first before its line was
            # out (a 2-rank start under load showed only "exits with return code = 2"). Still alive
            # after the wait, the first rank did not fail alike: this rank says it.
            time.sleep(QUIET_RANK_WAIT_S)
        print(line, file=sys.stderr, flush=True)
        return code

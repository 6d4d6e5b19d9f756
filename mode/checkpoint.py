"""Atomic, verified, exactly-resumable checkpoints on top of DeepSpeed's.

Layout: run.dir/checkpoints/step_00000100/ holds DeepSpeed's files (model, optimizer, scheduler,
client state with the step), `rng_rank{r}.pt` per rank (torch, cuda, numpy, python RNG: random
top-k and DeepSpeed's MoE draw from them; and the rank's not-yet-logged metric sums), `model.pt`
(plain state dict for generation), `config.json` (the config it was trained with, which readers of
model.pt check config.yaml against), `data.json` (the identity of the data it was trained on),
`param_order.json` (the optimizer's parameter order, which DeepSpeed's flat state is laid out in) and,
written last, `MANIFEST.json`: the size and SHA-256 of every other file.

Every rank writes into `step_N.tmp/`; after a barrier rank 0 hashes the files, writes the manifest
atomically and renames the directory to `step_N/`. A checkpoint counts only if its manifest
verifies: on resume a damaged, truncated, emptied or file-less newest checkpoint is reported in one
line, moved aside to `step_N.bad`, and the newest one that verifies is used instead; readers of the
weights (`newest_weights`) apply the same rule and leave the run as it is. A state with
non-finite weights or optimizer moments is never saved, and rotation (`checkpoint.keep`) only
counts and deletes checkpoints with a manifest, keeping the newest, just-verified one.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import re
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from mode.config import ConfigError

# The layout: the one place that spells it. Everything else calls the functions below.
CHECKPOINTS = "checkpoints"  # run.dir/checkpoints/
STEP_RE = re.compile(r"^step_(\d{8})$")  # .../step_00000100/ (`.tmp`: being written, `.bad`: moved aside)
MANIFEST = "MANIFEST.json"
MODEL = "model.pt"  # the plain state dict that sampling, `mode eval` and `mode export` read
CONFIG = "config.json"  # the config model.pt was trained with (config.yaml beside it can be edited)
DATA = "data.json"  # what it was trained on (mode.prepare.data_identity): a start checks it before workers start
PARAM_ORDER = "param_order.json"  # the optimizer's parameter order (mode.engine.param_groups): the flat state's layout
WEIGHTS_GLOB = f"{CHECKPOINTS}/step_*/{MODEL}"  # how messages name it, relative to run.dir


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message is one line naming the cause."""


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    """Where a run keeps its checkpoints."""
    return Path(run_dir) / CHECKPOINTS


def step_dir(root: Path, step: int) -> Path:
    """The checkpoint directory of `step` under `root` (a run's checkpoints_dir)."""
    return Path(root) / f"step_{step:08d}"


def step_dirs(root: Path) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and STEP_RE.match(p.name))


def complete_checkpoints(root: Path) -> list[Path]:
    """Checkpoints whose save finished (a manifest exists); verify() says whether they are intact."""
    return [p for p in step_dirs(root) if (p / MANIFEST).is_file()]


def latest(root: Path) -> Path | None:
    c = complete_checkpoints(Path(root))
    return c[-1] if c else None


def latest_step(run_dir: str | os.PathLike) -> int | None:
    """The step of a run's newest complete checkpoint, or None when it has none."""
    last = latest(checkpoints_dir(run_dir))
    return None if last is None else step_of(last)


def step_of(path: Path) -> int:
    m = STEP_RE.match(Path(path).name)
    if m is None:
        raise ValueError(f"{path} is not a checkpoint directory (step_XXXXXXXX)")
    return int(m.group(1))


# ----------------------------------------------------------------------------------------------
# Manifest: size + SHA-256 per file.


def _sha256(path: Path, sync: bool = False) -> str:
    """The file's SHA-256; `sync`: also force its data to disk (fsync) once it is read."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
        if sync:
            os.fsync(f.fileno())
    return h.hexdigest()


def _fsync_dir(d: Path) -> None:
    """Make d's entries (files created or renamed in it) durable."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file() and p.name != MANIFEST and not p.name.endswith(".part"))


def write_record(d: Path, name: str, record: dict) -> None:
    """A JSON record (CONFIG, DATA) into checkpoint directory `d`, before its manifest is written."""
    (d / name).write_text(json.dumps(record, indent=1) + "\n")


def trained_config(d: Path) -> dict | None:
    """The config checkpoint `d` records (None: saved before the record existed). The manifest
    vouches for the file, so a reader that verified `d` can trust it."""
    f = d / CONFIG
    return json.loads(f.read_text()) if f.is_file() else None


def vouched_record(d: Path, name: str) -> dict | None:
    """Checkpoint `d`'s JSON record `name` (CONFIG, DATA) when its manifest vouches for it (size and
    SHA-256 of that small file alone, not verify()'s every file), else None: absent, damaged (a
    resume falls back past such a checkpoint) or not a mapping."""
    try:
        if _file_problem(d, name, json.loads((d / MANIFEST).read_text())["files"][name]):
            return None
        record = json.loads((d / name).read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record if isinstance(record, dict) else None


def write_manifest(d: Path, step: int) -> None:
    """Hash every file and write the manifest last. Each file and directory is fsynced before the
    manifest is written, so after a power loss a manifest never outlives the data it vouches for."""
    paths = _files(d)
    files = {str(p.relative_to(d)): {"bytes": p.stat().st_size, "sha256": _sha256(p, sync=True)} for p in paths}
    dirs = {d} | {q for p in paths for q in p.parents if d in q.parents}
    for sub in sorted(dirs, key=lambda q: len(q.parts), reverse=True):  # deepest first
        _fsync_dir(sub)
    part = d / (MANIFEST + ".part")
    with open(part, "w") as f:
        json.dump({"step": step, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, d / MANIFEST)  # atomic: a manifest is either whole or absent
    _fsync_dir(d)


def verify(d: Path) -> str | None:
    """None if every file the manifest lists is there with its size and checksum; else what is wrong."""
    try:
        return _verify(d)
    except FileNotFoundError:  # a reader (sampling from a live run) met the run's rotation deleting it
        return "removed while it was being read (a live run's checkpoint.keep rotation)"


def _verify(d: Path) -> str | None:
    m = d / MANIFEST
    if not m.is_file():
        return "no manifest: its save never finished" if any(d.iterdir()) else "empty directory"
    try:
        files = json.loads(m.read_text())["files"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return f"unreadable {MANIFEST}"
    # damaged JSON that still parses: every entry must be {"bytes": int, "sha256": str}
    if not isinstance(files, dict) or not all(
            isinstance(meta, dict) and isinstance(meta.get("bytes"), int) and isinstance(meta.get("sha256"), str)
            for meta in files.values()):
        return f"unreadable {MANIFEST}"
    if not files:
        return "its manifest lists no files"
    return next(filter(None, (_file_problem(d, name, meta) for name, meta in files.items())), None)


def _file_problem(d: Path, name: str, meta: dict) -> str | None:
    """What is wrong with file `name` of checkpoint `d` against its manifest entry `meta`, or None."""
    p = d / name
    if not p.is_file():
        return f"{name} is missing"
    size = p.stat().st_size
    if size != meta["bytes"]:
        how = "emptied" if size == 0 else "truncated" if size < meta["bytes"] else "grown: written to since"
        return f"{name} is {size} bytes, {meta['bytes']} when saved ({how})"
    if _sha256(p) != meta["sha256"]:
        return f"{name} is damaged (its SHA-256 differs from the manifest)"
    return None


def _move_aside(d: Path) -> Path:
    target, i = d.with_name(d.name + ".bad"), 1
    while target.exists():
        i += 1
        target = d.with_name(f"{d.name}.bad{i}")
    d.rename(target)
    return target


def newest_verified(root: Path, move_aside: bool = True, log=None) -> Path | None:
    """The newest checkpoint that verifies. Each newer one that does not is reported in one line
    and (move_aside) renamed to `step_N.bad`, so a resumed run neither loads it nor collides with it."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    dirs = step_dirs(root)
    for i, d in reversed(list(enumerate(dirs))):
        problem = verify(d)
        if problem is None:
            return d
        moved = _move_aside(d) if move_aside else None
        log(f"checkpoint {d} is unusable ({problem}); " + (f"moved to {moved.name}, " if moved else "")
            + ("falling back to the previous one" if i else "and no earlier one is left"))
    return None


def newest_weights(run_dir: str | os.PathLike, log=None) -> Path | None:
    """For reading weights only (sampling, `mode eval`, `mode export`): the newest checkpoint of a
    run holding model.pt that verifies, by resume's rule (`verify`: one without a manifest never
    finished its save, whatever it holds). Each newer one that does not is reported in one line and
    left in place: reading never changes a run. None when the run has no checkpoint with weights;
    CheckpointError (one line) when it has some and none verifies."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    dirs = step_dirs(checkpoints_dir(run_dir))[::-1]
    skipped = []
    for i, d in enumerate(dirs):
        problem = verify(d)
        if problem is None:
            if (d / MODEL).is_file():
                return d
            continue  # intact, but DeepSpeed's files only (no model.pt): no weights to read here
        skipped.append(d.name)
        log(f"checkpoint {d} is unusable ({problem}); "
            + ("falling back to the previous one" if i + 1 < len(dirs) else "and no earlier one is left"))
    if skipped:
        raise CheckpointError(f"no checkpoint of {run_dir} verifies ({', '.join(skipped)}: each reported above), "
                              "so there are no weights to read")
    return None


def resume_point(root: Path, rank: int) -> Path | None:
    """Rank 0 verifies (and moves aside what does not verify); every rank gets its answer. A run
    whose every checkpoint failed is refused: starting it over here would log a second series of
    the same steps into its directory."""
    # [newest verified, had checkpoints]: any that failed verification were just moved aside as .bad
    found = [str(newest_verified(root)), any(root.glob("step_*.bad*"))] if rank == 0 else [None, None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(found, src=0)
    if found[0] in (None, "None"):
        if found[1]:
            raise ConfigError("run.fresh", False, f"true to start over (it deletes checkpoints/; move it away "
                                                  f"first to keep it): no checkpoint in {root} verifies (each was "
                                                  "moved aside as step_N.bad and kept), nothing to resume from")
        return None
    return Path(found[0])


# ----------------------------------------------------------------------------------------------
# Saving.


def rng_state() -> dict:
    s = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state()
    return s


def set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    np.random.set_state(s["numpy"])
    random.setstate(s["python"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state(s["cuda"])


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _all(ok: bool) -> bool:
    """True on every rank iff ok on every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return ok
    dev = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([0 if ok else 1], dtype=torch.int64, device=dev)
    dist.all_reduce(t)
    return int(t.item()) == 0


def nonfinite_state(engine) -> list[str]:
    """Names of this rank's parameters / optimizer-state entries that hold NaN or inf (one host sync)."""
    names = {p: n for n, p in engine.module.named_parameters()}
    tensors = list(engine.module.named_parameters())
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)  # ZeRO and bf16 wrap the torch optimizer
    for p, st in getattr(inner, "state", {}).items():
        tensors += [(f"{names.get(p, 'optimizer')}:{k}", v) for k, v in st.items()
                    if torch.is_tensor(v) and v.is_floating_point()]
    masters = (getattr(opt, "single_partition_of_fp32_groups", None)  # ZeRO master weights
               or getattr(opt, "fp32_groups_flat_partition", None) or [])  # bf16 ZeRO 1's (BF16_Optimizer)
    for i, g in enumerate(masters):
        if torch.is_tensor(g):
            tensors.append((f"fp32 master partition {i}", g))
    if not tensors:
        return []
    finite = torch.stack([torch.isfinite(t.detach()).all().to(tensors[0][1].device) for _, t in tensors]).tolist()
    return [n for (n, _), ok in zip(tensors, finite) if not ok]


def io_cause(e: BaseException, where: Path | None) -> str:
    """One line naming why a write failed: disk full, read-only, permissions, or the error itself.
    `where`: the path written (None when the error names none: then no place is named)."""
    probe = Path(where) if where is not None else None
    while probe is not None and not os.path.exists(probe) and probe != probe.parent:  # False, not a raise,
        probe = probe.parent                                                       # for a name too long
    free = shutil.disk_usage(probe).free if probe is not None and os.path.exists(probe) else None
    code = getattr(e, "errno", None)
    if code == errno.ENAMETOOLONG:
        name = getattr(e, "filename", None) or where
        shown = "" if name is None else f": {str(name)[:120]}" + ("..." if len(str(name)) > 120 else "")
        return f"file name too long (a path component over the filesystem's limit, usually 255 bytes{shown})"
    # torch's writer reports a full disk without an errno ("unexpected pos"): then the free space says it
    if code == errno.ENOSPC or (code is None and free is not None and free < 64 << 20):
        return "no space left on device" + (f" ({free / 2**20:.1f} MiB free on the filesystem of {probe})"
                                            if free is not None else "")
    if code == errno.EROFS:
        return "read-only file system" + (f" ({probe})" if probe is not None else "")
    if code in (errno.EACCES, errno.EPERM):
        who = getattr(e, "filename", None) or probe
        return "permission denied" + (f" ({who})" if who else "")
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}"


def save(engine, root: Path, step: int, client_state: dict, rank: int, keep: int,
         rank_state: dict | None = None) -> Path:
    final = step_dir(root, step)
    root, tmp = final.parent, final.with_name(final.name + ".tmp")
    bad = nonfinite_state(engine)
    if not _all(not bad):
        good = latest(root)
        raise CheckpointError(f"not saving step {step}: non-finite weights or optimizer state"
                              f"{' (' + ', '.join(bad[:4]) + ')' if bad else ' on another rank'}; "
                              f"the newest good checkpoint is {good or 'none'}")
    err = None
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        err = e
    if _all(err is None):
        try:
            engine.save_checkpoint(str(root), tag=tmp.name, client_state=client_state, save_latest=False)
            torch.save({**rng_state(), "extra": rank_state or {}}, tmp / f"rng_rank{rank}.pt")
            if rank == 0:
                torch.save({k: v.detach().float().cpu() if v.is_floating_point() else v.cpu()
                            for k, v in engine.module.state_dict().items()}, tmp / MODEL)
                for name, key in ((CONFIG, "config"), (DATA, "data"), (PARAM_ORDER, "param_order")):
                    if key in client_state:
                        write_record(tmp, name, client_state[key])
        except Exception as e:  # noqa: BLE001 - disk full / read-only surface as many types
            err = e
    if _all(err is None):
        _barrier()
        if rank == 0:
            try:
                write_manifest(tmp, step)
                if final.exists():  # a checkpoint of this step we did not resume from: keep it, aside
                    _move_aside(final)
                tmp.rename(final)
                _fsync_dir(root)  # the rename too: a checkpoint never reverts to step_N.tmp
                rotate(root, keep)
            except Exception as e:  # noqa: BLE001
                err = e
    if not _all(err is None):
        cause = io_cause(err, tmp) if err is not None else "another rank failed to write its part"
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # ours, partial: give the space back
        raise CheckpointError(f"cannot write checkpoint {final}: {cause}; the newest good checkpoint is "
                              f"{latest(root) or 'none'}")
    return final


def rotate(root: Path, keep: int) -> None:
    """Delete all but the `keep` newest checkpoints that have a manifest (the newest was just
    verified by hashing it from disk), and partial saves. Unfinished or moved-aside ones are kept."""
    for old in complete_checkpoints(root)[:-keep]:
        _remove_checkpoint(old)
    for stale in root.glob("step_*.tmp"):  # a save of ours that was cut short (save() names them)
        shutil.rmtree(stale, ignore_errors=True)


def listed_files(d: Path) -> list[Path] | None:
    """The files checkpoint `d`'s manifest lists (what mode wrote there), or None when the manifest
    cannot be read or names a path outside `d` (a hand edit): then nothing in `d` is proven mode's."""
    try:
        files = json.loads((d / MANIFEST).read_text())["files"]
        names = [d / n for n in files] if isinstance(files, dict) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    top = d.resolve()
    return names if names is not None and all(top in p.resolve().parents for p in names) else None


def unlisted_files(d: Path) -> list[str]:
    """Files in checkpoint `d` its readable manifest does not list: not mode's to delete."""
    names = listed_files(d)
    if names is None:
        return []
    mine = {p.resolve() for p in names} | {(d / MANIFEST).resolve()}
    return sorted(str(p.relative_to(d)) for p in d.rglob("*")
                  if (p.is_symlink() or not p.is_dir()) and p.resolve() not in mine)


def _remove_checkpoint(d: Path) -> None:
    """Rotation's delete: the files `d`'s manifest lists, then the manifest and the emptied
    directories. A file it does not list (a user's, put there after the save) is not mode's to
    delete: it stays, in `d` without a manifest (no longer counted), and one line says so. A
    manifest that cannot be read lists nothing provable: `d` is moved aside whole (`.bad`)."""
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    names = listed_files(d)
    if names is None:
        log(f"checkpoint.keep: {d} has an unreadable {MANIFEST}, so what it holds is unproven: moved to "
            f"{_move_aside(d).name} instead of deleted")
        return
    for p in [*names, d / MANIFEST]:
        p.unlink(missing_ok=True)
    for sub in sorted((q for q in d.rglob("*") if q.is_dir() and not q.is_symlink()),
                      key=lambda q: len(q.parts), reverse=True):  # deepest first, only while empty
        with contextlib.suppress(OSError):
            sub.rmdir()
    try:
        d.rmdir()
    except OSError:
        left = sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_symlink() or not p.is_dir())
        log(f"checkpoint.keep: kept {', '.join(left[:3])}{' ...' if len(left) > 3 else ''} in {d} (mode did not "
            "write it); the checkpoint's own files were deleted")


def load(engine, path: Path, rank: int, load_optimizer: bool = True) -> dict:
    """Load a verified checkpoint into the engine; restore this rank's RNG. Returns client state
    with this rank's saved extras under `rank_state`."""
    path = Path(path)
    try:
        _, client = engine.load_checkpoint(str(path.parent), tag=path.name, load_optimizer_states=load_optimizer,
                                           load_lr_scheduler_states=load_optimizer)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"cannot load checkpoint {path}: {type(e).__name__}: "
                              f"{' '.join(str(e).split())[:300]}") from e
    if client is None:
        raise CheckpointError(f"cannot load checkpoint {path}: DeepSpeed found no state for this rank")
    client = dict(client)
    rng = path / f"rng_rank{rank}.pt"
    if rng.exists():
        s = torch.load(rng, weights_only=False)
        set_rng_state(s)
        client["rank_state"] = s.get("extra", {})
    else:
        warnings.warn(f"{path} has no RNG state for rank {rank} (world size changed?): "
                      "training randomness will not continue exactly")
    return client

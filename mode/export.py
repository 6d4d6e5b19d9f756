"""`mode export --run RUN_DIR --out DIR`: a portable copy of a trained model.

DIR holds `model.safetensors` (weights only, no pickle), the resolved `config.yaml`, the tokenizer
(`tokenizer/tokenizer.json` and its `tokenizer_config.json` for a Hugging Face tokenizer, with the
run's EOS token pinned in the config; the byte tokenizer needs no file) and
`export.json` (where it came from, and the model config the weights were trained as). `load_run`, `mode generate` and `mode eval` read DIR like a run
directory. The export is written into a sibling temporary directory and renamed into place, so a
failure leaves no half-written DIR; one that is the disk's (full, read-only) is one line naming DIR and the cause.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import stat
from pathlib import Path

from mode.checkpoint import CheckpointError
from mode.portable import TOKENIZER_DIR, WEIGHTS, file_sha256, save_weights


def export(run_dir: str | Path, out_dir: str | Path) -> Path:
    """Write the newest complete checkpoint of `run_dir` as a portable model into `out_dir`,
    which must not exist or be empty (ConfigError otherwise, before anything is written)."""
    from mode.compare import check_outside_grids
    from mode.config import ConfigError, dump_config
    from mode.generate import load_run
    from mode.rundir import check_outside_runs, parents_made

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError("--out", str(out), "a new or empty directory (exporting never overwrites)")
    base = next(p for p in out.absolute().parents if p.exists())  # missing parents are created (`exports/x`)
    if not base.is_dir():
        raise ConfigError("--out", str(out), f"a directory path ({base} is not a directory)")
    check_outside_runs(str(out), "--out")
    check_outside_grids(str(out), "--out")
    model, tok, cfg, source = load_run(run_dir, return_source=True)
    tok_files = []
    if cfg.data.tokenizer != "byte":
        # The file the run's tokenizer was read from (a directory's, a tokenizer.json path or a
        # hub cache entry), its tokenizer_config.json beside it, and the EOS it resolved to,
        # written into the config so the export can never pick another one.
        f, conf = Path(tok.file), Path(tok.file).parent / "tokenizer_config.json"
        tok_files = [(f, "tokenizer.json")] + ([(conf, conf.name)] if conf.is_file() else [])
        cfg.data.tokenizer, cfg.data.eos_token = TOKENIZER_DIR, tok.identity["eos_token"]
    # missing parents are made for the export and removed again if it fails
    with parents_made(out.absolute().parent, key="--out", value=str(out)):
        # the name cut to 200 bytes: a legal --out of up to 255 made a temporary name over the limit
        tmp = out.parent / f".{out.name.encode()[:200].decode(errors='ignore')}.export-tmp-{os.getpid()}"
        try:
            tmp.mkdir()  # ours alone (pid-named, fresh): the only directory this function deletes on failure
        except FileExistsError:
            raise
        except OSError as e:  # /proc, a read-only mount (root passes os.access there): what parents_made says
            raise ConfigError("--out", str(out), f"a place where a directory can be made ({out.parent}: "
                              f"{e.strerror})") from None
        try:
            save_weights(model, tmp / WEIGHTS)
            if tok_files:  # config.yaml names TOKENIZER_DIR, relative to the export dir; load_run resolves it
                (tmp / TOKENIZER_DIR).mkdir()
                for src, name in tok_files:
                    shutil.copy2(src, tmp / TOKENIZER_DIR / name)
            (tmp / "config.yaml").write_text(dump_config(cfg))
            # "model": what the weights were trained as (config.yaml beside them can be edited; load_run checks)
            info = {"format": "mode-export-1", "run": str(Path(run_dir).resolve()),
                    "checkpoint": str(Path(source).resolve()), "parameters": sum(p.numel() for p in model.parameters()),
                    "weights_sha256": file_sha256(tmp / WEIGHTS),  # load_run verifies what it reads back
                    "model": cfg.to_dict()["model"]}
            (tmp / "export.json").write_text(json.dumps(info, indent=2) + "\n")
            # safetensors creates its file 0600 whatever the umask; give it the bits a plain open got
            # (config.yaml: the umask's, e.g. 0644), so whoever may read the config may read the weights.
            os.chmod(tmp / WEIGHTS, stat.S_IMODE((tmp / "config.yaml").stat().st_mode))
            if out.exists():
                out.rmdir()  # empty (checked above); rmdir refuses if something appeared since
            tmp.rename(out)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            io = _io_error(e)
            if io is None:
                raise
            if io.filename in {str(src) for src, _ in tok_files}:  # a file it copies (the run's tokenizer)
                # vanished or is unreadable: not the output's fault
                raise ExportError(f"cannot read {io.filename}: {io.strerror or io}; nothing was written to {out}") from e
            from mode.checkpoint import io_cause  # after the cleanup: the free space a rerun would find

            raise ExportError(f"cannot write {out}: {io_cause(io, tmp / WEIGHTS)}; nothing was left there") from e
    return out


class ExportError(CheckpointError):
    """The export could not be written (disk full, read-only, permissions): one line, exit 1."""


def _io_error(e: BaseException) -> OSError | None:
    """The I/O failure behind e: itself, or the OS error a safetensors writer names only in its text
    ("I/O error: No space left on device (os error 28)"); None for anything else."""
    if isinstance(e, OSError):
        return e
    m = re.search(r"\(os error (\d+)\)", str(e)) if type(e).__name__ == "SafetensorError" else None
    return OSError(int(m[1]), os.strerror(int(m[1]))) if m else None


def main(argv=None) -> int:
    from mode.errors import OneLineParser  # bad options: one line, exit 2

    p = OneLineParser(prog="mode export", description="Write a run's model as safetensors + config + tokenizer.")
    p.add_argument("--run", required=True, help="run directory (config.yaml and checkpoints/)")
    p.add_argument("--out", required=True, help="new (or empty) directory to write; missing parents are created")
    a = p.parse_args(argv)
    out = export(a.run, a.out)
    print(f"exported {a.run} -> {out}")
    return 0

"""Where metrics go, on rank 0: TensorBoard (always), run.dir/metrics.jsonl (always) and
Weights & Biases (`log.wandb`, optional extra `wandb`). Each logged step is one `write` call:
one JSONL line, one W&B log call, one scalar per tag in TensorBoard.

Tokens and FLOPs as x-axes: TensorBoard has one step axis per tag, so the loss is also logged
under `<split>/loss_vs_tokens` (step = tokens seen) and `<split>/loss_vs_mflops` (step = training
MFLOPs seen: FLOPs themselves overflow TensorBoard's int64 step past 9.2e18, MFLOPs only past 9.2e24,
and stay distinct per step for the tiny CPU models). JSONL and W&B
rows carry `train/tokens_seen` and `train/flops_seen`, so any column can be the x-axis there.
"""
from __future__ import annotations

import json
import math
import struct
import threading
from pathlib import Path
from typing import Iterator

import yaml

from mode.config import Config, dump_config, flatten


def drop_rows_after(path: Path, step: int) -> None:
    """On resume from step `step`: the rows the stopped process logged past its last checkpoint are
    not the run's (the resumed run logs those steps again, or stops short of them, or logs others
    under another log_every); removed, so that metrics.jsonl holds the uninterrupted run's series.
    A torn last line (a kill mid-write) goes too; a line that does not parse is kept as it is.
    TensorBoard's files: drop_events_after."""
    from mode.rundir import write_atomic

    try:
        lines = path.read_text().splitlines(keepends=True)
    except FileNotFoundError:
        return
    keep = [ln for ln in lines if ln.endswith("\n") and not _row_after(ln, step)]
    if len(keep) != len(lines):
        write_atomic(path, "".join(keep))


def _row_after(line: str, step: int) -> bool:
    try:
        return json.loads(line)["step"] > step
    except (ValueError, KeyError, TypeError):
        return False


EVENT_GLOB = "events.out.tfevents.*"
_LENGTH_CRC = struct.Struct("<QI")  # a TFRecord: u64 length, masked crc32c of it, payload, masked crc32c of payload


def event_records(path: Path, damage: list[tuple[int, int]]) -> Iterator[bytes]:
    """The record payloads of one event file, in order. A record that fails its checks is skipped:
    the reading resumes at the next offset holding a record whose length and payload CRCs check,
    and (offset, bytes skipped) is appended to `damage`. With no such record after it, the bad
    bytes are the tail of a run killed mid-write: the file ends there, silently."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    data = Path(path).read_bytes()
    n = len(data)

    def payload_end(p: int) -> int | None:
        if p + 16 > n:
            return None
        length, crc = _LENGTH_CRC.unpack_from(data, p)
        end = p + 12 + length
        if end + 4 > n or masked_crc32c(data[p:p + 8]) != crc:  # the cheap length bound first (resync scans)
            return None
        return end if masked_crc32c(data[p + 12:end]) == struct.unpack_from("<I", data, end)[0] else None

    pos = 0
    while pos < n:
        end = payload_end(pos)
        if end is None:
            nxt = next((p for p in range(pos + 1, n - 15) if payload_end(p) is not None), None)
            if nxt is None:
                return
            damage.append((pos, nxt - pos))
            pos = nxt
            continue
        yield data[pos + 12:end]
        pos = end + 4


def _framed(payload: bytes) -> bytes:
    """One TFRecord, as TensorBoard's writer frames it (event_records reads it back)."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    head = struct.pack("<Q", len(payload))
    return head + struct.pack("<I", masked_crc32c(head)) + payload + struct.pack("<I", masked_crc32c(payload))


def drop_events_after(tb_dir: Path, step: int, tokens: int, mflops: int, since: float = 0.0) -> None:
    """On resume from `step` (`tokens` and `mflops` seen there): the points the stopped process logged
    past its last checkpoint are not the run's; TensorBoard would show them beside the resumed run's,
    two points a step. Each event file holding such points is rewritten without them (atomically),
    by each tag's own axis: the step, or for `*_vs_tokens` / `*_vs_mflops` the tokens or MFLOPs seen
    (TensorBoard's purge, a SessionLog.START at a step, would drop every point of those axes). A torn
    last record (a kill mid-write) goes too; a file with damaged records before its end is left as it
    is (`mode analyze` names it and reads around the damage). Files last written before `since` (the
    checkpoint resumed from was written then, and every point past it after) are not read: the CRC
    checks read ~6 MB/s in Python, and a long run's earlier files hold nothing to drop; and a point
    written before `since` is never dropped (its axis past the cut or not: a FLOPs count that a code
    change moved must not delete the run's own points). The rewrite goes through run.dir/.tb_rewrite.tmp,
    outside tb/ (TensorBoard reads any file named *tfevents* there); one a kill left is removed first."""
    from google.protobuf.message import DecodeError
    from tensorboard.compat.proto import event_pb2

    from mode.rundir import TB_REWRITE, write_atomic

    def past(tag: str, at: int) -> bool:
        return at > (tokens if tag.endswith("_vs_tokens") else mflops if tag.endswith("_vs_mflops") else step)

    tmp = Path(tb_dir).parent / TB_REWRITE
    tmp.unlink(missing_ok=True)
    for path in sorted(Path(tb_dir).glob(EVENT_GLOB)):
        if path.stat().st_mtime < since:
            continue
        damage: list[tuple[int, int]] = []
        kept, dropped = [], 0
        for record in event_records(path, damage):
            try:
                event = event_pb2.Event.FromString(record)
            except DecodeError:  # checks but is no Event: not ours to judge
                kept.append(record)
                continue
            values = event.summary.value if event.HasField("summary") else []
            keep = [v for v in values if not (past(v.tag, event.step) and event.wall_time >= since)]
            if len(keep) != len(values):
                dropped += len(values) - len(keep)
                if not keep:
                    continue
                del event.summary.value[:]
                event.summary.value.extend(keep)
                record = event.SerializeToString()
            kept.append(record)
        if dropped and not damage:
            write_atomic(path, b"".join(_framed(r) for r in kept), tmp)


class Loggers:
    """Rank 0 writes; on other ranks every method is a no-op."""

    def __init__(self, cfg: Config, run_dir: Path, enabled: bool, resumed_step: int | None = None,
                 resumed_seen: dict | None = None, since: float = 0.0):
        """resumed_step: None for a new run, else the step this start continues the run from (0: a run
        stopped before its first checkpoint starts over and logs from step 0 again); resumed_seen: the
        `train/tokens_seen` and `train/flops_seen` there (the other step axes of TensorBoard's tags);
        since: when that checkpoint was written (drop_events_after)."""
        self.enabled, self.tb, self.wandb, self.jsonl, self.run_dir = enabled, None, None, None, run_dir
        if not enabled:
            return
        if resumed_step is not None:
            drop_rows_after(run_dir / "metrics.jsonl", resumed_step if resumed_step else -1)
            if resumed_seen is not None and (run_dir / "tb").is_dir():
                # each axis's cut: the step, tokens, MFLOPs (as _write logs them); a restart at 0 keeps nothing
                cut = (resumed_step, int(resumed_seen["train/tokens_seen"]), int(resumed_seen["train/flops_seen"] / 1e6))
                drop_events_after(run_dir / "tb", *(cut if resumed_step else (-1, -1, -1)), since=since)
        from torch.utils.tensorboard import SummaryWriter

        quiet_tensorboard_writer_thread()
        self.tb = SummaryWriter(str(run_dir / "tb"))
        self.jsonl = open(run_dir / "metrics.jsonl", "a")  # a resumed run appends (past the rows it dropped)
        if cfg.log.wandb:
            import wandb  # optional extra: pip install -e '.[wandb]'

            self.wandb = wandb.init(project=cfg.log.wandb_project, name=cfg.run.name or run_dir.name,
                                    dir=str(run_dir), mode=cfg.log.wandb_mode, config=cfg.to_dict(),
                                    id=_wandb_id(run_dir), resume="allow")

    def log_config(self, cfg: Config, extra: dict) -> None:
        """The resolved config to every logger: TensorBoard text + hparams (W&B got it at init)."""
        if not self.enabled:
            return
        text = dump_config(cfg) + yaml.safe_dump(extra, sort_keys=False)
        self.tb.add_text("config", "```yaml\n" + text + "```", 0)  # markdown: keep the YAML layout
        hparams = {k: (v if isinstance(v, (int, float, str, bool)) else str(v))
                   for k, v in flatten(cfg.to_dict()).items()}
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        for summary in hparams_summary(hparams, {}):  # into this run's event file (add_hparams opens another)
            self.tb.file_writer.add_summary(summary)
        if self.wandb is not None:
            self.wandb.config.update(extra, allow_val_change=True)

    def note(self, tag: str, text: str, step: int) -> None:
        """A text event (e.g. a schedule change on resume) in TensorBoard and W&B."""
        if not self.enabled:
            return
        self.tb.add_text(tag, text, step)
        if self.wandb is not None:
            self.wandb.log({tag: text}, step=step)

    def write(self, scalars: dict, step: int) -> None:
        if not self.enabled or not scalars:
            return
        try:
            self._write(scalars, step)
        except OSError as e:  # flush() names no file: name the run's, so a full disk is told of the right one
            e.filename = e.filename or str(self.run_dir)
            raise

    def _write(self, scalars: dict, step: int) -> None:
        for k, v in scalars.items():
            self.tb.add_scalar(k, v, step)
        for split in ("train", "eval"):
            loss = scalars.get(f"{split}/loss")
            if loss is not None and "train/tokens_seen" in scalars:
                self.tb.add_scalar(f"{split}/loss_vs_tokens", loss, int(scalars["train/tokens_seen"]))
                self.tb.add_scalar(f"{split}/loss_vs_mflops", loss, int(scalars["train/flops_seen"] / 1e6))
        self.tb.flush()
        row = {"step": step, **{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                for k, v in scalars.items()}}
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self, failed: bool = False) -> None:
        if not self.enabled:
            return
        self.tb.close()
        self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish(exit_code=1 if failed else 0)  # a fault shows as a failed W&B run


def quiet_tensorboard_writer_thread() -> None:
    """TensorBoard writes events in a thread; a write that fails there (a full disk) printed that
    thread's traceback beside the run's one error line. The writer keeps the exception and raises
    it in the main thread at the next write or flush (Loggers.write names the run): that is the
    one line; the thread's own report is dropped. Installed once; other threads' reports pass."""
    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread

    previous = threading.excepthook
    if getattr(previous, "mode_quiet_tensorboard", False):
        return

    def hook(args):
        if isinstance(args.thread, _AsyncWriterThread) and issubclass(args.exc_type, OSError):
            return
        previous(args)

    hook.mode_quiet_tensorboard = True
    threading.excepthook = hook


def _wandb_id(run_dir: Path) -> str:
    """One W&B run per run.dir, also across resumptions: the id is kept in run.dir/wandb_id."""
    f = run_dir / "wandb_id"
    if not f.exists():
        import uuid

        f.write_text(uuid.uuid4().hex[:16])
    return f.read_text().strip()

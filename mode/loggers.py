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
import threading
from pathlib import Path

import yaml

from mode.config import Config, dump_config, flatten


def drop_rows_after(path: Path, step: int) -> None:
    """On resume from step `step`: the rows the stopped process logged past its last checkpoint are
    not the run's (the resumed run logs those steps again, or stops short of them, or logs others
    under another log_every); removed, so that metrics.jsonl holds the uninterrupted run's series.
    A torn last line (a kill mid-write) goes too; a line that does not parse is kept as it is.
    TensorBoard's files are not rewritten: `mode analyze` drops those points by run_info.json's
    `resumes`, TensorBoard's own view still shows them."""
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


class Loggers:
    """Rank 0 writes; on other ranks every method is a no-op."""

    def __init__(self, cfg: Config, run_dir: Path, enabled: bool, resumed_step: int | None = None):
        """resumed_step: None for a new run, else the step this start continues the run from (0: a run
        stopped before its first checkpoint starts over and logs from step 0 again)."""
        self.enabled, self.tb, self.wandb, self.jsonl, self.run_dir = enabled, None, None, None, run_dir
        if not enabled:
            return
        if resumed_step is not None:
            drop_rows_after(run_dir / "metrics.jsonl", resumed_step if resumed_step else -1)
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

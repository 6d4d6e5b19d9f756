"""Training: a thin loop over the DeepSpeed engine; evaluation, checkpoints and logging are small
pieces it calls.

Launch as `mode train --config F`, `deepspeed --num_gpus N --module mode.train --config F`, or
`torchrun --nproc_per_node N -m mode.train --config F`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from mode import engine as eng
from mode import checkpoint as ckpt
from mode import console, rundir
from mode.config import EXECUTION_KEYS, Config, ConfigError, dump_config, flatten, is_int, load_config, typed_dict
from mode.config import config_diff as keys_diff  # train's config_diff: the resume's filter of it
from mode.data import DataModule, check_data
from mode.prepare import data_change, data_identity, prepared_path, read_manifest
from mode.flops import count as count_flops
from mode.loggers import Loggers
from mode.metrics import TRAIN_FLOPS_PER_FORWARD_FLOP, Accumulator, default_peak_tflops, efficiency, memory_gb
from mode.model import build_model
from mode.plan import has_moe, layer_plan, routes_at_sampling

# Keys that may change between a run and its resumption; anything else is a different experiment.
RESUMABLE_KEYS = EXECUTION_KEYS + ("train.max_steps", "train.eval_batches", "model.moe.ep_size")
# Keys the LR schedule is computed from (mode/engine.py lr_lambda): changing one on resume
# recomputes the schedule at the resumed step, so it needs train.allow_schedule_change.
SCHEDULE_KEYS = ("train.max_steps", "optim.lr", "optim.warmup_steps", "optim.min_lr_ratio")


class NonFiniteError(RuntimeError):
    pass


def config_diff(old: dict, new: dict) -> list[str]:
    """The differences a resume refuses (all but RESUMABLE_KEYS)."""
    return keys_diff(old, new, keep=lambda k: not k.startswith(RESUMABLE_KEYS))


def schedule_diff(old: dict, new: dict) -> dict[str, tuple]:
    """{key: (saved, new)} for the schedule keys that differ."""
    a, b = flatten(old), flatten(new)
    return {k: (a.get(k), b.get(k)) for k in SCHEDULE_KEYS if a.get(k) != b.get(k)}


def resume_order(last: Path | None, same_layout: bool = True) -> dict | str | None:
    """The optimizer's parameter order (mode.engine.param_groups) for a start from checkpoint `last`:
    None (the aligned order) for a fresh start or a weights-only load (another model.moe.ep_size: the
    optimizer state restarts, and the expert parameters' names differ), else the order it recorded, or
    module order for a checkpoint written before param_order.json (its flat optimizer state is laid
    out in that order)."""
    if last is None or not same_layout:
        return None
    return (ckpt.vouched_record(last, ckpt.PARAM_ORDER) or {}).get("groups", eng.MODULE_ORDER)


def saved_ep_size(saved: dict | None, cfg: Config) -> int:
    """The model.moe.ep_size the run being resumed was trained at (this config's for a fresh start)."""
    return (saved or {}).get("model", {}).get("moe", {}).get("ep_size", cfg.model.moe.ep_size)


def check_run_dir(cfg: Config, lock: bool = True) -> dict | None:
    """Refuse a run directory written by an incompatible config (before any worker starts).
    Returns the saved config dict when resuming."""
    saved = rundir.check(cfg.run.dir, cfg.run.fresh, lock=lock) / "config.yaml"
    if cfg.run.fresh:
        return None
    n = len(ckpt.step_dirs(ckpt.checkpoints_dir(cfg.run.dir)))
    if not saved.exists():
        if n:  # resuming would load them under whatever config this start has, schedule included
            raise ConfigError("run.dir", msg=f"run.dir={cfg.run.dir!r} holds {n} checkpoints but no config.yaml, so "
                              "the config they were trained with cannot be checked; write back the config it was "
                              "started with (each checkpoint's config.json and the TensorBoard TEXT tab hold a copy), "
                              "or use another run.dir (run.fresh=true deletes them)")
        return None
    try:
        old = yaml.safe_load(saved.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        old = e
    if not isinstance(old, dict):
        what = "empty" if old is None else "not a readable config"
        raise ConfigError("run.dir", msg=f"run.dir={cfg.run.dir!r}: its config.yaml is {what}, so the run cannot be "
                          f"resumed; write back the config it was started with ({n} checkpoints wait for it; their "
                          "config.json and the TensorBoard TEXT tab hold a copy), or use another run.dir (run.fresh=true "
                          "deletes them)")
    old = typed_dict(old)  # a config written back by hand (from a checkpoint's config.json) may hold `1e-06`
    saved_keys = flatten(old)
    unknown = sorted(set(saved_keys) - set(flatten(cfg.to_dict())))
    if unknown:  # a typo added by hand: "start over" (run.fresh) would be the wrong advice
        raise ConfigError("run.dir", msg=f"run.dir={cfg.run.dir!r}: its config.yaml has {unknown[0]}="
                          f"{saved_keys[unknown[0]]!r}, which is not a config key (edited by hand, or written by "
                          f"another version of mode); remove it from {saved} or use another run.dir")
    diff = config_diff(old, cfg.to_dict())
    sched = schedule_diff(old, cfg.to_dict())
    if [d for d in diff if d.split(":")[0] not in sched]:  # another experiment: list every difference
        raise ConfigError("run.dir", msg=f"run.dir={cfg.run.dir!r} holds a run with a different config "
                          f"({'; '.join(diff)}); pass run.fresh=true to start over or use another run.dir")
    # config.yaml may have been written back by hand: the newest checkpoint's own record decides
    if (trained := newest_record(cfg, ckpt.CONFIG)) and (refusal := other_config(cfg, *trained)):
        raise refusal
    if (Path(cfg.run.dir) / "DONE").exists() and not n:
        raise ConfigError("run.dir", msg=f"run.dir={cfg.run.dir!r} finished (DONE) but holds no checkpoint (were "
                          "they removed?): a start would train it again from step 0 beside its logs; pass "
                          "run.fresh=true to retrain it or use another run.dir")
    last = ckpt.latest_step(cfg.run.dir)
    if sched and not cfg.train.allow_schedule_change and last is not None:
        key, (was, now) = next(iter(sched.items()))
        raise ConfigError(key, msg=f"{key}={now!r}: run.dir={cfg.run.dir!r} was trained with {key}={was!r} and "
                          "its LR schedule depends on it (resuming would recompute the schedule at the resumed "
                          "step); use train.stop_at to time-box a run, pass train.allow_schedule_change=true to "
                          "change the schedule, or use another run.dir")
    if ("train.max_steps" in sched and last is not None and cfg.train.max_steps <= last
            and not (Path(cfg.run.dir) / "DONE").exists()):  # (a finished run: train.finished's "nothing to do")
        # it trained nothing and wrote a DONE without final metrics (or, below the step, nothing at all)
        raise ConfigError("train.max_steps", cfg.train.max_steps, f"more than {last}, the step run.dir="
                          f"{cfg.run.dir!r} resumes from (its checkpoints are usable as they are: mode eval, "
                          "mode export)")
    return old


def check_backend(cfg: Config) -> None:
    if cfg.model.moe.backend == "megablocks" and has_moe(layer_plan(cfg.model)):
        from mode.moe.megablocks import require_megablocks

        require_megablocks()


def check_loggers(cfg: Config) -> None:
    """The optional loggers' packages are there (else rank 0 would fail after creating run.dir)."""
    import importlib.util

    if cfg.log.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("log.wandb", True, "false, or install the wandb package it needs "
                                             "(pip install -e '.[wandb]')")
    if cfg.log.wandb and cfg.log.wandb_mode == "online" and not _wandb_logged_in():
        raise ConfigError("log.wandb_mode", "online", "offline (no login or network needed; `wandb sync` "
                          "uploads later), or log in first (`wandb login`, or set WANDB_API_KEY)")


def _wandb_logged_in() -> bool:
    """Whether wandb.init(mode="online") finds credentials (else it fails on rank 0 after run.dir was
    written). Asks wandb's own lookup (environment, .netrc, settings) without prompting; a wandb
    version without that lookup is not checked here."""
    try:
        import wandb
        from wandb.sdk.lib.wbauth import authenticate_session
    except ImportError:
        return True
    try:
        return authenticate_session(host=wandb.Settings().base_url, source="mode", prompt=False,
                                    update_session=False) is not None
    except Exception:  # e.g. a malformed key: wandb.init names it
        return True


def check_build_locks() -> None:
    from mode.lifeline import stale_build_locks, stale_lock_message, use_venv_build_cache

    use_venv_build_cache()
    stale = stale_build_locks()
    if stale:
        raise ConfigError("TORCH_EXTENSIONS_DIR", msg=stale_lock_message(stale[0]))


def preflight(cfg: Config, lock: bool = True, prepare_data: bool = True) -> dict | None:
    """Everything that can be checked before processes start (the launchers, `mode compare` and
    `--print-config` call it; so does every rank). Add new checks here: each raises ConfigError
    and writes nothing. The data is prepared here if needed (mode.data.check_data), unless
    `prepare_data=False` (`--print-config`: the same data checks, nothing written). Returns the
    saved config when resuming. `lock=False` skips the one-writer check (a launcher on node R > 0
    may start after rank 0 took the lock)."""
    check_backend(cfg)
    check_loggers(cfg)
    check_build_locks()
    saved = check_run_dir(cfg, lock)  # before the data: a refused run.dir must not wait for (or write) a prepare
    prepared, run = Path(cfg.data.prepared_dir).expanduser().resolve(), Path(cfg.run.dir).expanduser().resolve()
    if prepared == run or run in prepared.parents:  # the start would refuse the run it prepared into
        raise ConfigError("data.prepared_dir", cfg.data.prepared_dir, f"a directory outside run.dir ({cfg.run.dir})")
    rundir.check_outside_runs(cfg.data.prepared_dir, "data.prepared_dir", proofs=rundir.RUN_PROOFS)  # nor (in) another run
    check_data(cfg, write=prepare_data)
    if recorded := newest_record(cfg, ckpt.DATA):  # before workers start (they check the one they load)
        path = prepared_path(cfg.data)  # (--print-config of data not prepared yet: nothing to compare)
        if (manifest := read_manifest(path)) and (refusal := other_data(cfg, *recorded, path, manifest)):
            raise refusal
    return saved


def check_world(cfg: Config, world: int) -> None:
    """A checkpoint holds per-rank RNG states and a data position counted in global batches of its
    world size: resuming it at another world size would not continue the same run. Refused."""
    if cfg.run.fresh or ckpt.latest_step(cfg.run.dir) is None:
        return
    saved = saved_world(cfg.run.dir, strict=True)
    if saved is not None and saved != world:
        raise other_world(cfg, saved, world)


def other_world(cfg: Config, saved: int, world: int) -> ConfigError:
    return ConfigError("run.dir", msg=f"run.dir={cfg.run.dir!r} was saved at world size {saved} and this launch "
                       f"has world size {world}: resume it with {saved} process(es), or start over with "
                       "run.fresh=true or another run.dir")


def other_config(cfg: Config, name: str, trained: dict) -> ConfigError | None:
    """The refusal of checkpoint `name` trained under another config than `cfg` (the schedule keys
    aside: check_run_dir governs their change), or None."""
    diff = [d for d in config_diff(trained, cfg.to_dict()) if d.split(":")[0] not in SCHEDULE_KEYS]
    return ConfigError("run.dir", msg=f"run.dir={cfg.run.dir!r}: checkpoint {name} was trained with a different "
                       f"config ({'; '.join(diff)}); start it with that config, or start over with run.fresh=true or "
                       "another run.dir") if diff else None


def other_data(cfg: Config, name: str, recorded: dict, path, manifest: dict) -> ConfigError | None:
    """The refusal of checkpoint `name` trained on other data than the prepared `manifest`, or None:
    a rebuilt prepared_dir (an edited source, another tokenizer.json) passes every config check."""
    why = data_change(recorded, data_identity(manifest))
    return ConfigError("run.dir", msg=f"run.dir={cfg.run.dir!r}: checkpoint {name} was trained on other data than "
                       f"{path} holds ({why} since); resume it on that data, or start over with run.fresh=true or "
                       "another run.dir") if why else None


def newest_record(cfg: Config, name: str) -> tuple[str, dict] | None:
    """(checkpoint name, record) of a resume's newest complete checkpoint, its record `name`
    (ckpt.CONFIG, ckpt.DATA), or None: a fresh start, no checkpoint, a finished run (nothing to
    resume: `finished` says so), none recorded (older checkpoints), or a record its manifest does
    not vouch for (the resume falls back past that checkpoint and checks the one it loads)."""
    newest = None if cfg.run.fresh else ckpt.latest(ckpt.checkpoints_dir(cfg.run.dir))
    if newest is None or done_at(cfg, ckpt.step_of(newest)):
        return None
    record = ckpt.vouched_record(newest, name)
    return (newest.name, record) if record is not None else None


def requeued_fresh_start(cfg: Config, env=None) -> bool:
    """run.fresh=true again in a SLURM job that SLURM requeued (SLURM_RESTART_COUNT > 0) after this
    same job (SLURM_JOB_ID, recorded in run_info.json) had started the run: the requeue re-runs the
    job's command, and deleting would throw away what the job trained before it. Such a start
    resumes instead. (A second start inside one interactive allocation is no requeue: fresh holds.)"""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID")
    if not (cfg.run.fresh and job and env.get("SLURM_RESTART_COUNT", "0") not in ("", "0")):
        return False
    try:
        return json.loads((Path(cfg.run.dir) / "run_info.json").read_text()).get("slurm_job_id") == job
    except (OSError, ValueError, AttributeError):
        return False


def saved_world(run_dir: Path | str, strict: bool = False) -> int | None:
    """The world size run_info.json records; None when there is none. A damaged file (not a JSON
    object, or no positive whole world_size in it) reads as None, or with `strict` is refused."""
    info = Path(run_dir) / "run_info.json"
    if not info.exists():
        return None
    try:
        saved = json.loads(info.read_text()).get("world_size", 0)
    except (ValueError, AttributeError):
        saved = None
    if is_int(saved, 1):
        return saved
    if saved == 0 or not strict:  # 0: written before world_size was recorded
        return None
    raise ConfigError("run.dir", msg=f"run.dir={str(run_dir)!r}: its run_info.json is damaged (not a JSON object "
                      "with a whole world_size); delete it (the next start writes it again) and start again")


def done_at(cfg: Config, step: int) -> bool:
    """run.dir holds a run finished at `step`: DONE written, train.max_steps reached (a larger one
    continues it)."""
    return (Path(cfg.run.dir) / "DONE").exists() and step >= cfg.train.max_steps


def finished(cfg: Config, world: int | None = None) -> str | None:
    """A message when run.dir holds this run already finished (DONE at train.max_steps) or already
    at its train.stop_at (the same time-boxed command run again), else None: nothing to do. `world`:
    this launch's world size; when the run was saved at another one, the command that continues it
    is named with the saved one (at this one it would be refused: check_world)."""
    run_dir = Path(cfg.run.dir)
    step = ckpt.latest_step(run_dir)
    if cfg.run.fresh or step is None:
        return None
    done, stop = done_at(cfg, step), cfg.train.stop_at
    if (done or 0 < stop <= step) and ckpt.verify(ckpt.latest(ckpt.checkpoints_dir(run_dir))) is not None:
        return None  # a damaged last checkpoint is not a finished run: the start reports it and falls back
    saved = saved_world(run_dir)
    where = (f", launched with {saved} process(es) (it was saved at world size {saved}; this launch's {world} "
             "would be refused)") if world is not None and saved is not None and saved != world else ""
    if done:
        return (f"run.dir={str(run_dir)!r} already finished at step {step} (DONE): nothing to do, nothing written; "
                f"run.fresh=true starts over, a larger train.max_steps with train.allow_schedule_change=true continues"
                f"{where}")
    if 0 < stop <= step:
        return (f"run.dir={str(run_dir)!r} is already at step {step} (train.stop_at={stop}): nothing to do, nothing "
                f"written; the same command with train.stop_at=0 (or a later step) continues it{where}")
    return None


class Trainer:
    def __init__(self, cfg: Config):
        from mode.lifeline import watch_build_locks

        with watch_build_locks():  # DeepSpeed loads (or builds) its ops in here: a killed builder must not hang us
            self._start(cfg)

    def _start(self, cfg: Config) -> None:
        self.rank, self.world = eng.init_distributed()
        cfg.validate(self.world)
        self.cfg, self.dev = cfg, eng.device()
        self.run_dir = Path(cfg.run.dir)
        saved = preflight(cfg)  # every rank reads the saved config before rank 0 replaces it
        check_world(cfg, self.world)
        self._barrier()
        self.lock, made = None, []
        if self.rank == 0:
            was_run = rundir.is_mode_run(self.run_dir)  # before our LOCK makes any directory look like one
            made = rundir.missing_dirs(self.run_dir)
            self.lock = rundir.DirLock(self.run_dir)  # held until this process ends
            if cfg.run.fresh and was_run:  # preflight refused any other non-empty directory
                rundir.empty_run_dir(self.run_dir)
        self._barrier()
        self.ckpt_dir = ckpt.checkpoints_dir(self.run_dir)
        try:
            self._build(cfg, saved)
        except BaseException:
            if made:  # a start that never trained (out of memory building the model, ...) leaves no new
                self.lock.release()  # run.dir behind: the corrected command would find it "in use" or
                (self.run_dir / rundir.LOCK).unlink(missing_ok=True)  # another run's
                rundir.remove_made(made)
            raise
        since = (self.resume_from / ckpt.MANIFEST).stat().st_mtime if self.resume_from else 0.0
        self.log = Loggers(cfg, self.run_dir, self.rank == 0, None if saved is None else self.step, self.resumed, since)
        self._log_start(cfg, saved)

    def _build(self, cfg: Config, saved: dict | None) -> None:
        """Model, engine, resume; then config.yaml (written only now: a start that fails before
        this point leaves the run directory as it found it, and the corrected command is not
        refused as "a run with a different config")."""
        torch.manual_seed(cfg.train.seed)  # identical init on every rank
        self.data = DataModule(cfg.data, self.rank, self.world)
        self.model = eng.prepare_model(cfg, build_model(cfg.model).to(self.dev), self.dev)
        self.model.activation_checkpointing = cfg.train.activation_checkpointing == "block"
        # the checkpoint to resume from decides the optimizer's parameter order (its flat state's
        # layout): rank 0 reads it, every rank builds the groups it names
        self.resume_from = ckpt.resume_point(self.ckpt_dir, self.rank)
        self.same_layout = saved_ep_size(saved, cfg) == cfg.model.moe.ep_size
        box = [resume_order(self.resume_from, self.same_layout) if self.rank == 0 else None]
        if self.world > 1:
            dist.broadcast_object_list(box, src=0)
        self.param_order = eng.param_order(self.model, eng.param_groups(self.model, cfg.optim.weight_decay, box[0]))
        self.engine, self.opt, self.sched = eng.build_engine(cfg, self.model, self.world, self.param_order)
        eng.check_compile_alignment(cfg, self.model)
        self.pred_opt = eng.PredictorAdamW(cfg, self.model) if eng.predictor_params(self.model) else None
        self.threshold_bufs = eng.threshold_buffers(self.model)  # once: not a module walk every step
        torch.manual_seed(cfg.train.seed * 7919 + self.rank)  # training randomness differs per rank
        self.tokens_per_step = cfg.train.micro_batch_size * cfg.train.grad_accum * self.world * cfg.data.seq_len
        self.flops = count_flops(cfg)
        self.step, self.tokens, self.elapsed_s, self.consecutive_bad = 0, 0, 0.0, 0
        self.prev_cfg = saved
        self.acc = Accumulator()  # metric sums not yet logged: checkpointed so the series survives a resume
        # measured before the resume restores the RNG states: nothing may draw from them in between
        self.peak_tflops, self.peak_src = self._peak_tflops()
        self._resume()
        self.resumed = {"step": self.step, **self._seen(), "time": time.time()}  # before this start logs anything
        if self.rank == 0:
            self._record_schedule_change(saved, cfg)  # before config.yaml forgets the old schedule
            rundir.write_atomic(self.run_dir / "config.yaml", dump_config(cfg))

    def _log_start(self, cfg: Config, saved: dict | None) -> None:
        if self.rank == 0:
            params = self.flops["params"]  # the model's: with expert parallelism this rank holds E/ep experts
            info = {"name": cfg.run.name or self.run_dir.name, "seed": cfg.train.seed, "params": params,
                    "active_params": console.active_params(cfg, params),
                    "forward_flops_per_token": self.flops["forward_flops_per_token"],
                    "world_size": self.world, "tokens_per_step": self.tokens_per_step,
                    "peak_tflops_per_device": self.peak_tflops, "peak_tflops_source": self.peak_src,
                    # which tokenizer: eval losses in nats per token compare only within one (analysis/report.py)
                    "tokenizer_sha256": self.data.manifest["tokenizer"]["sha256"]}
            if os.environ.get("SLURM_JOB_ID"):  # the job that started this run (requeued_fresh_start)
                info["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
            prev = self._saved_info() if saved is not None else {}  # this run's, when resuming
            changes = prev.get("schedule_changes") if saved else None
            if changes:  # recorded by _record_schedule_change; kept across every later start
                info["schedule_changes"] = changes
            # every resume's point and time: what an earlier process logged past it, before it, is not
            # this run's series (analysis/tb.py drops it; metrics.jsonl had it dropped above)
            # (a restart at step 0, before the first checkpoint, included: it logs every step again)
            resumes = [*(prev.get("resumes") or []), self.resumed] if saved is not None else []
            if resumes:
                info["resumes"] = resumes
            # the peak each kept row's perf/mfu divides by, from the step a start resumed at, where it
            # changed (perf.peak_tflops given on a resume, a CPU peak measured again; analysis/report.py
            # says so); a start's entry past this resume point covered only rows that are dropped
            peaks = prev.get("peaks") or ([{"step": 0, "peak_tflops_per_device": prev["peak_tflops_per_device"]}]
                                          if "peak_tflops_per_device" in prev else [])
            peaks = [e for e in peaks if isinstance(e, dict) and e.get("step", 0) < self.step]
            if not peaks or peaks[-1].get("peak_tflops_per_device") != self.peak_tflops:
                peaks.append({"step": self.step, "peak_tflops_per_device": self.peak_tflops})
            info["peaks"] = peaks
            rundir.write_atomic(self.run_dir / "run_info.json", json.dumps(info, indent=1))
            self.log.log_config(cfg, {"run_info": info})
            print(console.start_block(cfg, params, self.flops, self.world, self.dev, (self.peak_tflops, self.peak_src),
                                      self.step), flush=True)
            for warning in (console.schedule_warning(cfg), console.eval_repeat_warning(cfg, self.data.n_val, self.world),
                            console.bf16_sum_warning(cfg, self.world)):
                if warning:
                    print(warning, flush=True)
            sched = schedule_diff(saved, cfg.to_dict()) if saved and self.step else {}
            if sched:
                note = (f"schedule changed at resumed step {self.step}: "
                        + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in sched.items())
                        + "; the LR is recomputed for the new schedule from here (train.allow_schedule_change)")
                print(note, flush=True)
                self.log.note("schedule_change", note, self.step)

    def _record_schedule_change(self, saved: dict | None, cfg: Config) -> None:
        """config.yaml holds only the last schedule: a resume that changes it (allowed by
        train.allow_schedule_change) is appended to run_info.json's `schedule_changes` before
        config.yaml is replaced, so that a start killed in between cannot lose it and `mode analyze`
        never averages a re-scheduled run with runs trained on one schedule."""
        step = ckpt.latest_step(self.run_dir) if saved else None
        sched = schedule_diff(saved, cfg.to_dict()) if step else {}
        if not sched:
            return
        info = self._saved_info()
        change, changes = {"step": step, **{k: list(ab) for k, ab in sched.items()}}, info.get("schedule_changes") or []
        if changes[-1:] != [change]:  # a start killed before config.yaml was replaced records it once
            info["schedule_changes"] = [*changes, change]
            rundir.write_atomic(self.run_dir / "run_info.json", json.dumps(info, indent=1))

    def _saved_info(self) -> dict:
        """The run_info.json of the run being resumed ({} if none or unreadable: it is rewritten)."""
        try:
            info = json.loads((self.run_dir / "run_info.json").read_text())
        except (OSError, ValueError):
            return {}
        return info if isinstance(info, dict) else {}

    def _peak_tflops(self) -> tuple[float, str]:
        if self.cfg.perf.peak_tflops > 0:
            return self.cfg.perf.peak_tflops, "perf.peak_tflops"
        self._barrier()  # on CPU every rank measures at once: ranks share the cores as in training
        peak, src = default_peak_tflops(self.cfg.deepspeed.precision)
        if dist.is_initialized() and self.world > 1:
            t = torch.tensor(peak, dtype=torch.float64, device=self.dev)
            dist.all_reduce(t)
            peak = t.item() / self.world
        return peak, src

    def _barrier(self):
        if dist.is_initialized():
            dist.barrier()

    def _resume(self) -> None:
        last = self.resume_from
        if last is None:
            return
        old_ep, same_layout = saved_ep_size(self.prev_cfg, self.cfg), self.same_layout
        if not same_layout:
            warnings.warn(f"resuming {last} at model.moe.ep_size={self.cfg.model.moe.ep_size} (saved at {old_ep}): "
                          "weights are loaded, the optimizer state restarts, the LR schedule goes on")
        client = ckpt.load(self.engine, last, self.rank, load_optimizer=same_layout)
        # check_world reads run_info.json, which a user may have deleted (its damage message says
        # to): the checkpoint's own record of its world size decides (every rank raises alike)
        if client.get("world_size", self.world) != self.world:
            raise other_world(self.cfg, client["world_size"], self.world)
        # ... and of its config: config.yaml may have been written back by hand (same shapes load
        # silently). The schedule keys are check_run_dir's (a changed schedule's first checkpoint may
        # not be written yet). Checkpoints from before this record have none.
        trained = client.get("config")
        if trained and (refusal := other_config(self.cfg, last.name, trained)):
            raise refusal
        # A schedule that differs from the checkpoint's must be a change asked for now or recorded when
        # it was asked for (run_info.json): config.yaml edited by hand passes check_run_dir's comparison
        sched = schedule_diff(trained, self.cfg.to_dict()) if trained else {}
        changes = self._saved_info().get("schedule_changes") or []
        unasked = {k: ab for k, ab in sched.items()
                   if not any(isinstance(c, dict) and list(c.get(k) or [])[1:] == [ab[1]] for c in changes)}
        if unasked and not self.cfg.train.allow_schedule_change:
            key, (was, now) = next(iter(unasked.items()))
            raise ConfigError(key, msg=f"{key}={now!r}: checkpoint {last.name} of run.dir={self.cfg.run.dir!r} was "
                              f"trained with {key}={was!r} and its LR schedule depends on it (its config.yaml was "
                              "edited?); pass train.allow_schedule_change=true to change the schedule, or start it "
                              "with the checkpoint's value")
        # ... and of its data: a rebuilt prepared_dir (an edited source, another tokenizer.json) passes
        # every config check, and the weights would go on training on other tokens
        if client.get("data") and (refusal := other_data(self.cfg, last.name, client["data"], self.data.path,
                                                          self.data.manifest)):
            raise refusal
        self.step, self.tokens = client["step"], client["tokens"]
        if not same_layout:  # the scheduler's state was not loaded (its groups changed): the LR is a
            # function of the applied steps alone, so take it up where it was, not from warmup again
            self.sched.last_epoch = client.get("lr_steps", self.step)
        # The loaded state holds the checkpoint's optim.lr as base_lrs (the lambda, not saved, is this
        # config's already): an allowed optim.lr change was logged and then trained at the old peak
        self.sched.base_lrs = [self.cfg.optim.lr] * len(self.sched.base_lrs)
        self.sched.last_epoch -= 1  # recompute this step's LR from both
        with warnings.catch_warnings():  # torch warns of a step before optimizer.step(): here it is meant
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
            self.sched.step()
        if self.pred_opt and "predictor_optim" in client:
            self.pred_opt.load_state_dict(client["predictor_optim"])
        self.elapsed_s = client.get("elapsed_s", 0.0)
        self.consecutive_bad = client.get("consecutive_bad", 0)  # max_consecutive_nonfinite spans a resume
        if "log_sums" in client.get("rank_state", {}) and client.get("world_size") == self.world:
            self.acc.load_state_dict(client["rank_state"]["log_sums"], self.dev)
        if self.rank == 0:
            print(f"resumed from {last} at step {self.step}", file=sys.stderr)

    def save(self, pending_s: float = 0.0) -> None:
        """`pending_s`: training time since the last log, not yet in elapsed_s (a resume must count it)."""
        state = {"step": self.step, "tokens": self.tokens, "elapsed_s": self.elapsed_s + pending_s,
                 "world_size": self.world, "lr_steps": self.sched.last_epoch,  # skipped steps do not count
                 "consecutive_bad": self.consecutive_bad,
                 "config": self.cfg.to_dict(), "data": data_identity(self.data.manifest),
                 "param_order": {"groups": self.param_order}}
        if self.pred_opt:
            state["predictor_optim"] = self.pred_opt.state_dict()
        ckpt.save(self.engine, self.ckpt_dir, self.step, state, self.rank, self.cfg.checkpoint.keep,
                  rank_state={"log_sums": self.acc.state_dict()})

    def train_step(self, acc: Accumulator) -> None:
        t = self.cfg.train
        skipped_before = self.engine.skipped_steps
        ema_before = [b.clone() for b in self.threshold_bufs]
        for micro in range(t.grad_accum):
            x, y = (b.to(self.dev) for b in self.data.train_batch(self.step, micro, t.micro_batch_size, t.grad_accum))
            out = self.engine(x, y)
            loss = out.loss + out.aux_loss
            self.engine.backward(loss)
            if self.pred_opt and micro == t.grad_accum - 1:  # before the engine's step drops the gradients
                self.pred_opt.step(self.sched.get_last_lr()[0])
            self.engine.step()
            acc.add({"train/loss": out.loss, "train/aux_loss": out.aux_loss, **out.metrics})
        skipped = self.engine.skipped_steps > skipped_before
        if skipped:  # the thresholds' EMA stepped in the forward: undo it as DeepSpeed undid the weights'
            for b, saved in zip(self.threshold_bufs, ema_before):  # (a NaN would stay for good)
                b.copy_(saved)
        eng.average_thresholds(self.model)
        self.step += 1
        self.tokens += self.tokens_per_step
        self._check_nonfinite(skipped)

    def _check_nonfinite(self, skipped: bool) -> None:
        self.consecutive_bad = self.consecutive_bad + 1 if skipped else 0
        t = self.cfg.train
        if skipped and (t.nonfinite == "stop" or self.consecutive_bad >= t.max_consecutive_nonfinite):
            bad = (getattr(self.opt, "bad_params", None)
                   or ["(not recorded: at ZeRO 1/2 DeepSpeed checks the gradients itself)"])
            stats = "; ".join(f"{n}: |w|={p.detach().float().norm():.3g}"
                              for n, p in self.model.named_parameters() if n.endswith("weight") and p.dim() >= 2)
            raise NonFiniteError(f"non-finite loss or gradient at step {self.step} "
                                 f"({self.consecutive_bad} in a row, policy {t.nonfinite}); non-finite grads in: "
                                 f"{', '.join(bad[:8])}; weight norms: {stats}")

    @torch.no_grad()
    def evaluate(self) -> dict:
        # evaluation must not shift training randomness (stochastic routing draws on the device)
        with self._fork_rng(), self._eager():
            model = self.engine.module
            model.eval()
            acc = Accumulator()
            routings = ("topk", "causal") if routes_at_sampling(model.plan) else ("topk",)
            n, mb = self.cfg.train.eval_batches, self.cfg.train.micro_batch_size
            # (nats, UTF-8 bytes) of the evaluated targets, summed over batches and ranks
            nats_bytes = torch.tensor([0.0, self.data.val_bytes(n, mb)], dtype=torch.float64, device=self.dev)
            for x, y in self.data.val_batches(n, mb):
                x, y = x.to(self.dev), y.to(self.dev)
                for r in routings:
                    out = model(x, y, routing=r)
                    acc.add({"eval/loss" if r == "topk" else "eval/loss_causal": out.loss})
                    if r == "topk":  # out.loss is the mean over every target token
                        nats_bytes[0] += out.loss.double() * y.numel()
            model.train()
            vals = acc.read()
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(nats_bytes)
            nats, nbytes = nats_bytes.tolist()
            # bits per UTF-8 byte of the evaluated text: comparable across tokenizers
            vals["eval/bpb"] = nats / math.log(2) / max(nbytes, 1.0)
            return vals

    def _fork_rng(self):
        return torch.random.fork_rng(devices=[self.dev.index] if self.dev.type == "cuda" else [])

    def _eager(self):
        """Compiled blocks run eager in evaluation: no-grad and causal routing's ragged shapes would
        recompile them (train.compile speeds up training). Without train.compile dynamo stays unloaded."""
        if self.cfg.train.compile:
            return torch.compiler.set_stance("force_eager")
        return contextlib.nullcontext()

    def dump_routing(self) -> None:
        with self._fork_rng(), self._eager():
            model = self.engine.module
            x, _ = next(self.data.val_batches(1, self.cfg.train.micro_batch_size))
            with torch.no_grad():
                model.eval()
                out = model(x.to(self.dev))
                model.train()
            p = torch.log_softmax(out.logits.float(), -1)
            entropy = -(p.exp() * p).sum(-1)
            engaged = model.engaged_blocks()
            if self.rank != 0:
                return
            if engaged is None:
                engaged = torch.ones(self.cfg.model.n_layers, *x.shape, dtype=torch.bool)
            tok = self.data.tokenizer
            torch.save({"input_ids": x.cpu(), "engaged": engaged.cpu(), "entropy": entropy.cpu(),
                        "text": [tok.decode(r.tolist()) for r in x],
                        "tokens": [[tok.decode([i]) for i in r.tolist()] for r in x]},  # per-token text for heatmaps
                       self.run_dir / "routing.pt")

    def _seen(self) -> dict:
        return {"train/tokens_seen": self.tokens,
                "train/flops_seen": TRAIN_FLOPS_PER_FORWARD_FLOP * self.flops["forward_flops_per_token"] * self.tokens}

    def _peak_memory_gb(self) -> float:
        mem = torch.tensor(memory_gb(self.dev), dtype=torch.float64, device=self.dev)
        if dist.is_initialized() and self.world > 1:
            dist.all_reduce(mem, op=dist.ReduceOp.MAX)  # the rank closest to running out
        return mem.item()

    def fit(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        bar = None
        if self.rank == 0 and console.use_bar(cfg.log.progress):
            from tqdm import tqdm

            bar = tqdm(total=t.max_steps, initial=self.step, desc=cfg.run.name or self.run_dir.name,
                       dynamic_ncols=True, file=sys.stderr)
        try:
            last = self._fit(bar)
        except BaseException:  # a fault (non-finite, checkpoint, disk): the loggers' files and W&B are
            with contextlib.suppress(Exception):  # closed too; the fault is what gets reported
                self.log.close(failed=True)
            raise
        finally:
            if bar is not None:
                bar.close()
        self.log.close()
        if self.lock is not None:
            self.lock.release()
        return last

    def _fit(self, bar) -> dict:
        cfg, t = self.cfg, self.cfg.train
        acc, last = self.acc, {}
        if self.rank == 0 and self.step < t.max_steps and (self.run_dir / "DONE").exists():
            (self.run_dir / "DONE").unlink()  # a finished run continued to a longer schedule is not done
        if self.step == 0:  # the starting point of every eval curve
            self.log.write({**self.evaluate(), **self._seen()}, 0)
        t_log, steps_since = time.perf_counter(), 0
        end = min(t.max_steps, t.stop_at) if t.stop_at else t.max_steps
        while self.step < end:
            self.train_step(acc)
            steps_since += 1
            done = self.step == end
            # Log and evaluate on the schedule alone (not at stop_at): a stopped-and-resumed run
            # logs the same points, from the same sums, as an uninterrupted one.
            row = {}  # everything logged at this step: one JSONL line
            if self.step % t.log_every == 0 or self.step == t.max_steps:
                vals = acc.read()  # all-reduce + host sync
                dt = time.perf_counter() - t_log
                self.elapsed_s += dt
                tokens_per_s = self.tokens_per_step * steps_since / dt
                vals.update({"train/lr": self.sched.get_last_lr()[0],
                             "train/grad_norm": eng.global_grad_norm(self.engine),
                             "train/tokens": self.tokens, **self._seen(),
                             "train/skipped_steps": self.engine.skipped_steps,
                             "perf/step_time_s": dt / steps_since, "perf/tokens_per_s": tokens_per_s,
                             "perf/flops_per_token": self.flops["forward_flops_per_token"],
                             **efficiency(tokens_per_s, self.flops["forward_flops_per_token"], self.world,
                                          self.peak_tflops),
                             "perf/memory_gb": self._peak_memory_gb(), "perf/elapsed_s": self.elapsed_s})
                row.update(vals)
                if bar is not None:
                    bar.set_postfix(loss=f"{vals['train/loss']:.3f}", tok_s=f"{vals['perf/tokens_per_s']:.0f}",
                                    mfu=f"{vals['perf/mfu']:.1%}")
                elif self.rank == 0:
                    print(console.progress_line(self.step, t.max_steps, vals), flush=True)
                t_log, steps_since = time.perf_counter(), 0
            if (t.eval_every and self.step % t.eval_every == 0) or self.step == t.max_steps:
                t0 = time.perf_counter()
                ev = self.evaluate()
                row.update({**ev, **self._seen()})
                t_log += time.perf_counter() - t0  # eval time is not training time (steps before it still count)
                if self.rank == 0:
                    line = f"step {self.step}/{t.max_steps} | " + " | ".join(f"{k} {v:.4f}" for k, v in ev.items())
                    if bar is not None:
                        bar.write(line)  # above the bar (which has no room for eval losses)
                    else:
                        print(line, flush=True)
            self.log.write(row, self.step)
            last.update(row)
            if (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0) or done:
                t0 = time.perf_counter()
                self.save(pending_s=t0 - t_log)
                t_log += time.perf_counter() - t0  # nor is saving
            if bar is not None:
                bar.update(1)
        if cfg.log.routing_dump and self.step == t.max_steps:
            self.dump_routing()  # every rank: expert-parallel layers need all ranks in the forward
        if self.rank == 0 and self.step == t.max_steps:
            (self.run_dir / "DONE").write_text(json.dumps(last))
            ev = f", eval loss {last['eval/loss']:.4f}" if "eval/loss" in last else ""
            print(f"finished at step {self.step}{ev}; TensorBoard: {self.run_dir / 'tb'}, "
                  f"metrics: {self.run_dir / 'metrics.jsonl'}", flush=True)
        return last


def main(argv=None) -> int:
    from mode.errors import guarded

    return guarded(_main, list(sys.argv[1:] if argv is None else argv),
                   broken_pipe="error: stopped: the reader of this run's output went away (a closed pipe, e.g. "
                               "`| head`); its last checkpoint resumes it; send its output to a file instead")


def _main(argv) -> int:
    from mode.errors import OneLineParser, Once  # bad options: one line, exit 2

    p = OneLineParser(prog="mode train", description="Train a model from a YAML config.")
    p.add_argument("--config", required=True, action=Once)
    p.add_argument("--print-config", action="store_true", help="check the config and the data as a start would "
                   "(without preparing the data or writing anything), print it, exit")
    p.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    p.add_argument("overrides", nargs="*", help="dotted.key=value")
    a = p.parse_intermixed_args(argv)  # overrides may come before or after the options, as in `mode compare`

    from mode.lifeline import die_with_launcher

    die_with_launcher()  # a rank never outlives its launcher
    try:
        cfg = load_config(a.config, a.overrides)
        asked_fresh = cfg.run.fresh  # (the command to continue must turn it off even where a requeue did)
        if requeued_fresh_start(cfg):
            cfg.run.fresh = False
            if int(os.environ.get("RANK", 0)) == 0:
                print(f"SLURM requeued job {os.environ['SLURM_JOB_ID']}, which started {cfg.run.dir} with "
                      "run.fresh=true: resuming it instead of deleting what it trained", flush=True)
        world = int(os.environ.get("WORLD_SIZE", 1))
        cfg.validate(world)
        preflight(cfg, prepare_data=not a.print_config)
        msg = finished(cfg, world)
        if msg is None:  # a finished run is "nothing to do" at any world size
            check_world(cfg, world)  # (before --print-config too: it accepts only what a start accepts)
        if a.print_config:
            print(dump_config(cfg), end="")
            return 0
        if msg:
            if int(os.environ.get("RANK", 0)) == 0:
                print(msg, flush=True)
            return 0
        trainer = Trainer(cfg)
        trainer.fit()
        end = cfg.train.max_steps
        if trainer.rank == 0 and trainer.step < end:
            again = console.continue_command(a.config, a.overrides, asked_fresh)
            print(f"stopped at step {trainer.step} of {end} (train.stop_at={cfg.train.stop_at}); the run resumes "
                  f"from its checkpoint with: {again}", flush=True)
        # Left to interpreter exit, gloo's threads abort the process now and then (SIGABRT after a
        # finished run). Only on success: a rank that failed may leave others inside a collective.
        if dist.is_initialized():
            dist.destroy_process_group()
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    code = main()
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        # A rank of a launch, its files closed and its lock released by now. Interpreter teardown
        # destroys DeepSpeed's and gloo's C++ objects while their threads may still run, which aborts a
        # finished rank now and then ("terminate called without an active exception": SIGABRT, the
        # launcher's exit 250): 2 in 10 two-rank ep_size=2 runs with the group destroyed, 0 in 8 with this.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)

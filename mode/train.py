"""Training: a thin loop over the DeepSpeed engine; evaluation, checkpoints and logging are small
pieces it calls.

Launch as `mode train --config F`, `deepspeed --num_gpus N --module mode.train --config F`, or
`torchrun --nproc_per_node N -m mode.train --config F`.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch
import yaml

from mode import engine as eng  # sets DS_ACCELERATOR=cpu before deepspeed loads
from mode import checkpoint as ckpt
from mode.config import Config, ConfigError, dump_config, load_config
from mode.data import DataModule, build_tokenizer
from mode.flops import count as count_flops
from mode.metrics import Accumulator, TBWriter
from mode.model import build_model
from mode.plan import routes_at_sampling

# Keys that may change between a run and its resumption; anything else is a different experiment.
RESUMABLE_KEYS = ("train.max_steps", "train.stop_at", "train.eval_every", "train.eval_batches", "train.log_every",
                  "train.nonfinite", "train.max_consecutive_nonfinite", "checkpoint.", "log.", "run.",
                  "model.moe.ep_size", "model.moe.backend")


class NonFiniteError(RuntimeError):
    pass


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def config_diff(old: dict, new: dict) -> list[str]:
    a, b = _flatten(old), _flatten(new)
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and not k.startswith(RESUMABLE_KEYS)]


def check_run_dir(cfg: Config) -> dict | None:
    """Refuse a run directory written by an incompatible config (before any worker starts).
    Returns the saved config dict when resuming."""
    saved = Path(cfg.run.dir) / "config.yaml"
    if cfg.run.fresh or not saved.exists():
        return None
    old = yaml.safe_load(saved.read_text())
    diff = config_diff(old, cfg.to_dict())
    if diff:
        raise ConfigError("run.dir", msg=f"run.dir={cfg.run.dir!r} holds a run with a different config "
                          f"({'; '.join(diff)}); pass run.fresh=true to start over or use another run.dir")
    return old


def check_vocab(cfg: Config) -> None:
    tok = build_tokenizer(cfg.data)
    if cfg.model.vocab_size < tok.vocab_size:
        raise ConfigError("model.vocab_size", cfg.model.vocab_size, f">= the tokenizer's vocabulary {tok.vocab_size}")


def preflight(cfg: Config) -> dict | None:
    """Everything that can be checked before processes start."""
    check_vocab(cfg)
    return check_run_dir(cfg)


class Trainer:
    def __init__(self, cfg: Config):
        self.rank, self.world = eng.init_distributed()
        cfg.validate(self.world)
        self.cfg, self.dev = cfg, eng.device()
        self.run_dir = Path(cfg.run.dir)
        saved = preflight(cfg)  # every rank reads the saved config before rank 0 replaces it
        self._barrier()
        if self.rank == 0:
            if cfg.run.fresh and self.run_dir.exists():
                shutil.rmtree(self.run_dir)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(dump_config(cfg))
        self._barrier()
        self.ckpt_dir = self.run_dir / "checkpoints"

        torch.manual_seed(cfg.train.seed)  # identical init on every rank
        self.data = DataModule(cfg.data, self.rank, self.world)
        self.model = build_model(cfg.model).to(self.dev)
        self.engine, self.opt, self.sched = eng.build_engine(cfg, self.model, self.world)
        torch.manual_seed(cfg.train.seed * 7919 + self.rank)  # training randomness differs per rank
        self.tokens_per_step = cfg.train.micro_batch_size * cfg.train.grad_accum * self.world * cfg.data.seq_len
        self.flops = count_flops(cfg)
        self.step, self.tokens, self.elapsed_s, self.consecutive_bad = 0, 0, 0.0, 0
        self.prev_cfg = saved
        self._resume()
        self.tb = TBWriter(self.run_dir / "tb", self.rank == 0)
        if self.rank == 0:
            info = {"name": cfg.run.name or self.run_dir.name, "seed": cfg.train.seed,
                    "params": sum(p.numel() for p in self.model.parameters()),
                    "forward_flops_per_token": self.flops["forward_flops_per_token"],
                    "world_size": self.world, "tokens_per_step": self.tokens_per_step}
            (self.run_dir / "run_info.json").write_text(json.dumps(info, indent=1))

    def _barrier(self):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()

    def _resume(self) -> None:
        last = ckpt.latest(self.ckpt_dir)
        if last is None:
            return
        old_ep = (self.prev_cfg or {}).get("model", {}).get("moe", {}).get("ep_size", self.cfg.model.moe.ep_size)
        same_layout = old_ep == self.cfg.model.moe.ep_size
        if not same_layout:
            warnings.warn(f"resuming {last} at model.moe.ep_size={self.cfg.model.moe.ep_size} (saved at {old_ep}): "
                          "weights are loaded, the optimizer and LR schedule restart")
        client = ckpt.load(self.engine, last, self.rank, load_optimizer=same_layout)
        self.step, self.tokens = client["step"], client["tokens"]
        self.elapsed_s = client.get("elapsed_s", 0.0)
        if self.rank == 0:
            print(f"resumed from {last} at step {self.step}", file=sys.stderr)

    def save(self) -> None:
        state = {"step": self.step, "tokens": self.tokens, "elapsed_s": self.elapsed_s, "world_size": self.world}
        ckpt.save(self.engine, self.ckpt_dir, self.step, state, self.rank, self.cfg.checkpoint.keep)

    def train_step(self, acc: Accumulator) -> None:
        t = self.cfg.train
        skipped_before = self.engine.skipped_steps
        for micro in range(t.grad_accum):
            x, y = (b.to(self.dev) for b in self.data.train_batch(self.step, micro, t.micro_batch_size, t.grad_accum))
            out = self.engine(x, y)
            loss = out.loss + out.aux_loss
            self.engine.backward(loss)
            self.engine.step()
            acc.add({"train/loss": out.loss, "train/aux_loss": out.aux_loss, **out.metrics})
        self.step += 1
        self.tokens += self.tokens_per_step
        self._check_nonfinite(self.engine.skipped_steps > skipped_before)

    def _check_nonfinite(self, skipped: bool) -> None:
        self.consecutive_bad = self.consecutive_bad + 1 if skipped else 0
        t = self.cfg.train
        if skipped and (t.nonfinite == "stop" or self.consecutive_bad >= t.max_consecutive_nonfinite):
            bad = getattr(self.opt, "bad_params", None) or ["(ZeRO: per-parameter detail not available)"]
            stats = "; ".join(f"{n}: |w|={p.detach().float().norm():.3g}"
                              for n, p in self.model.named_parameters() if n.endswith("weight") and p.dim() >= 2)
            raise NonFiniteError(f"non-finite loss or gradient at step {self.step} "
                                 f"({self.consecutive_bad} in a row, policy {t.nonfinite}); non-finite grads in: "
                                 f"{', '.join(bad[:8])}; weight norms: {stats}")

    @torch.no_grad()
    def evaluate(self) -> dict:
        with torch.random.fork_rng(devices=[]):  # evaluation must not shift training randomness
            return self._evaluate()

    def _evaluate(self) -> dict:
        model = self.engine.module
        model.eval()
        acc = Accumulator()
        routings = ("topk", "causal") if routes_at_sampling(model.plan) else ("topk",)
        for x, y in self.data.val_batches(self.cfg.train.eval_batches, self.cfg.train.micro_batch_size):
            x, y = x.to(self.dev), y.to(self.dev)
            for r in routings:
                out = model(x, y, routing=r)
                acc.add({"eval/loss" if r == "topk" else "eval/loss_causal": out.loss})
        model.train()
        return acc.read()

    def dump_routing(self) -> None:
        with torch.random.fork_rng(devices=[]):
            self._dump_routing()

    def _dump_routing(self) -> None:
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
        torch.save({"input_ids": x.cpu(), "engaged": engaged.cpu(), "entropy": entropy.cpu(),
                    "text": [self.data.tokenizer.decode(r.tolist()) for r in x]}, self.run_dir / "routing.pt")

    def fit(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        acc, last = Accumulator(), {}
        bar = None
        if self.rank == 0 and cfg.log.progress:
            from tqdm import tqdm

            bar = tqdm(total=t.max_steps, initial=self.step, desc=cfg.run.name or self.run_dir.name,
                       dynamic_ncols=True, file=sys.stderr)
        if self.step == 0:  # the starting point of every eval curve
            self.tb.write(self.evaluate(), 0)
        t_log, steps_since = time.perf_counter(), 0
        end = min(t.max_steps, t.stop_at) if t.stop_at else t.max_steps
        while self.step < end:
            self.train_step(acc)
            steps_since += 1
            done = self.step == end
            if self.step % t.log_every == 0 or done:
                vals = acc.read()  # all-reduce + host sync
                dt = time.perf_counter() - t_log
                self.elapsed_s += dt
                vals.update({"train/lr": self.sched.get_last_lr()[0],
                             "train/grad_norm": float(self.engine.get_global_grad_norm() or 0.0),
                             "train/tokens": self.tokens, "train/skipped_steps": self.engine.skipped_steps,
                             "perf/step_time_s": dt / steps_since,
                             "perf/tokens_per_s": self.tokens_per_step * steps_since / dt,
                             "perf/flops_per_token": self.flops["forward_flops_per_token"],
                             "perf/elapsed_s": self.elapsed_s})
                self.tb.write(vals, self.step)
                last.update(vals)
                if bar is not None:
                    bar.set_postfix(loss=f"{vals['train/loss']:.3f}", tok_s=f"{vals['perf/tokens_per_s']:.0f}")
                t_log, steps_since = time.perf_counter(), 0
            if (t.eval_every and self.step % t.eval_every == 0) or done:
                ev = self.evaluate()
                self.tb.write(ev, self.step)
                last.update(ev)
                t_log = time.perf_counter()  # eval time is not training time
            if (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0) or done:
                self.save()
                t_log = time.perf_counter()
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        if cfg.log.routing_dump and self.step == t.max_steps:
            self.dump_routing()  # every rank: expert-parallel layers need all ranks in the forward
        if self.rank == 0 and self.step == t.max_steps:
            (self.run_dir / "DONE").write_text(json.dumps(last))
            print(f"TensorBoard logs: {self.run_dir / 'tb'}", file=sys.stderr)
        self.tb.close()
        return last


def train(cfg: Config) -> dict:
    return Trainer(cfg).fit()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="mode train", description="Train a model from a YAML config.")
    p.add_argument("--config", required=True)
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    p.add_argument("overrides", nargs="*", help="dotted.key=value")
    a = p.parse_args(argv)
    try:
        cfg = load_config(a.config, a.overrides)
        if a.print_config:
            print(dump_config(cfg), end="")
            return 0
        import os

        cfg.validate(int(os.environ.get("WORLD_SIZE", 1)))
        preflight(cfg)
        train(cfg)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())

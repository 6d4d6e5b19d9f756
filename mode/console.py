"""What a run prints on rank 0: a start block (config summary, parameters, FLOPs, world layout),
progress (a tqdm bar on a terminal, else one plain line per log interval, which is what a
cluster job's log file wants) and how it ended."""
from __future__ import annotations

import os
import shlex
import sys

from mode.config import Config
from mode.plan import layer_plan


def si(x: float) -> str:
    """1.23M, 4.5G: a count or rate with an SI prefix (the console's and the report's)."""
    for div, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}"


def active_params(cfg: Config, total: int) -> int:
    """Parameters one token can use: an MoE layer contributes top_k of its E experts (at most)."""
    from mode.mlp import MLP

    moe = cfg.model.moe
    n_moe = sum(p.mlp == "moe" for p in layer_plan(cfg.model))
    per_expert = MLP.cost(cfg.model.d_model, moe.d_expert or cfg.model.d_ff, cfg.model.mlp).params
    return total - n_moe * max(0, moe.num_experts - moe.top_k) * per_expert


def _route(name: str, r) -> str:
    return f"{name} {r.capacity:g}" + (" K/V from all" if r.kv == "all" else "")


def routing_summary(cfg: Config) -> str:
    """Which layers route what, from the layer plan (per-layer and per-sublayer capacities included)."""
    m, plan = cfg.model, layer_plan(cfg.model)
    depth = [f"{p.index}: " + " / ".join(_route(n, r) for n, r in (("block", p.block), ("attn", p.attn),
                                                                  ("mlp", p.mlp_route)) if r is not None)
             for p in plan if p.depth_routed]
    moe = [p.index for p in plan if p.mlp == "moe"]
    parts = []
    if depth:
        routing = "stochastic top-k: the random control; " if m.mod.routing == "stochastic" else ""
        parts.append(f"MoD capacity by layer {{{', '.join(depth)}}} ({routing}{m.mod.causal} causal)")
    if moe:
        parts.append(f"MoE layers {moe}: {m.moe.num_experts} experts"
                     + (f" + {m.moe.num_noop_experts} no-op" if m.moe.num_noop_experts else "")
                     + f", top-{m.moe.top_k}, capacity factor {m.moe.capacity_factor}, backend {m.moe.backend}")
    return "; ".join(parts) or "dense"


def start_block(cfg: Config, params: int, flops: dict, world: int, device, peak: tuple[float, str],
                resumed_step: int) -> str:
    m, t, d = cfg.model, cfg.train, cfg.data
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or world)  # torchrun / deepspeed
    nodes = max(1, world // local)
    gbatch = t.micro_batch_size * t.grad_accum * world
    lines = [
        f"run {cfg.run.name or cfg.run.dir} in {cfg.run.dir}"
        + (f" (resuming at step {resumed_step})" if resumed_step else ""),
        f"model    d_model {m.d_model}, {m.n_layers} layers, {m.n_heads} heads, d_ff {m.d_ff}, vocab {m.vocab_size}; "
        + routing_summary(cfg),
        f"params   {params:,} total, {active_params(cfg, params):,} active per token",
        f"FLOPs    {si(flops['forward_flops_per_token'])} forward per token (training: 3x), "
        f"peak {peak[0]:.4g} TFLOP/s per device ({peak[1]})",
        f"data     {d.source}, tokenizer {d.tokenizer}, seq_len {d.seq_len}",
        f"batch    {t.micro_batch_size} x {t.grad_accum} accum x {world} ranks = {gbatch} sequences "
        f"= {gbatch * d.seq_len:,} tokens per step; {t.max_steps} steps"
        + (f" (stop_at {t.stop_at})" if t.stop_at else "")
        + f"; lr {cfg.optim.lr} warmup {cfg.optim.warmup_steps} cosine to x{cfg.optim.min_lr_ratio}",
        f"world    {world} rank(s) on {nodes} node(s) ({local} per node), device {device.type}, "
        f"{cfg.deepspeed.precision}, "
        f"ZeRO {cfg.deepspeed.zero_stage}, ep_size {m.moe.ep_size}, activation checkpointing "
        f"{t.activation_checkpointing}",
    ]
    return "\n".join(lines)


def schedule_warning(cfg: Config) -> str | None:
    """A warmup as long as the run (smoke runs use one): mode.engine.lr_lambda then gives step i
    (0-based) the LR lr * (i + 1) / warmup_steps to the end, so the LR peaks at the last step below
    (or, with warmup_steps == max_steps, just at) optim.lr and never decays: said once at the start."""
    o, n = cfg.optim, cfg.train.max_steps
    if o.warmup_steps < n:
        return None
    head = f"warning: optim.warmup_steps={o.warmup_steps} >= train.max_steps={n}: the learning rate "
    if o.warmup_steps == n:
        return head + f"reaches optim.lr={o.lr} only at the last step (no cosine decay)"
    return (head + f"rises to {o.lr * n / o.warmup_steps:.3g} at the last step and never reaches "
            f"optim.lr={o.lr} (no cosine decay)")


def eval_repeat_warning(cfg: Config, n_val: int, world: int) -> str | None:
    """An evaluation larger than the validation split reads its windows again (val_rows wraps):
    the loss is still their mean, but the evaluation costs more than it measures. Said once."""
    t = cfg.train
    rows = t.eval_batches * t.micro_batch_size * world
    if t.eval_every <= 0 or rows <= n_val:
        return None
    return (f"warning: an evaluation reads {rows} windows (train.eval_batches={t.eval_batches} x "
            f"train.micro_batch_size={t.micro_batch_size} x {world} rank(s)) but the validation split holds {n_val} of "
            f"data.seq_len={cfg.data.seq_len}: each is evaluated about {rows / n_val:.3g} times; a smaller "
            "train.eval_batches (or more validation text) evaluates each once")


def bf16_sum_warning(cfg: Config, world: int) -> str | None:
    """bf16 at ZeRO 0 with gradients summed over micro-steps or ranks: DeepSpeed sums them in bf16
    there (it refuses fp32 accumulation at stage 0; measured 3.1e-3 relative error at grad_accum 4
    against 2e-9 at ZeRO 1) and its optimizer wrapper reads the device once per gradient tensor."""
    ds, accum = cfg.deepspeed, cfg.train.grad_accum
    if ds.precision != "bf16" or ds.zero_stage > 0 or (accum == 1 and world == 1):
        return None
    return (f"warning: deepspeed.precision=bf16 at deepspeed.zero_stage=0 sums the gradients of "
            f"train.grad_accum={accum} micro-steps x {world} rank(s) in bf16 (DeepSpeed allows fp32 sums only "
            "at ZeRO 1/2) and reads the device once per gradient tensor: deepspeed.zero_stage=1 does neither")


def progress_line(step: int, max_steps: int, vals: dict) -> str:
    """One plain line per log interval."""
    parts = [f"step {step}/{max_steps}", f"loss {vals['train/loss']:.4f}", f"lr {vals['train/lr']:.3g}",
             f"{vals['perf/tokens_per_s']:.0f} tok/s", f"{vals['perf/tflops_per_device']:.3g} TFLOP/s/dev",
             f"MFU {vals['perf/mfu']:.1%}", f"mem {vals['perf/memory_gb']:.2f} GB",
             f"elapsed {vals['perf/elapsed_s']:.0f}s"]
    return " | ".join(parts)


def use_bar(progress: bool) -> bool:
    """The bar is drawn on stderr and replaces the plain lines on stdout: only when both are a
    terminal (either one redirected to a file would get redraws or nothing)."""
    return progress and sys.stdout.isatty() and sys.stderr.isatty()


def continue_command(config: str, overrides: list[str], fresh: bool = False) -> str:
    """The command that continues a run stopped by train.stop_at: the same with train.stop_at=0 (the
    stop may come from the YAML file, where dropping an override would not turn it off) and
    without run.fresh (which would delete what this start trained; `fresh`: the resolved config
    has it, maybe from the YAML file, so run.fresh=false is added). Under `mode compare`: the
    compare command that continues the grid (MODE_CONTINUE_COMMAND, set by compare)."""
    if os.environ.get("MODE_CONTINUE_COMMAND"):
        return os.environ["MODE_CONTINUE_COMMAND"]
    rest = [o for o in overrides if not o.startswith(("train.stop_at=", "run.fresh="))] + ["train.stop_at=0"]
    if fresh:  # maybe from the config file too: an override turns it off whatever set it
        rest.append("run.fresh=false")
    cmd = shlex.join(["mode", "train", "--config", config, *rest])
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:  # a single-process `mode train` would be refused: the checkpoint belongs to this world size
        return (f"the same {world}-process launch command with train.stop_at=0 and without run.fresh (a checkpoint "
                "resumes only at the world size it was saved with), whose trainer arguments are: "
                f"{shlex.join(['--config', config, *rest])}")
    return cmd

"""The one place that knows about distribution: process group, ds_config, the DeepSpeed engine.

Model code is single-device; everything parallel (data parallel, ZeRO, expert parallel groups,
gradient all-reduce) is applied here by DeepSpeed.
"""
from __future__ import annotations

import functools
import math
import os
import socket
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mode.checkpoint import CheckpointError
from mode.config import Config, ConfigError
from mode.moe.deepspeed import use_cpu_accelerator_without_cuda


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> tuple[int, int]:
    """Join the process group started by `deepspeed`/`torchrun`, or form a world of one."""
    use_cpu_accelerator_without_cuda()
    import deepspeed
    import torch.distributed as dist

    if "RANK" not in os.environ:  # plain `mode train`: a single process
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo",
                                   verbose=False)
        unlink_shm_buffer(dist)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return dist.get_rank(), dist.get_world_size()


def shm_buffer(rank: int) -> Path:
    """The shared-memory segment DeepSpeed's CPU communication op (csrc/cpu/comm/shm.cpp) creates
    for `rank` when all ranks are on one node: 66 MB of RAM in /dev/shm, never unlinked by DeepSpeed."""
    env = os.environ
    return Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{env.get('MASTER_ADDR', '')}_"
                f"{env.get('MASTER_PORT', '')}_{rank}")


def unlink_shm_buffer(dist) -> None:
    """Remove this rank's name of its segment once every rank has mapped every other's (the
    barrier: each rank maps its peers before its init returns). The mappings stay valid and the
    kernel frees the memory when the last rank exits, however it exits; left named, every
    multi-rank CPU run would leave 66 MB per rank in RAM for good."""
    if dist.get_world_size() > 1:
        dist.barrier()
    shm_buffer(dist.get_rank()).unlink(missing_ok=True)


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def ds_config(cfg: Config, world_size: int) -> dict:
    t, ds = cfg.train, cfg.deepspeed
    out = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.micro_batch_size * t.grad_accum * world_size,
        # ZeRO 1/2 clip and skip non-finite steps themselves; at stage 0 GuardedAdamW does both.
        "gradient_clipping": cfg.optim.grad_clip if ds.zero_stage > 0 else 0.0,
        "zero_optimization": {"stage": ds.zero_stage},
        "bf16": {"enabled": ds.precision == "bf16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    if ds.precision == "bf16" and ds.zero_stage > 0:
        # Sum the micro-steps' bf16 gradients in fp32 (as Megatron does), not in bf16: ZeRO 1 then runs
        # DeepSpeed's BF16_Optimizer, ZeRO 2 its ZeRO optimizer with an fp32 partition buffer. And reduce
        # them across ranks in fp32: in bf16 the reduction rounds the fp32 sum back to bf16 (with one
        # rank too) and undid most of the gain (2 ranks, grad_accum 4: 2.3e-3 relative error against
        # an exact sum, 2.8e-3 with bf16 accumulation, 2e-9 with both in fp32). Costs twice the
        # all-reduce bytes. ZeRO 0 cannot: DeepSpeed refuses bf16 with fp32 accumulation there.
        out["data_types"] = {"grad_accum_dtype": "fp32"}
        out["communication_data_type"] = "fp32"
    return out


def lr_lambda(cfg: Config):
    o, total = cfg.optim, cfg.train.max_steps

    def f(step: int) -> float:
        if step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        p = min(1.0, (step - o.warmup_steps) / max(1, total - o.warmup_steps))
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))

    return f


class GuardedAdamW(torch.optim.AdamW):
    """AdamW that computes the global gradient norm, clips, and refuses non-finite steps.

    Used at ZeRO stage 0 (ZeRO 1/2 do the same inside DeepSpeed). DeepSpeed's engine reads
    `overflow` (skip: no update, scheduler not stepped, engine.skipped_steps += 1) and
    `_global_grad_norm`. Expert-parallel expert params (DeepSpeed MoE, `ep_size` ranks share one
    set of experts) differ per rank, so their squared norm is summed across ranks: one all-reduce
    of one number per step, and none without such params.

    Expert params are known by their group's `moe` flag (`moe_param_groups`), and names by position
    in the group: with bf16 at stage 0 DeepSpeed wraps this optimizer (FP16_UnfusedOptimizer) and
    swaps each group's params for fp32 copies, in order, which lose per-parameter marks. Read by the
    parameter's own mark, every param looked shared there: each rank clipped by a norm of its own
    experts only, and the replicated weights drifted apart across ranks.
    """

    def __init__(self, params, *, clip: float, names: dict, ep_size: int = 1, **kw):
        super().__init__(params, **kw)
        self.clip, self.ep_size = clip, ep_size
        # the params the wrapper keeps (and copies) are the trainable, non-empty ones, in order
        self.names = [[names.get(p, "?") for p in g["params"] if p.requires_grad and p.numel() > 0]
                      for g in self.param_groups]
        self.overflow = False
        self._global_grad_norm = 0.0
        self.bad_params: list[str] = []

    @torch.no_grad()
    def step(self, closure=None):
        import torch.distributed as dist

        named = [(p, n, bool(g.get("moe"))) for g, ns in zip(self.param_groups, self.names)
                 for p, n in zip(g["params"], ns) if p.grad is not None]
        ps = [p for p, _, _ in named]
        expert = [p for p, _, moe in named if moe]
        zero = torch.zeros((), dtype=torch.float64, device=ps[0].device if ps else None)
        world = dist.get_world_size() if dist.is_initialized() else 1

        def global_norm(dtype: torch.dtype) -> float:
            expert_sq = _sq_norm(expert, zero, dtype)
            if expert and world > 1:  # every rank holds expert params or none: all take this branch or none
                dist.all_reduce(expert_sq)
                expert_sq = expert_sq / (world // max(1, self.ep_size))  # each expert has world/ep replicas
            return (_sq_norm([p for p, _, moe in named if not moe], zero, dtype) + expert_sq).sqrt().item()

        self._global_grad_norm = global_norm(torch.float32)  # host sync: once per optimizer step
        if not math.isfinite(self._global_grad_norm):  # a tensor's fp32 sum of squares overflows past a
            self._global_grad_norm = global_norm(torch.float64)  # norm of ~1.8e19: the exact sum decides
        self.overflow = not math.isfinite(self._global_grad_norm)
        if self.overflow:
            self.bad_params = [n for p, n, _ in named if not torch.isfinite(p.grad).all()]
            for p in ps:
                p.grad = None
            return None
        if self.clip > 0 and self._global_grad_norm > self.clip:
            torch._foreach_mul_([p.grad for p in ps], self.clip / (self._global_grad_norm + 1e-6))
        return super().step(closure)


def global_grad_norm(engine) -> float:
    """The norm this step was clipped by. At stage 0 that is GuardedAdamW's, also when DeepSpeed
    wraps it for bf16 (the wrapper's own norm leaves the expert params out)."""
    opt = engine.optimizer
    guard = opt if isinstance(opt, GuardedAdamW) else getattr(opt, "optimizer", None)
    if isinstance(guard, GuardedAdamW) and not getattr(opt, "overflow", False):
        return guard._global_grad_norm
    return float(engine.get_global_grad_norm() or 0.0)


def threshold_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The depth routers' calibrated-threshold state (value and update count), in module order."""
    return [b for m in model.modules() if getattr(m, "has_threshold", False) for b in (m.threshold, m.threshold_updates)]


def average_thresholds(model: torch.nn.Module) -> None:
    """Data parallelism for the depth routers' calibrated threshold (`model.mod.causal=threshold`):
    each rank steps its EMA on its own batches, and here, once per optimizer step, the copies are
    averaged. The EMA step and its first-step case are affine in the k-th score with weights that
    every rank shares, so the average equals one EMA of the rank-averaged k-th scores at every
    micro-step: every rank holds the same threshold (the checkpoint holds rank 0's). One all-reduce
    per step, none without thresholds or a second rank."""
    import torch.distributed as dist

    bufs = [m.threshold for m in model.modules() if getattr(m, "has_threshold", False)]
    if not bufs or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    flat = torch.stack(bufs)
    dist.all_reduce(flat)
    torch._foreach_copy_(bufs, list(flat.div_(dist.get_world_size()).unbind()))


def _sq_norm(params: list, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Sum of squared gradient entries: a few foreach kernels for all tensors (launches are what a
    small step on a GPU waits on), not three per tensor; each tensor's norm accumulated in `dtype`,
    their squares summed in float64. fp32 reads each gradient once; float64 casts each to a float64
    copy first (on the CPU 17x slower: 17.6 vs 1.0 ms over 6M entries, more than the AdamW update
    itself) but cannot overflow: in fp32 a tensor's sum of squares does once its norm passes ~1.8e19,
    and a step whose gradients are all finite was skipped as non-finite (grad_clip 0 included)."""
    if not params:
        return zero
    return torch.stack(torch._foreach_norm([p.grad for p in params], 2, dtype=dtype)).double().pow(2).sum()


def fused_adamw(model: torch.nn.Module) -> bool:
    """torch's fused AdamW kernel (one pass over each tensor) where it exists: CUDA and CPU. The
    same update up to rounding; on the 2-core CPU 4.5-5.1x faster than torch's default per-tensor
    loop for a 17M-parameter model (benchmarks/RESULTS.md, "Optimizer step"); on GPUs it is one
    launch per parameter group instead of several per tensor."""
    return next(model.parameters()).device.type in ("cuda", "cpu")


MODULE_ORDER = "module"  # param_groups' order for checkpoints written before their param_order.json
ALIGN_ELEMS = 8  # 16 bytes of bf16 (and of fp32): the alignment inductor's GPU kernels assume of their inputs


def param_groups(model: torch.nn.Module, weight_decay: float, order: dict | str | None = None) -> list[dict]:
    """Decay matrices; not norms, biases, embeddings or routers (scalars per token). The causal
    predictors are not here: PredictorAdamW trains them.

    The order within a group is the checkpoint's layout: at ZeRO 1/2 DeepSpeed flattens each group into
    one buffer, every parameter a view at its cumulative offset, and saves its optimizer state flat; at
    ZeRO 0 the optimizers save theirs by index. New runs (order None) put parameters whose size
    is not a multiple of ALIGN_ELEMS last: one-element router biases in module order put every later view
    off 16-byte alignment, and compiled blocks at ZeRO 1/2 faulted on CUDA ('misaligned address', H200;
    benchmarks/RESULTS.md). `order` {group name: [parameter names]} rebuilds the order a checkpoint
    recorded (param_order.json); MODULE_ORDER, module order, is that of checkpoints written before it."""
    decay, no_decay = [], []
    own = {id(p) for p in predictor_params(model)}
    for n, p in model.named_parameters():
        if not p.requires_grad or id(p) in own:
            continue
        skip = p.dim() < 2 or "embed" in n or "router" in n
        (no_decay if skip else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    groups = [g for g in groups if g["params"]]
    if order is None:
        for g in groups:
            g["params"].sort(key=lambda p: p.numel() % ALIGN_ELEMS != 0)  # stable: module order otherwise
    elif order != MODULE_ORDER:
        by_name = dict(model.named_parameters())
        for g in groups:
            names, ids = order.get(g["name"], []), {id(p) for p in g["params"]}
            if sorted(names) != sorted(n for n, p in by_name.items() if id(p) in ids):
                raise CheckpointError(f"the checkpoint's parameter group {g['name']!r} (param_order.json) "
                                      "holds other parameters than this model's")
            g["params"] = [by_name[n] for n in names]
    return groups


def check_compile_alignment(cfg: Config, model: torch.nn.Module) -> None:
    """Compiled blocks assume 16-byte aligned parameters (inductor's GPU kernels); in DeepSpeed's flat
    buffers (ZeRO 1/2) a parameter is aligned only where param_groups' order puts it so. One line, on
    every device (the layout is the same on a CPU, where it does not fault), naming the first one."""
    if not cfg.train.compile:
        return
    in_blocks = {id(p) for p in model.blocks.parameters()}
    off = [n for n, p in model.named_parameters() if id(p) in in_blocks and p.numel() > 1 and p.data_ptr() % 16]
    if off:
        raise ConfigError("train.compile", msg=(
            f"train.compile=True: {len(off)} block parameters ({off[0]}, ...) sit off 16-byte alignment in "
            f"DeepSpeed's flat buffers at deepspeed.zero_stage={cfg.deepspeed.zero_stage}, and compiled blocks "
            "fault there on CUDA ('misaligned address'); a run resumed from a checkpoint written before "
            "param_order.json keeps that layout: train.compile=false"))


def param_order(model: torch.nn.Module, groups: list[dict]) -> dict[str, list[str]]:
    """{group name: [parameter names]} in the groups' order: the record param_groups rebuilds it from."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    return {g["name"]: [name_of[id(p)] for p in g["params"]] for g in groups}


def predictor_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The depth routers' causal predictors (model.mod.causal predictor/both), in module order."""
    from mode.routing.depth import DepthRouter

    return [p for m in model.modules() if isinstance(m, DepthRouter) and m.predictor is not None
            for p in m.predictor.parameters()]


class PredictorAdamW:
    """The causal predictors' own optimizer. Their loss reaches no LM parameter (stop-gradient), and
    here it does not reach the LM's update either: in the engine's optimizer their gradients counted
    in the global norm that optim.grad_clip divides every gradient by, so predictor_loss_weight and the
    causal mode changed how the LM trained (tiny MoD preset: LM weights 0.08 apart after 40 steps).
    They are clipped by their own norm with the same grad_clip and stepped with the LM's AdamW
    settings and current learning rate, without weight decay (as routers), on fp32 weights also under
    bf16 (their GEMMs run in the stream's dtype, mode/routing/depth.py). Data parallel: at ZeRO 0 the
    engine all-reduces every module gradient, these included; ZeRO 1/2 reduce only their own
    partitions, so here one all-reduce of the flattened predictor gradients averages them. Steps
    before the engine's step (which drops every module gradient) on its own finite gradients;
    non-finite ones are dropped, no update (fused AdamW's found_inf: the step reads nothing back to
    the host)."""

    def __init__(self, cfg: Config, model: torch.nn.Module):
        self.params = predictor_params(model)
        for p in self.params:
            p.data = p.data.float()  # DeepSpeed's bf16 cast all parameters; these stay out of its optimizer
        o = cfg.optim
        self.clip, self.reduce = o.grad_clip, cfg.deepspeed.zero_stage > 0
        self.opt = torch.optim.AdamW(self.params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=0.0,
                                     fused=fused_adamw(model))

    @torch.no_grad()
    def step(self, lr: float) -> None:
        import torch.distributed as dist

        ps = [p for p in self.params if p.grad is not None]
        if ps and self.reduce and dist.is_initialized() and dist.get_world_size() > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in ps])
            dist.all_reduce(flat)
            flat.div_(dist.get_world_size())
            torch._foreach_copy_([p.grad for p in ps], [g.view_as(p) for g, p in zip(
                flat.split([p.numel() for p in ps]), ps)])
        if ps:  # no host sync: clipped by a device-side factor, a non-finite step skipped in the kernel
            # (norm in float64: no host read to retry an fp32 overflow with; the predictors are small)
            norm = _sq_norm(ps, torch.zeros((), dtype=torch.float64, device=ps[0].device), torch.float64).sqrt()
            finite = torch.isfinite(norm)
            if self.clip > 0:
                torch._foreach_mul_([p.grad for p in ps], (self.clip / (norm + 1e-6)).clamp(max=1.0))
            for g in self.opt.param_groups:
                g["lr"] = lr
            if self.opt.defaults["fused"]:
                self.opt.found_inf = (~finite).float()  # what GradScaler hands a fused AdamW
                self.opt.step()
            elif finite.item():  # the loop implementation has no found_inf: one read
                self.opt.step()
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict:
        return self.opt.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state)


def native_bf16_gemms(dev: torch.device) -> bool:
    """True where bf16 GEMMs have fast kernels: GPUs, and CPUs oneDNN runs bf16 on (avx512_bf16 /
    AMX). Elsewhere (AVX2-only CPUs) torch falls back to a scalar bf16 GEMM: measured 28-96x slower
    than fp32 (benchmarks/RESULTS.md, "bf16 on CPU")."""
    return dev.type != "cpu" or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


# Ops whose bf16 CPU fallback is slow; everything else (elementwise, norms, softmax) stays bf16.
_GEMMS = {F.linear, torch.matmul, torch.Tensor.__matmul__, torch.Tensor.matmul, torch.mm, torch.Tensor.mm,
          torch.bmm, torch.Tensor.bmm, F.scaled_dot_product_attention}


class Fp32Gemms(TorchFunctionMode):
    """bf16 GEMMs computed in fp32 on CPUs without bf16 units: bf16 -> fp32 is exact and the
    result is rounded back to bf16, which is what a bf16 GEMM with fp32 accumulation (a GPU's)
    returns up to summation order. Autograd records the casts, so the backward GEMMs run in fp32
    too and the gradients reaching the bf16 parameters are bf16, as DeepSpeed's bf16 path expects."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _GEMMS and any(_is_bf16_cpu(a) for a in (*args, *kwargs.values())):
            up = lambda a: a.float() if _is_bf16_cpu(a) else a  # noqa: E731
            return func(*map(up, args), **{k: up(v) for k, v in kwargs.items()}).to(torch.bfloat16)
        return func(*args, **kwargs)


def _is_bf16_cpu(a) -> bool:
    return isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 and a.device.type == "cpu"


def fp32_gemms_on_cpu(model: torch.nn.Module) -> torch.nn.Module:
    """Run `model`'s forward (and so its backward) under Fp32Gemms. In place; returns the model."""
    fwd = model.forward

    @functools.wraps(fwd)
    def forward(*args, **kwargs):
        with Fp32Gemms():
            return fwd(*args, **kwargs)

    model.forward = forward
    return model


def compile_blocks(model: torch.nn.Module, backend: str = "inductor") -> torch.nn.Module:
    """torch.compile each block in place (as torchtitan does): one graph per block type and shape is
    reused by every layer of that type, compile time stays flat in depth, and the module keeps its
    class and state_dict keys (checkpoints are interchangeable with eager runs). Graph breaks are
    allowed here (dropless MoE and causal routing need sizes on the host); tests/test_compile.py
    proves there are none on the paths that claim none. Static shapes (dynamic=False): a block sees
    a few fixed sizes in training (S, and k inside depth routing), and dynamo's automatic dynamic
    shapes would recompile them all as symbolic, which the capacity arithmetic cannot trace.
    Evaluation runs eager (Trainer.evaluate): its ragged causal routing would recompile per batch."""
    for block in model.blocks:
        block.compile(dynamic=False, backend=backend)
    return model


def prepare_model(cfg: Config, model: torch.nn.Module, dev: torch.device) -> torch.nn.Module:
    """Speed settings that do not change what is computed: fp32 GEMMs for bf16 on CPUs without
    bf16 units, and per-block torch.compile (train.compile)."""
    if cfg.deepspeed.precision == "bf16" and not native_bf16_gemms(dev):
        fp32_gemms_on_cpu(model)
    if cfg.train.compile:
        compile_blocks(model)
    return model


def uses_deepspeed_moe(cfg: Config) -> bool:
    from mode.plan import has_moe, layer_plan

    return cfg.model.moe.backend == "deepspeed" and has_moe(layer_plan(cfg.model))


def build_engine(cfg: Config, model: torch.nn.Module, world_size: int, order: dict | str | None = None):
    """DeepSpeed engine around the model with AdamW and warmup + cosine (both checkpointed); `order`:
    param_groups' (the resumed checkpoint's)."""
    use_cpu_accelerator_without_cuda()
    import deepspeed

    groups = param_groups(model, cfg.optim.weight_decay, order)
    if uses_deepspeed_moe(cfg):
        from mode.moe.deepspeed import moe_param_groups

        groups = moe_param_groups(groups)  # expert params get their own (expert-data-parallel) groups
    o = cfg.optim
    adam = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=fused_adamw(model))
    if cfg.deepspeed.zero_stage == 0:
        opt = GuardedAdamW(groups, clip=o.grad_clip, names={p: n for n, p in model.named_parameters()},
                           ep_size=cfg.model.moe.ep_size if uses_deepspeed_moe(cfg) else 1, **adam)
    else:
        opt = torch.optim.AdamW(groups, **adam)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    engine, opt, _, sched = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                                 config=ds_config(cfg, world_size))
    undo_warm_up_step(opt)
    foreach_bf16_step(opt)
    run_backward_prologue(engine)
    if world_size == 1 and cfg.deepspeed.zero_stage == 0:
        # One process: DeepSpeed's all-reduce of the gradients flattens and copies each back
        # unchanged (47 ms of a bf16 step of a 60M-parameter model, profiled); nothing to reduce.
        engine.enable_backward_allreduce = False
    return engine, opt, sched


def undo_warm_up_step(opt) -> None:
    """bf16 at ZeRO 0: DeepSpeed's FP16_UnfusedOptimizer creates the AdamW state by stepping it once
    on zero gradients (initialize_optimizer_states). That step counted (Adam's bias correction then
    started at step 2: the first real update was 0.73 x lr, and bf16 trained measurably worse than
    fp32) and decayed the fp32 master weights away from the model's. Undone: no state (AdamW makes
    it at the first real step, as in fp32), masters copied back from the model's weights."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if isinstance(opt, FP16_UnfusedOptimizer):
        opt.optimizer.state.clear()
        opt.refresh_fp32_params()


def foreach_bf16_step(opt) -> None:
    """bf16 at ZeRO 0: DeepSpeed's FP16_UnfusedOptimizer steps tensor by tensor: an overflow check
    that reads every gradient back to the host (one sync per tensor on a GPU: 26-42 a step on the
    tiny routed presets), a norm per group, an unscale by 1.0 and a copy back per tensor. Here the
    same step runs as DeepSpeed's would with no loss scale and no clipping of its own (bf16; ZeRO 0
    leaves clipping to GuardedAdamW): fp32 gradients cast from the bf16 ones, GuardedAdamW (one
    global norm, one host read, the non-finite skip, fused AdamW), one foreach copy back to bf16. The
    weights, masters, AdamW state and skipped steps equal DeepSpeed's own step bit for bit
    (tests/test_bf16.py); a skipped step also names its non-finite parameters, as fp32's does."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if (isinstance(opt, FP16_UnfusedOptimizer) and isinstance(opt.optimizer, GuardedAdamW)
            and opt.low_precision_dtype == torch.bfloat16 and not opt.loss_scale_config.dynamic_loss_scale
            and opt.loss_scale_config.cur_scale == 1.0 and not opt.clip_grad and not opt.fused_lamb_legacy):
        opt.step = types.MethodType(_bf16_step, opt)


@torch.no_grad()
def _bf16_step(self, closure=None) -> bool:
    guard = self.optimizer
    lo = [p for g in self.fp16_groups for p in g]
    hi = [p for g in self.fp32_groups for p in g]
    for a, b in zip(lo, hi):  # a parameter without a gradient steps on zeros, as in DeepSpeed's step
        b.grad = torch.zeros_like(b) if a.grad is None else a.grad.to(b.dtype)
    guard.step()
    self.overflow, self.bad_params = guard.overflow, guard.bad_params
    self._update_scale(self.overflow)  # (static scale: counts the iteration, as DeepSpeed's step does)
    if self.overflow:
        self._global_grad_norm = float("inf")
        self.zero_grad(set_to_none=True)
        return True
    self._global_grad_norm = guard._global_grad_norm
    for b in hi:
        b.grad = None
    for dt in {a.dtype for a in lo}:  # one destination dtype per call: CUDA's fast path once mishandled a mix
        pairs = [(a, b) for a, b in zip(lo, hi) if a.dtype == dt]
        torch._foreach_copy_([a for a, _ in pairs], [b for _, b in pairs])
    return False


def run_backward_prologue(engine) -> None:
    """Make DeepSpeed run its backward prologue for our model's output. The engine hooks it onto the
    tensors a forward returns, looked for in tuples, lists and dicts only: LMOutput is a dataclass, so
    it never ran. For the bf16 ZeRO 1 optimizer (BF16_Optimizer) the prologue zeroes the bf16
    gradients already added to its fp32 buffer; without it each micro-step added every earlier
    micro-step's gradient again (grad_accum 4: a grad norm 2.6x the true one). Here the engine's own
    prologue and per-tensor hook are registered on LMOutput's fields, as the engine does for a tuple
    (the other optimizers' gradients measured bit-identical with and without). In place."""
    from deepspeed.runtime.utils import register_output_backward_hooks

    fwd = engine.forward

    @functools.wraps(fwd)
    def forward(*args, **kwargs):
        out = fwd(*args, **kwargs)
        fields = vars(out) if hasattr(out, "__dataclass_fields__") else None
        if fields is not None and torch.is_grad_enabled():
            register_output_backward_hooks(fields, preprocess_once_fn=engine._backward_prologue,
                                           preprocess_per_tensor_fn=engine._backward_prologue_per_tensor)
        return out

    engine.forward = forward

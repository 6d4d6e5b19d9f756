"""bf16 (`deepspeed.precision=bf16`): fp32 GEMMs on CPUs without bf16 units, and bf16 training
that learns like fp32."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mode import engine as eng
from mode.config import load_config
from mode.model import build_model
from tests.util import TINY, mode_cli, scalars, side_by_side


def test_fp32_gemms_equal_a_float64_gemm_rounded_to_bf16():
    """Fp32Gemms must return what a bf16 GEMM with wide accumulation returns: the exact product of
    the bf16 inputs rounded once to bf16 (forward and the input/weight gradients)."""
    torch.manual_seed(0)
    x = torch.randn(64, 96).bfloat16().requires_grad_()
    w = torch.randn(48, 96).bfloat16().requires_grad_()
    gy = torch.randn(64, 48).bfloat16()
    with eng.Fp32Gemms():
        y = F.linear(x, w)
        a = x @ w.t()
    y.backward(gy)
    ref = (x.double() @ w.double().t())
    for out in (y, a):
        assert out.dtype == torch.bfloat16
        # one rounding of a float64-exact result: within half a bf16 ulp (2^-8 relative) of it
        torch.testing.assert_close(out.double(), ref, rtol=2 ** -8, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), gy.double() @ w.double(), rtol=2 ** -8, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), gy.double().t() @ x.double(), rtol=2 ** -8, atol=1e-6)
    assert x.grad.dtype == w.grad.dtype == torch.bfloat16


def test_fp32_gemms_leave_fp32_alone():
    x, w = torch.randn(8, 16), torch.randn(4, 16)
    with eng.Fp32Gemms():
        y = F.linear(x, w)
    assert torch.equal(y, F.linear(x, w))


def test_prepare_model_applies_speed_settings():
    cfg = load_config("configs/tiny/mod.yaml", ["deepspeed.precision=bf16", "train.compile=true"])
    model = eng.prepare_model(cfg, build_model(cfg.model), torch.device("cpu"))
    assert all(b._compiled_call_impl is not None for b in model.blocks)  # per block, in place
    assert type(model.blocks[1]).__name__ == "MoDBlock"  # class kept: isinstance checks still work
    assert ("forward" in vars(model)) == (not eng.native_bf16_gemms(torch.device("cpu")))
    plain = eng.prepare_model(load_config("configs/tiny/mod.yaml"), build_model(cfg.model), torch.device("cpu"))
    assert "forward" not in vars(plain) and all(b._compiled_call_impl is None for b in plain.blocks)


@pytest.mark.slow
def test_bf16_training_decreases_the_loss_like_fp32(tmp_path):
    """100 steps of the tiny preset through the DeepSpeed engine: bf16 ends within 0.1 nats of fp32
    (eval loss; both fall > 1 nat from ~ln 320), and its train loss tracks fp32 within 0.15 nats
    at every logged step."""
    common = ["train.max_steps=100", "train.eval_every=100", "train.log_every=10", "checkpoint.every=0",
              "log.progress=false", "data.max_documents=60"]

    def train(p):
        mode_cli("train", "--config", "configs/tiny/dense.yaml", *common, f"deepspeed.precision={p}",
                 f"run.dir={tmp_path / p}", timeout=1800, threads=1)

    side_by_side(lambda: train("fp32"), lambda: train("bf16"))
    ev = {p: scalars(tmp_path / p, "eval/loss") for p in ("fp32", "bf16")}
    tr = {p: scalars(tmp_path / p, "train/loss") for p in ("fp32", "bf16")}
    assert ev["fp32"][100] < ev["fp32"][0] - 1.0 and ev["bf16"][100] < ev["bf16"][0] - 1.0, ev
    assert abs(ev["bf16"][100] - ev["fp32"][100]) < 0.1, ev
    assert list(tr["bf16"]) == list(tr["fp32"]) == list(range(10, 101, 10))
    for s in tr["fp32"]:
        assert abs(tr["bf16"][s] - tr["fp32"][s]) < 0.15, (s, tr)


def _world_of_one(monkeypatch) -> None:
    import torch.distributed as dist

    from tests.util import free_port

    if not dist.is_initialized():  # a world of one in this process, kept (DeepSpeed caches its groups)
        for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=str(free_port())).items():
            monkeypatch.setenv(k, v)
        eng.init_distributed()
    monkeypatch.setenv("LOCAL_RANK", "0")  # deepspeed.initialize asks for it


def test_bf16_at_zero_0_starts_adamw_as_fp32_does(monkeypatch):
    """Bug caught: at ZeRO 0 DeepSpeed's bf16 wrapper (FP16_UnfusedOptimizer) created AdamW's state by
    stepping it on zero gradients, so Adam's bias correction started at step 2 (the first real update
    moved each weight by 0.73 x lr, not lr) and bf16 trained measurably worse than fp32 (tiny preset,
    30 steps: eval 3.904 vs 3.866; ZeRO 1: 3.867). After the engine is built there is no AdamW state
    and the fp32 masters equal the weights; the first step moves every weight with a gradient by lr
    (Adam's first update is lr x sign(g), weight decay off), in the fp32 masters."""
    _world_of_one(monkeypatch)
    cfg = load_config("configs/tiny/dense.yaml", [*TINY, "deepspeed.precision=bf16", "deepspeed.zero_stage=0",
                                                  "optim.grad_clip=0", "optim.weight_decay=0", "optim.warmup_steps=0"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    engine, opt, _ = eng.build_engine(cfg, model, 1)
    assert type(opt).__name__ == "FP16_UnfusedOptimizer" and len(opt.optimizer.state) == 0
    masters = [p for g in opt.fp32_groups for p in g]
    weights = [p for g in opt.fp16_groups for p in g]
    assert all(torch.equal(m, w.float()) for m, w in zip(masters, weights))
    before = [m.detach().clone() for m in masters]
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.data.seq_len + 1), generator=torch.Generator().manual_seed(1))
    out = engine(x[:, :-1], x[:, 1:])
    engine.backward(out.loss + out.aux_loss)
    grads = [w.grad.float().clone() for w in weights]
    engine.step()
    lr = cfg.optim.lr * eng.lr_lambda(cfg)(0)
    for m, b, g in zip(masters, before, grads):
        moved = (m.detach() - b)[g.abs() > 1e-4]
        assert moved.numel() and torch.allclose(moved.abs(), torch.full_like(moved, lr), rtol=1e-3), (lr, moved.abs().mean())


@pytest.mark.parametrize("preset", ["mode_staged", "mod"])
def test_foreach_bf16_step_equals_deepspeeds_own_step(monkeypatch, preset):
    """Speed and host syncs (#13): at ZeRO 0 DeepSpeed's bf16 wrapper stepped tensor by tensor with a
    host read per gradient; `foreach_bf16_step` runs the step in foreach kernels with one read. Against
    DeepSpeed's own step on the same batches: bf16 weights, fp32 masters, AdamW state, the skipped
    step (a NaN planted in one gradient) and the loss-scale iteration count are equal, bit for bit;
    the skipped step names the parameter that was not finite."""
    _world_of_one(monkeypatch)
    cfg = load_config(f"configs/tiny/{preset}.yaml", [*TINY, "deepspeed.precision=bf16", "deepspeed.zero_stage=0",
                                                      "optim.warmup_steps=0"])
    x = torch.randint(0, cfg.model.vocab_size, (4, 2, cfg.data.seq_len + 1), generator=torch.Generator().manual_seed(1))
    ends = []
    for ours in (True, False):
        torch.manual_seed(0)
        engine, opt, _ = eng.build_engine(cfg, build_model(cfg.model), 1)
        assert ("step" in vars(opt)) is True  # ours is installed on the instance
        if not ours:
            del opt.step  # DeepSpeed's FP16_UnfusedOptimizer.step
        named = dict(engine.module.named_parameters())
        for i, b in enumerate(x):
            out = engine(b[:, :-1], b[:, 1:])
            engine.backward(out.loss + out.aux_loss)
            if i == 2:
                named["blocks.1.inner.mlp.mlp.w_in" if preset == "mode_staged" else "embed.weight"].grad[0, 0] = float("nan")
            engine.step()
            if i == 2 and ours:
                assert opt.overflow and any(n.endswith(("mlp.w_in", "embed.weight")) for n in opt.bad_params), opt.bad_params
        state = [{k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()} for st in opt.optimizer.state.values()]
        ends.append(({n: p.detach().clone() for n, p in named.items()},
                     [m.detach().clone() for g in opt.fp32_groups for m in g], state,
                     engine.skipped_steps, opt.loss_scale_config.cur_iter))
    (w0, m0, s0, k0, c0), (w1, m1, s1, k1, c1) = ends
    assert k0 == k1 == 1 and c0 == c1 == 4
    assert w0.keys() == w1.keys() and all(torch.equal(w0[n], w1[n]) for n in w0)
    assert len(m0) == len(m1) and all(torch.equal(a, b) for a, b in zip(m0, m1))
    assert len(s0) == len(s1) > 0 and all(a.keys() == b.keys() and all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k]))
                                                                    for k in a) for a, b in zip(s0, s1))
    torch.manual_seed(0)  # and training moved them: the comparison is not of two inits
    init = build_model(cfg.model).state_dict()
    assert not all(torch.equal(v, init[k].to(v.dtype)) for k, v in w0.items())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_one_process_skips_the_gradient_all_reduce_and_trains_the_same(monkeypatch, precision):
    """Speed (review of #13): with one process at ZeRO 0 DeepSpeed still "all-reduced" the gradients,
    flattening and copying each back (47 ms of a 60M-parameter bf16 step). Skipped there; the weights
    after three steps equal, bit for bit, those of the engine that runs the all-reduce."""
    _world_of_one(monkeypatch)
    cfg = load_config("configs/tiny/mod.yaml", [*TINY, f"deepspeed.precision={precision}", "deepspeed.zero_stage=0"])
    x = torch.randint(0, cfg.model.vocab_size, (3, 2, cfg.data.seq_len + 1), generator=torch.Generator().manual_seed(1))
    weights = []
    for allreduce in (False, True):
        torch.manual_seed(0)
        engine, _, _ = eng.build_engine(cfg, build_model(cfg.model), 1)
        assert engine.enable_backward_allreduce is False
        engine.enable_backward_allreduce = allreduce
        for b in x:
            out = engine(b[:, :-1], b[:, 1:])
            engine.backward(out.loss + out.aux_loss)
            engine.step()
        weights.append({n: p.detach().clone() for n, p in engine.module.named_parameters()})
    assert all(torch.equal(weights[0][n], weights[1][n]) for n in weights[0])
    moved = engine.module.state_dict()  # (and training moved them: the comparison is not of two inits)
    torch.manual_seed(0)
    assert not all(torch.equal(v, build_model(cfg.model).state_dict()[k].to(v.dtype)) for k, v in moved.items())


@pytest.mark.parametrize("over", [[], ["model.mod.layers=every_other", "model.mod.capacity=0.25"],
                                  ["model.moe.layers=every_other", "model.moe.num_experts=4"]])
def test_activation_checkpointing_recomputes_under_fp32_gemms(over):
    """bf16 + train.activation_checkpointing=block on a CPU (Fp32Gemms around the forward): the
    backward recompute runs under the same mode, so the gradients equal those of the run without
    checkpointing (it stopped with torch's CheckpointError: recomputed bf16 vs saved fp32)."""
    cfg = load_config("configs/tiny/dense.yaml", ["model.d_model=64", "model.d_ff=128", "data.seq_len=32", *over])
    torch.manual_seed(1)
    x = torch.randint(0, 256, (2, 32))
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = eng.fp32_gemms_on_cpu(build_model(cfg.model).to(torch.bfloat16).train())
        model.activation_checkpointing = ckpt
        out = model(x, x)
        (out.loss + out.aux_loss).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n in grads[0]:
        assert torch.equal(grads[0][n], grads[1][n]), n


def _accumulated_gradient(zero, overrides, rank):
    """One optimizer step of bf16 training on 2 ranks, grad_accum 4: the relative error of the
    gradient DeepSpeed holds for the step (and of the grad norm mode logs) against the exact mean
    (float64) of the ranks' and micro-steps' bf16 gradients, computed here by plain autograd on a
    copy of the same bf16 weights; and the error a bf16 sum of this rank's 4 gradients makes."""
    import torch.distributed as dist
    from deepspeed.utils import groups, safe_get_full_grad

    cfg = load_config("configs/tiny/dense.yaml", ["model.d_model=64", "model.d_ff=128", "model.n_layers=2",
                                                  "model.n_heads=2", "data.seq_len=32", "train.micro_batch_size=2",
                                                  "train.grad_accum=4", "deepspeed.precision=bf16",
                                                  f"deepspeed.zero_stage={zero}", *overrides])
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    model = eng.prepare_model(cfg, build_model(cfg.model), cpu)
    engine, opt, _ = eng.build_engine(cfg, model, 2)
    ref_model = eng.prepare_model(cfg, build_model(cfg.model), cpu).to(torch.bfloat16)
    ref_model.load_state_dict(engine.module.state_dict())  # the same bf16 weights (this rank's experts)
    torch.manual_seed(1 + rank)  # each rank its own micro-batches
    xs = [torch.randint(0, cfg.model.vocab_size, (2, 33)) for _ in range(4)]
    micro = []  # each micro-step's bf16 gradients, as the engine computes them (loss / grad_accum)
    for x in xs:
        ref_model.zero_grad()
        out = ref_model(x[:, :-1], x[:, 1:])
        ((out.loss + out.aux_loss) / 4).backward()
        micro.append({n: p.grad.clone() for n, p in ref_model.named_parameters() if p.grad is not None})
    params = dict(engine.module.named_parameters())
    exact, sq = {}, torch.zeros((), dtype=torch.float64)
    for n in sorted(micro[0]):
        g = sum(m[n].double() for m in micro)
        # DeepSpeed MoE's experts are reduced over their expert-data-parallel group, the rest over all
        group = groups._get_expert_data_parallel_group(params[n].group_name) \
            if not getattr(params[n], "allreduce", True) else None
        dist.all_reduce(g, group=group)
        exact[n] = g / 2  # the loss is the mean over both ranks' tokens, experts' included
        sq += exact[n].pow(2).sum() / dist.get_world_size(group)  # once per replica group
    dist.all_reduce(sq)
    bf16_sum = {n: micro[0][n] + micro[1][n] + micro[2][n] + micro[3][n] for n in micro[0]}
    local = {n: sum(m[n].double() for m in micro) for n in micro[0]}
    for i, x in enumerate(xs):
        out = engine(x[:, :-1], x[:, 1:])
        engine.backward(out.loss + out.aux_loss)
        if i == 3:
            got = {n: safe_get_full_grad(params[n]) for n in exact}  # every rank: it may all-reduce
        engine.step()

    def rel(a, b):
        return (sum((a[n].double() - b[n]).pow(2).sum() for n in b) / sum(b[n].pow(2).sum() for n in b)).sqrt().item()

    norm = sq.sqrt().item()
    return (rank, type(opt).__name__, rel(got, exact), abs(eng.global_grad_norm(engine) - norm) / norm,
            rel(bf16_sum, local))


@pytest.mark.slow  # two spawned processes
@pytest.mark.parametrize("zero,overrides", [
    (0, []), (1, []), (2, []),
    # DeepSpeed MoE: expert parameter groups reduced over their expert-data-parallel group
    (1, ["model.moe.layers=every_other", "model.moe.num_experts=4", "model.moe.backend=deepspeed",
         "model.moe.ep_size=2"]),
    (1, ["model.moe.layers=every_other", "model.moe.num_experts=4", "model.moe.backend=deepspeed",
         "model.moe.ep_size=1"])], ids=["zero0", "zero1", "zero2", "zero1-moe-ep2", "zero1-moe-ep1"])
def test_bf16_accumulates_gradients_in_fp32_at_zero_1_and_2(zero, overrides):
    """bf16, 2 ranks, grad_accum 4: at ZeRO 1 and 2 the step's gradient is the exact mean of the bf16
    micro-step gradients up to fp32 rounding, and so is the grad norm logged; at ZeRO 0 DeepSpeed
    sums them in bf16 (it refuses fp32 accumulation there; README says so). Bug caught: every
    stage summed in bf16, 2.8e-3 relative error here, as much as a bf16 sum makes."""
    import functools

    from tests.test_moe_train import on_two_ranks

    res = on_two_ranks(functools.partial(_accumulated_gradient, zero, overrides))
    for rank, opt, grad_err, norm_err, bf16_sum_err in res:
        assert bf16_sum_err > 1e-3, res  # these inputs make a bf16 sum's rounding visible
        if zero == 0:
            assert grad_err > bf16_sum_err / 4, res  # summed in bf16
            continue
        assert opt == ("BF16_Optimizer" if zero == 1 else "DeepSpeedZeroOptimizer"), res
        assert grad_err < 1e-6 and norm_err < 1e-6, res  # measured 2e-9 and 4e-8

"""bf16 (`deepspeed.precision=bf16`): fp32 GEMMs on CPUs without bf16 units, and bf16 training
that learns like fp32."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mode import engine as eng
from mode.config import load_config
from mode.model import build_model
from tests.util import mode_cli, scalars, side_by_side


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

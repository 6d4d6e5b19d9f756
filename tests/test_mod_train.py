"""Mixture-of-Depths trained on the embedded default data through the real trainer."""
import pytest

from tests.util import TINY, mode_cli, scalars, side_by_side

# Every block routed at 12.5%, so which tokens get processed decides most of the model; the
# sigmoid gate keeps routed blocks active from the first step (with the identity gate r starts
# near 0 and both variants spend the first hundreds of steps growing it).
SETUP = ["model.d_model=64", "model.d_ff=256", "data.seq_len=64", "train.max_steps=150", "train.eval_every=150",
         "train.eval_batches=8", "train.log_every=10", "log.progress=false", "model.mod.layers=every",
         "model.mod.gate=sigmoid"]


@pytest.mark.slow
def test_learned_routing_beats_stochastic_routing(tmp_path):
    def train(routing):
        mode_cli("train", "--config", "configs/tiny/mod.yaml", *SETUP, f"model.mod.routing={routing}",
                 f"run.dir={tmp_path / routing}", threads=1)

    side_by_side(lambda: train("learned"), lambda: train("stochastic"))
    learned, stochastic = (scalars(tmp_path / r, "eval/loss")[150] for r in ("learned", "stochastic"))
    assert learned < stochastic - 0.03, (learned, stochastic)
    # the autoregressive (causal-routing) evaluation and the per-layer routing metrics are logged
    causal = scalars(tmp_path / "learned", "eval/loss_causal")
    assert set(causal) == {0, 150} and causal[150] < causal[0]
    acc = scalars(tmp_path / "learned", "mod/layer0/predictor_acc")
    assert acc and 0.5 < acc[150] <= 1.0
    assert scalars(tmp_path / "learned", "mod/layer3/causal_processed_frac")


@pytest.mark.slow
def test_the_predictor_loss_weight_changes_no_lm_update(tmp_path):
    """Bug caught: the predictor's gradients (stop-gradient: they reach no LM parameter) counted in
    the global norm that optim.grad_clip divides every gradient by, so predictor_loss_weight trained
    the LM differently (the tiny preset clips at most steps). Its own optimizer (PredictorAdamW) keeps
    the LM's update bit for bit the same at ZeRO 0 and 1, and its state resumes exactly."""
    common = ["train.max_steps=8", "train.log_every=1", "train.eval_every=0", "checkpoint.every=4",
              "optim.warmup_steps=2", "optim.lr=3e-3", *[a for a in SETUP if "max_steps" not in a
                                                          and "eval_every" not in a and "log_every" not in a]]

    def one(name, *over):
        return lambda: mode_cli("train", "--config", "configs/tiny/mod.yaml", *common, "train.micro_batch_size=4",
                                "train.grad_accum=2", *over, f"run.dir={tmp_path / name}", threads=1)

    side_by_side(one("w1"), one("w100", "model.mod.predictor_loss_weight=100"),
                 one("z1_w1", "deepspeed.zero_stage=1"),
                 one("z1_w100", "deepspeed.zero_stage=1", "model.mod.predictor_loss_weight=100"),
                 one("resumed", "train.stop_at=4"))
    one("resumed")()
    for tag in ("train/loss", "mod/layer0/predictor_loss"):
        assert scalars(tmp_path / "w1", tag) == scalars(tmp_path / "resumed", tag), tag  # bit for bit
    for a, b in (("w1", "w100"), ("z1_w1", "z1_w100")):
        la, lb = scalars(tmp_path / a, "train/loss"), scalars(tmp_path / b, "train/loss")
        assert list(la) == list(range(1, 9)) and la == lb, (a, b, la, lb)  # bit for bit
        pa, pb = (scalars(tmp_path / r, "mod/layer0/predictor_loss") for r in (a, b))
        assert pa[8] != pb[8]  # the weight does train the predictor


def _predictor_step_at_zero1(precision, rank):
    import torch

    from mode import engine as eng
    from mode.config import load_config
    from mode.model import build_model

    cfg = load_config("configs/tiny/mod.yaml", [*TINY, "deepspeed.zero_stage=1", f"deepspeed.precision={precision}"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    engine, _, _ = eng.build_engine(cfg, model, 2)
    opt = eng.PredictorAdamW(cfg, model)
    torch.manual_seed(1 + rank)  # each rank its own batch
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.data.seq_len + 1))
    out = engine(x[:, :-1], x[:, 1:])
    engine.backward(out.loss + out.aux_loss)
    grads = [p.grad.clone() for p in opt.params]
    opt.step(lr=1e-2)  # where the trainer steps it: after the last backward, before the engine's step
    engine.step()
    return rank, [g.tolist() for g in grads], [p.detach().tolist() for p in opt.params]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_predictors_are_averaged_across_ranks_at_zero_1(precision):
    """Bug caught: ZeRO 1/2 reduce only the gradients of their own partitions, so predictors outside
    DeepSpeed's optimizer trained on each rank's half of the batch and drifted apart. Both ranks'
    predictors equal one PredictorAdamW step on the ranks' mean gradient. bf16: DeepSpeed's
    BF16_Optimizer (fp32 accumulation) reduces only its own groups too; the predictors stay fp32."""
    import functools

    import torch

    from mode import engine as eng
    from mode.config import load_config
    from mode.model import build_model
    from tests.test_moe_train import on_two_ranks

    (_, g0, w0), (_, g1, w1) = on_two_ranks(functools.partial(_predictor_step_at_zero1, precision))
    assert g0 != g1 and w0 == w1  # other batches, one set of predictors
    cfg = load_config("configs/tiny/mod.yaml", [*TINY, "deepspeed.zero_stage=1"])
    torch.manual_seed(0)
    opt = eng.PredictorAdamW(cfg, build_model(cfg.model))  # no process group here: nothing to reduce
    for p, a, b in zip(opt.params, g0, g1):
        if precision == "bf16":  # DeepSpeed cast them to bf16 before PredictorAdamW made them fp32 again
            p.data = p.data.bfloat16().float()
        p.grad = (torch.tensor(a) + torch.tensor(b)) / 2
    opt.step(lr=1e-2)
    for p, w in zip(opt.params, w0):
        assert torch.allclose(p.detach(), torch.tensor(w), atol=1e-6, rtol=1e-5)

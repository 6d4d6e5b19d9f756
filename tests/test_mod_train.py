"""Mixture-of-Depths trained on the embedded default data through the real trainer."""
import pytest

from mode.generate import load_run
from tests.util import deepspeed_train, mode_cli, scalars, side_by_side

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
    the LM's update bit for bit the same at ZeRO 0 and 1, in one process, and resumes exactly; with two
    ranks at ZeRO 1,
    where DeepSpeed leaves the predictors' gradients unreduced, the predictor still trains as in one
    process (an unaveraged predictor would learn each rank's half of the batch)."""
    common = ["train.max_steps=8", "train.log_every=1", "train.eval_every=0", "checkpoint.every=8",
              "optim.warmup_steps=2", "optim.lr=3e-3", *[a for a in SETUP if "max_steps" not in a
                                                          and "eval_every" not in a and "log_every" not in a]]

    def one(name, *over):
        return lambda: mode_cli("train", "--config", "configs/tiny/mod.yaml", *common, "train.micro_batch_size=4",
                                "train.grad_accum=2", *over, f"run.dir={tmp_path / name}", threads=1)

    side_by_side(one("w1"), one("w100", "model.mod.predictor_loss_weight=100"),
                 one("z1_w1", "deepspeed.zero_stage=1"),
                 one("z1_w100", "deepspeed.zero_stage=1", "model.mod.predictor_loss_weight=100"),
                 one("resumed", "train.stop_at=4", "checkpoint.every=4"))
    one("resumed", "checkpoint.every=4")()  # the predictor's optimizer state is checkpointed too
    for tag in ("train/loss", "mod/layer0/predictor_loss"):
        assert scalars(tmp_path / "w1", tag) == scalars(tmp_path / "resumed", tag), tag  # bit for bit
    deepspeed_train(2, "configs/tiny/mod.yaml", *common, "train.micro_batch_size=2", "train.grad_accum=2",
                    "deepspeed.zero_stage=1", f"run.dir={tmp_path / 'two'}")
    for a, b in (("w1", "w100"), ("z1_w1", "z1_w100")):
        la, lb = scalars(tmp_path / a, "train/loss"), scalars(tmp_path / b, "train/loss")
        assert list(la) == list(range(1, 9)) and la == lb, (a, b, la, lb)  # bit for bit
        pa, pb = (scalars(tmp_path / r, "mod/layer0/predictor_loss") for r in (a, b))
        assert pa[8] != pb[8]  # the weight does train the predictor
    one_, two = (scalars(tmp_path / r, "mod/layer0/predictor_loss") for r in ("z1_w1", "two"))
    for s in range(1, 9):
        assert two[s] == pytest.approx(one_[s], rel=1e-4), (s, one_[s], two[s])
    (a, *_), (b, *_) = (load_run(tmp_path / r) for r in ("z1_w1", "two"))  # rank 0's weights, step 8
    pa, pb = ({n: p for n, p in m.named_parameters() if ".predictor." in n} for m in (a, b))
    # measured: 1.1e-4 apart (summation order, amplified by Adam); unaveraged across ranks, 8.3e-3
    assert pa and all((pa[n] - pb[n]).abs().max() < 1e-3 for n in pa), {
        n: (pa[n] - pb[n]).abs().max().item() for n in pa}

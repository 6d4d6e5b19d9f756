"""Mixture-of-Depths trained on the embedded default data through the real trainer."""
import pytest
from tests.util import mode_cli, scalars, side_by_side

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

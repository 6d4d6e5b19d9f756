"""Experiment grids: every variant resolves, and the matched variants have the same forward
FLOPs per token within 2% (as `mode flops` reports), at CPU and cluster scale."""
import json

import pytest

from mode.compare import check_matched_flops, expand, load_experiment, world_size
from mode.config import ConfigError, load_config
from tests.util import ROOT, mode_cli

MATCHED = {"dense", "mod", "moe_dropping", "mode_staged", "mode_integrated"}
GRIDS = ["configs/experiments/quickstart.yaml", "configs/experiments/mode_vs_moe_dropping.yaml"]


@pytest.mark.parametrize("grid", GRIDS)
def test_grid_variants_have_matched_flops(grid):
    exp = load_experiment(ROOT / grid)
    runs = expand(exp)
    for r in runs:
        r.cfg = load_config(r.config, r.overrides, world_size=world_size(exp))
    assert set(exp.match_flops["variants"]) == MATCHED
    flops = check_matched_flops(exp, runs)
    # independently of check_matched_flops: every matched variant within 2% of dense, via the CLI
    dense = flops["dense"]
    for name in MATCHED:
        assert abs(flops[name] / dense - 1) <= 0.02, (name, flops[name], dense)
    assert flops["moe"] > 1.2 * dense  # full-capacity MoE is the reference at its own FLOPs


@pytest.mark.slow
def test_cli_flops_agree_with_the_grid_check():
    exp = load_experiment(ROOT / GRIDS[0])
    runs = expand(exp)
    for r in runs:
        r.cfg = load_config(r.config, r.overrides, world_size=world_size(exp))
    flops = check_matched_flops(exp, runs)
    run = next(r for r in runs if r.variant == "mode_staged")
    cli = json.loads(mode_cli("flops", "--config", run.config, *run.overrides, "--json").stdout)
    assert cli["forward_flops_per_token"] == pytest.approx(flops["mode_staged"])


def test_unmatched_grid_is_refused(tmp_path):
    src = (ROOT / "configs/experiments/quickstart.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(src.replace('"model.mod.capacity=0.332"', '"model.mod.capacity=0.125"')
                   .replace("../tiny/", str(ROOT / "configs/tiny") + "/"))
    exp = load_experiment(bad)
    runs = expand(exp)
    for r in runs:
        r.cfg = load_config(r.config, r.overrides)
    with pytest.raises(ConfigError, match="match_flops: forward FLOPs/token differ"):
        check_matched_flops(exp, runs)


def test_mod_variants_grid_is_flop_matched_and_each_variant_is_its_routing():
    from mode.flops import count
    from mode.plan import layer_plan

    exp = load_experiment(ROOT / "configs/experiments/mod_variants.yaml")
    runs = expand(exp)
    for r in runs:
        r.cfg = load_config(r.config, r.overrides, world_size=world_size(exp))
    flops = check_matched_flops(exp, runs)
    assert set(flops) == {"dense", "mod", "decoupled", "kv_all", "schedule"}
    for r in runs:  # independently of check_matched_flops, from the analytic count
        assert abs(count(r.cfg)["forward_flops_per_token"] / flops["dense"] - 1) <= 0.02, r.variant
    kinds = {r.variant: [lp.kind for lp in layer_plan(r.cfg.model)] for r in runs}
    assert kinds["mod"][1::2] == ["mod(dense)"] * 3 and kinds["kv_all"][1::2] == ["mod(dense)+kv_all"] * 3
    assert kinds["decoupled"][1::2] == ["mod_split(dense)"] * 3
    sched = next(r for r in runs if r.variant == "schedule")
    assert [lp.block.capacity for lp in layer_plan(sched.cfg.model) if lp.block] == [0.5, 0.33, 0.165]
    assert {r.seed for r in runs} == {0, 1, 2}


def test_mod_causal_grid_differs_from_the_quickstart_mod_only_in_the_causal_rule():
    """configs/experiments/mod_causal.yaml (issue #11): the quickstart's MoD run (model and data)
    three times, with model.mod.causal = aux_loss / predictor / threshold and nothing else changed."""
    from mode.config import flatten
    from mode.flops import count

    qs = load_experiment(ROOT / "configs/experiments/quickstart.yaml")
    qs_mod = next(r for r in expand(qs) if r.variant == "mod")
    ref = flatten(load_config(qs_mod.config, qs_mod.overrides).to_dict())
    exp = load_experiment(ROOT / "configs/experiments/mod_causal.yaml")
    runs = expand(exp)
    assert {r.variant for r in runs} == {"aux_loss", "predictor", "threshold"}
    flops = {}
    for r in runs:
        r.cfg = load_config(r.config, r.overrides, world_size=world_size(exp))
        got = flatten(r.cfg.to_dict())
        diff = {k for k in ref if ref[k] != got[k] and not k.startswith("run.") and k != "train.seed"}
        assert diff == {"model.mod.causal"} if r.variant != "predictor" else diff == set(), (r.variant, diff)
        assert got["model.mod.causal"] == r.variant
        flops[r.variant] = count(r.cfg)["forward_flops_per_token"]
    check_matched_flops(exp, runs)
    # the LM's FLOPs are equal; only the predictor's MLP (d -> d/2 -> 1 per routed layer) is added
    d = ref["model.d_model"]
    assert flops["aux_loss"] == flops["threshold"]
    assert flops["predictor"] - flops["threshold"] == 3 * (2 * d * (d // 2) + 2 * (d // 2))

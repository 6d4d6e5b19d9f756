"""Analytic FLOPs/params (mode/flops.py) against FlopCounterMode and numel() on the real modules."""
import json

import pytest
import torch

from mode.config import load_config
from mode.flops import count, flop_counter
from mode.model import build_model
from tests.util import ROOT, mode_cli

BASE = ["model.d_model=64", "model.n_heads=4", "model.d_ff=256", "model.n_layers=4", "data.seq_len=256",
        "model.max_seq_len=256"]

VARIANTS = {
    "dense": [],
    "dense_gelu_untied": ["model.mlp=gelu", "model.tie_embeddings=false"],
    "mod": ["model.mod.layers=every_other", "model.mod.capacity=0.125"],
    "mod_every_aux": ["model.mod.layers=every", "model.mod.capacity=0.25", "model.mod.causal=aux_loss"],
    # MoE counted at capacity: capacity factor 0.25 fills every expert, so the native backend
    # does the capacity's work in either group layout (measured() uses the padded one)
    "moe_at_capacity": ["model.moe.layers=every_other", "model.moe.top_k=2", "model.moe.capacity_factor=0.25"],
    # fine-grained experts: d_expert, not d_ff, sizes each expert
    "moe_fine_grained": ["model.moe.layers=every", "model.moe.num_experts=16", "model.moe.d_expert=64",
                         "model.moe.top_k=4", "model.moe.capacity_factor=0.25"],
    "moe_dropless": ["model.moe.layers=every_other", "model.moe.top_k=2", "model.moe.capacity_factor=null"],
    "staged": ["model.moe.layers=every_other", "model.moe.top_k=2", "model.moe.capacity_factor=0.25",
               "model.mod.layers=every_other", "model.mod.capacity=0.25"],
    # no-op routes leave real-expert slots empty: measured with capacity-padded groups (the static
    # layout accelerators use), which compute exactly the capacity the analytic count assumes
    "integrated": ["model.moe.layers=every_other", "model.moe.top_k=2", "model.moe.capacity_factor=0.25",
                   "model.moe.num_noop_experts=8", "model.moe.noop_balance=include"],
    # more routes per token than real experts: a token reaches each real expert at most once (the
    # count was top_k = 3 rows per token; 2 real experts hold at most T rows each)
    "moe_k_above_real_experts": ["model.moe.layers=every_other", "model.moe.num_experts=2",
                                 "model.moe.num_noop_experts=2", "model.moe.top_k=3",
                                 "model.moe.capacity_factor=1.0"],
    "mod_kv_all": ["model.mod.layers=every_other", "model.mod.capacity=0.25", "model.mod.kv=all"],
    "mod_decoupled": ["model.mod.layers=every_other", "model.mod.decoupled=true", "model.mod.attn_capacity=0.25",
                      "model.mod.mlp_capacity=0.5", "model.mod.causal=both"],
}


def measured(cfg, batch=2):
    torch.manual_seed(0)
    model = build_model(cfg.model)
    for m in model.modules():  # capacity-padded expert groups: the work the analytic count assumes
        if hasattr(m, "padded_groups"):
            m.padded_groups = True
    x = torch.randint(0, 256, (batch, cfg.data.seq_len))
    with flop_counter() as fc, torch.no_grad():
        model(x)
    return fc.get_total_flops() / x.numel(), sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", VARIANTS)
def test_analytic_matches_flop_counter(name):
    # Exact (up to float rounding of the per-token division), not within a percent: a router
    # miscounted (the no-op outputs: 0.3% of `integrated`) or a predictor left out (1.7% of `mod`)
    # hides inside such slack.
    cfg = load_config(ROOT / "configs/tiny/dense.yaml", BASE + VARIANTS[name])
    flops, params = measured(cfg)
    c = count(cfg)
    assert c["params"] == params
    assert c["forward_flops_per_token"] == pytest.approx(flops, rel=1e-12, abs=0), (c["forward_flops_per_token"], flops)


def test_integrated_dropless_count_is_the_bound_native_computes_below():
    """Dropless integrated MoDE: the count takes top_k real-expert routes per token (the bound);
    the native backend computes only the routes that reached a real expert. Measured = count
    minus the expert work of the routes that went to no-ops, counted by hand from the routing."""
    cfg = load_config(ROOT / "configs/tiny/dense.yaml", BASE + [
        "model.moe.layers=every_other", "model.moe.top_k=2", "model.moe.capacity_factor=null",
        "model.moe.num_noop_experts=8"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    x = torch.randint(0, 256, (2, cfg.data.seq_len))
    with flop_counter() as fc, torch.no_grad():
        model(x)
    m, d = cfg.model.moe, cfg.model.d_model
    expert = 2 * 3 * d * cfg.model.d_ff  # one SwiGLU expert on one token: three d x d_ff matmuls
    noop_routes = sum(int((b.mlp.mlp.last_routing.idx_TK >= m.num_experts).sum()) for b in model.blocks
                      if hasattr(b.mlp.mlp, "last_routing"))
    assert noop_routes > 0
    want = count(cfg)["forward_flops_per_token"] * x.numel() - noop_routes * expert
    assert fc.get_total_flops() == want


def test_mod_costs_less_than_dense():
    dense = count(load_config(ROOT / "configs/tiny/dense.yaml", BASE))
    mod = count(load_config(ROOT / "configs/tiny/dense.yaml", BASE + VARIANTS["mod"]))
    assert mod["forward_flops_per_token"] < 0.8 * dense["forward_flops_per_token"]


@pytest.mark.slow
def test_cli_json():
    r = mode_cli("flops", "--config", "configs/tiny/dense.yaml", "--json")
    c = json.loads(r.stdout)
    assert c["params"] > 0 and c["forward_flops_per_token"] > 0
    table = mode_cli("flops", "--config", "configs/tiny/dense.yaml").stdout
    assert "dense" in table and "GFLOPs" in table


def test_table_shows_each_layer_of_a_capacity_schedule():
    from mode.flops import format_table

    cfg = load_config(ROOT / "configs/tiny/mod.yaml", ["model.n_layers=6", "model.mod.capacity=[0.5, 0.33, 0.165]"])
    c = count(cfg)
    rows = {line.split()[1]: line for line in format_table(c).splitlines() if line.startswith("mod(dense)")}
    assert set(rows) == {"1", "3", "5"}  # one row per distinct routed layer, not the first one for all
    for b in c["blocks"][1::2]:
        assert f"{b['flops_per_token'] / 1e9:.6f}" in rows[str(b["layer"])]


def test_table_keeps_a_long_block_kind_apart_from_its_layers():
    """Bug caught (variants walkthrough): kinds reach 28 characters (mod_split(integrated)+kv_all) in a
    22-wide column, so the table read `mod_split(dense)+kv_all1`: a kind glued to its layer."""
    from mode.flops import format_table

    cfg = load_config(ROOT / "configs/tiny/mode_integrated.yaml", [
        "model.mod.layers=every_other", "model.mod.decoupled=true", "model.mod.kv=all",
        "model.mod.attn_capacity=0.4", "model.mod.mlp_capacity=[0.25, 0.5]"])
    c = count(cfg)
    rows = [line.split() for line in format_table(c).splitlines()[1:] if line.startswith("mod_split")]
    assert [r[:2] for r in rows] == [["mod_split(integrated)+kv_all", "1"], ["mod_split(integrated)+kv_all", "3"]]


@pytest.mark.parametrize("knob", [[], ["--knob", "model.mod.capacity"]])  # the default knob, as README shows it
def test_match_solves_the_mod_capacity(knob, capsys):
    """`mode flops --config mod.yaml --match dense.yaml` solves model.mod.capacity (a float or a
    per-layer list in the config) so the FLOPs per token equal the dense model's; it was refused."""
    from mode.cli import main

    over = ["model.n_layers=6"]
    argv = ["flops", "--config", str(ROOT / "configs/tiny/mod.yaml"), *over,
            "--match", str(ROOT / "configs/tiny/dense.yaml"), *knob]
    assert main(argv) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("model.mod.capacity=")
    v = float(first.split()[0].split("=")[1])
    target = count(load_config(ROOT / "configs/tiny/dense.yaml"))["forward_flops_per_token"]
    got = count(load_config(ROOT / "configs/tiny/mod.yaml", over + [f"model.mod.capacity={v}"]))
    assert abs(got["forward_flops_per_token"] - target) / target < 0.01, (v, got["forward_flops_per_token"], target)
    # --json: stdout is one JSON object (the solved line went before it), holding the solved knob
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["match"]["knob"] == "model.mod.capacity" and out["match"]["value"] == pytest.approx(v, rel=1e-5)
    assert out["forward_flops_per_token"] == pytest.approx(got["forward_flops_per_token"], rel=1e-4)


@pytest.mark.parametrize("config,other", [("dense", "mod"), ("mod", "moe"), ("dense", "dense"),
                                          ("mode_integrated", "dense")])
def test_match_out_of_reach_or_by_a_knob_without_effect_is_refused(config, other, capsys):
    """Bugs caught: dense --match mod printed `model.mod.capacity=0.001` (the knob does nothing in a
    dense model) and mod --match moe printed capacity 1 still 23% short, both with exit 0; then
    dense --match dense and integrated MoDE (no depth-routed layer) --match dense printed 0.001, exit 0,
    the target being within 2% of what the knob leaves unchanged."""
    from mode.cli import main

    target = count(load_config(ROOT / f"configs/tiny/{other}.yaml"))["forward_flops_per_token"]
    assert main(["flops", "--config", str(ROOT / f"configs/tiny/{config}.yaml"),
                 "--match", str(ROOT / f"configs/tiny/{other}.yaml")]) == 2
    out, err = capsys.readouterr()
    if config == "mod":
        expect = f"config error: --match={ROOT}/configs/tiny/{other}.yaml: its {target:.6g} FLOPs/token is out of reach"
    else:
        expect = "config error: --knob='model.mod.capacity': a field that changes this config's FLOPs/token ("
    assert out == "" and err.splitlines() == [err.strip()] and err.startswith(expect), err


def test_flops_bad_option_is_one_line(capsys):
    from mode.cli import main

    # a missing --match file is named as --match (it was reported as --config)
    assert main(["flops", "--config", str(ROOT / "configs/tiny/mod.yaml"), "--match", "nope.yaml"]) == 2
    assert capsys.readouterr().err.strip() == "config error: --match='nope.yaml': an existing YAML file"
    # a per-layer capacity list is not replaced by one solved value in silence (it printed 0.972656, exit 0)
    assert main(["flops", "--config", str(ROOT / "configs/tiny/mod.yaml"), "model.mod.capacity=[0.5,0.25]", "--match",
                 str(ROOT / "configs/tiny/dense.yaml")]) == 2
    assert capsys.readouterr().err.strip() == ("config error: --knob='model.mod.capacity': a field holding one value "
                                               "(this config gives a per-layer list, [0.5, 0.25]: --match solves one "
                                               "value for every layer; set it to one value to solve it)")
    # a misspelt --knob gets the config's "did you mean", as a misspelt key does
    assert main(["flops", "--config", str(ROOT / "configs/tiny/mod.yaml"), "--match", str(ROOT / "configs/tiny/dense.yaml"),
                 "--knob", "model.mod.capcity"]) == 2
    assert capsys.readouterr().err.strip().endswith("; did you mean model.mod.capacity?")

    with pytest.raises(SystemExit) as e:
        main(["flops", "--config", str(ROOT / "configs/tiny/mod.yaml"), "--bogus"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == ["mode flops: error: unrecognized arguments: --bogus"], err


def test_knob_alone_is_refused_and_the_default_knob_is_named_as_such(capsys):
    """Bugs caught (README walkthrough): `--knob` without `--match` was ignored without a word; and
    `--match` on a config without depth routing failed on `--knob='model.mod.capacity'`, a flag the
    user never typed, without saying it is the default or what else to tune."""
    from mode.cli import main

    assert main(["flops", "--config", str(ROOT / "configs/tiny/mod.yaml"), "--knob", "model.mod.capacity"]) == 2
    assert "config error: --knob='model.mod.capacity': given with --match OTHER.yaml" in capsys.readouterr().err
    assert main(["flops", "--config", str(ROOT / "configs/tiny/moe_dropping.yaml"),
                 "--match", str(ROOT / "configs/tiny/dense.yaml")]) == 2
    err = capsys.readouterr().err
    assert "--knob (default model.mod.capacity) names the field --match tunes" in err, err

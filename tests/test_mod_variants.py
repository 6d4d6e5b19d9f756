"""Routing variants, each a config: decoupled attention/MLP routing, K/V-from-all attention, per-layer
capacities. Each is checked against a brute-force per-row reference written from the weights
(forward and gradients, float64), for causality, for KV-cache decoding == a full causal recompute,
and for its FLOPs against FlopCounterMode.

Shape legend: B rows, S sequence, D d_model, H heads, E head dim, V vocab.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from mode.config import ConfigError, ModConfig, ModelConfig, load_config
from mode.flops import count, flop_counter
from mode.generate import generate_ids
from mode.mod import MoDBlock
from mode.model import build_model
from mode.plan import layer_plan
from tests.util import ROOT, TINY, mode_cli, scalars

D, H, S, V = 32, 2, 16, 64
VARIANTS = {
    "mod": dict(layers="every_other", capacity=0.25),
    "decoupled": dict(layers="every_other", decoupled=True, attn_capacity=0.75, mlp_capacity=0.5),
    "kv_all": dict(layers="every_other", capacity=0.25, kv="all"),
    "decoupled_kv_all": dict(layers="every", decoupled=True, attn_capacity=[0.5, 0.25, 0.75, 0.5], mlp_capacity=0.25,
                             kv="all"),
    "per_layer": dict(layers="every", capacity=[0.75, 0.25, 0.5, 0.125]),
}


def model_of(variant, causal="predictor", dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=V, d_model=D, n_layers=4, n_heads=H, d_ff=64, max_seq_len=64,
                      mod=ModConfig(causal=causal, **VARIANTS[variant]))
    cfg.validate()
    model = build_model(cfg).to(dtype)
    for m in model.modules():  # sharper than init: attention far from uniform, routers spread
        if isinstance(m, MoDBlock):
            torch.nn.init.normal_(m.router.router.weight, std=2.0 / D ** 0.5)
            if m.router.predictor is not None:
                lin = m.router.predictor[2]
                torch.nn.init.normal_(lin.weight, std=3.0 / lin.weight.shape[1] ** 0.5)
    for n, p in model.named_parameters():
        if p.dim() == 2 and ("qkv" in n or "w_in" in n):
            torch.nn.init.normal_(p, std=1.5 / p.shape[1] ** 0.5)
    return model


# ------------------------------------------------------------------------------------------------
# The brute-force reference: one row at a time, top-k by sorting Python floats, attention written
# out with explicit masks over ORIGINAL positions.


def rms(norm, x):
    # in fp32 whatever the model's dtype (as the model does: bf16 sums of squares are too coarse)
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.float()).to(x.dtype)


def rope(x_NHE, pos_N, theta=10000.0):
    E = x_NHE.shape[-1]
    freq = theta ** (-torch.arange(0, E, 2, dtype=torch.float64) / E)
    ang = pos_N[:, None].double() * freq  # N, E/2
    x1, x2 = x_NHE[..., 0::2], x_NHE[..., 1::2]
    # the model keeps its rotary table in fp32 (a buffer derived from the config)
    c, s = ang.cos().float()[:, None].to(x_NHE.dtype), ang.sin().float()[:, None].to(x_NHE.dtype)
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), -1).flatten(-2)


def ref_attn(sub, x_SD, q_idx, kv_idx):
    """Attention sublayer: queries of the tokens q_idx, keys/values of kv_idx (positions = indices)."""
    h = rms(sub.norm, x_SD)
    W, Wo = sub.attn.qkv.weight, sub.attn.out.weight
    E = D // H
    q = (h[q_idx] @ W[:D].T).view(-1, H, E)
    k = (h[kv_idx] @ W[D:2 * D].T).view(-1, H, E)
    v = (h[kv_idx] @ W[2 * D:].T).view(-1, H, E)
    qi, ki = torch.tensor(q_idx), torch.tensor(kv_idx)
    q, k = rope(q, qi), rope(k, ki)
    att = torch.einsum("qhe,khe->hqk", q, k) / math.sqrt(E)
    att = att.masked_fill(~(ki[None, :] <= qi[:, None]), float("-inf")).softmax(-1)
    return torch.einsum("hqk,khe->qhe", att, v).reshape(-1, D) @ Wo.T


def ref_mlp(sub, x_ND):
    gate, up = (rms(sub.norm, x_ND) @ sub.mlp.w_in.weight.T).chunk(2, -1)
    return (F.silu(gate) * up) @ sub.mlp.w_out.weight.T


def ref_select(wrapper, x_SD, routing):
    lin = wrapper.router.router  # r in fp32 (the paper's router precision), whatever the model's dtype
    r_S = x_SD.float() @ lin.weight[0].float() + lin.bias[0].float()
    if routing == "topk":
        k = max(1, min(S, round(wrapper.capacity * len(r_S))))
        sel = sorted(sorted(range(len(r_S)), key=lambda j: -float(r_S[j].detach()))[:k])
    else:  # causal: each token alone, from the predictor (stop-gradient input)
        p = wrapper.router.predictor(x_SD.detach())[:, 0]
        sel = [j for j in range(len(r_S)) if float(p[j].detach()) > 0]
    return r_S, sel


def ref_routed(wrapper, x_SD, routing, unit):
    """x + r * unit(selected) on the selected tokens, x elsewhere."""
    r_S, sel = ref_select(wrapper, x_SD, routing)
    if not sel:
        return x_SD
    upd = torch.zeros_like(x_SD)
    upd = upd.index_put((torch.tensor(sel),), (r_S[sel, None] * unit(sel)).to(x_SD.dtype))
    return x_SD + upd


def ref_block(block, x_SD, routing):
    every = list(range(x_SD.shape[0]))
    if isinstance(block, MoDBlock):  # whole block: attention among the selected (or K/V of all), then MLP
        inner = block.inner

        def unit(sel):
            a = ref_attn(inner.attn, x_SD, sel, every if block.kv_all else sel)
            return a + ref_mlp(inner.mlp, x_SD[sel] + a)

        return ref_routed(block, x_SD, routing, unit)
    if isinstance(block.attn, MoDBlock):
        w = block.attn
        x_SD = ref_routed(w, x_SD, routing, lambda sel: ref_attn(w.inner, x_SD, sel, every if w.kv_all else sel))
    else:
        x_SD = x_SD + ref_attn(block.attn, x_SD, every, every)
    if isinstance(block.mlp, MoDBlock):
        x1 = x_SD
        return ref_routed(block.mlp, x1, routing, lambda sel: ref_mlp(block.mlp.inner, x1[sel]))
    return x_SD + ref_mlp(block.mlp, x_SD)


def ref_logits(model, ids_BS, routing="topk"):
    rows = []
    for ids_S in ids_BS:
        x = model.embed.weight[ids_S]
        for block in model.blocks:
            x = ref_block(block, x, routing)
        rows.append(rms(model.norm, x) @ model.head.weight.T)
    return torch.stack(rows)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("routing", ["topk", "causal"])
def test_forward_and_gradients_match_bruteforce_reference(variant, routing):
    # Bugs caught: a wrong selection (flattened batch, unsorted indices), K/V from the wrong tokens,
    # queries at re-indexed positions, a capacity from the wrong layer, an update without g(r).
    model = model_of(variant, dtype=torch.float64)
    g = torch.Generator().manual_seed(4)  # distinct tokens per row: a repeated token ties its own scores at layer 0
    ids = torch.stack([torch.randperm(V, generator=g)[: S + 1] for _ in range(3)])
    out = model(ids[:, :-1], ids[:, 1:], routing=routing)
    ref = ref_logits(model, ids[:, :-1], routing)
    torch.testing.assert_close(out.logits, ref, rtol=1e-10, atol=1e-10)
    params = [p for n, p in model.named_parameters() if ".predictor." not in n]
    g_model = torch.autograd.grad(out.loss, params, allow_unused=True)
    ref_loss = F.cross_entropy(ref.flatten(0, 1), ids[:, 1:].flatten())
    g_ref = torch.autograd.grad(ref_loss, params, allow_unused=True)
    n_routers = 0
    for (n, _), a, b in zip([(n, p) for n, p in model.named_parameters() if ".predictor." not in n], g_model, g_ref):
        assert (a is None) == (b is None), n
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=lambda m: f"{n}: {m}")
            n_routers += ".router.router.weight" in n and a.abs().sum() > 0
    assert n_routers > 0  # the LM loss reaches the routers through g(r)


def test_per_layer_capacity_is_each_layers_own():
    model = model_of("per_layer")
    model(torch.randint(0, V, (2, S)))
    ks = [int(b.last_selected_BS[0].sum()) for b in model.blocks]
    assert ks == [round(c * S) for c in VARIANTS["per_layer"]["capacity"]] == [12, 4, 8, 2]
    plan = layer_plan(model.cfg)
    assert [lp.block.capacity for lp in plan] == VARIANTS["per_layer"]["capacity"]


def test_decoupled_sublayers_have_their_own_routers_capacities_and_metrics():
    model = model_of("decoupled")
    out = model(torch.randint(0, V, (2, S)))
    blk = model.blocks[1]
    assert blk.attn.router is not blk.mlp.router
    assert int(blk.attn.last_selected_BS[0].sum()) == 12 and int(blk.mlp.last_selected_BS[0].sum()) == 8
    for sub in ("mod_attn", "mod_mlp"):
        for key in ("processed_frac", "predictor_acc", "router_mean", "causal_processed_frac"):
            assert f"{sub}/layer1/{key}" in out.metrics and f"{sub}/layer3/{key}" in out.metrics
    assert out.metrics["mod_attn/layer1/processed_frac"] == 0.75 and out.metrics["mod_mlp/layer1/processed_frac"] == 0.5
    # engaged = attention AND MLP computed for the token
    eng = model.engaged_blocks()
    assert torch.equal(eng[1], blk.attn.last_selected_BS & blk.mlp.last_selected_BS) and eng[0].all()


@pytest.mark.parametrize("variant", VARIANTS)
def test_causal_routing_never_looks_ahead(variant):
    model = model_of(variant).eval()
    ids = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(2))
    later = ids.clone()
    t = S // 2
    later[:, t + 1:] = torch.randint(0, V, (2, S - t - 1), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = model(ids, routing="causal").logits, model(later, routing="causal").logits
        sel = torch.stack([m.last_selected_BS for m in model.modules() if isinstance(m, MoDBlock)])
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=1e-5, atol=1e-6)
    assert 0 < int(sel.sum()) < sel.numel()


PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [3, 1, 4, 1, 5], [7]]


@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_decoding_equals_full_causal_recompute(variant):
    model = model_of(variant).eval()
    _, tr = generate_ids(model, PROMPTS, max_new_tokens=9, temperature=1.0, seed=3, return_trace=True)
    T = tr.logits_BTV.shape[1]
    caches = model.new_caches(len(PROMPTS), T)
    with torch.no_grad():  # one token per step through the caches: the path prefill replaces
        step_BTV = torch.cat([model(tr.tokens_BT[:, t: t + 1], routing="causal", caches=caches,
                                    pos_BS=torch.full((len(PROMPTS), 1), t)).logits.float() for t in range(T)], 1)
        full = model(tr.tokens_BT[:, :T], routing="causal")
    v = tr.valid_BT  # each row computes its prompt and new tokens (prefill, then decoding)
    torch.testing.assert_close(tr.logits_BTV[v], full.logits.float()[v], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step_BTV[v], full.logits.float()[v], rtol=1e-5, atol=1e-5)
    # Which tokens each layer's cache holds: the attention's routed tokens, or all with kv: all.
    for block, c in zip(model.blocks, caches):
        attn_route = block if isinstance(block, MoDBlock) else block.attn if isinstance(block.attn, MoDBlock) else None
        if attn_route is None or attn_route.kv_all:
            assert c.len_B.tolist() == [T] * len(PROMPTS)
        else:
            assert torch.equal(c.len_B, attn_route.last_selected_BS.sum(1))
            assert len(set(c.len_B.tolist())) > 1


# Padding patterns of one row of 12 (False = padding): left, holes, right. Row 0 has none.
PADDED = torch.tensor([[True] * 12,
                       [False] * 4 + [True] * 8,
                       [False, True, True, False, False, True, True, True, False, True, True, True],
                       [True] * 9 + [False] * 3])


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_padded_key_never_contributes_whatever_the_padding_pattern(variant, monkeypatch):
    """Bug caught: K/V-from-all attention ignored the key mask (`kv_valid_BT`): a valid query attended
    to padding keys at earlier positions (left padding, holes); harmless only for right padding.
    Reference: each row alone, its valid tokens only, at the positions they have in the batch."""
    from mode.model import layers

    # No query row is all-masked, padding slots included (the wrapper discards them): an all-masked
    # softmax is NaN on some SDPA backends (this CPU's returns 0), and a NaN poisons gradients.
    rows_ok, sdpa = [], layers.sdpa

    def checked_sdpa(q, k, v, attn_mask=None, **kw):
        rows_ok.append(attn_mask is None or bool(attn_mask.any(-1).all()))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(layers, "sdpa", checked_sdpa)
    model = model_of(variant, dtype=torch.float64).eval()
    B, P = PADDED.shape
    ids = torch.randint(0, V, (B, P), generator=torch.Generator().manual_seed(6))
    pos = torch.arange(P).expand(B, P)
    with torch.no_grad():
        out = model(ids, routing="causal", valid_BS=PADDED).logits
        for i in range(B):
            v = PADDED[i]
            alone = model(ids[i:i + 1, v], routing="causal", pos_BS=pos[i:i + 1, v]).logits[0]
            # float64, but the routers run in fp32 (the row's batch mates change its GEMM's rounding)
            torch.testing.assert_close(out[i, v], alone, rtol=1e-6, atol=1e-6, msg=lambda m: f"row {i}: {m}")
    assert rows_ok and all(rows_ok)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_padded_decoding_step_leaves_no_key_in_the_cache(variant):
    """Bug caught: at a decoding step whose token is padding (`valid_BS` False), K/V-from-all attention
    still appended that token's K/V to the cache and later tokens attended to it (a plain routed block
    skips the row, a dense layer writes the slot without counting it). Reference: the row alone, one
    valid token per step, at the same positions."""
    model = model_of(variant).eval()
    B, P = PADDED.shape
    ids = torch.randint(0, V, (B, P), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        caches = model.new_caches(B, P)
        step = torch.cat([model(ids[:, t:t + 1], routing="causal", caches=caches, valid_BS=PADDED[:, t:t + 1],
                                pos_BS=torch.full((B, 1), t)).logits for t in range(P)], 1)
        for block, c in zip(model.blocks, caches):  # a layer whose attention sees every token counts the valid ones
            attn = block if isinstance(block, MoDBlock) else block.attn if isinstance(block.attn, MoDBlock) else None
            if attn is None or attn.kv_all:
                assert c.len_B.tolist() == PADDED.sum(1).tolist()
        for i in range(B):
            ts = PADDED[i].nonzero()[:, 0].tolist()
            alone_c = model.new_caches(1, len(ts))
            alone = torch.cat([model(ids[i:i + 1, t:t + 1], routing="causal", caches=alone_c,
                                     pos_BS=torch.tensor([[t]])).logits for t in ts], 1)[0]
            torch.testing.assert_close(step[i, ts], alone, rtol=1e-5, atol=1e-5, msg=lambda m: f"row {i}: {m}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_flops_and_params_equal_flop_counter(variant):
    """S = 90: capacity * S is not a whole number for most capacities (22.5, 67.5, 11.25), so the
    count must use the k the router really takes (k / S), not the capacity fraction."""
    mod = VARIANTS[variant]
    over = [f"model.mod.{k}={v}" for k, v in mod.items()]
    cfg = load_config(ROOT / "configs/tiny/dense.yaml", ["model.d_model=64", "model.n_heads=4", "model.d_ff=256",
                                                           "model.n_layers=4", "data.seq_len=90", *over])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    x = torch.randint(0, 256, (2, cfg.data.seq_len))
    with flop_counter() as fc, torch.no_grad():
        model(x)
    c = count(cfg)
    assert c["params"] == sum(p.numel() for p in model.parameters())
    assert c["forward_flops_per_token"] == pytest.approx(fc.get_total_flops() / x.numel(), rel=1e-12)


def test_kv_all_costs_more_than_selected_and_decoupled_counts_both_routers():
    base = ["model.mod.layers=every", "model.mod.capacity=0.25"]
    sel = count(load_config(ROOT / "configs/tiny/dense.yaml", base))
    kv_all = count(load_config(ROOT / "configs/tiny/dense.yaml", base + ["model.mod.kv=all"]))
    assert kv_all["forward_flops_per_token"] > sel["forward_flops_per_token"]
    assert kv_all["params"] == sel["params"]
    dec = count(load_config(ROOT / "configs/tiny/dense.yaml", base + ["model.mod.decoupled=true"]))
    d, h = 128, 64  # the tiny preset: d_model 128, predictor hidden d/2
    router = d + 1 + d * h + h + h + 1
    assert dec["params"] == sel["params"] + 4 * router


@pytest.mark.parametrize("override,needle", [
    ("model.mod.capacity=[0.5,0.25,0.5]", "model.mod.capacity=[0.5, 0.25, 0.5]: a fraction or a list of 2"),
    ("model.mod.capacity=[0.5,0]", "a fraction in (0, 1]"),
    ("model.mod.attn_capacity=0.5", "null unless model.mod.decoupled is true"),
    ("model.mod.kv=some", "model.mod.kv='some': selected or all"),
    # bug caught: a wrong type in a capacity list said "a value of type Union"
    ("model.mod.capacity=[0.5,abc]", "model.mod.capacity=[0.5, 'abc']: a value of type float or list of float"),
])
def test_bad_variant_configs_are_refused(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/tiny/dense.yaml", ["model.mod.layers=every_other", override])
    assert needle in str(e.value)


def test_a_capacity_list_with_layers_out_of_order_is_refused():
    """layers [3, 1] with capacities [0.125, 0.5] gave layer 1 0.125 and layer 3 0.5 (the list pairs
    with the sorted layers), silently; in increasing order it pairs as written."""
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/tiny/dense.yaml", ["model.mod.layers=[3,1]", "model.mod.capacity=[0.125,0.5]"])
    assert str(e.value).startswith("config error: model.mod.layers=[3, 1]: distinct layer indices in increasing order")
    cfg = load_config(ROOT / "configs/tiny/dense.yaml", ["model.mod.layers=[1,3]", "model.mod.capacity=[0.125,0.5]"])
    assert [lp.block.capacity for lp in layer_plan(cfg.model) if lp.block] == [0.125, 0.5]
    load_config(ROOT / "configs/tiny/dense.yaml", ["model.mod.layers=[3,1]", "model.mod.capacity=0.5"])  # one value


@pytest.mark.parametrize("overrides,expect", [
    (["model.mod.capacity=[0.5,0.33,0.165]"], "{1: block 0.5, 3: block 0.33, 5: block 0.165}"),
    (["model.mod.decoupled=true", "model.mod.attn_capacity=0.4", "model.mod.mlp_capacity=[0.25,0.5,0.25]"],
     "{1: attn 0.4 / mlp 0.25, 3: attn 0.4 / mlp 0.5, 5: attn 0.4 / mlp 0.25}"),
    (["model.mod.kv=all", "model.mod.capacity=0.215"], "1: block 0.215 K/V from all,"),
    # the paper's random control said only "(threshold causal)", as a learned router would
    (["model.mod.routing=stochastic", "model.mod.causal=threshold"], "} (stochastic top-k: the random control; "
                                                                      "threshold causal)"),
])
def test_start_block_shows_each_routed_layers_capacities(overrides, expect):
    """The console's start block reads the layer plan: per-layer and per-sublayer capacities and
    K/V-from-all are what the run was configured with, not model.mod.capacity alone."""
    from mode.console import routing_summary

    cfg = load_config(ROOT / "configs/tiny/mod.yaml", ["model.n_layers=6", *overrides])
    assert expect in routing_summary(cfg)


@pytest.mark.parametrize("preset", ["dense", "mod", "moe", "mode_staged", "mode_integrated"])
def test_active_params_counts_top_k_of_each_layers_experts(preset):
    """Active parameters per token, against the built model: every parameter except, in each
    expert layer, the weights of the E - top_k experts a token does not use."""
    from mode.console import active_params

    cfg = load_config(ROOT / f"configs/tiny/{preset}.yaml")
    model = build_model(cfg.model)
    total = sum(p.numel() for p in model.parameters())
    E, k = cfg.model.moe.num_experts, cfg.model.moe.top_k
    unused = sum(p.numel() // E * (E - k) for n, p in model.named_parameters() if n.endswith((".w_in", ".w_out")))
    assert active_params(cfg, total) == total - unused


@pytest.mark.slow
def test_variant_metrics_reach_tensorboard(tmp_path):
    run = tmp_path / "run"
    mode_cli("train", "--config", "configs/tiny/mod.yaml", *TINY, "model.mod.decoupled=true",
             "model.mod.attn_capacity=0.75", "model.mod.mlp_capacity=[0.25]", "model.mod.kv=all",
             "train.max_steps=4", "train.log_every=2", "train.eval_every=4", f"run.dir={run}")
    assert scalars(run, "mod_attn/layer1/processed_frac")[4] == pytest.approx(0.75)
    assert scalars(run, "mod_mlp/layer1/processed_frac")[4] == pytest.approx(0.25)
    assert 4 in scalars(run, "eval/loss_causal")


def _grid_variants():
    """The routed variants of configs/experiments/mod_variants.yaml (config, overrides) and the MoDE presets."""
    import yaml

    grid = yaml.safe_load((ROOT / "configs/experiments/mod_variants.yaml").read_text())["variants"]
    out = {name: ((ROOT / "configs/experiments" / v["config"]).resolve(), v.get("overrides", []))
           for name, v in grid.items() if name != "dense"}  # dense: tests/test_train.py
    return {**out, **{p: (ROOT / f"configs/tiny/{p}.yaml", []) for p in ("mode_staged", "mode_integrated")}}


# 8 steps of 2 micro-batches, checkpoints every 2, evaluations at 3 and 6 (one on each side of the cut at 4).
RESUME = [*TINY, "train.max_steps=8", "train.log_every=1", "train.eval_every=3", "checkpoint.every=2",
          "optim.warmup_steps=2", "train.micro_batch_size=2", "train.grad_accum=2"]


def _resumed_equals_straight(tmp_path, launch):
    from tests.util import side_by_side
    from mode import checkpoint as ckpt

    side_by_side(lambda: launch(f"run.dir={tmp_path / 'straight'}"),
                 lambda: launch("train.stop_at=4", f"run.dir={tmp_path / 'resumed'}"))
    launch(f"run.dir={tmp_path / 'resumed'}")
    for tag in ("train/loss", "train/aux_loss", "train/grad_norm", "eval/loss", "eval/loss_causal"):
        a, b = scalars(tmp_path / "straight", tag), scalars(tmp_path / "resumed", tag)
        assert a and a == b, (tag, a, b)  # bit for bit
    assert list(scalars(tmp_path / "straight", "eval/loss")) == [0, 3, 6, 8]
    a, b = (torch.load(ckpt.step_dir(ckpt.checkpoints_dir(tmp_path / r), 8) / ckpt.MODEL, weights_only=True)
            for r in ("straight", "resumed"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.slow
@pytest.mark.parametrize("variant", _grid_variants())
def test_resume_is_exact_for_every_routing_variant(tmp_path, variant):
    """N steps == N/2, resume, N/2 for every variant the grid compares (and the MoDE presets): the
    logged losses, the evaluations on both sides of the cut and the final weights (routers,
    predictors, experts), bit for bit, with gradient accumulation. tests/test_train.py checks dense."""
    config, over = _grid_variants()[variant]
    prepared = tmp_path / "prepared"
    _resumed_equals_straight(tmp_path, lambda *o: mode_cli("train", "--config", config, *RESUME, *over,
                                                          f"data.prepared_dir={prepared}", *o, threads=1))


@pytest.mark.slow
def test_resume_is_exact_for_stochastic_threshold_routing_on_two_ranks(tmp_path):
    """Two ranks over gloo through the DeepSpeed launcher: stochastic routing draws from each rank's
    own RNG, and the calibrated thresholds are averaged across ranks every step; K/V-from-all and a
    per-layer schedule on top. The resumed run restores both ranks' states exactly."""
    from tests.util import deepspeed_train

    over = ["model.n_layers=4", "model.mod.routing=stochastic", "model.mod.causal=threshold", "model.mod.kv=all",
            "model.mod.capacity=[0.5, 0.25]", f"data.prepared_dir={tmp_path / 'prepared'}"]
    _resumed_equals_straight(tmp_path, lambda *o: deepspeed_train(2, "configs/tiny/mod.yaml", *RESUME, *over, *o))

"""Staged and integrated MoDE: the compositions and the properties that define them."""
import pytest
import torch

from mode.config import load_config
from mode.mod import MoDBlock
from mode.model import build_model
from mode.model.blocks import Block
from mode.routed import Ctx
from tests.util import ROOT

SMALL = ["model.d_model=32", "model.n_heads=2", "model.d_ff=64", "data.seq_len=32", "model.max_seq_len=64"]


def cfg_of(preset, *extra):
    return load_config(ROOT / f"configs/tiny/{preset}.yaml", [*SMALL, *extra])


def test_staged_is_mod_around_moe_block():
    model = build_model(cfg_of("mode_staged").model)
    routed = [b for b in model.blocks if isinstance(b, MoDBlock)]
    assert routed and all(isinstance(b.inner, Block) and b.inner.mlp.mlp.tag.startswith("moe/") for b in routed)


def test_staged_expert_capacity_is_computed_on_the_tokens_that_reached_it():
    cfg = cfg_of("mode_staged", "model.mod.capacity=0.25", "model.moe.capacity_factor=1.0", "model.moe.top_k=1")
    torch.manual_seed(0)
    model = build_model(cfg.model)
    B, S = 4, 32
    model(torch.randint(0, 256, (B, S)))
    blk = next(b for b in model.blocks if isinstance(b, MoDBlock))
    r = blk.inner.mlp.mlp.last_routing
    k = round(0.25 * S)
    assert r.idx_TK.shape[0] == B * k  # only the depth-selected tokens reached the expert router
    # capacity from T = B * k tokens: ceil(cf * top_k * T / E) per expert
    E = cfg.model.moe.num_experts
    assert int(r.kept_E.max()) <= -(-1 * B * k // E)
    assert blk.inner.mlp.mlp.last_engaged_BS.shape == (B, k)


def test_integrated_with_no_noops_equals_the_moe_block():
    torch.manual_seed(0)
    a = build_model(cfg_of("mode_integrated", "model.moe.num_noop_experts=0").model)
    torch.manual_seed(0)
    b = build_model(cfg_of("moe_dropping").model)
    b.load_state_dict(a.state_dict())
    x = torch.randint(0, 256, (3, 32))
    oa, ob = a(x, x), b(x, x)
    assert torch.equal(oa.logits, ob.logits) and torch.equal(oa.aux_loss, ob.aux_loss)


def test_tokens_routed_only_to_noops_are_bit_identical_after_the_mlp_step():
    cfg = cfg_of("mode_integrated", "model.moe.capacity_factor=null")
    torch.manual_seed(0)
    model = build_model(cfg.model)
    blk = model.blocks[1]
    with torch.no_grad():
        blk.mlp.mlp.router.weight.normal_(std=1.0)  # sharp routing: some tokens pick two no-ops
    seen = {}
    blk.attn.register_forward_hook(lambda m, i, o: seen.update(h=i[0], a=o))
    x = torch.randn(2, 32, 32)
    pos = torch.arange(32).expand(2, 32)
    delta = blk(x, Ctx(pos))
    only_noop = (blk.mlp.mlp.last_routing.idx_TK >= cfg.model.moe.num_experts).all(-1).view(2, 32)
    assert only_noop.any() and (~only_noop).any()
    after_attn = x + seen["a"]
    out = x + delta
    # the block's output for those tokens is exactly the residual after attention: no MLP update
    assert torch.equal(out[only_noop], after_attn[only_noop])
    assert not torch.equal(out[~only_noop], after_attn[~only_noop])


@pytest.mark.parametrize("preset", ["mode_staged", "mode_integrated"])
def test_causal_routing_never_looks_ahead(preset):
    # dropless experts: capacity over the batch would couple positions (a route dropped because a
    # LATER token took the slot); token-choice routing itself is causal.
    cfg = cfg_of(preset, "model.moe.capacity_factor=null", "model.moe.eval_capacity_factor=null")
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    for b in model.blocks:
        if isinstance(b, MoDBlock):
            torch.nn.init.normal_(b.router.predictor[2].weight, std=3.0 / b.router.predictor[2].weight.shape[1] ** 0.5)
    x = torch.randint(0, 256, (2, 32))
    y = x.clone()
    y[:, 20:] = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        a, b = model(x, routing="causal").logits, model(y, routing="causal").logits
    assert torch.allclose(a[:, :20], b[:, :20], atol=1e-6)
    assert not torch.allclose(a[:, 20:], b[:, 20:])


@pytest.mark.parametrize("routing", ["topk", "causal"])
def test_staged_block_equals_bruteforce_composition(routing):
    """Staged MoDE from independent parts: per row, the top-k tokens of a Python sort of r (causal:
    the predictor's sign), attention among them at their original positions written out from the
    weights, then the brute-force MoE loop of tests/test_moe.py over the selected tokens of every
    row (row by row, position order; capacity from their number, dropless at sampling time), and
    x + r * (attention + experts) on the selected tokens. Float64 weights, fp32 routers.
    Bugs caught: experts seeing unselected tokens or capacity from the whole sequence, a wrong
    token order into the expert router (changes which routes drop), g(r) missing on the MoE part."""
    from tests.test_mod_variants import ref_attn, ref_select, rms
    from tests.test_moe import reference

    cfg = cfg_of("mode_staged", "model.mod.capacity=0.375", "model.moe.capacity_factor=0.5")
    torch.manual_seed(0)
    model = build_model(cfg.model).double()
    blk = next(b for b in model.blocks if isinstance(b, MoDBlock))
    moe = blk.inner.mlp.mlp
    with torch.no_grad():  # routers spread (at init std 0.02 they barely separate tokens)
        torch.nn.init.normal_(blk.router.router.weight, std=2.0 / 32 ** 0.5)
        torch.nn.init.normal_(blk.router.predictor[2].weight, std=3.0 / blk.router.predictor[2].weight.shape[1] ** 0.5)
        moe.router.weight.normal_(std=1.0)
    x0 = torch.randn(3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x, xr = x0.clone().requires_grad_(), x0.clone().requires_grad_()  # the block's input, the reference's
    pos = torch.arange(32).expand(3, 32)
    delta = blk(x, Ctx(pos, routing=routing))
    sel_rows, attn_rows = [], []
    for b in range(3):
        r_S, sel = ref_select(blk, xr[b], routing)
        sel_rows.append((r_S, sel))
        attn_rows.append(ref_attn(blk.inner.attn, xr[b], sel, sel))
    h_TD = torch.cat([xr[b, sel] + a for b, ((_, sel), a) in enumerate(zip(sel_rows, attn_rows))])
    mc = cfg.model.moe
    if routing == "causal":  # sampling time: inference_capacity_factor (null: dropless)
        from dataclasses import replace

        mc = replace(mc, capacity_factor=mc.inference_capacity_factor)
    y_TD, _, met, _ = reference(rms(blk.inner.mlp.norm, h_TD), moe.router.weight, moe.w_in, moe.w_out, mc,
                                cfg.model.mlp)
    want = torch.zeros_like(x0)
    t = 0
    for b, ((r_S, sel), a) in enumerate(zip(sel_rows, attn_rows)):
        n = len(sel)
        want[b, sel] = r_S[sel, None].double() * (a + y_TD[t:t + n])
        t += n
    assert 0 < t < x.shape[0] * x.shape[1]
    if routing == "topk":
        assert float(met["dropped_routes_frac"]) > 0  # the case really drops
    else:
        assert len({len(s) for _, s in sel_rows}) > 1  # ragged rows
    torch.testing.assert_close(delta, want, rtol=1e-6, atol=1e-8)
    # and the gradients of the update (the router through g(r), attention, experts, the input)
    g = torch.randn(x0.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    params = [blk.router.router.weight, blk.inner.attn.attn.qkv.weight, blk.inner.attn.attn.out.weight,
              moe.router.weight, moe.w_in, moe.w_out]
    got = torch.autograd.grad((delta * g).sum(), [x, *params])
    ref = torch.autograd.grad((want * g).sum(), [xr, *params])
    for name, a, b in zip(["x", "router", "qkv", "out", "expert router", "w_in", "w_out"], got, ref):
        assert b.abs().max() > 0, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)

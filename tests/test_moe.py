"""Mixture-of-Experts layers: router semantics against a brute-force loop, backends against each other.

Shape legend: T tokens, D d_model, E real experts, N no-op experts, K top_k.
"""
from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

from mode.config import ConfigError, ModelConfig, MoEConfig, load_config
from mode.model.layers import MLP
from mode.moe import build_moe_mlp
from mode.moe.native import NativeMoE
from mode.routing.experts import expert_capacity


def model_cfg(mlp="swiglu", d=16, f=32, **moe) -> ModelConfig:
    cfg = ModelConfig(d_model=d, d_ff=f, n_heads=2, n_layers=2, mlp=mlp, moe=MoEConfig(layers="every", **moe))
    cfg.validate()
    return cfg


def native(cfg: ModelConfig, seed=0, router_scale=10.0) -> NativeMoE:
    torch.manual_seed(seed)
    m = NativeMoE(cfg, 0)
    with torch.no_grad():  # sharper routing: overflow and distinct probabilities
        m.router.weight.mul_(router_scale)
        m.w_in.normal_(std=0.3)
        m.w_out.normal_(std=0.3)
    return m


def act(h, kind):
    if kind == "swiglu":
        g, u = h.chunk(2, -1)
        return F.silu(g) * u
    return F.gelu(h)


# ------------------------------------------------------------------------------------------------
# The brute-force reference: the semantics in mode/routing/experts.py's docstring, spelled out
# with Python loops over tokens and routes.


def reference(x_TD, Wr, w_in, w_out, mc: MoEConfig, kind, valid=None, training=True):
    E, N, K = mc.num_experts, mc.num_noop_experts, mc.top_k
    T = x_TD.shape[0]
    valid = [True] * T if valid is None else [bool(v) for v in valid]
    n = sum(valid)
    logits = x_TD.float() @ Wr.float().t()
    probs = logits.softmax(-1)
    choice = {}  # (t, j) -> expert
    for t in range(T):
        if valid[t]:
            ranked = sorted(range(E + N), key=lambda e: -probs[t, e].item())
            for j in range(K):
                choice[(t, j)] = ranked[j]
    real = [(t, j) for j in range(K) for t in range(T) if (t, j) in choice and choice[(t, j)] < E]  # route order
    cf = mc.capacity_factor if training or mc.eval_capacity_factor is None else mc.eval_capacity_factor
    cap = math.inf if cf is None else max(math.ceil(Fraction(str(cf)) * K * n / E), mc.min_capacity)  # exact
    kept = set()
    for e in range(E):
        mine = [r for r in real if choice[r] == e]
        if mc.drop_policy == "probability":
            mine.sort(key=lambda r: -probs[r[0], e].item())  # stable: ties stay in route order
        kept |= set(mine[:cap] if cap != math.inf else mine)
    rows = []
    for t in range(T):
        y = x_TD.new_zeros(x_TD.shape[1], dtype=torch.float32)
        if valid[t]:
            p = [probs[t, choice[(t, j)]] for j in range(K)]
            live = [(t, j) in kept or choice[(t, j)] >= E for j in range(K)]
            if K > 1 and mc.normalize_weights:
                denom = sum(pj for pj, lj in zip(p, live) if lj or not mc.renormalize_after_drop)
                p = [pj / denom for pj in p]
            for j in range(K):
                if (t, j) in kept:
                    e = choice[(t, j)]
                    y = y + p[j] * (act(x_TD[t] @ w_in[e], kind) @ w_out[e])
        rows.append(y)
    y_TD = torch.stack(rows)
    counts = torch.tensor([sum(1 for r in real if choice[r] == e) for e in range(E)], dtype=torch.float32)
    kept_e = torch.tensor([sum(1 for r in kept if choice[r] == e) for e in range(E)], dtype=torch.float32)
    vmask = torch.tensor(valid)
    pe = probs[vmask][:, :E]
    if N and mc.noop_balance == "include":  # balance over all E + N outputs
        all_counts = torch.tensor([sum(1 for r in choice.values() if r == e) for e in range(E + N)],
                                  dtype=torch.float32)
        lb = (E + N) * (all_counts / all_counts.sum() * probs[vmask].mean(0)).sum()
    else:
        if N:
            pe = pe / pe.sum(-1, keepdim=True)
        lb = E * (counts / counts.sum() * pe.mean(0)).sum()
    z = torch.logsumexp(logits[vmask], -1).square().mean()
    asked = {t for (t, j) in real}
    got = {t for (t, j) in kept}
    metrics = {
        "dropped_routes_frac": (counts.sum() - len(kept)) / counts.sum(),
        "dropped_tokens_frac": torch.tensor(len(asked - got) / n),
        "engaged_frac": torch.tensor(len(got) / n),  # a real expert processed >= 1 of its routes
        "load_max": kept_e.max() * E / (K * n),
        "load_mean": kept_e.mean() * E / (K * n),
        "lb_loss": lb,
        "z_loss": z,
    }
    if N:
        metrics["noop_frac"] = torch.tensor(sum(1 for e in choice.values() if e >= E) / (K * n))
    kept_routes = {(t, j, choice[(t, j)]) for (t, j) in kept}
    return y_TD, mc.lb_loss_weight * lb + mc.z_loss_weight * z, metrics, kept_routes


@pytest.mark.parametrize("cf", [0.3, 0.6, 1.2])
def test_native_dropping_at_a_factor_float32_rounds_equals_bruteforce(cf):
    """At capacity factors whose float32 product rounds up (T=200, E=4: 0.3 -> 15 slots, float32 16)
    the layer keeps exactly the ceiling's routes (bug caught: one route per expert more)."""
    cfg = model_cfg(num_experts=4, top_k=1, capacity_factor=cf, lb_loss_weight=0.0)
    m = native(cfg)
    torch.manual_seed(0)
    x = torch.randn(2, 100, 16) + 2.0 * torch.randn(16)  # a shared direction: the router overloads experts
    y = m(x).view(200, 16)
    params = [p.detach().clone() for p in (m.router.weight, m.w_in, m.w_out)]
    y_ref, _, _, kept_ref = reference(x.view(200, 16), *params, cfg.moe, cfg.mlp)
    assert kept_routes(m) == kept_ref
    load = torch.bincount(torch.tensor([e for _, _, e in kept_ref]), minlength=4)
    assert int(load.max()) == math.ceil(Fraction(str(cf)) * 200 / 4)  # an expert is full: the boundary is tested
    torch.testing.assert_close(y, y_ref)


def kept_routes(layer) -> set:
    r = layer.last_routing
    return {(t, j, int(r.idx_TK[t, j])) for t, j in r.keep_TK.nonzero().tolist()}


@pytest.mark.parametrize("renorm", [False, True])  # renormalize_after_drop: over surviving + no-op routes
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("policy", ["position", "probability"])
@pytest.mark.parametrize("noops,balance", [(0, "exclude"), (2, "exclude"), (2, "include")])
@pytest.mark.parametrize("k", [1, 2])
def test_native_dropping_equals_bruteforce(policy, noops, balance, k, padded, renorm):
    cfg = model_cfg(num_experts=4, num_noop_experts=noops, top_k=k, capacity_factor=0.5, drop_policy=policy,
                    z_loss_weight=1e-3, lb_loss_weight=0.01, noop_balance=balance, renormalize_after_drop=renorm)
    m = native(cfg)
    m.padded_groups = padded  # both group layouts (exact on CPU, padded static on accelerators)
    x = torch.randn(2, 12, 16)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(24, 16)
    y = m(x1).view(24, 16)
    ((y * g).sum() + m.aux_loss).backward()
    params = [m.router.weight, m.w_in, m.w_out]
    ref_params = [p.detach().clone().requires_grad_() for p in params]
    y_ref, aux_ref, met_ref, kept_ref = reference(x2.view(24, 16), *ref_params, cfg.moe, cfg.mlp)
    ((y_ref * g).sum() + aux_ref).backward()

    assert kept_routes(m) == kept_ref  # which routes survive
    assert 0 < m.metrics["dropped_routes_frac"] < 1  # the case really drops
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(m.aux_loss, aux_ref)
    assert set(m.metrics) == set(met_ref)
    for name, v in met_ref.items():
        torch.testing.assert_close(m.metrics[name], v.float(), msg=name)
    torch.testing.assert_close(x1.grad, x2.grad)
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("eval_cf", [0.25, 1.0])
def test_eval_capacity_padding_and_min_capacity(eval_cf):
    """Eval mode uses eval_capacity_factor; padded tokens take no part in routing or capacity.
    At 0.25 min_capacity binds; at 1.0 there are free slots a padding route could take."""
    cfg = model_cfg(num_experts=4, top_k=2, capacity_factor=1.0, eval_capacity_factor=eval_cf, min_capacity=3)
    m = native(cfg).eval()
    x = torch.randn(1, 20, 16)
    valid = torch.arange(20)[None] < 14
    y = m(x, valid)
    y_ref, _, met_ref, kept_ref = reference(x[0], m.router.weight, m.w_in, m.w_out, cfg.moe, cfg.mlp,
                                            valid=valid[0], training=False)
    assert kept_routes(m) == kept_ref
    torch.testing.assert_close(y[0], y_ref)
    assert (y[0, 14:] == 0).all() and not m.last_engaged_BS[0, 14:].any()
    torch.testing.assert_close(m.metrics["dropped_tokens_frac"], met_ref["dropped_tokens_frac"].float())
    # The valid prefix alone routes identically: padding changed neither capacity nor ranks.
    torch.testing.assert_close(m(x[:, :14]), y[:, :14])


def test_router_jitter_only_while_training():
    """Bug caught: multiplicative router jitter applied at evaluation (noisy, irreproducible eval
    and sampling). Reference: the same layer with jitter 0."""
    x = torch.randn(1, 24, 16)
    y = {}
    for jitter in (0.0, 0.5):
        m = native(model_cfg(num_experts=4, top_k=2, capacity_factor=None, jitter=jitter), router_scale=1.0)
        y[jitter, "eval"] = m.eval()(x)
        torch.manual_seed(1)
        y[jitter, "train"] = m.train()(x)
    assert torch.equal(y[0.0, "eval"], y[0.5, "eval"])
    assert not torch.allclose(y[0.0, "train"], y[0.5, "train"])  # the jitter is real: it moves training


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
@pytest.mark.parametrize("cf", [None, 1.0])
def test_one_expert_top1_equals_dense_mlp(mlp, cf):
    cfg = model_cfg(mlp=mlp, num_experts=1, top_k=1, capacity_factor=cf)
    m = native(cfg)
    dense = MLP(16, 32, mlp)
    with torch.no_grad():
        dense.w_in.weight.copy_(m.w_in[0].t())
        dense.w_out.weight.copy_(m.w_out[0].t())
    x = torch.randn(3, 7, 16)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(3, 7, 16)
    y, y_dense = m(x1), dense(x2)
    torch.testing.assert_close(y, y_dense)
    (y * g).sum().backward()
    (y_dense * g).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad)
    torch.testing.assert_close(m.w_in.grad[0], dense.w_in.weight.grad.t())
    torch.testing.assert_close(m.w_out.grad[0], dense.w_out.weight.grad.t())
    assert float(m.metrics["dropped_tokens_frac"]) == 0.0


def test_noop_routes_get_exactly_zero_update():
    """Integrated MoDE: a token whose routes all land on no-op experts gets a bit-exact zero."""
    cfg = model_cfg(num_experts=2, num_noop_experts=6, top_k=2, capacity_factor=None)
    m = native(cfg)
    x = torch.randn(4, 16, 16, requires_grad=True)
    y = m(x)
    r = m.last_routing
    only_noop = (r.idx_TK >= 2).all(-1).view(4, 16)
    assert only_noop.any() and (~only_noop).any()
    assert (y[only_noop] == 0).all()
    assert not m.last_engaged_BS[only_noop].any()
    assert 0 < float(m.metrics["noop_frac"]) < 1
    y.sum().backward()  # no-op experts have no parameters; gradients stay finite
    assert torch.isfinite(x.grad).all()


def test_noop_exclude_balance_renormalises_tokens_that_strongly_prefer_noops():
    """Bug caught: with noop_balance=exclude, P_e (real-expert probabilities renormalised over the
    real experts) divided by the real-probability sum clamped at float32 eps (1.2e-7), so a token
    whose real experts together had less than that (a no-op logit margin of ~16) added less than 1
    to sum_e P_e and the balance loss came out too small. Reference: softmax over the real logits."""
    cfg = model_cfg(num_experts=2, num_noop_experts=2, top_k=1, capacity_factor=None, noop_balance="exclude",
                    lb_loss_weight=1.0, z_loss_weight=0.0)
    m = native(cfg, router_scale=1.0)
    x = torch.randn(1, 8, 16)
    x[..., 0] = (torch.arange(8) % 2).float()  # odd tokens carry a feature that only the no-ops read
    with torch.no_grad():
        m.router.weight[:, 0] = torch.tensor([0.0, 0.0, 30.0, 30.0])
    m(x)
    logits = x[0].double() @ m.router.weight.detach().double().t()
    assert (logits[1::2].softmax(-1)[:, :2].sum(-1) < 1e-9).all()  # far below float32 eps
    r = m.last_routing
    f = torch.bincount(r.idx_TK[r.idx_TK < 2], minlength=2).double()
    P = logits[:, :2].softmax(-1).mean(0)
    want = 2 * (f / f.sum() * P).sum()
    torch.testing.assert_close(m.metrics["lb_loss"].double(), want, rtol=1e-6, atol=0)


def test_capacity_is_the_exact_ceiling_deepspeeds_where_its_float32_is_exact():
    """DESIGN 3.2: ceil(capacity_factor * k * T / E). Bug caught: capacity was DeepSpeed's float32
    expression, one slot more than that for some factors (T=200, E=4, top-1, 0.3: 16, not 15),
    while README and DESIGN state the ceiling. Checked against exact rationals, and against
    DeepSpeed's `_capacity` where its float32 product is exact."""

    from mode.moe.deepspeed import use_cpu_accelerator_without_cuda

    use_cpu_accelerator_without_cuda()
    from deepspeed.moe.sharded_moe import _capacity

    assert expert_capacity(200, 4, 0.3, 1, 1) == 15 and int(_capacity(torch.empty(200, 4), torch.tensor(0.3),
                                                                      torch.tensor(1))) == 16
    differs = 0
    for T in (1, 7, 100, 200, 333, 4096):
        for E in (1, 3, 4, 8, 64):
            for cf in (0.1, 0.3, 0.5, 0.6, 1.0, 1.2, 1.25, 2.0):
                for k in (1, 2, 3):
                    want = max(math.ceil(Fraction(str(cf)) * k * T / E), 2)
                    assert expert_capacity(T, E, cf, k, 2) == want, (T, E, cf, k)
                    assert int(expert_capacity(torch.tensor(T), E, cf, k, 2)) == want
                    ds = int(_capacity(torch.empty(T, E), torch.tensor(cf * k), torch.tensor(2)))
                    assert ds in (want, want + 1), (T, E, cf, k)
                    if cf in (0.5, 1.0, 1.25, 2.0):  # binary fractions: float32 is exact
                        assert ds == want, (T, E, cf, k)
                    differs += ds != want
    assert differs > 0  # the factors above do reach DeepSpeed's rounding


# ------------------------------------------------------------------------------------------------
# DeepSpeed backend: DeepSpeed's MoE layer (dispatch, experts, combine) vs native.


@pytest.fixture(scope="module")
def ds_world():
    import torch.distributed as dist

    from mode.moe.deepspeed import use_cpu_accelerator_without_cuda

    use_cpu_accelerator_without_cuda()
    import deepspeed

    if not dist.is_initialized():
        # A world of one on an in-memory store: no port, and no RANK/MASTER_PORT left in the
        # environment for the subprocesses other tests start.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def _ds_pair(cfg, stock_gate=False):
    from mode.moe.deepspeed import DeepSpeedMoE, copy_moe_weights

    nat = native(cfg, router_scale=5.0)
    ds = DeepSpeedMoE(cfg, 0, stock_gate=stock_gate)
    copy_moe_weights(nat, ds)
    return nat, ds


def _run(m, x, g):
    x = x.clone().requires_grad_()
    y = m(x)
    ((y * g).sum() + (0 if m.aux_loss is None else m.aux_loss)).backward()
    return y, x.grad


def _expert_grads(m):
    if isinstance(m, NativeMoE):
        return m.router.weight.grad, list(m.w_in.grad), list(m.w_out.grad)
    layer = m.moe.deepspeed_moe
    gw = layer.gate.router.weight.grad if hasattr(layer.gate, "router") else layer.gate.wg.weight.grad
    ex = layer.experts.deepspeed_experts
    return gw, [e.w_in.weight.grad.t() for e in ex], [e.w_out.weight.grad.t() for e in ex]


@pytest.mark.parametrize("k,cf,noops,policy", [(1, 0.5, 0, "position"), (2, 0.5, 0, "position"),
                                               (2, None, 0, "position"), (2, 0.5, 2, "probability")])
def test_native_and_deepspeed_agree(ds_world, k, cf, noops, policy):
    cfg = model_cfg(num_experts=4, top_k=k, capacity_factor=cf, num_noop_experts=noops, drop_policy=policy,
                    z_loss_weight=1e-3, backend="deepspeed")
    nat, ds = _ds_pair(cfg)
    x, g = torch.randn(2, 24, 16), torch.randn(2, 24, 16)
    (y1, dx1), (y2, dx2) = _run(nat, x, g), _run(ds, x, g)
    torch.testing.assert_close(y1, y2)
    torch.testing.assert_close(dx1, dx2)
    torch.testing.assert_close(nat.aux_loss, ds.aux_loss)
    assert set(nat.metrics) == set(ds.metrics)
    for name in nat.metrics:
        torch.testing.assert_close(nat.metrics[name], ds.metrics[name], msg=name)
    if cf is not None:
        assert float(ds.metrics["dropped_routes_frac"]) > 0
    for a, b in zip(_expert_grads(nat), _expert_grads(ds)):
        torch.testing.assert_close(a, b)
    assert torch.equal(nat.last_engaged_BS, ds.last_engaged_BS)


@pytest.mark.parametrize("k,cf", [(2, 0.5), (1, None)])
def test_native_reproduces_deepspeed_stock_gate(ds_world, k, cf):
    """DeepSpeed's own TopKGate (use_rts off, no 2nd-expert sampling): top-2 drops in position
    order and renormalises over surviving routes -> native with renormalize_after_drop matches.
    (Its top-1 gate picks overflow survivors by torch.topk tie order, so only dropless is comparable.)"""
    cfg = model_cfg(num_experts=4, top_k=k, capacity_factor=cf, renormalize_after_drop=True, backend="deepspeed")
    nat, ds = _ds_pair(cfg, stock_gate=True)
    nat.router.cfg.lb_loss_weight = ds.lb_weight = 0.0  # DS's top-2 balances on first choices only
    x, g = torch.randn(2, 24, 16), torch.randn(2, 24, 16)
    (y1, dx1), (y2, dx2) = _run(nat, x, g), _run(ds, x, g)
    torch.testing.assert_close(y1, y2)
    torch.testing.assert_close(dx1, dx2)
    for a, b in zip(_expert_grads(nat), _expert_grads(ds)):
        torch.testing.assert_close(a, b)
    for name in ("dropped_routes_frac", "dropped_tokens_frac", "load_max", "load_mean"):
        torch.testing.assert_close(nat.metrics[name], ds.metrics[name], msg=name)
    if k == 1:
        torch.testing.assert_close(nat.metrics["lb_loss"], ds.metrics["lb_loss"])


# ------------------------------------------------------------------------------------------------
# Wiring: the LM collects the layers' losses and metrics; configs refuse what cannot work.


def test_lm_collects_moe_metrics():
    from mode.model.lm import build_model

    cfg = ModelConfig(d_model=16, d_ff=32, n_heads=2, n_layers=2, vocab_size=64,
                      moe=MoEConfig(layers="every_other", num_experts=4, num_noop_experts=1, capacity_factor=0.5))
    cfg.validate()
    torch.manual_seed(0)
    lm = build_model(cfg)
    out = lm(torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16)))
    names = {"dropped_tokens_frac", "dropped_routes_frac", "engaged_frac", "noop_frac", "load_max", "load_mean",
             "lb_loss", "z_loss"}
    assert {f"moe/layer1/{n}" for n in names} <= set(out.metrics)
    assert float(out.aux_loss.detach()) > 0
    (out.loss + out.aux_loss).backward()
    assert lm.blocks[1].mlp.mlp.router.weight.grad.abs().sum() > 0
    assert lm.engaged_blocks().shape == (2, 2, 16)


def test_presets_and_config_errors():
    for preset in ("moe", "moe_dropping"):
        cfg = load_config(f"configs/tiny/{preset}.yaml")
        assert cfg.model.moe.layers == "every_other"
        load_config(f"configs/tiny/{preset}.yaml", ["model.moe.backend=deepspeed"])
    bad = [(["model.moe.top_k=9"], "model.moe.top_k"),
           (["model.moe.backend=deepspeed", "model.moe.ep_size=3"], "model.moe.ep_size"),
           (["model.moe.ep_size=2"], "model.moe.ep_size"),  # native has no expert parallelism
           (["model.moe.capacity_factor=0"], "model.moe.capacity_factor")]
    for overrides, key in bad:
        with pytest.raises(ConfigError) as e:
            load_config("configs/tiny/moe.yaml", overrides)
        assert str(e.value).startswith(f"config error: {key}=") and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="model.moe.ep_size"):  # must divide the world size
        load_config("configs/tiny/moe.yaml", ["model.moe.backend=deepspeed", "model.moe.ep_size=4"], world_size=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_megablocks_refused_cleanly_without_cuda():
    cfg = model_cfg(num_experts=4, backend="megablocks")
    with pytest.raises(ConfigError) as e:
        build_moe_mlp(cfg, 1)
    msg = str(e.value)
    assert msg.startswith("config error: model.moe.backend='megablocks'") and "\n" not in msg
    assert "pip install -e '.[megablocks]'" in msg


@pytest.mark.gpu
@pytest.mark.parametrize("k,cf,noops", [(1, 0.5, 0), (2, 1.0, 0), (2, None, 0), (1, 0.5, 2)])
def test_megablocks_matches_native(k, cf, noops):
    pytest.importorskip("megablocks")
    from mode.moe.megablocks import MegaBlocksMoE, copy_native_to_megablocks

    cfg = model_cfg(d=128, f=128, num_experts=4, top_k=k, capacity_factor=cf, num_noop_experts=noops,
                    backend="megablocks")
    nat = native(cfg, router_scale=2.0).cuda().bfloat16()  # grouped_gemm is bf16-only: compare in bf16
    mb = MegaBlocksMoE(cfg, 0).cuda().bfloat16()
    copy_native_to_megablocks(nat, mb)
    # ... and a megablocks run's state dict reads back into the native layout (mode generate/eval/export)
    from copy import deepcopy
    from types import SimpleNamespace

    from mode.portable import megablocks_to_native

    _, back = megablocks_to_native(SimpleNamespace(model=deepcopy(cfg)), mb.state_dict())
    assert sorted(back) == sorted(nat.state_dict())
    for k, v in nat.state_dict().items():
        assert torch.equal(back[k].float(), v.float()), k  # the router stays in the run's dtype
    x = torch.randn(2, 64, 128, device="cuda", dtype=torch.bfloat16)
    g = torch.randn_like(x)
    (y1, dx1), (y2, dx2) = _run(nat, x, g), _run(mb, x, g)
    assert torch.equal(nat.last_routing.keep_TK, mb.router(x.view(-1, 128)).keep_TK)  # same decisions
    # bf16 GEMMs accumulate in different orders, and MegaBlocks' backward sums a token's K routes in
    # bf16: on an H200 0.2% of dx's elements differed by up to 0.0625 (4 bf16 steps at magnitude 2),
    # so the whole tensors are compared (relative norm); a wrong expert or slot is off by ~100%.
    for name, a, b in (("y", y2, y1), ("dx", dx2, dx1), ("router grad", mb.router.weight.grad, nat.router.weight.grad)):
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert rel < 2e-2, (name, rel)
    for name in nat.metrics:
        torch.testing.assert_close(nat.metrics[name], mb.metrics[name], msg=name)


def _megablocks_layout(nat: NativeMoE) -> dict:
    """The state dict a MegaBlocksMoE holding `nat`'s weights has (bf16 [E*F, D] matrices), written by
    copy_native_to_megablocks, which the GPU test above checks against MegaBlocks' own layers; the
    module here only has MegaBlocks' parameter names and shapes (MegaBlocks needs CUDA to build)."""
    from torch import nn

    from mode.moe.megablocks import copy_native_to_megablocks

    E, D, FF = nat.w_out.shape[0], nat.w_out.shape[2], nat.w_out.shape[1]
    mb = nn.Module()
    mb.router = nn.Linear(D, nat.router.weight.shape[0], bias=False)
    mb.experts = nn.Module()
    mb.experts.mlp = nn.Module()
    glu = nat.w_in.shape[2] == 2 * FF
    for name in ("w1", "w2") + (("v1",) if glu else ()):
        setattr(mb.experts.mlp, name, nn.Parameter(torch.zeros(E * FF, D, dtype=torch.bfloat16)))
    copy_native_to_megablocks(nat, mb)
    return mb.state_dict()


@pytest.mark.parametrize("prefix", ["blocks.1.ffn.", ""])  # a model's state dict, a layer's own
@pytest.mark.parametrize("mlp,f", [("swiglu", 24), ("gelu", 40)])
def test_megablocks_run_state_converts_to_native_exactly(mlp, f, prefix):
    from types import SimpleNamespace

    from mode.portable import megablocks_to_native

    cfg = model_cfg(mlp=mlp, d=16, f=f, num_experts=4, top_k=2, backend="megablocks")
    nat = native(cfg)
    with torch.no_grad():  # what a bf16 megablocks run can hold
        for p in (nat.w_in, nat.w_out):
            p.copy_(p.bfloat16().float())
    state = {f"{prefix}{k}": v for k, v in _megablocks_layout(nat).items()}
    run_cfg, out = megablocks_to_native(SimpleNamespace(model=cfg), state)
    assert run_cfg.model.moe.backend == "native"
    want = {f"{prefix}{k}": v for k, v in nat.state_dict().items()}
    assert sorted(out) == sorted(want)
    for k, v in want.items():
        assert out[k].dtype == torch.float32 and torch.equal(out[k], v), k


def test_megablocks_run_is_read_by_load_run_with_native_layers(tmp_path):
    """load_run (mode generate / eval / export) reads a megablocks run on a CPU: same logits as the
    native model holding the same (bf16-representable) weights."""
    from mode.config import dump_config
    from mode.generate import load_run
    from tests.util import fake_checkpoint, tiny_model

    model, cfg = tiny_model("moe")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    state = model.state_dict()
    for name, m in model.named_modules():
        if isinstance(m, NativeMoE):
            del state[f"{name}.w_in"], state[f"{name}.w_out"], state[f"{name}.router.weight"]
            state.update({f"{name}.{k}": v for k, v in _megablocks_layout(m).items()})
    cfg.model.moe.backend, cfg.deepspeed.precision = "megablocks", "bf16"
    run = tmp_path / "run"
    fake_checkpoint(run, 3, state)
    (run / "config.yaml").write_text(dump_config(cfg))
    loaded, _, loaded_cfg = load_run(run)
    assert loaded_cfg.model.moe.backend == "native"
    ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.max_seq_len))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def _megablocks_expert_math(x_TD, w1, v1, w2, e, E, act_fn):
    """Expert e of MegaBlocks' grouped expert stage on rows x, transcribed from MegaBlocks' own
    GroupedGLU / GroupedMLP.forward (megablocks/layers/glu.py, mlp.py): each weight is viewed as
    [E, -1, hidden_size]; x1 = x @ w1[e]^T, for GLU act(x1) * (x @ v1[e]^T) else act(x1); then @ w2[e]."""
    D = x_TD.shape[1]
    h = x_TD @ w1.view(E, -1, D)[e].t()
    h = act_fn(h) * (x_TD @ v1.view(E, -1, D)[e].t()) if v1 is not None else act_fn(h)
    return h @ w2.view(E, -1, D)[e]


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_megablocks_layout_written_by_hand_converts_to_native(mlp):
    """megablocks_to_native against MegaBlocks' own expert math, not against
    copy_native_to_megablocks (the tests above build the MegaBlocks state with it, so a mistake
    shared by both directions would pass them on a CPU): MegaBlocks-layout bf16 tensors drawn at
    random, non-square everywhere (D=16, expert hidden F=24 from moe.d_expert != d_ff=40), 11 real
    experts (two-digit indices) and 2 no-op experts, converted, loaded strictly into a NativeMoE,
    whose dropless top-2 forward (float64) must equal the routed sum of MegaBlocks' expert outputs."""
    from types import SimpleNamespace

    from mode.portable import megablocks_to_native

    E, N, D, F_ = 11, 2, 16, 24
    cfg = model_cfg(mlp=mlp, d=D, f=40, num_experts=E, num_noop_experts=N, d_expert=F_, top_k=2,
                    capacity_factor=None, backend="megablocks")
    g = torch.Generator().manual_seed(0)
    mb = {n: (torch.randn(E * F_, D, generator=g) * 0.3).bfloat16()
          for n in ("w1", "w2") + (("v1",) if mlp == "swiglu" else ())}
    router = torch.randn(E + N, D, generator=g) * 3
    P = "blocks.2.ffn"  # any prefix: keys keep it
    state = {f"{P}.router.weight": router, **{f"{P}.experts.mlp.{n}": w for n, w in mb.items()}}
    run_cfg, out = megablocks_to_native(SimpleNamespace(model=cfg), state)
    assert run_cfg.model.moe.backend == "native"
    nat = NativeMoE(cfg, 0)
    nat.load_state_dict({k.removeprefix(P + "."): v for k, v in out.items()})  # strict: names and shapes
    assert torch.equal(nat.router.weight, router)
    nat.double()
    x = torch.randn(40, D, generator=g, dtype=torch.float64)
    with torch.no_grad():
        y = nat(x[None])[0]
    r = nat.last_routing
    assert r.keep_TK.any() and (~r.keep_TK).any()  # some no-op routes (not run), many expert routes
    assert len(r.idx_TK[r.keep_TK].unique()) >= E - 1
    act_fn = F.silu if mlp == "swiglu" else F.gelu
    w = {n: t.double() for n, t in mb.items()}
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(2):
            if r.keep_TK[t, j]:
                e = int(r.idx_TK[t, j])
                want[t] += float(r.w_TK[t, j]) * _megablocks_expert_math(x[t:t + 1], w["w1"], w.get("v1"), w["w2"],
                                                                         e, E, act_fn)[0]
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_native_and_deepspeed_backends_start_from_the_same_weights(ds_world, mlp):
    """Bug caught: at the same seed the native and DeepSpeed MoE backends drew their experts and
    routers from different keys (the parameters' names differ), so a backend comparison seed for
    seed started from different weights (tiny preset: step-0 eval 5.750088 vs 5.749751). Every
    parameter, expert by global index, must now be equal, and so the logits."""
    from mode.model import build_model
    from mode.moe.deepspeed import DeepSpeedMoE, _expert_views

    over = ["model.d_model=24", "model.n_layers=2", "model.n_heads=2", "model.d_ff=40", f"model.mlp={mlp}",
            "model.moe.num_experts=4", "model.moe.capacity_factor=null", "model.moe.layers=[1]"]
    models = {}
    for backend in ("native", "deepspeed"):
        torch.manual_seed(3)
        models[backend] = build_model(load_config("configs/tiny/moe.yaml", [*over, f"model.moe.backend={backend}"]).model)
    nat, ds = (dict(m.named_parameters()) for m in models.values())
    shared = [n for n in nat if n in ds]  # all but the MoE layer's, named apart
    assert shared and all(torch.equal(nat[n], ds[n]) for n in shared)
    [ds_layer] = [m for m in models["deepspeed"].modules() if isinstance(m, DeepSpeedMoE)]
    [nat_layer] = [m for m in models["native"].modules() if isinstance(m, NativeMoE)]
    (rn, _, in_n, out_n), (rd, _, in_d, out_d) = _expert_views(nat_layer), _expert_views(ds_layer)
    assert torch.equal(rn, rd) and len(in_n) == len(in_d) == 4
    assert all(torch.equal(a, b) for a, b in zip(in_n + out_n, in_d + out_d))
    assert not torch.equal(in_n[0], in_n[1])  # the experts differ from each other
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(models["native"](x).logits, models["deepspeed"](x).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mlp,precision", [("swiglu", "bf16"), ("gelu", "fp32")])
def test_deepspeed_checkpoint_files_load_into_native(ds_world, tmp_path, monkeypatch, mlp, precision):
    """A checkpoint written by DeepSpeed's own engine.save_checkpoint (through mode.checkpoint.save:
    model.pt plus DeepSpeed's per-expert files) reads back through load_run with native layers that
    compute what the DeepSpeed layers compute. Shapes where a layout mistake cannot hide: 12 experts
    (file names sort expert_10, expert_11 before expert_2), MoE only in layers 0, 2, 3 of 4 (DeepSpeed
    numbers its files layer_0..2 by MoE layer, not by block), d_model 24, d_ff 40, moe.d_expert 20, two
    no-op experts; bf16 checkpoints compare with the DeepSpeed model cast to float32 (bf16 -> fp32 is
    exact). In-process world of one; nothing is trained."""
    from mode import checkpoint as ck
    from mode.config import dump_config
    from mode.engine import build_engine
    from mode.generate import load_run
    from mode.model import build_model
    from mode.portable import deepspeed_moe_to_native

    monkeypatch.setenv("LOCAL_RANK", "0")  # deepspeed.initialize asks for it
    cfg = load_config("configs/tiny/moe.yaml", [
        "model.d_model=24", "model.n_layers=4", "model.n_heads=2", "model.d_ff=40", "model.max_seq_len=16",
        "data.seq_len=16", f"model.mlp={mlp}", "model.moe.backend=deepspeed", "model.moe.num_experts=12",
        "model.moe.layers=[0,2,3]", "model.moe.d_expert=20", "model.moe.num_noop_experts=2",
        "model.moe.capacity_factor=null", f"deepspeed.precision={precision}", "train.micro_batch_size=2"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    with torch.no_grad():  # sharper routing: every expert gets tokens
        for name, p in model.named_parameters():
            if name.endswith("router.weight"):
                p.mul_(20)
    engine, _, _ = build_engine(cfg, model, 1)
    run = tmp_path / "run"
    d = ck.save(engine, ck.checkpoints_dir(run), 3, {}, 0, 2)
    (run / "config.yaml").write_text(dump_config(cfg))
    assert len(list(d.glob("layer_*_expert_*_mp_rank_*_model_states.pt"))) == 3 * 12
    ds_model = engine.module.float().eval()
    ids = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ds_model(ids).logits
        used = [m.last_routing.idx_TK[m.last_routing.keep_TK].unique().numel()
                for m in ds_model.modules() if getattr(m, "last_routing", None) is not None]
        assert len(used) == 3 and min(used) >= 10  # two-digit experts are used in every MoE layer
        nat, _, nat_cfg = load_run(run)
        assert nat_cfg.model.moe.backend == "native" and nat_cfg.model.moe.ep_size == 1
        torch.testing.assert_close(nat(ids).logits, want, rtol=1e-5, atol=1e-5)

    # An expert file missing (a partial copy of the checkpoint) is refused, naming what is there.
    (d / "layer_1_expert_10_mp_rank_00_model_states.pt").unlink()
    state = torch.load(d / ck.MODEL, weights_only=True)
    with pytest.raises(FileNotFoundError, match=r"holds experts \[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11\] of blocks\.2"):
        deepspeed_moe_to_native(load_config(run / "config.yaml"), state, d)

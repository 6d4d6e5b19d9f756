"""Mixture-of-Depths: each test names the bug it catches.

Shape legend: B batch, S sequence, K selected per row, D d_model, H heads, E head dim, V vocab.
"""
import copy
import pickle
import re

import pytest
import torch
import torch.nn.functional as F

from mode.config import ModConfig, ModelConfig, load_config
from mode.mod import MoDBlock
from mode.model import build_model
from mode.model.blocks import DenseBlock
from mode.routed import Ctx
from mode.routing.depth import DepthRouter, capacity_k, topk_sorted

D, H, S = 32, 2, 16


def model_cfg(layers="every_other", capacity=0.25, **mod):
    return ModelConfig(vocab_size=64, d_model=D, n_layers=4, n_heads=H, d_ff=64, max_seq_len=64,
                       mod=ModConfig(layers=layers, capacity=capacity, **mod))


def mod_block(capacity=0.25, seed=0, sharp=False, **mod):
    """A MoDBlock around a dense block; `sharp` scales attention weights up so that attention is
    far from uniform (at init std 0.02 it barely depends on positions)."""
    torch.manual_seed(seed)
    cfg = model_cfg("every", capacity, **mod)
    inner = DenseBlock(cfg)
    for p in inner.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=(2.0 if sharp else 1.0) / p.shape[1] ** 0.5)
    blk = MoDBlock(inner, cfg.mod, D, 0)
    torch.nn.init.normal_(blk.router.router.weight, std=1.0 / D ** 0.5)
    return blk


def spread_causal(model, std=3.0):
    """An untrained predictor outputs ~0 for every token; spread it so causal routing selects
    some tokens and skips others."""
    for b in model.blocks:
        if isinstance(b, MoDBlock):
            lin = b.router.predictor[2] if b.router.predictor is not None else b.router.router
            torch.nn.init.normal_(lin.weight, std=std / lin.weight.shape[1] ** 0.5)


def step(blk, x, pos, routing="topk"):
    """The residual stream after the wrapper (the block contract: it returns the update)."""
    return x + blk(x, Ctx(pos, routing=routing))


def inputs(B=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, D, generator=g), torch.arange(S).expand(B, S)


def test_capacity_k():
    assert capacity_k(0.125, 2048) == 256 and capacity_k(0.125, 4) == 1 and capacity_k(1.0, 7) == 7
    assert capacity_k(0.01, 10) == 1  # never zero tokens
    assert capacity_k(0.3, 7) == 2 and capacity_k(0.4, 7) == 3  # 2.1 and 2.8: rounded, not ceil or floor


def test_capacity_one_gate_one_reproduces_wrapped_block_exactly():
    # Bugs caught: residual multiplied by r, positions re-indexed, a different causal mask,
    # a lost token, anything that makes the routed path compute something else.
    blk = mod_block(capacity=1.0)
    blk.gate = lambda r: torch.ones_like(r)
    x, pos = inputs()
    assert torch.equal(step(blk, x, pos), x + blk.inner(x, Ctx(pos)))
    # Whole LM: every block routed at capacity 1 == the dense LM with the same weights.
    torch.manual_seed(0)
    dense = build_model(model_cfg("none"))
    routed = build_model(model_cfg("every", 1.0))
    state = {re.sub(r"^blocks\.(\d+)\.", r"blocks.\1.inner.", k): v for k, v in dense.state_dict().items()}
    missing, unexpected = routed.load_state_dict(state, strict=False)
    assert not unexpected and all(".router." in k for k in missing)
    for b in routed.blocks:
        b.gate = lambda r: torch.ones_like(r)
    ids = torch.randint(0, 64, (2, S))
    assert torch.equal(routed(ids).logits, dense(ids).logits)
    for b in routed.blocks:  # sanity: the paper's gate g(r) = r does change the output
        b.gate = lambda r: r
    assert not torch.allclose(routed(ids).logits, dense(ids).logits)


def test_topk_matches_bruteforce_and_unselected_are_bit_identical():
    blk = mod_block(capacity=0.25)
    x, pos = inputs()
    w = blk.router.router.weight.detach()[0]
    x[0] += 3 * w / w.dot(w)  # row 0's scores all +3: a top-k over the flattened batch favours it
    out = step(blk, x, pos)
    r = blk.router.scores(x)
    k = capacity_k(0.25, S)
    for b in range(x.shape[0]):  # brute force, row by row, in plain Python
        ref = sorted(sorted(range(S), key=lambda j: -float(r[b, j].detach()))[:k])
        assert topk_sorted(r, k)[b].tolist() == ref
        assert blk.last_selected_BS[b].nonzero().flatten().tolist() == ref
        sel = torch.zeros(S, dtype=torch.bool)
        sel[ref] = True
        assert torch.equal(out[b, ~sel], x[b, ~sel])  # unselected: the very same bits
        assert (out[b, sel] != x[b, sel]).any(-1).all()  # selected: updated
    assert int(blk.last_selected_BS.sum()) == k * x.shape[0]


def test_topk_ties_go_to_the_earliest_positions():
    """Bug caught: torch.topk breaks ties at the k-th score as its kernel happens to (CPU: {0, 6} of
    [1,0,1,0,1,0,1,1] at k=2), so repeated tokens routed on their embeddings were selected
    differently on CPU and GPU. Reference: Python's stable sort by score, then position."""
    g = torch.Generator().manual_seed(0)
    for S, k in ((8, 2), (64, 8), (64, 13), (256, 32)):
        r = torch.randint(0, 4, (6, S), generator=g).float()  # many ties at every k-th score
        r[0] = torch.tensor([1.0, 0.0] * (S // 2))  # every kept score tied
        for b in range(r.shape[0]):
            ref = sorted(sorted(range(S), key=lambda j: -float(r[b, j]))[:k])
            assert topk_sorted(r, k)[b].tolist() == ref, (S, k, b)


def test_unselected_bit_identical_in_bf16_and_causal_routing():
    blk = mod_block(capacity=0.25).to(torch.bfloat16)
    x, pos = inputs()
    x = x.bfloat16()
    for routing in ("topk", "causal"):
        out = step(blk, x, pos, routing)
        sel = blk.last_selected_BS
        assert 0 < int(sel.sum()) < sel.numel()
        assert torch.equal(out[~sel], x[~sel])


def _rope_ref(x_KHE, pos_K, theta=10000.0):
    """Independent rotary: pairs (2i, 2i+1) as complex numbers rotated by pos * theta^(-2i/E)."""
    E = x_KHE.shape[-1]
    freq = theta ** (-torch.arange(0, E, 2, dtype=torch.float64) / E)
    rot = torch.polar(torch.ones(len(pos_K), E // 2, dtype=torch.float64), pos_K[:, None].double() * freq)
    z = torch.view_as_complex(x_KHE.double().reshape(*x_KHE.shape[:-1], E // 2, 2).contiguous())
    return torch.view_as_real(z * rot[:, None]).flatten(-2).float()


def _block_ref(blk, x_KD, pos_K):
    """The dense block on K tokens at the given positions, written out from the weights."""
    inner = blk.inner

    def norm(m, v):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + m.eps) * m.weight

    K = x_KD.shape[0]
    q, k, v = (norm(inner.attn.norm, x_KD) @ inner.attn.attn.qkv.weight.T).view(K, 3, H, D // H).unbind(1)
    q, k = _rope_ref(q, pos_K), _rope_ref(k, pos_K)
    att = torch.einsum("qhe,khe->hqk", q, k) / (D // H) ** 0.5
    att = att.masked_fill(~torch.ones(K, K, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    a = torch.einsum("hqk,khe->qhe", att, v).reshape(K, D) @ inner.attn.attn.out.weight.T
    gate, up = (norm(inner.mlp.norm, x_KD + a) @ inner.mlp.mlp.w_in.weight.T).chunk(2, -1)
    return a + (F.silu(gate) * up) @ inner.mlp.mlp.w_out.weight.T


def test_gathered_tokens_see_their_original_rotary_positions():
    # Bug caught: gathered tokens given positions 0..k-1 (sramshetty/mixture-of-depths).
    blk = mod_block(capacity=0.375, sharp=True)
    x, pos = inputs(B=2)
    with torch.no_grad():
        out = step(blk, x, pos)
        r = blk.router.scores(x)
    for b in range(2):
        idx = blk.last_selected_BS[b].nonzero().flatten()
        assert (idx.diff() > 1).any(), "want gaps so that re-indexing changes distances"
        want = x[b, idx] + r[b, idx, None] * _block_ref(blk, x[b, idx], idx)
        torch.testing.assert_close(out[b, idx], want, rtol=1e-4, atol=1e-5)
        reindexed = x[b, idx] + r[b, idx, None] * _block_ref(blk, x[b, idx], torch.arange(len(idx)))
        assert (out[b, idx] - reindexed).abs().max() > 1e-3  # re-indexed positions are detectably wrong


def test_causal_ragged_path_matches_per_row_reference():
    # Bug caught: padding of the ragged causal batch leaking into real tokens or rows.
    blk = mod_block(capacity=0.25)
    torch.nn.init.normal_(blk.router.predictor[2].weight, std=3.0 / blk.router.predictor[2].weight.shape[1] ** 0.5)
    x, pos = inputs(B=4)
    with torch.no_grad():
        out = step(blk, x, pos, "causal")
        r = blk.router.scores(x)
    sel = blk.last_selected_BS
    assert len(set(sel.sum(1).tolist())) > 1, "rows should select different counts"
    for b in range(4):
        idx = sel[b].nonzero().flatten()
        want = x[b].clone()
        want[idx] = x[b, idx] + r[b, idx, None] * blk.inner(x[b, idx][None], Ctx(idx[None]))[0]
        torch.testing.assert_close(out[b], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gate", ["identity", "sigmoid"])
def test_router_receives_gradient(gate):
    # Bug caught: an output that does not multiply the update by g(r) leaves the router untrained.
    torch.manual_seed(0)
    model = build_model(model_cfg(gate=gate, causal="predictor"))
    ids = torch.randint(0, 64, (2, S + 1))
    out = model(ids[:, :-1], ids[:, 1:])
    out.loss.backward()  # the LM loss alone (no aux loss) must reach the router
    for b in model.blocks:
        if isinstance(b, MoDBlock):
            assert b.router.router.weight.grad.abs().sum() > 0
            assert b.inner.attn.attn.qkv.weight.grad.abs().sum() > 0


def test_sigmoid_gate_scales_the_update():
    blk = mod_block(capacity=1.0, gate="sigmoid")
    x, pos = inputs()
    want = x + torch.sigmoid(blk.router.scores(x))[..., None] * blk.inner(x, Ctx(pos))
    torch.testing.assert_close(step(blk, x, pos), want, rtol=0, atol=0)


@pytest.mark.parametrize("routing", ["topk", "causal"])
def test_batch_rows_are_independent(routing):
    # Bug caught: top-k over the flattened batch, or any cross-row mixing.
    blk = mod_block(capacity=0.25)
    torch.nn.init.normal_(blk.router.predictor[2].weight, std=0.5)
    x, pos = inputs(B=3)
    x2 = x.clone()
    x2[1] = torch.randn(S, D)
    with torch.no_grad():
        out, out2 = step(blk, x, pos, routing), step(blk, x2, pos, routing)
        alone = step(blk, x[:1], pos[:1], routing)
    for b in (0, 2):
        torch.testing.assert_close(out2[b], out[b], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(alone[0], out[0], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(out2[1], out[1])
    if routing == "topk":  # same shapes for every row: the very same bits
        assert torch.equal(out2[0], out[0]) and torch.equal(out2[2], out[2])


def _grads(model, weight, detach=True, monkeypatch=None):
    torch.manual_seed(0)
    model = build_model(model_cfg(causal="predictor", predictor_loss_weight=weight))
    ids = torch.randint(0, 64, (2, S + 1), generator=torch.Generator().manual_seed(5))
    out = model(ids[:, :-1], ids[:, 1:])
    (out.loss + out.aux_loss).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_predictor_loss_does_not_change_lm_gradients(monkeypatch):
    # Bug caught: a predictor fed the router input without stop-gradient trains the LM.
    g0, g1 = _grads(None, 0.0), _grads(None, 1.0)
    pred = [n for n in g0 if ".predictor." in n]
    assert pred and all(g1[n].abs().sum() > 0 for n in pred)
    for n in g0:
        if n not in pred:
            assert torch.equal(g0[n], g1[n]), n
    # The check is sensitive: without the stop-gradient some LM gradient moves.
    monkeypatch.setattr(DepthRouter, "causal_logits",
                        lambda self, x, r: self.predictor(x).squeeze(-1).float())
    g1_leak = _grads(None, 1.0)
    assert any(not torch.equal(g0[n], g1_leak[n]) for n in g0 if n not in pred)


def test_predictor_gemms_run_in_the_streams_dtype_and_train_its_fp32_weights():
    """Bug caught: under bf16 the predictor (fp32 master weights, mode.engine.PredictorAdamW) cast
    the stream up and ran its d x d/2 GEMMs in fp32 on every token (~1/6 of the inner unit's FLOPs
    at capacity 0.125, at fp32 GEMM speed; benchmarks/bench_predictor.py). Now bf16 GEMMs; the logits
    agree with a float64 reference to bf16 rounding, the fp32 weights get fp32 gradients, and
    the stream none (stop-gradient)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class GemmDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("mm", "addmm", "bmm", "linear"):
                self.seen.append((func.__name__, {a.dtype for a in args if isinstance(a, torch.Tensor)}))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    D = 64
    router = DepthRouter(D, ModConfig(layers="every", causal="predictor"))
    x_BSD = torch.randn(2, 8, D).to(torch.bfloat16).requires_grad_()
    member_BS = (torch.rand(2, 8) < 0.5).float()
    r_BS = router.scores(x_BSD)
    with GemmDtypes() as mode:
        p_BS = router.causal_logits(x_BSD, r_BS)
        F.binary_cross_entropy_with_logits(p_BS, member_BS).backward()
    # two forward GEMMs, the two weight gradients and the hidden layer's input gradient
    assert len(mode.seen) >= 4 and all(d == {torch.bfloat16} for _, d in mode.seen), mode.seen
    up, act, down = router.predictor
    ref_BS = F.linear(act(F.linear(x_BSD.double(), up.weight.double(), up.bias.double())),
                      down.weight.double(), down.bias.double()).squeeze(-1)
    assert p_BS.dtype == torch.float32 and torch.allclose(p_BS.double(), ref_BS, atol=0.03 * ref_BS.abs().max().item())
    assert all(p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
               and p.grad.abs().sum() > 0 for p in router.predictor.parameters())
    assert x_BSD.grad is None


def test_aux_loss_trains_the_router():
    def router_grad(weight):
        torch.manual_seed(0)
        model = build_model(model_cfg(causal="aux_loss", aux_loss_weight=weight))
        ids = torch.randint(0, 64, (2, S + 1), generator=torch.Generator().manual_seed(5))
        out = model(ids[:, :-1], ids[:, 1:])
        (out.loss + out.aux_loss).backward()
        assert "mod/layer1/router_bce" in out.metrics and "mod/layer1/predictor_acc" not in out.metrics
        return model.blocks[1].router.router.weight.grad.clone()

    assert not torch.equal(router_grad(0.0), router_grad(1.0))


def test_decode_step_never_processes_an_invalid_row():
    """Bug caught: a decoding step that ignores `valid_BS` runs the block on a padding row and
    appends its K/V to the cache. Every token is selected here (predictor bias +10), so only the
    valid mask can keep row 1 out."""
    from mode.model.layers import KVCache

    blk = mod_block(capacity=0.25)
    torch.nn.init.constant_(blk.router.predictor[2].bias, 10.0)
    x, _ = inputs(B=2)
    cache = KVCache(2, H, 4, D // H, torch.float32, "cpu")
    valid_B1 = torch.tensor([[True], [False]])
    out = blk(x[:, :1], Ctx(torch.zeros(2, 1, dtype=torch.long), valid_B1, cache, "causal"))
    assert cache.len_B.tolist() == [1, 0]
    assert torch.equal(out[1], torch.zeros_like(out[1])) and out[0].abs().sum() > 0
    assert blk.last_engaged_BS.flatten().tolist() == [True, False]


@pytest.mark.parametrize("causal", ["predictor", "aux_loss", "both"])
def test_causal_losses_target_the_topk_membership(causal):
    """Bug caught: a predictor or router BCE trained against the wrong target (inverted, or not
    the top-k of the full sequence). Reference: membership from a per-row sort in plain Python,
    the BCE written out in float64."""
    blk = mod_block(capacity=0.25, causal=causal, aux_loss_weight=0.3, predictor_loss_weight=0.7)
    x, pos = inputs()
    blk(x, Ctx(pos))
    r = blk.router.scores(x).detach().double()
    member = torch.zeros_like(r)
    for b in range(r.shape[0]):
        member[b, sorted(range(S), key=lambda j: -float(r[b, j]))[:capacity_k(0.25, S)]] = 1.0

    def bce(logit, y):  # -[y log sigmoid(l) + (1 - y) log(1 - sigmoid(l))], averaged
        return float(-(y * torch.log(torch.sigmoid(logit)) + (1 - y) * torch.log(1 - torch.sigmoid(logit))).mean())

    aux = 0.0
    assert float(blk.metrics["router_bce"]) == pytest.approx(bce(r, member), rel=1e-5)
    if causal in ("aux_loss", "both"):
        aux += 0.3 * bce(r, member)
    if causal in ("predictor", "both"):
        p = blk.router.predictor(x).squeeze(-1).detach().double()
        assert float(blk.metrics["predictor_loss"]) == pytest.approx(bce(p, member), rel=1e-5)
        assert float(blk.metrics["predictor_acc"]) == pytest.approx(float(((p > 0).double() == member).double().mean()))
        aux += 0.7 * bce(p, member)
    assert float(blk.aux_loss.detach()) == pytest.approx(aux, rel=1e-5)


@pytest.mark.parametrize("layers,causal", [("every_other", "predictor"), ("every", "aux_loss"), ("every", "both")])
def test_causal_routing_never_looks_ahead(layers, causal):
    torch.manual_seed(0)
    model = build_model(model_cfg(layers, 0.25, causal=causal)).eval()
    spread_causal(model)
    ids = torch.randint(0, 64, (2, S), generator=torch.Generator().manual_seed(2))
    later = ids.clone()
    t = S // 2
    later[:, t + 1:] = torch.randint(0, 64, (2, S - t - 1), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a = model(ids, routing="causal").logits
        sel = torch.stack([b.last_selected_BS for b in model.blocks if isinstance(b, MoDBlock)])
        b = model(later, routing="causal").logits
        torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=1e-5, atol=1e-6)
        assert 0 < int(sel.sum()) < sel.numel()  # a real mix of processed and skipped tokens
        # Sanity: top-k routing DOES look ahead (later tokens change which early tokens win).
        ta, tb = model(ids).logits, model(later).logits
        assert not torch.allclose(ta[:, : t + 1], tb[:, : t + 1])


def test_stochastic_routing_control():
    torch.manual_seed(0)
    model = build_model(model_cfg(routing="stochastic"))
    ids = torch.randint(0, 64, (2, S + 1))
    out = model(ids[:, :-1], ids[:, 1:])
    sel1 = model.blocks[1].last_selected_BS
    (out.loss + out.aux_loss).backward()
    assert torch.isfinite(out.loss) and model.blocks[1].router.router.weight.grad.abs().sum() > 0
    model(ids[:, :-1])
    sel2 = model.blocks[1].last_selected_BS
    k = capacity_k(0.25, S)
    assert sel1.sum(1).tolist() == [k, k] and not torch.equal(sel1, sel2)  # random, at capacity
    learned = build_model(model_cfg())
    learned(ids[:, :-1])
    s1 = learned.blocks[1].last_selected_BS
    learned(ids[:, :-1])
    assert torch.equal(s1, learned.blocks[1].last_selected_BS)  # learned routing is deterministic


def test_metrics_and_module_hygiene():
    model = build_model(model_cfg())
    pickle.loads(pickle.dumps(model))  # no lambdas on the module
    copy.deepcopy(model)
    out = model(torch.randint(0, 64, (2, S)))
    for key in ("predictor_acc", "predictor_loss", "router_mean", "router_std", "causal_processed_frac", "aux_loss"):
        assert f"mod/layer1/{key}" in out.metrics and f"mod/layer3/{key}" in out.metrics
    assert float(out.aux_loss.detach()) > 0


@pytest.mark.parametrize("path", ["configs/tiny/mod.yaml", "configs/cluster/mod.yaml"])
def test_presets(path):
    import os

    base = os.path.join(os.path.dirname(path), "dense.yaml")
    if not os.path.exists(base):
        pytest.skip(f"{base} not written yet")
    cfg = load_config(path)
    m = cfg.model.mod
    assert (m.layers, m.capacity, m.causal, m.routing) == ("every_other", 0.125, "predictor", "learned")
    assert cfg.run.dir.endswith("/mod")


def test_causal_routing_that_selects_nothing_still_runs_the_inner_unit():
    """Bug caught: a batch in which causal routing selected no token returned before calling the
    inner unit. Ranks select on their own, and an expert-parallel MoE inside (DeepSpeed's
    all-to-all, the capacity all-reduce) holds collectives every rank must join: the rank that
    skipped hung the others at eval/loss_causal. The unit runs on padding slots that add nothing
    (the update is exactly zero), and the LM does not report a unit's metrics from an earlier call."""
    blk = mod_block(causal="none")
    torch.nn.init.constant_(blk.router.router.bias, -100.0)  # r < 0 everywhere: nothing selected
    calls = []
    blk.inner.register_forward_hook(lambda m, i, o: calls.append(i[0].shape))
    x, pos = inputs()
    with torch.no_grad():
        out = blk(x, Ctx(pos, routing="causal"))
    assert calls == [(3, 1, D)] and torch.equal(out, torch.zeros_like(x))
    assert not blk.last_selected_BS.any() and not blk.last_engaged_BS.any()

    # the LM: a decoding step that selects no row skips the inner MoE, whose metrics still held
    # the prefill's (reported again as this step's)
    cfg = load_config("configs/tiny/mode_staged.yaml", ["model.d_model=32", "model.n_layers=2", "model.n_heads=2",
                                                         "model.d_ff=64"])
    torch.manual_seed(0)
    lm = build_model(cfg.model).eval()
    ids = torch.randint(0, cfg.model.vocab_size, (2, 16))
    spread_causal(lm)
    with torch.no_grad():
        caches = lm.new_caches(2, 17)
        assert "moe/layer1/load_mean" in lm(ids, routing="causal", caches=caches).metrics  # the prefill ran it
        torch.nn.init.constant_(lm.blocks[1].router.predictor[2].bias, -100.0)  # the next token: none selected
        step_out = lm(ids[:, :1], routing="causal", pos_BS=torch.full((2, 1), 16), caches=caches)
    assert not lm.blocks[1].last_selected_BS.any()
    assert not [k for k in step_out.metrics if k.startswith("moe/")], step_out.metrics

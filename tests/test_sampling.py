"""Sampling that is exact and fast (issue #11): batch-independent causal routing, dropless experts at
sampling time, prefill == step-by-step == full recompute, decode that skips, calibrated-threshold
routing, and the `mode generate` CLI.

Every preset of configs/tiny and every MoD variant, shrunk. Shape legend: B rows, T positions, V vocab.
"""
import json

import pytest
import torch

from mode.cli import main as cli_main
from mode.config import Config, ModConfig, ModelConfig, MoEConfig, dump_config, load_config
from mode.data import ByteTokenizer
from mode.generate import _sample, generate, generate_ids
from mode.mod import MoDBlock
from mode.model import build_model
from mode.plan import layer_plan, routes_at_sampling
from tests.test_moe import ds_world  # noqa: F401 - the fixture: a gloo world of one
from tests.util import ROOT, TINY, fake_checkpoint, mode_cli, scalars

PRESETS = ["dense", "mod", "moe", "moe_dropping", "mode_staged", "mode_integrated"]
SMALL = ["model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.max_seq_len=64", "model.vocab_size=64",
         "data.seq_len=32"]
VARIANTS = {  # on top of the mod preset
    "decoupled": ["model.mod.decoupled=true", "model.mod.attn_capacity=0.75", "model.mod.mlp_capacity=0.5"],
    "kv_all": ["model.mod.kv=all", "model.mod.capacity=0.25"],
    "decoupled_kv_all": ["model.mod.layers=every", "model.mod.decoupled=true", "model.mod.attn_capacity=0.5",
                         "model.mod.mlp_capacity=0.25", "model.mod.kv=all"],
    "per_layer": ["model.mod.layers=every", "model.mod.capacity=[0.75,0.25,0.5,0.125]"],
    "aux_loss": ["model.mod.causal=aux_loss"],
    "threshold": ["model.mod.causal=threshold"],
}
CASES = PRESETS + list(VARIANTS)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [9, 8], [3, 1, 4, 1, 5], [7]]


def model_of(case, *extra, seed=0):
    preset, over = (case, []) if case in PRESETS else ("mod", VARIANTS[case])
    cfg = load_config(ROOT / f"configs/tiny/{preset}.yaml", [*SMALL, *over, *extra])
    torch.manual_seed(seed)
    model = build_model(cfg.model).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in model.modules():  # untrained routers output ~0: spread them so rows route differently
            if isinstance(m, MoDBlock):
                lin = m.router.predictor[2] if m.router.predictor is not None else m.router.router
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 3.0 / lin.weight.shape[1] ** 0.5)
                if m.router.has_threshold:  # mid-spread of these scores (~0.06): some tokens in, some out
                    m.router.threshold.fill_(0.0)
            if hasattr(m, "router") and hasattr(m.router, "E"):  # expert routers: sharper than init
                m.router.weight.copy_(torch.randn(m.router.weight.shape, generator=g))
    return model


def trace(model, prompts, n, **kw):
    return generate_ids(model, prompts, n, temperature=0, return_trace=True, **kw)


def max_diff_valid(a_BTV, b_BTV, valid_BT):
    return (a_BTV[valid_BT] - b_BTV[valid_BT]).abs().max().item()


# ------------------------------------------------------------------------------------------------
# 1. Sampling-time semantics


@pytest.mark.parametrize("case", CASES)
def test_row_generated_in_a_batch_equals_the_row_alone(case):
    model = model_of(case)
    ids_b, tr_b = trace(model, PROMPTS, 8)
    for i, p in enumerate(PROMPTS):
        ids_a, tr_a = trace(model, [p], 8)
        assert ids_a[0] == ids_b[i]
        n = len(p) + 8 - 1
        assert (tr_a.logits_BTV[0, :n] - tr_b.logits_BTV[i, :n]).abs().max().item() <= 1e-5


def test_the_cases_route_some_tokens_and_skip_others():
    """The comparisons above are only as strong as the routing they see: a case whose routers select
    every token or none (a threshold above every score) checks nothing about skipping."""
    for case in ("mod", *VARIANTS):
        model = model_of(case)
        with torch.no_grad():
            model(torch.tensor(PROMPTS[0])[None], routing="causal")
        frac = [m.last_engaged_BS.float().mean().item() for m in model.modules() if isinstance(m, MoDBlock)]
        assert frac and all(0.05 < f < 0.95 for f in frac), (case, frac)


def test_a_shared_inference_capacity_couples_rows_as_documented():
    # The control: with a capacity shared by the batch (inference_capacity_factor set), a row's
    # logits do depend on its batch mates; the test above would catch that.
    model = model_of("moe_dropping", "model.moe.inference_capacity_factor=0.5")
    _, tr_b = trace(model, PROMPTS, 8)
    diffs = []
    for i, p in enumerate(PROMPTS):
        _, tr_a = trace(model, [p], 8)
        n = len(p) + 8 - 1
        diffs.append((tr_a.logits_BTV[0, :n] - tr_b.logits_BTV[i, :n]).abs().max().item())
    assert max(diffs) > 1e-3


@pytest.mark.parametrize("preset", PRESETS)
def test_eval_loss_causal_is_causal(preset):
    model = model_of(preset)
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 64, (4, 32), generator=g)
    p = 13
    y = x.clone()
    y[:, p + 1:] = torch.randint(0, 64, (4, 32 - p - 1), generator=g)
    with torch.no_grad():
        a, b = model(x, routing="causal").logits, model(y, routing="causal").logits
        ta, tb = model(x).logits, model(y).logits  # training-time routing (eval/loss)
    assert (a[:, : p + 1] - b[:, : p + 1]).abs().max().item() <= 1e-5
    assert routes_at_sampling(layer_plan(model.cfg)) == (preset != "dense")
    if preset in ("mod", "moe_dropping", "mode_integrated"):  # top-k / shared capacity looks ahead
        assert (ta[:, : p + 1] - tb[:, : p + 1]).abs().max().item() > 1e-4


def test_skipped_rows_never_consume_expert_capacity():
    """Staged MoDE, 2 experts, top-1, a capacity factor of 1.0 at sampling time. Row 0's token is
    skipped by the depth router, row 1's selected, both prefer expert 0. Had row 0 entered the MoE,
    capacity ceil(1.0 * 2 / 2) = 1 would go to row 0 (earlier) and drop row 1's route."""
    cfg = ModelConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=2, d_ff=16, max_seq_len=16,
                      mod=ModConfig(layers=[0], capacity=0.5, causal="none"),
                      moe=MoEConfig(layers=[0], num_experts=2, top_k=1, capacity_factor=1.0,
                                    inference_capacity_factor=1.0))
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    blk = model.blocks[0]
    moe = blk.inner.mlp.mlp
    with torch.no_grad():
        model.embed.weight[:, 0] = torch.tensor([-1.0, 1.0] * 4)  # even ids: skipped, odd: selected
        model.embed.weight[:, 1] = 1.0
        blk.router.router.weight.zero_()
        blk.router.router.weight[0, 0] = 5.0
        blk.router.router.bias.zero_()
        moe.router.weight.zero_()
        moe.router.weight[0, 1], moe.router.weight[1, 1] = 5.0, -5.0  # every token: expert 0
    caches = model.new_caches(2, 4)
    with torch.no_grad():
        out = model(torch.tensor([[2], [3]]), routing="causal", pos_BS=torch.zeros(2, 1, dtype=torch.long),
                    caches=caches)
        assert blk.last_selected_BS[:, 0].tolist() == [False, True]
        assert moe.last_routing.keep_TK.shape[0] == 1 and bool(moe.last_routing.keep_TK.all())
        alone = model(torch.tensor([[3]]), routing="causal")  # row 1's own causal forward
    assert (out.logits[1] - alone.logits[0]).abs().max().item() <= 1e-6
    assert caches[0].len_B.tolist() == [0, 1]


# ------------------------------------------------------------------------------------------------
# 2. Prefill


@pytest.mark.parametrize("case", CASES)
def test_prefill_equals_step_by_step_and_full_recompute(case):
    model = model_of(case)
    ids_p, tr_p = trace(model, PROMPTS, 9)
    ids_s, tr_s = trace(model, PROMPTS, 9, prefill=False)
    assert ids_p == ids_s
    assert torch.equal(tr_p.valid_BT, tr_s.valid_BT)
    T = tr_p.valid_BT.shape[1]
    with torch.no_grad():
        full = model(tr_p.tokens_BT[:, :T], routing="causal").logits.float()
    assert max_diff_valid(tr_p.logits_BTV, tr_s.logits_BTV, tr_p.valid_BT) <= 1e-5
    assert max_diff_valid(tr_p.logits_BTV, full, tr_p.valid_BT) <= 1e-5
    # greedy: each new token is the argmax of the full recompute at the position before it
    for i, p in enumerate(PROMPTS):
        n = len(p) + 9 - 1
        assert tr_p.tokens_BT[i, len(p): n + 1].tolist() == full[i, len(p) - 1: n].argmax(-1).tolist()


@pytest.mark.parametrize("case", ["mod", "mode_staged", "kv_all", "decoupled", "per_layer"])
def test_prefill_caches_hold_the_tokens_each_layer_processed(case):
    model = model_of(case)
    B, P = len(PROMPTS), max(map(len, PROMPTS))
    ids_BP = torch.zeros(B, P, dtype=torch.long)
    for i, p in enumerate(PROMPTS):
        ids_BP[i, : len(p)] = torch.tensor(p)
    len_B = torch.tensor([len(p) for p in PROMPTS])
    valid_BP = torch.arange(P)[None] < len_B[:, None]
    caches = model.new_caches(B, P)
    with torch.no_grad():
        model(ids_BP, routing="causal", caches=caches, valid_BS=valid_BP)
    n_routed = 0
    for block, c in zip(model.blocks, caches):
        attn_route = block if isinstance(block, MoDBlock) else block.attn if isinstance(block.attn, MoDBlock) else None
        if attn_route is None or attn_route.kv_all:
            assert torch.equal(c.len_B, len_B)
        else:
            n_routed += 1
            sel_BP = attn_route.last_selected_BS
            assert not (sel_BP & ~valid_BP).any()  # padding is never selected
            assert torch.equal(c.len_B, sel_BP.sum(1))
    assert n_routed > 0 or case == "kv_all"


def test_staged_kv_all_decodes_steps_that_select_no_row():
    # Bug caught: with K/V from all, a decoding step that selects no row still runs the block on
    # zero rows (every row's K/V goes to the cache), and the MoE combine crashed on zero tokens.
    model = model_of("mode_staged", "model.mod.kv=all")
    seen = []
    for m in model.modules():
        if isinstance(m, MoDBlock):
            m.inner.mlp.mlp.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[:2]))
    ids, tr = trace(model, PROMPTS, 9)
    assert (0, 1) in seen  # sanity: some decoding step selected no row of some layer
    T = tr.valid_BT.shape[1]
    with torch.no_grad():
        full = model(tr.tokens_BT[:, :T], routing="causal").logits.float()
    assert max_diff_valid(tr.logits_BTV, full, tr.valid_BT) <= 1e-5


# ------------------------------------------------------------------------------------------------
# 3. Decode that skips


def test_decode_runs_a_routed_block_on_its_selected_rows_only():
    model = model_of("mod")
    routed = [b for b in model.blocks if isinstance(b, MoDBlock)]
    seen = {id(b): [] for b in routed}
    for b in routed:
        b.inner.register_forward_hook(lambda m, i, o, b=b: seen[id(b)].append(i[0].shape[0]))
    B = 8
    prompts = [[i + 1, 2 * i + 3] for i in range(B)]
    ids = generate_ids(model, prompts, 6, temperature=0)
    assert all(len(o) == 6 for o in ids)
    for b in routed:
        seen[id(b)].clear()
    caches = model.new_caches(B, 4)
    x = torch.randint(0, 64, (B, 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(x, routing="causal", pos_BS=torch.zeros(B, 1, dtype=torch.long), caches=caches)
    for b, c in zip(model.blocks, caches):
        if isinstance(b, MoDBlock):
            n_sel = int(b.last_selected_BS.sum())
            assert seen[id(b)] == ([n_sel] if n_sel else [])  # the inner block saw the selected rows only
            assert c.len_B.tolist() == b.last_selected_BS[:, 0].long().tolist()
    assert any(0 < int(b.last_selected_BS.sum()) < B for b in routed)


def test_at_batch_one_a_skipped_layer_runs_only_its_router_and_predictor():
    model = model_of("mod")
    blk = next(b for b in model.blocks if isinstance(b, MoDBlock))
    calls = []
    for name, m in blk.named_modules():
        m.register_forward_hook(lambda m, i, o, name=name: calls.append(name))
    for tok in range(64):  # find a token the layer skips and one it selects
        calls.clear()
        caches = model.new_caches(1, 2)
        with torch.no_grad():
            model(torch.tensor([[tok]]), routing="causal", pos_BS=torch.zeros(1, 1, dtype=torch.long), caches=caches)
        if not bool(blk.last_selected_BS.any()):
            assert set(calls) <= {"", "router", "router.router", "router.predictor", "router.predictor.0",
                                  "router.predictor.1", "router.predictor.2"}, calls
            skipped = True
        else:
            assert any(c.startswith("inner.") for c in calls)
    assert skipped


# ------------------------------------------------------------------------------------------------
# 4. Calibrated threshold


def record_router_scores(blk) -> list:
    """The block's router scores r = w^T x + b of every forward, in float64 (an independent reading)."""
    lin, scores = blk.router.router, []
    blk.register_forward_pre_hook(lambda mod, args: scores.append(
        args[0].detach().double() @ lin.weight.detach().double()[0] + lin.bias.detach().double()[0]))
    return scores


def test_threshold_is_an_ema_of_the_kth_largest_score():
    model = model_of("threshold", "model.mod.threshold_momentum=0.9").train()
    blk = next(b for b in model.blocks if isinstance(b, MoDBlock))
    blk.router.threshold.zero_()
    scores = record_router_scores(blk)
    g = torch.Generator().manual_seed(0)
    S = 32
    k = round(0.125 * S)
    expected = None
    for _ in range(3):
        model(torch.randint(0, 64, (4, S), generator=g))
        r = scores[-1]
        kth = sum(sorted(row.tolist(), reverse=True)[k - 1] for row in r) / r.shape[0]  # by hand
        expected = kth if expected is None else 0.9 * expected + 0.1 * kth
    assert blk.router.threshold.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert int(blk.router.threshold_updates) == 3
    model.eval()
    with torch.no_grad():  # eval (either routing) leaves the threshold alone
        model(torch.randint(0, 64, (4, S), generator=g))
        model(torch.randint(0, 64, (4, S), generator=g), routing="causal")
    assert blk.router.threshold.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert "blocks.1.router.threshold" in model.state_dict()
    # sampling time: a token is processed iff its score exceeds the threshold
    x = torch.randint(0, 64, (2, S), generator=g)
    with torch.no_grad():
        model(x, routing="causal")
    tau = blk.router.threshold.item()
    assert torch.equal(blk.last_selected_BS, scores[-1] > tau)
    assert 0 < int(blk.last_selected_BS.sum()) < blk.last_selected_BS.numel()


def test_threshold_metrics_score_a_batch_the_threshold_has_not_seen():
    """Bug caught: the EMA stepped before the metrics were computed, so `threshold_acc` and
    `causal_processed_frac` scored each training batch against a threshold already fitted to it
    (at the first step: its own k-th score). Reference: the threshold of the previous step."""
    model = model_of("threshold", "model.mod.threshold_momentum=0.5").train()
    blk = next(b for b in model.blocks if isinstance(b, MoDBlock))
    scores = record_router_scores(blk)
    g = torch.Generator().manual_seed(0)
    S, k = 32, round(0.125 * 32)
    for _ in range(3):
        before = blk.router.threshold.item()
        out = model(torch.randint(0, 64, (4, S), generator=g))
        r = scores[-1]
        member = torch.zeros_like(r).scatter_(1, r.topk(k, dim=1).indices, 1.0).bool()
        decide = r > before
        tag = next(t for t in out.metrics if t.endswith("/threshold_acc"))
        layer = tag.rsplit("/", 1)[0]
        assert out.metrics[f"{layer}/threshold"].item() == pytest.approx(before, abs=1e-6)
        assert out.metrics[tag].item() == pytest.approx((decide == member).double().mean().item(), abs=1e-6)
        assert out.metrics[f"{layer}/causal_processed_frac"].item() == pytest.approx(decide.double().mean().item(),
                                                                                      abs=1e-6)
        assert blk.router.threshold.item() != before  # and then the EMA stepped


def test_threshold_ema_steps_once_per_micro_step_under_activation_checkpointing():
    # Bug caught: activation checkpointing re-runs each block's forward in backward, and the re-run
    # stepped the EMA a second time (momentum m became m^2, threshold_updates counted double).
    model = model_of("threshold", "model.mod.threshold_momentum=0.5").train()
    model.activation_checkpointing = True
    blk = next(b for b in model.blocks if isinstance(b, MoDBlock))
    scores = record_router_scores(blk)
    g = torch.Generator().manual_seed(0)
    S = 32
    k = round(0.125 * S)
    expected = None
    for _ in range(3):  # a different batch each micro-step: a repeated EMA step changes the value
        out = model(torch.randint(0, 64, (4, S), generator=g))
        r = scores[-1]  # the forward's scores (the re-run in backward appends a copy)
        kth = sum(sorted(row.tolist(), reverse=True)[k - 1] for row in r) / r.shape[0]  # by hand
        expected = kth if expected is None else 0.5 * expected + 0.5 * kth
        out.logits.float().pow(2).mean().backward()
    assert len(scores) == 6  # sanity: the block really was re-run in every backward
    assert int(blk.router.threshold_updates) == 3
    assert blk.router.threshold.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def _two_rank_threshold(rank, port, out):
    import torch.distributed as dist

    from mode.engine import average_thresholds
    from mode.routing.depth import DepthRouter
    from tests.util import leave_world

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    router = DepthRouter(8, ModConfig(causal="threshold", threshold_momentum=0.75))
    for step in range(2):  # each rank sees its own scores: two micro-steps of one optimizer step
        router.update_threshold(torch.tensor(THRESHOLD_SCORES[step][rank]), k=2)
    average_thresholds(router)  # what the trainer does after each optimizer step
    out.put((rank, router.threshold.item(), int(router.threshold_updates)))
    leave_world(out)


THRESHOLD_SCORES = [  # [step][rank] -> [B=2, S=4] router scores
    [[[4.0, 1.0, 3.0, 0.0], [2.0, 2.5, -1.0, 5.0]], [[-3.0, -1.0, -2.0, 0.5], [0.0, 9.0, 1.0, 1.5]]],
    [[[1.0, 1.0, 1.0, 1.0], [0.5, 0.25, 0.0, 8.0]], [[7.0, 6.0, 5.0, 4.0], [2.0, -2.0, 3.0, -3.0]]],
]


@pytest.mark.slow
def test_threshold_is_averaged_over_data_parallel_ranks():
    # Bug caught: each rank kept its own EMA while the checkpoint holds rank 0's, so a resumed
    # 2-rank run continued rank 1 from another threshold (config: "averaged over data-parallel ranks").
    # The average of the ranks' EMAs after the step must equal one EMA of the rank-averaged k-th
    # scores at every micro-step (the trainer's call is checked by a 2-rank run in test_moe_train.py).
    import torch.multiprocessing as mp

    from tests.util import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.start_processes(_two_rank_threshold, args=(free_port(), q), nprocs=2, start_method="spawn")
    got = sorted(q.get(timeout=60) for _ in range(2))
    # by hand: the 2nd largest score of each row, averaged over rows and ranks; EMA with momentum 0.75
    kth = [(3.0 + 2.5 + -1.0 + 1.5) / 4, (1.0 + 0.5 + 6.0 + 2.0) / 4]
    expected = 0.75 * kth[0] + 0.25 * kth[1]
    assert [(r, n) for r, _, n in got] == [(0, 2), (1, 2)]
    assert all(t == pytest.approx(expected, abs=1e-6) for _, t, _ in got), (got, expected)


@pytest.mark.slow
def test_threshold_buffer_survives_an_exact_resume(tmp_path):
    over = [*TINY, "model.mod.causal=threshold", "train.max_steps=6", "train.eval_every=0", "checkpoint.every=3"]
    mode_cli("train", "--config", "configs/tiny/mod.yaml", *over, f"run.dir={tmp_path / 'ref'}")
    mode_cli("train", "--config", "configs/tiny/mod.yaml", *over, "train.stop_at=3", f"run.dir={tmp_path / 'cut'}")
    mode_cli("train", "--config", "configs/tiny/mod.yaml", *over, f"run.dir={tmp_path / 'cut'}")
    from mode import checkpoint as ckpt

    a, b = (torch.load(ckpt.step_dir(ckpt.checkpoints_dir(tmp_path / run), 6) / ckpt.MODEL, weights_only=True)
            for run in ("ref", "cut"))
    keys = [k for k in a if k.endswith("router.threshold")]
    assert keys and all(torch.equal(a[k], b[k]) for k in keys)
    assert all(int(a[k.replace("threshold", "threshold_updates")]) == 6 for k in keys)
    assert all(a[k].item() != 0 for k in keys)
    t = scalars(tmp_path / "ref", "mod/layer1/threshold")
    assert t and all(v != 0 for v in t.values())


@pytest.mark.slow
def test_moe_presets_log_eval_loss_causal(tmp_path):
    mode_cli("train", "--config", "configs/tiny/moe_dropping.yaml", *TINY, "train.max_steps=2",
             "train.eval_every=2", f"run.dir={tmp_path}")
    assert 2 in scalars(tmp_path, "eval/loss_causal") and 2 in scalars(tmp_path, "eval/loss")


# ------------------------------------------------------------------------------------------------
# 5. Sampler and CLI


def test_temperature_samples_softmax_of_logits_over_temperature():
    """Bug caught: logits scaled the wrong way (x T instead of / T). Reference: softmax(l / T) in
    float64 against the frequencies of 20,000 draws (3-sigma < 0.011)."""
    logits_BV = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(20_000, 4)
    gen = torch.Generator().manual_seed(0)
    for T in (0.5, 2.0):
        freq = torch.bincount(_sample(logits_BV, T, 0, gen), minlength=4).double() / 20_000
        assert torch.allclose(freq, (logits_BV[0].double() / T).softmax(-1), atol=0.011), (T, freq)


def test_top_p_and_top_k_sample_only_from_their_sets():
    g = torch.Generator().manual_seed(0)
    logits_BV = torch.randn(3, 20, generator=g) * 2
    for top_p in (0.3, 0.7, 0.95):
        allowed = []
        for row in logits_BV.double().softmax(-1).tolist():  # brute force: descending mass until >= top_p
            order = sorted(range(len(row)), key=lambda j: -row[j])
            keep, mass = set(), 0.0
            for j in order:
                keep.add(j)
                mass += row[j]
                if mass >= top_p:
                    break
            allowed.append(keep)
        seen = [set() for _ in range(3)]
        gen = torch.Generator().manual_seed(1)
        for _ in range(400):
            for i, t in enumerate(_sample(logits_BV, 1.0, 0, gen, top_p).tolist()):
                seen[i].add(t)
        assert all(s <= a for s, a in zip(seen, allowed)) and all(len(a) == 1 or len(s) > 1 for s, a in
                                                                   zip(seen, allowed))
    gen = torch.Generator().manual_seed(1)
    assert torch.equal(_sample(logits_BV, 1.0, 1, gen), logits_BV.argmax(-1))
    assert torch.equal(_sample(logits_BV, 0.0, 0, gen, 0.5), logits_BV.argmax(-1))


@pytest.fixture
def run_dir(tmp_path):
    model = model_of("mod", "model.vocab_size=320")
    cfg = Config(model=model.cfg)
    cfg.data.seq_len = 32
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    fake_checkpoint(tmp_path, 2, model.state_dict())
    return tmp_path, model


def test_cli_json_prompt_file_stop_and_greedy(run_dir, tmp_path, capsys):
    d, model = run_dir
    tok = ByteTokenizer()
    prompts = ["def f(", "ab", "x = 1"]
    greedy = generate(model, tok, prompts, 12, temperature=0)
    pf = tmp_path / "prompts.txt"
    pf.write_text("\n".join(prompts[1:]) + "\n")
    assert cli_main(["generate", "--run", str(d), "--prompt", prompts[0], "--prompt-file", str(pf),
                     "--max-new-tokens", "12", "--temperature", "0", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in rows] == prompts
    assert [r["completion"] for r in rows] == greedy
    assert all(r["num_tokens"] == len(tok.encode(r["completion"])) for r in rows)
    # --stop: cut before the first occurrence, counting the tokens up to the one completing it
    stop = greedy[0][3:5]
    assert cli_main(["generate", "--run", str(d), "--prompt", prompts[0], "--max-new-tokens", "12",
                     "--temperature", "0", "--json", "--stop", stop, "--stop", "\x00never"]) == 0
    r = json.loads(capsys.readouterr().out)
    cut = greedy[0].index(stop)
    assert r["completion"] == greedy[0][:cut] and r["num_tokens"] == len(tok.encode(greedy[0][:cut + len(stop)]))
    # text output: a header per prompt, then the prompt and its completion
    assert cli_main(["generate", "--run", str(d), "--prompt", "ab", "--prompt", "x = 1", "--max-new-tokens", "12",
                     "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out == f"=== [0] 12 tokens ===\nab{greedy[1]}\n=== [1] 12 tokens ===\nx = 1{greedy[2]}\n"
    # sampling with top-k / top-p is seeded
    args = ["generate", "--run", str(d), "--prompt", "ab", "--max-new-tokens", "8", "--top-k", "5", "--top-p", "0.9",
            "--temperature", "1.0", "--json"]
    cli_main(args + ["--seed", "1"])
    cli_main(args + ["--seed", "1"])
    a, b = capsys.readouterr().out.splitlines()
    assert a == b


def test_cli_prompt_file_skips_blank_lines(run_dir, tmp_path, capsys):
    """Blank (or whitespace-only) lines of --prompt-file are no prompts; the others keep their text."""
    d, model = run_dir
    # a form feed (as in Python sources) and U+2028 are characters of a line, not line ends (was: str.splitlines)
    prompts = ["ab", "  x = 1", "def f(", "a\x0cb\u2028c"]
    pf = tmp_path / "prompts.txt"
    pf.write_text(f"\n{prompts[0]}\n\n   \n{prompts[1]}\n\t\n{prompts[2]}\r\n\n{prompts[3]}\n", newline="")
    assert cli_main(["generate", "--run", str(d), "--prompt-file", str(pf), "--max-new-tokens", "4",
                     "--temperature", "0", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in rows] == prompts
    assert [r["completion"] for r in rows] == generate(model, ByteTokenizer(), prompts, 4, temperature=0)
    pf.write_text("\n \n\n")  # nothing but blank lines: no prompt at all
    with pytest.raises(SystemExit) as e:
        raise SystemExit(cli_main(["generate", "--run", str(d), "--prompt-file", str(pf)]))
    err = capsys.readouterr().err  # the file is named as the empty one (it said --prompt=None)
    assert e.value.code == 2 and f"config error: --prompt-file='{pf}': a file with at least one non-blank line" in err


@pytest.mark.parametrize("args,needle", [
    (["--run", "/nonexistent/run", "--prompt", "a"], "/nonexistent/run"),
    (["--prompt", "a"], "the following arguments are required: --run"),
    (["--run", "{run}", "--prompt", "a", "--top-p", "1.5"], "--top-p=1.5: in (0, 1]"),
    (["--run", "{run}", "--prompt", "a", "--temperature", "-1"], "--temperature=-1.0"),
    (["--run", "{run}", "--prompt", "a", "--bogus"], "unrecognized arguments: --bogus"),
    (["--run", "{run}", "--prompt", "y" * 60, "--max-new-tokens", "10"],
     "--max-new-tokens=10: at most 4: prompt 0, the longest, has 61 tokens"),
    (["--run", "{run}", "--prompt", "a", "--max-new-tokens", "100"],
     "--max-new-tokens=100: at most 63: prompt 0, the longest, has 2 tokens"),
    (["--run", "{run}", "--prompt", "a", "--prompt", "y" * 70, "--max-new-tokens", "1"],  # the prompt alone is too long
     "at most 64 tokens with the leading EOS (the model's max_seq_len): prompt 1 has 71"),
    (["--run", "{run}", "--prompt-file", "/nonexistent/prompts.txt"], "--prompt-file"),
    (["--run", "{run}"], "config error: --prompt: none given; at least one --prompt"),  # was `--prompt=None`
    (["--run", "{run}", "--prompt", "a", "--seed", str(2**64)], "--seed=18446744073709551616: an integer in"),
    (["--run", "{run}", "--prompt-file", "{run}/latin1.txt"],
     "latin1.txt': a UTF-8 text file, one prompt per line (byte 3 is not UTF-8)"),
    # bug caught (README walkthrough): Latin-1 bytes in argv (os.fsdecode: lone surrogates) were
    # `error: UnicodeEncodeError`, exit 1, for --prompt, and a --stop string that could never match
    (["--run", "{run}", "--prompt", "caf\udce9"], "--prompt='caf\\udce9': UTF-8 text"),
    (["--run", "{run}", "--prompt", "a", "--stop", "\udce9"], "--stop='\\udce9': UTF-8 text"),
    # bug caught (README walkthrough): an empty --prompt-file (an unset $FILE) was skipped in silence
    (["--run", "{run}", "--prompt", "a", "--prompt-file", ""], "--prompt-file='': a non-empty path"),
])
def test_cli_errors_are_one_line_exit_2(run_dir, capsys, args, needle):
    d, _ = run_dir
    (d / "latin1.txt").write_bytes("caf\u00e9\n".encode("latin-1"))  # bug caught: a UnicodeDecodeError, exit 1
    needle = needle.replace("{run}", str(d))
    with pytest.raises(SystemExit) as e:
        raise SystemExit(cli_main(["generate", "--max-new-tokens", "4", *[x.replace("{run}", str(d)) for x in args]]))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and needle in err, err


@pytest.mark.parametrize("backend", ["native", pytest.param("deepspeed", marks=pytest.mark.slow)])  # DS: minutes on CPU
def test_moe_is_dropless_at_sampling_time_per_token(backend, request):
    """routing causal: every token gets its top-k experts whatever the capacity factor, so each
    token's output equals its output computed alone; routing topk keeps the training capacity."""
    from mode.moe import build_moe_mlp

    if backend == "deepspeed":
        request.getfixturevalue("ds_world")
    cfg = ModelConfig(d_model=16, d_ff=32, moe=MoEConfig(layers="every", num_experts=4, top_k=2, capacity_factor=0.5,
                                                         backend=backend))
    torch.manual_seed(0)
    moe = build_moe_mlp(cfg, 0).eval()
    with torch.no_grad():
        router = moe.router if backend == "native" else moe.moe.deepspeed_moe.gate.router
        router.weight.mul_(200.0)  # sharp preferences: shared capacity overflows
        x = torch.randn(2, 12, 16)
        y = moe(x, None, "causal")
        assert float(moe.metrics["dropped_routes_frac"]) == 0.0
        alone = torch.cat([moe(x.reshape(-1, 1, 16)[t:t + 1], None, "causal") for t in range(24)]).view(2, 12, 16)
        torch.testing.assert_close(y, alone, rtol=1e-5, atol=1e-6)
        moe(x, None, "topk")
        assert float(moe.metrics["dropped_routes_frac"]) > 0  # the training-time capacity drops

"""MoE on the DeepSpeed engine: expert parallelism over 2 processes, MoE checkpoints and resume."""
import json
import shutil

import pytest

from tests.util import TINY, deepspeed_train, scalars, side_by_side

CFG = "configs/tiny/moe.yaml"
MOE = [*TINY, "model.moe.backend=deepspeed", "model.moe.num_experts=4", "model.moe.capacity_factor=1.0",
       "train.log_every=1", "train.eval_every=4", "checkpoint.every=2", "optim.warmup_steps=2",
       "train.micro_batch_size=2"]


@pytest.fixture(scope="module")
def ep2(tmp_path_factory):
    """8 steps with the experts split over 2 ranks: the reference of both tests below."""
    d = tmp_path_factory.mktemp("moe") / "ep2"
    deepspeed_train(2, CFG, *MOE, "train.max_steps=8", "model.moe.ep_size=2", f"run.dir={d}")
    return d


@pytest.mark.slow
def test_expert_parallel_matches_ep1(tmp_path, ep2):
    deepspeed_train(2, CFG, *MOE, "train.max_steps=8", "model.moe.ep_size=1", f"run.dir={tmp_path / 'ep1'}")
    a, b = scalars(tmp_path / "ep1", "train/loss"), scalars(ep2, "train/loss")
    assert list(a) == list(b) == list(range(1, 9))
    for s in a:
        assert b[s] == pytest.approx(a[s], rel=1e-4), (s, a[s], b[s])
    # drops are visible on the deepspeed backend too, and agree across layouts
    da = scalars(tmp_path / "ep1", "moe/layer1/dropped_tokens_frac")
    db = scalars(ep2, "moe/layer1/dropped_tokens_frac")
    assert da and db[8] == pytest.approx(da[8], abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_moe_resume_exact_same_ep_and_weights_only_at_other_ep(tmp_path, request, precision):
    """bf16 at ZeRO 1 is the cluster presets' setting: DeepSpeed's BF16_Optimizer keeps fp32 master
    weights and optimizer states, which the exact resume must restore and the other-ep_size resume
    must rebuild from the saved weights."""
    extra = ["deepspeed.precision=bf16", "deepspeed.zero_stage=1"] if precision == "bf16" else []
    run = [*MOE, *extra, "train.max_steps=8", "model.moe.ep_size=2"]
    half = lambda: deepspeed_train(2, CFG, *run, "train.stop_at=4", f"run.dir={tmp_path / 'resumed'}")
    if precision == "fp32":
        ep2 = request.getfixturevalue("ep2")
        half()
    else:  # its own straight reference, beside the first half (one thread each)
        ep2 = tmp_path / "straight"
        side_by_side(lambda: deepspeed_train(2, CFG, *run, f"run.dir={ep2}"), half)
    shutil.copytree(tmp_path / "resumed", tmp_path / "other")  # the same first half, resumed at ep_size 1 below
    deepspeed_train(2, CFG, *run, f"run.dir={tmp_path / 'resumed'}")
    straight = scalars(ep2, "train/loss")
    assert straight == scalars(tmp_path / "resumed", "train/loss")  # bit for bit at the same ep_size

    r = deepspeed_train(2, CFG, *[o for o in run if "ep_size" not in o], "model.moe.ep_size=1",
                        f"run.dir={tmp_path / 'other'}")
    assert "the optimizer state restarts, the LR schedule goes on" in r.stdout + r.stderr
    # torch's warning that a schedule step before the first optimizer step skips an LR: here it is meant
    assert "lr_scheduler.step()" not in r.stdout + r.stderr
    other = scalars(tmp_path / "other", "train/loss")
    # step 5's loss is computed with the weights saved at step 4: the weights were resumed
    assert other[5] == pytest.approx(straight[5], rel=1e-4)
    # ... and trained on from them: a bf16 run whose fp32 master copy kept its initial values would
    # put the saved weights back to init's at step 5's update (loss ~5.56 for ~5.1)
    assert all(other[s] == pytest.approx(straight[s], rel=0.02) for s in (6, 7, 8)), (other, straight)
    assert list(other) == list(range(1, 9))
    # Bug caught: the scheduler started again at 0 (warmup again, the LR of step 1 at step 5)
    assert scalars(tmp_path / "other", "train/lr") == pytest.approx(scalars(ep2, "train/lr"), rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["mode_staged", "mode_integrated"])
def test_mode_variants_on_deepspeed_expert_parallel_match_one_process(tmp_path, preset):
    from tests.util import mode_cli

    common = [*TINY, "model.n_layers=2", "model.moe.backend=deepspeed", "model.moe.num_experts=4",
              "model.moe.num_noop_experts=" + ("4" if preset == "mode_integrated" else "0"),
              "train.max_steps=4", "train.log_every=1", "train.eval_every=4", "log.routing_dump=true"]
    if preset == "mode_staged":
        # Calibrated threshold: each rank steps its own EMA and the trainer averages them after every
        # step. Bug caught: without that, rank 1 scored eval/loss_causal with its own threshold
        # (momentum 0 and the sigmoid gate make the ranks' thresholds differ and the flips count).
        common += ["model.mod.causal=threshold", "model.mod.threshold_momentum=0.0", "model.mod.gate=sigmoid"]
    side_by_side(lambda: mode_cli("train", "--config", f"configs/tiny/{preset}.yaml", *common,
                                  "train.micro_batch_size=4", "model.moe.ep_size=1", f"run.dir={tmp_path / 'one'}",
                                  threads=1),
                 lambda: deepspeed_train(2, f"configs/tiny/{preset}.yaml", *common, "train.micro_batch_size=2",
                                         "model.moe.ep_size=2", f"run.dir={tmp_path / 'ep2'}"))
    a, b = scalars(tmp_path / "one", "train/loss"), scalars(tmp_path / "ep2", "train/loss")
    assert list(a) == list(b) == [1, 2, 3, 4]
    for s in a:
        assert b[s] == pytest.approx(a[s], rel=1e-4)
    tag = "moe/layer1/noop_frac" if preset == "mode_integrated" else "mod/layer1/threshold"
    assert scalars(tmp_path / "ep2", tag)
    ca, cb = scalars(tmp_path / "one", "eval/loss_causal"), scalars(tmp_path / "ep2", "eval/loss_causal")
    assert list(ca) == list(cb) == [0, 4] and cb[4] == pytest.approx(ca[4], rel=1e-5), (ca, cb)
    # Bug caught: run_info counted rank 0's modules, which hold E/ep_size experts per layer (ep 2:
    # 2.27M params for 3.85M, and active_params negative); the analysis reads these.
    ia, ib = (json.loads((tmp_path / r / "run_info.json").read_text()) for r in ("one", "ep2"))
    assert ia["params"] == ib["params"] and ia["active_params"] == ib["active_params"] > 0, (ia, ib)


def _rank_main(rank, port, out, body):
    """One of two spawned ranks: join a gloo world of 2 (one thread each), put body(rank) on `out`."""
    import os

    import torch

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from mode import engine as eng
    from tests.util import leave_world

    eng.init_distributed()
    out.put(body(rank))
    leave_world(out)


def on_two_ranks(body) -> list:
    """body(rank) (a module-level function) run in two spawned processes forming one world; results by rank."""
    import torch.multiprocessing as mp

    from tests.util import free_port

    q = mp.get_context("spawn").Queue()
    mp.start_processes(_rank_main, args=(free_port(), q, body), nprocs=2, start_method="spawn")
    return sorted(q.get(timeout=120) for _ in range(2))


def _bf16_expert_clip(zero, rank):
    import torch
    import torch.distributed as dist

    from mode import engine as eng
    from mode.config import load_config
    from mode.model import build_model

    cfg = load_config(CFG, [*MOE, "model.moe.ep_size=2", "deepspeed.precision=bf16", f"deepspeed.zero_stage={zero}",
                            "optim.grad_clip=0.01", "optim.warmup_steps=1"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    engine, opt, _ = eng.build_engine(cfg, model, 2)
    torch.manual_seed(1 + rank)  # each rank its own batch, so each rank's experts get other gradients
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.data.seq_len + 1))
    norms = []
    for _ in range(2):
        o = engine(x[:, :-1], x[:, 1:])
        engine.backward(o.loss + o.aux_loss)
        engine.step()
        norms.append(eng.global_grad_norm(engine))
    shared = torch.cat([p.detach().float().flatten() for p in model.parameters() if getattr(p, "allreduce", True)])
    both = [torch.empty_like(shared) for _ in range(2)]
    dist.all_gather(both, shared)
    return rank, type(opt).__name__, norms, torch.equal(both[0], both[1])


@pytest.mark.slow
@pytest.mark.parametrize("zero,wrapper", [(0, "FP16_UnfusedOptimizer"), (1, "BF16_Optimizer")])
def test_bf16_clips_expert_parallel_ranks_by_one_global_norm(zero, wrapper):
    """bf16 at ZeRO 0: DeepSpeed wraps GuardedAdamW (FP16_UnfusedOptimizer) and hands it fp32 copies
    of the params. Bug caught: the copies lost the experts' `allreduce=False` mark, every param
    looked shared, each rank clipped by a norm over its own experts only, and the replicated
    weights differed across ranks after the first clipped step. Both ranks must report one global
    norm and hold identical shared weights. At ZeRO 1 (fp32 gradient accumulation) DeepSpeed's
    BF16_Optimizer clips, by its norm over its expert groups: the same must hold."""
    import functools

    res = on_two_ranks(functools.partial(_bf16_expert_clip, zero))
    assert res[0][1] == wrapper  # the wrapped path this test is about
    assert res[0][2] == res[1][2] and all(n > 0.01 for n in res[0][2]), res  # one global norm; clipping applies
    assert res[0][3] and res[1][3], res


def _copy_weights(rank):
    import torch

    from mode.moe.deepspeed import DeepSpeedMoE, copy_moe_weights
    from tests.test_moe import model_cfg, native

    cfg = model_cfg(num_experts=4, top_k=2, capacity_factor=None, backend="deepspeed", ep_size=2)
    nat = native(cfg)  # seed 0 on both ranks: one layer, all 4 experts
    torch.manual_seed(5 + rank)
    ds = DeepSpeedMoE(cfg, 0)  # experts 2*rank, 2*rank+1 of its own init; no forward yet
    copy_moe_weights(nat, ds)
    torch.manual_seed(7)
    x = torch.randn(2, 24, 16)
    with torch.no_grad():
        err = (ds(x) - nat(x)).abs().max().item()
    back = native(cfg, seed=3)
    copy_moe_weights(ds, back)  # this rank's experts, by global index
    mine = range(2 * rank, 2 * rank + 2)
    return rank, err, all(torch.equal(back.w_in[g], nat.w_in[g]) and torch.equal(back.w_out[g], nat.w_out[g])
                          for g in mine)


@pytest.mark.slow
def test_copy_moe_weights_places_experts_by_global_index_across_expert_parallel_ranks():
    """Bug caught: before its first forward a DeepSpeed layer has no expert-parallel group yet, so
    copy_moe_weights took every rank's local experts for experts 0..1: rank 1 computed with the
    wrong experts. With ep_size 2 each rank must hold its own experts (2r, 2r+1), the layer must
    then equal the native one, and copying back must return those experts."""
    res = on_two_ranks(_copy_weights)
    assert all(err < 1e-5 and back_ok for _, err, back_ok in res), res

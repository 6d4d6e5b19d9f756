"""Training on the DeepSpeed engine end to end: learning, exact resume, multi-process equivalence."""
import json
import subprocess

import pytest

from mode import checkpoint as ckpt
from mode import engine as eng
from mode.config import load_config
from mode.model import build_model
from mode.prepare import ByteTokenizer

from tests.util import PY, ROOT, TINY, deepspeed_train, env, mode_cli, scalars, side_by_side

CFG = "configs/tiny/dense.yaml"


@pytest.mark.slow
def test_end_to_end_tiny_run_learns(tmp_path):
    run = tmp_path / "run"
    mode_cli("train", "--config", CFG, *TINY, "data.max_documents=60", "train.max_steps=60", "train.eval_every=30",
             "train.log_every=10", "optim.warmup_steps=5", f"run.dir={run}")
    ev = scalars(run, "eval/loss")
    assert set(ev) == {0, 30, 60}
    assert ev[60] < ev[0] - 1.0, ev  # byte-level loss starts near ln(320) = 5.8
    for tag in ("train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/step_time_s",
                "perf/flops_per_token"):
        assert scalars(run, tag), tag
    info = json.loads((run / "run_info.json").read_text())
    assert info["params"] > 0 and (run / "DONE").exists()
    # the report tells runs of different tokenizers apart by this: the byte tokenizer's own identity
    assert info["tokenizer_sha256"] == ByteTokenizer().identity["sha256"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir())[-1] == "step_00000060"


# One schedule for the resume and the one-vs-two-process checks: 8 sequences per step, as 2 micro-batches
# of 4 in one process or 2 micro-batches of 2 on each of 2 ranks (the same 4 sequences per micro-step, and
# the same 8 evaluated: eval reads eval_batches x micro_batch_size x ranks). Checkpoints at 3, 6, 9 and 12;
# a resumed run stops at 6, so it restarts from a mid-run checkpoint.
COMMON = [*TINY, "train.max_steps=12", "train.log_every=1", "train.eval_every=6", "checkpoint.every=3",
          "optim.warmup_steps=2"]


def one_process(*overrides):
    return mode_cli("train", "--config", CFG, *COMMON, "train.micro_batch_size=4", "train.grad_accum=2", *overrides,
                    threads=1)  # one thread in every launch here: bit-for-bit comparisons need the same sums


def two_processes(*overrides):
    return deepspeed_train(2, CFG, *COMMON, "train.micro_batch_size=2", "train.grad_accum=2", *overrides)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Uninterrupted runs, one process and two, side by side; each prepares its own fresh
    data.prepared_dir (with 2 ranks: one prepares, one waits), which later launches reuse."""
    d = tmp_path_factory.mktemp("straight")
    side_by_side(lambda: one_process(f"data.prepared_dir={d / 'prepared_one'}", f"run.dir={d / 'one'}"),
                 lambda: two_processes(f"data.prepared_dir={d / 'prepared_two'}", f"run.dir={d / 'two'}"))
    return d


def _resume_check(straight, resumed, launch, prepared):
    launch(f"data.prepared_dir={prepared}", "train.stop_at=6", f"run.dir={resumed}")
    assert not (resumed / "DONE").exists()
    launch(f"data.prepared_dir={prepared}", f"run.dir={resumed}")
    a, b = scalars(straight, "train/loss"), scalars(resumed, "train/loss")
    assert list(a) == list(range(1, 13)) and a == b  # bit for bit
    assert scalars(straight, "eval/loss") == scalars(resumed, "eval/loss")
    assert scalars(straight, "eval/bpb") == scalars(resumed, "eval/bpb")


@pytest.mark.slow
def test_resume_is_exact_single_process(tmp_path, straight):
    _resume_check(straight / "one", tmp_path / "resumed", one_process, straight / "prepared_one")


@pytest.mark.slow
def test_resume_is_exact_two_processes(tmp_path, straight):
    _resume_check(straight / "two", tmp_path / "resumed", two_processes, straight / "prepared_two")


@pytest.mark.slow
def test_resume_is_exact_at_zero_stage_1(tmp_path, straight):
    """Bug caught: at ZeRO 1/2 DeepSpeed copies its recovery scripts into checkpoints/, and the resume
    of every stopped run was refused ("not a mode run"): the cluster preset trains at ZeRO 1."""
    def zero1(*overrides):
        return one_process("deepspeed.zero_stage=1", f"data.prepared_dir={straight / 'prepared_one'}", *overrides)

    side_by_side(lambda: zero1(f"run.dir={tmp_path / 'straight'}"),
                 lambda: zero1("train.stop_at=6", f"run.dir={tmp_path / 'resumed'}"))
    assert (tmp_path / "resumed" / "checkpoints" / "zero_to_fp32.py").is_file()  # what DeepSpeed writes there
    zero1(f"run.dir={tmp_path / 'resumed'}")
    for tag in ("train/loss", "eval/loss"):
        a, b = scalars(tmp_path / "straight", tag), scalars(tmp_path / "resumed", tag)
        assert a and a == b, (tag, a, b)  # bit for bit


@pytest.mark.slow
def test_resume_is_exact_in_bf16_at_zero_stage_1_two_processes(tmp_path, straight):
    """The cluster presets' setting: bf16 at ZeRO 1 accumulates in fp32 (DeepSpeed's BF16_Optimizer,
    which keeps its own fp32 master partitions and gradient buffers); a run stopped at step 6 and
    resumed on 2 ranks must log what the straight run logs, bit for bit, the grad norm included."""
    def bf16(*overrides):
        return two_processes("deepspeed.precision=bf16", "deepspeed.zero_stage=1",
                             f"data.prepared_dir={straight / 'prepared_two'}", *overrides)

    bf16(f"run.dir={tmp_path / 'straight'}")
    bf16("train.stop_at=6", f"run.dir={tmp_path / 'resumed'}")
    assert not (tmp_path / "resumed" / "DONE").exists()
    bf16(f"run.dir={tmp_path / 'resumed'}")
    for tag in ("train/loss", "train/grad_norm", "eval/loss"):
        a, b = scalars(tmp_path / "straight", tag), scalars(tmp_path / "resumed", tag)
        assert a and a == b, (tag, a, b)  # bit for bit
    assert list(scalars(tmp_path / "resumed", "train/loss")) == list(range(1, 13))


@pytest.mark.slow
def test_resume_is_exact_when_training_draws_random_numbers(tmp_path):
    """Bug caught: on CPU the peak for MFU was measured (torch.randn) after the resume had restored
    the RNG states, so with router jitter every step after the resume differed from the straight run."""
    args = ["train", "--config", "configs/tiny/moe.yaml", *TINY, "model.moe.jitter=0.05", "train.max_steps=6",
            "checkpoint.every=3", "train.log_every=1", "train.eval_every=0", "optim.warmup_steps=2"]
    side_by_side(lambda: mode_cli(*args, f"run.dir={tmp_path / 'straight'}", threads=1),
                 lambda: mode_cli(*args, "train.stop_at=3", f"run.dir={tmp_path / 'resumed'}", threads=1))
    mode_cli(*args, f"run.dir={tmp_path / 'resumed'}", threads=1)
    for tag in ("train/loss", "moe/layer1/dropped_routes_frac"):
        a, b = scalars(tmp_path / "straight", tag), scalars(tmp_path / "resumed", tag)
        assert list(a) == list(range(1, 7)) and a == b, (tag, a, b)  # bit for bit


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 2])
def test_two_processes_match_one_process(tmp_path, straight, zero):
    """Against the one-process run (ZeRO 0, gradient accumulation): two ranks with ZeRO 0 are the
    module's straight run, ZeRO 2 (partitioned gradients and optimizer state) is its own run."""
    two = straight / "two"
    if zero:
        two = tmp_path / "two"
        two_processes(f"deepspeed.zero_stage={zero}", f"data.prepared_dir={straight / 'prepared_two'}",
                      f"run.dir={two}")
    a, b = scalars(straight / "one", "train/loss"), scalars(two, "train/loss")
    assert list(a) == list(b) == list(range(1, 13))
    for s in a:
        assert b[s] == pytest.approx(a[s], rel=2e-5, abs=1e-5), (s, a[s], b[s])
    ea, eb = scalars(straight / "one", "eval/loss"), scalars(two, "eval/loss")
    assert list(ea) == list(eb) == [0, 6, 12]
    for s in ea:
        assert eb[s] == pytest.approx(ea[s], rel=1e-4), (s, ea[s], eb[s])


def test_accumulator_averages_each_key_over_its_own_count():
    import torch

    from mode.metrics import Accumulator

    acc = Accumulator()
    acc.add({"a": torch.tensor(1.0), "b": torch.tensor(10.0)})
    acc.add({"a": torch.tensor(3.0)})
    assert acc.read() == {"a": 2.0, "b": 10.0}


def test_accumulator_takes_the_maximum_of_maxima():
    # Bug caught: load_max (the busiest expert) averaged over steps and ranks, under-reporting overload.
    import torch

    from mode.metrics import Accumulator

    acc = Accumulator()
    acc.add({"moe/layer1/load_max": torch.tensor(1.5), "moe/layer1/load_mean": torch.tensor(1.0)})
    acc.add({"moe/layer1/load_max": torch.tensor(3.0), "moe/layer1/load_mean": torch.tensor(2.0)})
    assert acc.read() == {"moe/layer1/load_max": 3.0, "moe/layer1/load_mean": 1.5}


def _two_rank_accumulator(rank, port, out):
    import torch
    import torch.distributed as dist

    from mode.metrics import Accumulator
    from tests.util import leave_world

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    acc = Accumulator()
    acc.add({"load_max": torch.tensor([2.0, 5.0][rank]), "loss": torch.tensor([1.0, 3.0][rank])})
    vals = acc.read()
    if rank == 0:
        out.put(vals)
    leave_world(out)


@pytest.mark.slow
def test_accumulator_reduces_maxima_with_max_across_ranks():
    import torch.multiprocessing as mp

    from tests.util import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.start_processes(_two_rank_accumulator, args=(free_port(), q), nprocs=2, start_method="spawn")
    assert q.get(timeout=60) == {"load_max": 5.0, "loss": 2.0}


def test_a_run_saved_before_a_key_existed_still_resumes():
    """config_diff reads keys missing from a saved config as their defaults (a schema that grew must
    not lock old runs out), and still reports a new key set to a non-default value."""
    from mode.config import load_config
    from mode.train import config_diff

    new = load_config("configs/tiny/dense.yaml").to_dict()
    old = {k: dict(v) if isinstance(v, dict) else v for k, v in new.items()}
    del old["data"]["sample_by"]  # as saved by a version without the key
    assert config_diff(old, new) == []
    new["data"]["sample_by"] = "line"
    assert config_diff(old, new) == ["data.sample_by: 'document' -> 'line'"]


def _params_with_grads(seed: int, dtype):
    import torch

    g = torch.Generator().manual_seed(seed)
    shapes = [(8, 4), (4,), (3, 5, 2), (7,)]
    ps = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]
    for p in ps:
        p.grad = (3 * torch.randn(p.shape, generator=g)).to(dtype)
    return ps


def _groups(ps: list) -> list[dict]:
    """ps[2] as an expert-parallel parameter (its group flagged as moe_param_groups does): its norm
    goes through the expert path."""
    return [{"params": ps[:2]}, {"params": ps[2:3], "moe": True}, {"params": ps[3:]}]


@pytest.mark.parametrize("fused", [False, True], ids=["loop", "fused"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_guarded_adamw_clips_by_the_global_norm_like_torch(dtype, fused):
    """The global gradient norm (over shared and expert parameters) and the clipped AdamW update
    equal a float64 reference: torch's clip_grad_norm_ and torch's AdamW (per-tensor loop), with
    the default loop and with the fused kernel that build_engine picks on CPU and CUDA."""
    import torch

    from mode.engine import GuardedAdamW

    dt = getattr(torch, dtype)
    ps, ref = _params_with_grads(0, dt), _params_with_grads(0, torch.float64)
    norm64 = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in _params_with_grads(0, dt))))
    opt = GuardedAdamW(_groups(ps), clip=1.0, names={}, lr=0.1, weight_decay=0.0, fused=fused)
    opt.step()
    assert not opt.overflow and abs(opt._global_grad_norm - norm64) <= 1e-6 * norm64
    assert norm64 > 1.0  # so the clip applies
    for p, q in zip(ref, _params_with_grads(0, dt)):  # the reference starts from the same rounded values
        p.data, p.grad = q.data.double(), q.grad.double()
    torch.nn.utils.clip_grad_norm_(ref, 1.0)
    torch.optim.AdamW(ref, lr=0.1, weight_decay=0.0, foreach=False).step()
    tol = 1e-6 if dtype == "float32" else 1e-2  # bf16 parameters hold the update rounded to 8 bits
    for p, r in zip(ps, ref):
        assert torch.allclose(p.double(), r, atol=tol, rtol=tol)


@pytest.mark.parametrize("fused", [False, True], ids=["loop", "fused"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_guarded_adamw_takes_a_step_whose_huge_gradients_are_all_finite(dtype, fused):
    """Bug caught: the squared norms were summed in fp32, which overflows once the global norm passes
    ~1.8e19: a step whose gradients were all finite (norm ~5e20 here) was skipped as non-finite, with
    no parameter to name and a message blaming ZeRO or bf16 (grad_clip 0 too). The norm must equal
    float64's and the clipped update torch's."""
    import torch

    from mode.engine import GuardedAdamW

    dt = getattr(torch, dtype)
    ps, ref = _params_with_grads(0, dt), _params_with_grads(0, torch.float64)
    for p in ps:
        p.grad = p.grad * 1e20
    norm64 = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in ps)))
    assert 1e20 < norm64 < 3.4e38 and all(torch.isfinite(p.grad).all() for p in ps)
    opt = GuardedAdamW(_groups(ps), clip=1.0, names={}, lr=0.1, weight_decay=0.0, fused=fused)
    opt.step()
    assert not opt.overflow and opt.bad_params == [] and abs(opt._global_grad_norm - norm64) <= 1e-6 * norm64
    for p, q in zip(ref, _params_with_grads(0, dt)):
        p.data, p.grad = q.data.double(), q.grad.double() * 1e20
    torch.nn.utils.clip_grad_norm_(ref, 1.0)
    torch.optim.AdamW(ref, lr=0.1, weight_decay=0.0, foreach=False).step()
    tol = 1e-6 if dtype == "float32" else 1e-2
    for p, r in zip(ps, ref):
        assert torch.allclose(p.double(), r, atol=tol, rtol=tol)


def test_guarded_adamw_refuses_a_non_finite_step_and_names_the_parameter():
    import torch

    from mode.engine import GuardedAdamW

    ps = _params_with_grads(1, torch.float32)
    ps[1].grad[2] = float("nan")
    before = [p.detach().clone() for p in ps]
    opt = GuardedAdamW(_groups(ps), clip=1.0, names={ps[1]: "blocks.0.norm.weight"}, lr=0.1)
    opt.step()
    assert opt.overflow and opt.bad_params == ["blocks.0.norm.weight"]
    assert all(p.grad is None for p in ps) and all(torch.equal(p, b) for p, b in zip(ps, before))


@pytest.mark.parametrize("scale", [3.0, 3e20], ids=["plain", "huge_but_finite"])
def test_the_predictors_train_apart_clipped_by_their_own_norm(scale):
    """Bug caught: in the engine's optimizer the causal predictors' gradients counted in the norm the
    LM's gradients are clipped by, so predictor_loss_weight changed the LM's update (end to end:
    tests/test_mod_train.py). Here: the engine's groups hold every parameter but the predictors', and
    PredictorAdamW's step equals a float64 clip_grad_norm_ + AdamW over the predictors alone, also
    where an fp32 sum of squares overflows (norm > 1.8e19: such a step was skipped as non-finite)."""
    import torch

    from mode.config import load_config
    from mode.engine import PredictorAdamW, param_groups, predictor_params
    from mode.model import build_model

    cfg = load_config("configs/tiny/mod.yaml", ["model.d_model=32", "model.n_layers=2", "model.n_heads=2",
                                                "model.d_ff=64", "model.mod.layers=every"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    pred, grouped = predictor_params(model), [p for g in param_groups(model, 0.1) for p in g["params"]]
    assert len(pred) == 8 and not {id(p) for p in grouped} & {id(p) for p in pred}  # 2 layers x 2 Linear
    assert {id(p) for p in grouped} | {id(p) for p in pred} == {id(p) for p in model.parameters()}
    g = torch.Generator().manual_seed(0)
    for p in pred:
        p.grad = scale * torch.randn(p.shape, generator=g)
    ref = [p.detach().double().clone() for p in pred]
    for r, p in zip(ref, pred):
        r.grad = p.grad.double()
    assert float(torch.sqrt(sum((r.grad ** 2).sum() for r in ref))) > cfg.optim.grad_clip  # the clip applies
    opt = PredictorAdamW(cfg, model)
    opt.step(lr=0.1)
    torch.nn.utils.clip_grad_norm_(ref, cfg.optim.grad_clip)
    o = cfg.optim
    torch.optim.AdamW(ref, lr=0.1, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=0.0, foreach=False).step()
    for p, r in zip(pred, ref):
        assert torch.allclose(p.double(), r, atol=1e-6, rtol=1e-6)
    assert all(p.grad is None for p in pred)
    # a non-finite gradient: no update at all (weights and Adam's state as they were)
    before = [p.detach().clone() for p in pred]
    for p in pred:
        p.grad = torch.ones_like(p)
    pred[3].grad[0] = float("nan")
    opt.step(lr=0.1)
    assert all(torch.equal(p, b) for p, b in zip(pred, before))
    assert all(float(opt.opt.state[p]["step"]) == 1 for p in pred)


def test_init_scales_megablocks_expert_down_projection_like_the_others():
    """Bug caught: MegaBlocks names its experts' down projection `experts.mlp.w2` ([E*F, D]), which
    the output-projection rule missed: MegaBlocks runs started with it at the full init_std while
    native and DeepSpeed experts' w_out were scaled. MegaBlocks needs CUDA; the rule is checked
    on its parameter names (megablocks.layers.mlp: w1, v1, w2)."""
    import torch
    from torch import nn

    from mode.model.layers import init_weights

    mlp = nn.Module()
    for n in ("w1", "v1", "w2"):
        setattr(mlp, n, nn.Parameter(torch.empty(4 * 64, 32)))
    layer = nn.Module()
    layer.experts = nn.Module()
    layer.experts.mlp = mlp
    init_weights(layer, std=0.02, n_layers=8, seed=0)
    assert abs(float(mlp.w2.std()) / (0.02 / 16 ** 0.5) - 1) < 0.1
    assert all(abs(float(getattr(mlp, n).std()) / 0.02 - 1) < 0.1 for n in ("w1", "v1"))


def test_init_scales_residual_output_projections_by_depth():
    """Bug caught: the output projections of residual branches (attention out, MLP and expert
    w_out) initialised at init_std instead of init_std / sqrt(2 * n_layers) (GPT-2), or the
    scaling hitting other matrices. Reference: the empirical std of every matrix with >= 1024
    entries (std error <= 2.2%) against the rule written out by module name."""
    import re

    import torch

    from mode.config import load_config
    from mode.model import build_model

    cfg = load_config(ROOT / "configs/tiny/mode_staged.yaml").model
    torch.manual_seed(0)
    model = build_model(cfg)
    checked = 0
    for name, p in model.named_parameters():
        if p.dim() < 2 or p.numel() < 1024 or name.endswith("embed.weight") and cfg.tie_embeddings:
            continue
        residual_out = re.search(r"\.(attn\.out|mlp\.w_out)(\.weight)?$", name) is not None
        want = cfg.init_std / (2 * cfg.n_layers) ** 0.5 if residual_out else cfg.init_std
        std = float(p.detach().std())
        assert abs(std / want - 1) < 0.1, (name, std, want)
        checked += residual_out
    assert checked == 2 * cfg.n_layers  # every block's attention and MLP (or experts) output


def _offsets(group: dict) -> list[int]:
    """Each parameter's element offset in the flat buffer DeepSpeed makes of its group (ZeRO 1/2)."""
    out, at = [], 0
    for p in group["params"]:
        out.append(at)
        at += p.numel()
    return out


def test_new_runs_lay_every_parameter_but_the_odd_sized_tail_on_16_byte_alignment():
    """Bug caught (H200, session 28): `train.compile` at ZeRO 1/2 faulted with 'misaligned address'. ZeRO
    1/2 make each parameter a view of its group's flat buffer at the cumulative offset, and in module
    order a one-element router bias put every later view (norm weights) off 16 bytes; with those odd
    sizes moved last, compiled MoD trained at ZeRO 1 (bf16) and 2 (fp32) there."""
    cfg = load_config(ROOT / "configs/tiny/mod.yaml", ["model.n_layers=4"])
    model = build_model(cfg.model)
    legacy = eng.param_groups(model, 0.1, eng.MODULE_ORDER)
    assert any(off % eng.ALIGN_ELEMS for g in legacy for off, p in zip(_offsets(g), g["params"])
               if p.numel() % eng.ALIGN_ELEMS == 0)  # the layout that faulted: an even-sized view off alignment
    groups = eng.param_groups(model, 0.1)
    assert [sorted(map(id, g["params"])) for g in groups] == [sorted(map(id, g["params"])) for g in legacy]
    for g in groups:
        sizes = [p.numel() % eng.ALIGN_ELEMS for p in g["params"]]
        tail = next((i for i, r in enumerate(sizes) if r), len(sizes))
        assert all(sizes[tail:])  # after the first odd size, only odd sizes
        assert all(off % eng.ALIGN_ELEMS == 0 for off in _offsets(g)[:tail + 1])
    assert any(p.numel() == 1 for g in groups for p in g["params"])  # the router biases are there, last


def test_param_groups_rebuild_a_recorded_order_and_refuse_another_models():
    model = build_model(load_config(ROOT / "configs/tiny/mod.yaml", []).model)
    groups = eng.param_groups(model, 0.1)
    record = eng.param_order(model, groups)
    assert record != eng.param_order(model, eng.param_groups(model, 0.1, eng.MODULE_ORDER))
    shuffled = {name: names[::-1] for name, names in record.items()}
    again = eng.param_groups(model, 0.1, shuffled)
    assert eng.param_order(model, again) == shuffled
    assert [g["weight_decay"] for g in again] == [g["weight_decay"] for g in groups]
    with pytest.raises(ckpt.CheckpointError, match="param_order.json"):
        eng.param_groups(model, 0.1, {**record, "no_decay": record["no_decay"][:-1]})


def test_a_checkpoint_without_param_order_json_resumes_in_module_order(tmp_path):
    """The choice the slow test below checks end to end, on checkpoint directories as written."""
    from mode.train import resume_order

    old, new = tmp_path / "step_00000003", tmp_path / "step_00000006"
    record = {"decay": ["a"], "no_decay": ["b", "c"]}
    for d in (old, new):
        d.mkdir()
        ckpt.write_record(d, ckpt.CONFIG, {})
    ckpt.write_record(new, ckpt.PARAM_ORDER, {"groups": record})
    for d in (old, new):
        ckpt.write_manifest(d, ckpt.step_of(d))
    assert resume_order(None) is None  # a fresh start: the aligned order
    assert resume_order(old) == eng.MODULE_ORDER
    assert resume_order(new) == record
    # at another model.moe.ep_size the load is weights-only, and the expert parameters' names differ
    assert resume_order(new, same_layout=False) is None and resume_order(old, same_layout=False) is None


# A trainer as it was before checkpoints recorded param_order.json: the optimizer in module order.
MODULE_ORDER_TRAINER = """import sys
import mode.engine as e
groups = e.param_groups
e.param_groups = lambda model, wd, order=None: groups(model, wd, e.MODULE_ORDER)
from mode.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_checkpoint_from_before_param_order_json_resumes_exactly_in_module_order(tmp_path):
    """New runs lay the optimizer out in another order (odd sizes last, above); DeepSpeed's ZeRO 1
    checkpoint holds its fp32 weights and moments as flat partitions in the order they were written.
    A checkpoint without param_order.json must be resumed in module order: in the new order the
    same-sized flat state loads silently scrambled."""
    prepared = tmp_path / "prepared"
    mode_cli("data", "prepare", "--config", "configs/tiny/mod.yaml", *TINY, f"data.prepared_dir={prepared}")
    # 4 layers: in module order layer 1's router bias puts later blocks' norm weights off alignment
    args = ["train", "--config", "configs/tiny/mod.yaml", *COMMON, "model.n_layers=4", "train.micro_batch_size=4",
            "train.grad_accum=2", "deepspeed.zero_stage=1", f"data.prepared_dir={prepared}"]

    def old_trainer(*overrides):
        subprocess.run([PY, "-c", MODULE_ORDER_TRAINER, *args, *overrides], cwd=ROOT, env=env(1), check=True,
                       capture_output=True, timeout=600)

    side_by_side(lambda: old_trainer(f"run.dir={tmp_path / 'straight'}"),
                 lambda: old_trainer("train.stop_at=6", f"run.dir={tmp_path / 'resumed'}"))
    for d in ckpt.complete_checkpoints(tmp_path / "resumed" / "checkpoints"):  # as the old code wrote them
        (d / ckpt.PARAM_ORDER).unlink()
        ckpt.write_manifest(d, ckpt.step_of(d))
    # compiled, that layout would fault on CUDA: refused in one line, before anything is written
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "resumed").rglob("*"))
    r = mode_cli(*args, "train.compile=true", f"run.dir={tmp_path / 'resumed'}", threads=1, check=False)
    assert r.returncode == 2 and "config error: train.compile=True:" in r.stderr, r.stderr[-2000:]
    assert "blocks.2.attn.norm.weight" in r.stderr and "param_order.json" in r.stderr
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "resumed").rglob("*")) == before
    mode_cli(*args, f"run.dir={tmp_path / 'resumed'}", threads=1)
    for tag in ("train/loss", "eval/loss"):
        a, b = scalars(tmp_path / "straight", tag), scalars(tmp_path / "resumed", tag)
        assert a and a == b, (tag, a, b)  # bit for bit
    # ... and the checkpoints it writes from there record that order, so every later resume keeps it
    final = ckpt.latest(tmp_path / "resumed" / "checkpoints")
    record = json.loads((final / ckpt.PARAM_ORDER).read_text())["groups"]
    model = build_model(load_config(ROOT / "configs/tiny/mod.yaml", [*TINY, "model.n_layers=4"]).model)
    assert record == eng.param_order(model, eng.param_groups(model, 0.1, eng.MODULE_ORDER))

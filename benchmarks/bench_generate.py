"""Decode speed of dense, MoD, staged and integrated MoDE models, each beside its FLOP limit, and
prefill vs step-by-step prompt processing. Not a test: prints markdown tables (`--write` appends
them to benchmarks/RESULTS.md).

Shape (default): d_model 512, 8 layers, 8 heads, SwiGLU d_ff 2048, vocabulary 320 (byte
tokenizer), fp32. MoD: every other layer (1, 3, 5, 7) depth-routed at capacity 0.125. Staged
MoDE: the same routing around MoE blocks (8 experts of width d_ff, top-2). Integrated MoDE: MoE
layers of 8 real + 8 no-op experts, top-2, no depth routing. MoE layers are dropless at sampling
time (model.moe.inference_capacity_factor null).

Routing at sampling time is the calibrated threshold (`model.mod.causal: threshold`): with
momentum 0, one training-mode forward over random prompts sets each routed layer's threshold to
the k-th largest router score, as training would. The models are untrained (random weights):
speed depends on shapes and on the fraction of tokens each layer processes, not on the weights.

FLOP limit: analytic decode FLOPs per token of the dense model / of the model, counted from the
fraction of tokens each routed layer actually processed during the timed decode and the mean
length of its cache: per processed token 8 D^2 (QKV, out) + 4 D L (scores and values over a cache
of L keys) + the MLP (6 D F dense; 2 D X router + 6 D F per kept expert route); per token 2 D per
depth router (the threshold needs no predictor) and the head 2 D V. Norms, rotary, softmax,
gathers are not counted: they are what the measured speedup loses against the limit.

`--runs RUN ...` instead compares trained MoD runs that differ in `model.mod.causal`
(configs/experiments/mod_causal.yaml, issue #11): causal - top-k eval gap, processed fraction at
sampling time vs capacity per routed layer, and decode tokens/s at `--batches` side by side:
    python benchmarks/bench_generate.py --runs runs/mod_causal/*_seed0 --new 64 --batches 1,8 \
        --threads 1 --reps 5 --dense-ref configs/tiny/dense.yaml
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from mode.config import ModConfig, ModelConfig, MoEConfig  # noqa: E402
from mode.mod import MoDBlock  # noqa: E402
from mode.model import build_model  # noqa: E402
from mode.moe.base import MoEBase  # noqa: E402
from common import append_results  # noqa: E402  (benchmarks/common.py)


def configs(d: int, layers: int, heads: int, ff: int, capacity: float) -> dict[str, ModelConfig]:
    base = dict(vocab_size=320, d_model=d, n_layers=layers, n_heads=heads, d_ff=ff, max_seq_len=1024)
    mod = ModConfig(layers="every_other", capacity=capacity, causal="threshold", threshold_momentum=0.0)
    moe = dict(layers="every_other", num_experts=8, top_k=2, capacity_factor=1.0, inference_capacity_factor=None)
    return {
        "dense": ModelConfig(**base),
        "mod": ModelConfig(**base, mod=mod),
        "staged": ModelConfig(**base, mod=mod, moe=MoEConfig(**moe)),
        "integrated": ModelConfig(**base, moe=MoEConfig(**moe, num_noop_experts=8, noop_balance="include")),
    }


def build(cfg: ModelConfig, calib_BS: torch.Tensor) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():
        model.train()(calib_BS)  # calibrates the thresholds (momentum 0: the k-th largest score)
    return model.eval()


class Stats:
    """Per layer: processed fraction of the attention / MLP units, kept expert routes per token
    reaching the MoE, mean cache length; accumulated over decode steps."""

    def __init__(self, model):
        self.model, self.n = model, 0
        L = model.cfg.n_layers
        self.f_attn, self.f_mlp, self.routes, self.cache_len = [0.0] * L, [0.0] * L, [0.0] * L, [0.0] * L

    def add(self, caches):
        self.n += 1
        for i, b in enumerate(self.model.blocks):
            f = b.last_selected_BS.float().mean().item() if isinstance(b, MoDBlock) else 1.0
            self.f_attn[i] += f
            self.f_mlp[i] += f
            inner = b.inner if isinstance(b, MoDBlock) else b
            moe = getattr(inner.mlp, "mlp", None)
            if isinstance(moe, MoEBase) and moe.last_routing is not None and f > 0:
                self.routes[i] += moe.last_routing.keep_TK.float().sum(-1).mean().item() * f
            self.cache_len[i] += caches[i].len_B.float().mean().item()

    def flops(self) -> float:
        c = self.model.cfg
        d, ff, V = c.d_model, c.d_ff, c.vocab_size
        total = 2 * d * V
        for i, lp in enumerate(self.model.plan):
            fa, fm, L = self.f_attn[i] / self.n, self.f_mlp[i] / self.n, self.cache_len[i] / self.n
            total += len(lp.routes) * 2 * d + fa * (8 * d * d + 4 * d * L)
            if lp.mlp == "moe":
                X = c.moe.num_experts + c.moe.num_noop_experts
                total += fm * 2 * d * X + self.routes[i] / self.n * 6 * d * (c.moe.d_expert or ff)
            else:
                total += fm * 6 * d * ff
        return total

    def routed_fracs(self) -> str:
        out = []
        for i, lp in enumerate(self.model.plan):
            if lp.depth_routed:
                out.append(f"{self.f_attn[i] / self.n:.3f}")
            elif lp.mlp == "moe":
                out.append(f"{self.routes[i] / self.n / self.model.cfg.moe.top_k:.3f}r")
        return " ".join(out) or "-"


@torch.no_grad()
def decode(model, prompt_BP, new: int):
    """Prefill, then `new - 1` decoding steps (the generate_ids path), sampling at temperature 1
    (greedy decoding of an untrained model repeats one token: no spread of routing decisions).
    Returns (prefill seconds, decode seconds, Stats)."""
    B, P = prompt_BP.shape
    caches = model.new_caches(B, P + new)
    stats = Stats(model)
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    out = model(prompt_BP, routing="causal", caches=caches)
    nxt = torch.multinomial(out.logits[:, -1].softmax(-1), 1, generator=gen)[:, 0]
    prefill_s, decode_s = time.perf_counter() - t0, 0.0
    for j in range(new - 1):
        t = time.perf_counter()
        pos = torch.full((B, 1), P + j, dtype=torch.long)
        out = model(nxt[:, None], routing="causal", pos_BS=pos, caches=caches)
        nxt = torch.multinomial(out.logits[:, 0].softmax(-1), 1, generator=gen)[:, 0]
        decode_s += time.perf_counter() - t
        stats.add(caches)  # outside the timed part: its .item() reads are the benchmark's, not decoding's
    return prefill_s, decode_s, stats


@torch.no_grad()
def step_by_step(model, prompt_BP):
    B, P = prompt_BP.shape
    caches = model.new_caches(B, P)
    t0 = time.perf_counter()
    for t in range(P):
        model(prompt_BP[:, t:t + 1], routing="causal", pos_BS=torch.full((B, 1), t, dtype=torch.long), caches=caches)
    return time.perf_counter() - t0


def _routed(model) -> list[MoDBlock]:
    return [m for m in model.modules() if isinstance(m, MoDBlock)]


@torch.no_grad()
def sampling_fractions(model, cfg):
    """On the run's own eval batches (cfg.train.eval_batches x micro_batch): eval/loss (top-k) and
    eval/loss_causal recomputed, and per routed layer the fraction of tokens causal routing
    processes and how often its decision agrees with top-k membership. Causal routing decides each
    token from itself and earlier tokens, so these are exactly generation's decisions on this text."""
    from mode.data import DataModule

    layers = _routed(model)
    loss, sel, agree, n = {"topk": 0.0, "causal": 0.0}, [0.0] * len(layers), [0.0] * len(layers), 0
    for x, y in DataModule(cfg.data).val_batches(cfg.train.eval_batches, cfg.train.micro_batch_size):
        loss["topk"] += model(x, y, routing="topk").loss.item()
        member = [m.last_selected_BS.clone() for m in layers]
        loss["causal"] += model(x, y, routing="causal").loss.item()
        for i, m in enumerate(layers):
            sel[i] += m.last_selected_BS.float().mean().item()
            agree[i] += (m.last_selected_BS == member[i]).float().mean().item()
        n += 1
    return loss["topk"] / n, loss["causal"] / n, [f / n for f in sel], [a / n for a in agree]


@torch.no_grad()
def timed_decode(model, prompt_BP, new: int, stats: Stats | None = None) -> float:
    """Prefill (not timed), then new - 1 greedy decode steps; returns the decode seconds."""
    B, P = prompt_BP.shape
    caches = model.new_caches(B, P + new)
    nxt = model(prompt_BP, routing="causal", caches=caches).logits[:, -1].argmax(-1)
    t0 = time.perf_counter()
    for j in range(new - 1):
        pos = torch.full((B, 1), P + j, dtype=torch.long)
        nxt = model(nxt[:, None], routing="causal", pos_BS=pos, caches=caches).logits[:, 0].argmax(-1)
        if stats is not None:
            stats.add(caches)
    return time.perf_counter() - t0


def compare_runs(run_dirs: list[str], new: int = 64, batches: str = "1,8", reps: int = 3,
                 dense_ref: str | None = None) -> list[str]:
    """Trained MoD runs that differ in model.mod.causal (configs/experiments/mod_causal.yaml), side
    by side in one process: the causal - top-k eval gap, the fraction of tokens each routed layer
    processes at sampling time (on the eval text and during greedy decoding) vs its capacity, and
    greedy decode tokens/s at each batch size (prompts: the first validation windows' first 64
    tokens; rounds interleave the models, the median of `reps` rounds is reported). `dense_ref`: a
    config whose untrained model decodes beside them as the speed reference (speed does not depend
    on the weights of a dense model)."""
    from mode.config import load_config
    from mode.data import DataModule
    from mode.generate import load_run
    from tests.util import scalars

    models, quality = {}, ["| run | causal rule | eval/loss | eval/loss_causal | gap | capacity "
                           "| processed at sampling, eval text (per routed layer) | agreement with top-k "
                           "| processed at decode | causal rule's acc (last train log) |",
                           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    prompts_BP = None
    for d in run_dirs:
        model, _, cfg = load_run(d)
        name = os.path.basename(os.path.normpath(d))
        models[name] = model
        last = lambda tag: (list(scalars(d, tag).values()) or [float("nan")])[-1]  # noqa: E731
        ev, evc = last("eval/loss"), last("eval/loss_causal")
        re_ev, re_evc, sel, agree = sampling_fractions(model, cfg)
        assert abs(re_ev - ev) < 1e-4 and abs(re_evc - evc) < 1e-4, (d, ev, re_ev, evc, re_evc)  # same eval
        if prompts_BP is None:
            prompts_BP = next(DataModule(cfg.data).val_batches(1, max(map(int, batches.split(",")))))[0][:, :64]
        stats = Stats(model)
        timed_decode(model, prompts_BP, new, stats)
        dec = " ".join(f"{stats.f_attn[i] / stats.n:.3f}" for i, lp in enumerate(model.plan) if lp.depth_routed)
        acc_tag = {"predictor": "predictor_acc", "threshold": "threshold_acc"}.get(cfg.model.mod.causal,
                                                                                  "router_causal_acc")
        acc = " ".join(f"{last(f'{m.tag}/{acc_tag}'):.1%}" for m in _routed(model))
        quality.append(f"| {name} | {cfg.model.mod.causal} | {ev:.4f} | {evc:.4f} | {evc - ev:+.4f} | "
                       f"{cfg.model.mod.capacity} | {' '.join(f'{f:.3f}' for f in sel)} | "
                       f"{' '.join(f'{a:.1%}' for a in agree)} | {dec} | {acc} |")
    if dense_ref:
        torch.manual_seed(0)
        models["dense (untrained, " + os.path.basename(dense_ref) + ")"] = build_model(load_config(dense_ref).model).eval()
    ref = next(iter(models)) if not dense_ref else list(models)[-1]
    times = {(B, n): [] for B in map(int, batches.split(",")) for n in models}
    for _ in range(reps):  # rounds interleave the models so that load drifts hit them alike
        for B in map(int, batches.split(",")):
            for n, m in models.items():
                timed_decode(m, prompts_BP[:B], 8)  # warm-up
                times[(B, n)].append(timed_decode(m, prompts_BP[:B], new))
    speed = [f"| batch | run | decode tok/s (median of {reps}) | vs {ref} |", "| --- | --- | --- | --- |"]
    for B in map(int, batches.split(",")):
        tps = {n: B * (new - 1) / sorted(times[(B, n)])[len(times[(B, n)]) // 2] for n in models}
        speed += [f"| {B} | {n} | {t:,.0f} | {t / tps[ref]:.2f}x |" for n, t in tps.items()]
    return quality + [""] + speed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", nargs="+", help="compare trained runs (model.mod.causal variants) instead")
    ap.add_argument("--dense-ref", help="with --runs: a config whose untrained model decodes beside them")
    ap.add_argument("--reps", type=int, default=3, help="with --runs: interleaved timing rounds")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d-ff", type=int, default=2048)
    ap.add_argument("--capacity", type=float, default=0.125)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args()
    if a.runs:
        torch.set_num_threads(int(a.threads.split(",")[0]))
        print(f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
              f"{torch.get_num_threads()} thread(s), load average {os.getloadavg()}", flush=True)
        print("\n".join(compare_runs(a.runs, a.new, a.batches, a.reps, a.dense_ref)))
        print(f"load average after: {os.getloadavg()}")
        return
    g = torch.Generator().manual_seed(0)
    calib = torch.randint(0, 257, (8, a.prompt), generator=g)
    models = {name: build(cfg, calib) for name, cfg in configs(a.d_model, a.layers, a.heads, a.d_ff,
                                                                  a.capacity).items()}
    lines = ["\n## Generation: decode tokens/s vs FLOP limit (`benchmarks/bench_generate.py`)\n",
             f"Shape: d_model {a.d_model}, {a.layers} layers, {a.heads} heads, SwiGLU d_ff {a.d_ff}, vocab 320, "
             f"fp32; prompt {a.prompt} random tokens, {a.new} new tokens (sampled), MoD capacity {a.capacity} "
             f"every other layer, calibrated threshold. Machine: {platform.machine()} {os.cpu_count()} cores, "
             f"torch {torch.__version__}. Speedup = tokens/s over dense's in the same (batch, threads) round; "
             f"limit = dense decode FLOPs / model decode FLOPs from the fractions processed (per routed layer; "
             f"`r` = kept expert routes / top_k).\n",
             "| threads | batch | model | decode tok/s | speedup | FLOP limit | speedup / limit | processed per routed layer |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    print("\n".join(lines), flush=True)
    pre_rows = []
    for th in map(int, a.threads.split(",")):
        torch.set_num_threads(th)
        for B in map(int, a.batches.split(",")):
            prompt = torch.randint(0, 257, (B, a.prompt), generator=g)
            res = {}
            order = list(models) if B % 2 else list(models)[::-1]  # alternate who runs first (load drifts)
            for name, m in ((n, models[n]) for n in order):
                decode(m, prompt[:, :8], 4)  # warm-up
                pre_s, dec_s, st = decode(m, prompt, a.new)
                res[name] = (B * (a.new - 1) / dec_s, st.flops(), st, pre_s)
            for name, (tps, fl, st, _) in ((n, res[n]) for n in models):
                sp, lim = tps / res["dense"][0], res["dense"][1] / fl
                row = (f"| {th} | {B} | {name} | {tps:,.0f} | {sp:.2f}x | {lim:.2f}x | {sp / lim:.2f} | "
                       f"{st.routed_fracs()} |")
                lines.append(row)
                print(row, flush=True)
            if B == 1 and th == int(a.threads.split(",")[-1]):
                for name, m in models.items():
                    sbs = step_by_step(m, prompt)
                    pre_rows.append(f"| {th} | {B} | {name} | {res[name][3] * 1e3:,.1f} | {sbs * 1e3:,.1f} | "
                                    f"{sbs / res[name][3]:.1f}x |")
    pre = ["", f"Prompt processing, {a.prompt} tokens: one prefill forward vs one token per step (same caches "
               "and routing; outputs identical, tests/test_sampling.py).\n",
           "| threads | batch | model | prefill ms | step-by-step ms | prefill speedup |", "| --- | --- | --- | --- | --- | --- |",
           *pre_rows]
    print("\n".join(pre))
    lines += pre
    if a.write:
        append_results("\n".join(lines))


if __name__ == "__main__":
    main()

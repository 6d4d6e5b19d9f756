"""Analytic parameters and forward FLOPs per token, per block kind and for the model.

Conventions (checked against torch.utils.flop_counter.FlopCounterMode on the real modules):
- a matmul of [M, K] x [K, N] costs 2*M*K*N; elementwise ops, norms, softmax are not counted;
- attention scores and values cost 4 * S_proc * d per processed token: the full S x S product,
  which is what SDPA kernels without causal block skipping compute (S_proc = the tokens the
  block actually processes: k = round(capacity * S) in a depth-routed block);
- expert MLPs are counted at capacity: k * min(1, capacity_factor) routes per token
  (dropless: k). This is what capacity-padded implementations compute, and the upper bound of
  what the native backend computes; with no-op experts the real-expert capacity still bounds it;
- a depth-routed block counts its router (and predictor) on every token and its inner block on
  the processed fraction of tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

from mode.config import Config, ModelConfig, resolve_layers
from mode.routing.depth import capacity_k


def _mlp(d: int, f: int, kind: str) -> tuple[int, int]:
    """(params, flops/token) of one MLP."""
    n = (3 if kind == "swiglu" else 2) * d * f
    return n, 2 * n


@dataclass
class BlockCount:
    kind: str
    params: int
    flops_per_token: float


def block_count(cfg: ModelConfig, i: int, seq_len: int) -> BlockCount:
    d = cfg.d_model
    moe, mod = cfg.moe, cfg.mod
    is_moe = i in resolve_layers(moe.layers, cfg.n_layers)
    is_mod = i in resolve_layers(mod.layers, cfg.n_layers)

    s_proc = capacity_k(mod.capacity, seq_len) if is_mod else seq_len
    params = 4 * d * d + 2 * d  # attention projections + two norms
    flops = 8 * d * d + 4 * s_proc * d
    if is_moe:
        n_out = moe.num_experts + moe.num_noop_experts
        p_e, f_e = _mlp(d, moe.d_expert or cfg.d_ff, cfg.mlp)
        params += d * n_out + moe.num_experts * p_e  # router has no bias
        frac = 1.0 if moe.capacity_factor is None else min(1.0, moe.capacity_factor)
        flops += 2 * d * n_out + moe.top_k * frac * f_e
        kind = "integrated" if moe.num_noop_experts else "moe"
    else:
        p_m, f_m = _mlp(d, cfg.d_ff, cfg.mlp)
        params += p_m
        flops += f_m
        kind = "dense"
    if is_mod:
        flops *= s_proc / seq_len
        params += d + 1
        flops += 2 * d
        if mod.causal in ("predictor", "both"):
            h = mod.predictor_hidden or d // 2
            params += d * h + h + h + 1
            flops += 2 * d * h + 2 * h
        kind = "staged" if kind == "moe" else f"mod({kind})"
    return BlockCount(kind, params, flops)


def model_count(cfg: ModelConfig, seq_len: int) -> dict:
    """{'params', 'forward_flops_per_token', 'blocks': [...], 'head_flops_per_token'}."""
    d, V = cfg.d_model, cfg.vocab_size
    blocks = [block_count(cfg, i, seq_len) for i in range(cfg.n_layers)]
    params = V * d * (1 if cfg.tie_embeddings else 2) + d + sum(b.params for b in blocks)
    head = 2 * d * V
    return {
        "params": params,
        "forward_flops_per_token": head + sum(b.flops_per_token for b in blocks),
        "head_flops_per_token": head,
        "seq_len": seq_len,
        "blocks": [{"layer": i, "kind": b.kind, "params": b.params, "flops_per_token": b.flops_per_token}
                   for i, b in enumerate(blocks)],
    }


def count(cfg: Config) -> dict:
    return model_count(cfg.model, cfg.data.seq_len)


def flop_counter():
    """FlopCounterMode that also counts CPU flash attention (torch has no entry for it)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    def cpu_flash(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(q_shape, k_shape, v_shape)  # torch's own SDPA formula

    return FlopCounterMode(display=False, custom_mapping={
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_flash})


def format_table(c: dict) -> str:
    kinds: dict[str, list] = {}
    for b in c["blocks"]:
        kinds.setdefault(b["kind"], []).append(b)
    lines = [f"{'block kind':<16}{'layers':<14}{'params/block':>14}{'GFLOPs/token/block':>20}"]
    for k, bs in kinds.items():
        layers = ",".join(str(b["layer"]) for b in bs)
        lines.append(f"{k:<16}{layers:<14}{bs[0]['params']:>14,}{bs[0]['flops_per_token'] / 1e9:>20.6f}")
    lines.append(f"{'head':<16}{'':<14}{'':>14}{c['head_flops_per_token'] / 1e9:>20.6f}")
    lines.append(f"model: {c['params']:,} params, {c['forward_flops_per_token'] / 1e9:.6f} GFLOPs forward per token "
                 f"(seq_len {c['seq_len']})")
    return "\n".join(lines)


def solve_knob(cfg: Config, key: str, target_flops: float, lo: float, hi: float) -> float:
    """Value of the float config field `key` (e.g. `model.mod.capacity`) whose forward FLOPs per
    token come closest to `target_flops`; FLOPs must grow with the knob (bisection, then the
    best of the discrete steps the knob induces)."""
    import copy

    def flops_at(v: float) -> float:
        c = copy.deepcopy(cfg)
        obj = c
        *path, last = key.split(".")
        for p in path:
            obj = getattr(obj, p)
        setattr(obj, last, v)
        return count(c)["forward_flops_per_token"]

    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if flops_at(mid) < target_flops else (lo, mid)
    return min((lo, hi), key=lambda v: abs(flops_at(v) - target_flops))

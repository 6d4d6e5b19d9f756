"""Analytic parameters and forward FLOPs per token: the layer plan's units, composed.

Each unit reports its own cost (`cost` static methods: parameters and forward FLOPs per token it
processes, given how many tokens it sees); this module walks the layer plan (`mode/plan.py`) the
way the model builder does and composes them. Conventions (checked against
torch.utils.flop_counter.FlopCounterMode on the real modules, exactly):
- a matmul of [M, K] x [K, N] costs 2*M*K*N; elementwise ops, norms, softmax are not counted;
- attention scores and values cost 4 * S_kv * d per query token: the full product, which is
  what SDPA kernels without causal block skipping compute (a depth-routed attention sees
  k = round(capacity * S) queries, and k keys, or all S keys with `kv: all`);
- expert MLPs are counted at capacity: min(E, k * min(1, capacity_factor)) routes per token
  (dropless: min(E, k)). Up to capacity factor 1 this is what capacity-padded implementations
  compute and the upper bound of what the native backend computes; above 1 a padded buffer
  (DeepSpeed, native on accelerators) computes k * capacity_factor rows per token, of which at
  most k hold a route: the count stays at the k routes (a convention). With no-op experts the
  real-expert capacity still bounds it. Exact when E divides capacity_factor * k * T (T tokens
  per routing call): otherwise padding rounds each expert's capacity up, at most E rows per call
  more than counted; `model.moe.min_capacity` (a floor for small calls) is not counted;
- a depth-routed unit counts its router (and predictor) on every token and the unit on the
  processed fraction of tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

from mode.config import Config, ModelConfig
from mode.mod import MoDBlock
from mode.model.blocks import AttnSublayer, MLPSublayer
from mode.mlp import MLP
from mode.moe.base import MoEBase
from mode.plan import LayerPlan, Route, layer_plan
from mode.routed import Cost
from mode.routing.depth import capacity_k


@dataclass
class BlockCount:
    kind: str
    params: int
    flops_per_token: float


def layer_cost(cfg: ModelConfig, lp: LayerPlan, seq_len: int) -> Cost:
    """Cost per token of the sequence of the block `build_block(cfg, lp)` builds. A unit's cost
    function takes (query tokens, key/value tokens) per row: what a routing wrapper lets it see."""
    mlp = MoEBase.cost(cfg) if lp.mlp == "moe" else MLP.cost(cfg.d_model, cfg.d_ff, cfg.mlp)

    def routed(route: Route | None, s: int, unit) -> Cost:
        if route is None:
            return unit(s, s)
        k = capacity_k(route.capacity, s)
        return MoDBlock.cost(cfg.mod, cfg.d_model, route.capacity, s, unit(k, s if route.kv == "all" else k))

    def attn(q: int, kv: int) -> Cost:
        return AttnSublayer.cost(cfg, q, kv)

    def mlp_sub(q: int, kv: int) -> Cost:
        return MLPSublayer.cost(cfg, mlp)

    def block(q: int, kv: int) -> Cost:
        a = attn(q, kv) if lp.attn is None else routed(lp.attn, q, attn)
        return a + routed(lp.mlp_route, q, mlp_sub)

    return routed(lp.block, seq_len, block)


def block_count(cfg: ModelConfig, lp: LayerPlan, seq_len: int) -> BlockCount:
    c = layer_cost(cfg, lp, seq_len)
    return BlockCount(lp.kind, c.params, c.flops)


def model_count(cfg: ModelConfig, seq_len: int) -> dict:
    """{'params', 'forward_flops_per_token', 'blocks': [...], 'head_flops_per_token'}."""
    d, V = cfg.d_model, cfg.vocab_size  # embedding (tied or not), final norm, head
    blocks = [block_count(cfg, lp, seq_len) for lp in layer_plan(cfg)]
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
    # One row per distinct block (a per-layer capacity schedule gives each routed layer its own).
    kinds: dict[tuple, list] = {}
    for b in c["blocks"]:
        kinds.setdefault((b["kind"], b["params"], b["flops_per_token"]), []).append(b)
    rows = [(k, ",".join(str(b["layer"]) for b in bs), params, flops) for (k, params, flops), bs in kinds.items()]
    # columns as wide as their longest entry (+2): a kind such as mod_split(integrated)+kv_all ran into the layers
    wk = max([len("block kind"), *(len(r[0]) for r in rows)]) + 2
    wl = max([len("layers"), *(len(r[1]) for r in rows)]) + 2
    lines = [f"{'block kind':<{wk}}{'layers':<{wl}}{'params/block':>14}{'GFLOPs/token/block':>20}"]
    for k, layers, params, flops in rows:
        lines.append(f"{k:<{wk}}{layers:<{wl}}{params:>14,}{flops / 1e9:>20.6f}")
    lines.append(f"{'head':<{wk}}{'':<{wl}}{'':>14}{c['head_flops_per_token'] / 1e9:>20.6f}")
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

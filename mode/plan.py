"""The layer plan: the model config resolved ONCE into what each layer is.

Everything that needs to know which layer is dense, MoE or depth-routed reads the plan: the model
builder (`mode/model/lm.py`), FLOP and parameter counting (`mode/flops.py`), the engine (expert
parallel param groups), the trainer (causal eval) and the analysis (processed fractions). No
torch here: the analysis and the CLI read plans of runs without building a model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from mode.config import ModelConfig, resolve_layers


@dataclass(frozen=True)
class Route:
    """Depth routing (expert-choice top-k over the sequence) around one unit of a layer."""

    capacity: float
    """Fraction of the sequence the unit processes: k = max(1, round(capacity * S))."""
    tag: str
    """TensorBoard prefix of its router: `mod/layer1` (whole block), `mod_attn/layer1`, `mod_mlp/layer1`."""
    kv: str = "selected"
    """Keys/values of attention inside the route: `selected` or `all` (K/V-from-all)."""


@dataclass(frozen=True)
class LayerPlan:
    index: int
    mlp: str
    """`dense` or `moe` (num_noop_experts > 0 makes it integrated MoDE)."""
    block: Optional[Route] = None
    """Depth routing around the whole block (MoD; staged MoDE when mlp is moe)."""
    attn: Optional[Route] = None
    """Depth routing around the attention sublayer alone (decoupled routing)."""
    mlp_route: Optional[Route] = None
    """Depth routing around the MLP sublayer alone (decoupled routing)."""
    integrated: bool = False
    """The MoE MLP has no-op experts."""

    @property
    def routes(self) -> List[Route]:
        return [r for r in (self.block, self.attn, self.mlp_route) if r is not None]

    @property
    def depth_routed(self) -> bool:
        return bool(self.routes)

    @property
    def kind(self) -> str:
        base = "integrated" if self.integrated else self.mlp
        if self.block is not None:
            kind = "staged" if base == "moe" else f"mod({base})"
            return kind + ("+kv_all" if self.block.kv == "all" else "")
        if self.attn is not None or self.mlp_route is not None:  # a sublayer routed alone (decoupled)
            return f"mod_split({base})" + ("+kv_all" if self.attn is not None and self.attn.kv == "all" else "")
        return base

    def mlp_frac(self, seq_len: int) -> float:
        """Fraction of a sequence's tokens the layer's MLP sees under top-k routing: k/S, the
        capacity as rounded to whole tokens (0.125 of 100 tokens is 12 of them: capacity_k)."""
        r = self.block or self.mlp_route
        return 1.0 if r is None else capacity_k(r.capacity, seq_len) / seq_len


def capacity_k(capacity: float, seq_len: int) -> int:
    """k, the tokens of a sequence a depth router sends through: capacity x S rounded to whole
    tokens, at least 1 (plain Python: analysis reads it without torch)."""
    return max(1, min(seq_len, round(capacity * seq_len)))


def _per_layer(value, j: int) -> float:
    return float(value[j] if isinstance(value, list) else value)


def layer_plan(cfg: ModelConfig) -> List[LayerPlan]:
    """One LayerPlan per layer. A capacity list holds one value per routed layer, in layer order."""
    moe_layers = set(resolve_layers(cfg.moe.layers, cfg.n_layers))
    mod_layers = resolve_layers(cfg.mod.layers, cfg.n_layers)
    m = cfg.mod
    plans = []
    for i in range(cfg.n_layers):
        is_moe = i in moe_layers
        kw = dict(index=i, mlp="moe" if is_moe else "dense", integrated=is_moe and cfg.moe.num_noop_experts > 0)
        if i in mod_layers:
            j = mod_layers.index(i)
            if m.decoupled:
                ca = m.attn_capacity if m.attn_capacity is not None else m.capacity
                cm = m.mlp_capacity if m.mlp_capacity is not None else m.capacity
                kw.update(attn=Route(_per_layer(ca, j), f"mod_attn/layer{i}", m.kv),
                          mlp_route=Route(_per_layer(cm, j), f"mod_mlp/layer{i}"))
            else:
                kw.update(block=Route(_per_layer(m.capacity, j), f"mod/layer{i}", m.kv))
        plans.append(LayerPlan(**kw))
    return plans


def has_depth_routing(plan: List[LayerPlan]) -> bool:
    return any(p.depth_routed for p in plan)


def has_moe(plan: List[LayerPlan]) -> bool:
    return any(p.mlp == "moe" for p in plan)


def routes_at_sampling(plan: List[LayerPlan]) -> bool:
    """Whether sampling-time routing (causal depth decisions, dropless experts) can differ from
    training-time routing: then the trainer evaluates both (eval/loss and eval/loss_causal)."""
    return has_depth_routing(plan) or has_moe(plan)

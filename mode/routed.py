"""The contracts every block and every router of the model keeps. Imports nothing of the model.

Block contract (`mode/model/blocks.py`, `mode/mod.py`): a block, a sublayer (attention or MLP
with its pre-norm) and a routing wrapper are all called as

    delta_BSD = unit(x_BSD, ctx)

and return the UPDATE they add to the residual stream (the caller does `x + delta`): a token a
unit did not engage gets exactly zero, so it leaves the unit bit-identical. After the call
`unit.last_engaged_BS` is a bool [B, S] of the tokens that got the unit's full computation, or
None when every token did. `Ctx` carries everything but the stream.

Routed protocol: a module that routes tokens (a depth router wrapper, an MoE MLP) holds, after
each forward, `aux_loss` (a weighted scalar to add to the LM loss, or None), `metrics`
(name -> on-device scalar, read only at logging steps) and reports them under `tag`
(`mod/layer1`, `mod_attn/layer1`, `moe/layer3`, ...). The LM collects every module that
matches it; the LM takes `aux_loss` away after each forward (no autograd state survives).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Protocol, runtime_checkable


@runtime_checkable
class Routed(Protocol):
    tag: str
    """TensorBoard prefix of this router's metrics, e.g. `mod/layer1`."""
    aux_loss: Any
    """Weighted auxiliary loss of the last forward (a scalar tensor) or None."""
    metrics: dict
    """name -> on-device scalar of the last forward."""


@dataclass
class Ctx:
    """What a unit needs besides the stream. Shape legend: B rows, S tokens the unit sees."""

    pos_BS: Any
    """Original positions of the tokens (rotary; causal masks of gathered subsets)."""
    valid_BS: Optional[Any] = None
    """False marks padding (ragged causal routing); None = all valid."""
    cache: Optional[Any] = None
    """KVCache of this layer during generation (a prefill into the empty cache, then one token per
    row per step), else None."""
    routing: str = "topk"
    """`topk` (training, the paper's eval) or `causal` (every decision for a token depends only on
    it and earlier tokens of its row: generation and eval/loss_causal; MoE layers are dropless)."""
    kv_x_BSD: Optional[Any] = None
    """K/V-from-all attention: the layer input of EVERY token (keys and values come from it,
    queries from the unit's own tokens); None = keys and values from the unit's tokens."""
    kv_pos_BS: Optional[Any] = None
    """Positions of kv_x_BSD."""
    kv_valid_BS: Optional[Any] = None
    """False marks padding among kv_x_BSD (a ragged prefill); None = all valid."""

    def with_(self, **kw) -> "Ctx":
        return replace(self, **kw)


# Training FLOPs per forward FLOP: forward + backward (~2x forward). The one convention of MFU,
# TFLOP/s, train/flops_seen and the report's FLOP axes.
TRAIN_FLOPS_PER_FORWARD_FLOP = 3.0


@dataclass(frozen=True)
class Cost:
    """What a unit reports about itself: its parameters and its forward FLOPs per token it
    processes (a matmul [M, K] x [K, N] = 2*M*K*N; elementwise ops, norms, softmax: 0).
    `mode/flops.py` composes the units' costs along the layer plan."""

    params: int
    flops: float

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.params + other.params, self.flops + other.flops)


def both_engaged(a, b):
    """AND of two `last_engaged_BS` masks, None meaning 'every token'."""
    return b if a is None else a if b is None else a & b

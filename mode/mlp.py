"""The feed-forward block (SwiGLU or GELU): the dense blocks' MLP and every MoE expert.

It lives outside `mode.model` because `mode.moe` builds its experts from it while `mode.model`
builds MoE layers: inside the package, importing an expert would run `mode/model/__init__` and
import the model, an import cycle (`mode.model.layers` re-exports it).

Shape legend: B batch, S sequence, D d_model, F MLP hidden.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mode.routed import Cost


def activation(h: torch.Tensor, kind: str) -> torch.Tensor:
    """The hidden activation of a dense MLP or an expert: SwiGLU on [gate | up], or exact GELU."""
    if kind == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h)


class MLP(nn.Module):
    def __init__(self, d_model: int, d_ff: int, kind: str = "swiglu"):
        super().__init__()
        self.kind = kind
        self.w_in = nn.Linear(d_model, (2 if kind == "swiglu" else 1) * d_ff, bias=False)
        self.w_out = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x_BSD: torch.Tensor, valid_BS=None, routing: str = "topk") -> torch.Tensor:
        return self.w_out(activation(self.w_in(x_BSD), self.kind))

    @staticmethod
    def cost(d: int, f: int, kind: str) -> Cost:
        n = (3 if kind == "swiglu" else 2) * d * f
        return Cost(n, 2 * n)

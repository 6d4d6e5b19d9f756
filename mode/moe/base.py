"""What every MoE backend shares: mode's router decides, the backend executes the decisions.

Shape legend: B batch, S sequence, T = B*S tokens, D d_model.

A backend subclasses MoEBase and implements `compute(x_TD, r) -> y_TD` (dispatch, expert
compute, combine for the Routing `r`); `forward` routes, computes and records what the block
contract and the Routed protocol (`mode/routed.py`) ask for: `aux_loss`, `metrics`,
`last_engaged_BS` (tokens with at least one kept real-expert route) and `last_routing`.
A backend that routes inside its own layer (DeepSpeed) overrides `forward` and calls `record`.
"""
from __future__ import annotations

import torch
from torch import nn

from mode.config import ModelConfig
from mode.mlp import MLP
from mode.routed import Cost
from mode.routing.experts import Routing


class MoEBase(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        m = cfg.moe
        self.E, self.K, self.kind = m.num_experts, m.top_k, cfg.mlp
        self.tag = f"moe/layer{layer_idx}"
        self.aux_loss, self.metrics = None, {}
        self.last_engaged_BS: torch.Tensor | None = None
        self.last_routing: Routing | None = None

    def forward(self, x_BSD: torch.Tensor, valid_BS: torch.Tensor | None = None, routing: str = "topk") -> torch.Tensor:
        B, S, D = x_BSD.shape
        self.router.sampling = routing == "causal"  # sampling time: inference_capacity_factor (dropless)
        x_TD = x_BSD.reshape(-1, D)
        r = self.router(x_TD, None if valid_BS is None else valid_BS.reshape(-1))
        y_TD = self.compute(x_TD, r)
        self.record(r.aux_loss, r.metrics, r.engaged_T.view(B, S), r)
        return y_TD.view(B, S, D)

    def compute(self, x_TD: torch.Tensor, r: Routing) -> torch.Tensor:
        raise NotImplementedError

    def record(self, aux_loss, metrics: dict, engaged_BS: torch.Tensor, routing: Routing | None = None) -> None:
        self.aux_loss, self.metrics, self.last_engaged_BS, self.last_routing = aux_loss, metrics, engaged_BS, routing

    @staticmethod
    def cost(cfg: ModelConfig) -> Cost:
        """Per token: the router over E + N outputs (no bias) and the experts counted at capacity,
        min(E, top_k * min(1, capacity_factor)) rows (dropless: min(E, top_k); a token reaches each
        real expert at most once, so with no-op experts and top_k > E at most E). Up to capacity
        factor 1 this is what capacity-padded implementations compute and what bounds the native
        backend (above 1 padded buffers hold top_k * capacity_factor rows, the count stays at the
        routes); no-op experts cost nothing. Exact when E divides capacity_factor * top_k * T for
        the T tokens of a routing call: padding rounds each expert's capacity up (at most E rows
        more per call), and `min_capacity`, a floor for small calls, is not counted."""
        m, d = cfg.moe, cfg.d_model
        n_out = m.num_experts + m.num_noop_experts
        e = MLP.cost(d, m.d_expert or cfg.d_ff, cfg.mlp)
        frac = 1.0 if m.capacity_factor is None else min(1.0, m.capacity_factor)
        rows = min(m.num_experts, m.top_k * frac)
        return Cost(d * n_out + m.num_experts * e.params, 2 * d * n_out + rows * e.flops)

"""Native MoE MLP: pure PyTorch, sort/gather dispatch; the reference for the other backends.

Shape legend: B batch, S sequence, T = B*S tokens, D d_model, F expert hidden (2F for the
fused SwiGLU input projection), E real experts, C slots per expert, K top_k, R = K*T routes,
M expert-buffer rows (E*C when dropping, the real-route count when dropless).

Three steps, as the router decides and the backends execute:
  dispatch  every kept route names a row of the expert buffer (`slot`); the buffer is filled
            with one gather of token rows (no one-hot matrices);
  compute   stacked expert weights w_in [E, D, 2F|F], w_out [E, F, D]:
            dropping  -> a padded [E, C, D] buffer and two batched matmuls; C is static (from
                         the number of token rows), so there is no host sync;
            dropless  -> routes grouped by expert with per-expert split sizes, one matmul pair
                         per expert (host sync: the sizes are data-dependent; unavoidable);
  combine   each token gathers its routes' rows and sums them weighted by the router weights,
            in fp32 (dropped, no-op and padding routes read an all-zero scratch row).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mode.config import ModelConfig
from mode.model.blocks import Routed
from mode.routing.experts import ExpertRouter, Routing


def activation(h: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "swiglu":  # same layout as layers.MLP: [gate | up]
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h)


def combine(out_MD: torch.Tensor, slot_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
    """y_t = sum_j w_tj * out[slot_tj]; slot == M is the zero scratch row. fp32 accumulation."""
    T, K = slot_TK.shape
    out_pad = torch.cat([out_MD, out_MD.new_zeros(1, out_MD.shape[1])])
    routed_TKD = out_pad.index_select(0, slot_TK.reshape(-1)).view(T, K, -1)
    if K == 1:
        return (routed_TKD[:, 0] * w_TK).to(out_MD.dtype)
    return (routed_TKD * w_TK[..., None]).sum(1).to(out_MD.dtype)


class NativeMoE(nn.Module, Routed):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        moe = cfg.moe
        self.E, self.K, self.kind = moe.num_experts, moe.top_k, cfg.mlp
        d_ff = moe.d_expert or cfg.d_ff
        self.router = ExpertRouter(cfg.d_model, moe)
        self.w_in = nn.Parameter(torch.empty(self.E, cfg.d_model, (2 if cfg.mlp == "swiglu" else 1) * d_ff))
        self.w_out = nn.Parameter(torch.empty(self.E, d_ff, cfg.d_model))
        for w in (self.w_in, self.w_out):  # the LM re-initialises (w_out scaled by depth)
            nn.init.normal_(w, std=cfg.init_std)
        self.tag = f"moe/layer{layer_idx}"
        self.aux_loss, self.metrics = None, {}
        self.last_engaged_BS: torch.Tensor | None = None
        self.last_routing: Routing | None = None

    def expert_mlp(self, x_ECD: torch.Tensor) -> torch.Tensor:
        return torch.bmm(activation(torch.bmm(x_ECD, self.w_in), self.kind), self.w_out)

    def forward(self, x_BSD: torch.Tensor, valid_BS: torch.Tensor | None = None) -> torch.Tensor:
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(-1, D)
        T, E = x_TD.shape[0], self.E
        r = self.router(x_TD, None if valid_BS is None else valid_BS.reshape(-1))
        if r.capacity is not None:
            y_TD = self._dropping(x_TD, r)
        else:
            y_TD = self._dropless(x_TD, r)
        self.aux_loss, self.metrics = r.aux_loss, r.metrics
        self.last_engaged_BS, self.last_routing = r.engaged_T.view(B, S), r
        return y_TD.view(B, S, D)

    def _dropping(self, x_TD: torch.Tensor, r: Routing) -> torch.Tensor:
        T, D = x_TD.shape
        E, C = self.E, r.capacity
        slot_TK = torch.where(r.keep_TK, r.idx_TK * C + r.pos_TK, E * C)  # E*C: scratch
        # Invert route -> slot into slot -> source token (T = the zero pad row): one gather
        # fills the buffer, and its backward is one index_add.
        src_M = torch.full((E * C + 1,), T, dtype=torch.long, device=x_TD.device)
        tok_TK = torch.arange(T, device=x_TD.device)[:, None].expand_as(slot_TK)
        src_M.scatter_(0, slot_TK.reshape(-1), tok_TK.reshape(-1))
        x_pad = torch.cat([x_TD, x_TD.new_zeros(1, D)])
        x_ECD = x_pad.index_select(0, src_M[:-1]).view(E, C, D)
        return combine(self.expert_mlp(x_ECD).view(E * C, D), slot_TK, r.w_TK)

    def _dropless(self, x_TD: torch.Tensor, r: Routing) -> torch.Tensor:
        T, D = x_TD.shape
        sizes = r.counts_E.tolist()  # host sync: per-expert split sizes (dropless, unavoidable)
        M = sum(sizes)
        tok_M = r.order_R[:M] % T  # real routes come first in order_R, grouped by expert
        xs_MD = x_TD.index_select(0, tok_M)
        outs = [activation(xe @ self.w_in[e], self.kind) @ self.w_out[e]
                for e, xe in enumerate(xs_MD.split(sizes)) if xe.shape[0]]
        out_MD = torch.cat(outs) if outs else xs_MD
        # A route's row in the grouped buffer: its expert's offset + its rank there.
        start_E = r.counts_E.cumsum(0) - r.counts_E
        slot_TK = torch.where(r.keep_TK, start_E[r.idx_TK.clamp(max=self.E - 1)] + r.pos_TK, M)
        return combine(out_MD, slot_TK, r.w_TK)

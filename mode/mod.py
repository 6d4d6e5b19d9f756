"""MoDBlock: Mixture-of-Depths routing around ANY block (dense -> MoD, MoE -> staged MoDE).

Shape legend: B batch, S sequence, K tokens processed per row, D d_model, N = B * K.

Selected tokens: `x + g(r) * delta` where delta is what the wrapped block adds to the residual
and r the raw router score (g = identity as in the paper, or sigmoid); the product is what puts
the router on the gradient path. Unselected tokens are returned bit-identical. The wrapped
block sees the gathered tokens with their ORIGINAL positions (rotary) and causal attention
among them. Routing modes:
  topk    - k = max(1, round(capacity * S)) per row (training, the paper's eval);
  causal  - each token decides alone from the predictor (or sigmoid(r) > 0.5): sampling-safe;
            rows then hold different counts, padded to the row maximum with a key mask.
With a KV cache (one decoding step) routing is always causal; only rows whose token is
selected append to this layer's cache, so its per-row length counts the tokens it processed.
"""
from __future__ import annotations

import torch
from torch import nn

from mode.config import ModConfig
from mode.model.blocks import Routed
from mode.model.layers import KVCache
from mode.routing.depth import DepthRouter, capacity_k, topk_sorted


def _identity(r: torch.Tensor) -> torch.Tensor:
    return r  # a named function, not a lambda: the module must pickle / deepcopy


def _flat(idx_BK: torch.Tensor, S: int) -> torch.Tensor:
    """Row-local indices -> indices into the [B * S] flattened sequence (one batched gather)."""
    return (idx_BK + S * torch.arange(idx_BK.shape[0], device=idx_BK.device)[:, None]).reshape(-1)


class MoDBlock(nn.Module, Routed):
    def __init__(self, inner: nn.Module, cfg: ModConfig, d_model: int, layer_idx: int):
        super().__init__()
        self.inner, self.cfg = inner, cfg
        self.router = DepthRouter(d_model, cfg)
        self.gate = torch.sigmoid if cfg.gate == "sigmoid" else _identity
        self.tag = f"mod/layer{layer_idx}"
        self.aux_loss, self.metrics = None, {}
        self.last_selected_BS: torch.Tensor | None = None  # for routing dumps / analysis

    def forward(self, x_BSD, pos_BS, valid_BS=None, cache: KVCache | None = None, routing: str = "topk"):
        B, S, D = x_BSD.shape
        r_BS = self.router.scores(x_BSD)
        if cache is not None:
            return self._decode_step(x_BSD, pos_BS, r_BS, cache)
        if routing == "topk":
            # Learned: top-k of r. Stochastic (the paper's control): a random k; g(r) still
            # scales the update, so the router keeps its gradient either way.
            k = capacity_k(self.cfg.capacity, S)
            sel_scores_BS = r_BS if self.cfg.routing == "learned" else torch.rand_like(r_BS)
            idx_BK = topk_sorted(sel_scores_BS.detach(), k)
            valid_BK = None
            member_BS = torch.zeros_like(r_BS).scatter_(1, idx_BK, 1.0)
            self.aux_loss, self.metrics = self.router.losses(x_BSD, r_BS, member_BS)
            self.last_selected_BS = member_BS.bool()
        elif routing == "causal":
            sel_BS = self.router.causal_logits(x_BSD, r_BS) > 0
            if valid_BS is not None:
                sel_BS = sel_BS & valid_BS
            count_B = sel_BS.sum(1)
            K = int(count_B.max())  # host sync: the ragged width is data-dependent
            self.aux_loss, self.last_selected_BS = None, sel_BS
            self.metrics = {"causal_processed_frac": sel_BS.float().mean()}
            if K == 0:
                return x_BSD
            # Selected positions first, in position order (stable sort); the tail is padding.
            idx_BK = torch.sort((~sel_BS).to(torch.uint8), dim=1, stable=True).indices[:, :K]
            valid_BK = torch.arange(K, device=x_BSD.device)[None] < count_B[:, None]
        else:
            raise ValueError(f"routing must be 'topk' or 'causal', got {routing!r}")

        flat_N = _flat(idx_BK, S)
        x_ND = x_BSD.reshape(B * S, D)
        xg_BKD = x_ND.index_select(0, flat_N).view(B, -1, D)
        delta_BKD = self.inner(xg_BKD, pos_BS.gather(1, idx_BK), valid_BK, None)
        upd_BKD = (self.gate(r_BS.gather(1, idx_BK))[..., None] * delta_BKD).to(x_BSD.dtype)
        if valid_BK is None:
            # x + upd at the selected rows, x copied elsewhere; its backward passes the gradient
            # to x untouched (a copy-scatter would have to zero the selected rows first).
            return x_ND.index_add(0, flat_N, upd_BKD.reshape(-1, D)).view(B, S, D)
        # Ragged: padding slots write their own x back, so they stay bit-identical.
        y_BKD = torch.where(valid_BK[..., None], xg_BKD + upd_BKD, xg_BKD)
        return x_ND.index_copy(0, flat_N, y_BKD.reshape(-1, D)).view(B, S, D)

    def _decode_step(self, x_B1D, pos_B1, r_B1, cache: KVCache):
        """One token per row: every row runs the block (a static shape), only rows whose token is
        selected append to the cache and take the update."""
        sel_B1 = self.router.causal_logits(x_B1D, r_B1) > 0
        cache.write_B = sel_B1[:, 0]
        try:
            delta_B1D = self.inner(x_B1D, pos_B1, None, cache)
        finally:
            cache.write_B = None
        y_B1D = x_B1D + (self.gate(r_B1)[..., None] * delta_B1D).to(x_B1D.dtype)
        self.aux_loss, self.metrics, self.last_selected_BS = None, {}, sel_B1
        return torch.where(sel_B1[..., None], y_B1D, x_B1D)

"""MoDBlock: Mixture-of-Depths routing around ANY block (dense -> MoD, MoE -> staged MoDE).

Shape legend: B batch, S sequence, K tokens processed per row, D d_model.

Selected tokens: `x + g(r) * delta` where delta is what the wrapped block adds to the residual
and r the raw router score (g = identity as in the paper, or sigmoid); the product is what puts
the router on the gradient path. Unselected tokens are returned bit-identical. The wrapped
block sees the gathered tokens with their ORIGINAL positions (rotary) and causal attention
among them. Routing modes:
  topk    - k = max(1, round(capacity * S)) per row (training, the paper's eval);
  causal  - each token decides alone from the predictor (or sigmoid(r) > 0.5): sampling-safe;
            rows then hold different counts, padded to the row maximum with a key mask.
"""
from __future__ import annotations

import torch
from torch import nn

from mode.config import ModConfig
from mode.model.blocks import Routed
from mode.model.layers import KVCache
from mode.routing.depth import DepthRouter, capacity_k, topk_sorted


def _gather(x_BS_, idx_BK):
    if x_BS_.dim() == 2:
        return x_BS_.gather(1, idx_BK)
    return x_BS_.gather(1, idx_BK[..., None].expand(-1, -1, x_BS_.shape[-1]))


class MoDBlock(nn.Module, Routed):
    def __init__(self, inner: nn.Module, cfg: ModConfig, d_model: int, layer_idx: int):
        super().__init__()
        self.inner, self.cfg = inner, cfg
        self.router = DepthRouter(d_model, cfg)
        self.gate = torch.sigmoid if cfg.gate == "sigmoid" else (lambda r: r)
        self.tag = f"mod/layer{layer_idx}"
        self.aux_loss, self.metrics = None, {}
        self.last_selected_BS: torch.Tensor | None = None  # for routing dumps / analysis

    def forward(self, x_BSD, pos_BS, valid_BS=None, cache: KVCache | None = None, routing: str = "topk"):
        B, S, D = x_BSD.shape
        r_BS = self.router.scores(x_BSD)
        if cache is not None or routing == "causal":
            sel_BS = self.router.causal_logits(x_BSD, r_BS) > 0
            if valid_BS is not None:
                sel_BS = sel_BS & valid_BS
        if cache is not None:  # one decoding step: every row runs, only selected rows write the cache
            cache.write_B = sel_BS[:, 0]
            delta_BSD = self.inner(x_BSD, pos_BS, None, cache)
            cache.write_B = None
            y_BSD = x_BSD + self.gate(r_BS)[..., None].to(x_BSD.dtype) * delta_BSD
            self.aux_loss, self.metrics, self.last_selected_BS = None, {}, sel_BS
            return torch.where(sel_BS[..., None], y_BSD, x_BSD)

        if routing == "topk":
            k = capacity_k(self.cfg.capacity, S)
            sel_scores_BS = r_BS if self.cfg.routing == "learned" else torch.rand_like(r_BS)
            idx_BK = topk_sorted(sel_scores_BS, k)
            valid_BK = None
            member_BS = torch.zeros_like(r_BS).scatter_(1, idx_BK, 1.0)
            self.aux_loss, self.metrics = self.router.losses(x_BSD, r_BS, member_BS)
            self.last_selected_BS = member_BS.bool()
        elif routing == "causal":
            count_B = sel_BS.sum(1)
            K = int(count_B.max())  # host sync: the ragged width is data-dependent
            self.aux_loss, self.last_selected_BS = None, sel_BS
            self.metrics = {"causal_processed_frac": sel_BS.float().mean()}
            if K == 0:
                return x_BSD
            # Selected positions first, in position order; the tail of each row is padding.
            order_BS = torch.argsort((~sel_BS).long() * S + torch.arange(S, device=x_BSD.device), dim=1)
            idx_BK = order_BS[:, :K]
            valid_BK = torch.arange(K, device=x_BSD.device)[None] < count_B[:, None]
        else:
            raise ValueError(f"routing must be 'topk' or 'causal', got {routing!r}")

        xg_BKD = _gather(x_BSD, idx_BK)
        delta_BKD = self.inner(xg_BKD, _gather(pos_BS, idx_BK), valid_BK, None)
        g_BK = self.gate(_gather(r_BS, idx_BK)).to(x_BSD.dtype)
        y_BKD = xg_BKD + g_BK[..., None] * delta_BKD
        if valid_BK is not None:
            y_BKD = torch.where(valid_BK[..., None], y_BKD, xg_BKD)  # padding writes x back unchanged
        return x_BSD.scatter(1, idx_BK[..., None].expand(-1, -1, D), y_BKD)

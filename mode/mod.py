"""MoDBlock: Mixture-of-Depths routing around ANY unit that keeps the block contract
(`mode/routed.py`): a whole block (dense -> MoD, MoE -> staged MoDE) or one sublayer (decoupled
attention / MLP routing).

Shape legend: B batch, S sequence, K tokens processed per row, D d_model, N = B * K.

Selected tokens get `g(r) * delta` where delta is the wrapped unit's update and r the raw router
score (g = identity as in the paper, or sigmoid); the product is what puts the router on the
gradient path. Unselected tokens get exactly zero (the caller's `x + 0` leaves them bit-identical).
The wrapped unit sees the gathered tokens with their ORIGINAL positions (rotary) and causal
attention among them; with `kv: all` its attention instead takes keys/values from EVERY token
(the selected tokens still compute the queries and take the update). Routing modes:
  topk    - k = max(1, round(capacity * S)) per row (training, the paper's eval);
  causal  - each token decides alone from the predictor (or sigmoid(r) > 0.5): sampling-safe;
            rows then hold different counts, padded to the row maximum with a key mask.
With a KV cache (one decoding step) routing is always causal; only rows whose token is
selected append to this layer's cache (every row with `kv: all`), so its per-row length counts
the tokens that give this layer keys and values.
"""
from __future__ import annotations

import torch
from torch import nn

from mode.config import ModConfig
from mode.plan import Route
from mode.routed import Cost, Ctx, both_engaged
from mode.routing.depth import DepthRouter, capacity_k, topk_sorted


def _identity(r: torch.Tensor) -> torch.Tensor:
    return r  # a named function, not a lambda: the module must pickle / deepcopy


def _flat(idx_BK: torch.Tensor, S: int) -> torch.Tensor:
    """Row-local indices -> indices into the [B * S] flattened sequence (one batched gather)."""
    return (idx_BK + S * torch.arange(idx_BK.shape[0], device=idx_BK.device)[:, None]).reshape(-1)


class MoDBlock(nn.Module):
    """Routed (mode/routed.py): tag `mod/layer{i}` around a block, `mod_attn/...`, `mod_mlp/...`
    around a sublayer."""

    def __init__(self, inner: nn.Module, cfg: ModConfig, d_model: int, layer_idx: int, route: Route | None = None):
        super().__init__()
        if route is None:  # a single wrapper built by hand: the config's (scalar) capacity
            assert not isinstance(cfg.capacity, list), "a per-layer capacity list needs the layer plan's Route"
            route = Route(cfg.capacity, f"mod/layer{layer_idx}", cfg.kv)
        self.inner, self.cfg, self.capacity, self.kv_all = inner, cfg, route.capacity, route.kv == "all"
        self.router = DepthRouter(d_model, cfg)
        self.gate = torch.sigmoid if cfg.gate == "sigmoid" else _identity
        self.tag = route.tag
        self.aux_loss, self.metrics = None, {}
        self.last_selected_BS: torch.Tensor | None = None  # the routing decision (routing dumps / analysis)
        self.last_engaged_BS: torch.Tensor | None = None  # selected AND fully computed by the inner unit

    def forward(self, x_BSD: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        B, S, D = x_BSD.shape
        r_BS = self.router.scores(x_BSD)
        if ctx.cache is not None:
            return self._decode_step(x_BSD, r_BS, ctx)
        if ctx.routing == "topk":
            # Learned: top-k of r. Stochastic (the paper's control): a random k; g(r) still
            # scales the update, so the router keeps its gradient either way.
            k = capacity_k(self.capacity, S)
            sel_scores_BS = r_BS if self.cfg.routing == "learned" else torch.rand_like(r_BS)
            idx_BK = topk_sorted(sel_scores_BS.detach(), k)
            valid_BK = None
            member_BS = torch.zeros_like(r_BS).scatter_(1, idx_BK, 1.0)
            self.aux_loss, self.metrics = self.router.losses(x_BSD, r_BS, member_BS)
            self.metrics["processed_frac"] = member_BS.mean()
            sel_BS = member_BS.bool()
        elif ctx.routing == "causal":
            sel_BS = self.router.causal_logits(x_BSD, r_BS) > 0
            if ctx.valid_BS is not None:
                sel_BS = sel_BS & ctx.valid_BS
            count_B = sel_BS.sum(1)
            K = int(count_B.max())  # host sync: the ragged width is data-dependent
            self.aux_loss = None
            self.metrics = {"causal_processed_frac": sel_BS.float().mean()}
            if K == 0:
                self.last_selected_BS = self.last_engaged_BS = sel_BS
                return torch.zeros_like(x_BSD)
            # Selected positions first, in position order (stable sort); the tail is padding.
            idx_BK = torch.sort((~sel_BS).to(torch.uint8), dim=1, stable=True).indices[:, :K]
            valid_BK = torch.arange(K, device=x_BSD.device)[None] < count_B[:, None]
        else:
            raise ValueError(f"routing must be 'topk' or 'causal', got {ctx.routing!r}")

        flat_N = _flat(idx_BK, S)
        x_ND = x_BSD.reshape(B * S, D)
        xg_BKD = x_ND.index_select(0, flat_N).view(B, -1, D)
        inner_ctx = Ctx(ctx.pos_BS.gather(1, idx_BK), valid_BK, None, ctx.routing)
        if self.kv_all:
            inner_ctx.kv_x_BSD, inner_ctx.kv_pos_BS = x_BSD, ctx.pos_BS
        delta_BKD = self.inner(xg_BKD, inner_ctx)
        upd_BKD = (self.gate(r_BS.gather(1, idx_BK))[..., None] * delta_BKD).to(x_BSD.dtype)
        if valid_BK is not None:
            upd_BKD = torch.where(valid_BK[..., None], upd_BKD, 0.0)  # padding slots add nothing
        # Zero everywhere but the selected rows; its backward hands each row its own gradient.
        out_BSD = x_ND.new_zeros(B * S, D).index_add(0, flat_N, upd_BKD.reshape(-1, D)).view(B, S, D)
        self.last_selected_BS = sel_BS
        inner_on_BK = self.inner.last_engaged_BS
        if inner_on_BK is None:
            self.last_engaged_BS = sel_BS
        else:  # scatter the inner unit's [B, K] verdict back to positions (padding: False)
            on_BK = inner_on_BK if valid_BK is None else inner_on_BK & valid_BK
            self.last_engaged_BS = torch.zeros_like(sel_BS).scatter(1, idx_BK, on_BK)
        return out_BSD

    def _decode_step(self, x_B1D, r_B1, ctx: Ctx):
        """One token per row: every row runs the unit (a static shape), only rows whose token is
        selected take the update and (unless K/V-from-all) append to the cache."""
        sel_B1 = self.router.causal_logits(x_B1D, r_B1) > 0
        ctx.cache.write_B = None if self.kv_all else sel_B1[:, 0]
        try:
            delta_B1D = self.inner(x_B1D, ctx)
        finally:
            ctx.cache.write_B = None
        upd_B1D = (self.gate(r_B1)[..., None] * delta_B1D).to(x_B1D.dtype)
        self.aux_loss, self.metrics = None, {}
        self.last_selected_BS = sel_B1
        self.last_engaged_BS = both_engaged(sel_B1, self.inner.last_engaged_BS)
        return torch.where(sel_B1[..., None], upd_B1D, 0.0)

    @staticmethod
    def cost(cfg: ModConfig, d_model: int, capacity: float, seq_len: int, inner: Cost) -> Cost:
        """Router (and predictor) on every token; the inner unit's cost (computed for the k tokens
        it sees) on the processed fraction k / S."""
        k = capacity_k(capacity, seq_len)
        return DepthRouter.cost(d_model, cfg) + Cost(inner.params, inner.flops * k / seq_len)

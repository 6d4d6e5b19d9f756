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
  causal  - each token decides alone from the predictor, the calibrated threshold (r > tau) or
            sigmoid(r) > 0.5: sampling-safe;
            rows then hold different counts, padded to the row maximum with a key mask.
Generation (a KV cache in the Ctx; routing is causal): the prefill gathers each row's selected
prompt tokens as above and the unit writes them to this layer's cache; a decoding step (one token
per row) gathers the rows whose token is selected and runs the unit on those rows only, so a
skipped token reads none of the unit's weights (at batch 1 a skipped layer costs its router and
predictor). The cache's per-row length counts the tokens that give this layer keys and values:
the selected ones, or every token with `kv: all` (whose K/V projection then runs for every row).
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
        if ctx.cache is not None and S == 1:
            return self._decode_step(x_BSD, r_BS, ctx)
        if ctx.routing == "topk":
            # Learned: top-k of r. Stochastic (the paper's control): a random k; g(r) still
            # scales the update, so the router keeps its gradient either way.
            k = capacity_k(self.capacity, S)
            sel_scores_BS = r_BS if self.cfg.routing == "learned" else torch.rand_like(r_BS)
            idx_BK = topk_sorted(sel_scores_BS.detach(), k)
            valid_BK = None
            member_BS = torch.zeros_like(r_BS).scatter_(1, idx_BK, 1.0)
            # metrics first: the threshold is scored on a batch it has not yet seen (as the predictor)
            self.aux_loss, self.metrics = self.router.losses(x_BSD, r_BS, member_BS)
            if self.training and self.router.has_threshold:
                self.router.update_threshold(r_BS, k)
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
            # Nothing selected: the inner unit still runs, on one padding slot per row. Each rank
            # selects on its own, and an expert-parallel MoE inside holds collectives that every
            # rank must join (a rank that skipped it hung the others); a K/V-from-all prefill
            # still writes K/V.
            K = max(K, 1)
            # Selected positions first, in position order (stable sort); the tail is padding.
            idx_BK = torch.sort((~sel_BS).to(torch.uint8), dim=1, stable=True).indices[:, :K]
            valid_BK = torch.arange(K, device=x_BSD.device)[None] < count_B[:, None]
        else:
            raise ValueError(f"routing must be 'topk' or 'causal', got {ctx.routing!r}")

        flat_N = _flat(idx_BK, S)
        x_ND = x_BSD.reshape(B * S, D)
        xg_BKD = x_ND.index_select(0, flat_N).view(B, -1, D)
        inner_ctx = Ctx(ctx.pos_BS.gather(1, idx_BK), valid_BK, ctx.cache, ctx.routing)
        if self.kv_all:
            inner_ctx.kv_x_BSD, inner_ctx.kv_pos_BS, inner_ctx.kv_valid_BS = x_BSD, ctx.pos_BS, ctx.valid_BS
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
        """One token per row: run the unit on the rows whose token is selected (gather, run,
        scatter back). With `kv: all` every row's token still gives the unit's attention K/V."""
        B = x_B1D.shape[0]
        sel_B = (self.router.causal_logits(x_B1D, r_B1) > 0)[:, 0]
        if ctx.valid_BS is not None:
            sel_B = sel_B & ctx.valid_BS[:, 0]
        self.aux_loss, self.metrics = None, {}
        self.last_selected_BS = sel_B[:, None]
        rows_N = sel_B.nonzero()[:, 0]  # host sync: the work depends on how many rows it selected
        N = rows_N.numel()
        if N == 0 and not self.kv_all:
            self.last_engaged_BS = self.last_selected_BS
            return torch.zeros_like(x_B1D)
        every = N == B
        inner_ctx = ctx.with_(pos_BS=ctx.pos_BS if every else ctx.pos_BS.index_select(0, rows_N), valid_BS=None)
        if self.kv_all:  # every valid row's token gives K/V (a padding row's is written, not counted)
            inner_ctx.kv_x_BSD, inner_ctx.kv_pos_BS, inner_ctx.kv_valid_BS = x_B1D, ctx.pos_BS, ctx.valid_BS
        ctx.cache.rows_N = None if every else rows_N
        try:
            delta_N1D = self.inner(x_B1D if every else x_B1D.index_select(0, rows_N), inner_ctx)
        finally:
            ctx.cache.rows_N = None
        r_N1 = r_B1 if every else r_B1.index_select(0, rows_N)
        upd_N1D = (self.gate(r_N1)[..., None] * delta_N1D).to(x_B1D.dtype)
        on_N1 = self.inner.last_engaged_BS
        if every:
            self.last_engaged_BS = both_engaged(self.last_selected_BS, on_N1)
            return upd_N1D
        on_N = torch.ones(N, dtype=torch.bool, device=x_B1D.device) if on_N1 is None else on_N1[:, 0]
        self.last_engaged_BS = torch.zeros_like(sel_B).index_copy(0, rows_N, on_N)[:, None]
        return torch.zeros_like(x_B1D).index_copy(0, rows_N, upd_N1D)

    @staticmethod
    def cost(cfg: ModConfig, d_model: int, capacity: float, seq_len: int, inner: Cost) -> Cost:
        """Router (and predictor) on every token; the inner unit's cost (computed for the k tokens
        it sees) on the processed fraction k / S."""
        k = capacity_k(capacity, seq_len)
        return DepthRouter.cost(d_model, cfg) + Cost(inner.params, inner.flops * k / seq_len)

"""Native MoE MLP: pure PyTorch, sort/gather dispatch; the reference for the other backends.

Shape legend: B batch, S sequence, T = B*S tokens, D d_model, F expert hidden, H = 2F (SwiGLU's
fused [gate | up] projection) or F (GELU), E real experts, C slots per expert, K top_k,
M rows of the grouped expert buffer (+1 zero scratch row that dropped routes read).

Three steps execute the router's decisions:
  dispatch  every kept route names a row of the grouped buffer (`slot` = its expert's offset +
            its rank within the expert); one gather of token rows fills the buffer (no one-hot);
  compute   per-expert GEMMs over contiguous row groups, with stacked weights
            w_in [E, D, H] and w_out [E, F, D] (a grouped GEMM written as a loop);
  combine   each token gathers its routes' rows and sums them weighted by the router, in fp32.

Group sizes: when dropping on an accelerator, every expert gets C rows (static: C comes from the
number of token rows, so there is no host sync; empty slots compute rows nobody reads). On CPU,
and always when dropless, the groups are exactly the kept routes per expert: that needs the
counts on the host (a host sync: free on CPU, unavoidable for dropless).

Expert by expert (GEMM -> activation -> GEMM on one group) the working set stays in cache: on
CPU this measured faster than one batched matmul over the padded [E, C, D] buffer.
"""
from __future__ import annotations

import torch
from torch import nn

from mode.config import ModelConfig
from mode.mlp import activation
from mode.moe.base import MoEBase
from mode.routing.experts import ExpertRouter, Routing


def grouped_mlp(x_MD: torch.Tensor, w_in_EDH: torch.Tensor, w_out_EFD: torch.Tensor, sizes: list[int],
                kind: str) -> torch.Tensor:
    """out[rows of group e] = act(x[rows] @ w_in[e]) @ w_out[e], plus one zero row at the end.
    `unbind` (not `w[e]`) so the backward stacks the expert gradients once instead of building a
    full-size zero gradient per expert."""
    w_in, w_out = w_in_EDH.unbind(0), w_out_EFD.unbind(0)
    outs = [activation(x @ w_in[e], kind) @ w_out[e] for e, x in enumerate(x_MD.split(sizes)) if sizes[e]]
    return torch.cat(outs + [x_MD.new_zeros(1, x_MD.shape[1])])


def combine(out_MD: torch.Tensor, slot_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
    """y_t = sum_j w_tj * out[slot_tj], accumulated in fp32 (w is fp32); unkept routes point at
    the zero row and have weight 0."""
    T, K = slot_TK.shape
    routed_TKD = out_MD.index_select(0, slot_TK.reshape(-1)).view(T, K, out_MD.shape[1])  # T may be 0
    if K == 1:
        return (routed_TKD[:, 0] * w_TK).to(out_MD.dtype)
    return (routed_TKD * w_TK[..., None]).sum(1).to(out_MD.dtype)


class NativeMoE(MoEBase):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        moe = cfg.moe
        d_ff = moe.d_expert or cfg.d_ff
        self.router = ExpertRouter(cfg.d_model, moe)
        self.w_in = nn.Parameter(torch.empty(self.E, cfg.d_model, (2 if cfg.mlp == "swiglu" else 1) * d_ff))
        self.w_out = nn.Parameter(torch.empty(self.E, d_ff, cfg.d_model))
        for w, part in ((self.w_in, "w_in"), (self.w_out, "w_out")):  # the LM re-initialises (w_out scaled by
            nn.init.normal_(w, std=cfg.init_std)  # depth), keyed as the DeepSpeed layer's experts are
            w.init_keys = [f"layer{layer_idx}.expert{g}.{part}.weight" for g in range(self.E)]
        self.router.weight.init_key = f"layer{layer_idx}.router.weight"
        # Padded groups of C rows per expert when dropping (static shapes, no host sync) or exact
        # groups of the kept routes; None = padded on accelerators, exact on CPU.
        self.padded_groups: bool | None = None

    def compute(self, x_TD: torch.Tensor, r: Routing) -> torch.Tensor:
        """Dispatch, compute, combine for the routing decisions `r`."""
        E, dev = self.E, x_TD.device
        padded = self.padded_groups if self.padded_groups is not None else dev.type != "cpu"
        if r.capacity is not None and padded:
            sizes = [r.capacity] * E  # static padded groups: no host sync
            return self._dispatch(x_TD, r, sizes, torch.arange(E, device=dev) * r.capacity)
        return self._exact(x_TD, r)

    @torch.compiler.disable
    def _exact(self, x_TD: torch.Tensor, r: Routing) -> torch.Tensor:
        """Exact groups: a host sync for the group sizes (free on CPU; dropless needs it). Eager under
        torch.compile: traced, every new set of sizes would recompile the block (the recompile limit
        is reached within a few steps)."""
        return self._dispatch(x_TD, r, r.kept_E.tolist(), r.kept_E.cumsum(0) - r.kept_E)

    def _dispatch(self, x_TD: torch.Tensor, r: Routing, sizes: list[int], start_E: torch.Tensor) -> torch.Tensor:
        T, E, dev = x_TD.shape[0], self.E, x_TD.device
        M = sum(sizes)
        slot_TK = torch.where(r.keep_TK, start_E[r.idx_TK.clamp(max=E - 1)] + r.pos_TK, M)
        # Invert route -> slot into slot -> token (row M: scratch for unkept routes); empty
        # padded slots read token 0, and nobody reads their output.
        src_M = torch.zeros(M + 1, dtype=torch.long, device=dev)
        src_M.scatter_(0, slot_TK.reshape(-1), torch.arange(T, device=dev).repeat_interleave(self.K))
        x_MD = x_TD.index_select(0, src_M[:M])
        out_MD = grouped_mlp(x_MD, self.w_in, self.w_out, sizes, self.kind)
        return combine(out_MD, slot_TK, r.w_TK)

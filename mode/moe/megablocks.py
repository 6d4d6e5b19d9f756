"""MegaBlocks backend (CUDA only): mode's router + MegaBlocks' dropless expert computation.

Shape legend: B batch, S sequence, T = B*S tokens, D d_model, F expert hidden, E experts,
K top_k, M kept routes.

MegaBlocks 0.10 ships a router and two expert layers: `dMoE` (dropless: grouped / block-sparse
GEMMs over exactly the routed tokens) and `MoE` (dropping: capacity int(cf * k * T / E), floor
not ceil, overflow dropped in token-major route order, weights of dropped routes lost). Its
dropping rule is not ours, so routing (capacity, drop policy, no-op experts, weights, losses) is
done by mode's router, and every KEPT route is run through dMoE's expert stage
(`ParallelDroplessMLP`) as a top-1 pseudo-token: dropless runs all real routes, dropping runs
only the survivors, so capacity cuts compute exactly as configured. MegaBlocks' own
load-balancing loss is switched off (moe_loss_weight=0: nothing lands in its module-global list);
ours is returned through `aux_loss`. `mlp_impl='grouped'` (grouped_gemm): the default block-sparse
path breaks with triton >= 3.2. grouped_gemm is bf16-only, so the expert weights are bf16 and
the expert stage runs in bf16 whatever the rest of the model uses (train with
deepspeed.precision=bf16, whose fp32 master weights then cover the experts too).
"""
from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from mode.config import ConfigError, ModelConfig
from mode.moe.base import MoEBase
from mode.moe.native import NativeMoE, combine
from mode.routing.experts import ExpertRouter

INSTALL = ("on a GPU node run pip install -e '.[megablocks]' (MegaBlocks 0.10 pins torch 2.7.0 and builds "
           "CUDA extensions; grouped_gemm is needed), or use model.moe.backend=native")


def require_megablocks() -> None:
    """Raise a one-line ConfigError unless CUDA and megablocks are usable."""
    if not torch.cuda.is_available():
        raise ConfigError("model.moe.backend", "megablocks", f"needs CUDA and this machine has none; {INSTALL}")
    try:
        import megablocks.layers.dmoe  # noqa: F401
        import grouped_gemm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError or a broken CUDA extension
        why = " ".join(f"{type(e).__name__}: {e}".split())
        raise ConfigError("model.moe.backend", "megablocks", f"megablocks is not importable ({why}); {INSTALL}")


class MegaBlocksMoE(MoEBase):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        require_megablocks()
        from megablocks.layers.arguments import Arguments
        from megablocks.layers.dmoe import ParallelDroplessMLP

        m = cfg.moe
        self.router = ExpertRouter(cfg.d_model, m)
        init = partial(nn.init.normal_, mean=0.0, std=cfg.init_std)
        args = Arguments(
            hidden_size=cfg.d_model, ffn_hidden_size=m.d_expert or cfg.d_ff, num_layers=cfg.n_layers,
            bias=False, return_bias=False,
            activation_fn=F.silu if cfg.mlp == "swiglu" else F.gelu,  # exact GELU, as layers.MLP
            mlp_type="glu" if cfg.mlp == "swiglu" else "mlp", mlp_impl="grouped",
            moe_num_experts=m.num_experts, moe_top_k=1,  # each kept route is one pseudo-token
            moe_loss_weight=0.0,  # our router owns the load-balancing loss
            fp16=False, bf16=True, device=torch.cuda.current_device(),  # grouped_gemm is bf16-only
            init_method=init,  # both overwritten by LM's init_weights (by parameter name), as every backend
            output_layer_init_method=partial(nn.init.normal_, mean=0.0,
                                             std=cfg.init_std / math.sqrt(2 * cfg.n_layers)))
        self.experts = ParallelDroplessMLP(args)

    def compute(self, x_TD: torch.Tensor, r) -> torch.Tensor:
        D = x_TD.shape[1]
        keep_R = r.keep_TK.reshape(-1)  # token-major here (t*K + j), not the router's choice-major route order
        # Host sync: the number of kept routes sizes the buffers (MegaBlocks syncs on group sizes anyway).
        route_M = keep_R.nonzero().squeeze(1)
        M = route_M.numel()
        x_MD = x_TD.index_select(0, route_M // self.K).to(torch.bfloat16)
        if M:
            e_M1 = r.idx_TK.reshape(-1)[route_M][:, None]
            ones_M1 = torch.ones(M, 1, dtype=x_MD.dtype, device=x_MD.device)  # we weight in fp32 below
            out_MD = self.experts(x_MD[None], None, ones_M1, e_M1).view(M, D).to(x_TD.dtype)
        else:
            out_MD = x_MD.to(x_TD.dtype)
        out_MD = torch.cat([out_MD, out_MD.new_zeros(1, D)])
        slot_TK = torch.where(r.keep_TK, (keep_R.cumsum(0) - 1).view_as(r.keep_TK), M)
        return combine(out_MD, slot_TK, r.w_TK)


@torch.no_grad()
def copy_native_to_megablocks(src: NativeMoE, dst: MegaBlocksMoE) -> None:
    """MegaBlocks keeps experts as w1 (and v1 for GLU) [E*F, D] = W^T per expert, w2 [E*F, D]."""
    mlp = dst.experts.mlp
    dst.router.weight.copy_(src.router.weight)
    F_ = src.w_out.shape[1]
    w_in_EHD = src.w_in.transpose(1, 2)  # [E, H, D]
    if hasattr(mlp, "v1"):
        mlp.w1.copy_(w_in_EHD[:, :F_].reshape(-1, w_in_EHD.shape[2]))
        mlp.v1.copy_(w_in_EHD[:, F_:].reshape(-1, w_in_EHD.shape[2]))
    else:
        mlp.w1.copy_(w_in_EHD.reshape(-1, w_in_EHD.shape[2]))
    mlp.w2.copy_(src.w_out.reshape(-1, src.w_out.shape[2]))

"""Blocks and their sublayers, all keeping the block contract of `mode/routed.py`:
`delta_BSD = unit(x_BSD, ctx)` is the update the unit adds to the residual stream, and
`unit.last_engaged_BS` says which tokens got its full computation (None: all of them).

A Block is an attention sublayer then an MLP sublayer (each: pre-norm, then the op). Returning the
update (not `x + delta`) lets a routing wrapper apply `x + g(r) * delta` to the tokens it selected
and leave the others bit-identical, and lets it wrap the whole block or one sublayer alike:
`MoDBlock(Block)` is MoD (staged MoDE with an MoE MLP), `Block(MoDBlock(AttnSublayer),
MoDBlock(MLPSublayer))` is decoupled routing. Composition, not flags.
"""
from __future__ import annotations

import torch
from torch import nn

from mode.config import ModelConfig
from mode.model.layers import MLP, Attention, RMSNorm
from mode.routed import Cost, Ctx, both_engaged


class AttnSublayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg.d_model, cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        self.last_engaged_BS = None

    def forward(self, x_BSD: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        kv_x = None if ctx.kv_x_BSD is None else self.norm(ctx.kv_x_BSD)
        return self.attn(self.norm(x_BSD), ctx.pos_BS, ctx.valid_BS, ctx.cache, kv_x, ctx.kv_pos_BS, ctx.kv_valid_BS)

    @staticmethod
    def cost(cfg: ModelConfig, s: int, s_kv: int | None = None) -> Cost:
        return RMSNorm.cost(cfg.d_model) + Attention.cost(cfg.d_model, s, s_kv)


class MLPSublayer(nn.Module):
    """Pre-norm + an MLP: a dense `MLP` or an MoE backend (`mode/moe`), called as mlp(h, valid, routing)
    (an MoE is dropless at sampling time, routing `causal`, unless `moe.inference_capacity_factor` caps it)."""

    def __init__(self, cfg: ModelConfig, mlp: nn.Module):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = mlp
        self.last_engaged_BS = None

    def forward(self, x_BSD: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        y_BSD = self.mlp(self.norm(x_BSD), ctx.valid_BS, ctx.routing)
        self.last_engaged_BS = getattr(self.mlp, "last_engaged_BS", None)  # MoE: tokens with a kept route
        return y_BSD

    @staticmethod
    def cost(cfg: ModelConfig, mlp: Cost) -> Cost:
        return RMSNorm.cost(cfg.d_model) + mlp


class Block(nn.Module):
    def __init__(self, attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.attn, self.mlp = attn, mlp
        self.last_engaged_BS = None

    def forward(self, x_BSD: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        a_BSD = self.attn(x_BSD, ctx)
        m_BSD = self.mlp(x_BSD + a_BSD, ctx.with_(kv_x_BSD=None, kv_pos_BS=None, kv_valid_BS=None))
        self.last_engaged_BS = both_engaged(self.attn.last_engaged_BS, self.mlp.last_engaged_BS)
        return a_BSD + m_BSD


def dense_mlp(cfg: ModelConfig) -> MLPSublayer:
    return MLPSublayer(cfg, MLP(cfg.d_model, cfg.d_ff, cfg.mlp))


def moe_mlp(cfg: ModelConfig, layer_idx: int) -> MLPSublayer:
    from mode.moe import build_moe_mlp  # backends import their packages lazily

    return MLPSublayer(cfg, build_moe_mlp(cfg, layer_idx))


def DenseBlock(cfg: ModelConfig) -> Block:
    return Block(AttnSublayer(cfg), dense_mlp(cfg))


def MoEBlock(cfg: ModelConfig, layer_idx: int) -> Block:
    return Block(AttnSublayer(cfg), moe_mlp(cfg, layer_idx))

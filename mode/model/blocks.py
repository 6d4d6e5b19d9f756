"""Blocks: pre-norm attention + MLP, returning the update they add to the residual stream.

A block returns `delta_BSD` (not `x + delta`) so that a routing wrapper can apply
`x + g(r) * delta` to the tokens it selected and leave the others bit-identical.
DenseBlock and MoEBlock are the same Block with a different MLP: composition, not flags.
"""
from __future__ import annotations

import torch
from torch import nn

from mode.config import ModelConfig
from mode.model.layers import MLP, Attention, KVCache, RMSNorm


class Routed:
    """Marks a module that routes tokens. After each forward it holds `aux_loss` (a weighted
    scalar to add to the LM loss, or None) and `metrics` (name -> on-device scalar), and is
    reported under `tag` (e.g. `mod/layer1`, `moe/layer3`)."""

    tag: str = ""
    aux_loss: torch.Tensor | None = None
    metrics: dict = {}


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, mlp: nn.Module):
        super().__init__()
        self.norm_attn = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg.d_model, cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        self.norm_mlp = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = mlp

    def forward(self, x_BSD, pos_BS, valid_BS=None, cache: KVCache | None = None, routing: str = "topk"):
        a_BSD = self.attn(self.norm_attn(x_BSD), pos_BS, valid_BS, cache)
        m_BSD = self.mlp(self.norm_mlp(x_BSD + a_BSD), valid_BS)
        return a_BSD + m_BSD


def DenseBlock(cfg: ModelConfig) -> Block:
    return Block(cfg, MLP(cfg.d_model, cfg.d_ff, cfg.mlp))


def MoEBlock(cfg: ModelConfig, layer_idx: int) -> Block:
    from mode.moe import build_moe_mlp  # backends import their packages lazily

    return Block(cfg, build_moe_mlp(cfg, layer_idx))

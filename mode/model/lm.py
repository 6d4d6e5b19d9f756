"""The decoder-only language model: embedding, a schedule of (possibly routed) blocks, head.

Shape legend: B batch, S sequence, D d_model, V vocab, L layers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mode.config import ModelConfig, resolve_layers
from mode.model.blocks import Block, DenseBlock, MoEBlock, Routed
from mode.model.layers import KVCache, RMSNorm, init_weights


@dataclass
class LMOutput:
    logits: torch.Tensor
    """[B, S, V]"""
    aux_loss: torch.Tensor
    """Sum of the routers' weighted auxiliary losses (0 for dense)."""
    metrics: dict = field(default_factory=dict)
    """Tag -> on-device scalar, e.g. `mod/layer1/predictor_acc`."""
    loss: torch.Tensor | None = None
    """Mean next-token cross-entropy when targets were given (aux_loss not included)."""


def build_block(cfg: ModelConfig, i: int) -> nn.Module:
    from mode.mod import MoDBlock

    block = MoEBlock(cfg, i) if i in resolve_layers(cfg.moe.layers, cfg.n_layers) else DenseBlock(cfg)
    if i in resolve_layers(cfg.mod.layers, cfg.n_layers):
        block = MoDBlock(block, cfg.mod, cfg.d_model, i)
    return block


class LM(nn.Module):
    activation_checkpointing = False  # set by the trainer from train.activation_checkpointing

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(build_block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        init_weights(self, cfg.init_std, cfg.n_layers)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        self.routed = [m for m in self.modules() if isinstance(m, Routed)]

    def forward(self, input_ids_BS, targets_BS=None, routing: str = "topk", pos_BS=None,
                caches: list[KVCache] | None = None) -> LMOutput:
        B, S = input_ids_BS.shape
        if pos_BS is None:
            pos_BS = torch.arange(S, device=input_ids_BS.device).expand(B, S)
        x_BSD = self.embed(input_ids_BS)
        for i, block in enumerate(self.blocks):
            cache = caches[i] if caches is not None else None
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                # Keep only the block's input; backward re-runs the block (same RNG state, so same routing).
                out_BSD = checkpoint(block, x_BSD, pos_BS, None, cache, routing, use_reentrant=False)
            else:
                out_BSD = block(x_BSD, pos_BS, None, cache, routing)
            # A plain Block returns its residual update; a routing wrapper returns the new stream.
            x_BSD = x_BSD + out_BSD if isinstance(block, Block) else out_BSD
        logits_BSV = self.head(self.norm(x_BSD))
        aux = logits_BSV.new_zeros((), dtype=torch.float32)
        metrics = {}
        for m in self.routed:
            if m.aux_loss is not None:
                aux = aux + m.aux_loss
                m.aux_loss = None  # hand the graph over: modules keep no autograd state between calls
            metrics.update({f"{m.tag}/{k}": v for k, v in m.metrics.items()})
        loss = None
        if targets_BS is not None:
            loss = F.cross_entropy(logits_BSV.float().flatten(0, 1), targets_BS.flatten())
        return LMOutput(logits_BSV, aux, metrics, loss)

    def new_caches(self, batch: int, max_len: int) -> list[KVCache]:
        p = next(self.parameters())
        c = self.cfg
        return [KVCache(batch, c.n_heads, max_len, c.d_model // c.n_heads, p.dtype, p.device)
                for _ in range(c.n_layers)]

    def engaged_blocks(self) -> torch.Tensor | None:
        """[L, B, S] 1 where the last forward gave the token the block's full computation, for
        routing analysis: skipping by depth routing, a no-op expert, or a dropped expert route
        all count as not engaged."""
        rows = []
        for block in self.blocks:
            sel = getattr(block, "last_selected_BS", None)
            mlp = block.inner.mlp if hasattr(block, "inner") else block.mlp
            mlp_on = getattr(mlp, "last_engaged_BS", None)
            rows.append((sel, mlp_on))
        shape = next((s.shape for pair in rows for s in pair if s is not None), None)
        if shape is None:
            return None
        out = []
        for sel, mlp_on in rows:
            e = torch.ones(shape, dtype=torch.bool, device=self.embed.weight.device) if sel is None else sel.bool()
            if mlp_on is not None and mlp_on.shape == shape:
                e = e & mlp_on.bool()
            out.append(e)
        return torch.stack(out)


def build_model(cfg: ModelConfig) -> LM:
    return LM(cfg)

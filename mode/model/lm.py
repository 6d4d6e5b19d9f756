"""The decoder-only language model: embedding, a schedule of (possibly routed) blocks, head.

Shape legend: B batch, S sequence, D d_model, V vocab, L layers.
"""
from __future__ import annotations

import re
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mode.config import ModelConfig
from mode.mod import MoDBlock
from mode.model.blocks import AttnSublayer, Block, dense_mlp, moe_mlp
from mode.model.layers import KVCache, RMSNorm, init_weights
from mode.plan import LayerPlan, layer_plan
from mode.routed import Ctx, Routed
from mode.routing.depth import recomputing


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


_OLD_BLOCK_KEY = re.compile(r"^(blocks\.\d+\.(?:inner\.)?)(norm_attn|attn|norm_mlp|mlp)\.")
_NEW_SUBLAYER = {"norm_attn": "attn.norm.", "attn": "attn.attn.", "norm_mlp": "mlp.norm.", "mlp": "mlp.mlp."}


def _upgrade_old_block_keys(state_dict, prefix, *args) -> None:
    """Checkpoints written before attention and MLP became sublayers name block weights
    `blocks.N.norm_attn.weight`, `blocks.N.attn.qkv.weight`, `blocks.N.mlp.w_in.weight`: rename
    them in place so old runs still resume and sample."""
    if not any(k.startswith(prefix) and ".norm_attn." in k for k in state_dict):
        return
    for k in list(state_dict):
        m = _OLD_BLOCK_KEY.match(k[len(prefix):]) if k.startswith(prefix) else None
        if m:
            new = prefix + m.group(1) + _NEW_SUBLAYER[m.group(2)] + k[len(prefix) + m.end():]
            state_dict[new] = state_dict.pop(k)


# What a forward records on a module that holds its graph: the Routed protocol's aux_loss, the MoE
# backends' last_routing (RouterGate.last), DeepSpeed's MOELayer.l_aux.
_GRAPH_RECORDS = ("aux_loss", "last_routing", "last", "l_aux")


def _checkpoint_contexts(block: nn.Module):
    """checkpoint's context_fn, called at forward time: nothing around the forward; around the
    re-run in backward, `_rerun` under the torch function modes the forward ran under
    (mode.engine.Fp32Gemms: bf16 GEMMs in fp32 on CPU), which are no longer active in backward:
    without them the recomputed tensors differ in dtype and torch refuses them."""
    from torch.overrides import _get_current_function_mode_stack

    return nullcontext(), _rerun(block, _get_current_function_mode_stack())


@contextmanager
def _rerun(block: nn.Module, modes: list):
    """Activation checkpointing's re-run of `block` in backward only rebuilds the tensors backward
    needs. It is not a new micro-step (the threshold EMA stays), and the records it leaves on the
    modules (holding the re-run's graph, and with it the block's recomputed activations, until the
    next forward) are put back as the forward left them."""
    saved = [(m, {a: vars(m)[a] for a in _GRAPH_RECORDS if a in vars(m)}) for m in block.modules()]
    try:
        with ExitStack() as stack, recomputing():
            for m in modes:
                stack.enter_context(m)
            yield
    finally:  # also when checkpointing stops the re-run early (it raises once it has what it needs)
        for m, records in saved:
            vars(m).update(records)


def build_block(cfg: ModelConfig, lp: LayerPlan) -> nn.Module:
    """The module a layer plan names: sublayers, the block, then the routing wrappers around them.
    `mode/flops.py` walks the same plan to count it."""
    def routed(unit: nn.Module, route):
        return unit if route is None else MoDBlock(unit, cfg.mod, cfg.d_model, lp.index, route)

    mlp = moe_mlp(cfg, lp.index) if lp.mlp == "moe" else dense_mlp(cfg)
    block = Block(routed(AttnSublayer(cfg), lp.attn), routed(mlp, lp.mlp_route))
    return routed(block, lp.block)


class LM(nn.Module):
    activation_checkpointing = False  # set by the trainer from train.activation_checkpointing

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.plan = layer_plan(cfg)
        self.blocks = nn.ModuleList(build_block(cfg, lp) for lp in self.plan)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        init_weights(self, cfg.init_std, cfg.n_layers)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        self.routed = [m for m in self.modules() if isinstance(m, Routed)]
        self._register_load_state_dict_pre_hook(_upgrade_old_block_keys)

    def forward(self, input_ids_BS, targets_BS=None, routing: str = "topk", pos_BS=None,
                caches: list[KVCache] | None = None, valid_BS=None) -> LMOutput:
        """`routing` topk (training) or causal (sampling-time semantics, README "Sampling"). With
        `caches` (generation, routing causal): several tokens per row are a prefill into empty
        caches (right-padded prompts: `valid_BS` False marks the padding), one token per row a
        decoding step at positions `pos_BS`."""
        B, S = input_ids_BS.shape
        if pos_BS is None:
            pos_BS = torch.arange(S, device=input_ids_BS.device).expand(B, S)
        x_BSD = self.embed(input_ids_BS)
        for i, block in enumerate(self.blocks):
            ctx = Ctx(pos_BS, valid_BS, caches[i] if caches is not None else None, routing)
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                # Keep only the block's input; backward re-runs the block (same RNG state, so same routing).
                delta_BSD = checkpoint(block, x_BSD, ctx, use_reentrant=False,
                                       context_fn=lambda b=block: _checkpoint_contexts(b))
            else:
                delta_BSD = block(x_BSD, ctx)
            x_BSD = x_BSD + delta_BSD  # every block returns its residual update
        logits_BSV = self.head(self.norm(x_BSD))
        aux = logits_BSV.new_zeros((), dtype=torch.float32)
        metrics = {}
        for m in self.routed:
            if m.aux_loss is not None:
                aux = aux + m.aux_loss
                m.aux_loss = None  # hand the graph over: modules keep no autograd state between calls
            metrics.update({f"{m.tag}/{k}": v for k, v in m.metrics.items()})
            m.metrics = {}  # a unit its MoD wrapper skips next time must not report this call's again
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
        routing analysis: skipping by depth routing (block or either sublayer), a no-op expert, or
        a dropped expert route all count as not engaged. None when every block engaged every token."""
        masks = [b.last_engaged_BS for b in self.blocks]
        shape = next((m.shape for m in masks if m is not None), None)
        if shape is None:
            return None
        ones = torch.ones(shape, dtype=torch.bool, device=self.embed.weight.device)
        return torch.stack([ones if m is None else m.bool() for m in masks])


def build_model(cfg: ModelConfig) -> LM:
    return LM(cfg)

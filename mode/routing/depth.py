"""Depth routing (Mixture-of-Depths, Raposo et al. 2024): expert-choice top-k over the sequence.

Shape legend: B batch, S sequence, K selected tokens per row, D d_model.

The router is a scalar `r = w^T x` per token, computed in fp32. Top-k over the sequence is
non-causal, so causal stand-ins decide at sampling time: the router logits themselves trained
against top-k membership (aux BCE, `sigmoid(r) > 0.5` decides), a small MLP predictor that sees
the router's input through a stop-gradient (its loss reaches no LM parameter, and its own optimizer,
mode.engine.PredictorAdamW, keeps its gradients out of the LM's clipping norm), or a calibrated
threshold (`r > tau`, tau an EMA of the k-th largest score seen in training; nothing trained).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from mode.config import ModConfig
from mode.plan import capacity_k  # noqa: F401 - routing's k, re-exported beside topk_sorted
from mode.routed import Cost


_recomputing = False


@contextmanager
def recomputing():
    """Activation checkpointing re-runs a block's forward during backward (mode/model/lm.py runs
    the re-run under this): that is not a new micro-step, so the threshold EMA must not step again."""
    global _recomputing
    prev, _recomputing = _recomputing, True
    try:
        yield
    finally:
        _recomputing = prev


def topk_sorted(scores_BS: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores per row, sorted by position (keeps causal order). Ties at the
    k-th score go to the earliest positions: torch.topk breaks them as its kernel happens to (CPU:
    [1,0,1,0,1,0,1,1], k=2 gave {0, 6}), and equal scores are common where a layer routes raw
    embeddings (repeated tokens), so the same model selected different tokens on CPU and GPU."""
    kth_B1 = scores_BS.topk(k, dim=1).values[:, -1:]
    above_BS, tied_BS = scores_BS > kth_B1, scores_BS == kth_B1
    take_BS = above_BS | (tied_BS & (tied_BS.cumsum(1) <= k - above_BS.sum(1, keepdim=True)))
    # the k taken positions, in position order: a stable sort puts them first (no host sync, fixed shapes)
    return take_BS.sort(dim=1, descending=True, stable=True).indices[:, :k]


class DepthRouter(nn.Module):
    def __init__(self, d_model: int, cfg: ModConfig):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(d_model, 1)
        self.predictor = None
        if cfg.causal in ("predictor", "both"):
            h = cfg.predictor_hidden or d_model // 2
            self.predictor = nn.Sequential(nn.Linear(d_model, h), nn.SiLU(), nn.Linear(h, 1))
        self.has_threshold = cfg.causal == "threshold"
        if self.has_threshold:  # buffers: checkpointed with the model, so a resume continues the EMA exactly
            self.register_buffer("threshold", torch.zeros((), dtype=torch.float32))
            self.register_buffer("threshold_updates", torch.zeros((), dtype=torch.long))

    def scores(self, x_BSD: torch.Tensor) -> torch.Tensor:
        # fp32 even under bf16: near-ties in r decide top-k membership and r scales the update.
        w = self.router
        return F.linear(x_BSD.float(), w.weight.float(), w.bias.float()).squeeze(-1)

    @torch.no_grad()
    def update_threshold(self, r_BS: torch.Tensor, k: int) -> None:
        """One EMA step towards the mean over rows of the k-th largest score; the first step takes
        the value itself. No host sync. Data-parallel ranks step their own copies; the trainer
        averages them once per optimizer step (mode/engine.py `average_thresholds`)."""
        if _recomputing:  # the checkpointed forward already stepped it
            return
        kth = r_BS.detach().topk(k, dim=1).values[:, -1].mean()
        m = self.cfg.threshold_momentum
        self.threshold.copy_(torch.where(self.threshold_updates == 0, kth, m * self.threshold + (1 - m) * kth))
        self.threshold_updates.add_(1)

    def causal_logits(self, x_BSD: torch.Tensor, r_BS: torch.Tensor) -> torch.Tensor:
        """Per-token logit of 'selected' that depends on this token alone (> 0 means process it)."""
        if self.has_threshold:
            return r_BS - self.threshold
        if self.predictor is None:
            return r_BS  # sigmoid(r) > 0.5  <=>  r > 0
        # Stop-gradient: the predictor learns from the residual stream but never shapes it. Its
        # weights stay fp32 in training also under bf16 (mode.engine.PredictorAdamW's masters); its
        # GEMMs run in the stream's dtype, as the model's do: in fp32 under bf16 this d x d/2 MLP on
        # every token (~1/6 of the inner unit's FLOPs at capacity 0.125) ran at fp32 GEMM speed.
        x = x_BSD.detach()
        up, act, down = self.predictor
        h = act(F.linear(x, up.weight.to(x.dtype), up.bias.to(x.dtype)))
        return F.linear(h, down.weight.to(x.dtype), down.bias.to(x.dtype)).squeeze(-1).float()

    def losses(self, x_BSD, r_BS, member_BS):
        """Weighted aux loss and metrics against top-k membership `member_BS` (0/1 float)."""
        cfg = self.cfg
        aux = r_BS.new_zeros(())
        train_r = cfg.causal in ("aux_loss", "both")
        # Without the aux loss the router BCE is only a metric: keep it off the autograd graph.
        bce_r = F.binary_cross_entropy_with_logits(r_BS if train_r else r_BS.detach(), member_BS)
        if train_r:
            aux = aux + cfg.aux_loss_weight * bce_r
        r = r_BS.detach()
        m = {"router_mean": r.mean(), "router_std": r.std(correction=0), "router_bce": bce_r.detach(),
             "router_causal_acc": ((r > 0) == member_BS.bool()).float().mean()}
        decide_BS = r
        if self.has_threshold:
            decide_BS = self.causal_logits(x_BSD, r)
            m["threshold"] = self.threshold.clone()
            m["threshold_acc"] = ((decide_BS > 0) == member_BS.bool()).float().mean()
        if self.predictor is not None:
            p_BS = self.causal_logits(x_BSD, r_BS)
            bce_p = F.binary_cross_entropy_with_logits(p_BS, member_BS)
            aux = aux + cfg.predictor_loss_weight * bce_p
            decide_BS = p_BS.detach()
            m["predictor_loss"] = bce_p.detach()
            m["predictor_acc"] = ((decide_BS > 0) == member_BS.bool()).float().mean()
        # Fraction of tokens a causal pass would process here (vs the capacity top-k processes).
        m["causal_processed_frac"] = (decide_BS > 0).float().mean()
        m["aux_loss"] = aux.detach()
        return aux, m

    @staticmethod
    def cost(d_model: int, cfg: ModConfig) -> Cost:
        """Per token: the router r = w^T x + b, and the predictor MLP when there is one."""
        c = Cost(d_model + 1, 2 * d_model)
        if cfg.causal in ("predictor", "both"):
            h = cfg.predictor_hidden or d_model // 2
            c = c + Cost(d_model * h + h + h + 1, 2 * d_model * h + 2 * h)
        return c

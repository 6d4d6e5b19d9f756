"""Depth routing (Mixture-of-Depths, Raposo et al. 2024): expert-choice top-k over the sequence.

Shape legend: B batch, S sequence, K selected tokens per row, D d_model.

The router is a scalar `r = w^T x` per token, computed in fp32. Top-k over the sequence is
non-causal, so two causal stand-ins are trained against top-k membership: the router logits
themselves (aux BCE, `sigmoid(r) > 0.5` decides) and a small MLP predictor that sees the
router's input through a stop-gradient (its loss reaches no LM parameter).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mode.config import ModConfig


def capacity_k(capacity: float, seq_len: int) -> int:
    return max(1, round(capacity * seq_len))


def topk_sorted(scores_BS: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores per row, sorted by position (keeps causal order)."""
    return scores_BS.topk(k, dim=1, sorted=False).indices.sort(dim=1).values


class DepthRouter(nn.Module):
    def __init__(self, d_model: int, cfg: ModConfig):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(d_model, 1)
        self.predictor = None
        if cfg.causal in ("predictor", "both"):
            h = cfg.predictor_hidden or d_model // 2
            self.predictor = nn.Sequential(nn.Linear(d_model, h), nn.SiLU(), nn.Linear(h, 1))

    def scores(self, x_BSD: torch.Tensor) -> torch.Tensor:
        w = self.router
        return F.linear(x_BSD.float(), w.weight.float(), w.bias.float()).squeeze(-1)

    def causal_logits(self, x_BSD: torch.Tensor, r_BS: torch.Tensor) -> torch.Tensor:
        """Per-token logit of 'selected' that depends on this token alone (> 0 means process it)."""
        if self.predictor is None:
            return r_BS
        return self.predictor(x_BSD.detach()).squeeze(-1).float()

    def losses(self, x_BSD, r_BS, member_BS):
        """Weighted aux loss and metrics against top-k membership `member_BS` (0/1 float)."""
        cfg = self.cfg
        aux = r_BS.new_zeros(())
        bce_r = F.binary_cross_entropy_with_logits(r_BS, member_BS)
        if cfg.causal in ("aux_loss", "both"):
            aux = aux + cfg.aux_loss_weight * bce_r
        m = {"router_mean": r_BS.detach().mean(), "router_std": r_BS.detach().std(),
             "router_bce": bce_r.detach(),
             "router_causal_acc": ((r_BS.detach() > 0).float() == member_BS).float().mean()}
        if self.predictor is not None:
            p_BS = self.causal_logits(x_BSD, r_BS)
            bce_p = F.binary_cross_entropy_with_logits(p_BS, member_BS)
            aux = aux + cfg.predictor_loss_weight * bce_p
            m["predictor_loss"] = bce_p.detach()
            m["predictor_acc"] = ((p_BS.detach() > 0).float() == member_BS).float().mean()
            m["causal_processed_frac"] = (p_BS.detach() > 0).float().mean()
        else:
            m["causal_processed_frac"] = (r_BS.detach() > 0).float().mean()
        m["aux_loss"] = aux.detach()
        return aux, m

"""Expert routing (Mixture-of-Experts): token-choice top-k over E real + N no-op experts.

Shape legend: T tokens (the B*S rows of a forward call, flattened), D d_model, K top_k,
X = E + N router outputs (real experts first, then no-op experts), E real experts,
R = K*T routes, ordered choice-major (r = j*T + t: every token's first choice, then every
token's second choice, ...).

The router decides everything that is routing: which expert each route goes to, its combine
weight, and whether it survives the capacity limit. Dispatch, expert compute and combine are
separate steps (mode/moe/*), so every backend executes the same decisions.

Semantics:
- logits = x W^T and softmax in fp32; optional multiplicative jitter on x while training.
- Capacity per real expert: ceil(capacity_factor * K * T / E) floored at min_capacity, T = the
  valid tokens of this call (DeepSpeed's per-rank group), in exact arithmetic (capacity_factor as
  the decimal it was written as). DeepSpeed's `_capacity` computes it in float32, which gives one
  slot more for some factors (0.3, 0.6, 1.2: T=200, E=4, top-1, 0.3 -> 16, not 15); every mode
  backend takes this value. capacity_factor None = dropless.
  At sampling time (`sampling`: routing causal, generation) inference_capacity_factor applies,
  dropless by default: a shared capacity would let other tokens of the call push a route out.
- `position` policy: routes claim slots in route order (all first choices before any second
  choice, then by token index); DeepSpeed's top-2 gate uses the same order. `probability`
  policy: each expert keeps its routes with the highest router probability (DeepSpeed's k>2).
- No-op experts have no capacity limit and no parameters; a route to one adds nothing.
- Weights: the top-k probabilities; for K > 1 renormalised to sum to 1 over the top-k
  (no-op routes included) or, with renormalize_after_drop, over the surviving routes
  (DeepSpeed's stock gate). K = 1 keeps the raw probability (Switch): renormalising would
  make it 1 and cut the router off the gradient of the LM loss.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import nn

from mode.config import MoEConfig


@dataclass
class Routing:
    """One forward call's routing decisions, losses and metrics."""

    idx_TK: torch.Tensor
    """Chosen router output per route (0..E-1 real, E..E+N-1 no-op), choice-sorted (j=0 is top-1)."""
    w_TK: torch.Tensor
    """fp32 combine weight of each route; 0 where the route does not reach a real expert."""
    keep_TK: torch.Tensor
    """Route reaches a real expert and survived capacity (False for padding and no-op routes)."""
    pos_TK: torch.Tensor
    """Slot of the route inside its expert's buffer (valid where keep_TK)."""
    capacity: int | None
    """Static bound on slots per expert for buffers (None = dropless: no bound)."""
    counts_E: torch.Tensor
    """Routes per real expert before dropping (demand)."""
    kept_E: torch.Tensor
    """Routes per real expert after dropping."""
    aux_loss: torch.Tensor
    """lb_loss_weight * lb_loss + z_loss_weight * z_loss (fp32 scalar, on the graph)."""
    metrics: dict = field(default_factory=dict)
    engaged_T: torch.Tensor | None = None
    """Token got at least one real-expert update."""


def expert_capacity(num_tokens, num_experts: int, capacity_factor: float, k: int, min_capacity: int):
    """ceil(capacity_factor * k * T / E), exactly, floored at min_capacity. `num_tokens` is an int
    (returns an int, no device work) or a 0-d tensor (returns a 0-d tensor on its device, integer
    arithmetic: no host sync)."""
    if isinstance(num_tokens, int):
        return _host_capacity(num_tokens, num_experts, capacity_factor, k, min_capacity)
    num, den = capacity_ratio(capacity_factor, k, num_experts)
    return ((num_tokens.long() * num + den - 1) // den).clamp(min=min_capacity)


def capacity_ratio(capacity_factor: float, k: int, num_experts: int) -> tuple[int, int]:
    """capacity_factor * k / E as (numerator, denominator): the factor as the decimal it was written
    as (repr: 0.3 is 3/10, not the binary float), denominators bounded so T * numerator fits int64."""
    r = Fraction(repr(float(capacity_factor))).limit_denominator(10**6) * k / num_experts
    return r.numerator, r.denominator


def count(idx_R: torch.Tensor, n: int) -> torch.Tensor:
    """bincount with a static length n (values < n): bincount sizes its output from the data,
    a host sync on GPUs and a graph break under torch.compile."""
    return torch.zeros(n, dtype=torch.long, device=idx_R.device).scatter_add_(0, idx_R, torch.ones_like(idx_R))


def _host_capacity(num_tokens: int, num_experts: int, capacity_factor: float, k: int, min_capacity: int) -> int:
    # Python integers: a tensor here would be a device read on every call.
    num, den = capacity_ratio(capacity_factor, k, num_experts)
    return max(-(-num_tokens * num // den), min_capacity)


# A function of Python numbers: torch.compile folds it. This is the mark that
# @torch.compiler.assume_constant_result sets (tests/test_compile.py checks it); the decorator
# imports torch._dynamo, ~3 s of CPU in every process that only validates, evaluates or generates.
_host_capacity._dynamo_marked_constant = True
capacity_ratio._dynamo_marked_constant = True


class ExpertRouter(nn.Module):
    def __init__(self, d_model: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.E, self.N, self.k = cfg.num_experts, cfg.num_noop_experts, cfg.top_k
        # One row per router output; no-op experts are just extra logits.
        self.weight = nn.Parameter(torch.empty(self.E + self.N, d_model))
        nn.init.normal_(self.weight, std=0.02)  # a standalone router's; an LM re-initialises it (init_std)
        # Sampling-time routing for the current call (set by the MoE layer from the routing mode):
        # capacity from inference_capacity_factor, null = dropless.
        self.sampling = False

    def capacity_factor(self) -> float | None:
        c = self.cfg
        if self.sampling:
            return c.inference_capacity_factor
        if not self.training and c.eval_capacity_factor is not None:
            return c.eval_capacity_factor
        return c.capacity_factor

    def buffer_capacity(self, T: int) -> int | None:
        """Static slots per expert for T token rows (None: dropless). An expert gets at most one
        route per token, so more than T slots would only hold padding."""
        cf = self.capacity_factor()
        return None if cf is None else min(expert_capacity(T, self.E, cf, self.k, self.cfg.min_capacity), T)

    def logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        x = x_TD.float()  # fp32 routing even under bf16: near-ties decide experts
        if self.training and self.cfg.jitter > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - self.cfg.jitter, 1.0 + self.cfg.jitter)
        return F.linear(x, self.weight.float())

    def forward(self, x_TD: torch.Tensor, valid_T: torch.Tensor | None = None) -> Routing:
        cfg, E, K = self.cfg, self.E, self.k
        T = x_TD.shape[0]
        logits_TX = self.logits(x_TD)
        probs_TX = logits_TX.softmax(-1)
        p_TK, idx_TK = probs_TX.topk(K, dim=-1)

        valid_TK = None if valid_T is None else valid_T[:, None].expand(T, K)
        real_TK = idx_TK < E if valid_TK is None else (idx_TK < E) & valid_TK
        noop_TK = idx_TK >= E if valid_TK is None else (idx_TK >= E) & valid_TK
        # Valid-token count: a Python int when there is no padding (exact DeepSpeed capacity,
        # no device work), a device scalar otherwise (no host sync).
        n_valid = T if valid_T is None else valid_T.sum()

        # -- slots: sort routes by expert in priority order; a route's slot is its rank there.
        key_R = torch.where(real_TK, idx_TK, E).t().reshape(-1)  # E = sentinel: padding / no-op
        if cfg.drop_policy == "probability":
            by_prob_R = torch.argsort(-p_TK.detach().t().reshape(-1), stable=True)
            order_R = by_prob_R[torch.argsort(key_R[by_prob_R], stable=True)]
        else:
            order_R = torch.argsort(key_R, stable=True)
        counts_X = count(key_R, E + 1)  # [E real..., sentinel]
        start_X = counts_X.cumsum(0) - counts_X
        pos_sorted_R = torch.arange(key_R.numel(), device=key_R.device) - start_X[key_R[order_R]]
        pos_R = torch.empty_like(pos_sorted_R).scatter_(0, order_R, pos_sorted_R)
        pos_TK = pos_R.view(K, T).t()
        counts_E = counts_X[:E]

        cf = self.capacity_factor()
        if cf is None:
            keep_TK, kept_E, cap_buf = real_TK, counts_E, None
        else:
            cap = expert_capacity(n_valid, E, cf, K, cfg.min_capacity)
            keep_TK = real_TK & (pos_TK < cap)
            kept_E = counts_E.clamp(max=cap)
            cap_buf = self.buffer_capacity(T)

        # -- combine weights
        if K > 1 and cfg.normalize_weights:
            live_TK = (keep_TK | noop_TK) if cfg.renormalize_after_drop else torch.ones_like(keep_TK)
            denom_T1 = (p_TK * live_TK).sum(-1, keepdim=True)
            w_TK = p_TK / denom_T1.clamp(min=torch.finfo(p_TK.dtype).eps)
        else:
            w_TK = p_TK
        w_TK = w_TK * keep_TK

        # -- losses. Load balancing over REAL experts only: f_e = share of the real-expert routes
        # (before dropping) that chose e, P_e = mean over valid tokens of e's probability
        # renormalised over the real experts. With N = 0 this is Switch's E * sum_e f_e P_e (and
        # DeepSpeed's top-1 and top-k gates'; its top-2 gate counts first choices only). With N > 0
        # it measures balance among the real experts only and is indifferent to how much traffic
        # goes to no-ops: that split is left to the LM loss.
        # noop_balance=include (AdaMoE's null experts) balances over all E + N outputs instead, so
        # about N / (E + N) of the routes go to no-ops: without it the router has no reason to
        # pick an output that contributes nothing, and integrated MoDE degenerates to dropping.
        vmask_T1 = None if valid_T is None else valid_T[:, None].float()
        probs_TE = probs_TX[:, :E]
        counts_lb = counts_E
        if self.N and cfg.noop_balance == "include":
            probs_TE = probs_TX
            sel_R = (idx_TK if valid_TK is None else torch.where(valid_TK, idx_TK, E + self.N)).reshape(-1)
            counts_lb = count(sel_R, E + self.N + 1)[:E + self.N]
        elif self.N:
            probs_TE = logits_TX[:, :E].softmax(-1)  # = p_e / sum of real p, exact however small that sum
        if vmask_T1 is None:
            P_E = probs_TE.mean(0)
            z = torch.logsumexp(logits_TX, -1).square().mean()
        else:
            denom = n_valid.clamp(min=1).float()
            P_E = (probs_TE * vmask_T1).sum(0) / denom
            z = (torch.logsumexp(logits_TX, -1).square() * vmask_T1[:, 0]).sum() / denom
        f_E = counts_lb.float() / counts_lb.sum().clamp(min=1).float()
        lb = f_E.numel() * (f_E * P_E).sum()
        aux = cfg.lb_loss_weight * lb + cfg.z_loss_weight * z

        metrics = route_metrics(keep_TK, real_TK, noop_TK if self.N else None, counts_E, kept_E, n_valid, lb, z)
        return Routing(idx_TK, w_TK, keep_TK, pos_TK, cap_buf, counts_E, kept_E, aux, metrics,
                       keep_TK.any(-1))


def route_metrics(keep_TK, real_TK, noop_TK, counts_E, kept_E, n_valid, lb, z=None) -> dict:
    """On-device metrics of one routing call (read at logging steps only; no host sync here).

    keep_TK: route processed by a real expert; real_TK: route asked for a real expert (valid
    tokens only); noop_TK: route went to a no-op expert (None without no-op experts);
    counts_E / kept_E: routes per real expert before / after dropping; n_valid: valid tokens.
    """
    E, K = counts_E.numel(), keep_TK.shape[1]
    n_tok = float(max(n_valid, 1)) if isinstance(n_valid, int) else n_valid.clamp(min=1).float()
    demand = counts_E.sum()
    dropped_tok = (real_TK.any(-1) & ~keep_TK.any(-1)).sum()
    m = {
        # dropped routes / routes that asked for a real expert
        "dropped_routes_frac": (demand - kept_E.sum()).float() / demand.clamp(min=1).float(),
        # tokens that asked for >= 1 real expert and got none / valid tokens
        "dropped_tokens_frac": dropped_tok.float() / n_tok,
        # tokens with >= 1 route a real expert processed / valid tokens: the layer's processed
        # fraction (what neither a drop nor the no-op experts took), comparable across variants
        "engaged_frac": keep_TK.any(-1).sum().float() / n_tok,
        # expert load = kept routes of expert e / (K*T/E), its share under perfect balance:
        # load_max is the busiest expert (<= ~capacity_factor when dropping), load_mean the
        # fraction of all routes processed by real experts (1 - dropped - no-op shares).
        "load_max": kept_E.max().float() * E / (K * n_tok),
        "load_mean": kept_E.float().mean() * E / (K * n_tok),
        "lb_loss": lb.detach(),
    }
    if z is not None:
        m["z_loss"] = z.detach()
    if noop_TK is not None:
        m["noop_frac"] = noop_TK.sum().float() / (K * n_tok)  # share of routes sent to no-ops
    return m

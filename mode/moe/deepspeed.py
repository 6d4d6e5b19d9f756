"""DeepSpeed MoE backend: `deepspeed.moe.layer.MoE` (expert parallelism over all-to-all) with
OUR router as its gate.

Shape legend: B batch, S sequence, T = B*S tokens, D d_model, F expert hidden, E real experts,
K top_k, C slots per expert, X = E + N router outputs.

Why our router and not DeepSpeed's TopKGate: DeepSpeed's MOELayer takes any gate that returns
its sparse-route tuple (l_aux, C, E, indices[K,T] with -1 for dropped routes, locations[K,T],
gates[K,T], exp_counts), then does the dispatch, all-to-all, expert compute and combine. Its
stock gate cannot reproduce our semantics: with use_rts=False its top-1 gate keeps
`torch.topk` of a 0/1 mask over tokens, so WHICH overflow tokens survive is the tie order of
topk (measured: not position order); its top-2 gate renormalises over the surviving routes and
balances on first choices only; k>2 always drops by probability; it has no no-op experts, no
z-loss and reports no drops. With our gate every backend executes the same routing decisions,
no-op experts (integrated MoDE) work under expert parallelism (a no-op route is an index of -1,
which DeepSpeed sends nowhere), and drop metrics are exact. `stock_gate=True` keeps DeepSpeed's
TopKGate (use_rts=False, top2_2nd_expert_sampling=False) for tests and benchmarks; its drops are
then derived from the gate's capacity and counts.

Process groups: `deepspeed.initialize` calls the inner MoE's `set_deepspeed_parallelism()`;
a forward outside an engine creates them on first use (torch.distributed must be initialised).
Optimizer: pass param groups through `moe_param_groups` so expert parameters (tagged
`allreduce=False` by DeepSpeed) are reduced over their expert-data-parallel group.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from mode.config import ModelConfig
from mode.mlp import MLP
from mode.moe.base import MoEBase
from mode.routing.experts import ExpertRouter, route_metrics


def use_cpu_accelerator_without_cuda() -> None:
    """DeepSpeed picks its accelerator when it is first imported: on a machine without CUDA it must
    be told `cpu` first. Called before each `import deepspeed` here and in mode/engine.py (never at
    import time: importing mode changes no environment)."""
    from mode.lifeline import use_venv_build_cache

    use_venv_build_cache()  # before DeepSpeed builds its CPU comm op
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


class RouterGate(nn.Module):
    """ExpertRouter speaking DeepSpeed's gate protocol (MOELayer calls it with sparse_routes=True)."""

    def __init__(self, router: ExpertRouter):
        super().__init__()
        self.router = router
        self.ep_group = None
        self.last = None  # the Routing of the last call, read by DeepSpeedMoE

    def _set_ep_group(self, ep_group):
        self.ep_group = ep_group

    def forward(self, x_TD, used_token=None, sparse_routes=True, use_tutel=False):
        assert sparse_routes and not use_tutel, "DeepSpeed's MOELayer asks for sparse routes"
        r = self.router(x_TD, None if used_token is None else used_token.bool())
        # All-to-all needs the same buffer on every rank of the EP group. Dropping with full
        # batches: C follows from the (equal) token count. Dropless, or ragged batches (padding,
        # e.g. causal depth routing): agree on the largest C (host sync: a data-dependent size).
        C = r.capacity
        parallel = self.ep_group is not None and torch.distributed.get_world_size(self.ep_group) > 1
        if C is None or (parallel and used_token is not None):
            c = r.counts_E.max() if C is None else torch.tensor(C, device=r.counts_E.device)
            if parallel:
                torch.distributed.all_reduce(c, op=torch.distributed.ReduceOp.MAX, group=self.ep_group)
            C = int(c)
        C = max(C, 1)
        idx_KT = torch.where(r.keep_TK, r.idx_TK, -1).t().int()  # -1: dropped / no-op / padding
        loc_KT = torch.where(r.keep_TK, r.pos_TK, 0).t().int()
        self.last = r
        return r.aux_loss, C, self.router.E, idx_KT, loc_KT, r.w_TK.t(), r.counts_E


class DeepSpeedMoE(MoEBase):
    def __init__(self, cfg: ModelConfig, layer_idx: int, stock_gate: bool = False):
        super().__init__(cfg, layer_idx)
        use_cpu_accelerator_without_cuda()
        from deepspeed.moe.layer import MoE  # lazy: the core runs without DeepSpeed

        m = cfg.moe
        self.stock_gate = stock_gate
        cf = m.capacity_factor
        ecf = m.eval_capacity_factor if m.eval_capacity_factor is not None else cf
        self.moe = MoE(hidden_size=cfg.d_model, expert=MLP(cfg.d_model, m.d_expert or cfg.d_ff, cfg.mlp),
                       num_experts=m.num_experts, ep_size=m.ep_size, k=m.top_k,
                       capacity_factor=cf or 1.0, eval_capacity_factor=ecf or 1.0,
                       min_capacity=m.min_capacity, noisy_gate_policy="Jitter" if m.jitter else None,
                       drop_tokens=cf is not None, use_rts=False, top2_2nd_expert_sampling=False)
        if not stock_gate:
            self.moe.deepspeed_moe.gate = RouterGate(ExpertRouter(cfg.d_model, m))
            self.moe.deepspeed_moe.gate.router.weight.init_key = f"layer{layer_idx}.router.weight"  # native's key
        else:
            self._stock = None
            self.moe.deepspeed_moe.gate.register_forward_hook(self._capture_stock)
        # DeepSpeed deep-copies one expert module: re-draw every expert so they differ, and name
        # each by its GLOBAL index for init_weights (same weights whatever the ep_size; DeepSpeed
        # puts consecutive ranks in one expert-parallel group, so ep_rank = rank % ep_size).
        ep_rank = torch.distributed.get_rank() % m.ep_size if torch.distributed.is_initialized() else 0
        n_local = m.num_experts // m.ep_size
        for name, p in self.moe.named_parameters():
            if "deepspeed_experts" in name:
                nn.init.normal_(p, std=cfg.init_std)
                j, rest = name.split("deepspeed_experts.")[1].split(".", 1)
                p.init_key = f"layer{layer_idx}.expert{ep_rank * n_local + int(j)}.{rest}"
        self.lb_weight = m.lb_loss_weight

    def _capture_stock(self, gate, inputs, out):
        self._stock = out  # (l_aux, C, E, indices[K,T], locations, gates, exp_counts)

    def _ensure_groups(self):
        if self.moe.deepspeed_moe.ep_group is None:
            from deepspeed import comm as dist

            if not dist.is_initialized():
                raise RuntimeError("backend deepspeed needs torch.distributed: build the model under the "
                                   "engine, or call deepspeed.init_distributed() before the first forward")
            self.moe.set_deepspeed_parallelism()

    def forward(self, x_BSD: torch.Tensor, valid_BS: torch.Tensor | None = None, routing: str = "topk") -> torch.Tensor:
        B, S, D = x_BSD.shape
        self._ensure_groups()
        if not self.stock_gate:  # sampling time: inference_capacity_factor (dropless by default)
            self.moe.deepspeed_moe.gate.router.sampling = routing == "causal"
        used = None if valid_BS is None else valid_BS.reshape(-1).to(x_BSD.dtype)
        y_BSD, l_aux, counts_E = self.moe(x_BSD, used)
        r = None
        if not self.stock_gate:
            r = self.moe.deepspeed_moe.gate.last
            aux, metrics, engaged_T = r.aux_loss, r.metrics, r.engaged_T
        else:  # derive drops from the stock gate's capacity and counts
            _, C, _, idx_KT, _, _, _ = self._stock
            # metrics over valid tokens only, as the native router's (the stock gate routes padding too)
            real_TK = torch.ones_like(idx_KT.t(), dtype=torch.bool)
            n_valid = B * S
            if valid_BS is not None:
                real_TK = real_TK & valid_BS.reshape(-1, 1).bool()
                n_valid = valid_BS.sum()
            keep_TK = (idx_KT.t() >= 0) & real_TK
            aux = self.lb_weight * l_aux
            metrics = route_metrics(keep_TK, real_TK, None, counts_E, counts_E.clamp(max=int(C)), n_valid, l_aux)
            engaged_T = keep_TK.any(-1)
        if valid_BS is not None and self.stock_gate:
            y_BSD = y_BSD * valid_BS[..., None].to(y_BSD.dtype)  # the stock top-2 gate routes padding too
        self.record(aux, metrics, engaged_T.view(B, S), r)
        return y_BSD


def moe_param_groups(param_groups: list[dict]) -> list[dict]:
    """Split DeepSpeed expert parameters into their own optimizer groups (one per expert-parallel
    group name), as DeepSpeed's ZeRO needs for MoE. Groups without a `name` get one."""
    use_cpu_accelerator_without_cuda()
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    named = [dict(g, name=g.get("name", f"group{i}")) for i, g in enumerate(param_groups)]
    return split_params_into_different_moe_groups_for_optimizer(named)


# ---------------------------------------------------------------------------------------------
# Weight exchange between backends (agreement tests, converting checkpoints).


def _expert_views(m: nn.Module):
    """(router weight [X, D], first global expert index, w_in list [D, 2F|F], w_out list [F, D])
    as tensors that share storage with the module's parameters (writes go through)."""
    from mode.moe.native import NativeMoE

    if isinstance(m, NativeMoE):
        return m.router.weight, 0, list(m.w_in), list(m.w_out)
    if isinstance(m, DeepSpeedMoE):
        m._ensure_groups()  # its expert-parallel group says which experts this rank holds (unset before
        # the first forward, every rank's were taken for experts 0..n-1)
        layer = m.moe.deepspeed_moe
        gate = layer.gate
        w_r = gate.router.weight if isinstance(gate, RouterGate) else gate.wg.weight
        first = 0
        if layer.ep_group is not None and layer.ep_size > 1:
            first = torch.distributed.get_rank(layer.ep_group) * layer.num_local_experts
        experts = layer.experts.deepspeed_experts
        return w_r, first, [e.w_in.weight.t() for e in experts], [e.w_out.weight.t() for e in experts]
    raise TypeError(f"no weight mapping for {type(m).__name__}")


@torch.no_grad()
def copy_moe_weights(src: nn.Module, dst: nn.Module) -> None:
    """Copy router and expert weights between NativeMoE and DeepSpeedMoE layers (either way).
    An expert-parallel DeepSpeed layer holds only its rank's experts: the experts both hold
    are copied (by global index)."""
    r_s, first_s, in_s, out_s = _expert_views(src)
    r_d, first_d, in_d, out_d = _expert_views(dst)
    r_d.copy_(r_s)
    for g in range(max(first_s, first_d), min(first_s + len(in_s), first_d + len(in_d))):
        in_d[g - first_d].copy_(in_s[g - first_s])
        out_d[g - first_d].copy_(out_s[g - first_s])

"""The causal predictor's cost under bf16: fp32 GEMMs (its fp32 master weights, the stream cast up:
what mode did before session 27) against GEMMs in the stream's dtype (the weights cast down, what
DepthRouter.causal_logits does now). Forward + the predictor loss's backward, side by side.

    python benchmarks/bench_predictor.py [--device cuda] [--d-model 2048] [--tokens 16384]

Prints both times, their ratio, and how far apart the two logits are (bf16 rounding).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.bench_mod import timeit_interleaved  # noqa: E402
from mode.config import ModConfig  # noqa: E402
from mode.routing.depth import DepthRouter  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    torch.manual_seed(0)
    D, dev = a.d_model, torch.device(a.device)
    torch.set_default_device(dev)  # timeit_interleaved waits for the default device's work (CUDA)
    router = DepthRouter(D, ModConfig(layers="every", causal="predictor")).to(dev)  # fp32 masters
    x_BSD = torch.randn(1, a.tokens, D, device=dev).to(torch.bfloat16)  # the bf16 residual stream
    r_BS = router.scores(x_BSD)
    member_BS = (torch.rand(1, a.tokens, device=dev) < 0.125).float()

    def fp32_gemms():
        p_BS = router.predictor(x_BSD.detach().float()).squeeze(-1)
        F.binary_cross_entropy_with_logits(p_BS, member_BS).backward()

    def stream_dtype():
        p_BS = router.causal_logits(x_BSD, r_BS)
        F.binary_cross_entropy_with_logits(p_BS, member_BS).backward()

    t_old, t_new = timeit_interleaved([fp32_gemms, stream_dtype], a.reps)
    with torch.no_grad():
        old_BS = router.predictor(x_BSD.float()).squeeze(-1)
        new_BS = router.causal_logits(x_BSD, r_BS)
        flips = ((old_BS > 0) != (new_BS > 0)).float().mean().item()
        err = (old_BS - new_BS).abs().max().item() / old_BS.abs().max().item()
    name = torch.cuda.get_device_name() if dev.type == "cuda" else f"{os.cpu_count()}-core CPU"
    print(f"predictor d_model {D} -> {D // 2} -> 1, {a.tokens} tokens, bf16 stream, fp32 weights, {name}, "
          f"{torch.get_num_threads()} threads: fp32 GEMMs {t_old * 1e3:.2f} ms, stream-dtype GEMMs "
          f"{t_new * 1e3:.2f} ms: {t_old / t_new:.2f}x; logits max |diff| {err:.1e} of their max, "
          f"decisions flipped {100 * flips:.2f}%")


if __name__ == "__main__":
    main()

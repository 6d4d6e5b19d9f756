"""The portable model format `mode export` writes and `load_run` reads (its own module, so that
export -> generate (load_run) and generate -> the format do not form an import cycle)."""
from __future__ import annotations

import re
from pathlib import Path

import torch

WEIGHTS = "model.safetensors"
TOKENIZER_DIR = "tokenizer"


def is_export(path: str | Path) -> bool:
    return (Path(path) / WEIGHTS).is_file() and (Path(path) / "config.yaml").is_file()


def save_weights(model: torch.nn.Module, path: Path) -> None:
    # save_model drops the tied head weight (an alias of the embedding) instead of refusing it.
    from safetensors.torch import save_model

    save_model(model, str(path))


def file_sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def load_weights(model: torch.nn.Module, path: Path) -> None:
    from safetensors.torch import load_model

    load_model(model, str(path), strict=True, device="cpu")


# DeepSpeed MoE layers in a run's state dict: `<P>.moe.deepspeed_moe.gate.router.<w>` and
# `<P>.moe.deepspeed_moe.experts.deepspeed_experts.<j>.w_{in,out}.weight` (Linear: [out, in]).
_DS_ROUTER = re.compile(r"^(.*)\.moe\.deepspeed_moe\.gate\.router\.(\w+)$")
_DS_EXPERT = re.compile(r"^(.*)\.moe\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(w_in|w_out)\.weight$")
DS_EXPERT_FILES = "layer_*_expert_*_mp_rank_*_model_states.pt"  # DeepSpeed's per-expert files, global indices


def deepspeed_moe_to_native(cfg, state: dict, ckpt_dir: Path):
    """(config, state dict) of a run trained with `model.moe.backend=deepspeed`, rewritten for the
    native backend (the reference implementation; same routing, same numbers: tests/test_moe.py),
    which runs without torch.distributed. With expert parallelism (ep_size > 1) rank 0's model.pt
    holds only its own experts: every expert is read from DeepSpeed's per-expert checkpoint files,
    which name them by global index."""
    state = {k: v for k, v in state.items() if not _DS_EXPERT.match(k)}
    for f in sorted(Path(ckpt_dir).glob(DS_EXPERT_FILES)):
        state.update(torch.load(f, map_location="cpu", weights_only=True))
    out, experts = {}, {}
    for k, v in state.items():
        if m := _DS_ROUTER.match(k):
            out[f"{m[1]}.router.{m[2]}"] = v
        elif m := _DS_EXPERT.match(k):
            experts.setdefault((m[1], m[3]), {})[int(m[2])] = v.float().t()  # native: [E, in, out]
        else:
            out[k] = v
    E = cfg.model.moe.num_experts
    for (prefix, name), by_index in experts.items():
        if sorted(by_index) != list(range(E)):
            raise FileNotFoundError(f"{ckpt_dir} holds experts {sorted(by_index)} of {prefix} ({E} expected): "
                                    f"DeepSpeed's expert files ({DS_EXPERT_FILES}) are incomplete")
        out[f"{prefix}.{name}"] = torch.stack([by_index[j] for j in range(E)])
    cfg.model.moe.backend, cfg.model.moe.ep_size = "native", 1
    return cfg, out


# MegaBlocks layers (mode/moe/megablocks.py): `<P>.router.weight` as native, and the experts of
# dMoE's grouped MLP as `<P>.experts.mlp.{w1,v1,w2}`, each [E*F, D] (w1/v1 = W^T per expert).
# `<P>.` is empty in a layer's own state dict.
_MB_EXPERT = re.compile(r"^((?:.*\.)?)experts\.mlp\.(w1|v1|w2)$")


def megablocks_to_native(cfg, state: dict):
    """(config, state dict) of a run trained with `model.moe.backend=megablocks` (CUDA only),
    rewritten for the native backend, so that it samples, evaluates and exports anywhere. The
    inverse of mode.moe.megablocks.copy_native_to_megablocks; MegaBlocks' bf16 expert weights
    become float32, as native parameters are (bf16 -> fp32 is exact)."""
    out, mlps = {}, {}
    for k, v in state.items():
        if m := _MB_EXPERT.match(k):
            mlps.setdefault(m[1], {})[m[2]] = v.float()
        else:
            out[k] = v
    E = cfg.model.moe.num_experts
    for prefix, w in mlps.items():
        D = w["w1"].shape[1]
        w_in_EDH = torch.cat([w[n].view(E, -1, D) for n in ("w1", "v1") if n in w], dim=1).transpose(1, 2)
        out[f"{prefix}w_in"] = w_in_EDH.contiguous()
        out[f"{prefix}w_out"] = w["w2"].view(E, -1, D).contiguous()
    cfg.model.moe.backend = "native"
    return cfg, out

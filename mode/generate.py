"""Autoregressive sampling with a KV cache and causal depth routing, batched over ragged prompts.

Shape legend: B prompts (batch rows), T decoding steps, V vocabulary, P longest prompt.

All rows advance in lockstep, one position per step: at step t row i feeds its prompt token t
while t < len_i, else the token it sampled at step t - 1. Every row sits at the same position t,
so no padding or position offsets are needed; a row whose prompt is still running ignores its
sample. Routed layers decide each token causally (predictor, or sigmoid(r) > 0.5) and append it
to their own cache only when they process it, so cache lengths differ per row and layer.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from mode.model import LM, build_model


@dataclass
class Trace:
    tokens_BT: torch.Tensor
    """[B, T + 1] every row's fed tokens (prompt, then samples) plus the last sample."""
    logits_BTV: torch.Tensor
    """[B, T, V] the logits each step produced (fp32)."""


def _sample(logits_BV, temperature: float, top_k: int, gen: torch.Generator) -> torch.Tensor:
    if temperature <= 0:
        return logits_BV.argmax(-1)
    logits_BV = logits_BV / temperature
    if 0 < top_k < logits_BV.shape[-1]:
        kth_B1 = logits_BV.topk(top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    return torch.multinomial(logits_BV.softmax(-1), 1, generator=gen)[:, 0]


@torch.no_grad()
def generate_ids(model: LM, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
                 top_k: int = 0, seed: int = 0, eos_id: int | None = None, vocab_limit: int | None = None,
                 return_trace: bool = False):
    """Sample `max_new_tokens` after each prompt (stopping a row at `eos_id`, not included).
    temperature <= 0 is greedy; top_k 0 keeps the whole vocabulary; `vocab_limit` masks logits of
    ids the tokenizer cannot decode. Returns the new ids per row (and a Trace if asked)."""
    if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token")
    dev = next(model.parameters()).device
    B, n = len(prompt_ids), max_new_tokens
    len_B = torch.tensor([len(p) for p in prompt_ids], device=dev)
    P = int(len_B.max())
    if n <= 0:
        return ([[] for _ in prompt_ids], None) if return_trace else [[] for _ in prompt_ids]
    T = max(len(p) + n for p in prompt_ids) - 1  # steps: the last sample is never fed back
    if T > model.cfg.max_seq_len:
        raise ValueError(f"prompt + max_new_tokens needs {T} positions > model.max_seq_len={model.cfg.max_seq_len}")
    prompt_BP = torch.zeros(B, P, dtype=torch.long, device=dev)
    for i, p in enumerate(prompt_ids):
        prompt_BP[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    was_training = model.training
    model.eval()
    gen = torch.Generator(device=dev).manual_seed(seed)
    caches = model.new_caches(B, T)
    tokens_BT = torch.zeros(B, T + 1, dtype=torch.long, device=dev)
    tokens_BT[:, 0] = prompt_BP[:, 0]
    logits = []
    for t in range(T):
        pos_B1 = torch.full((B, 1), t, dtype=torch.long, device=dev)
        out = model(tokens_BT[:, t : t + 1], routing="causal", pos_BS=pos_B1, caches=caches)
        logits_BV = out.logits[:, 0].float()
        if return_trace:
            logits.append(logits_BV)
        if vocab_limit is not None:
            logits_BV = logits_BV[:, :vocab_limit]
        next_B = _sample(logits_BV, temperature, top_k, gen)
        in_prompt_B = t + 1 < len_B
        tokens_BT[:, t + 1] = torch.where(in_prompt_B, prompt_BP[:, min(t + 1, P - 1)], next_B)
    model.train(was_training)
    out_ids = []
    for i, p in enumerate(prompt_ids):
        new = tokens_BT[i, len(p) : len(p) + n].tolist()
        if eos_id is not None and eos_id in new:
            new = new[: new.index(eos_id)]
        out_ids.append(new)
    if return_trace:
        return out_ids, Trace(tokens_BT, torch.stack(logits, 1))
    return out_ids


def generate(model: LM, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float = 1.0,
             top_k: int = 0, seed: int = 0) -> list[str]:
    """Text in, text out. Each prompt is preceded by the tokenizer's EOS: training packs
    documents with EOS between them, so it marks 'a document starts here' (and lets an empty
    prompt sample from scratch)."""
    eos = tokenizer.eos_id
    ids = [[eos] + [int(i) for i in tokenizer.encode(p)] for p in prompts]
    out = generate_ids(model, ids, max_new_tokens, temperature, top_k, seed, eos_id=eos,
                       vocab_limit=min(tokenizer.vocab_size, model.cfg.vocab_size))
    return [tokenizer.decode(o) for o in out]


# ----------------------------------------------------------------------------------------------
# Loading a trained run.


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """Newest complete checkpoint dir: checkpoints/step_<N> (no `.tmp` suffix) holding model.pt
    whose manifest verifies (one without a manifest predates manifests). A damaged newer one is
    reported in one line and skipped (left in place: sampling never changes a run)."""
    from mode.checkpoint import MANIFEST, verify

    ckpts = []
    for d in (Path(run_dir) / "checkpoints").glob("step_*"):
        m = re.fullmatch(r"step_(\d+)", d.name)
        if m and d.is_dir() and (d / "model.pt").is_file():
            ckpts.append((int(m.group(1)), d))
    for _, d in sorted(ckpts, reverse=True):
        problem = verify(d) if (d / MANIFEST).exists() else None
        if problem is None:
            return d
        print(f"checkpoint {d} is unusable ({problem}); falling back to the previous one", file=sys.stderr)
    return None


def load_run(run_dir: str | Path, device: str | torch.device = "cpu", return_source: bool = False):
    """(model in eval mode, tokenizer, config) from a run directory (config.yaml and the newest
    complete checkpoint's plain state_dict, model.pt: no DeepSpeed needed) or from a directory
    written by `mode export` (config.yaml, model.safetensors, tokenizer/). With `return_source`, the
    file the weights came from is returned fourth. A missing run or checkpoint is a ConfigError."""
    from mode.config import ConfigError, load_config
    from mode.data import build_tokenizer
    from mode.portable import TOKENIZER_DIR, WEIGHTS, is_export, load_weights

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError("--run", str(run_dir), "a run directory (with config.yaml) or a `mode export` directory")
    exported = is_export(run_dir)
    # An export's HF tokenizer lives inside it; the path in its config.yaml is relative to it.
    over = [f"data.tokenizer={run_dir / TOKENIZER_DIR}"] if exported and (run_dir / TOKENIZER_DIR).is_dir() else []
    try:
        cfg = load_config(run_dir / "config.yaml", over)
    except ConfigError as e:  # sampling reads no data: a training file that moved must not block it
        if e.key not in ("data.source", "data.val_source"):
            raise
        cfg = load_config(run_dir / "config.yaml", over + ["data.source=stdlib", "data.val_source="])
    model = build_model(cfg.model)
    if exported:
        source = run_dir / WEIGHTS
        load_weights(model, source)
    else:
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None:
            raise ConfigError("--run", str(run_dir), "a run with a complete checkpoint (checkpoints/step_*/model.pt): "
                              "none yet; train it first")
        source = ckpt / "model.pt"
        state = torch.load(source, map_location="cpu", weights_only=True)
        state = state.get("module", state) if isinstance(state, dict) else state
        state = {k.removeprefix("module."): v for k, v in state.items()}
        model.load_state_dict(state)
    out = (model.to(device).eval(), build_tokenizer(cfg.data), cfg)
    return (*out, source) if return_source else out


def cli_generate(run_dir: str, prompts: list[str], max_new_tokens: int, temperature: float = 1.0,
                 seed: int = 0) -> list[str]:
    """What `mode generate --run RUN_DIR --prompt TEXT` does: the prompt followed by its sample."""
    from mode.config import ConfigError

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if max_new_tokens < 0:
        raise ConfigError("--max-new-tokens", max_new_tokens, ">= 0")
    model, tok, _ = load_run(run_dir, device)
    longest = max(len(tok.encode(p)) for p in prompts) + 1  # + the EOS that starts each prompt
    if longest + max_new_tokens - 1 > model.cfg.max_seq_len:
        raise ConfigError("--max-new-tokens", max_new_tokens, f"<= {model.cfg.max_seq_len - longest + 1} "
                          f"(model.max_seq_len={model.cfg.max_seq_len} minus the longest prompt, {longest} tokens)")
    return [p + s for p, s in zip(prompts, generate(model, tok, prompts, max_new_tokens, temperature, seed=seed))]


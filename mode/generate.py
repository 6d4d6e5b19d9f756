"""Autoregressive sampling with a KV cache and causal routing, batched over ragged prompts.

Shape legend: B prompts (batch rows), P longest prompt, T positions, V vocabulary.

Sampling-time semantics (README "Sampling"): every routing decision for a token depends only on it
and the earlier tokens of its own row. Depth routing decides per token (predictor, router sign or
calibrated threshold); MoE layers are dropless (model.moe.inference_capacity_factor null). So a
prompt's logits (and greedy output) do not depend on the other prompts of its batch, and equal a
full `model(tokens, routing="causal")` recompute. At temperature > 0 one generator draws for the
whole batch: the drawn tokens (not their distribution) depend on the row's place in the batch.

Prefill: the right-padded prompts go through the model in one forward (padding masked); each
layer's cache receives the tokens that layer processed. Then every row decodes one token per step
at its own position (rows of different prompt lengths advance together). A routed layer runs its
block only on the rows whose token it selected. `prefill=False` feeds prompts one token per step
instead (the reference path: rows in lockstep, position t at step t).

Stopping: a row finishes at the EOS or as soon as its decoded new text holds one of its stop
strings (checked on the host after every step); a finished row leaves the batch (its cache rows
are dropped), and decoding ends when every row has finished.

Python API:
    from mode.generate import load_run, generate
    model, tokenizer, cfg = load_run("runs/tiny/mod")      # newest complete checkpoint, eval mode
    texts = generate(model, tokenizer, ["def main("], max_new_tokens=64, temperature=0)  # greedy
    texts = generate(model, tokenizer, ["def main("], 64, temperature=0, stop=["\\n\\n"])  # ends at a blank line
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from mode.config import config_diff, is_int, is_number
from mode.model import LM, build_model
from mode.plan import has_depth_routing, has_moe, layer_plan


# What `mode generate` and a `mode eval` task's generation_kwargs (mode.harness) accept for the same values.
SAMPLING = {"max_new_tokens": (lambda v: is_int(v, 1), "an integer >= 1"),
            "temperature": (lambda v: is_number(v) and 0 <= v < math.inf, "a finite number >= 0 (0 = greedy)"),
            "top_k": (lambda v: is_int(v, 0), "an integer >= 0 (0 = all)"),
            "top_p": (lambda v: is_number(v) and 0 < v <= 1, "in (0, 1]"),
            "stop": (lambda v: isinstance(v, list) and all(isinstance(s, str) and s for s in v), "non-empty strings"),
            "seed": (lambda v: is_int(v, -2**63) and v < 2**64,
                     "an integer in [-2**63, 2**64) (torch.Generator's range)")}


def check_sampling(values: list[tuple[str, str, object]]) -> None:
    """(key as the user wrote it, rule of SAMPLING, value) each: the first bad one is a ConfigError."""
    from mode.config import ConfigError

    for key, rule, value in values:
        ok, allowed = SAMPLING[rule]
        if not ok(value):
            raise ConfigError(key, value, allowed)


@dataclass
class Trace:
    tokens_BT: torch.Tensor
    """[B, T + 1] every row's tokens by position (prompt, then samples), zero-padded."""
    logits_BTV: torch.Tensor
    """[B, T, V] the logits each position produced (fp32); NaN where valid_BT is False."""
    valid_BT: torch.Tensor
    """[B, T] positions the row computed: its prompt and its new tokens but the last."""


def _sample(logits_BV, temperature: float, top_k: int, gen: torch.Generator, top_p: float = 1.0) -> torch.Tensor:
    """temperature <= 0: greedy (argmax). Else softmax(logits / temperature) restricted to the
    top_k most likely ids (0 = all) and to the smallest set whose mass reaches top_p (1 = all)."""
    if temperature <= 0:
        return logits_BV.argmax(-1)
    if not math.isfinite(temperature):
        raise ValueError(f"temperature: a finite number, got {temperature}")
    # shifted so the largest is 0: a tiny temperature scales the rest towards -inf, never past the
    # float range to inf (whose softmax is NaN)
    logits_BV = (logits_BV - logits_BV.amax(-1, keepdim=True)) / temperature
    if 0 < top_k < logits_BV.shape[-1]:
        kth_B1 = logits_BV.topk(top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    if top_p < 1.0:
        sorted_BV, order_BV = logits_BV.sort(-1, descending=True)
        p_BV = sorted_BV.softmax(-1)
        drop_BV = p_BV.cumsum(-1) - p_BV >= top_p  # mass before this id already reaches top_p
        logits_BV = logits_BV.masked_fill(drop_BV.scatter(-1, order_BV, drop_BV), float("-inf"))
    return torch.multinomial(logits_BV.softmax(-1), 1, generator=gen)[:, 0]


def positions_needed(prompt_len: int, max_new_tokens: int) -> int:
    """Positions the model computes for a prompt and its new tokens (the last sample is not fed)."""
    return prompt_len + max_new_tokens - 1


def _stop_rows(stop, B: int) -> list[list[str]] | None:
    """Per-row stop strings: one list of strings shared by every row, or one list (or string) per
    row. None when no row has one."""
    if not stop:
        return None
    if isinstance(stop, str):  # one string, not its characters
        stop = [stop]
    if all(isinstance(s, str) for s in stop):
        rows = [list(stop)] * B
    else:
        if len(stop) != B:
            raise ValueError(f"stop: one list of strings per prompt ({B}), got {len(stop)}")
        rows = [[s] if isinstance(s, str) else list(s or []) for s in stop]
    if any(not isinstance(s, str) or not s for r in rows for s in r):
        raise ValueError("stop strings must be non-empty strings")
    return rows if any(rows) else None


def cut_at_stop(text: str, stop: list[str]) -> str:
    """`text` before the earliest occurrence of any of the `stop` strings (all of it if none)."""
    return text[: min((text.find(s) for s in stop if s in text), default=len(text))]


@torch.no_grad()
def generate_ids(model: LM, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
                 top_k: int = 0, seed: int = 0, eos_id: int | None = None, vocab_limit: int | None = None,
                 return_trace: bool = False, top_p: float = 1.0, prefill: bool = True,
                 stop: list[str] | list[list[str]] | None = None, decode=None):
    """Sample up to `max_new_tokens` after each prompt. temperature <= 0 is greedy; top_k 0 and
    top_p 1.0 keep the whole vocabulary; `vocab_limit` masks logits of ids the tokenizer cannot
    decode. Returns the new ids per row (and a Trace).

    A row finishes at `eos_id` (not included) or as soon as `decode(its new ids)` contains one of
    its `stop` strings (one list for all rows, or one list per row; ids through the token that
    completed it are returned: cut the text with `cut_at_stop`). A stop string may span several
    tokens or sit inside one. A finished row leaves the batch (its caches are dropped), so it costs
    no further compute, and the loop ends when every row has finished. The other rows' tokens are
    the same as without stopping, also when sampling (every step draws for all B rows)."""
    if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token")
    dev = next(model.parameters()).device
    B, n = len(prompt_ids), max_new_tokens
    if n <= 0:
        return ([[] for _ in prompt_ids], None) if return_trace else [[] for _ in prompt_ids]
    stops = _stop_rows(stop, B)
    if stops is not None and decode is None:
        raise ValueError("stop strings need `decode` (token ids -> text), e.g. tokenizer.decode")
    lens = [len(p) for p in prompt_ids]
    P = max(lens)
    T = max(positions_needed(m, n) for m in lens)
    if T > model.cfg.max_seq_len:
        raise ValueError(f"prompt + max_new_tokens needs {T} positions > model.max_seq_len={model.cfg.max_seq_len}")
    len_B = torch.tensor(lens, device=dev)
    tokens_BT = torch.zeros(B, T + 1, dtype=torch.long, device=dev)
    for i, p in enumerate(prompt_ids):
        tokens_BT[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    rows_B = torch.arange(B, device=dev)
    n_new_B = torch.full((B,), n, dtype=torch.long, device=dev)  # new tokens per row (a finished row: fewer)
    logits_BTV = None
    was_training = model.training
    model.eval()
    gen = torch.Generator(device=dev).manual_seed(seed)

    def pick(logits_AV, act_A):
        """Next token of the A active rows (original rows act_A)."""
        logits_AV = logits_AV.float()
        if vocab_limit is not None:
            logits_AV = logits_AV[:, :vocab_limit]
        if temperature > 0 and act_A.shape[0] < B:
            # Finished rows draw from a placeholder: the generator advances as with all B rows.
            full_BV = logits_AV.new_zeros(B, logits_AV.shape[-1]).index_copy(0, act_A, logits_AV)
            return _sample(full_BV, temperature, top_k, gen, top_p).index_select(0, act_A)
        return _sample(logits_AV, temperature, top_k, gen, top_p)

    def record(act_A, pos_AS, logits_ASV):
        nonlocal logits_BTV
        if return_trace:
            if logits_BTV is None:
                logits_BTV = torch.full((B, T, logits_ASV.shape[-1]), float("nan"), device=dev)
            logits_BTV[act_A[:, None], pos_AS] = logits_ASV.float()

    try:
        if prefill:
            caches = model.new_caches(B, P + n - 1)
            valid_BP = None if min(lens) == P else torch.arange(P, device=dev)[None] < len_B[:, None]
            out = model(tokens_BT[:, :P], routing="causal", caches=caches, valid_BS=valid_BP)
            record(rows_B, torch.arange(P, device=dev).expand(B, P), out.logits)
            # The A rows still being extended: original row ids (device, and host for stop strings).
            act_A, len_A = rows_B, len_B
            act = list(range(B))
            new_ids = [[] for _ in range(B)]  # host copy of the new ids of rows with stop strings
            next_A = pick(out.logits[rows_B, len_B - 1], act_A)
            for j in range(n):
                pos_A = len_A + j  # where the sample goes; decoded as the next step's input
                tokens_BT[act_A, pos_A] = next_A
                if j == n - 1:
                    break
                if eos_id is not None or stops is not None:
                    fin_A = next_A == eos_id if eos_id is not None else torch.zeros_like(act_A, dtype=torch.bool)
                    if stops is not None:  # host: the text of a row's new tokens (one sync per step)
                        hit = _stop_hits(act, next_A.tolist(), stops, new_ids, decode)
                        if hit:
                            fin_A[hit] = True
                    if bool(fin_A.any()):  # host sync: the batch shrinks
                        n_new_B[act_A[fin_A]] = j + 1
                        keep_A = (~fin_A).nonzero()[:, 0]
                        if keep_A.numel() == 0:
                            break
                        act_A, len_A, next_A = act_A[keep_A], len_A[keep_A], next_A[keep_A]
                        for c in caches:
                            c.keep_rows(keep_A)
                        act = act_A.tolist()
                        pos_A = len_A + j
                out = model(next_A[:, None], routing="causal", pos_BS=pos_A[:, None], caches=caches)
                record(act_A, pos_A[:, None], out.logits)
                next_A = pick(out.logits[:, 0], act_A)
        else:  # step by step: rows in lockstep, row i feeds its prompt token t while t < len_i
            caches = model.new_caches(B, T)
            for t in range(T):
                pos_B1 = torch.full((B, 1), t, dtype=torch.long, device=dev)
                out = model(tokens_BT[:, t : t + 1], routing="causal", pos_BS=pos_B1, caches=caches)
                record(rows_B, pos_B1, out.logits)
                next_B = pick(out.logits[:, 0], rows_B)
                tokens_BT[:, t + 1] = torch.where(t + 1 < len_B, tokens_BT[:, t + 1], next_B)
    finally:
        model.train(was_training)
    out_ids = []
    for i, (p, m) in enumerate(zip(prompt_ids, n_new_B.tolist())):
        new = tokens_BT[i, len(p) : len(p) + m].tolist()
        if eos_id is not None and eos_id in new:
            new = new[: new.index(eos_id)]
        if not prefill and stops is not None and stops[i]:  # the reference path runs to the end, then cuts
            new = new[: _stop_len(decode, new, stops[i])]
        out_ids.append(new)
    if return_trace:
        valid_BT = torch.arange(T, device=dev)[None] < (len_B + n_new_B - 1)[:, None]
        if logits_BTV is not None:
            logits_BTV[~valid_BT] = float("nan")  # prefill padding, steps after a row's last token
        return out_ids, Trace(tokens_BT, logits_BTV, valid_BT)
    return out_ids


def _stop_hits(act: list[int], tok_A: list[int], stops: list[list[str]], new_ids: list[list[int]], decode) -> list[int]:
    """Append each active row's new token to its host copy (rows with stop strings only) and return
    the active positions whose decoded new text now holds one of the row's stop strings."""
    hit = []
    for a, r in enumerate(act):
        if stops[r]:
            new_ids[r].append(tok_A[a])
            if any(s in decode(new_ids[r]) for s in stops[r]):
                hit.append(a)
    return hit


def _stop_len(decode, ids: list[int], stop: list[str]) -> int:
    """Tokens through the first one whose text completes a stop string (all of them if none)."""
    if not any(s in decode(ids) for s in stop):
        return len(ids)
    return next(m for m in range(1, len(ids) + 1) if any(s in decode(ids[:m]) for s in stop))


@dataclass
class Completion:
    prompt: str
    completion: str
    """The sampled text, cut before the first stop string (or the EOS)."""
    num_tokens: int
    """New tokens the completion took (through the one that completed a stop string)."""


def complete(model: LM, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float = 1.0,
             top_k: int = 0, seed: int = 0, top_p: float = 1.0, stop: list[str] | None = None) -> list[Completion]:
    """Text in, Completions out. Each prompt is preceded by the tokenizer's EOS: training packs
    documents with EOS between them, so it marks 'a document starts here' (and lets an empty
    prompt sample from scratch). A row stops at the EOS or as soon as its text holds one of the
    `stop` strings; the completion is cut before it."""
    eos = tokenizer.eos_id
    ids = [[eos] + [int(i) for i in tokenizer.encode(p)] for p in prompts]
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    out = generate_ids(model, ids, max_new_tokens, temperature, top_k, seed, eos_id=eos,
                       vocab_limit=min(tokenizer.vocab_size, model.cfg.vocab_size), top_p=top_p, stop=stop,
                       decode=tokenizer.decode)
    return [Completion(p, cut_at_stop(tokenizer.decode(o), stop), len(o)) for p, o in zip(prompts, out)]


def generate(model: LM, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float = 1.0,
             top_k: int = 0, seed: int = 0, top_p: float = 1.0, stop: list[str] | None = None) -> list[str]:
    """The completions of `complete` as strings (temperature 0 = greedy)."""
    return [c.completion for c in complete(model, tokenizer, prompts, max_new_tokens, temperature, top_k, seed,
                                           top_p, stop)]


# ----------------------------------------------------------------------------------------------
# Loading a trained run.


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """Newest checkpoint dir of a run holding model.pt that verifies (resume's rule: one without a
    manifest never finished its save); mode/checkpoint.py `newest_weights`, which owns the layout. A
    damaged newer one is reported in one line and skipped (left in place: sampling never changes a
    run); CheckpointError when none verifies, None when the run has none."""
    from mode.checkpoint import newest_weights

    return newest_weights(run_dir)


# Model keys that leave the trained function as it is (losses, init, training noise, sampling-time
# capacity, the MoE layers' implementation and layout): config.yaml may differ from the checkpoint's
# record in these. Any other model key would silently sample a different model from the same weights.
SAMPLING_FREE = ("model.init_std", "model.mod.aux_loss_weight", "model.mod.predictor_loss_weight",
                 "model.mod.threshold_momentum", "model.moe.jitter", "model.moe.lb_loss_weight",
                 "model.moe.z_loss_weight", "model.moe.eval_capacity_factor", "model.moe.inference_capacity_factor",
                 "model.moe.backend", "model.moe.ep_size")


def model_diff(trained: dict, cfg) -> list[str]:
    """`key: trained -> now` for the model keys (but SAMPLING_FREE) in which `cfg` differs from a
    checkpoint's recorded config."""
    return config_diff(trained, cfg.to_dict(), keep=lambda k: k.startswith("model.") and k not in SAMPLING_FREE)


def load_run(run_dir: str | Path, device: str | torch.device = "cpu", return_source: bool = False):
    """(model in eval mode, tokenizer, config) from a run directory (config.yaml and the newest
    complete checkpoint's plain state_dict, model.pt: no DeepSpeed needed) or from a directory
    written by `mode export` (config.yaml, model.safetensors, tokenizer/). With `return_source`, the
    file the weights came from is returned fourth. A missing run or checkpoint is a ConfigError."""
    from mode.checkpoint import CONFIG, MODEL, WEIGHTS_GLOB, CheckpointError, trained_config
    from mode.config import ConfigError, load_config
    from mode.data import build_tokenizer
    from mode.portable import TOKENIZER_DIR, WEIGHTS, file_sha256, is_export, load_weights

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
        # the stand-in only lets the config load: the config returned names the run's own data
        # (`mode export` writes it)
        import yaml

        data = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("data") or {}
        cfg.data.source = data.get("source", cfg.data.source)
        cfg.data.val_source = data.get("val_source", cfg.data.val_source)

    def check_model(trained: dict | None, where: str, record: str) -> None:
        diff = model_diff(trained, cfg) if trained else []  # None: written before the record existed
        if diff:  # config.yaml written back by hand: the weights load (same shapes) into another model
            raise ConfigError("--run", msg=f"--run={run_dir}: its config.yaml differs from the config {where} was "
                              f"trained with ({'; '.join(diff)}); write back the trained value ({record} holds it)")

    if exported:
        info = run_dir / "export.json"
        record = json.loads(info.read_text()) if info.is_file() else {}
        check_model(record.get("model") and {"model": record["model"]}, "the export", "its export.json")
        model = build_model(cfg.model)
        source = run_dir / WEIGHTS
        want = record.get("weights_sha256")  # (exports before it was recorded: not verified)
        if want is not None and file_sha256(source) != want:
            raise CheckpointError(f"{source} is damaged: its sha256 is not the one export.json recorded when it was "
                                  "written; export the run again")
        try:
            load_weights(model, source)
        except Exception as e:  # noqa: BLE001 - a damaged header (SafetensorError), other tensors (RuntimeError)
            raise CheckpointError(f"cannot read {source}: {type(e).__name__}: {' '.join(str(e).split())[:200]} "
                                  "(an export's weights do not match its config.yaml: export the run again)") from e
    else:
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None:
            raise ConfigError("--run", str(run_dir), f"a run with a complete checkpoint ({WEIGHTS_GLOB}): "
                              "none yet; train it first")
        check_model(trained_config(ckpt), f"checkpoint {ckpt.name}", f"the checkpoint's {CONFIG}")
        source = ckpt / MODEL
        try:  # it verified a moment ago: a failure now is a file changed since (or no state dict)
            state = torch.load(source, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch's reader raises RuntimeError, EOFError, UnpicklingError
            raise CheckpointError(f"cannot read {source}: {type(e).__name__}: {' '.join(str(e).split())[:200]}") from e
        state = state.get("module", state) if isinstance(state, dict) else state
        state = {k.removeprefix("module."): v for k, v in state.items()}
        if cfg.model.moe.backend == "deepspeed":  # its layers need torch.distributed: sample with native
            from mode.portable import deepspeed_moe_to_native

            cfg, state = deepspeed_moe_to_native(cfg, state, ckpt)
        elif cfg.model.moe.backend == "megablocks":  # CUDA-only layers: sample, evaluate, export with native
            from mode.portable import megablocks_to_native

            cfg, state = megablocks_to_native(cfg, state)
        model = build_model(cfg.model)
        model.load_state_dict(state)
    out = (model.to(device).eval(), build_tokenizer(cfg.data), cfg)
    return (*out, source) if return_source else out


def rows_independent(model, routing: str) -> bool:
    """True when a row's log-probs do not depend on the other rows (or the trailing padding) of its
    batch: causal routing decides each token from its own row's prefix, and expert layers at
    sampling time are capped only by `inference_capacity_factor` (null = dropless; a value makes
    the batch's rows share expert slots). A dense model's rows are independent under either routing."""
    plan = layer_plan(model.cfg)
    if routing != "causal":  # top-k over the sequence: padding and length change who is selected
        return not has_depth_routing(plan) and not has_moe(plan)
    return not has_moe(plan) or model.cfg.moe.inference_capacity_factor is None


def cli_generate(run_dir: str, prompts: list[str], max_new_tokens: int, temperature: float = 1.0,
                 seed: int = 0, top_k: int = 0, top_p: float = 1.0, stop: list[str] | None = None,
                 completions: bool = False):
    """What `mode generate --run RUN_DIR --prompt TEXT` does: the prompt followed by its sample
    (or, with `completions`, the Completion objects). A prompt longer than the model allows is a
    ConfigError that names the limit."""
    from mode.config import ConfigError

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if max_new_tokens < 0:
        raise ConfigError("--max-new-tokens", max_new_tokens, ">= 0")
    model, tok, _ = load_run(run_dir, device)
    if len(prompts) > 1 and not rows_independent(model, "causal"):
        print(f"warning: model.moe.inference_capacity_factor={model.cfg.moe.inference_capacity_factor}: the prompts "
              "of this batch share expert slots, so a prompt's output depends on the others (null: dropless, "
              "each prompt as if alone)", file=sys.stderr, flush=True)
    limit = model.cfg.max_seq_len
    n_tok = [1 + len(tok.encode(p)) for p in prompts]  # the EOS that starts a document, then the prompt
    i = max(range(len(prompts)), key=n_tok.__getitem__, default=None)  # the longest prompt decides
    if i is not None and n_tok[i] > limit:  # too long whatever the count
        p = prompts[i]
        raise ConfigError("--prompt", p if len(p) <= 40 else p[:37] + "...", msg=None,
                          allowed=f"at most {limit} tokens with the leading EOS (the model's max_seq_len): prompt "
                                  f"{i} has {n_tok[i]}")
    if i is not None and positions_needed(n_tok[i], max_new_tokens) > limit:
        raise ConfigError("--max-new-tokens", max_new_tokens, msg=None,
                          allowed=f"at most {limit + 1 - n_tok[i]}: prompt {i}, the longest, has {n_tok[i]} tokens "
                                  f"(with the leading EOS), and prompt + new tokens - 1 <= the model's "
                                  f"max_seq_len={limit} (or shorten that prompt)")
    out = complete(model, tok, prompts, max_new_tokens, temperature, top_k, seed, top_p, stop)
    return out if completions else [c.prompt + c.completion for c in out]

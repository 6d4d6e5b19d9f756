"""Typed configuration: nested dataclasses are the schema; YAML and `a.b.c=value` overrides fill them.

Every field carries a docstring (the string literal right after it) that the README's config
reference is generated from (`python -m mode.config --markdown`). Validation raises
`ConfigError`, whose message is one line: `config error: <key>=<value>: <what is allowed>`.
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
import os
import re
import sys
import textwrap
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Union

import yaml


# a variant name: it names a run directory (mode compare) and report figure files
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class ConfigError(ValueError):
    """A bad config value; the message is the whole user-facing line."""

    def __init__(self, key: str, value: Any = None, allowed: str = "", msg: str | None = None):
        self.key, self.allowed = key, allowed
        text = msg if msg is not None else f"{key}={value!r}: {allowed}"
        super().__init__(f"config error: {text}")


BLANK = "a non-empty path (an unset shell variable?)"


def refuse_blank(key: str, value, allowed: str = BLANK) -> None:
    """`--out "$DIR"` with DIR unset passes "": read as the option not given (or Path("") as the current
    directory), it sent output to a default place or read the wrong file. None (not given) passes."""
    if value is not None and not str(value).strip():
        raise ConfigError(key, value, allowed)


def is_int(v, least: float = -math.inf) -> bool:
    """An integer >= least, never a bool (True is an int to Python: `num_nodes: true` is not 1 node).
    The one spelling of the check: every config, manifest and option reader uses it."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def is_number(v) -> bool:
    """An int or a float, never a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def user_path(p: str, key: str) -> str:
    """A path as the user wrote it, `~` expanded and `.`/`..` folded (lexically): every check and
    every write then name one directory. Unfolded, `runs/x/..` was checked as a directory that does
    not exist (so no check applied), then its parents were made and the run written into `runs`.
    `~name/...` of no user of this machine is refused under `key` (pathlib raised a bare RuntimeError)."""
    if not p.strip():
        return p
    out = os.path.expanduser(p)
    if out.startswith("~"):
        raise ConfigError(key, p, "a path whose ~user names a user of this machine")
    return os.path.normpath(out)


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(key, value, allowed)


# Keys (dotted prefixes) that change how a run is executed, where it lives, how it logs, saves and
# reads its data, never what it computes: a run may be resumed with other values (mode/train.py),
# and `mode analyze` averages runs that differ only in these and the seed (analysis/tb.py).
EXECUTION_KEYS = ("run.", "log.", "checkpoint.", "perf.", "train.stop_at", "train.log_every", "train.eval_every",
                  "train.allow_schedule_change", "train.nonfinite", "train.max_consecutive_nonfinite",
                  "data.num_workers", "data.prepared_dir", "data.shard_tokens", "train.activation_checkpointing",
                  "train.compile")


def flatten(d: dict, prefix: str = "") -> dict:
    """Nested config dict -> {"a.b.c": value} (the dotted keys overrides and diffs use)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def config_diff(old: dict, new: dict, keep=lambda key: True) -> list[str]:
    """`key: old -> new` for each dotted key `keep` accepts in which two config dicts differ. A key
    added to the schema after `old` was saved reads as its default: an older run still matches
    unless the new key is set to something else."""
    a = {**flatten(Config().to_dict()), **flatten(old)}
    b = flatten(new)
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if keep(k) and a.get(k) != b.get(k)]


LayerSpec = Union[str, List[int]]
LAYER_SPECS = ("none", "every", "every_other")


def resolve_layers(spec: LayerSpec, n_layers: int) -> List[int]:
    """`none` | `every` | `every_other` (odd layers: the first block stays dense) | explicit indices."""
    if isinstance(spec, list):
        return sorted(set(spec))
    start, step = {"none": (n_layers, 1), "every": (0, 1), "every_other": (1, 2)}[spec]
    return list(range(start, n_layers, step))


def _check_layers(spec: LayerSpec, key: str, n_layers: int) -> None:
    if isinstance(spec, str):
        _check(spec in LAYER_SPECS, key, spec, f"one of {', '.join(LAYER_SPECS)} or a list of layer indices")
        # a preset's `every_other` on a 1-layer model would silently train (and be labelled) a dense model
        _check(spec != "every_other" or n_layers >= 2, key, spec,
               f"none, every or a list of layer indices with model.n_layers={n_layers} (every_other routes no layer)")
    else:
        _check(all(0 <= i < n_layers for i in spec), key, spec, f"layer indices in [0, {n_layers})")


Capacity = Union[float, List[float]]


@dataclass
class ModConfig:
    layers: LayerSpec = "none"
    """Blocks wrapped in depth routing: `none`, `every`, `every_other` (layers 1, 3, ...), or a list of layer indices."""
    capacity: Capacity = 0.125
    """Fraction of the sequence each routed block processes: k = max(1, round(capacity * S)), Python's round (a half goes to the even integer: 0.125 * 20 -> 2); in (0, 1]. A list gives one value per routed layer (a per-layer schedule), paired with the routed layers in increasing order (an explicit `layers` list must then be in increasing order)."""
    decoupled: bool = False
    """Route attention and MLP separately, each with its own router and capacity (attn_capacity, mlp_capacity) instead of the whole block; refused when `layers` routes no layer."""
    attn_capacity: Optional[Capacity] = None
    """With decoupled: capacity of the attention router (a fraction or one per routed layer); null = capacity."""
    mlp_capacity: Optional[Capacity] = None
    """With decoupled: capacity of the MLP router (a fraction or one per routed layer); null = capacity."""
    kv: str = "selected"
    """Keys/values of routed attention: `selected` (only processed tokens compute Q, K, V: the paper) or `all` (every token gives K/V, only selected tokens compute queries and take the update; at decode every token appends K/V); `all` is refused when `layers` routes no layer."""
    gate: str = "identity"
    """g(r) multiplying the block's update of selected tokens: `identity` (paper: x + r * f(x)) or `sigmoid` (refused when `layers` routes no layer)."""
    routing: str = "learned"
    """`learned` top-k on router scores, or `stochastic` (random top-k: the paper's control; refused when `layers` routes no layer)."""
    causal: str = "predictor"
    """Causal routing for sampling: `aux_loss` (BCE on router logits), `predictor` (stop-gradient MLP), `both`, `threshold` (process tokens whose router score exceeds a running average of the k-th largest score seen in training), or `none` (sign of the router score)."""
    aux_loss_weight: float = 0.01
    """Weight of the router BCE loss (used when causal is aux_loss or both)."""
    predictor_loss_weight: float = 1.0
    """Weight of the predictor BCE loss; it only trains the predictor (its input is detached, and its own optimizer clips it by its own norm: the LM's update is the same at any weight)."""
    predictor_hidden: int = 0
    """Predictor MLP hidden width; 0 means d_model // 2."""
    threshold_momentum: float = 0.99
    """With causal: threshold, the EMA momentum of the per-layer threshold (mean over rows of the k-th largest router score, updated every training micro-step, averaged over data-parallel ranks; a checkpointed buffer)."""

    def validate(self, n_layers: int) -> None:
        _check_layers(self.layers, "model.mod.layers", n_layers)
        n_routed = len(resolve_layers(self.layers, n_layers))
        for name in ("capacity", "attn_capacity", "mlp_capacity"):
            v = getattr(self, name)
            if v is None:
                continue
            key = f"model.mod.{name}"
            if isinstance(v, list):
                _check(len(v) == n_routed, key, v, f"a fraction or a list of {n_routed} (one per routed layer)")
                # the list pairs with the routed layers in increasing order: [3, 1] would pair silently reversed
                _check(not isinstance(self.layers, list) or self.layers == sorted(set(self.layers)),
                       "model.mod.layers", self.layers, f"distinct layer indices in increasing order when {key} "
                       "is a list (its values pair with the routed layers in that order)")
            _check(all(0.0 < c <= 1.0 for c in (v if isinstance(v, list) else [v])), key, v,
                   "a fraction in (0, 1] (or a list of them, one per routed layer)")
            if name != "capacity" and not self.decoupled:
                _check(False, key, v, "null unless model.mod.decoupled is true")
        _check(self.kv in ("selected", "all"), "model.mod.kv", self.kv, "selected or all")
        _check(self.gate in ("identity", "sigmoid"), "model.mod.gate", self.gate, "identity or sigmoid")
        _check(self.routing in ("learned", "stochastic"), "model.mod.routing", self.routing, "learned or stochastic")
        _check(self.causal in ("aux_loss", "predictor", "both", "threshold", "none"), "model.mod.causal", self.causal,
               "aux_loss, predictor, both, threshold or none")
        _check(0.0 <= self.threshold_momentum < 1.0, "model.mod.threshold_momentum", self.threshold_momentum,
               "in [0, 1)")
        _check(self.aux_loss_weight >= 0, "model.mod.aux_loss_weight", self.aux_loss_weight, ">= 0")
        _check(self.predictor_loss_weight >= 0, "model.mod.predictor_loss_weight", self.predictor_loss_weight, ">= 0")
        _check(self.predictor_hidden >= 0, "model.mod.predictor_hidden", self.predictor_hidden, ">= 0")
        # A variant key that changes what a depth-routed layer computes, set with no such layer, would
        # train a dense model under the variant's name: refused. (capacity, causal and the loss weights
        # are left alone: they are --match's knob and sampling/loss settings a grid may share.)
        if not n_routed:
            for name, default, shown in (("kv", "selected", "selected"), ("decoupled", False, "false"),
                                         ("gate", "identity", "identity"), ("routing", "learned", "learned")):
                _check(getattr(self, name) == default, f"model.mod.{name}", getattr(self, name),
                       f"{shown} (the default) unless model.mod.layers names a depth-routed layer "
                       f"(model.mod.layers={self.layers!r} routes none)")
        if n_routed:  # a zero weight leaves the causal router untrained (the predictor's input is detached)
            for name, modes in (("aux_loss_weight", ("aux_loss", "both")),
                                ("predictor_loss_weight", ("predictor", "both"))):
                _check(self.causal not in modes or getattr(self, name) > 0, f"model.mod.{name}", getattr(self, name),
                       f"> 0 with model.mod.causal={self.causal} (it is that router's only training signal)")


@dataclass
class MoEConfig:
    layers: LayerSpec = "none"
    """Blocks whose MLP is a mixture of experts: `none`, `every`, `every_other` (layers 1, 3, ...), or a list."""
    num_experts: int = 8
    """E, the number of real (parameterised) experts."""
    num_noop_experts: int = 0
    """N parameter-free no-op experts (integrated MoDE): a route to one gives the token no MLP update; > 0 is refused when `layers` names no MoE layer."""
    top_k: int = 1
    """Experts per token (token-choice)."""
    d_expert: int = 0
    """Hidden width of each expert MLP; 0 means model.d_ff."""
    capacity_factor: Optional[float] = 1.0
    """Per-expert capacity ceil(capacity_factor * top_k * T / E) for T tokens, exactly (DeepSpeed's own gate rounds in float32: one slot more for some factors, e.g. 0.3); null = dropless. T is one micro-batch on one rank (micro_batch_size x seq_len), as in Switch, GShard and DeepSpeed: changing the micro-batch / grad_accum split changes which routes drop (dense models are invariant to it)."""
    eval_capacity_factor: Optional[float] = None
    """Capacity factor in eval mode under training-time routing (eval/loss); null = same as capacity_factor."""
    inference_capacity_factor: Optional[float] = None
    """Capacity factor at sampling time (generation and eval/loss_causal); null = dropless, so a token's experts depend only on the token. A value makes a prompt's output depend on the other prompts of its batch (capacity is shared by the tokens of one call) and, where a whole sequence is one call (eval/loss_causal, `mode eval`, prefill), a token's experts on later tokens: that scoring is no longer causal."""
    min_capacity: int = 0
    """Lower bound on the per-expert capacity (DeepSpeed's min_capacity)."""
    drop_policy: str = "position"
    """Which overflow routes are dropped: `position` (top-1 choices first, then earlier tokens) or `probability`."""
    normalize_weights: bool = True
    """Renormalise the top-k probabilities to sum to 1 (top_k > 1); the no-op routes count in the sum."""
    renormalize_after_drop: bool = False
    """With normalize_weights: renormalise over the routes that survive capacity (DeepSpeed's stock gate) instead of over the top-k."""
    noop_balance: str = "exclude"
    """Load balancing with no-op experts: `exclude` (balance the real experts only; the no-op share is left to the LM loss) or `include` (balance over all E + N outputs, AdaMoE-style, so ~N/(E+N) of routes go to no-ops)."""
    jitter: float = 0.0
    """Multiplicative input jitter epsilon on the router input during training (Switch); 0 = off."""
    lb_loss_weight: float = 0.01
    """Load-balancing loss weight: E * sum_e f_e * P_e over real experts, per micro-batch on each rank (as Switch and DeepSpeed; not over the global batch)."""
    z_loss_weight: float = 0.0
    """Router z-loss weight: mean(logsumexp(logits)^2)."""
    backend: str = "native"
    """Expert implementation: `native` (PyTorch, reference), `deepspeed` (deepspeed.moe, expert parallel), `megablocks` (CUDA)."""
    ep_size: int = 1
    """Expert-parallel size (deepspeed backend): divides the world size and num_experts."""

    def validate(self, n_layers: int) -> None:
        k = "model.moe."
        _check_layers(self.layers, k + "layers", n_layers)
        _check(self.num_experts >= 1, k + "num_experts", self.num_experts, ">= 1")
        _check(self.num_noop_experts >= 0, k + "num_noop_experts", self.num_noop_experts, ">= 0")
        _check(1 <= self.top_k <= self.num_experts + self.num_noop_experts, k + "top_k", self.top_k,
               f"1 <= top_k <= num_experts + num_noop_experts = {self.num_experts + self.num_noop_experts}")
        _check(self.d_expert >= 0, k + "d_expert", self.d_expert, ">= 0")
        for name, null in (("capacity_factor", "dropless"), ("eval_capacity_factor", "as capacity_factor"),
                           ("inference_capacity_factor", "dropless")):
            v = getattr(self, name)
            # capacity saturates at num_experts / top_k (nothing dropped); the bound keeps DeepSpeed's float32 finite
            _check(v is None or 0 < v <= 1e6, k + name, v, f"null ({null}) or in (0, 1e6]")
        _check(self.min_capacity >= 0, k + "min_capacity", self.min_capacity, ">= 0")
        _check(self.drop_policy in ("position", "probability"), k + "drop_policy", self.drop_policy,
               "position or probability")
        _check(self.noop_balance in ("exclude", "include"), k + "noop_balance", self.noop_balance, "exclude or include")
        _check(0 <= self.jitter < 1, k + "jitter", self.jitter,
               "in [0, 1) (the router input is scaled by U(1 - jitter, 1 + jitter))")
        _check(self.lb_loss_weight >= 0, k + "lb_loss_weight", self.lb_loss_weight, ">= 0")
        _check(self.z_loss_weight >= 0, k + "z_loss_weight", self.z_loss_weight, ">= 0")
        _check(self.backend in ("native", "deepspeed", "megablocks"), k + "backend", self.backend,
               "native, deepspeed or megablocks")
        _check(self.ep_size >= 1 and self.num_experts % self.ep_size == 0, k + "ep_size", self.ep_size,
               f"a divisor of num_experts={self.num_experts}")
        if self.backend != "deepspeed":
            _check(self.ep_size == 1, k + "ep_size", self.ep_size, "1 unless backend is deepspeed")
        # No-op experts with no MoE layer would train (and label) a dense model as integrated MoDE: refused.
        # (The backend, capacities, noop_balance and loss weights are left alone: a grid may share them
        # with dense or MoE variants; `mode_integrated.yaml model.moe.num_noop_experts=0` is an ablation.)
        if not resolve_layers(self.layers, n_layers):
            _check(self.num_noop_experts == 0, k + "num_noop_experts", self.num_noop_experts,
                   f"0 unless model.moe.layers names an MoE layer (model.moe.layers={self.layers!r} names none)")
        # The deepspeed and megablocks backends execute OUR router's decisions (mode/moe/*): every
        # routing option (no-op experts, z-loss, drop policy, weights) applies to all backends.


@dataclass
class ModelConfig:
    vocab_size: int = 320
    """Embedding rows; >= the tokenizer's vocabulary (byte tokenizer: 257). Rounded sizes are faster."""
    d_model: int = 128
    """Residual stream width."""
    n_layers: int = 4
    """Number of blocks."""
    n_heads: int = 4
    """Attention heads; divides d_model."""
    d_ff: int = 512
    """Hidden width of the dense MLP."""
    mlp: str = "swiglu"
    """MLP kind: `swiglu` or `gelu`."""
    max_seq_len: int = 2048
    """Largest position the rotary table covers (training sequence length and generation length)."""
    rope_theta: float = 10000.0
    """Rotary base; > 0."""
    tie_embeddings: bool = True
    """Share the token embedding with the output head."""
    init_std: float = 0.02
    """Std of the normal init; residual output projections are scaled by 1/sqrt(2 * n_layers)."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon; > 0."""
    mod: ModConfig = field(default_factory=ModConfig)
    """Mixture-of-Depths routing."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-Experts MLPs."""

    def validate(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            _check(getattr(self, name) >= 1, f"model.{name}", getattr(self, name), ">= 1")
        _check(self.d_model % self.n_heads == 0 and (self.d_model // self.n_heads) % 2 == 0, "model.n_heads",
               self.n_heads, f"a divisor of d_model={self.d_model} leaving an even head size")
        _check(self.mlp in ("swiglu", "gelu"), "model.mlp", self.mlp, "swiglu or gelu")
        _check(self.init_std > 0, "model.init_std", self.init_std, "> 0")
        _check(self.rope_theta > 0, "model.rope_theta", self.rope_theta, "> 0")
        _check(self.norm_eps > 0, "model.norm_eps", self.norm_eps, "> 0")
        self.mod.validate(self.n_layers)
        self.moe.validate(self.n_layers)


@dataclass
class DataConfig:
    source: str = "stdlib"
    """`stdlib` (the running interpreter's standard-library sources: always on disk), a local file/dir/glob, or a hub dataset name (streamed)."""
    format: str = "auto"
    """Local file format: `auto` (from the extension: .json/.jsonl, .parquet, .csv, .tsv, anything else text), `text`, `json` (also jsonl), `parquet`, `csv` or `tsv` (tab-separated); json/parquet/csv/tsv read the column data.text_key."""
    text_key: str = "text"
    """Column holding the document text (json/parquet/csv/tsv/hub)."""
    hub_split: str = "train"
    """Split to read from a hub dataset."""
    hub_config: str = ""
    """Configuration (subset) name of a hub dataset, passed to `datasets.load_dataset` as `name=` (e.g. `wikitext-103-raw-v1`, c4's `en`); also selects a config of a local dataset repository directory (a clone whose README.md lists `configs:`); empty = the dataset's default config."""
    sample_by: str = "document"
    """How a text file becomes documents (the `datasets` text builder): `document` (a whole file), `paragraph` (blocks separated by a blank line) or `line`."""
    val_source: str = ""
    """Validation documents of their own: a local file/dir/glob, or a split name of the hub source (e.g. `validation`); never trained on. Empty = hold out val_fraction of the source's documents."""
    tokenizer: str = "byte"
    """`byte` (UTF-8 bytes + EOS, no download), a local directory holding tokenizer.json, a tokenizer.json file, or a hub tokenizer name present in the local Hugging Face cache (offline)."""
    eos_token: str = ""
    """End-of-document token (a token string of the tokenizer) when the tokenizer has no recognised one; empty = recognise it."""
    seq_len: int = 128
    """Tokens per training sequence."""
    val_fraction: float = 0.05
    """Without val_source: fraction of documents held out for validation (every 1/val_fraction-th document, seeded offset)."""
    max_documents: int = 0
    """Use at most this many documents of each source (0 = all); keeps CPU runs small."""
    split_seed: int = 1234
    """Seed of the train/validation split and of the sampling order (same across variants)."""
    prepared_dir: str = "data/prepared"
    """Where tokenized shards live (`mode data prepare`); one subdirectory per data config, shared by every run that uses it."""
    num_workers: int = 0
    """Tokenizer processes of the prepare step; 0 = the cores this process may use (its CPU affinity, e.g. a SLURM allocation)."""
    shard_tokens: int = 268435456
    """Tokens per shard file of the prepare step (a shard ends at the end of the first encode batch past it: up to 4,096 documents or ~1 MB of text, so small values give larger shards); a killed prepare resumes after its last complete shard."""

    def __post_init__(self):
        self.prepared_dir = user_path(self.prepared_dir, "data.prepared_dir")

    def validate(self) -> None:
        _check(self.format in ("auto", "text", "json", "parquet", "csv", "tsv"), "data.format", self.format,
               "auto, text, json, parquet, csv or tsv")
        _check(self.sample_by in ("document", "paragraph", "line"), "data.sample_by", self.sample_by,
               "document, paragraph or line")
        _check(self.seq_len >= 2, "data.seq_len", self.seq_len, ">= 2")
        _check(0.0 < self.val_fraction < 1.0, "data.val_fraction", self.val_fraction, "in (0, 1)")
        _check(self.max_documents >= 0, "data.max_documents", self.max_documents, ">= 0")
        _check(0 <= self.split_seed < 2**32, "data.split_seed", self.split_seed, "an integer in [0, 2**32)")
        _check(self.num_workers >= 0, "data.num_workers", self.num_workers, ">= 0 (0 = the machine's cores)")
        _check(self.shard_tokens >= 1, "data.shard_tokens", self.shard_tokens, ">= 1")
        _check(self.tokenizer != "byte" or not self.eos_token, "data.eos_token", self.eos_token,
               "empty with data.tokenizer=byte (its EOS is its own id 256)")
        _check(bool(self.prepared_dir), "data.prepared_dir", self.prepared_dir, "a directory path")
        _check(short_parts(self.prepared_dir), "data.prepared_dir", self.prepared_dir, SHORT_PARTS)
        for key, src in (("data.source", self.source), ("data.val_source", self.val_source)):
            if src and src != "stdlib" and looks_local(src):
                import glob
                _check(bool(glob.glob(os.path.expanduser(src))), key, src, "an existing file, directory or glob")
        if self.tokenizer != "byte" and looks_local(self.tokenizer):
            _check(Path(user_path(self.tokenizer, "data.tokenizer")).exists(), "data.tokenizer", self.tokenizer,
                   "`byte`, a local directory holding tokenizer.json, a tokenizer.json file, or a cached hub name")


SHORT_PARTS = "a path whose every component (file or directory name) is at most 255 bytes, the filesystem's limit"


def short_parts(path: str) -> bool:
    return all(len(part.encode("utf-8", "surrogateescape")) <= 255 for part in Path(os.path.expanduser(path)).parts)


def looks_local(s: str) -> bool:
    """A path or glob (as opposed to a hub name such as `org/name` or a split name)."""
    return (s.startswith((".", "/", "~")) or any(c in s for c in "*?[") or Path(s).exists()
            or (not _is_hub_name(s) and (os.sep in s or bool(Path(s).suffix))))


def _is_hub_name(s: str) -> bool:
    parts = s.split("/")  # a hub repo id, `org/name`: letters, digits, - _ . (never a space)
    return len(parts) == 2 and not Path(s).exists() and all(re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*", p)
                                                            for p in parts)


@dataclass
class TrainConfig:
    max_steps: int = 200
    """Optimizer steps to train for (sets the LR schedule's length)."""
    stop_at: int = 0
    """Stop (after a checkpoint) at this step without changing the schedule: time-boxed or preemptible jobs resume later; 0 = off."""
    seed: int = 0
    """Seed of model init and all training randomness (each rank adds its rank)."""
    micro_batch_size: int = 8
    """Sequences per rank per micro-step."""
    grad_accum: int = 1
    """Micro-steps per optimizer step; global batch = micro_batch_size * grad_accum * world_size."""
    eval_every: int = 50
    """Evaluate every N steps (and at the end); 0 = only at the end."""
    eval_batches: int = 4
    """Micro-batches per evaluation on each rank: an evaluation reads the first eval_batches × micro_batch_size × world-size windows of the validation split (the same ones every time; past the split's end it wraps around, and the start warns), so the world size changes how much is evaluated (`mode analyze` never averages runs of different world sizes)."""
    log_every: int = 10
    """Read metrics from the device, reduce across ranks and write TensorBoard every N steps."""
    nonfinite: str = "skip"
    """On a non-finite loss or gradient: `skip` the step (counted in train/skipped_steps) or `stop`."""
    max_consecutive_nonfinite: int = 5
    """With `skip`: stop after this many non-finite steps in a row (the count is checkpointed: a resume continues it)."""
    compile: bool = False
    """torch.compile each block (per-block, as torchtitan); off until it is faster everywhere it runs (benchmarks/RESULTS.md). Any ZeRO stage: the optimizer's parameter order keeps DeepSpeed's flat-buffer views 16-byte aligned (mode.engine.param_groups; at ZeRO 1/2 model.d_model must be a multiple of 8, and a run resumed from a checkpoint written before param_order.json is refused where its layout is not aligned)."""
    activation_checkpointing: str = "none"
    """`none`, or `block`: keep only each block's input for backward and recompute the block (less activation memory, ~1 extra forward)."""
    allow_schedule_change: bool = False
    """Resume a run whose LR schedule changes (train.max_steps, optim.lr, warmup, min_lr_ratio): the schedule is recomputed for the new values from the resumed step on (a new max_steps must exceed that step), and the change is printed and logged; without it such a resume is refused."""

    def validate(self) -> None:
        for name in ("max_steps", "micro_batch_size", "grad_accum", "eval_batches", "log_every",
                     "max_consecutive_nonfinite"):
            _check(getattr(self, name) >= 1, f"train.{name}", getattr(self, name), ">= 1")
        _check(self.stop_at >= 0, "train.stop_at", self.stop_at, ">= 0")
        _check(0 <= self.seed < 2**32, "train.seed", self.seed, "an integer in [0, 2**32)")  # seeds torch and numpy
        _check(self.eval_every >= 0, "train.eval_every", self.eval_every, ">= 0")
        _check(self.nonfinite in ("skip", "stop"), "train.nonfinite", self.nonfinite, "skip or stop")
        _check(self.activation_checkpointing in ("none", "block"), "train.activation_checkpointing",
               self.activation_checkpointing, "none or block")


@dataclass
class OptimConfig:
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """Cosine decays to lr * min_lr_ratio at max_steps."""
    warmup_steps: int = 20
    """Linear warmup steps."""
    weight_decay: float = 0.1
    """AdamW weight decay (not applied to norms, biases, embeddings or routers)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Global gradient-norm clipping (0 = off); the causal predictors are clipped apart, by their own norm."""

    def validate(self) -> None:
        _check(self.lr > 0, "optim.lr", self.lr, "> 0")
        _check(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", self.min_lr_ratio, "in [0, 1]")
        _check(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, ">= 0")
        _check(0 <= self.weight_decay * self.lr < 1, "optim.weight_decay", self.weight_decay,
               f">= 0 and < 1 / optim.lr = {1 / self.lr:.6g} (AdamW scales weights by 1 - lr * weight_decay each step)")
        _check(0 <= self.beta1 < 1, "optim.beta1", self.beta1, "in [0, 1)")
        _check(0 <= self.beta2 < 1, "optim.beta2", self.beta2, "in [0, 1)")
        _check(self.grad_clip >= 0, "optim.grad_clip", self.grad_clip, ">= 0")
        _check(self.eps > 0, "optim.eps", self.eps, "> 0")


@dataclass
class CheckpointConfig:
    every: int = 100
    """Save every N steps (and at the end); 0 = only at the end."""
    keep: int = 2
    """Complete checkpoints kept (older ones deleted)."""

    def validate(self) -> None:
        _check(self.every >= 0, "checkpoint.every", self.every, ">= 0")
        _check(self.keep >= 1, "checkpoint.keep", self.keep, ">= 1")


@dataclass
class LogConfig:
    progress: bool = True
    """tqdm progress bar on rank 0 when stdout and stderr are a terminal; otherwise (or when false) one plain line per log interval."""
    routing_dump: bool = False
    """At the end, write per-token routing decisions of one eval batch to run.dir/routing.pt."""
    wandb: bool = False
    """Also log to Weights & Biases (optional extra: `pip install -e '.[wandb]'`); TensorBoard and run.dir/metrics.jsonl are always written."""
    wandb_project: str = "mode"
    """W&B project name."""
    wandb_mode: str = "online"
    """W&B mode: `online`, or `offline` (no network; files under run.dir/wandb, upload later with `wandb sync`)."""

    def validate(self) -> None:
        _check(self.wandb_mode in ("online", "offline"), "log.wandb_mode", self.wandb_mode, "online or offline")


@dataclass
class PerfConfig:
    peak_tflops: float = 0.0
    """Peak TFLOP/s per device that perf/mfu divides by; 0 = the datasheet value for A100/H100/H200 at deepspeed.precision, on CPU the best matmul rate measured at start by this and earlier runs on the machine, in the dtype the step's GEMMs run in (bf16 on CPUs with bf16 kernels, else fp32; kept in the virtualenv: one busy moment cannot deflate it)."""

    def validate(self) -> None:
        _check(math.isfinite(self.peak_tflops) and self.peak_tflops >= 0, "perf.peak_tflops", self.peak_tflops,
               "a finite number >= 0 (0 = automatic)")


@dataclass
class DeepSpeedConfig:
    zero_stage: int = 0
    """ZeRO stage 0, 1 or 2 (3 is refused: DeepSpeed MoE does not support it)."""
    precision: str = "fp32"
    """`fp32` or `bf16` (bf16 weights/activations, fp32 master weights, optimizer states and routing; gradients summed over micro-steps and ranks in fp32 at ZeRO 1/2, in bf16 at ZeRO 0; on CPUs without bf16 units the GEMMs run in fp32)."""

    def validate(self) -> None:
        _check(self.zero_stage in (0, 1, 2), "deepspeed.zero_stage", self.zero_stage,
               "0, 1 or 2 (ZeRO-3 is not supported with MoE layers)")
        _check(self.precision in ("fp32", "bf16"), "deepspeed.precision", self.precision, "fp32 or bf16")


@dataclass
class RunConfig:
    dir: str = "runs/default"
    """Run directory (`~` expanded): holds tb/ (TensorBoard), checkpoints/ and config.yaml; an existing one is resumed. A directory holding files mode did not write is refused."""
    fresh: bool = False
    """Empty an existing run directory instead of resuming it (only one that holds nothing but a mode run's files)."""
    name: str = ""
    """Variant name (set by `mode compare`): letters, digits, `_ . -`; shown in reports and names their figure files."""

    def __post_init__(self):
        self.dir = user_path(self.dir, "run.dir")

    def validate(self) -> None:
        refuse_blank("run.dir", self.dir)
        _check(short_parts(self.dir), "run.dir", self.dir, SHORT_PARTS)
        # the report names figure files after it: a '/' would point them into a missing directory
        _check(not self.name or bool(NAME_RE.fullmatch(self.name)), "run.name", self.name,
               "empty or letters, digits, _ . - (starting with a letter or digit)")
        # file names are made of it (the report's entropy_vs_blocks_<name>#<k>.png): 255 bytes at most
        _check(len(self.name) <= 200, "run.name", self.name, "at most 200 characters (report file names hold it)")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The network."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus, tokenizer, packing."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Loop, batch, evaluation."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW and the warmup + cosine schedule."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint cadence."""
    log: LogConfig = field(default_factory=LogConfig)
    """Progress, loggers and dumps."""
    perf: PerfConfig = field(default_factory=PerfConfig)
    """Efficiency metrics (MFU)."""
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    """Engine options."""
    run: RunConfig = field(default_factory=RunConfig)
    """Where the run lives."""

    def validate(self, world_size: int | None = None) -> "Config":
        for f in dataclasses.fields(self):
            sub = getattr(self, f.name)
            if hasattr(sub, "validate"):
                sub.validate()
        _check(self.data.seq_len <= self.model.max_seq_len, "data.seq_len", self.data.seq_len,
               f"<= model.max_seq_len={self.model.max_seq_len}")
        moe = self.model.moe
        if moe.backend == "megablocks":
            _check(self.deepspeed.precision == "bf16", "deepspeed.precision", self.deepspeed.precision,
                   "bf16 with model.moe.backend=megablocks (its grouped GEMM is bf16-only)")
        if self.train.compile and self.deepspeed.zero_stage > 0:  # mode.engine.check_compile_alignment
            _check(self.model.d_model % 8 == 0, "model.d_model", self.model.d_model,
                   f"a multiple of 8 with train.compile=true at deepspeed.zero_stage={self.deepspeed.zero_stage} "
                   "(DeepSpeed's flat buffers put parameters of other sizes off the 16-byte alignment compiled "
                   "blocks assume on CUDA)")
        if world_size is not None and moe.backend == "deepspeed":
            _check(world_size % moe.ep_size == 0, "model.moe.ep_size", moe.ep_size,
                   f"a divisor of the world size {world_size}")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------------------------
# Loading: YAML with `base:` inheritance, dotted overrides, strict typed conversion.


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML silently keeps the last).
    Merge keys (`<<: *anchor`) stay allowed: a key written beside a merge overrides the merged one."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for k, _ in node.value:
            if k.tag == "tag:yaml.org,2002:merge":  # no constructor of its own; flatten_mapping resolves it
                continue
            key = self.construct_object(k, deep=deep)
            if not isinstance(key, (str, int, float, bool, type(None))):
                continue  # a list or mapping key (`? [1, 2]`): SafeLoader's own "unhashable key" error below
            if key in seen:  # `~:` twice too
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", k.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def parse_yaml(text: str):
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
    except ValueError as e:  # an integer of over 4,300 digits: Python refuses to convert it (not a YAMLError)
        raise yaml.constructor.ConstructorError(None, None, str(e)[:200]) from None


def _yaml_problem(e: yaml.YAMLError) -> str:
    return " ".join(str(e).split())


def read_yaml(path: str | os.PathLike, _chain: tuple = ()) -> dict:
    """Read a YAML config, resolving `base: other.yaml` (relative to the file) recursively."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("--config", str(path), "an existing YAML file")
    if path.resolve() in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, path.resolve()))
        raise ConfigError("base", msg=f"{path}: `base:` forms a cycle ({cycle})")
    try:
        raw = parse_yaml(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError("--config", msg=f"{path}: not UTF-8 text (byte {e.start}); a YAML config is expected")
    except yaml.YAMLError as e:
        raise ConfigError("--config", msg=f"{path}: not valid YAML ({_yaml_problem(e)})")
    if raw is None:
        raise ConfigError("--config", msg=f"{path}: empty; write at least one section (e.g. `base: ...` or `model:`)")
    if not isinstance(raw, dict):
        raise ConfigError("--config", msg=f"{path}: the top level must be a mapping")
    base = raw.pop("base", None)
    if base is None:
        return raw
    bases = base if isinstance(base, list) else [base]
    if not bases or not all(isinstance(b, str) and b for b in bases):
        raise ConfigError("base", base, "a path or a list of paths (relative to the file)")
    merged: dict = {}
    for b in bases:
        if not (path.parent / b).is_file():  # name the `base:` line, not --config (which exists)
            raise ConfigError("base", b, f"an existing YAML file, relative to {path} ({path.parent / b} is not one)")
        merged = _deep_merge(merged, read_yaml(path.parent / b, (*_chain, path.resolve())))
    return _deep_merge(merged, raw)


def apply_overrides(d: dict, overrides: List[str]) -> dict:
    d = dict(d)
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(ov, msg=f"override {ov!r}: expected dotted.key=value")
        key, val = ov.split("=", 1)
        node = d
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(key, msg=f"override {ov!r}: expected dotted.key=value")
        for i, p in enumerate(parts[:-1]):
            if not isinstance(node.get(p, {}), dict):
                raise ConfigError(key, msg=f"override {ov!r}: {'.'.join(parts[:i + 1])} is a value, not a section")
            node[p] = dict(node.get(p) or {})
            node = node[p]
        try:
            # a bare `~` on a command line is the home directory (run.dir=~), not YAML's null
            node[parts[-1]] = parse_yaml(val) if val not in ("", "~") else val
        except yaml.YAMLError as e:
            shown = val if len(val) <= 60 else f"{val[:40]}... ({len(val)} characters)"
            raise ConfigError(key, shown, f"a YAML value ({_yaml_problem(e)})") from None
    return d


def _type_name(tp: Any) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is Union:  # `Union` alone says nothing: spell the alternatives
        names = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(names + (["null"] if type(None) in args else []))
    if typing.get_origin(tp) in (list, List):
        return f"list of {_type_name(args[0])}"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`, allowing int -> float; raise ConfigError otherwise."""
    origin = typing.get_origin(tp)
    if origin is Union:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        shaped = None  # the refusal of the alternative the value has the shape of: its reason is the one
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, key)
            except ConfigError as e:
                if isinstance(value, list) == (typing.get_origin(a) in (list, List)):
                    shaped = shaped or e
        # e.g. `.nan` for a float-or-list field: "a finite number", not "a value of type float or list"
        if shaped is not None and shaped.allowed and not shaped.allowed.startswith("a value of type"):
            raise ConfigError(key, value, shaped.allowed)
        raise ConfigError(key, value, f"a value of type {_type_name(tp)}")
    if origin in (list, List):
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(key, value, f"a list of {_type_name(item)}")
        return [_convert(v, item, key) for v in value]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(key, value, "a mapping")
        return _build(tp, value, key + ".")
    if tp is float and is_int(value):
        try:
            value = float(value)
        except OverflowError:  # an integer past float's range (1e308)
            raise ConfigError(key, value, "a finite number") from None
    if tp is float and isinstance(value, str):  # YAML 1.1 reads `1e-3` (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if tp is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(key, value, "a finite number")
    if not (is_int(value) if tp is int else isinstance(value, tp)):
        raise ConfigError(key, value, f"a value of type {_type_name(tp)}")
    if tp is int and not -2**63 <= value < 2**63:  # torch and numpy take int64: larger fails after workers start
        raise ConfigError(key, value, "an integer in [-2**63, 2**63)")
    return value


def _build(cls: type, d: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in d.items():
        if not isinstance(k, str):  # YAML reads `1:`, `yes:` and `~:` as int, bool and None keys
            raise ConfigError(prefix + str(k), msg=f"unknown key {prefix}{k!r} (a {type(k).__name__}, not a "
                                                   f"name); allowed: {', '.join(names)}")
        if k not in names:
            close = difflib.get_close_matches(k, names, n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise ConfigError(prefix + k, msg=f"unknown key {prefix}{k}{hint}; allowed: {', '.join(names)}")
        kwargs[k] = _convert(v, hints[k], prefix + k)
    return cls(**kwargs)


def load_config(path: str | os.PathLike | None = None, overrides: List[str] | None = None,
                world_size: int | None = None) -> Config:
    """Resolve YAML (with `base:`) + `a.b=v` overrides into a validated Config."""
    refuse_blank("--config", path, "an existing YAML file (an unset shell variable?)")  # not the defaults
    d = read_yaml(path) if path is not None else {}
    return _build(Config, apply_overrides(d, list(overrides or []))).validate(world_size)


def typed_dict(d: dict) -> dict:
    """A config dict with its values typed as load_config types them (YAML 1.1 reads `1e-06`, no
    dot, as a string); as written when it does not build (a key this version does not know)."""
    try:
        return _build(Config, d).to_dict()
    except (ConfigError, TypeError):
        return d


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


# ----------------------------------------------------------------------------------------------
# Field docstrings -> README reference.


def field_docs(cls: type) -> dict:
    """Map field name -> the string literal that follows it in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            docs[a.target.id] = b.value.value
    return docs


def markdown_reference(cls: type = Config, prefix: str = "") -> str:
    lines = []
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    default = cls()
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            lines.append(f"\n**`{prefix}{f.name}`** — {docs.get(f.name, '')}\n")
            lines.append("| key | default | meaning |\n| --- | --- | --- |")
            lines.append(markdown_reference(tp, f"{prefix}{f.name}."))
        else:
            lines.append(f"| `{prefix}{f.name}` | `{getattr(default, f.name)!r}` | {docs.get(f.name, '')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if "--markdown" in sys.argv:
        print(markdown_reference())

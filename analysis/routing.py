"""Routing analysis of one eval batch (RUN/routing.pt): which blocks each token engaged.

The MoD paper observes that tokens which engage more blocks across depth tend to be those
whose next-token prediction has higher entropy. We measure it: per token, the number of
blocks engaged (`engaged` summed over layers) against the entropy of the model's prediction
at that token, as a binned plot and a Pearson coefficient; plus a layer x position heatmap
of the routing decisions for one sample sequence, labelled with its characters.

Dump layout (written by the trainer with log.routing_dump=true), shape legend L layers,
B batch rows, S positions:
    input_ids LongTensor[B, S]; engaged BoolTensor[L, B, S] (a token is engaged in a layer when
    its block ran on it: not routed out by depth routing and, in an MoE layer, at least one of its
    routes kept by a real expert — all of them dropped or sent to no-op experts is not engaged); entropy FloatTensor[B, S] (nats); text list[str];
    tokens list[list[str]] (each token decoded alone: heatmap labels for any tokenizer; optional).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

BYTE_EOS_ID = 256  # mode.data.ByteTokenizer.eos_id
_VISIBLE = {"\n": "⏎", "\t": "⇥", " ": "␣"}


@dataclass
class RoutingDump:
    input_ids_BS: np.ndarray  # int64 [B, S]
    engaged_LBS: np.ndarray  # bool [L, B, S]
    entropy_BS: np.ndarray  # float64 [B, S], nats
    text: list[str]
    tokens: list[list[str]] = field(default_factory=list)

    @property
    def n_layers(self) -> int:
        return self.engaged_LBS.shape[0]


def load_dump(path: str | Path) -> RoutingDump:
    """Read routing.pt into numpy arrays, checking the shapes agree."""
    import torch

    d = torch.load(str(path), map_location="cpu", weights_only=True)
    ids = d["input_ids"].long().numpy()
    engaged = d["engaged"].bool().numpy()
    entropy = d["entropy"].double().numpy()
    if engaged.ndim != 3 or engaged.shape[1:] != ids.shape or entropy.shape != ids.shape:
        raise ValueError(f"{path}: inconsistent shapes input_ids {ids.shape}, engaged {engaged.shape} "
                         f"(expected [L, *input_ids]), entropy {entropy.shape}")
    text = list(d.get("text") or [])
    return RoutingDump(ids, engaged, entropy, text, [list(r) for r in d.get("tokens") or []])


def try_load_dump(path: str | Path) -> RoutingDump | None:
    """load_dump, or None when the file is absent or unreadable (a run writing it right now,
    a dump from another version): the report goes on without it, with a warning."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        return load_dump(path)
    except Exception as e:  # noqa: BLE001 - torch.load raises many kinds on a partial file
        warnings.warn(f"skipping unreadable routing dump {path}: {type(e).__name__}: {e}")
        return None


def processed_frac_per_layer(dump: RoutingDump) -> np.ndarray:
    """[L] fraction of the batch's tokens each block processed."""
    return dump.engaged_LBS.reshape(dump.n_layers, -1).mean(axis=1)


@dataclass
class EngagementVsEntropy:
    """Per-token blocks engaged vs prediction entropy, summarised."""

    n_blocks_T: np.ndarray  # int [T], T = B * S tokens
    entropy_T: np.ndarray  # float [T], nats
    pearson_r: float  # nan when either side has no variation (e.g. a dense model)
    bins: list[tuple[int, int, float, float]]  # (blocks engaged, tokens, mean entropy, std entropy)
    n_layers: int


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.size < 2 or x.std() == 0 or y.std() == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def engagement_vs_entropy(dump: RoutingDump) -> EngagementVsEntropy:
    n_blocks_BS = dump.engaged_LBS.sum(axis=0)
    n_T, ent_T = n_blocks_BS.reshape(-1).astype(np.int64), dump.entropy_BS.reshape(-1)
    bins = []
    for k in np.unique(n_T):
        e = ent_T[n_T == k]
        bins.append((int(k), int(e.size), float(e.mean()), float(e.std())))
    return EngagementVsEntropy(n_T, ent_T, pearson(n_T, ent_T), bins, dump.n_layers)


def token_labels(ids_S: np.ndarray, byte_tokens: bool) -> list[str]:
    """One short label per token: the character for byte tokens (whitespace made visible,
    non-ASCII bytes as '·', end of document as '¶'), else the token id."""
    if not byte_tokens:
        return [str(int(i)) for i in ids_S]
    out = []
    for i in ids_S:
        i = int(i)
        if i == BYTE_EOS_ID:
            out.append("¶")
        elif 0 <= i < 128 and (chr(i).isprintable() or chr(i) in _VISIBLE):
            out.append(_VISIBLE.get(chr(i), chr(i)))
        else:
            out.append("·")
    return out


def text_labels(pieces: list[str], max_chars: int = 8) -> list[str]:
    """Labels from per-token text (any tokenizer): whitespace made visible, long pieces cut."""
    out = []
    for t in pieces:
        t = "".join(_VISIBLE.get(c, c) for c in t) or "∅"
        out.append(t if len(t) <= max_chars else t[:max_chars - 1] + "…")
    return out


def looks_like_bytes(dump: RoutingDump) -> bool:
    return dump.input_ids_BS.size > 0 and 0 <= dump.input_ids_BS.min() and dump.input_ids_BS.max() <= BYTE_EOS_ID


# ----------------------------------------------------------------------------------------------
# Figures.


def plot_engagement_vs_entropy(stats: EngagementVsEntropy, path: str | Path, title: str = "") -> Path:
    """Left: mean entropy (± std) per number of blocks engaged, with token counts.
    Right: every token (jittered horizontally)."""
    import matplotlib.pyplot as plt

    fig, (ax_bin, ax_sc) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    ks = np.array([b[0] for b in stats.bins])
    means = np.array([b[2] for b in stats.bins])
    stds = np.array([b[3] for b in stats.bins])
    ax_bin.errorbar(ks, means, yerr=stds, fmt="o-", capsize=3)
    for k, count, m, _ in stats.bins:
        ax_bin.annotate(f"n={count}", (k, m), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax_bin.set_xlabel(f"blocks engaged (of {stats.n_layers})")
    ax_bin.set_ylabel("prediction entropy (nats)")
    ax_bin.set_title("binned: mean ± std")
    rng = np.random.default_rng(0)
    jitter = rng.uniform(-0.25, 0.25, size=stats.n_blocks_T.size)
    ax_sc.scatter(stats.n_blocks_T + jitter, stats.entropy_T, s=3, alpha=0.3)
    ax_sc.set_xlabel("blocks engaged (jittered)")
    r = "n/a" if math.isnan(stats.pearson_r) else f"{stats.pearson_r:.3f}"
    ax_sc.set_title(f"per token: Pearson r = {r}")
    for ax in (ax_bin, ax_sc):
        ax.set_xticks(range(0, stats.n_layers + 1))
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    from analysis.outdir import save_figure

    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path


def plot_routing_heatmap(dump: RoutingDump, path: str | Path, row: int = 0, start: int = 0, width: int = 64,
                         byte_tokens: bool | None = None, title: str = "") -> Path:
    """Layer x position map of which block processed which token of one sequence window, with
    the window's characters along x (when short enough to read) and the entropy below."""
    import matplotlib.pyplot as plt

    if byte_tokens is None:
        byte_tokens = looks_like_bytes(dump)
    S = dump.input_ids_BS.shape[1]
    start = max(0, min(start, S - 1))
    stop = min(S, start + width)
    eng_LW = dump.engaged_LBS[:, row, start:stop].astype(np.float64)
    W, L = stop - start, dump.n_layers
    fig, (ax_map, ax_ent) = plt.subplots(2, 1, figsize=(max(6.0, 0.16 * W + 1.5), 1.2 + 0.35 * L + 1.4),
                                         sharex=True, gridspec_kw={"height_ratios": [max(L, 2), 2]})
    ax_map.imshow(eng_LW, aspect="auto", cmap="Blues", vmin=0, vmax=1.25, interpolation="nearest")
    from matplotlib.patches import Patch

    cmap = plt.get_cmap("Blues")
    ax_map.legend(handles=[Patch(color=cmap(1 / 1.25), label="processed by the block"),
                           Patch(facecolor=cmap(0.0), edgecolor="0.6",
                                 label="skipped (depth-routed out, no-op expert or dropped route)")],
                  loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    ax_map.set_yticks(range(L))
    ax_map.set_yticklabels([f"layer {i}" for i in range(L)], fontsize=7)
    ax_map.set_title(title or f"routing decisions, row {row}, positions {start}..{stop - 1} (dark = processed)",
                     fontsize=9)
    ax_ent.bar(range(W), dump.entropy_BS[row, start:stop], color="tab:orange", width=0.8)
    ax_ent.set_ylabel("prediction\nentropy (nats)", fontsize=7)
    ax_ent.set_xlim(-0.5, W - 0.5)
    if W <= 128:
        ax_ent.set_xticks(range(W))
        pieces = dump.tokens[row][start:stop] if row < len(dump.tokens) else []
        if byte_tokens or len(pieces) != W:
            labels = token_labels(dump.input_ids_BS[row, start:stop], byte_tokens)
            unit = "characters" if byte_tokens else "token ids"
        else:
            labels, unit = text_labels(pieces), "tokens"
        ax_ent.set_xticklabels(labels, fontsize=7, family="monospace", rotation=0 if byte_tokens else 90)
        ax_ent.set_xlabel(f"position ({unit})")
    else:
        ax_ent.set_xlabel("position")
    fig.tight_layout()
    path = Path(path)
    from analysis.outdir import save_figure

    save_figure(fig, path, dpi=110, bbox_inches="tight")  # keep the key right of the map
    plt.close(fig)
    return path


def window_text(dump: RoutingDump, row: int = 0, start: int = 0, width: int = 64) -> str:
    """The sample window as text: decoded bytes for the byte tokenizer, else the window's tokens
    (each decoded alone, as dumped; the row's whole text only from a dump that predates them)."""
    ids = dump.input_ids_BS[row, start:start + width]
    if looks_like_bytes(dump):
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")
    pieces = dump.tokens[row][start:start + width] if row < len(dump.tokens) else []
    if len(pieces) == len(ids):  # not the whole row (2048 tokens) under "first 64 tokens"
        return "".join(pieces)
    return dump.text[row] if row < len(dump.text) else ""

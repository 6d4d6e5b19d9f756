"""Transformer layers that know where their tokens sit.

Shape legend: B batch, S sequence (or the k gathered tokens of a routed block), D d_model,
H heads, E head dim, R rotary pairs (E/2), L cache length, T key positions, N rows of a call.

Attention takes explicit position ids `pos_BS` so that a Mixture-of-Depths block can run on a
gathered subset of tokens and still give each its *original* rotary position, and an optional
`valid_BS` key mask for ragged subsets (causal routing selects a different number per row).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mode.mlp import MLP  # noqa: F401 - defined outside this package: the MoE experts are MLPs too
from mode.routed import Cost


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32: bf16 sums of squares lose too much precision.
        x = x_BSD.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight.float()).to(x_BSD.dtype)

    @staticmethod
    def cost(d: int) -> Cost:
        return Cost(d, 0)  # elementwise: not counted


class Rotary(nn.Module):
    """Rotary embedding indexed by explicit positions (a table lookup, not arange)."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        ang_LR = torch.arange(max_seq_len, dtype=torch.float64)[:, None] * inv_freq[None]
        # Not saved in checkpoints: derived from the config.
        self.register_buffer("cos_LR", ang_LR.cos().float(), persistent=False)
        self.register_buffer("sin_LR", ang_LR.sin().float(), persistent=False)

    def forward(self, x_BHSE: torch.Tensor, pos_BS: torch.Tensor) -> torch.Tensor:
        cos = self.cos_LR[pos_BS][:, None].to(x_BHSE.dtype)  # B 1 S R
        sin = self.sin_LR[pos_BS][:, None].to(x_BHSE.dtype)
        x1, x2 = x_BHSE[..., 0::2], x_BHSE[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
        return out.flatten(-2)


class KVCache:
    """Per-layer key/value cache with a length per batch row.

    A routed layer writes only the tokens it processed, so rows fill at different rates. Writes
    append after each row's current length: a prefill writes a whole (right-padded) prompt, a
    decoding step one token. `rows_N` (set by a routing wrapper for one call) names the batch rows
    whose queries this call carries (decode that skips runs a block on the selected rows only).
    """

    def __init__(self, batch: int, n_heads: int, max_len: int, head_dim: int, dtype, device):
        self.k_BHLE = torch.zeros(batch, n_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v_BHLE = torch.zeros_like(self.k_BHLE)
        self.len_B = torch.zeros(batch, dtype=torch.long, device=device)
        self.rows_N: torch.Tensor | None = None
        # Host-side count of written slots bounds every row's length (len_B <= steps): the
        # overflow check and the read window need no device sync.
        self.steps = 0

    def write(self, k_NHTE: torch.Tensor, v_NHTE: torch.Tensor, rows_N: torch.Tensor | None = None,
              valid_NT: torch.Tensor | None = None) -> None:
        """Append T tokens per row after its current length, for rows `rows_N` (None = all).
        valid_NT False marks trailing padding: written, not counted (the next write overwrites it)."""
        T, L = k_NHTE.shape[2], self.k_BHLE.shape[2]
        if self.steps + T > L:
            raise RuntimeError(f"KV cache full: max_len={L}")
        self.steps += T
        rows = torch.arange(self.len_B.shape[0], device=self.len_B.device) if rows_N is None else rows_N
        slot_NT = self.len_B[rows][:, None] + torch.arange(T, device=rows.device)
        self.k_BHLE[rows[:, None], :, slot_NT] = k_NHTE.transpose(1, 2)
        self.v_BHLE[rows[:, None], :, slot_NT] = v_NHTE.transpose(1, 2)
        n_N = T if valid_NT is None else valid_NT.sum(1)
        self.len_B = self.len_B.index_add(0, rows, torch.as_tensor(n_N, device=rows.device).expand(rows.shape[0]))

    def read(self, rows_N: torch.Tensor | None = None):
        """Keys, values [N, H, W, E] of rows `rows_N` (None = all) over the written window W, and
        the key mask [N, W]. A row with no key yet still sees slot 0 so softmax stays finite (its
        output is padding the routing wrapper discards)."""
        W = max(self.steps, 1)
        k, v, n = self.k_BHLE[:, :, :W], self.v_BHLE[:, :, :W], self.len_B
        if rows_N is not None:
            k, v, n = k.index_select(0, rows_N), v.index_select(0, rows_N), n.index_select(0, rows_N)
        return k, v, torch.arange(W, device=n.device)[None] < n.clamp(min=1)[:, None]

    def keep_rows(self, rows_N: torch.Tensor) -> None:
        """Shrink the batch to rows `rows_N` (in that order): generation drops the rows that have
        finished, so later steps compute nothing for them. One copy of the kept rows."""
        self.k_BHLE = self.k_BHLE.index_select(0, rows_N)
        self.v_BHLE = self.v_BHLE.index_select(0, rows_N)
        self.len_B = self.len_B.index_select(0, rows_N)


# bf16 attention over at most this many keys runs in fp32 on a CPU: measured on an avx512_bf16 CPU,
# causal SDPA forward + backward in bf16 takes 9x fp32's time over 16 keys, 2x over 128, about 1x
# over 256 and 0.73x from 1024 on (benchmarks/RESULTS.md, "bf16 attention on CPU"); a depth-routed
# block of a tiny preset attends over 16. bf16 -> fp32 is exact; the result is rounded back to bf16.
CPU_BF16_SDPA_MAX_KEYS = 256


def sdpa(q, k, v, **kw):
    """F.scaled_dot_product_attention, in fp32 for bf16 on a CPU over few keys (see above)."""
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and k.shape[-2] <= CPU_BF16_SDPA_MAX_KEYS:
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kw).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, **kw)


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, max_seq_len: int, rope_theta: float):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.rotary = Rotary(self.head_dim, max_seq_len, rope_theta)

    def forward(self, x_BSD, pos_BS, valid_BS=None, cache: KVCache | None = None, kv_x_BTD=None, kv_pos_BT=None,
                kv_valid_BT=None):
        """Queries from x_BSD. Keys/values from the same tokens, or (K/V-from-all) from kv_x_BTD at
        positions kv_pos_BT (T tokens, kv_valid_BT False = padding): each query then sees every key
        at or before its position. With a cache the keys/values are appended to it (for the rows
        `cache.rows_N`, or every row with K/V-from-all); one token per row attends over the cache,
        a prefill (several tokens into an empty cache) attends as without one."""
        B, S, D = x_BSD.shape
        H, E = self.n_heads, self.head_dim
        if kv_x_BTD is None:
            q, k, v = self.qkv(x_BSD).view(B, S, 3, H, E).permute(2, 0, 3, 1, 4)
            kv_pos_BT, kv_valid_BT = pos_BS, valid_BS
        else:
            # Selective query projection: only this unit's tokens pay for Q (and the output).
            w_q, w_kv = self.qkv.weight.split([D, 2 * D])
            q = F.linear(x_BSD, w_q).view(B, S, H, E).transpose(1, 2)
            T = kv_x_BTD.shape[1]
            k, v = F.linear(kv_x_BTD, w_kv).view(kv_x_BTD.shape[0], T, 2, H, E).permute(2, 0, 3, 1, 4)
        q, k = self.rotary(q, pos_BS), self.rotary(k, kv_pos_BT)  # B H S E
        if cache is not None:
            rows_N = cache.rows_N
            prefill = S > 1 or k.shape[2] > 1  # several queries or keys per row: a prompt's tokens
            assert not prefill or cache.steps == 0, "a prefill fills an empty cache; then one token per step"
            assert not (prefill and rows_N is not None), "a prefill carries every row"
            cache.write(k, v, None if kv_x_BTD is not None else rows_N, kv_valid_BT)
            if not prefill:
                k_c, v_c, keymask_NW = cache.read(rows_N)
                y = sdpa(q, k_c, v_c, attn_mask=keymask_NW[:, None, None])
                return self.out(y.transpose(1, 2).reshape(B, S, D))
        if kv_x_BTD is not None:
            # Causal by position, and only valid keys: a padding key never contributes, wherever it
            # sits (left padding, holes). A query left without a key (padding: the routing wrapper
            # discards it) keeps its causal row so that softmax stays finite.
            mask_BST = kv_pos_BT[:, None, :] <= pos_BS[:, :, None]
            if kv_valid_BT is not None:
                keyed_BST = mask_BST & kv_valid_BT[:, None, :]
                mask_BST = torch.where(keyed_BST.any(-1, keepdim=True), keyed_BST, mask_BST)
            y = sdpa(q, k, v, attn_mask=mask_BST[:, None])
        elif valid_BS is None:
            y = sdpa(q, k, v, is_causal=True)
        else:
            # Ragged subsets: causal among the gathered tokens and only valid keys; the diagonal
            # stays visible so padded queries never see an all-masked row (they are discarded).
            causal_SS = torch.ones(S, S, dtype=torch.bool, device=x_BSD.device).tril()
            mask_BSS = (causal_SS & valid_BS[:, None, :]) | torch.eye(S, dtype=torch.bool, device=x_BSD.device)
            y = sdpa(q, k, v, attn_mask=mask_BSS[:, None])
        return self.out(y.transpose(1, 2).reshape(B, S, D))

    @staticmethod
    def cost(d: int, s: int, s_kv: int | None = None) -> Cost:
        """Per query token, when each row has s query tokens (and s_kv key/value tokens, default s):
        Q and output projections, K/V projections of the s_kv tokens shared by the s queries,
        and the full s x s_kv score and value products (what SDPA without block skipping does)."""
        s_kv = s if s_kv is None else s_kv
        return Cost(4 * d * d, 4 * d * d + 4 * d * d * s_kv / s + 4 * s_kv * d)


def init_weights(model: nn.Module, std: float, n_layers: int, seed: int | None = None) -> None:
    """Normal(0, std) for matrices; output projections of residual branches scaled by 1/sqrt(2L).

    Each parameter draws from its own generator seeded by (seed, its name), so the init does not
    depend on which other parameters exist: an expert-parallel layer holding only its rank's
    experts names them by global expert index (`p.init_key`) and gets the same weights as ep=1.
    Native MoE's stacked experts [E, in, out] draw each expert as the DeepSpeed layer's Linear
    weight [out, in] of the same key (`p.init_keys`), and both routers share a key: the backends
    start from the same weights at the same seed.
    """
    import zlib

    def keyed_randn(key: str, shape) -> torch.Tensor:
        g = torch.Generator().manual_seed((seed * 1000003 + zlib.crc32(key.encode())) % 2**63)
        # on the generator's device (CPU), whatever the default device: the same draws everywhere
        return torch.randn(shape, generator=g, dtype=torch.float32, device="cpu")

    seed = torch.initial_seed() if seed is None else seed
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                # residual-branch outputs: attention/MLP `out`, native/DeepSpeed experts' `w_out`,
                # MegaBlocks experts' `w2` (its [E*F, D] down projection)
                out = name.endswith(("out.weight", "w_out.weight", "w_out", "experts.mlp.w2"))
                s = std / math.sqrt(2 * n_layers) if out else std
                keys = getattr(p, "init_keys", None)
                if keys is not None:
                    p.copy_(torch.stack([keyed_randn(k, (p.shape[2], p.shape[1])).t() for k in keys]) * s)
                else:
                    p.copy_(keyed_randn(getattr(p, "init_key", name), p.shape) * s)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

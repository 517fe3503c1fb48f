"""`LatentAttention`: multi-head latent attention from low-rank Q/K/V/O factors (LatentLLM, MLA-style).

    q = RoPE(norm(B_q A_q x + b_q))          A_q (r_q, d) shared by all query heads, B_q (h·d_h, r_q)
    c_k = A_k x  (r_k per token, cached)     k = RoPE(norm(B_k c_k + b_k)), B_k (n_kv·d_h, r_k) per KV head
    c_v = A_v x  (r_v per token, cached)     v = B_v c_v + b_v
    y = o_proj(softmax(q kᵀ · scaling) v)    o_proj: LowRankLinear or the original nn.Linear

RoPE is applied after decompression (the rotation cannot be folded into B_k), so with a latent cache every
step decompresses all cached keys: T·r_k·n_kv·d_h MACs per token and layer. Values never need that: the
attention weights act on the latents and B_v is applied once per query (absorption). Without RoPE and
QK-norm (OPT) keys are absorbed too: q̃ = B_kᵀ q scores the latents directly (q·b_k is the same for every
key, so softmax ignores it). Each call picks the cheaper of "decompress" and "absorb" from the MAC counts
in `_costs`; both give the same result.

cache="latent" stores (b, 1, t, r_k) key latents and (b, 1, t, r_v) value latents in HF's cache (a value
path left dense stores (b, n_kv, t, d_h)); cache="dense" stores rotated keys and values like HF attention;
cache="values" stores rotated keys (b, n_kv, t, d_h) and value latents: with RoPE, a latent key cache costs
T·r_k·n_kv·d_h MACs per new token (more than the whole model at a few hundred tokens of context), while
absorbed value latents cost h·T·r_v — the decode-speed-neutral way to shrink the cache.
RoPE tables come from the model's own rotary module (so scaled RoPE variants stay exact) at the absolute
cache positions: key j of a cache holding `total` tokens sits at total − kv_len + j (also for sliding-window
caches, which keep only the last window). Left padding shifts every position of a row by the same amount,
which RoPE logits do not see.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attnslim import _compat
from attnslim._compat import AttentionCall
from attnslim.errors import AttnslimError
from attnslim.linalg.attention import grouped_attention, repeat_kv, sliding_keep, softmax_attention
from attnslim.linalg.rope import apply_rope
from attnslim.linalg.scores import heads, merge_heads
from attnslim.modules.base import AttnShape, ReplacementAttention
from attnslim.modules.lowrank import LowRankLinear
from attnslim.registry import register_module

CACHE_MODES = ("latent", "dense", "values")
FEW_QUERIES = 16  # at most this many new queries (decode, short chunks): `grouped_attention`, not SDPA


def _rank(module: nn.Module) -> int | None:
    return module.rank if isinstance(module, LowRankLinear) else None


@register_module
class LatentAttention(ReplacementAttention):
    def __init__(
        self, shape: AttnShape, *, q_proj: nn.Module, k_proj: LowRankLinear, v_proj: nn.Module, o_proj: nn.Module,
        q_norm: nn.Module | None = None, k_norm: nn.Module | None = None, rotary: nn.Module | None = None,
        cache: str = "latent",
    ) -> None:
        """shape: the replaced layer's heads and softmax settings; rotary: the model's rotary module (None: no
        RoPE), used for its tables and never owned."""
        super().__init__()
        layer_idx, n_heads, n_kv_heads, head_dim = shape.layer, shape.n_heads, shape.n_kv_heads, shape.head_dim
        scaling, sliding_window, softcap = shape.scaling, shape.sliding_window, shape.softcap
        if cache not in CACHE_MODES:
            raise AttnslimError(f"layer {layer_idx}: LatentAttention cache={cache!r} is invalid; valid: {CACHE_MODES}")
        if not isinstance(k_proj, LowRankLinear):
            raise AttnslimError(f"layer {layer_idx}: LatentAttention needs a LowRankLinear k_proj (the key latent)")
        self.layer_idx, self.n_heads, self.n_kv_heads, self.head_dim = layer_idx, n_heads, n_kv_heads, head_dim
        self.scaling, self.sliding_window, self.softcap, self.cache = scaling, sliding_window, softcap, cache
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q_proj, k_proj, v_proj, o_proj
        self.q_norm, self.k_norm = q_norm, k_norm
        # A plain tuple, not a submodule: the model owns the rotary module (and its buffers)
        self._rotary: tuple[nn.Module, ...] = () if rotary is None else (rotary,)
        self.layer_type = shape.layer_type
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None  # (1, cap, d_rot) cos and sin

    # --- RoPE ------------------------------------------------------------------------------------
    def _rope(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Rotate x (b, n, t, d_h) as positions start .. start + t − 1."""
        if not self._rotary:
            return x
        end = start + x.shape[-2]
        cos, sin = self._cos_sin(end, x)
        return apply_rope(x, cos[:, start:end], sin[:, start:end])

    def _cos_sin(self, end: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._table
        if table is None or table[0].shape[1] < end or table[0].device != x.device or table[0].dtype != x.dtype:
            cap = max(256, 1 << (end - 1).bit_length())  # grow geometrically: O(1) amortised per token
            pos = torch.arange(cap, device=x.device)[None]  # (1, cap)
            table = _compat.rotary_cos_sin(self._rotary[0], x, pos, self.layer_type)
            self._table = table
        return table

    # --- projections ------------------------------------------------------------------------------
    def _keys(self, c_k: torch.Tensor, start: int) -> torch.Tensor:
        """Key latents (b, T, r_k) -> rotated keys (b, n_kv, T, d_h) at positions start.. ."""
        k = heads(F.linear(c_k, self.k_proj.decompression(), self.k_proj.bias), self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return self._rope(k, start)

    def _latent_v(self) -> LowRankLinear | None:
        """v_proj when values are cached as latents, else None."""
        v = self.v_proj
        return v if self.cache in ("latent", "values") and isinstance(v, LowRankLinear) else None

    def _absorbable_k(self) -> bool:
        """Keys can be scored in latent space: no rotation or norm after B_k, and a softcap would not
        commute with dropping the per-query constant q·b_k."""
        softcap_bias = self.softcap is not None and self.k_proj.bias is not None
        return self.cache == "latent" and not self._rotary and self.k_norm is None and not softcap_bias

    def _costs(self, t: int, kv: int) -> dict[str, int]:
        """MACs of the attention core for t queries over kv keys, per path (see the module docstring)."""
        h, n_kv, d_h = self.n_heads, self.n_kv_heads, self.head_dim
        core = h * t * kv * d_h  # scores (or weighted values) at head_dim
        r_k = self.k_proj.rank
        out = {"k_dense": core, "v_dense": core}
        if self.cache == "latent":
            out["k_decompress"] = kv * r_k * n_kv * d_h + core
            if self._absorbable_k():
                out["k_absorb"] = h * t * d_h * r_k + h * t * kv * r_k
        if (lv := self._latent_v()) is not None:
            r_v = lv.rank
            out["v_decompress"] = kv * r_v * n_kv * d_h + core
            out["v_absorb"] = h * t * kv * r_v + h * t * r_v * d_h
        return out

    def _paths(self, t: int, kv: int) -> tuple[str, str]:
        c = self._costs(t, kv)
        key = "dense" if self.cache != "latent" else min(
            (p for p in ("decompress", "absorb") if f"k_{p}" in c), key=lambda p: c[f"k_{p}"])
        value = "dense" if self._latent_v() is None else min(("decompress", "absorb"), key=lambda p: c[f"v_{p}"])
        return key, value

    # --- forward -----------------------------------------------------------------------------------
    def attend(self, call: AttentionCall) -> torch.Tensor:
        hidden_states, position_embeddings, attention_mask, past_key_values = call
        x = hidden_states  # (b, t, d)
        b, t, _ = x.shape
        h, n_kv = self.n_heads, self.n_kv_heads
        past = _compat.cache_seq_length(past_key_values, self.layer_idx)
        q = heads(self.q_proj(x), self.head_dim)  # (b, h, t, d_h)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = self._rope(q, past)
        c_k = self.k_proj.latent(x)  # (b, t, r_k)
        k_new = self._keys(c_k, past) if self.cache in ("dense", "values") else c_k[:, None]
        lv = self._latent_v()
        v_new = heads(self.v_proj(x), self.head_dim) if lv is None else lv.latent(x)[:, None]
        k_store, v_store = self._cache_update(past_key_values, k_new, v_new)
        kv = k_store.shape[-2]
        keep = attention_keep(attention_mask, t, kv, x.device, self.sliding_window, self.softcap)
        key_path, value_path = self._paths(t, kv)
        if key_path == "absorb":  # (b, h, t, r_k) queries against (b, 1, kv, r_k) latents
            bk = self.k_proj.decompression().view(n_kv, self.head_dim, -1)  # (n_kv, d_h, r_k)
            q = (q.view(b, n_kv, h // n_kv, t, self.head_dim) @ bk[:, None]).reshape(b, h, t, -1)
            k = k_store.expand(b, n_kv, kv, k_store.shape[-1])
        elif key_path == "decompress":
            k = self._keys(k_store[:, 0], past + t - kv)  # (b, n_kv, kv, d_h)
        else:
            k = k_store
        out = self._attend(q, k, v_store, keep, value_path)  # (b, h, t, d_h)
        return self.o_proj(merge_heads(out))  # o_proj of (b, t, h·d_h)

    def _cache_update(self, cache: Any, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Both slots into the HF cache, every row so far back. A static cache allocates both slots with the first
        update's head count, so where one slot is a latent (b, 1, t, r) and the other per KV head
        (b, n_kv, t, d_h), the per-head one is stored as one row (b, 1, t, n_kv·d_h) and read back as a view."""
        if k.shape[1] == v.shape[1]:  # reserve: a dynamic layer appends in place (`_compat.ReservedRowsLayer`)
            return _compat.cache_update(cache, self.layer_idx, k, v, reserve=True)
        k_rows, v_rows = _compat.cache_update(cache, self.layer_idx, _one_row(k), _one_row(v), reserve=True)
        return _heads_back(k_rows, k.shape[1], self.head_dim), _heads_back(v_rows, v.shape[1], self.head_dim)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v_store: torch.Tensor, keep: torch.Tensor | None, path: str
                ) -> torch.Tensor:
        """q (b, h, t, ·), k (b, n_kv | h, kv, ·) and the cached values (latent (b, 1, kv, r_v) or
        (b, n_kv, kv, d_h)) -> (b, h, t, d_h)."""
        b, h, t, _ = q.shape
        n_kv, g = self.n_kv_heads, self.n_heads // self.n_kv_heads
        lv = self._latent_v()
        if lv is not None and path == "decompress":
            v_store = heads(F.linear(v_store[:, 0], lv.decompression(), lv.bias), self.head_dim)  # (b, n_kv, kv, d_h)
        out = self._core(q, k, v_store, keep)  # (b, h, t, d_h | r_v)
        if lv is None or path != "absorb":
            return out
        bv = lv.decompression().view(n_kv, self.head_dim, -1)  # (n_kv, d_h, r_v)
        out = (out.view(b, n_kv, g, t, -1) @ bv[:, None].transpose(-1, -2)).reshape(b, h, t, self.head_dim)
        if lv.bias is not None:  # softmax rows sum to one: the value bias passes through unchanged
            out = out + heads(lv.bias.expand(1, 1, -1), self.head_dim).repeat_interleave(g, 1)
        return out

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        return attend(q, k, v, keep, self.scaling, self.softcap)

    # --- reporting ---------------------------------------------------------------------------------
    def kv_cache_bytes_per_token(self) -> int:
        size = self.k_proj.b.element_size()
        full = self.n_kv_heads * self.head_dim
        if self.cache == "dense":
            return 2 * full * size
        lv = self._latent_v()
        keys = self.k_proj.rank if self.cache == "latent" else full
        return (keys + (full if lv is None else lv.rank)) * size

    def attention_flops(self, context: int) -> float:
        """FLOPs (2 per MAC) of the attention core for one new token at `context` tokens, cheaper paths."""
        c = self._costs(1, context)
        key, value = self._paths(1, context)
        return 2.0 * (c[f"k_{key}"] + c[f"v_{value}"])

    def ranks(self) -> dict[str, int | None]:
        return {"q": _rank(self.q_proj), "k": self.k_proj.rank, "v": _rank(self.v_proj), "o": _rank(self.o_proj)}

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "LatentAttention", "heads": self.n_heads, "kv_heads": self.n_kv_heads, "head_dim": self.head_dim,
            "ranks": self.ranks(), "cache": self.cache, "rope": bool(self._rotary),
            "kv_bytes_per_token": self.kv_cache_bytes_per_token(),
            "params": sum(p.numel() for p in self.parameters()),
        }

    def extra_repr(self) -> str:
        r = self.ranks()
        ranks = ", ".join(f"r_{k}={v if v is not None else 'dense'}" for k, v in r.items())
        return (f"layer={self.layer_idx}, heads={self.n_heads}/{self.n_kv_heads}x{self.head_dim}, {ranks}, "
                f"cache={self.cache} ({self.kv_cache_bytes_per_token()} B/token)")


def _one_row(z: torch.Tensor) -> torch.Tensor:
    """(b, n, t, d) -> (b, 1, t, n·d): every head of a token in one cache row (n = 1: unchanged)."""
    return z if z.shape[1] == 1 else z.transpose(1, 2).reshape(z.shape[0], 1, z.shape[2], -1)


def _heads_back(rows: torch.Tensor, n: int, head_dim: int) -> torch.Tensor:
    """`_one_row`'s inverse on what the cache returned: (b, 1, kv, n·d_h) -> (b, n, kv, d_h), a view."""
    return rows if n == 1 else heads(rows[:, 0], head_dim)


def attention_keep(attention_mask: Any, t: int, kv: int, device: torch.device, sliding_window: int | None,
                   softcap: float | None) -> torch.Tensor | None:
    """Boolean (b|1, 1, t, kv) keep-mask; None when plain causal attention is all that is needed (no
    padding, window not binding): SDPA's unmasked and is_causal kernels are several times faster.
    A decode step (t = 1) whose mask keeps every row, as HF passes with a static cache and no padding, gets None
    too on the CPU (where reading the mask costs no device sync): masked decode kernels build and apply it."""
    window_free = sliding_window is None or kv <= sliding_window
    if attention_mask is None and window_free and softcap is None and t in (1, kv):
        return None
    keep = _compat.keep_mask(attention_mask, t, kv, device)
    if not window_free:  # within the window every key is at most kv − 1 < window positions back
        keep = sliding_keep(keep, sliding_window)
    if t == 1 and softcap is None and keep.device.type == "cpu" and bool(keep.all()):
        return None
    return keep


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None, scaling: float,
           softcap: float | None, key_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q (b, h, t, e), k (b, n, kv, e), v (b, n | 1, kv, e_v), n | h: grouped heads without copies.
    keep=None: causal (t == kv) or one query attending to everything (t == 1).
    key_scale (b, n, kv): keys multiplied by it (a key norm's 1/rms, modules/mla.py); decode scales the logits
    instead, with no scaled copy of the keys.
    Few queries (decode) go through `grouped_attention`: SDPA copies grouped KV heads and, when the value
    width differs from the query width (absorbed latents), falls back to a much slower kernel on the CPU
    (timed by benchmarks/kernels.py, results/kernels.txt)."""
    t, kv = q.shape[2], k.shape[2]
    if t <= FEW_QUERIES:
        if keep is None and t > 1:  # causal over the last t of kv positions
            keep = torch.ones(t, kv, dtype=torch.bool, device=q.device).tril(kv - t)[None, None]
        return grouped_attention(q, k, v, keep, scaling, softcap, key_scale)
    if key_scale is not None:
        k = k * key_scale[..., None]
    v = v.expand(v.shape[0], k.shape[1], *v.shape[2:])  # a shared latent serves every key head (a view)
    g = q.shape[1] // k.shape[1]
    if keep is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, scale=scaling, enable_gqa=g > 1)
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scaling, enable_gqa=g > 1)
    return softmax_attention(q, repeat_kv(k, g), repeat_kv(v, g), keep, scaling, softcap)

"""`MLAAttention`: multi-head latent attention with decoupled RoPE (DeepSeek-V2 form; math in linalg/mla.py).

    q_i = q_proj(x)_i (norm if the model has a q-norm)        (d_h,) per query head, unchanged from the model
    c = A x                                   (r,)  cached      one latent per token and layer (`kv`: LowRankLinear)
    k_r = RoPE(W_kr x + b_kr)                 (d_rope,) cached  one rotary key shared by every head
    [k_n; v] = B c                            B = [B_k (D_n, r); B_v (n_kv·d_h, r)]
    logit_i = scaling · (N_q,i q_i · k_n + RoPE(R_q,i q_i) · k_r)     q_nope = N_q (h, D_n, d_h), q_rope = R_q
    y = o_proj(concat_i softmax(logit_i) v_g(i))

QK-norm (k = g ⊙ u / rms(u) per KV head): the factors describe g ⊙ u, and s_j = 1/rms(u_j) of the model's own
u = W_k x (`key_norm`) is cached per KV head: logit_i = s_j(i) · (as above); docs/methods/mla.md says why.
The cache holds [c, k_r (, s)] (b, 1, t, r + d_rope (+ n_kv)) in the key slot and nothing in the value slot; in
a dynamic cache the layer becomes a `_compat.ReservedRowsLayer`, which appends in place (no copy per step).
Two paths give the same output (tested):
  absorb     (decode, ≤ FEW_QUERIES new tokens): q̃_i = B_kᵀ N_q,i q_i (r,) scores the cached latents directly,
             the attention-weighted latent goes through B_v per head after the softmax: cached latents are
             never decompressed. MACs per new token and head: (r + d_rope) T for scores, r T for values,
             d_h (r + d_rope) + r d_h for the absorbed projections. Fused weights, the core's kernel and the
             straight step of a sequence under way: the decode engine, modules/mla_decode.py.
  decompress (prefill): every cached token's key per query head [M_iᵀ c; k_r] with M_i = B_kᵀ N_q,i, and its
             value B_v c, then attention at width d_h + d_rope per head (N_q,i q_i · B_k c = q_i · M_iᵀ c).
B_kᵀ N_q,i is a product of two parameters; outside autograd it is computed once per parameter version.
RoPE tables come from the model's rotary module (scaled RoPE stays exact) at the kept frequencies `rope_freq` and
absolute cache positions: keys are rotated once when cached, so sliding windows and left padding need nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attnslim import _compat
from attnslim._compat import AttentionCall
from attnslim.errors import AttnslimError
from attnslim.linalg import split_attention
from attnslim.linalg.attention import repeat_kv
from attnslim.linalg.rope import apply_rope
from attnslim.linalg.scores import heads, merge_heads
from attnslim.modules.base import AttnShape, ReplacementAttention
from attnslim.modules.latent import FEW_QUERIES, attend, attention_keep
from attnslim.modules.lowrank import LowRankLinear
from attnslim.modules.mla_decode import DECODE_KERNELS, MLADecode
from attnslim.registry import register_module

PATHS = ("auto", "absorb", "decompress")
__all__ = ["DECODE_KERNELS", "PATHS", "MLAAttention", "MLAShape"]


@dataclass(frozen=True)
class MLAShape:
    """An MLA layer's own sizes beside its AttnShape, which the plan and the replaced layer decide (the skeleton
    rebuilds from them).

    rank r: the cached latent's width;  rope_dims d_rope: the shared rotary key's width (even, at most n_kv·d_h;
    0 without RoPE);  k_rope_bias: the rotary key has a bias (the model's keys have one);  key_norm_eps: the
    model's key RMS-norm epsilon (QK-norm), None without a key norm."""

    rank: int
    rope_dims: int
    k_rope_bias: bool = False
    key_norm_eps: float | None = None


@register_module
class MLAAttention(MLADecode, ReplacementAttention):
    rope_freq: torch.Tensor | None  # (d_rope/2,) long: model frequency index of each rotary pair
    linear_kernel = "torch"  # or "onednn" for the fused decode projection: modules/cpu_linear.set_cpu_linear

    def __init__(
        self, shape: AttnShape, mla: MLAShape, *, q_proj: nn.Module, o_proj: nn.Linear,
        q_norm: nn.Module | None = None, rotary: nn.Module | None = None, dtype: torch.dtype = torch.float32,
    ) -> None:
        """shape: the replaced layer's heads and softmax settings; mla: the MLA sizes; rotary: the model's rotary
        module (None: no RoPE), used for its tables and never owned; dtype: of the new parameters."""
        super().__init__()
        layer_idx, n_heads, n_kv_heads, head_dim = shape.layer, shape.n_heads, shape.n_kv_heads, shape.head_dim
        scaling, sliding_window, softcap = shape.scaling, shape.sliding_window, shape.softcap
        hidden_size, rank, rope_dims = shape.hidden_size, mla.rank, mla.rope_dims
        k_rope_bias, key_norm_eps = mla.k_rope_bias, mla.key_norm_eps
        d_n = n_kv_heads * head_dim - rope_dims
        if rope_dims % 2 or d_n < 0 or (rope_dims and rotary is None):
            raise AttnslimError(f"layer {layer_idx}: MLAAttention rope_dims = {rope_dims} must be even, at most "
                                f"{n_kv_heads * head_dim}, and 0 without a rotary embedding")
        self.layer_idx, self.n_heads, self.n_kv_heads, self.head_dim = layer_idx, n_heads, n_kv_heads, head_dim
        self.scaling, self.sliding_window, self.softcap = scaling, sliding_window, softcap
        self.rank, self.rope_dims, self.nope_dims = rank, rope_dims, d_n
        self.q_proj, self.o_proj, self.q_norm = q_proj, o_proj, q_norm
        # no zero-size tensors (safetensors would drop them): absent parts are None
        self.q_rope = nn.Parameter(torch.zeros(n_heads, rope_dims, head_dim, dtype=dtype)) if rope_dims else None
        self.q_nope = nn.Parameter(torch.zeros(n_heads, d_n, head_dim, dtype=dtype)) if d_n else None
        self.k_rope = nn.Linear(hidden_size, rope_dims, bias=k_rope_bias, dtype=dtype) if rope_dims else None
        # block identity saves r² weights below full rank; at r = hidden it would leave an empty A2
        self.kv = LowRankLinear(hidden_size, d_n + n_kv_heads * head_dim, rank, False, rank < hidden_size, dtype)
        self.register_buffer("rope_freq", torch.zeros(rope_dims // 2, dtype=torch.long) if rope_dims else None)
        # QK-norm (key_norm_eps given): each new token's pre-norm key u = W_k x, whose 1/rms per KV head is cached
        # beside [c, k_r] and scales that head's logits
        self.key_norm_eps = key_norm_eps
        self.key_norm = None if key_norm_eps is None else nn.Linear(hidden_size, n_kv_heads * head_dim, bias=False,
                                                                      dtype=dtype)
        self._rotary: tuple[nn.Module, ...] = () if rotary is None else (rotary,)  # owned by the model
        self.layer_type = shape.layer_type
        # "auto": decode steps of a sequence under way take `_decode_step`, other calls with few queries absorb,
        # many decompress; or "absorb" / "decompress" (the general path) for every call (tests, benchmarks)
        self.path = "auto"
        self._init_decode()  # decode_kernel and the fused weights (modules/mla_decode.py)
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None  # (1, cap, d_rope) cos and sin
        self._absorbed = None

    @property
    def key_scales(self) -> int:
        """Cached key scales per token: one per KV head with a key norm, else none."""
        return 0 if self.key_norm is None else self.n_kv_heads

    # --- RoPE -----------------------------------------------------------------------------------------
    def _rope(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Rotate x (b, n, t, d_rope) as positions start .. start + t − 1, at the kept frequencies."""
        if not self.rope_dims:
            return x
        return apply_rope(x, *self._cos_sin(start, start + x.shape[-2], x))

    def _cos_sin(self, start: int, end: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (1, end − start, d_rope) of positions start .. end − 1 at the kept frequencies, in like's
        dtype and device."""
        table = self._table
        if table is None or table[0].shape[1] < end or table[0].dtype != like.dtype or table[0].device != like.device:
            cap = max(256, 1 << (end - 1).bit_length())  # grow geometrically: O(1) amortised per token
            pos = torch.arange(cap, device=like.device)[None]  # (1, cap)
            cos, sin = _compat.rotary_cos_sin(self._rotary[0], like, pos, self.layer_type)  # (1, cap, d_rot)
            assert self.rope_freq is not None
            idx = torch.cat([self.rope_freq, self.rope_freq]).to(like.device)  # half-split: pair p at p and m + p
            table = (cos[..., idx], sin[..., idx])
            self._table = table
        return table[0].narrow(1, start, end - start), table[1].narrow(1, start, end - start)

    # --- projections ------------------------------------------------------------------------------------
    def _value_map(self) -> torch.Tensor:
        """(n_kv, r, d_h) B_vᵀ per KV head, a view of the parameter (`fused` holds a contiguous copy for decode)."""
        return self.kv.b[self.nope_dims :].view(self.n_kv_heads, self.head_dim, self.rank).transpose(-1, -2)

    def absorbed_query(self) -> torch.Tensor:
        """(h, r, d_h) B_kᵀ N_q,i: maps query head i straight to latent space."""
        b_k = self.kv.b[: self.nope_dims]  # (D_n, r)
        if self.q_nope is None:  # every key dim is rotary: the latent carries values only
            return b_k.new_zeros(self.n_heads, self.rank, self.head_dim)
        if torch.is_grad_enabled() and (b_k.requires_grad or self.q_nope.requires_grad):
            return torch.einsum("nr,hnd->hrd", b_k, self.q_nope)
        key = (self.kv.b._version, self.q_nope._version, self.kv.b.data_ptr(), self.q_nope.data_ptr())
        if self._absorbed is None or self._absorbed[0] != key:
            self._absorbed = (key, torch.einsum("nr,hnd->hrd", b_k, self.q_nope).detach())
        return self._absorbed[1]

    def _project(self, q: torch.Tensor, maps: torch.Tensor | None) -> torch.Tensor:
        """q (b, h, t, d_h) through per-head maps (h, e, d_h) -> (b, h, t, e); e = 0 where the maps are absent."""
        if maps is None:
            return q.new_zeros(*q.shape[:3], 0)
        return torch.einsum("bhtd,hed->bhte", q, maps)

    # --- forward ----------------------------------------------------------------------------------------
    def attend(self, call: AttentionCall) -> torch.Tensor:
        hidden_states, position_embeddings, attention_mask, past_key_values = call
        x = hidden_states  # (b, t, d)
        b, t, _ = x.shape
        if t == 1 and attention_mask is None and (out := self._decode_step(x, past_key_values)) is not None:
            return out
        path = self.path if self.path != "auto" else ("absorb" if t <= FEW_QUERIES else "decompress")
        if path not in PATHS[1:]:
            raise AttnslimError(f"layer {self.layer_idx}: MLAAttention path = {self.path!r}; valid: {PATHS}")
        past = _compat.cache_seq_length(past_key_values, self.layer_idx)
        if past == 0:  # a sequence starts: the one point where derived decode weights are checked (`fused`)
            self._forget_stale()
        fused = self.fused() if path == "absorb" and not torch.is_grad_enabled() else None
        if fused is not None:  # inference decode: one input GEMM, one query-map GEMM (same values, fewer ops)
            new, q_cat = self._decode_inputs(x, fused, past)
            store, _ = _compat.cache_update(past_key_values, self.layer_idx, new, new[..., :0], reserve=True)
            keep = attention_keep(attention_mask, t, store.shape[-2], x.device, self.sliding_window, self.softcap)
            out = self._attend_latent(q_cat, store, keep, 1.0, fused.value_t)  # `scaling` is in the fused maps
        else:
            q = heads(self.q_proj(x), self.head_dim)  # (b, h, t, d_h)
            if self.q_norm is not None:
                q = self.q_norm(q)
            q_r = self._project(q, self.q_rope)  # (b, h, t, d_rope)
            q_r = self._rope(q_r, past) if self.rope_dims else q_r
            new = self._new_rows(x, past)  # (b, 1, t, r + d_rope [+ n_kv])
            store, _ = _compat.cache_update(past_key_values, self.layer_idx, new, new[..., :0], reserve=True)
            keep = attention_keep(attention_mask, t, store.shape[-2], x.device, self.sliding_window, self.softcap)
            if path == "absorb":
                out = self._absorb(q, q_r, store, keep)
            else:
                out = self._decompress(q, q_r, store, keep)
        return self.o_proj(merge_heads(out))  # o_proj of (b, t, h·d_h)

    def _new_rows(self, x: torch.Tensor, past: int) -> torch.Tensor:
        """x (b, t, d) -> the cache rows of new tokens (b, 1, t, r + d_rope + key_scales): [c, RoPE(k_r)], and with
        QK-norm each KV head's 1/rms of its pre-norm key u = W_k x."""
        c = self.kv.latent(x)  # (b, t, r)
        k_r = self.k_rope(x) if self.k_rope is not None else None  # (b, t, d_rope)
        parts = [c] if k_r is None else [c, self._rope(k_r[:, None], past)[:, 0]]
        if self.key_norm is not None:
            parts.append(self._key_scales(self.key_norm(x)))
        return (torch.cat(parts, dim=-1) if len(parts) > 1 else c)[:, None]

    def _key_scales(self, u: torch.Tensor) -> torch.Tensor:
        """QK-norm: pre-norm keys u (..., n_kv·d_h) -> 1/rms per KV head (..., n_kv), in u's dtype."""
        assert self.key_norm_eps is not None
        u = u.unflatten(-1, (self.n_kv_heads, self.head_dim))  # (..., n_kv, d_h)
        return torch.rsqrt(u.float().pow(2).mean(-1) + self.key_norm_eps).to(u.dtype)

    def _cached_scales(self, store: torch.Tensor) -> torch.Tensor:
        """QK-norm: the cached key scales (b, n_kv, T), one per KV head, a view of the cache."""
        return store[:, 0, :, self.rank + self.rope_dims :].transpose(1, 2)

    def _absorb(self, q: torch.Tensor, q_r: torch.Tensor, store: torch.Tensor, keep: torch.Tensor | None
                ) -> torch.Tensor:
        """Scores and values in latent space; (b, h, t, d_h)."""
        q_lat = torch.einsum("bhtd,hrd->bhtr", q, self.absorbed_query())  # (b, h, t, r)
        return self._attend_latent(torch.cat([q_lat, q_r], dim=-1), store, keep, self.scaling, self._value_map())

    def _attend_latent(self, q_cat: torch.Tensor, store: torch.Tensor, keep: torch.Tensor | None, scaling: float,
                       b_v_t: torch.Tensor) -> torch.Tensor:
        """q_cat (b, h, t, r + d_rope) [absorbed query; rotated rotary query] against the cached [c, k_r]:
        attention-weighted latents, then each head's value up-projection b_v_t (n_kv, r, d_h); (b, h, t, d_h)."""
        b, h, t, _ = q_cat.shape
        n_kv, r = self.n_kv_heads, self.rank
        if self.key_norm is not None:  # QK-norm: keys differ from the cached rows by a scale per KV head
            e = r + self.rope_dims
            keys, scale = store[..., :e].expand(b, n_kv, -1, e), self._cached_scales(store)  # views of the cache
            # many queries: values as wide as the queries (SDPA's fast kernels; as below); few: no scaled copy
            values = store[..., :e] if t > FEW_QUERIES else store[..., :r]
            lat = attend(q_cat, keys, values, keep, scaling, self.softcap, scale)[..., :r]
            return (lat.reshape(b, n_kv, h // n_kv * t, r) @ b_v_t).view(b, h, t, self.head_dim)
        # SDPA (many queries) falls back to a slow math kernel unless the value width is the query width: attend
        # over the whole cached row there and keep the latent columns. Few queries on the CPU: the same rows, split
        # over the cache and attended in parallel (`split_attention`: BLAS runs the grouped form's skinny GEMMs on
        # little more than one core)
        if t > FEW_QUERIES:
            lat = attend(q_cat, store, store, keep, scaling, self.softcap)[..., :r]
        elif self.softcap is None and (splits := self._splits(q_cat, store.shape[-2])) > 1:
            lat = split_attention.split_attention(q_cat, store, keep, scaling, splits)[..., :r]
        else:
            lat = attend(q_cat, store, store[..., :r], keep, scaling, self.softcap)  # (b, h, t, r)
        lat = lat.reshape(b, n_kv, h // n_kv * t, r)  # rows (i, s): query head j·g + i uses KV head j
        return (lat @ b_v_t).view(b, h, t, self.head_dim)  # no copy of B_v per group

    def _decompress(self, q: torch.Tensor, q_r: torch.Tensor, store: torch.Tensor, keep: torch.Tensor | None
                    ) -> torch.Tensor:
        """Keys and values rebuilt for every cached token; (b, h, t, d_h). Query head i's non-rotary logit is
        N_q,i q_i · B_k c = q_i · M_iᵀ c with M_i = B_kᵀ N_q,i (`absorbed_query`), so each head gets the key
        [M_iᵀ c; k_r] and attention runs at width d_h + d_rope per head, not D_n + d_rope."""
        b, kv, h = store.shape[0], store.shape[2], self.n_heads
        c = store[:, 0, :, : self.rank]  # (b, kv, r)
        k = torch.einsum("bsr,hrd->bhsd", c, self.absorbed_query())  # (b, h, kv, d_h)
        e = self.rank + self.rope_dims
        if self.rope_dims:
            k = torch.cat([k, store[..., self.rank : e].expand(b, h, kv, self.rope_dims)], dim=-1)
            q = torch.cat([q, q_r], dim=-1)  # (b, h, t, d_h + d_rope)
        if self.key_norm is not None:  # each query head's keys times its KV head's scale
            scale = self._cached_scales(store).repeat_interleave(h // self.n_kv_heads, dim=1)  # (b, h, kv)
            k = k * scale[..., None]
        v = heads(F.linear(c, self.kv.b[self.nope_dims :]), self.head_dim)  # (b, n_kv, kv, d_h)
        v = repeat_kv(v, h // self.n_kv_heads)  # every query head has its own key here
        pad = self.rope_dims if q.shape[2] > FEW_QUERIES else 0
        if pad > 0:  # SDPA's fast kernels need the value width to equal the query width (zero columns, sliced off)
            v = F.pad(v, (0, pad))
        return attend(q, k, v, keep, self.scaling, self.softcap)[..., : self.head_dim]

    # --- reporting --------------------------------------------------------------------------------------
    def kv_cache_bytes_per_token(self) -> int:
        return (self.rank + self.rope_dims + self.key_scales) * self.kv.b.element_size()

    def attention_flops(self, context: int) -> float:
        """FLOPs (2 per MAC) of the attention core for one new token at `context` tokens (the absorbed path):
        scores h·T·(r + d_rope), values h·T·r, absorbed query and value projections h·d_h·(2r + d_rope).
        bench.flops counts every weight of `kv` as applied once per token; decode applies A but never B itself
        (B_k lives in the absorbed query, B_v is applied per head above), so B's size is taken off here.
        The count is the algorithm's: the rotate-half rows `fused` adds (d_rope·(d + h·d_h) MACs, under 1% of a
        SmolLM2 decode step) trade a few FLOPs for fewer operations and are not in it. A key norm adds the
        scaling of every score by its key's cached scale (h·T multiplies); its projection W_k is a linear layer,
        which bench.flops counts."""
        h, r, e = self.n_heads, self.rank, self.rank + self.rope_dims
        flops = 2.0 * (h * context * (e + r) + h * self.head_dim * (e + r) - self.kv.b.numel())
        if self.key_norm is not None:
            flops += float(h * context)
        return flops

    def ranks(self) -> dict[str, int]:
        return {"kv": self.rank, "rope": self.rope_dims, "nope": self.nope_dims}

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "MLAAttention", "heads": self.n_heads, "kv_heads": self.n_kv_heads, "head_dim": self.head_dim,
            "ranks": self.ranks(), "cache": "latent+rope" + ("+key_scales" if self.key_scales else ""),
            "rope": bool(self._rotary),
            "kv_bytes_per_token": self.kv_cache_bytes_per_token(),
            "params": sum(p.numel() for p in self.parameters()),
        }

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, heads={self.n_heads}/{self.n_kv_heads}x{self.head_dim}, r_kv={self.rank}, "
                f"d_rope={self.rope_dims}, d_nope={self.nope_dims}"
                + (f", key_scales={self.key_scales}" if self.key_scales else "")
                + f" ({self.kv_cache_bytes_per_token()} B/token)")


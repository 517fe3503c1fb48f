"""`JointQKVAttention`: attention whose q, k and v come from ONE shared latent (LatentLLM App. C, Eq. 50).

    z = A x  (r per token)     [q; k; v] = [B_q; B_k; B_v] z + b̂     one LowRankLinear `qkv` with stacked rows
    q = RoPE(norm(q)), k = RoPE(norm(k)) per head (h·d_h, n_kv·d_h rows); y = o_proj(softmax(q kᵀ·scaling) v)

The stacked B's rows are q's h·d_h, then k's and v's n_kv·d_h each (GQA). The KV cache holds the rotated keys and
the values, as HF's attention does (`cache` is always "dense"): a cache of the shared latent z is not implemented
(latentllm refuses qk=joint_qkv with cache latent or values). RoPE tables come from the model's own rotary module
at the absolute cache positions, as LatentAttention's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from attnslim import _compat
from attnslim._compat import AttentionCall
from attnslim.errors import AttnslimError
from attnslim.linalg.rope import apply_rope
from attnslim.linalg.scores import heads, merge_heads
from attnslim.modules.base import AttnShape, ReplacementAttention
from attnslim.modules.latent import attend, attention_keep
from attnslim.modules.lowrank import LowRankLinear
from attnslim.registry import register_module


@register_module
class JointQKVAttention(ReplacementAttention):
    def __init__(self, shape: AttnShape, *, qkv: LowRankLinear, o_proj: nn.Module, q_norm: nn.Module | None = None,
                 k_norm: nn.Module | None = None, rotary: nn.Module | None = None) -> None:
        """qkv: the shared-A factors, (h + 2 n_kv)·d_h output rows; rotary: the model's rotary module (never owned)."""
        super().__init__()
        self.layer_idx, self.n_heads, self.n_kv_heads = shape.layer, shape.n_heads, shape.n_kv_heads
        self.head_dim, self.scaling, self.softcap = shape.head_dim, shape.scaling, shape.softcap
        self.sliding_window, self.layer_type = shape.sliding_window, shape.layer_type
        rows = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        if not isinstance(qkv, LowRankLinear) or qkv.out_features != rows:
            raise AttnslimError(
                f"layer {shape.layer}: JointQKVAttention needs a LowRankLinear qkv with (h + 2·n_kv)·d_h = {rows} "
                f"output rows, got {type(qkv).__name__} with {getattr(qkv, 'out_features', '?')}")
        self.qkv, self.o_proj, self.q_norm, self.k_norm = qkv, o_proj, q_norm, k_norm
        self._rotary: tuple[nn.Module, ...] = () if rotary is None else (rotary,)  # the model owns it

    def _rope(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Rotate x (b, n, t, d_h) as positions start .. start + t − 1."""
        if not self._rotary:
            return x
        pos = torch.arange(start, start + x.shape[-2], device=x.device)[None]  # (1, t)
        cos, sin = _compat.rotary_cos_sin(self._rotary[0], x, pos, self.layer_type)
        return apply_rope(x, cos, sin)

    def attend(self, call: AttentionCall) -> torch.Tensor:
        x, _, attention_mask, cache = call  # x (b, t, d)
        t = x.shape[1]
        past = _compat.cache_seq_length(cache, self.layer_idx)
        d_q, d_kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = self.qkv(x).split([d_q, d_kv, d_kv], -1)  # (b, t, h·d_h), (b, t, n_kv·d_h) twice
        q, k, v = heads(q, self.head_dim), heads(k, self.head_dim), heads(v, self.head_dim)  # (b, n, t, d_h)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        q, k = self._rope(q, past), self._rope(k, past)
        k, v = _compat.cache_update(cache, self.layer_idx, k, v, reserve=True)  # (b, n_kv, kv, d_h)
        keep = attention_keep(attention_mask, t, k.shape[-2], x.device, self.sliding_window, self.softcap)
        out = attend(q, k, v, keep, self.scaling, self.softcap)  # (b, h, t, d_h)
        return self.o_proj(merge_heads(out))

    def kv_cache_bytes_per_token(self) -> int:
        return 2 * self.n_kv_heads * self.head_dim * self.qkv.b.element_size()

    def attention_flops(self, context: int) -> float:
        """FLOPs of the attention core (scores and weighted values) for one new token at `context` tokens."""
        return 4.0 * self.n_heads * context * self.head_dim

    def ranks(self) -> dict[str, int | None]:
        return {"qkv": self.qkv.rank, "o": self.o_proj.rank if isinstance(self.o_proj, LowRankLinear) else None}

    def describe(self) -> dict[str, Any]:
        return {"kind": "JointQKVAttention", "heads": self.n_heads, "kv_heads": self.n_kv_heads,
                "head_dim": self.head_dim, "ranks": self.ranks(), "cache": "dense", "rope": bool(self._rotary),
                "kv_bytes_per_token": self.kv_cache_bytes_per_token(),
                "params": sum(p.numel() for p in self.parameters())}

    def extra_repr(self) -> str:
        r = self.ranks()
        return (f"layer={self.layer_idx}, heads={self.n_heads}/{self.n_kv_heads}x{self.head_dim}, shared "
                f"r_qkv={r['qkv']}, r_o={r['o'] if r['o'] is not None else 'dense'}, cache=dense "
                f"({self.kv_cache_bytes_per_token()} B/token)")

"""Attention recomputed from an `AttentionSpec` alone: the reference every replacement is checked against."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from attnslim.errors import AttnslimError
from attnslim.linalg.attention import repeat_kv, sliding_keep, softmax_attention
from attnslim.linalg.rope import apply_rope

if TYPE_CHECKING:
    from attnslim.adapters.base import AttentionSpec


def project_heads(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, head_dim: int) -> torch.Tensor:
    """x (b, t, d_in) @ w (h*head_dim, d_in)^T -> (b, h, t, head_dim)."""
    y = F.linear(x, w, b)
    return y.view(*x.shape[:2], -1, head_dim).transpose(1, 2)


def spec_qkv(
    spec: AttentionSpec, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (b, t, hidden) -> q (b, n_heads, t, hd), k, v (b, n_kv, t, hd), after q/k norms and RoPE."""
    q = project_heads(x, spec.q, spec.q_bias, spec.head_dim)
    k = project_heads(x, spec.k, spec.k_bias, spec.head_dim)
    v = project_heads(x, spec.v, spec.v_bias, spec.head_dim)
    if spec.q_norm is not None:
        q = spec.q_norm(q)
    if spec.k_norm is not None:
        k = spec.k_norm(k)
    if spec.rope is not None:
        if cos_sin is None:
            raise AttnslimError(f"layer {spec.layer}: RoPE layer needs (cos, sin) position embeddings")
        q, k = apply_rope(q, *cos_sin), apply_rope(k, *cos_sin)
    return q, k, v


def spec_attention(
    spec: AttentionSpec,
    x: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
    keep: torch.Tensor,
) -> torch.Tensor:
    """x (b, t, hidden) -> (b, t, hidden) for the full sequence; keep (b|1, 1, t, t) True = attend."""
    q, k, v = spec_qkv(spec, x, cos_sin)
    k, v = repeat_kv(k, spec.group_size), repeat_kv(v, spec.group_size)
    out = softmax_attention(q, k, v, sliding_keep(keep, spec.sliding_window), spec.scaling, spec.softcap)
    out = out.transpose(1, 2).reshape(*x.shape[:2], -1)  # (b, t, n_heads*hd)
    return F.linear(out, spec.o, spec.o_bias)

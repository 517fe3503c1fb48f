"""Attention scores as pure functions, shared by LISA's modules, its distillation teacher and the analyses."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from attnslim.linalg.attention import repeat_kv
from attnslim.linalg.spec_attention import spec_qkv

if TYPE_CHECKING:
    from attnslim.adapters.base import AttentionSpec


def heads(y: torch.Tensor, dim: int) -> torch.Tensor:
    """(b, t, n*dim) -> (b, n, t, dim). One token (decode): a view with no transpose, one operator less."""
    if y.shape[1] == 1:
        return y.view(y.shape[0], -1, 1, dim)
    return y.view(*y.shape[:2], -1, dim).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(b, n, t, dim) -> (b, t, n*dim), `heads` undone. One token: a view where x is contiguous."""
    b, n, t, dim = x.shape
    if t == 1 and x.is_contiguous():
        return x.view(b, 1, n * dim)
    return x.transpose(1, 2).reshape(b, t, n * dim)


def qk_scores(
    q: torch.Tensor, k: torch.Tensor, scaling: float, softcap: float | None = None
) -> torch.Tensor:
    """q (b, h, l, d), k (b, g, t, d) -> unmasked scores (b, h, l, t) = scaling * q k^T (tanh-capped)."""
    scores = (q @ repeat_kv(k, q.shape[1] // k.shape[1]).transpose(-1, -2)) * scaling
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def attend(scores: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """scores (b, h, l, t), v (b, g, t, d), keep (b|1, 1, l, t) -> (b, l, h*d); the mask is applied here only.

    Masked entries get finfo.min (not -inf), so a query row with no allowed key (padding) stays finite.
    """
    masked = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    probs = torch.softmax(masked, dim=-1, dtype=torch.float32).to(v.dtype)
    out = probs @ repeat_kv(v, scores.shape[1] // v.shape[1])  # (b, h, l, d)
    return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)


def spec_qkv_scores(
    spec: AttentionSpec, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (b, l, hidden) -> q (b, h, l, d), k, v (b, g, l, d) post-norm/RoPE, unmasked scores (b, h, l, l)."""
    q, k, v = spec_qkv(spec, x, cos_sin)
    return q, k, v, qk_scores(q, k, spec.scaling, spec.softcap)

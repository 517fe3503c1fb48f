"""Attention math shared by replacement modules and the adapter contract test."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(b, n_kv, t, d) -> (b, n_kv*groups, t, d): each KV head serves `groups` query heads."""
    if groups == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)


TAYLOR_FLOOR = 1e-3  # taylor_attention's smallest denominator, as a fraction of the sequence length


def taylor_attention(scores: torch.Tensor, v: torch.Tensor, colsum: torch.Tensor, length: torch.Tensor
                     ) -> torch.Tensor:
    """First-order Taylor attention on principal keys: ATP's Eq. 8 (variant B of its notes),
    O = (1U + s)·V′ / (L + s·(1U)ᵀ).

    scores s (b, h, L, R) = q K′ᵀ · scaling, v V′ (b, h, R, dv), colsum 1U (b, 1, 1, R) (the column sums of U,
    zero for masked components), length L (b, 1, 1, 1) real tokens. With K = U K′, V = U V′ and UᵀU = I this is
    exactly Σ_j (1 + q k_j) v_j / Σ_j (1 + q k_j), the first-order expansion of softmax attention over all L tokens,
    restricted to the principal subspace: at r = rank(X) it equals that over the tokens, and it does not change when
    any u_i flips sign (s and 1U flip together with V′). The weights 1 + q k_j may be negative, so the denominator can
    reach 0 where the expansion has broken down; it is floored at TAYLOR_FLOOR·L to keep the output finite."""
    weights = colsum + scores  # (b, h, L, R)
    denominator = length + scores @ colsum.transpose(-1, -2)  # (b, h, L, 1)
    return (weights @ v) / denominator.clamp_min(TAYLOR_FLOOR * length)


def sliding_keep(keep: torch.Tensor, window: int | None) -> torch.Tensor:
    """Restrict a (.., q, kv) causal keep-mask to the last `window` keys of each query."""
    if window is None:
        return keep
    q_len, kv_len = keep.shape[-2:]
    q_pos = torch.arange(kv_len - q_len, kv_len, device=keep.device)[:, None]
    k_pos = torch.arange(kv_len, device=keep.device)[None, :]
    return keep & (q_pos - k_pos < window)


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """q (b, h, tq, d), k (b, h, tk, d), v (b, h, tk, dv), keep (b|1, 1|h, tq, tk) -> (b, h, tq, dv).

    Rows with no allowed key (padding) give zeros, never NaN.
    """
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scaling)
    scores = (q @ k.transpose(-1, -2)) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1) @ v


def grouped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    key_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (b, h, t, e), k (b, n, kv, e), v (b, n | 1, kv, e_v), keep (b|1, 1, t, kv) or None -> (b, h, t, e_v).
    key_scale (b, n, kv): each key's logits multiplied by it (a key norm's 1/rms, modules/mla.py): the same as
    attending to k · key_scale, without a scaled copy of the keys.

    Query head j·g + i (g = h / n) uses key head j, HF's GQA convention; a single value head (a shared latent)
    serves every key head by broadcasting. Scores are materialised as (b, n, g·t, kv) with no copy of K or V:
    meant for few queries (decode), where SDPA copies KV heads or, with e_v ≠ e, falls back to a math kernel
    (one query over 512 latents of width 192: 619 µs against 57 µs here, benchmarks/kernels.py).
    keep=None attends to every key, so pass None only for t == 1 (or a non-causal use). Rows with no allowed
    key give zeros, never NaN.
    """
    b, h, t, e = q.shape
    n = k.shape[1]
    g = h // n
    scores = q.reshape(b, n, g * t, e) @ k.transpose(-1, -2)  # (b, n, g·t, kv)
    if scaling != 1.0:  # callers that fold the scale into the query pass 1.0
        scores = scores * scaling
    if key_scale is not None:
        scores = scores * key_scale[:, :, None, :]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if keep is not None:
        rows = keep.repeat(1, 1, g, 1)  # (b|1, 1, g·t, kv): row i·t + s is query s of group member i
        scores = scores.masked_fill(~rows, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1) * rows
    else:
        probs = torch.softmax(scores, dim=-1)
    return (probs @ v).reshape(b, h, t, v.shape[-1])  # (b, n, g·t, e_v) -> (b, h, t, e_v)

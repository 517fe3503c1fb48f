"""The derived weights `MLAAttention` decodes with outside autograd (modules/mla.py): the same algebra as its unfused
absorbed path, in fewer, larger operations. Pure functions of tensors; the module decides when to build them.

    w_in (h·d_h + r + 2·d_rope (+ n_kv·d_h), d)   [W_q; A; W_kr; P W_kr (; W_k)]   one GEMM gives [q, c, k_r, P k_r
                                     (, u)] per new token; u = W_k x, the pre-norm key of a QK-norm layer, whose
                                     1/rms per KV head the module caches
    maps (h, d_h, r + 2·d_rope)      scaling · [B_kᵀ N_q,i; R_q,i; P R_q,i]ᵀ per head: q -> [absorbed query;
                                     rotary query; its rotate-half], the softmax scale folded in
    value_t (n_kv, r, d_h)           B_vᵀ per KV head, contiguous

P is RoPE's rotate-half ([x1, x2] -> [−x2, x1]), a fixed linear map: with P·y computed by the same GEMM,
RoPE(y) = y·cos + (P y)·sin is two in-place element-wise ops (`rotate_in_place`). The module takes the GEMMs'
outputs apart with one `split` each: at a small model's decode every dispatched operator counts
(benchmarks/decode_ops.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import nn

from attnslim.linalg.rope import rotate_half


class FusedDecode(NamedTuple):
    w_in: torch.Tensor  # (h·d_h + r + 2·d_rope (+ n_kv·d_h), d)
    b_in: torch.Tensor | None  # (h·d_h + r + 2·d_rope (+ n_kv·d_h),)
    maps: torch.Tensor  # (h, d_h, r + 2·d_rope)
    value_t: torch.Tensor  # (n_kv, r, d_h) B_vᵀ per KV head


class RotaryParts(NamedTuple):
    w_kr: torch.Tensor  # (d_rope, d) the shared rotary key's projection
    b_kr: torch.Tensor | None  # (d_rope,)
    q_rope: torch.Tensor  # (h, d_rope, d_h) R_q,i per query head


@torch.no_grad()
def fuse_decode_weights(q_proj: nn.Linear, latent: torch.Tensor, absorbed: torch.Tensor, value_map: torch.Tensor,
                        scaling: float, rotary: RotaryParts | None, key_norm: torch.Tensor | None = None
                        ) -> FusedDecode:
    """The module docstring's tensors, detached. latent (r, d): A with its block identity written out; absorbed
    (h, r, d_h) B_kᵀ N_q,i; value_map (n_kv, r, d_h) B_vᵀ; rotary None where every key dim is non-rotary;
    key_norm (n_kv·d_h, d) the pre-norm key projection W_k of a QK-norm layer (its rows come last), else None."""
    rows = [q_proj.weight, latent]
    biases: list[torch.Tensor | None] = [q_proj.bias, None]
    maps = [absorbed]  # (h, r, d_h)
    if rotary is not None:
        w_kr, b_kr, q_r = rotary
        rows += [w_kr, rotate_half(w_kr.T).T]
        biases += [b_kr, None if b_kr is None else rotate_half(b_kr)]
        maps += [q_r, rotate_half(q_r.transpose(1, 2)).transpose(1, 2)]
    if key_norm is not None:
        rows.append(key_norm)
        biases.append(None)
    bias = None if all(x is None for x in biases) else torch.cat(
        [x if x is not None else w.new_zeros(w.shape[0]) for x, w in zip(biases, rows, strict=True)])
    return FusedDecode(torch.cat(rows).detach(), None if bias is None else bias.detach(),
                       (torch.cat(maps, dim=1).transpose(1, 2) * scaling).contiguous().detach(),
                       value_map.contiguous().detach())


def fused_weight_count(n_heads: int, head_dim: int, rank: int, rope_dims: int, hidden: int, n_kv_heads: int,
                       has_bias: bool, key_norm: bool = False) -> int:
    """Elements of `fuse_decode_weights`' output, from the shapes alone (what one fused decode step reads)."""
    rows = n_heads * head_dim + rank + 2 * rope_dims + (n_kv_heads * head_dim if key_norm else 0)
    return rows * hidden + (rows if has_bias else 0) + n_heads * head_dim * (rank + 2 * rope_dims) \
        + n_kv_heads * rank * head_dim


def source_key(modules: Iterable[nn.Module | None]) -> tuple[tuple[int, int], ...]:
    """Version and address of every parameter and buffer the modules hold directly (their own dicts, not their
    children's): equal keys mean derived weights built from them are still current."""
    return tuple((p._version, p.data_ptr()) for m in modules if m is not None
                 for d in (m._parameters, m._buffers) for p in d.values() if p is not None)


def rotate_in_place(y: torch.Tensor, p_y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """y, p_y (..., t, d_rope) = y and P y, views of one GEMM's output -> y becomes RoPE(y) = y·cos + (P y)·sin."""
    y.mul_(cos).addcmul_(p_y, sin)

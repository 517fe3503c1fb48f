"""One MLAAttention layer as DeepSeek-V3 attention tensors (pure math; export/deepseek.py orchestrates).

Ours (modules/mla.py), per query head i of KV group g(i), with q_i = W_q,i x:
    logit_i = s · (q_iᵀ N_q,iᵀ B_k c + RoPE(R_q,i q_i) · RoPE(W_kr x)),   c = A x,   v_g = B_v,g c
DeepSeek-V3 (q_lora_rank null), with its latent c' = kv_a_layernorm(first R rows of kv_a_proj_with_mqa x):
    logit_i = s' · (q_nope,i · W_UK,i c' + RoPE'(q_pe,i) · RoPE'(k_pe)),   v_i = W_UV,i c',   s' = (d_qn + D)^-½
The map (exact where noted in export/deepseek.py):
    q_proj       (h·(d_h + D), d)   per head [κ W_q,i ; κ P R_q,i W_q,i]           κ = s / s'
    kv_a_proj_with_mqa (R + D, d)    [α A ; 0 (R − r rows) ; P W_kr]
    kv_a_layernorm (R,)              √eps / α  (the norm is linear on α-scaled latents; see `latent_scale`)
    kv_b_proj    (h·2·d_h, R)        per head [N_q,iᵀ B_k | 0 ; B_v,g(i) | 0]       (d_qn = d_v = d_h)
    o_proj       (d, h·d_h)          W_o
P places our half-split rotary pair p (rows p and m + p, frequency f_p) at DeepSeek's interleaved slot
(2 f_p, 2 f_p + 1): with D = the model's rotary dims, DeepSeek's frequency f is the model's frequency f.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_F64 = torch.float64
TAU = 1e-6  # mean (α c)² ≤ TAU · eps for every input: kv_a_layernorm's relative error ≤ TAU / 2


def place_rotary(rows: torch.Tensor, freq: torch.Tensor, rotary_dims: int) -> torch.Tensor:
    """rows (..., 2m, k) in half-split layout [re_1..re_m, im_1..im_m], pair p at frequency freq[p] ->
    (..., D, k) in DeepSeek's interleaved layout, zero at the frequencies not kept."""
    m = freq.numel()
    out = rows.new_zeros(*rows.shape[:-2], rotary_dims, rows.shape[-1])
    out[..., 2 * freq, :] = rows[..., :m, :]
    out[..., 2 * freq + 1, :] = rows[..., m:, :]
    return out


def latent_scale(latent_map: torch.Tensor, input_bound: float, kv_lora_rank: int, eps: float) -> float:
    """α with mean((α A x)²) ≤ TAU · eps whenever ‖x‖ ≤ input_bound (mean over the R padded latent dims):
    ‖A x‖ ≤ ‖A‖₂ · input_bound. latent_map A (r, d)."""
    bound = float(torch.linalg.matrix_norm(latent_map.to(_F64), ord=2)) * input_bound
    return math.sqrt(TAU * eps * kv_lora_rank) / max(bound, 1e-30)


@dataclass(frozen=True)
class MLALayer:
    """One MLAAttention layer's tensors as the export reads them (modules/mla.py's names in the docstring above).

    w_q (h·d_h, d);  q_nope (h, D_n, d_h) N_q or None;  q_rope (h, 2m, d_h) R_q or None;  freq (m,) long, in the
    target's frequency numbering;  latent_map (r, d) A;  b_k (D_n, r);  b_v (n_kv·d_h, r);  w_kr (2m, d) or None;
    w_o (d, h·d_h);  n_heads h, n_kv_heads n_kv;  scaling s, the layer's logit scale. Absent parts are zero."""

    w_q: torch.Tensor
    q_nope: torch.Tensor | None
    q_rope: torch.Tensor | None
    freq: torch.Tensor
    latent_map: torch.Tensor
    b_k: torch.Tensor
    b_v: torch.Tensor
    w_kr: torch.Tensor | None
    w_o: torch.Tensor
    n_heads: int
    n_kv_heads: int
    scaling: float


def attention_tensors(
    layer: MLALayer, *, rotary_dims: int, kv_lora_rank: int, alpha: float, eps: float,
) -> dict[str, torch.Tensor]:
    """DeepSeek-V3 attention tensors of one layer, float64: rotary_dims D and kv_lora_rank R of the target, alpha
    the latent scale (`latent_scale`), eps kv_a_layernorm's epsilon."""
    w_q, q_nope, q_rope, freq, latent_map = layer.w_q, layer.q_nope, layer.q_rope, layer.freq, layer.latent_map
    b_k, b_v, w_kr, w_o = layer.b_k, layer.b_v, layer.w_kr, layer.w_o
    n_kv_heads, scaling = layer.n_kv_heads, layer.scaling
    h, r, d = layer.n_heads, latent_map.shape[0], w_q.shape[1]
    d_h = w_q.shape[0] // h
    w_q64 = w_q.to(_F64).view(h, d_h, d)  # (h, d_h, d)
    kappa = scaling * math.sqrt(d_h + rotary_dims)  # s / s'
    if q_rope is not None:
        pe = place_rotary(q_rope.to(_F64) @ w_q64, freq, rotary_dims)  # (h, D, d)
    else:
        pe = w_q64.new_zeros(h, rotary_dims, d)
    q_proj = kappa * torch.cat([w_q64, pe], dim=1).reshape(h * (d_h + rotary_dims), d)
    kv_a = w_q64.new_zeros(kv_lora_rank + rotary_dims, d)
    kv_a[:r] = alpha * latent_map.to(_F64)
    if w_kr is not None:
        kv_a[kv_lora_rank:] = place_rotary(w_kr.to(_F64), freq, rotary_dims)
    w_uk = w_q64.new_zeros(h, d_h, r) if q_nope is None else \
        torch.einsum("hnd,nr->hdr", q_nope.to(_F64), b_k.to(_F64))  # (h, d_h, r) N_q,iᵀ B_k
    w_uv = b_v.to(_F64).view(n_kv_heads, d_h, r).repeat_interleave(h // n_kv_heads, 0)  # (h, d_h, r)
    kv_b = w_q64.new_zeros(h, 2 * d_h, kv_lora_rank)
    kv_b[:, :d_h, :r], kv_b[:, d_h:, :r] = w_uk, w_uv
    norm = w_q64.new_ones(kv_lora_rank)
    norm[:r] = math.sqrt(eps) / alpha
    return {"q_proj.weight": q_proj, "kv_a_proj_with_mqa.weight": kv_a, "kv_a_layernorm.weight": norm,
            "kv_b_proj.weight": kv_b.reshape(h * 2 * d_h, kv_lora_rank), "o_proj.weight": w_o.to(_F64)}

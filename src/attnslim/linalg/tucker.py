"""Joint Q/K compression by Tucker/HOSVD of the whitened per-head bilinear forms (LatentLLM §4.1, Alg. 1,
App. E-F).

Approximated: the pre-softmax logits q_mᵀ k_n of every head by shared latents A_q x (r_q) and A_k x (r_k)
with per-head decompressions B_q (d_h, r_q), B_k (d_h, r_k): an MLA-style latent KV cache of r_k per token.
Objective: Σ_heads E‖(x_mᵀ W_qᵀ W_k x_n) − (x_mᵀ Ŵ_qᵀ Ŵ_k x_n)‖² = Σ_i ‖G_i − A'_qᵀ H_i A'_k‖²,
G_i = P W_{q,i}ᵀ W_{k,i} P with P = (C + λI)^{1/2}; solved by alternating top-r eigenvectors (Eq. 74-77).
Statistics: InputStats of the shared q/k input. Cost (weights): r_q (d + h d_h) + r_k (d + n_kv d_h),
minus r_q² + r_k² with block-identity A_q / A_k.
Deviations: Alg. 1's A_q update uses Σ G_i A_kᵀ A_k G_iᵀ (the printed A_k A_kᵀ is a dimension error);
the per-head junction J_i (saving d_h² per head) is not applied (J_i = I), so B_q, B_k stay dense.
The bias-aware rank-1 terms (§3.7) are extended to RoPE slices as u_{i,δ} = P W_{q,i}ᵀ Θ_δ k̄_i.
GQA (§3.8): query head (i, j) shares KV head i and has index i * group + j (HF repeat_kv order).
RoPE (§3.9): Θ_δ (d_h, d_h) in HF rotate_half layout with logit = q_mᵀ Θ_{n−m} k_n for pre-rotation q, k;
slices over a window of offsets are treated as independent token pairs (the paper's assumption).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from attnslim.errors import AttnslimError
from attnslim.linalg.lowrank import JOINT_FIT, FitOptions, block_identity, factorize
from attnslim.linalg.precond import PrecondSpec, damped_eigh
from attnslim.linalg.ranks import check_rank
from attnslim.linalg.stats import InputStats

_F64 = torch.float64


@dataclass(frozen=True)
class QKWeights:
    """The query and key projections of one attention layer, what joint_qk approximates.

    w_q: (h·d_h, d);  w_k: (n_kv·d_h, d);  b_q: (h·d_h,) or None;  b_k: (n_kv·d_h,) or None;
    n_heads h, n_kv_heads n_kv (GQA: query head i·g + j reads KV head i, HF repeat_kv order)."""

    w_q: torch.Tensor
    w_k: torch.Tensor
    n_heads: int
    n_kv_heads: int
    b_q: torch.Tensor | None = None
    b_k: torch.Tensor | None = None


@dataclass(frozen=True)
class JointQKFactors:
    """Shared compressions and per-head decompressions (float64, input coordinates).

    a_q: (r_q, d);  a_k: (r_k, d);  b_q: (h, d_h, r_q);  b_k: (n_kv, d_h, r_k);
    bias_q: (h·d_h,) or None;  bias_k: (n_kv·d_h,) or None;  perm_q / perm_k: (d,) when A is block-identity;
    loss_history: whitened loss after each iteration (non-increasing).
    """

    a_q: torch.Tensor
    a_k: torch.Tensor
    b_q: torch.Tensor
    b_k: torch.Tensor
    bias_q: torch.Tensor | None = None
    bias_k: torch.Tensor | None = None
    perm_q: torch.Tensor | None = None
    perm_k: torch.Tensor | None = None
    loss_history: list[float] = field(default_factory=list)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(Ŵ_q (h·d_h, d), Ŵ_k (n_kv·d_h, d))."""
        return self.b_q.flatten(0, 1) @ self.a_q, self.b_k.flatten(0, 1) @ self.a_k


def rope_rotations(
    head_dim: int, offsets: Sequence[int], theta: float = 1e4, rotary_dim: int | None = None,
    freqs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Θ_δ for each offset δ = n − m: (n_off, d_h, d_h), HF rotate_half layout (pairs k, k + rd/2).

    Only the first `rotary_dim` dims rotate (partial RoPE); the rest is identity. `freqs` (rd/2,) radians per
    token replaces theta's θ^(-2j/rd) where the model's frequencies are scaled (llama3, yarn: read them from the
    model's rotary module, `adapters.rotary.rotary_angles`).
    """
    rd = head_dim if rotary_dim is None else rotary_dim
    if rd % 2 or not 0 < rd <= head_dim:
        raise AttnslimError(f"rotary_dim = {rd} must be even and in 2..{head_dim}")
    half = rd // 2
    if freqs is not None and freqs.shape != (half,):
        raise AttnslimError(f"freqs has shape {tuple(freqs.shape)}; rotary_dim = {rd} needs ({half},)")
    freq = theta ** (-torch.arange(half, dtype=_F64) * 2.0 / rd) if freqs is None else freqs.to(_F64)  # (half,)
    ang = torch.tensor(list(offsets), dtype=_F64)[:, None] * freq  # (n_off, half)
    cos, sin = ang.cos(), ang.sin()
    out = torch.eye(head_dim, dtype=_F64).repeat(len(offsets), 1, 1)  # (n_off, d_h, d_h)
    idx = torch.arange(half)
    out[:, idx, idx] = cos
    out[:, idx + half, idx + half] = cos
    out[:, idx, idx + half] = -sin
    out[:, idx + half, idx] = sin
    return out


def causal_offsets(window: int) -> list[int]:
    """Offsets δ = n − m of a query m and its `window` most recent keys n <= m: [0, −1, ..., −(window−1)]."""
    if window < 1:
        raise AttnslimError(f"rope window = {window} must be >= 1")
    return [-i for i in range(window)]


def _rope_or_identity(
    rope: torch.Tensor | None, d_h: int, weights: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (Θ (n_off, d_h, d_h), w (n_off,)); no RoPE = the single slice Θ = I with weight 1."""
    th = torch.eye(d_h, dtype=_F64, device=device)[None] if rope is None else rope.to(device, _F64)
    if th.shape[1:] != (d_h, d_h):
        raise AttnslimError(f"rope rotations have shape {tuple(th.shape)}; expected (n_offsets, {d_h}, {d_h})")
    w = torch.ones(th.shape[0], dtype=_F64, device=device) if weights is None else weights.to(device, _F64)
    return th, w


def _conj(th: torch.Tensor, w: torch.Tensor, g: torch.Tensor, transpose: bool) -> torch.Tensor:
    """Σ_δ w_δ Θ_δ g Θ_δᵀ (or Θ_δᵀ g Θ_δ when transpose) for g (..., d_h, d_h)."""
    t = th.transpose(-1, -2) if transpose else th  # (n_off, d_h, d_h)
    return torch.einsum("o,oab,...bc,odc->...ad", w, t, g, t)


def _top_rows(m: torch.Tensor, r: int) -> torch.Tensor:
    """Top-r eigenvectors of a symmetric PSD (d, d) matrix as rows (r, d) ("RightSingular_r")."""
    _, q = torch.linalg.eigh(0.5 * (m + m.T))
    return q[:, -r:].flip(1).T.contiguous()


def joint_qk(
    qk: QKWeights,
    stats: InputStats,
    r_q: int,
    r_k: int,
    *,
    options: FitOptions = JOINT_FIT,
    bias_aware: bool | None = None,
    rope: torch.Tensor | None = None,
    rope_weights: torch.Tensor | None = None,
    whiten: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> JointQKFactors:
    """Joint QK HOSVD (Alg. 1 corrected, block form: no (h, d, d) tensor is ever built).

    qk: the weights (QKWeights); options: n_iter (paper: 8), damp, junction, label (FitOptions).
    bias_aware (default: both biases given): whiten with the centred C0 and add the rank-1 mean-key /
    mean-query terms (§3.7); then b̂ = b + (W − Ŵ) μ. Without it, P = (Sxx/n + λI)^{1/2} and given
    biases still get the b̂ mean correction. rope: Θ_δ (n_off, d_h, d_h) from `rope_rotations`
    (J_i = I under RoPE); rope_weights (n_off,) default 1. junction: "none" | "block_identity" (A_q, A_k).
    whiten: (P, P⁻¹) (d, d) to run the HOSVD in the coordinates of another pre-conditioner (Table-1 ablation)
    instead of the damped root correlation; it excludes bias_aware (which needs the centred root covariance).
    """
    w_q, w_k, b_q, b_k, n_heads, n_kv_heads = qk.w_q, qk.w_k, qk.b_q, qk.b_k, qk.n_heads, qk.n_kv_heads
    n_iter, damp, junction, label = options.n_iter, options.damp, options.junction, options.label
    d = stats.dim
    d_h = w_q.shape[0] // n_heads
    if n_heads % n_kv_heads or w_q.shape != (n_heads * d_h, d) or w_k.shape != (n_kv_heads * d_h, d):
        raise AttnslimError(
            f"{label}: w_q {tuple(w_q.shape)} / w_k {tuple(w_k.shape)} do not fit n_heads={n_heads}, "
            f"n_kv_heads={n_kv_heads}, d={d}"
        )
    check_rank(r_q, d, "r_q", label)
    check_rank(r_k, d, "r_k", label)
    if n_iter < 1:
        raise AttnslimError(f"{label}: n_iter = {n_iter} must be >= 1 (paper: 8)")
    if junction not in ("none", "block_identity"):
        raise AttnslimError(f"{label}: junction = {junction!r} is not one of ('none', 'block_identity')")
    if bias_aware is None:
        bias_aware = b_q is not None and b_k is not None
    if bias_aware and (b_q is None or b_k is None):
        raise AttnslimError(f"{label}: bias_aware=True needs both b_q and b_k (pass zeros to add biases)")
    dev = stats.sxx.device  # all math runs where the statistics live
    w_q, w_k = w_q.to(dev, _F64), w_k.to(dev, _F64)
    b_q = None if b_q is None else b_q.to(dev, _F64)
    b_k = None if b_k is None else b_k.to(dev, _F64)
    g = n_heads // n_kv_heads
    th, wt = _rope_or_identity(rope, d_h, rope_weights, dev)
    mu = stats.mean
    if whiten is None:
        e, qv, _ = damped_eigh(stats.centred_cov if bias_aware else stats.corr, damp, label=label, n=stats.n)
        p, p_inv = (qv * e.sqrt()) @ qv.T, (qv * e.rsqrt()) @ qv.T  # (d, d)
    elif bias_aware:
        raise AttnslimError(f"{label}: whiten (another pre-conditioner) and bias_aware=True exclude each other")
    else:
        p, p_inv = whiten[0].to(dev, _F64), whiten[1].to(dev, _F64)  # (d, d) each
    wq_t = (w_q @ p).reshape(n_kv_heads, g, d_h, d)  # W̃_q
    wk_t = (w_k @ p).reshape(n_kv_heads, d_h, d)  # W̃_k
    qbar = kbar = None
    if bias_aware:
        assert b_q is not None and b_k is not None
        qbar = (w_q @ mu + b_q).reshape(n_kv_heads, g, d_h)  # mean query per head
        kbar = (w_k @ mu + b_k).reshape(n_kv_heads, d_h)  # mean key per KV head
    gq = wq_t @ wq_t.transpose(-1, -2)  # (n_kv, g, d_h, d_h)
    gk = wk_t @ wk_t.transpose(-1, -2)  # (n_kv, d_h, d_h)
    kbar_outer = None if kbar is None else torch.einsum("ia,ib->iab", kbar, kbar)

    def q_matrix(pk: torch.Tensor) -> torch.Tensor:  # Σ_ij W̃_qijᵀ [Σ_δ Θ (K Kᵀ + k̄k̄ᵀ) Θᵀ] W̃_qij
        inner = pk if kbar_outer is None else pk + kbar_outer
        kg = _conj(th, wt, inner, transpose=False)  # (n_kv, d_h, d_h)
        t = kg[:, None] @ wq_t  # (n_kv, g, d_h, d)
        return wq_t.reshape(-1, d).T @ t.reshape(-1, d)  # (d, d): one GEMM over all heads

    def k_matrix(pq: torch.Tensor) -> torch.Tensor:  # Σ_i W̃_kiᵀ [Σ_jδ Θᵀ (Q Qᵀ + q̄q̄ᵀ) Θ] W̃_ki
        inner = pq if qbar is None else pq + torch.einsum("iga,igb->igab", qbar, qbar)
        qg = _conj(th, wt, inner.sum(1), transpose=True)  # (n_kv, d_h, d_h)
        return wk_t.reshape(-1, d).T @ (qg @ wk_t).reshape(-1, d)  # (d, d)

    aq = _top_rows(q_matrix(gk), r_q)  # init: Σ G Gᵀ (+ rank-1 terms), A'_q (r_q, d) orthonormal rows
    history: list[float] = []
    for _ in range(n_iter):
        qq = wq_t @ aq.T  # (n_kv, g, d_h, r_q)
        ak = _top_rows(k_matrix(qq @ qq.transpose(-1, -2)), r_k)
        kk = wk_t @ ak.T  # (n_kv, d_h, r_k)
        aq = _top_rows(q_matrix(kk @ kk.transpose(-1, -2)), r_q)
        qq = wq_t @ aq.T
        history.append(_loss_from_grams(gq, gk, qq @ qq.transpose(-1, -2), kk @ kk.transpose(-1, -2),
                                        qbar, kbar, th, wt))
    b_q_h = (wq_t @ aq.T).reshape(n_heads * d_h, r_q)  # B_q stacked over heads
    b_k_h = (wk_t @ ak.T).reshape(n_kv_heads * d_h, r_k)
    a_q, a_k = aq @ p_inv, ak @ p_inv  # input coordinates
    perm_q = perm_k = None
    if junction == "block_identity":
        b_q_h, a_q, perm_q = block_identity(b_q_h, a_q)
        b_k_h, a_k, perm_k = block_identity(b_k_h, a_k)
    bias_q = bias_k = None
    if b_q is not None:
        bias_q = b_q + (w_q - b_q_h @ a_q) @ mu
    if b_k is not None:
        bias_k = b_k + (w_k - b_k_h @ a_k) @ mu
    return JointQKFactors(
        a_q, a_k, b_q_h.reshape(n_heads, d_h, r_q), b_k_h.reshape(n_kv_heads, d_h, r_k),
        bias_q, bias_k, perm_q, perm_k, history,
    )


def _loss_from_grams(
    gq: torch.Tensor, gk: torch.Tensor, pq: torch.Tensor, pk: torch.Tensor,
    qbar: torch.Tensor | None, kbar: torch.Tensor | None, th: torch.Tensor, wt: torch.Tensor,
) -> float:
    """Whitened loss Σ_{ijδ} w_δ [‖G‖² − ‖A'_q G A'_kᵀ‖²] + Σ w_δ [‖(I−Π_q)u‖² + ‖(I−Π_k)v‖²].

    gq, pq: (n_kv, g, d_h, d_h) W̃_q W̃_qᵀ and Q Qᵀ (Q = W̃_q A'_qᵀ);  gk, pk: (n_kv, d_h, d_h).
    """
    full = torch.einsum("igab,iab->", gq, _conj(th, wt, gk, transpose=False))
    proj = torch.einsum("igab,iab->", pq, _conj(th, wt, pk, transpose=False))
    total = full - proj
    if qbar is not None and kbar is not None:
        kk = _conj(th, wt, torch.einsum("ia,ib->iab", kbar, kbar), transpose=False)  # Σ Θ k̄k̄ᵀ Θᵀ
        total = total + torch.einsum("igab,iab->", gq - pq, kk)  # ‖u‖² − ‖A'_q u‖²
        qq = _conj(th, wt, torch.einsum("iga,igb->igab", qbar, qbar).sum(1), transpose=True)  # Σ Θᵀ q̄q̄ᵀ Θ
        total = total + torch.einsum("iab,iab->", gk - pk, qq)
    return float(total)


def split_qk(
    qk: QKWeights, stats: InputStats, r_q: int, r_k: int, *, damp: float = 1e-2, label: str = "layer",
) -> JointQKFactors:
    """The split-ASVD baseline: separate RootCov factorisations of W_q and W_k at ranks r_q, r_k.

    Same structure as `joint_qk` (a rank-r_q A_q shared by all query heads), so it is a feasible point
    of the joint problem and `qk_logit_loss` compares the two directly. loss_history is empty.
    """
    d_h = qk.w_q.shape[0] // qk.n_heads
    precond = PrecondSpec("rootcov", damp)
    fq = factorize(qk.w_q, qk.b_q, stats, r_q, precond=precond, junction="left", label=f"{label}.q")
    fk = factorize(qk.w_k, qk.b_k, stats, r_k, precond=precond, junction="left", label=f"{label}.k")
    return JointQKFactors(
        fq.A, fk.A, fq.B.reshape(qk.n_heads, d_h, r_q), fk.B.reshape(qk.n_kv_heads, d_h, r_k), fq.bias, fk.bias
    )


def qk_logit_loss(
    qk: QKWeights,
    approx: JointQKFactors,
    stats: InputStats,
    *,
    rope: torch.Tensor | None = None,
    rope_weights: torch.Tensor | None = None,
    damp: float = 0.0,
) -> float:
    """Mean over token pairs (m, n) of Σ_heads Σ_δ w_δ (ℓ_mn − ℓ̂_mn)², ℓ_mn = q_mᵀ Θ_δ k_n (pre-softmax).

    With x = μ + x̃ and P = (C0 + λI)^{1/2}, λ = damp · mean(diag C0), the error splits exactly into
    c² + ‖P a‖² + ‖P b‖² + ‖P Δ P‖² (constant, query-only, key-only and bilinear parts; the cross terms
    vanish because x̃ has zero mean). damp = 0: the exact mean over all ordered pairs of calibration tokens
    (independent pairs under RoPE); damp > 0: the whitened surrogate `joint_qk(bias_aware=True)` minimises.
    Shapes: as in QKWeights.
    """
    w_q, w_k, b_q, b_k, n_heads, n_kv_heads = qk.w_q, qk.w_k, qk.b_q, qk.b_k, qk.n_heads, qk.n_kv_heads
    d = stats.dim
    d_h, g = w_q.shape[0] // n_heads, n_heads // n_kv_heads
    dev = stats.sxx.device
    th, wt = _rope_or_identity(rope, d_h, rope_weights, dev)
    c0 = stats.centred_cov.to(dev)
    e, qv = torch.linalg.eigh(c0)
    e = e.clamp_min(0.0) + damp * float(torch.diagonal(c0).mean())
    p = (qv * e.sqrt()) @ qv.T  # (d, d)
    mu = stats.mean.to(dev)
    wq_hat, wk_hat = approx.weights()

    def heads_q(w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        w64 = w.to(dev, _F64)
        mean = w64 @ mu + (0.0 if b is None else b.to(dev, _F64))
        return (w64 @ p).reshape(n_kv_heads, g, d_h, d), mean.reshape(n_kv_heads, g, d_h)

    def heads_k(w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        w64 = w.to(dev, _F64)
        mean = w64 @ mu + (0.0 if b is None else b.to(dev, _F64))
        return (w64 @ p).reshape(n_kv_heads, d_h, d), mean.reshape(n_kv_heads, d_h)

    q1, qm1 = heads_q(w_q, b_q)  # (n_kv, g, d_h, d), (n_kv, g, d_h)
    q2, qm2 = heads_q(wq_hat, approx.bias_q)
    k1, km1 = heads_k(w_k, b_k)  # (n_kv, d_h, d), (n_kv, d_h)
    k2, km2 = heads_k(wk_hat, approx.bias_k)
    total = torch.zeros((), dtype=_F64, device=dev)
    for t, w_d in zip(th, wt, strict=True):
        tk1, tk2 = t @ k1, t @ k2  # Θ W_k P: (n_kv, d_h, d)
        tkm1, tkm2 = km1 @ t.T, km2 @ t.T  # Θ k̄: (n_kv, d_h)
        c = torch.einsum("iga,ia->ig", qm1, tkm1) - torch.einsum("iga,ia->ig", qm2, tkm2)
        a = torch.einsum("igad,ia->igd", q1, tkm1) - torch.einsum("igad,ia->igd", q2, tkm2)
        b = torch.einsum("iad,iga->igd", tk1, qm1) - torch.einsum("iad,iga->igd", tk2, qm2)
        bil = torch.zeros((), dtype=_F64, device=dev)
        for qs, ks, sign_s in ((q1, tk1, 1.0), (q2, tk2, -1.0)):
            for qt, kt, sign_t in ((q1, tk1, 1.0), (q2, tk2, -1.0)):
                gram_q = qs @ qt.transpose(-1, -2)  # (n_kv, g, d_h, d_h) Q_s Q_tᵀ
                gram_k = kt @ ks.transpose(-1, -2)  # (n_kv, d_h, d_h) K'_t K'_sᵀ
                bil = bil + sign_s * sign_t * torch.einsum("igab,iba->", gram_q, gram_k)
        total = total + w_d * ((c * c).sum() + (a * a).sum() + (b * b).sum() + bil)
    return float(total)

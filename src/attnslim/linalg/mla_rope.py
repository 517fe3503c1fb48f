"""Decoupled RoPE for multi-head latent attention: which rotary directions stay rotary (pure math).

Stack the keys of all KV heads, k = W_k x + b_k (n_kv·d_h,). HF's half-split RoPE rotates, in every head g,
the pair (j, j + d_rot/2) by the angle θ_j·pos: the complex number z_gj = k[g, j] + i·k[g, j + d_rot/2].
Query head i (KV head g(i)) scores Σ_j Re(w_ij · conj(z_g(i)j) · e^{iθ_j δ}), δ = its position − the key's.
Lift its query to all heads (zero outside g(i)). Any real invertible T acting on the n_kv components of one
frequency, the same T on real and imaginary parts, commutes with the rotation (both factors are I ⊗ R(θ)), so
keys T z_:j and queries T^{-T} w_:j give the same logits. After the change of basis:
  - a kept component stays a true rotary pair of frequency θ_j, rotated by the model's own cos/sin tables (scaled
    RoPE stays exact): one shared rotary key of d_rope = 2m dims, m kept components;
  - the other components lose their rotation (their logit term loses its phase e^{iθ_jδ}) and join the
    non-rotary key space with the head dims RoPE never touched (partial rotary); the joint latent compresses it.
Keeping every component is exact (tested).

Choosing T and the kept components (`select`):
  pca:   T = the eigenvectors of the key second moment per frequency, summed over the real and imaginary parts
         (orthogonal; TransMLA's RoRoPE); every frequency's first component is kept before any second one, by
         key energy; the others are de-rotated as they are.
  query: balanced truncation of the logit per frequency: T diagonalises the key moment K and the lifted query
         moment Q together (T K Tᵀ = T^{-T} Q T^{-1} = Σ), so component c carries logit energy σ_c² and the
         components are the best change of basis for it. A dropped component's query is scaled by β_j, the mean
         cosine of its phase over causal distances < span (`phase_mean`), the least-squares stand-in for its
         rotation; the score is the error that leaves, σ_c² (1 − β_j²).
fold > 1 (TransMLA's FreqFold) treats `fold` neighbouring frequencies as one: the PCA (or the joint
diagonalisation, select=query, with β the mean over the group's frequencies) runs over all their components and
its top components take the group's frequency slots in order, which is exact only where the neighbouring
frequencies are equal: an approximation that buys more key energy per rotary slot.
one_per_freq keeps at most one component per frequency (a frequency's best), so every kept pair has its own
frequency: the layout of DeepSeek-V3's rotary key, one slot per frequency (export/deepseek.py).
allowed_freqs keeps pairs only at those frequency indices (fold 1): a DeepSeek-V3 key narrower than the model's
rotary width rotates at a subset of its frequencies (mla `rope_stride`, `rope_fastest`; export/deepseek.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnslim.errors import AttnslimError
from attnslim.linalg.precond import root_pair

SELECTS = ("pca", "query")
_F64 = torch.float64


@dataclass(frozen=True)
class RotarySplit:
    """A change of basis of the stacked keys into a shared rotary key and a non-rotary key.

    rope_key:   (2m, n_kv·d_h)   stacked key -> rotary key, half-split layout [re_1..re_m, im_1..im_m]
    rope_query: (h, 2m, d_h)     query head i's (pre-RoPE) query -> its rotary query, same layout
    freq:       (m,) long        frequency index (< d_rot/2) of each kept pair
    nope_key:   (D_n, n_kv·d_h)  stacked key -> non-rotary key, D_n = n_kv·d_h − 2m
    nope_query: (h, D_n, d_h)    query head -> its non-rotary query (de-rotated terms carry the RoPE
                                 attention scale², which the rotated terms get from the cos/sin tables)
    nope_weight: (D_n,)          how much of each non-rotary key row the logits still see: the square of its
                                 query's shrinkage (1 for rows never shrunk)
    """

    rope_key: torch.Tensor
    rope_query: torch.Tensor
    freq: torch.Tensor
    nope_key: torch.Tensor
    nope_query: torch.Tensor
    nope_weight: torch.Tensor

    @property
    def rope_dims(self) -> int:
        return int(self.rope_key.shape[0])


@dataclass(frozen=True)
class RotaryLayout:
    """The heads split_rotary works on: n_heads query heads and n_kv_heads KV heads of head_dim dims each, the
    first rotary_dims of every head rotated by RoPE (HF half-split: pair (j, j + rotary_dims/2))."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    rotary_dims: int


@dataclass(frozen=True)
class RotaryChoice:
    """How split_rotary chooses the rotary components it keeps (the module docstring says what each does).

    pairs: rotary pairs to keep (rope dims / 2);  select: one of SELECTS;  span: causal distances the query
    selection averages a dropped phase over;  fold: FreqFold's neighbouring frequencies treated as one;
    one_per_freq: at most one pair per frequency;  allowed_freqs: the frequency indices a pair may keep (None:
    any);  damp: damping of the query selection's moment roots."""

    pairs: int
    select: str
    span: int = 512
    fold: int = 1
    one_per_freq: bool = False
    allowed_freqs: list[int] | None = None
    damp: float = 1e-6


@dataclass(frozen=True)
class _Group:
    freqs: list[int]  # frequency indices treated as one
    key_t: torch.Tensor  # (M·n_kv, M·n_kv) rows = components, over coordinates (g, j) g-major
    query_t: torch.Tensor  # (M·n_kv, M·n_kv) = key_t^{-T}
    score: torch.Tensor  # (M·n_kv,) keep score of each component
    shrink: float = 1.0  # factor on a de-rotated component's query (its phase's mean cosine; 1 = de-rotate as is)


def split_rotary(
    key_moment: torch.Tensor, query_moment: torch.Tensor | None, layout: RotaryLayout, choice: RotaryChoice, *,
    angles: torch.Tensor | None = None, scale: float = 1.0, label: str = "layer",
) -> RotarySplit:
    """Choose `choice.pairs` rotary components to keep (see the module docstring).

    key_moment: (n_kv·d_h, n_kv·d_h) E[k kᵀ] of the stacked pre-RoPE keys (bias included).
    query_moment: (h, d_h, d_h) E[q_i q_iᵀ] per query head (select=query only).
    angles: (d_rot/2,) θ_j in radians per token (select=query only). scale: RoPE's attention scale.
    """
    n_kv_heads, head_dim, rotary_dims = layout.n_kv_heads, layout.head_dim, layout.rotary_dims
    pairs, select, fold, one_per_freq = choice.pairs, choice.select, choice.fold, choice.one_per_freq
    allowed_freqs = choice.allowed_freqs
    half = rotary_dims // 2
    if select not in SELECTS:
        raise AttnslimError(f"{label}: rope selection {select!r} is not one of {SELECTS}")
    if rotary_dims % 2 or not 0 <= rotary_dims <= head_dim:
        raise AttnslimError(f"{label}: rotary_dims = {rotary_dims} must be even and within 0..{head_dim}")
    if not 0 <= pairs <= n_kv_heads * half:
        raise AttnslimError(f"{label}: {pairs} rotary pairs requested; this layer has {n_kv_heads * half} "
                            f"({n_kv_heads} KV heads x {half} frequencies)")
    if fold > 1 and pairs > half:
        raise AttnslimError(f"{label}: fold = {fold} gives each of the {half} frequencies one slot; {pairs} pairs "
                            f"requested")
    if one_per_freq and pairs > half:
        raise AttnslimError(f"{label}: one rotary pair per frequency allows at most {half} pairs ({rotary_dims} "
                            f"rotary dims); {pairs} requested")
    if allowed_freqs is not None and fold > 1:
        raise AttnslimError(f"{label}: rope_stride / rope_fastest keep single frequencies; they cannot be combined "
                            f"with FreqFold (fold {fold}): set rope_fold: 1")
    allowed = len(allowed_freqs or []) * (1 if one_per_freq else n_kv_heads)
    if allowed_freqs is not None and pairs > allowed:
        raise AttnslimError(f"{label}: rope_stride / rope_fastest leave {allowed} rotary pairs; {pairs} requested "
                            f"(rope_dims at most {2 * allowed})")
    groups = [list(range(s, min(s + fold, half))) for s in range(0, half, fold)]
    built = [_group(key_moment, query_moment, f, layout, choice, angles) for f in groups]
    kept = _choose(built, pairs, fold, 1 if one_per_freq else None, by_rank=select == "pca",
                   allowed=None if allowed_freqs is None else set(allowed_freqs))
    return _assemble(built, kept, layout, scale)


def _coords(freqs: list[int], n_kv: int, head_dim: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked-key indices (M·n_kv,) of the real and imaginary parts of coordinates (g, j), g-major."""
    re = torch.tensor([g * head_dim + j for g in range(n_kv) for j in freqs])
    return re, re + half


def _group(k_mom: torch.Tensor, q_mom: torch.Tensor | None, freqs: list[int], layout: RotaryLayout,
           choice: RotaryChoice, angles: torch.Tensor | None) -> _Group:
    h, n_kv, d_h, half = layout.n_heads, layout.n_kv_heads, layout.head_dim, layout.rotary_dims // 2
    select, span, damp = choice.select, choice.span, choice.damp
    re, im = _coords(freqs, n_kv, d_h, half)
    k = k_mom.to(_F64)
    kc = k[re][:, re] + k[im][:, im]  # (M·n_kv, M·n_kv): the rotation-invariant part of the key moment
    if select == "pca":
        e, u = torch.linalg.eigh(0.5 * (kc + kc.T))
        order = torch.argsort(e, descending=True)
        t = u[:, order].T  # orthogonal: T^{-T} = T
        return _Group(freqs, t, t, e[order].clamp_min(0.0))
    if q_mom is None or angles is None:
        raise AttnslimError("select='query' needs the query moments and the RoPE angles")
    m, g = len(freqs), h // n_kv
    qc = torch.zeros_like(kc)  # lifted query moment: head i lives in the coordinates of its KV head g(i)
    js = torch.tensor(freqs)
    for i in range(h):
        qi = q_mom[i].to(_F64)
        blk = qi[js][:, js] + qi[js + half][:, js + half]  # (M, M)
        s = (i // g) * m
        qc[s : s + m, s : s + m] += blk
    lk, _ = root_pair(kc, damp, label="rope keys")  # K^{1/2}
    lq, _ = root_pair(qc, damp, label="rope queries")  # Q^{1/2}
    u, sig, vh = torch.linalg.svd(lq @ lk)  # Q^{1/2} K^{1/2} = U Σ Vᵀ, σ descending
    inv_sqrt = sig.clamp_min(sig.max() * 1e-12).rsqrt()
    key_t = inv_sqrt[:, None] * (u.T @ lq)  # T = Σ^{-1/2} Uᵀ Q^{1/2}:   T K Tᵀ = Σ
    query_t = inv_sqrt[:, None] * (vh @ lk)  # T^{-T} = Σ^{-1/2} Vᵀ K^{1/2}: T^{-T} Q T^{-1} = Σ
    beta = sum(phase_mean(float(angles[j]), span) for j in freqs) / len(freqs)
    return _Group(freqs, key_t, query_t, sig.pow(2) * (1.0 - beta**2), beta)


def phase_mean(angle: float, span: int) -> float:
    """β = E[cos(θ δ)] over causal distances δ < span, weighted span − δ (a query at position p sees δ ≤ p, so
    over a window short distances are the more frequent). Replacing a component's rotated logit term
    Re(w z̄ e^{iθδ}) by β·Re(w z̄) leaves the least mean-square error, (1 − β²)/2 · |w|²|z|²: slow frequencies
    (β ≈ 1) lose almost nothing without their rotation, fast ones (β ≈ 0) are better dropped than de-rotated."""
    delta = torch.arange(span, dtype=_F64)
    weight = span - delta
    return float((weight * torch.cos(angle * delta)).sum() / weight.sum())


def _choose(groups: list[_Group], pairs: int, fold: int, per_freq: int | None, by_rank: bool,
            allowed: set[int] | None = None) -> list[tuple[int, int]]:
    """The `pairs` (group, component) with the largest scores. A group's components come sorted by score; with
    fold > 1 only its first M (one per frequency slot) are candidates, with per_freq only its first per_freq.
    by_rank (RoRoPE): every group's first component before any second one, so the kept pairs cover every
    frequency before doubling any. allowed: only groups at these frequencies are candidates."""
    cands = []
    for gi, grp in enumerate(groups):
        if allowed is not None and grp.freqs[0] not in allowed:
            continue
        limit = len(grp.freqs) if fold > 1 else min(grp.score.numel(), per_freq or grp.score.numel())
        cands += [(c // len(grp.freqs) if by_rank else 0, -float(grp.score[c]), gi, c) for c in range(limit)]
    cands.sort()
    return sorted((gi, c) for _, _, gi, c in cands[:pairs])


def _assemble(groups: list[_Group], kept: list[tuple[int, int]], layout: RotaryLayout, scale: float) -> RotarySplit:
    h, n_kv, d_h, d_rot = layout.n_heads, layout.n_kv_heads, layout.head_dim, layout.rotary_dims
    half, g, m = d_rot // 2, h // n_kv, len(kept)
    rope_key = torch.zeros(2 * m, n_kv * d_h, dtype=_F64)
    rope_query = torch.zeros(h, 2 * m, d_h, dtype=_F64)
    nope_k: list[torch.Tensor] = []  # rows (n_kv·d_h,)
    nope_q: list[torch.Tensor] = []  # rows (h, d_h)
    nope_w: list[float] = []
    freq: list[int] = []
    keep = set(kept)
    for gi, grp in enumerate(groups):
        re, im = _coords(grp.freqs, n_kv, d_h, half)
        local = re % d_h  # (M·n_kv,) head-local real index of each coordinate
        owner = re // d_h  # (M·n_kv,) KV head of each coordinate
        for c in range(grp.score.numel()):
            kt, qt = grp.key_t[c], grp.query_t[c]  # (M·n_kv,)
            rows_k = [torch.zeros(n_kv * d_h, dtype=_F64).index_add_(0, idx, kt) for idx in (re, im)]
            rows_q = [torch.zeros(h, d_h, dtype=_F64) for _ in range(2)]
            for i in range(h):
                sel = owner == i // g
                rows_q[0][i].index_add_(0, local[sel], qt[sel])
                rows_q[1][i].index_add_(0, local[sel] + half, qt[sel])
            if (gi, c) in keep:
                p = len(freq)
                freq.append(grp.freqs[c] if len(grp.freqs) > 1 else grp.freqs[0])
                rope_key[p], rope_key[m + p] = rows_k
                rope_query[:, p], rope_query[:, m + p] = rows_q
            else:
                nope_k += rows_k
                nope_q += [r * (scale**2 * grp.shrink) for r in rows_q]
                nope_w += [grp.shrink**2] * 2
    for kv_head in range(n_kv):  # head dims RoPE never rotates (partial rotary): unchanged, unscaled
        for d in range(d_rot, d_h):
            nope_k.append(torch.zeros(n_kv * d_h, dtype=_F64).index_fill_(0, torch.tensor([kv_head * d_h + d]), 1.0))
            row = torch.zeros(h, d_h, dtype=_F64)
            row[kv_head * g : (kv_head + 1) * g, d] = 1.0
            nope_q.append(row)
            nope_w.append(1.0)
    nk = torch.stack(nope_k) if nope_k else torch.zeros(0, n_kv * d_h, dtype=_F64)
    nq = torch.stack(nope_q, 1) if nope_q else torch.zeros(h, 0, d_h, dtype=_F64)
    return RotarySplit(rope_key, rope_query, torch.tensor(freq, dtype=torch.long), nk, nq,
                       torch.tensor(nope_w, dtype=_F64))

"""Activation-aware low-rank factorisation W ≈ B A (LatentLLM §3.2-3.3, App. A-B).

Paper: Koike-Akino et al., "LatentLLM: Attention-Aware Joint Tensor Compression" (seed 001).
Approximated: y = W x + b by y ≈ B (A x) + b̂, B (d_out, r), A (r, d_in), minimising E‖(W − BA)x‖²
(exact optimum for precond "rootcov"; the other pre-conditioners are the paper's baselines).
Statistics: InputStats of the layer input (Σxxᵀ, Σx, Σ|x|, n); `rrr` also needs Σ t sᵀ and Σ t.
Cost (weights only): r (d_out + d_in), or r (d_out + d_in) − r² with the block-identity junction (linalg/ranks.py).
Deviations: Eq. 42's double-counted S is corrected (A = J⁻¹ V P⁻¹, B = U S J); the pivot columns are
chosen by QR column pivoting followed by maxvol swaps so |A2| ≤ 1.01 (the paper does not say how).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from attnslim.errors import AttnslimError
from attnslim.linalg.precond import ROOTCOV, PrecondSpec, damped_eigh
from attnslim.linalg.ranks import check_rank, factor_weights
from attnslim.linalg.stats import InputStats

Junction = Literal["left", "right", "split", "block_identity"]
JUNCTIONS: tuple[str, ...] = ("left", "right", "split", "block_identity")
_F64 = torch.float64


@dataclass(frozen=True)
class FitOptions:
    """The settings linalg's iterative joint fits share (tucker.joint_qk, vo.joint_vo, joint_ud.joint_ud).

    n_iter: alternating iterations (joint_ud counts its local step);  damp: λ = damp · mean(diag C) added before
    any root or inverse (precond.damped_eigh);  junction: how each factor pair is gauged ("none",
    "block_identity", or for joint_ud any of JUNCTIONS);  label: names the layer in errors and warnings.
    The defaults are joint_qk's and joint_vo's (the paper's 8 iterations); joint_ud's are `joint_ud.UD_FIT`."""

    n_iter: int = 8
    damp: float = 1e-2
    junction: str = "none"
    label: str = "layer"


JOINT_FIT = FitOptions()


@dataclass(frozen=True)
class LowRankFactors:
    """W ≈ B A with bias b̂ (float64).

    B: (d_out, r);  A: (r, d_in);  bias: (d_out,) or None;  perm: (d_in,) long or None.
    With the block-identity junction A[:, perm[:r]] is exactly I_r, so inference needs only
    `a2` = A[:, perm[r:]] (r, d_in − r) and A x = x[perm[:r]] + a2 @ x[perm[r:]].
    """

    B: torch.Tensor
    A: torch.Tensor
    bias: torch.Tensor | None
    perm: torch.Tensor | None

    @property
    def rank(self) -> int:
        return int(self.A.shape[0])

    @property
    def a2(self) -> torch.Tensor:
        """(r, d_in − r) non-identity block of A (block-identity junction only)."""
        if self.perm is None:
            raise AttnslimError("a2 exists only for junction='block_identity' (perm is None)")
        return self.A[:, self.perm[self.rank :]]

    def weight(self) -> torch.Tensor:
        """(d_out, d_in) Ŵ = B A."""
        return self.B @ self.A

    def param_count(self) -> int:
        d_out, d_in = int(self.B.shape[0]), int(self.A.shape[1])
        return param_count(d_out, d_in, self.rank, "block_identity" if self.perm is not None else "left")


Gauge = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], LowRankFactors]  # (B, A, bias) -> a factor
# form (e.g. the block identity pivoted into A), the same map B A


def param_count(d_out: int, d_in: int, r: int, junction: str = "block_identity") -> int:
    """Weight parameters (= MACs per token) of a rank-r factor pair; biases and indices not counted."""
    if junction not in JUNCTIONS:
        raise AttnslimError(f"junction = {junction!r} is not one of {JUNCTIONS}")
    check_rank(r, min(d_out, d_in), "rank")
    return factor_weights(d_out, d_in, r, junction)


def pivot_columns(m: torch.Tensor, max_swaps: int | None = None, tol: float = 1.01) -> torch.Tensor:
    """Column permutation (d,) whose first r columns of m (r, d) form a well-conditioned block.

    QR column pivoting (Businger-Golub) picks r columns greedily; maxvol swaps then exchange a pivot
    column for any column whose coefficient |(J⁻¹ m)_ij| exceeds `tol` (each swap grows |det J|,
    so it terminates), which bounds the entries of A2 = J⁻¹ m[:, rest] by `tol`.
    """
    r, d = m.shape
    res = m.to(_F64).clone()  # (r, d) residual of the columns after projecting out chosen ones
    chosen: list[int] = []
    taken = torch.zeros(d, dtype=torch.bool, device=m.device)
    for _ in range(r):
        norms = (res * res).sum(0).masked_fill(taken, -1.0)  # (d,)
        j = int(norms.argmax())
        chosen.append(j)
        taken[j] = True
        qv = res[:, j] / norms[j].sqrt()  # (r,)
        res -= torch.outer(qv, qv @ res)
    piv = torch.tensor(chosen, dtype=torch.long, device=m.device)
    coef = torch.linalg.solve(m[:, piv].to(_F64), m.to(_F64))  # (r, d), identity at piv
    for _ in range(10 * r if max_swaps is None else max_swaps):
        flat = int(coef.abs().argmax())
        i, c = divmod(flat, d)
        if abs(float(coef[i, c])) <= tol:
            break
        row = coef[i] / coef[i, c]  # (d,)
        coef = coef - torch.outer(coef[:, c], row)
        coef[i] = row
        piv[i] = c
    rest = torch.ones(d, dtype=torch.bool, device=m.device)
    rest[piv] = False
    return torch.cat([piv, torch.nonzero(rest).flatten()])


def block_identity(b: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Re-gauge b (d_out, r) @ m (r, d) so the right factor holds an exact I_r (Remark 4, Eq. 8-9).

    Returns (B = b J, A = J⁻¹ m with A[:, perm[:r]] = I_r exactly, perm (d,)), J = m[:, perm[:r]].
    """
    r = m.shape[0]
    perm = pivot_columns(m)
    j = m[:, perm[:r]].to(_F64)  # (r, r)
    a = torch.linalg.solve(j, m.to(_F64))  # (r, d)
    a[:, perm[:r]] = torch.eye(r, dtype=_F64, device=m.device)
    return b.to(_F64) @ j, a, perm


def _apply_junction(
    u: torch.Tensor, s: torch.Tensor, m: torch.Tensor, junction: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """u (d_out, r), s (r,), m = V P⁻¹ (r, d_in) -> (B, A, perm) with B A = u diag(s) m."""
    if junction == "left":
        return u * s, m, None
    if junction == "right":
        return u, s[:, None] * m, None
    if junction == "split":
        root = s.sqrt()
        return u * root, root[:, None] * m, None
    return block_identity(u * s, m)


def factorize(
    w: torch.Tensor,
    b: torch.Tensor | None,
    stats: InputStats,
    rank: int,
    *,
    precond: PrecondSpec = ROOTCOV,
    junction: str = "block_identity",
    center: bool | None = None,
    update_bias: bool | None = None,
    label: str = "layer",
) -> LowRankFactors:
    """Rank-`rank` activation-aware factorisation of w (d_out, d_in) with bias b (d_out,) or None.

    U S V = svd_r[W P];  B = U S J;  A = J⁻¹ V P⁻¹ (Eq. 3, 6-7, corrected 42); P from `precond` (kind, damp, alpha).
    center: whiten with the centred covariance C0 (Eq. 46-48); default (None) = on when the layer
      has a bias and precond.kind is "rootcov" or "cov" (App. B, Eq. 46-48). Needs a bias.
    update_bias: b̂ = b + (W − BA) μ (Eq. 45); default follows `center`.
    """
    if junction not in JUNCTIONS:
        raise AttnslimError(f"{label}: junction = {junction!r} is not one of {JUNCTIONS}")
    d_out, d_in = w.shape
    if stats.dim != d_in:
        raise AttnslimError(f"{label}: stats are for d = {stats.dim} inputs but W is {tuple(w.shape)}")
    check_rank(rank, min(d_out, d_in), "rank", label)
    if center is None:
        center = b is not None and precond.kind in ("rootcov", "cov")
    if update_bias is None:
        update_bias = center
    if (center or update_bias) and b is None:
        raise AttnslimError(
            f"{label}: center/update_bias need a bias; pass b = zeros(d_out) to add one, or center=False"
        )
    dev = stats.sxx.device  # all math runs where the statistics live
    w64 = w.to(dev, _F64)
    pc = precond.build(stats, center=center, label=label)
    u, s, vh = torch.linalg.svd(pc.right(w64), full_matrices=False)  # (d_out, k) (k,) (k, d_in)
    u, s, vh = u[:, :rank], s[:rank], vh[:rank]
    big_b, a, perm = _apply_junction(u, s, pc.right_inv(vh), junction)
    bias = None if b is None else b.to(dev, _F64)
    if update_bias and bias is not None:
        bias = bias + (w64 - big_b @ a) @ stats.mean
    return LowRankFactors(big_b, a, bias, perm)


def rrr(
    s_stats: InputStats,
    sts: torch.Tensor,
    st: torch.Tensor,
    rank: int,
    *,
    junction: str = "block_identity",
    damp: float = 1e-2,
    fit_bias: bool = True,
    label: str = "layer",
) -> LowRankFactors:
    """Reduced-rank regression (App. B): min over rank-r Ŵ, b̂ of Σ_tokens ‖Ŵ s + b̂ − t‖².

    s_stats: InputStats of the inputs s (n_in);  sts: (n_out, n_in) Σ t sᵀ;  st: (n_out,) Σ t.
    With C0 = cov(s) + λI (centred when fit_bias) and K = cov(t, s):
    U Σ V = svd_r[K C0^{-1/2}],  Ŵ = (U Σ J)(J⁻¹ V C0^{-1/2}),  b̂ = μ_t − Ŵ μ_s (None if not fit_bias).
    λ > 0 makes this the rank-constrained ridge solution (exact for the ridge-penalised loss).
    """
    if junction not in JUNCTIONS:
        raise AttnslimError(f"{label}: junction = {junction!r} is not one of {JUNCTIONS}")
    n_out, n_in = sts.shape
    if s_stats.dim != n_in or st.shape != (n_out,):
        raise AttnslimError(
            f"{label}: rrr shapes disagree: s dim {s_stats.dim}, sts {tuple(sts.shape)}, st {tuple(st.shape)}"
        )
    check_rank(rank, min(n_out, n_in), "rank", label)
    n = s_stats.n
    dev = s_stats.sxx.device
    mu_s, mu_t = s_stats.mean, st.to(dev, _F64) / n
    c = s_stats.centred_cov if fit_bias else s_stats.corr  # (n_in, n_in)
    k = sts.to(dev, _F64) / n  # (n_out, n_in)
    if fit_bias:
        k = k - torch.outer(mu_t, mu_s)
    e, q, _ = damped_eigh(c, damp, label=label, n=n)
    c_isqrt = (q * e.rsqrt()) @ q.T  # (n_in, n_in) C0^{-1/2}
    u, sv, vh = torch.linalg.svd(k @ c_isqrt, full_matrices=False)
    u, sv, vh = u[:, :rank], sv[:rank], vh[:rank]
    big_b, a, perm = _apply_junction(u, sv, vh @ c_isqrt, junction)
    bias = mu_t - big_b @ (a @ mu_s) if fit_bias else None
    return LowRankFactors(big_b, a, bias, perm)


def rrr_tokens(
    s: torch.Tensor,
    t: torch.Tensor,
    rank: int,
    *,
    junction: str = "block_identity",
    damp: float = 1e-2,
    fit_bias: bool = True,
    label: str = "layer",
) -> LowRankFactors:
    """`rrr` from token matrices s (N, n_in) and t (N, n_out), tokens as rows."""
    s64, t64 = s.to(_F64), t.to(_F64)
    return rrr(
        InputStats.from_tokens(s64), t64.T @ s64, t64.sum(0), rank,
        junction=junction, damp=damp, fit_bias=fit_bias, label=label,
    )

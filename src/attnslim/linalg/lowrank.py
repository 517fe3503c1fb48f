"""Activation-aware low-rank factorisation W ≈ B A (LatentLLM §3.2-3.3, App. A-B).

Paper: Koike-Akino et al., "LatentLLM: Attention-Aware Joint Tensor Compression" (seed 001).
Approximated: y = W x + b by y ≈ B (A x) + b̂, B (d_out, r), A (r, d_in), minimising E‖(W − BA)x‖²
(exact optimum for precond "rootcov"; the other pre-conditioners are the paper's baselines).
Statistics: InputStats of the layer input (Σxxᵀ, Σx, Σ|x|, n); `rrr` also needs Σ t sᵀ and Σ t.
Cost (weights only): r (d_out + d_in), or r (d_out + d_in) − r² with the block-identity, left-block-identity and
LU-like junctions (linalg/ranks.py; the gauges themselves: linalg/junctions.py).
Deviations: Eq. 42's double-counted S is corrected (A = J⁻¹ V P⁻¹, B = U S J); the pivot columns are
chosen by QR column pivoting followed by maxvol swaps so |A2| ≤ 1.01 (the paper does not say how).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch

from attnslim.errors import AttnslimError
from attnslim.linalg.junctions import block_identity, left_block_identity, lu_junction
from attnslim.linalg.precond import ROOTCOV, PrecondSpec, damped_eigh
from attnslim.linalg.ranks import check_rank, factor_weights
from attnslim.linalg.stats import InputStats

Junction = Literal["left", "right", "split", "block_identity", "left_block_identity", "lu"]
JUNCTIONS: tuple[str, ...] = ("left", "right", "split", "block_identity", "left_block_identity", "lu")
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

    B: (d_out, r);  A: (r, d_in);  bias: (d_out,) or None;  perm: (d_in,) long or None;  out_perm: (d_out,) or None.
    The junction's form follows from which permutations are set (`form`):
      perm only       block identity: A[:, perm[:r]] = I_r exactly, so inference needs only `a2` = A[:, perm[r:]]
                      (r, d_in − r) and A x = x[perm[:r]] + a2 @ x[perm[r:]];
      out_perm only   left block identity: B[out_perm[:r]] = I_r, inference needs `b2` = B[out_perm[r:]];
      both            LU-like: A[:, perm[:r]] upper-triangular, B[out_perm[:r]] unit lower-triangular.
    """

    B: torch.Tensor
    A: torch.Tensor
    bias: torch.Tensor | None
    perm: torch.Tensor | None
    out_perm: torch.Tensor | None = None

    @property
    def form(self) -> str:
        """"dense" | "block_identity" | "left_block_identity" | "lu": which blocks are structural."""
        if self.out_perm is None:
            return "dense" if self.perm is None else "block_identity"
        return "left_block_identity" if self.perm is None else "lu"

    @property
    def rank(self) -> int:
        return int(self.A.shape[0])

    @property
    def a2(self) -> torch.Tensor:
        """(r, d_in − r) A outside its pivot columns (block-identity and LU-like forms)."""
        if self.perm is None:
            raise AttnslimError("a2 exists only for junction 'block_identity' or 'lu' (perm is None)")
        return self.A[:, self.perm[self.rank :]]

    @property
    def b2(self) -> torch.Tensor:
        """(d_out − r, r) B outside its pivot rows (left-block-identity and LU-like forms)."""
        if self.out_perm is None:
            raise AttnslimError("b2 exists only for junction 'left_block_identity' or 'lu' (out_perm is None)")
        return self.B[self.out_perm[self.rank :]]

    def weight(self) -> torch.Tensor:
        """(d_out, d_in) Ŵ = B A."""
        return self.B @ self.A

    def param_count(self) -> int:
        d_out, d_in = int(self.B.shape[0]), int(self.A.shape[1])
        return param_count(d_out, d_in, self.rank, "left" if self.form == "dense" else self.form)


Gauge = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], LowRankFactors]  # (B, A, bias) -> a factor
# form (e.g. the block identity pivoted into A), the same map B A


def param_count(d_out: int, d_in: int, r: int, junction: str = "block_identity") -> int:
    """Weight parameters (= MACs per token) of a rank-r factor pair; biases and indices not counted."""
    if junction not in JUNCTIONS:
        raise AttnslimError(f"junction = {junction!r} is not one of {JUNCTIONS}")
    check_rank(r, min(d_out, d_in), "rank")
    return factor_weights(d_out, d_in, r, junction)


def _apply_junction(u: torch.Tensor, s: torch.Tensor, m: torch.Tensor, junction: str) -> LowRankFactors:
    """u (d_out, r), s (r,), m = V P⁻¹ (r, d_in) -> factors (bias None) with B A = u diag(s) m."""
    if junction == "right":
        return LowRankFactors(u, s[:, None] * m, None, None)
    if junction == "split":
        root = s.sqrt()
        return LowRankFactors(u * root, root[:, None] * m, None, None)
    return regauge(u * s, m, None, junction)


def regauge(b: torch.Tensor, a: torch.Tensor, bias: torch.Tensor | None, junction: str) -> LowRankFactors:
    """Any factor pair b (d_out, r) @ a (r, d_in) in a junction's form (same product): "left" / "none" keep it
    dense, the three r²-saving junctions re-gauge it (linalg/junctions.py). "right" and "split" need the
    singular values, which a bare pair does not carry: refused."""
    if junction in ("left", "none"):
        return LowRankFactors(b, a, bias, None)
    if junction == "block_identity":
        big_b, big_a, perm = block_identity(b, a)
        return LowRankFactors(big_b, big_a, bias, perm)
    if junction == "left_block_identity":
        big_b, big_a, out_perm = left_block_identity(b, a)
        return LowRankFactors(big_b, big_a, bias, None, out_perm)
    if junction == "lu":
        big_b, big_a, perm, out_perm = lu_junction(b, a)
        return LowRankFactors(big_b, big_a, bias, perm, out_perm)
    raise AttnslimError(
        f"junction {junction!r} cannot re-gauge a factor pair without its singular values; valid here: "
        "left, block_identity, left_block_identity, lu"
    )


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
    f = _apply_junction(u, s, pc.right_inv(vh), junction)
    bias = None if b is None else b.to(dev, _F64)
    if update_bias and bias is not None:
        bias = bias + (w64 - f.B @ f.A) @ stats.mean
    return replace(f, bias=bias)


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
    f = _apply_junction(u, sv, vh @ c_isqrt, junction)
    return replace(f, bias=mu_t - f.B @ (f.A @ mu_s) if fit_bias else None)


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

"""Streamed joint statistics of (X, Y), canonical correlations and the LMMSE affine map (NBL, Algorithm 2).

NBL (Erdogan, Tonin, Cevher 2025, arXiv 2505.21077) replaces an attention block whose output Y is nearly a
linear function of its input X by the affine map Y ≈ W X + b fitted in closed form. The layer is chosen by the
CCA bound Σ_i (1 − ρ_i²) on the normalised MSE, where ρ_i are the canonical correlations of (Y+ = Y + X, X).

Everything here works from running float64 sums (Σx, Σy, Σxxᵀ, Σyxᵀ, Σyyᵀ, n), so activations are streamed
window by window and never held. Covariances are mean-centred and normalised by n (the 1/n vs 1/(n−1) choice
cancels in the correlations, in W and in the NMSE ratio).

Deviations from the reference implementation, and why:
- no explicit inverse: W C_XX = C_YX is solved with a Cholesky factor of C_XX + δI, where δ is a ridge
  relative to the mean eigenvalue of C_XX (the reference uses a plain inverse, which breaks when C_XX is
  near-singular);
- the CCA's inverse square roots floor eigenvalues at `eig_floor` × λ_max, so numerically null directions
  are damped instead of amplified into spurious correlations of 1;
- too few tokens (n < d + 1, where every covariance is singular) is an error, not a silently wrong bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnslim.errors import AttnslimError

_F64 = torch.float64


@dataclass
class JointStats:
    """Running float64 sums of paired rows x (d_x,) and y (d_y,); `update` adds rows, `merge` adds stats."""

    sum_x: torch.Tensor  # (d_x,)
    sum_y: torch.Tensor  # (d_y,)
    sum_xx: torch.Tensor  # (d_x, d_x)  Σ x xᵀ
    sum_yx: torch.Tensor  # (d_y, d_x)  Σ y xᵀ
    sum_yy: torch.Tensor  # (d_y, d_y)  Σ y yᵀ
    n: int = 0

    @classmethod
    def zeros(cls, d_x: int, d_y: int | None = None, device: torch.device | str | None = None) -> JointStats:
        """Empty statistics on `device` (inputs are moved there; keep it on the GPU for large d)."""
        d_y = d_x if d_y is None else d_y
        if d_x <= 0 or d_y <= 0:
            raise AttnslimError(f"JointStats dimensions must be positive, got d_x={d_x}, d_y={d_y}")

        def z(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=_F64, device=device)

        return cls(z(d_x), z(d_y), z(d_x, d_x), z(d_y, d_x), z(d_y, d_y), 0)

    @property
    def d_x(self) -> int:
        return int(self.sum_x.shape[0])

    @property
    def d_y(self) -> int:
        return int(self.sum_y.shape[0])

    def update(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Add rows in place: x (..., d_x), y (..., d_y), equal leading dims; mask (...) bool, True = real."""
        if x.shape[-1] != self.d_x or y.shape[-1] != self.d_y or x.shape[:-1] != y.shape[:-1]:
            raise AttnslimError(
                f"JointStats.update expects x (..., {self.d_x}) and y (..., {self.d_y}) with equal leading "
                f"dims, got x {tuple(x.shape)} and y {tuple(y.shape)}"
            )
        dev = self.sum_x.device
        x2 = x.detach().reshape(-1, self.d_x).to(device=dev, dtype=_F64)  # (N, d_x)
        y2 = y.detach().reshape(-1, self.d_y).to(device=dev, dtype=_F64)  # (N, d_y)
        if mask is not None:
            if mask.dtype != torch.bool or mask.shape != x.shape[:-1]:
                raise AttnslimError(
                    f"mask must be bool with shape {tuple(x.shape[:-1])} (True = real token), "
                    f"got {mask.dtype} {tuple(mask.shape)}"
                )
            keep = mask.reshape(-1).to(dev)  # (N,)
            x2, y2 = x2[keep], y2[keep]  # (n_real, d)
        self.sum_x += x2.sum(0)
        self.sum_y += y2.sum(0)
        self.sum_xx.addmm_(x2.T, x2)
        self.sum_yx.addmm_(y2.T, x2)
        self.sum_yy.addmm_(y2.T, y2)
        self.n += int(x2.shape[0])

    def merge(self, other: JointStats) -> JointStats:
        """New stats over both token sets (sums add, so chunked accumulation equals one batch)."""
        if (other.d_x, other.d_y) != (self.d_x, self.d_y):
            raise AttnslimError(
                f"cannot merge JointStats of dims (d_x, d_y)={(self.d_x, self.d_y)} "
                f"with {(other.d_x, other.d_y)}"
            )
        dev = self.sum_x.device
        return JointStats(
            self.sum_x + other.sum_x.to(dev),
            self.sum_y + other.sum_y.to(dev),
            self.sum_xx + other.sum_xx.to(dev),
            self.sum_yx + other.sum_yx.to(dev),
            self.sum_yy + other.sum_yy.to(dev),
            self.n + other.n,
        )

    def check(self) -> None:
        """Raise if empty or if any sum holds NaN/Inf (an activation overflowed upstream)."""
        if self.n <= 0:
            raise AttnslimError("JointStats is empty (n=0): call update() with calibration activations first")
        for name in ("sum_x", "sum_y", "sum_xx", "sum_yx", "sum_yy"):
            if not bool(torch.isfinite(getattr(self, name)).all()):
                raise AttnslimError(
                    f"JointStats.{name} contains NaN/Inf after {self.n} tokens: an activation overflowed; "
                    "collect in float32/bfloat16 without overflow or check the model's inputs"
                )

    @property
    def mean_x(self) -> torch.Tensor:
        return self.sum_x / self.n  # (d_x,)

    @property
    def mean_y(self) -> torch.Tensor:
        return self.sum_y / self.n  # (d_y,)

    @property
    def cov_xx(self) -> torch.Tensor:
        c = self.sum_xx / self.n - torch.outer(self.mean_x, self.mean_x)  # (d_x, d_x)
        return 0.5 * (c + c.T)

    @property
    def cov_yx(self) -> torch.Tensor:
        return self.sum_yx / self.n - torch.outer(self.mean_y, self.mean_x)  # (d_y, d_x)

    @property
    def cov_yy(self) -> torch.Tensor:
        c = self.sum_yy / self.n - torch.outer(self.mean_y, self.mean_y)  # (d_y, d_y)
        return 0.5 * (c + c.T)


def require_tokens(n: int, d: int, window: int | None = None, what: str = "statistics") -> None:
    """Raise unless n ≥ d + 1: below that a centred d×d covariance from n tokens is singular."""
    need = d + 1
    if n >= need:
        return
    how = f"collect at least {need - n} more tokens"
    if window is not None and window > 0:
        how += f" (≥ {math.ceil(need / window)} windows of {window} tokens in total)"
    raise AttnslimError(
        f"too few tokens for {what}: n={n} but dimension d={d} needs n ≥ d+1={need}; {how}, "
        "or for lmmse_map raise the ridge (e.g. ridge=1e-2) and pass allow_few_tokens=True"
    )


def _inv_sqrt_psd(c: torch.Tensor, eig_floor: float) -> torch.Tensor:
    """C^{-1/2} = V diag(max(λ, floor)^{-1/2}) Vᵀ for symmetric PSD c (d, d); floor = eig_floor · λ_max."""
    lam, vec = torch.linalg.eigh(c)  # (d,), (d, d)
    top = float(lam[-1].clamp_min(0.0))
    if top <= 0.0:
        raise AttnslimError("covariance is zero (constant activations): canonical correlations are undefined")
    lam = lam.clamp_min(eig_floor * top)
    return (vec * lam.rsqrt()) @ vec.T


def canonical_correlations(
    stats: JointStats, residual: bool = True, eig_floor: float = 1e-10
) -> torch.Tensor:
    """Canonical correlations ρ (min(d_x, d_y),) in [0, 1], descending, of (Y+ = Y + X, X), or of (Y, X).

    Algorithm 2 of NBL: C_W = C_{Y+Y+}^{-1/2} C_{Y+X} C_XX^{-1/2}; ρ = singular values of C_W.
    """
    stats.check()
    require_tokens(stats.n, max(stats.d_x, stats.d_y), what="canonical correlations")
    c_xx, c_yx, c_yy = stats.cov_xx, stats.cov_yx, stats.cov_yy
    if residual:
        if stats.d_x != stats.d_y:
            raise AttnslimError(
                f"residual=True needs d_x == d_y (Y+ = Y + X), got d_x={stats.d_x}, d_y={stats.d_y}; "
                "pass residual=False"
            )
        # Cov(Y+X, Y+X) = C_YY + C_YX + C_XY + C_XX; Cov(Y+X, X) = C_YX + C_XX
        c_yy = c_yy + c_yx + c_yx.T + c_xx
        c_yx = c_yx + c_xx
    c_w = _inv_sqrt_psd(c_yy, eig_floor) @ c_yx @ _inv_sqrt_psd(c_xx, eig_floor)  # (d_y, d_x)
    return torch.linalg.svdvals(c_w).clamp(0.0, 1.0)


def cca_bound(stats: JointStats, residual: bool = True, eig_floor: float = 1e-10) -> float:
    """NBL's layer score Σ_i (1 − ρ_i²) ∈ [0, min(d_x, d_y)]: lower = more linear."""
    rho = canonical_correlations(stats, residual=residual, eig_floor=eig_floor)
    return float((1.0 - rho.square()).sum())


@dataclass(frozen=True)
class LmmseInfo:
    """Diagnostics of an LMMSE solve; `nmse` is the in-sample E‖Y − WX − b‖² / tr(C_YY)."""

    n_tokens: int
    ridge_abs: float  # δ added to the diagonal of C_XX
    eig_min: float  # smallest eigenvalue of C_XX (before the ridge)
    eig_max: float
    cond: float  # λ_max / λ_min of C_XX (inf when singular)
    cond_ridged: float  # (λ_max + δ) / (λ_min + δ): the conditioning actually solved
    nmse: float


def lmmse_map(
    stats: JointStats, ridge: float = 1e-6, allow_few_tokens: bool = False, affine: bool = True,
    prior: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, LmmseInfo]:
    """Affine LMMSE fit y ≈ W x + b: W (d_y, d_x) solves W (C_XX + δI) = C_YX, b (d_y,) = E[Y] − W E[X].
    affine=False (a target without a bias): y ≈ W x, W solving the same with the uncentred moments E[XXᵀ],
    E[YXᵀ], and b = 0. prior W₀ (d_y, d_x): the ridge pulls W towards W₀ instead of 0 (min E‖y − Wx − b‖² +
    δ‖W − W₀‖²: W (C_XX + δI) = C_YX + δ W₀), so directions the tokens barely excite keep W₀'s map.

    δ = ridge · tr(C_XX) / d_x (relative to the mean eigenvalue). Cholesky solve, never an explicit inverse.
    """
    if not ridge >= 0.0 or not math.isfinite(ridge):
        raise AttnslimError(f"ridge must be finite and ≥ 0 (relative to the mean eigenvalue), got {ridge}")
    stats.check()
    if not allow_few_tokens:
        require_tokens(stats.n, stats.d_x, what="lmmse_map")
    c_xx, c_yx = (stats.cov_xx, stats.cov_yx) if affine else (stats.sum_xx / stats.n, stats.sum_yx / stats.n)
    mean_eig = float(torch.trace(c_xx)) / stats.d_x
    if mean_eig <= 0.0:
        raise AttnslimError("C_XX is zero (X is constant over all tokens): no linear map can be fitted")
    delta = ridge * mean_eig
    lam = torch.linalg.eigvalsh(c_xx)  # (d_x,) ascending
    lo, hi = float(lam[0]), float(lam[-1])
    eye = torch.eye(stats.d_x, dtype=_F64, device=c_xx.device)
    chol, info = torch.linalg.cholesky_ex(c_xx + delta * eye)  # (d_x, d_x) lower
    if int(info) != 0:
        raise AttnslimError(
            f"C_XX + ridge·I is not positive definite (ridge={ridge}, λ_min={lo:.3e}, λ_max={hi:.3e}); "
            "raise the ridge (e.g. 1e-4) or collect more tokens"
        )
    # C_XX symmetric: W C = C_YX  <=>  C Wᵀ = C_XY
    rhs = c_yx if prior is None else c_yx + delta * prior.to(c_yx.device, _F64)  # (d_y, d_x)
    w = torch.cholesky_solve(rhs.T.contiguous(), chol).T.contiguous()  # (d_y, d_x)
    b = stats.mean_y - w @ stats.mean_x if affine else torch.zeros_like(stats.mean_y)  # (d_y,)
    info_out = LmmseInfo(
        n_tokens=stats.n,
        ridge_abs=delta,
        eig_min=lo,
        eig_max=hi,
        cond=hi / lo if lo > 0.0 else math.inf,
        cond_ridged=(hi + delta) / (lo + delta) if lo + delta > 0.0 else math.inf,
        nmse=linear_fit_nmse(stats, w, b),
    )
    return w, b, info_out


def linear_fit_nmse(stats: JointStats, w: torch.Tensor, b: torch.Tensor) -> float:
    """E‖Y − W X − b‖² / tr(C_YY) over the tokens in `stats`, in closed form from the sums alone.

    With e = Y − WX − b: E‖e‖² = tr(C_YY − 2 W C_XY + W C_XX Wᵀ) + ‖E[Y] − W E[X] − b‖².
    """
    stats.check()
    if tuple(w.shape) != (stats.d_y, stats.d_x) or tuple(b.shape) != (stats.d_y,):
        raise AttnslimError(
            f"linear_fit_nmse expects W ({stats.d_y}, {stats.d_x}) and b ({stats.d_y},), "
            f"got W {tuple(w.shape)} and b {tuple(b.shape)}"
        )
    dev = stats.sum_x.device
    w64, b64 = w.detach().to(dev, _F64), b.detach().to(dev, _F64)
    c_yy_tr = float(torch.trace(stats.cov_yy))
    if c_yy_tr <= 0.0:
        raise AttnslimError("tr(C_YY) is zero (Y is constant over all tokens): the NMSE is undefined")
    cross = float((w64 * stats.cov_yx).sum())  # tr(W C_XY)
    quad = float(((w64 @ stats.cov_xx) * w64).sum())  # tr(W C_XX Wᵀ)
    bias = stats.mean_y - w64 @ stats.mean_x - b64  # (d_y,)
    mse = c_yy_tr - 2.0 * cross + quad + float(bias.square().sum())
    return max(mse, 0.0) / c_yy_tr  # the sum cancels to ~1e-16 relative for an exact fit

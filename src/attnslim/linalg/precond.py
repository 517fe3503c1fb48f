"""Pre-conditioners for activation-aware low-rank factorisation (LatentLLM §3.2, Table 1, App. B.1).

A pre-conditioner P turns the activation loss ``E‖(W − BA)x‖²`` into a weighted matrix problem
``svd_r[W P]``; every factorisation in this package then maps back with ``P⁻¹``. Only the root
covariance ``P = (C + λI)^{1/2}`` is optimal (it makes the two losses equal); the others are the
baselines of the paper's Table 1.

Statistics are streamed sums over calibration tokens (tokens never stored): ``Sxx = Σ x xᵀ``,
``sx = Σ x``, ``ax = Σ |x|`` and the token count ``n``. All math runs in float64.

Damping: ``λ = damp · mean(diag(C))`` with C the per-token (÷n) correlation or centred covariance,
the relative "percdamp" rule of SparseGPT/SparseLLM (the paper gives no value).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from attnslim.errors import AttnslimError
from attnslim.linalg.stats import InputStats

PrecondKind = Literal["identity", "hessian", "l1", "l2", "cov", "rootcov"]
PRECOND_KINDS: tuple[str, ...] = ("identity", "hessian", "l1", "l2", "cov", "rootcov")

# Eigenvalues below this fraction of the largest count as zero when judging rank deficiency.
_RANK_TOL = 1e-9


@dataclass(frozen=True)
class Precond:
    """A symmetric pre-conditioner and its inverse.

    p, p_inv: (d,) diagonal entries for the diagonal kinds (identity, hessian, l1, l2) or
    (d, d) symmetric matrices for cov / rootcov. Use `right` / `right_inv` and never branch
    on the kind. `lam` is the damping added to C (0 where the kind has none).
    """

    kind: str
    p: torch.Tensor
    p_inv: torch.Tensor
    lam: float

    @property
    def diagonal(self) -> bool:
        return self.p.ndim == 1

    def right(self, w: torch.Tensor) -> torch.Tensor:
        """(m, d) -> (m, d): W P."""
        return w * self.p if self.diagonal else w @ self.p

    def right_inv(self, m: torch.Tensor) -> torch.Tensor:
        """(m, d) -> (m, d): M P⁻¹."""
        return m * self.p_inv if self.diagonal else m @ self.p_inv

    def matrix(self) -> torch.Tensor:
        """(d, d) dense P."""
        return torch.diag(self.p) if self.diagonal else self.p

    def inv_matrix(self) -> torch.Tensor:
        """(d, d) dense P⁻¹."""
        return torch.diag(self.p_inv) if self.diagonal else self.p_inv


@dataclass(frozen=True)
class PrecondSpec:
    """Which pre-conditioner of Table 1 a fit whitens with, and its settings (`preconditioner` builds it).

    kind: one of PRECOND_KINDS;  damp: λ = damp · mean(diag C) (the kinds that damp);  alpha: the l1 kind's
    exponent (ASVD). Whether C is centred is not part of it: that follows the linear's bias, per call."""

    kind: str = "rootcov"
    damp: float = 1e-2
    alpha: float = 0.5

    def build(self, stats: InputStats, *, center: bool = False, label: str = "layer") -> Precond:
        """`preconditioner(stats, kind, damp=, alpha=, center=, label=)`: built once per statistics and settings."""
        return preconditioner(stats, self.kind, damp=self.damp, alpha=self.alpha, center=center, label=label)


ROOTCOV = PrecondSpec()  # the default: LatentLLM's root covariance, damp 1e-2


def damped_eigh(
    c: torch.Tensor, damp: float, *, label: str = "layer", n: int | None = None, warn: bool = True
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Eigen-decomposition of a PSD matrix with relative damping.

    c: (d, d) symmetric PSD. Returns (e (d,) ascending, q (d, d) eigenvectors as columns, λ) with
    e = max(eig(c), 0) + λ and λ = damp · mean(diag(c)). Warns (naming `label`) when c is a rank-deficient
    input covariance, because then λ alone decides the factors in directions the calibration never saw;
    `warn=False` for weights whose null space is expected and carries no error (the caller says why). Raises
    if c is rank-deficient and undamped (P⁻¹ would not exist).
    """
    if damp < 0:
        raise AttnslimError(f"{label}: damp = {damp} must be >= 0 (relative damping, typical 1e-4..1e-2)")
    c64 = c.to(torch.float64)
    c64 = 0.5 * (c64 + c64.T)
    e, q = torch.linalg.eigh(c64)  # ascending
    e = e.clamp_min(0.0)
    top = float(e[-1]) if e.numel() else 0.0
    d = c64.shape[0]
    num_rank = int((e > _RANK_TOL * max(top, 1e-300)).sum())
    lam = damp * float(torch.diagonal(c64).mean()) if d else 0.0
    if num_rank < d:
        tokens = f", {n} tokens" if n is not None else ""
        if lam <= 0.0:
            raise AttnslimError(
                f"{label}: input covariance is rank-deficient (numerical rank {num_rank} of {d}{tokens}) "
                f"and damp = {damp}; use damp > 0 (e.g. 1e-2) or collect more calibration tokens"
            )
        if warn:
            warnings.warn(
                f"{label}: input covariance is rank-deficient (numerical rank {num_rank} of {d}{tokens}); "
                f"damping λ = {lam:.3g} (damp = {damp}) decides the factors in the null space",
                stacklevel=3,
            )
    return e + lam, q, lam


def root_pair(
    c: torch.Tensor, damp: float, *, label: str = "layer", n: int | None = None, warn: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d, d) PSD c -> ((c + λI)^{1/2}, (c + λI)^{-1/2}), both (d, d) symmetric, via one eigh (`damped_eigh`)."""
    e, q, _ = damped_eigh(c, damp, label=label, n=n, warn=warn)
    s = e.sqrt()
    return (q * s) @ q.T, (q / s) @ q.T


def preconditioner(
    stats: InputStats,
    kind: str = "rootcov",
    *,
    damp: float = 1e-2,
    alpha: float = 0.5,
    center: bool = False,
    label: str = "layer",
) -> Precond:
    """Build the pre-conditioner `kind` of Table 1 from streamed statistics.

    C = Sxx/n (or the centred covariance C0 when `center`, the optimum for layers with a bias, Eq. 46-48).
      identity: P = I                                  (plain SVD, no statistics)
      hessian:  P_jj = ([(C + λI)⁻¹]_jj)^{-1/2}        (OBS/GPTQ-style diagonal)
      l1:       P_jj = (Σ|x_j|)^alpha                  (ASVD/AWQ; `center` does not apply)
      l2:       P_jj = diag(C)_jj^{1/2}                (WandA)
      cov:      P = C + λI                             (CorDA)
      rootcov:  P = (C + λI)^{1/2}                     (LatentLLM; optimal for the activation loss)
    Diagonal kinds return (d,) vectors; zero entries (dead input channels) are floored at
    damp · mean(p) with a warning, since any value gives the same loss on those channels.
    Built once per statistics tensor and settings, and shared: the linears that read one site (q/k/v, gate/up)
    and a method's planning and conversion get the same object (one eigh instead of one per matrix and pass);
    a rank-deficiency warning therefore names the first linear that asked. Treat the result as read-only.
    """
    if kind not in PRECOND_KINDS:
        raise AttnslimError(f"{label}: precond = {kind!r} is not one of {PRECOND_KINDS}")
    if stats.n == 0:
        raise AttnslimError(f"{label}: no calibration tokens reached this linear's input; check the calibration")
    key = (kind, damp, alpha, center, stats.n)
    built = _BUILT.setdefault(stats.sxx, {})
    if key not in built:  # q/k/v (and gate/up) read one site: one eigh for all, plan and conversion alike
        built[key] = _build(stats, kind, damp=damp, alpha=alpha, center=center, label=label)
    return built[key]


# preconditioners already built, per statistics tensor (weakly held: they go with the statistics); the key holds
# the token count, so statistics still accumulating are never served a stale entry
_BUILT = WeakTensorKeyDictionary()  # torch's weak dictionary for tensor keys (identity, not value, equality)


def _build(stats: InputStats, kind: str, *, damp: float, alpha: float, center: bool, label: str) -> Precond:
    d = stats.dim
    c = stats.centred_cov if center else stats.corr  # (d, d)
    if kind == "identity":
        one = torch.ones(d, dtype=torch.float64, device=c.device)
        return Precond(kind, one, one, 0.0)
    if kind in ("l1", "l2"):
        base = stats.ax.to(torch.float64) / stats.n if kind == "l1" else torch.diagonal(c).clamp_min(0.0)
        p = base.pow(alpha if kind == "l1" else 0.5)  # (d,)
        return _diag_precond(kind, p, damp, label)
    e, q, lam = damped_eigh(c, damp, label=label, n=stats.n)
    if kind == "hessian":
        h_inv_diag = ((q * (1.0 / e)) * q).sum(1)  # (d,) diag of (C + λI)⁻¹
        p = h_inv_diag.rsqrt()
        return Precond(kind, p, 1.0 / p, lam)
    power = 1.0 if kind == "cov" else 0.5
    return Precond(kind, (q * e.pow(power)) @ q.T, (q * e.pow(-power)) @ q.T, lam)


def _diag_precond(kind: str, p: torch.Tensor, damp: float, label: str) -> Precond:
    dead = p <= 0
    if bool(dead.any()):
        floor = damp * float(p.mean())
        if floor <= 0.0:
            raise AttnslimError(f"{label}: precond {kind!r} is zero on every input channel (all-zero input)")
        warnings.warn(
            f"{label}: {int(dead.sum())} of {p.numel()} input channels are never active; "
            f"precond {kind!r} floors them at {floor:.3g} (damp = {damp})",
            stacklevel=3,
        )
        p = torch.where(dead, torch.full_like(p, floor), p)
    return Precond(kind, p, 1.0 / p, 0.0)

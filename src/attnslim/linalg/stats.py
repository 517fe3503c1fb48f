"""Streaming float64 input statistics: mergeable, padding-aware; never hold activations.

`InputStats` accumulates, for inputs x of one site (tokens as rows): Σ x xᵀ (d, d), Σ x (d), Σ |x| (d) and the
token count n. It is the one statistics type of a linear's input: collectors fill it during calibration, and the
linear algebra (linalg/precond.py and every factorisation) reads its moments. `JointStats` (NBL's input/output
pair) lives in linalg/cca.py and follows the same update/merge contract. Both are plain tensors and sums (no hooks,
no model), so they sit in linalg, below calib/ which fills them: linalg imports nothing of calibration.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnslim.errors import AttnslimError

_F64 = torch.float64


def flatten_tokens(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """(b, t, d) activations and optional (b, t) bool mask (True = real token) -> (N, d) float64."""
    x2 = x.reshape(-1, x.shape[-1]).to(_F64)
    if mask is not None:
        x2 = x2[mask.reshape(-1).to(torch.bool)]
    return x2


@dataclass
class InputStats:
    """First and second moments of one site's input, streamed (float64).

    sxx: (d, d) Σ x xᵀ;  sx: (d,) Σ x;  ax: (d,) Σ |x| (elementwise);  n: number of tokens.
    `update` adds a batch in place; the moments (`mean`, `corr`, `centred_cov`) are per token. A consumer calls
    `check(where)` before using them: it names the site when no token reached it or the sums are not finite.
    """

    sxx: torch.Tensor
    sx: torch.Tensor
    ax: torch.Tensor
    n: int

    def __post_init__(self) -> None:
        d = self.sxx.shape[0]
        if self.sxx.shape != (d, d) or self.sx.shape != (d,) or self.ax.shape != (d,):
            raise AttnslimError(
                f"InputStats shapes disagree: sxx {tuple(self.sxx.shape)}, sx {tuple(self.sx.shape)}, "
                f"ax {tuple(self.ax.shape)}; expected (d, d), (d,), (d,)"
            )
        if self.n < 0:
            raise AttnslimError(f"InputStats.n = {self.n}: a token count is >= 0")

    @classmethod
    def empty(cls, dim: int) -> InputStats:
        z = torch.zeros(dim, dtype=_F64)
        return cls(torch.zeros(dim, dim, dtype=_F64), z.clone(), z.clone(), 0)

    @classmethod
    def from_tokens(cls, x: torch.Tensor) -> InputStats:
        """x: (..., d) activations, every row a token."""
        x64 = x.reshape(-1, x.shape[-1]).to(_F64)  # (N, d)
        return cls(sxx=x64.T @ x64, sx=x64.sum(0), ax=x64.abs().sum(0), n=x64.shape[0])

    def update(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Add the tokens of x (b, t, d) (or (N, d)); `mask` (b, t) drops padding. The tokens come to the stats'
        device (CPU unless made elsewhere), as JointStats does: calibration on a GPU used to fail here."""
        dev = self.sxx.device
        x2 = flatten_tokens(x.to(dev), None if mask is None else mask.to(dev))
        self.sxx += x2.T @ x2
        self.sx += x2.sum(0)
        self.ax += x2.abs().sum(0)
        self.n += x2.shape[0]

    def merge(self, other: InputStats) -> InputStats:
        return InputStats(self.sxx + other.sxx, self.sx + other.sx, self.ax + other.ax, self.n + other.n)

    def check(self, where: str) -> None:
        """Raise if no token reached this site or the sums are not finite, naming the layer/site."""
        if self.n == 0:
            raise AttnslimError(f"{where}: no calibration tokens reached this site; check the calibration data")
        if not (torch.isfinite(self.sxx).all() and torch.isfinite(self.sx).all()):
            raise AttnslimError(
                f"{where}: NaN/Inf in calibration statistics; the model produces non-finite activations "
                "here (try float32 and check the input windows)"
            )

    @property
    def dim(self) -> int:
        return int(self.sxx.shape[0])

    @property
    def mean(self) -> torch.Tensor:
        """(d,) token mean μ = Σx / n."""
        return self.sx.to(_F64) / max(self.n, 1)

    @property
    def corr(self) -> torch.Tensor:
        """(d, d) auto-correlation Sxx / n (what LatentLLM calls the "covariance")."""
        return self.sxx.to(_F64) / max(self.n, 1)

    @property
    def centred_cov(self) -> torch.Tensor:
        """(d, d) centred covariance C0 = Sxx/n − μμᵀ (LatentLLM Eq. 49), symmetrised."""
        mu = self.mean
        c0 = self.corr - torch.outer(mu, mu)
        return 0.5 * (c0 + c0.T)

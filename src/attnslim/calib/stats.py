"""Streaming float64 statistics: mergeable, padding-aware; never hold activations.

`GramStats` accumulates, for inputs x (tokens as rows):  Σ x xᵀ (d,d), Σ x (d), Σ |x| (d), n tokens.
`JointStats` (for NBL) lives in linalg/cca.py and follows the same update/merge contract.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnslim.errors import AttnslimError


def flatten_tokens(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """(b, t, d) activations and optional (b, t) bool mask (True = real token) -> (N, d) float64."""
    x2 = x.reshape(-1, x.shape[-1]).to(torch.float64)
    if mask is not None:
        x2 = x2[mask.reshape(-1).to(torch.bool)]
    return x2


@dataclass
class GramStats:
    sxx: torch.Tensor  # (d, d) Σ x xᵀ
    sx: torch.Tensor  # (d,) Σ x
    ax: torch.Tensor  # (d,) Σ |x|
    n: int

    @classmethod
    def empty(cls, dim: int) -> GramStats:
        z = torch.zeros(dim, dtype=torch.float64)
        return cls(torch.zeros(dim, dim, dtype=torch.float64), z.clone(), z.clone(), 0)

    def update(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        x2 = flatten_tokens(x, mask)
        self.sxx += x2.T @ x2
        self.sx += x2.sum(0)
        self.ax += x2.abs().sum(0)
        self.n += x2.shape[0]

    def merge(self, other: GramStats) -> GramStats:
        return GramStats(self.sxx + other.sxx, self.sx + other.sx, self.ax + other.ax, self.n + other.n)

    @property
    def dim(self) -> int:
        return int(self.sx.shape[0])

    @property
    def mean(self) -> torch.Tensor:
        return self.sx / max(self.n, 1)

    @property
    def corr(self) -> torch.Tensor:
        """E[x xᵀ] (the paper's "covariance": the un-centred auto-correlation)."""
        return self.sxx / max(self.n, 1)

    @property
    def cov(self) -> torch.Tensor:
        """Centred covariance E[(x-μ)(x-μ)ᵀ]."""
        mu = self.mean
        return self.corr - torch.outer(mu, mu)

    def check(self, where: str) -> None:
        """Raise if the statistics are empty or not finite, naming the layer/site."""
        if self.n == 0:
            raise AttnslimError(f"{where}: no calibration tokens reached this site; check the calibration data")
        if not (torch.isfinite(self.sxx).all() and torch.isfinite(self.sx).all()):
            raise AttnslimError(
                f"{where}: NaN/Inf in calibration statistics; the model produces non-finite activations "
                "here (try float32 and check the input windows)"
            )

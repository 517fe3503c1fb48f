"""`LowRankLinear`: y = B (A x) + b, optionally with a block-identity A stored as an index + A2.

Block identity (LatentLLM §3.3): A[:, perm[:r]] = I_r, so A x = x[perm[:r]] + A2 x[perm[r:]] and the
layer stores r(d_out + d_in) − r² weights — the identity block is neither stored nor multiplied.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from attnslim.errors import AttnslimError
from attnslim.modules.cpu_linear import linear
from attnslim.registry import register_module


@register_module
class LowRankLinear(nn.Module):
    perm: torch.Tensor  # (d_in,) long; only meaningful with block_identity
    linear_kernel = "torch"  # or "onednn": modules/cpu_linear.set_cpu_linear

    def __init__(
        self, in_features: int, out_features: int, rank: int, bias: bool, block_identity: bool,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if not 0 < rank <= min(in_features, out_features):
            raise AttnslimError(
                f"rank={rank} out of range for a {out_features}x{in_features} linear; "
                f"use 1..{min(in_features, out_features)}"
            )
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.block_identity = block_identity
        a_cols = in_features - rank if block_identity else in_features
        self.a = nn.Parameter(torch.zeros(rank, a_cols, dtype=dtype))  # (r, d_in [- r])
        self.b = nn.Parameter(torch.zeros(out_features, rank, dtype=dtype))  # (d_out, r)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        # perm[:r] = identity columns, perm[r:] = columns multiplied by A2 (stored, not trained)
        self.register_buffer("perm", torch.arange(in_features) if block_identity else None)

    @classmethod
    def from_factors(cls, factors: Any, dtype: torch.dtype) -> LowRankLinear:
        """Build from `attnslim.linalg.lowrank.LowRankFactors` (B, A, bias, perm)."""
        d_out, r = factors.B.shape
        d_in = factors.A.shape[1]
        mod = cls(d_in, d_out, r, factors.bias is not None, factors.perm is not None, dtype)
        with torch.no_grad():
            mod.b.copy_(factors.B)
            mod.a.copy_(factors.a2 if factors.perm is not None else factors.A)
            if factors.bias is not None and mod.bias is not None:
                mod.bias.copy_(factors.bias)
            if factors.perm is not None:
                mod.perm.copy_(factors.perm)
        return mod

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d_in) -> (..., r) = A x."""
        if not self.block_identity:
            return linear(x, self.a, None, self.linear_kernel)
        r = self.rank
        return x.index_select(-1, self.perm[:r]) + linear(x.index_select(-1, self.perm[r:]), self.a, None,
                                                          self.linear_kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.latent(x), self.b, self.bias, self.linear_kernel)

    def dense_latent(self) -> torch.Tensor:
        """(r, d_in) A as one matrix, the block identity written out."""
        return self.latent(torch.eye(self.in_features, dtype=self.b.dtype, device=self.b.device)).T

    def dense_weight(self) -> torch.Tensor:
        """(d_out, d_in) B A, for tests and analysis."""
        eye = torch.eye(self.in_features, dtype=self.b.dtype, device=self.b.device)
        return self.forward(eye).T - (0 if self.bias is None else self.bias[:, None])

    def extra_repr(self) -> str:
        kind = "block-identity" if self.block_identity else "dense factors"
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, {kind}"


def is_full_rank(rank: int, out_features: int, in_features: int) -> bool:
    """At r = min(d_out, d_in), B A is a general d_out×d_in matrix: a factorised layer saves nothing."""
    return rank >= min(out_features, in_features)


def compact_linear(factors: Any, dtype: torch.dtype) -> nn.Module:
    """The factors as a `LowRankLinear`, or at full rank as the same map in one dense `nn.Linear` (B A
    materialised): the same weights count with the block-identity junction, one matmul instead of two, and
    no latent index gathers — it decodes at dense speed."""
    mod = LowRankLinear.from_factors(factors, dtype)
    if not is_full_rank(mod.rank, mod.out_features, mod.in_features):
        return mod
    dense = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None, dtype=dtype)
    with torch.no_grad():
        dense.weight.copy_(mod.dense_weight())
        if mod.bias is not None and dense.bias is not None:
            dense.bias.copy_(mod.bias)
    return dense


def empty_compact_linear(in_features: int, out_features: int, rank: int, bias: bool, block_identity: bool,
                         dtype: torch.dtype) -> nn.Module:
    """The empty module `compact_linear` builds for this shape and rank (for loading)."""
    if is_full_rank(rank, out_features, in_features):
        return nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    return LowRankLinear(in_features, out_features, rank, bias, block_identity, dtype)

"""`LowRankLinear`: y = B (A x) + b, dense factors or one of three junction forms that store r(d_out + d_in) − r².

  block_identity       (LatentLLM §3.3) A[:, perm[:r]] = I_r: A x = x[perm[:r]] + A2 x[perm[r:]]; the identity
                       block is neither stored nor multiplied.
  left_block_identity  (Remark 5-i) B[out_perm[:r]] = I_r: y[out_perm[:r]] = z, y[out_perm[r:]] = B2 z (z = A x).
  lu                   (Remark 5-ii) A[:, perm[:r]] = U upper-, B[out_perm[:r]] = L unit lower-triangular, packed
                       in one (r, r) `lu` (U on and above the diagonal, L below; L's unit diagonal implicit), as
                       LAPACK packs an LU; the triangles are applied as masked dense matmuls (the weights are
                       stored once; the MAC saving of the triangles is not realised by torch's kernels).
`out_index` (d_out,) is the inverse of out_perm, so y = cat([top, B2 z])[out_index] is one gather.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from attnslim.errors import AttnslimError
from attnslim.modules.cpu_linear import linear
from attnslim.registry import register_module

FORMS = ("dense", "block_identity", "left_block_identity", "lu")


@register_module
class LowRankLinear(nn.Module):
    perm: torch.Tensor  # (d_in,) long; forms block_identity and lu
    out_index: torch.Tensor  # (d_out,) long, inverse of out_perm; forms left_block_identity and lu
    linear_kernel = "torch"  # or "onednn": modules/cpu_linear.set_cpu_linear

    def __init__(
        self, in_features: int, out_features: int, rank: int, bias: bool, block_identity: bool,
        dtype: torch.dtype = torch.float32, *, form: str | None = None,
    ) -> None:
        """form (FORMS) overrides block_identity when given: "dense" | "block_identity" | "left_block_identity" |
        "lu"."""
        super().__init__()
        form = form if form is not None else ("block_identity" if block_identity else "dense")
        if form not in FORMS:
            raise AttnslimError(f"LowRankLinear form={form!r} is invalid; valid: {FORMS}")
        if not 0 < rank <= min(in_features, out_features):
            raise AttnslimError(
                f"rank={rank} out of range for a {out_features}x{in_features} linear; "
                f"use 1..{min(in_features, out_features)}"
            )
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.form, self.block_identity = form, form == "block_identity"
        pivot_a, pivot_b = form in ("block_identity", "lu"), form in ("left_block_identity", "lu")
        self.a = nn.Parameter(torch.zeros(rank, in_features - rank * pivot_a, dtype=dtype))  # (r, d_in [- r])
        self.b = nn.Parameter(torch.zeros(out_features - rank * pivot_b, rank, dtype=dtype))  # (d_out [- r], r)
        self.lu = nn.Parameter(torch.zeros(rank, rank, dtype=dtype)) if form == "lu" else None  # packed U and L
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        # perm[:r] = structural columns of A, perm[r:] = columns multiplied by A2 (stored, not trained)
        self.register_buffer("perm", torch.arange(in_features) if pivot_a else None)
        self.register_buffer("out_index", torch.arange(out_features) if pivot_b else None)

    @classmethod
    def from_factors(cls, factors: Any, dtype: torch.dtype) -> LowRankLinear:
        """Build from `attnslim.linalg.lowrank.LowRankFactors` (B, A, bias, perm)."""
        d_out, r = factors.B.shape
        d_in = factors.A.shape[1]
        form = factors.form
        mod = cls(d_in, d_out, r, factors.bias is not None, form == "block_identity", dtype, form=form)
        with torch.no_grad():
            mod.b.copy_(factors.b2 if factors.out_perm is not None else factors.B)
            mod.a.copy_(factors.a2 if factors.perm is not None else factors.A)
            if factors.bias is not None and mod.bias is not None:
                mod.bias.copy_(factors.bias)
            if factors.perm is not None:
                mod.perm.copy_(factors.perm)
            if factors.out_perm is not None:
                mod.out_index.copy_(torch.argsort(factors.out_perm))
            if mod.lu is not None:  # U on and above the diagonal, L strictly below
                assert factors.perm is not None and factors.out_perm is not None
                upper = factors.A[:, factors.perm[:r]].triu()
                mod.lu.copy_(upper + factors.B[factors.out_perm[:r]].tril(-1))
        return mod

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d_in) -> (..., r) = A x."""
        if self.perm is None:
            return linear(x, self.a, None, self.linear_kernel)
        r = self.rank
        rest = linear(x.index_select(-1, self.perm[r:]), self.a, None, self.linear_kernel)
        head = x.index_select(-1, self.perm[:r])
        return head + rest if self.lu is None else linear(head, self.lu.triu(), None, self.linear_kernel) + rest

    def decompress(self, z: torch.Tensor) -> torch.Tensor:
        """(..., r) latents -> (..., d_out) = B z + b."""
        if self.out_index is None:
            return linear(z, self.b, self.bias, self.linear_kernel)
        top = z if self.lu is None else z + linear(z, self.lu.tril(-1), None, self.linear_kernel)  # L z
        y = torch.cat([top, linear(z, self.b, None, self.linear_kernel)], -1).index_select(-1, self.out_index)
        return y if self.bias is None else y + self.bias

    def decompression(self) -> torch.Tensor:
        """(d_out, r) B as one matrix: the parameter itself for dense B, else the structure written out (for code
        that multiplies by B per head: LatentAttention's key and value paths)."""
        if self.out_index is None:
            return self.b
        eye = torch.eye(self.rank, dtype=self.b.dtype, device=self.b.device)
        return (self.decompress(eye) - (0 if self.bias is None else self.bias)).T

    def factor_weights(self) -> int:
        """Weights stored (= MACs per token; biases and indices not counted): r(d_out + d_in) [− r²]."""
        return self.a.numel() + self.b.numel() + (0 if self.lu is None else self.lu.numel())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decompress(self.latent(x))

    def dense_latent(self) -> torch.Tensor:
        """(r, d_in) A as one matrix, the block identity written out."""
        return self.latent(torch.eye(self.in_features, dtype=self.b.dtype, device=self.b.device)).T

    def dense_weight(self) -> torch.Tensor:
        """(d_out, d_in) B A, for tests and analysis."""
        eye = torch.eye(self.in_features, dtype=self.b.dtype, device=self.b.device)
        return self.forward(eye).T - (0 if self.bias is None else self.bias[:, None])

    def extra_repr(self) -> str:
        kind = "dense factors" if self.form == "dense" else self.form.replace("_", "-")
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
                         dtype: torch.dtype, form: str | None = None) -> nn.Module:
    """The empty module `compact_linear` builds for this shape and rank (for loading); form as LowRankLinear's."""
    if is_full_rank(rank, out_features, in_features):
        return nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    return LowRankLinear(in_features, out_features, rank, bias, block_identity, dtype, form=form)

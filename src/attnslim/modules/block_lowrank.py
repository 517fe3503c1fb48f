"""`BlockLowRankLinear`: y = blockdiag(B_1, ..., B_h) (A x) + b, the split-head factors of LatentLLM App. D.

A (r, d_in) = [A_1; ...; A_h] is stored whole (dense factors: the split-head fit has no junction), B as its h
diagonal blocks b (h, d_out/h, r/h), never as a zero-padded (d_out, r) matrix: weights r d_in + d_out r / h.
A subclass of LowRankLinear, so LatentAttention takes it as the key latent (the cached c_k = A x) and reads
`decompression()` (the block-diagonal B written out) on its key path.
"""

from __future__ import annotations

import torch
from torch import nn

from attnslim.errors import AttnslimError
from attnslim.linalg.lowrank import LowRankFactors
from attnslim.modules.lowrank import LowRankLinear
from attnslim.registry import register_module


@register_module
class BlockLowRankLinear(LowRankLinear):
    def __init__(self, in_features: int, out_features: int, rank: int, n_heads: int, bias: bool,
                 dtype: torch.dtype = torch.float32) -> None:
        """n_heads must divide out_features and rank (each head: d_out/h rows, rank r/h)."""
        if n_heads < 1 or out_features % n_heads or rank % n_heads:
            raise AttnslimError(
                f"BlockLowRankLinear: n_heads={n_heads} must divide out_features={out_features} and rank={rank}; "
                f"use a rank that is a multiple of {n_heads}")
        super().__init__(in_features, out_features, rank, bias, False, dtype, form="dense")
        self.n_heads = n_heads
        self.b = nn.Parameter(torch.zeros(n_heads, out_features // n_heads, rank // n_heads, dtype=dtype))

    @classmethod
    def from_block_factors(cls, factors: LowRankFactors, n_heads: int, dtype: torch.dtype) -> BlockLowRankLinear:
        """From split_head_factorize's factors (B (d_out, r) block-diagonal, A (r, d_in)); refuses a B with
        anything off its diagonal blocks (that would not be the split-head form)."""
        d_out, r = factors.B.shape
        mod = cls(factors.A.shape[1], d_out, r, n_heads, factors.bias is not None, dtype)
        rows, r_h = d_out // n_heads, r // n_heads
        blocks = torch.stack([factors.B[i * rows:(i + 1) * rows, i * r_h:(i + 1) * r_h] for i in range(n_heads)])
        if not torch.equal(torch.block_diag(*blocks), factors.B):
            raise AttnslimError("BlockLowRankLinear: B has entries off its diagonal blocks; not split-head factors")
        with torch.no_grad():
            mod.b.copy_(blocks)
            mod.a.copy_(factors.A)
            if factors.bias is not None and mod.bias is not None:
                mod.bias.copy_(factors.bias)
        return mod

    def decompress(self, z: torch.Tensor) -> torch.Tensor:
        """(..., r) -> (..., d_out): head i's rows from its r/h latents only."""
        zh = z.unflatten(-1, (self.n_heads, -1))  # (..., h, r/h)
        y = torch.einsum("...hr,hor->...ho", zh, self.b).flatten(-2)  # (..., d_out)
        return y if self.bias is None else y + self.bias

    def decompression(self) -> torch.Tensor:
        """(d_out, r) block-diagonal B written out (LatentAttention's per-head key path)."""
        return torch.block_diag(*self.b.unbind(0))

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, rank={self.rank}, split-head h={self.n_heads} "
                "(block-diagonal B)")

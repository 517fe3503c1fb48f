"""Split-head activation-aware low-rank factorisation, LatentLLM App. D (Eq. 53-54): the paper's ablation.

Approximated: y = W x + b with W's rows split into h heads W_i (d_out/h, d_in), each by its own rank-r/h
activation-aware SVD (linalg.lowrank.factorize on the layer's input statistics): B = blockdiag(B_1, ..., B_h)
(d_out, r), A = [A_1; ...; A_h] (r, d_in). Loss: Σ_i E‖(W_i − B_i A_i) x‖², the sum of each head's spectral tail
Σ_{j>r/h} σ_j²(W_i C^{1/2}) (RootCov). Weights: r d_in + d_out r / h (B's off-diagonal blocks are zero).
Fig. 9: "terrible performance" beside full-matrix ASVD: the full problem's optimum is at least as good at the
same rank, since a block-diagonal B is one of its feasible points.
No junction: a per-head J_i would save Σ (r/h)² = r²/h, the paper's App. D counts none. The method option is
latentllm's `qk: split_head` (modules/block_lowrank.BlockLowRankLinear stores the h blocks of B).
"""

from __future__ import annotations

import torch

from attnslim.errors import AttnslimError
from attnslim.linalg.lowrank import LowRankFactors, factorize
from attnslim.linalg.precond import ROOTCOV, PrecondSpec
from attnslim.linalg.stats import InputStats


def split_head_weights(d_out: int, d_in: int, rank: int, n_heads: int) -> int:
    """Weights of the split-head factors: A (r, d_in) whole, B's h diagonal blocks (d_out/h, r/h)."""
    return rank * d_in + d_out * rank // n_heads


def split_head_max_rank(d_out: int, d_in: int, n_heads: int) -> int:
    """Largest multiple of n_heads whose split-head factors hold no more weights than the dense matrix (at least
    n_heads: one rank per head), at most d_out (r/h <= d_out/h rows per head)."""
    return split_head_rank_for_ratio(d_out, d_in, 1.0, n_heads)


def split_head_rank_for_ratio(d_out: int, d_in: int, ratio: float, n_heads: int) -> int:
    """Largest multiple r of n_heads with r d_in + d_out r/h <= ratio · d_out · d_in (at least n_heads, at most
    min(d_out, h · d_in)): the split-head form's rank at a kept fraction."""
    per_head = n_heads * d_in + d_out  # weights of one rank in each head
    r_h = int(ratio * d_out * d_in // per_head)
    return n_heads * max(1, min(r_h, d_out // n_heads, d_in))


def split_head_factorize(
    w: torch.Tensor, b: torch.Tensor | None, stats: InputStats, rank: int, n_heads: int, *,
    precond: PrecondSpec = ROOTCOV, label: str = "layer",
) -> LowRankFactors:
    """w (d_out, d_in), b (d_out,) or None -> factors with block-diagonal B (d_out, r) and A (r, d_in) (float64).

    Each head i (rows i·d_out/h .. (i+1)·d_out/h) gets `factorize(W_i, b_i, stats, rank / h)` with dense factors;
    the bias is each head's b̂_i. Needs h | d_out and h | rank."""
    d_out, d_in = w.shape
    if n_heads < 1 or d_out % n_heads or rank % n_heads:
        raise AttnslimError(
            f"{label}: split-head needs n_heads ({n_heads}) to divide d_out ({d_out}) and the rank ({rank}); use a "
            f"rank that is a multiple of {n_heads}"
        )
    rows, r_h = d_out // n_heads, rank // n_heads
    heads = [
        factorize(w[i * rows : (i + 1) * rows], None if b is None else b[i * rows : (i + 1) * rows], stats, r_h,
                  precond=precond, junction="left", label=f"{label} head {i}")
        for i in range(n_heads)
    ]
    big_b = torch.block_diag(*[f.B for f in heads])  # (d_out, r)
    a = torch.cat([f.A for f in heads])  # (r, d_in)
    bias = None if b is None else torch.cat([f.bias for f in heads if f.bias is not None])
    return LowRankFactors(big_b, a, bias, None)

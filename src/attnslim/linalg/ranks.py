"""Rank arithmetic of a factor pair W (d_out, d_in) ≈ B (d_out, r) A (r, d_in): the one place that counts weights.

Weights stored (= MACs per token; biases and indices not counted): r (d_out + d_in) for dense factors, and
r (d_out + d_in) − r² with the block-identity junction (r columns of A are exactly I_r and never stored), and the
same with the left-block-identity (r rows of B are I_r) and LU-like (two r×r triangles, r² entries) junctions.
Every method that sizes factors by a kept fraction (the svd/asvd/svdllm baselines, latentllm's allocation) and
`LowRankFactors.param_count` use these functions, so a budget means the same thing everywhere.
"""

from __future__ import annotations

from attnslim.errors import AttnslimError

BLOCK_IDENTITY = "block_identity"
SAVES_SQUARE = (BLOCK_IDENTITY, "left_block_identity", "lu")  # junctions that save r² weights; every other junction
# stores both factors whole


def saves_square(junction: str) -> bool:
    """Whether a junction's factor pair stores r(d_out + d_in) − r² weights (True) or r(d_out + d_in)."""
    return junction in SAVES_SQUARE


def check_rank(rank: int, max_rank: int, name: str = "rank", label: str = "layer") -> None:
    """Raise naming the value and the valid range unless 1 <= rank <= max_rank."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise AttnslimError(f"{label}: {name} = {rank!r} is out of range; valid ranks are 1..{max_rank}")


def factor_weights(d_out: int, d_in: int, rank: int, junction: str) -> int:
    """Weights stored by a rank-`rank` factor pair of a d_out×d_in matrix."""
    dense = rank * (d_out + d_in)
    return dense - rank * rank if saves_square(junction) else dense


def max_rank(d_out: int, d_in: int, junction: str) -> int:
    """Largest rank whose factors hold no more weights than the dense d_out×d_in matrix."""
    if saves_square(junction):
        return min(d_out, d_in)  # r(d'+d) − r² <= d'd for every r <= min(d', d)
    return max(1, min(d_out * d_in // (d_out + d_in), d_out, d_in))


def rank_for_ratio(d_out: int, d_in: int, ratio: float, junction: str = "left") -> int:
    """Largest rank (at least 1, at most min(d_out, d_in)) whose factor weights are <= ratio·d_out·d_in."""
    budget = ratio * d_out * d_in
    if saves_square(junction):
        # r(d'+d) − r² <= budget  -> the smaller root of r² − (d'+d) r + budget = 0
        s = d_out + d_in
        r = int((s - (s * s - 4 * budget) ** 0.5) / 2) if s * s >= 4 * budget else min(d_out, d_in)
    else:
        r = int(budget // (d_out + d_in))
    return max(1, min(r, min(d_out, d_in)))

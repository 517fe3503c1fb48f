"""LatentLLM App. D split-head factorisation (notes §5, §13 property 12 "split-head ≪ full", paper Fig. 9) on
random data with the notes' synthetic input covariance (0.9^|i−j| correlation)."""

from __future__ import annotations

import pytest
import torch

from attnslim.errors import AttnslimError
from attnslim.linalg.lowrank import factorize
from attnslim.linalg.precond import PrecondSpec, preconditioner
from attnslim.linalg.split_head import split_head_factorize, split_head_weights
from attnslim.linalg.stats import InputStats

F64 = torch.float64
EXACT = PrecondSpec("rootcov", damp=1e-9)  # the optimum of the undamped activation loss
H, D = 4, 32

pytestmark = pytest.mark.usefixtures("one_thread")


def _problem(seed: int) -> tuple[torch.Tensor, InputStats, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    idx = torch.arange(D, dtype=F64)
    cov = 0.9 ** (idx[:, None] - idx[None]).abs()  # (D, D)
    x = torch.randn(2000, D, generator=gen, dtype=F64) @ torch.linalg.cholesky(cov).T  # (N, D)
    return x, InputStats.from_tokens(x), torch.randn(D, D, generator=gen, dtype=F64)


def _act_loss(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    return float(((x @ (w - w_hat).T) ** 2).sum())


def test_split_head_is_each_heads_optimum_with_a_block_diagonal_b():
    """Eq. 53-54: B is block-diagonal, the loss is the sum of each head's spectral tail at rank r/h, and the
    weights are r d + d' r / h."""
    x, st, w = _problem(0)
    r = 16
    f = split_head_factorize(w, None, st, r, H, precond=EXACT)
    rows, r_h = D // H, r // H
    for i in range(H):
        for j in range(H):
            block = f.B[i * rows : (i + 1) * rows, j * r_h : (j + 1) * r_h]
            assert (i == j) != bool(torch.equal(block, torch.zeros_like(block))), (i, j)
    p = preconditioner(st, "rootcov", damp=0.0)
    tails = sum(float((torch.linalg.svdvals(p.right(w[i * rows : (i + 1) * rows]))[r_h:] ** 2).sum())
                for i in range(H))
    assert _act_loss(x, w, f.weight()) == pytest.approx(tails * st.n, rel=1e-6)
    assert split_head_weights(D, D, r, H) == r * D + D * r_h == int((f.B != 0).sum()) + f.A.numel()


def test_split_head_with_bias_keeps_each_heads_bias_update():
    x, st, w = _problem(1)
    b = torch.randn(D, generator=torch.Generator().manual_seed(5), dtype=F64)
    f = split_head_factorize(w, b, st, 8, H)
    assert f.bias is not None
    rows = D // H
    for i in range(H):
        one = factorize(w[i * rows : (i + 1) * rows], b[i * rows : (i + 1) * rows], st, 2, junction="left")
        assert one.bias is not None and torch.allclose(f.bias[i * rows : (i + 1) * rows], one.bias, atol=1e-10)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_split_head_loses_to_full_matrix_asvd_even_at_equal_weights(seed):
    """Fig. 9 ("terrible performance"): at the same rank and at the same weight count (full ASVD then has a lower
    rank) the full-matrix activation-aware SVD has the lower activation loss."""
    x, st, w = _problem(seed)
    for r in (8, 16, 24):
        split = _act_loss(x, w, split_head_factorize(w, None, st, r, H, precond=EXACT).weight())
        same_rank = _act_loss(x, w, factorize(w, None, st, r, precond=EXACT, junction="left").weight())
        r_eq = split_head_weights(D, D, r, H) // (2 * D)  # dense factors: r (d' + d) weights
        same_weights = _act_loss(x, w, factorize(w, None, st, r_eq, precond=EXACT, junction="left").weight())
        assert same_rank < same_weights < split, (r, same_rank, same_weights, split)


def test_split_head_refuses_ranks_the_heads_do_not_divide():
    _, st, w = _problem(0)
    with pytest.raises(AttnslimError, match="divide d_out.*multiple of 4"):
        split_head_factorize(w, None, st, 10, H)

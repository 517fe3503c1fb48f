"""linalg/bias_fold.py: a bias folded into its weight by least squares over inputs that carry a common part."""

from __future__ import annotations

import torch

from attnslim.linalg.bias_fold import constant_fit, fold_bias


def _inputs(common_scale: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    common = torch.randn(16, generator=gen, dtype=torch.float64)
    return common_scale * common + 0.05 * torch.randn(4096, 16, generator=gen, dtype=torch.float64)  # (n, d)


def test_a_bias_folds_where_the_inputs_share_a_large_common_part() -> None:
    x = _inputs(1.0)
    a, rho = constant_fit(x.T @ x / len(x), x.mean(0))
    assert rho > 0.99 and float((1 - x @ a).abs().max()) < 0.2
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(8, 16, generator=gen, dtype=torch.float64), torch.randn(8, generator=gen, dtype=torch.float64)
    folded = fold_bias(w, b, a)
    exact, approx = x @ w.T + b, x @ folded.T
    folded_error, dropped_error = float((approx - exact).norm()), float((x @ w.T - exact).norm())
    assert folded_error < dropped_error / 10  # the bias is nearly all there; dropping it loses it all


def test_nothing_folds_from_inputs_without_a_common_part() -> None:
    x = _inputs(1.0)
    centred = x - x.mean(0)
    _, rho = constant_fit(centred.T @ centred / len(x), centred.mean(0))
    assert abs(rho) < 1e-6

"""A bias folded into its weight by least squares: W x + b ≈ (W + b aᵀ) x with aᵀx ≈ 1.

No input of an attention projection carries a constant (it reads a normalised hidden state), but in real models
that input has a large common part, so a constant is nearly a linear function of it. `a` is the least-squares
solution of aᵀx = 1 over calibration tokens: a = (C + λI)⁻¹ μ with C = E[x xᵀ] and μ = E[x]; the fit leaves
E[(1 − aᵀx)²] = 1 − μᵀa at λ = 0, so ρ = μᵀa is the fraction of the constant the inputs reproduce (1: exact).
Used where a served form has no bias (the DeepSeek-V3 layout vLLM loads: methods/mla_base.py, `biases: fold`) and
measured on the 1.5B model by benchmarks/bias_drop.py."""

from __future__ import annotations

import torch

# λ relative to the mean diagonal of C: a guard against singular C, far below the signal. 1e-4 generalises better
# for the dense model's q biases but makes the folded MLA model worse, 1e-8 barely better (docs/serving.md, "Biased
# models"; mla's `fold_ridge` sets it)
RIDGE = 1e-6


def constant_fit(corr: torch.Tensor, mean: torch.Tensor, ridge: float = RIDGE) -> tuple[torch.Tensor, float]:
    """(a (d,) float64, ρ = μᵀa): the least-squares a with aᵀx ≈ 1 for inputs with second moment corr (d, d) and
    mean (d,)."""
    c, mu = corr.to(torch.float64), mean.to(torch.float64)
    eye = torch.eye(c.shape[0], dtype=torch.float64, device=c.device)
    a = torch.linalg.solve(c + ridge * c.diagonal().mean() * eye, mu)
    return a, float(mu @ a)


def fold_bias(weight: torch.Tensor, bias: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """W + b aᵀ (m, d) in W's dtype: the bias-free weight whose output approximates W x + b."""
    return (weight.to(torch.float64) + torch.outer(bias.to(torch.float64), a.to(torch.float64))).to(weight.dtype)

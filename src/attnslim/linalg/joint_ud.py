"""Joint up/down MLP compression with SparseLLM-style auxiliary variables (LatentLLM §4.3, App. H).

Approximated: y = W_d σ(W_u x + b_u) + b_d (or the gated y = W_d (act(W_g x + b_g) ⊙ (W_u x + b_u)) + b_d)
by the same MLP with every weight replaced by a low-rank factor pair (lowrank.LowRankFactors).
Data: calibration tokens as ROWS, x (N, d) and targets y (N, d_out) (the dense MLP output by default);
the (N, d_i) auxiliaries are held in memory, so pass a token subsample for large layers.
Objective (ReLU, Eq. 20): L4 = α‖Ŵ_u x + b̂_u − z‖² + β‖z' − σ(z)‖² + γ‖Ŵ_d z' + b̂_d − y‖², per token.
Step order (SparseLLM): iteration 0 = local RootCov compression of each weight; then per iteration update
z' (ridge), z (closed form), and refit each weight by rank-constrained regression (lowrank.rrr).
Exact: the z' ridge update, the ReLU z update (two-candidate elementwise argmin, SparseLLM code), the gated
up-output update z = (α m_u + β a⊙p)/(α + β a²) and every refit (optimal for the ridge-damped loss).
Approximated (gated MLPs only): the gate pre-activation s has no closed form; it takes `gate_steps`
elementwise Gauss-Newton steps, each accepted only where it lowers the (separable) objective, so L stays
monotone. This replaces SparseLLM's 2 SGD steps (lr 0.01) for LLaMA. Un-gated non-ReLU MLPs (GELU) have
no closed-form z update and raise AttnslimError: compress them locally with lowrank.factorize.
Cost (weights): as lowrank.param_count for each of up, down (and gate).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from attnslim.errors import AttnslimError
from attnslim.linalg.lowrank import FitOptions, LowRankFactors, factorize, rrr
from attnslim.linalg.precond import PrecondSpec
from attnslim.linalg.ranks import check_rank
from attnslim.linalg.stats import InputStats

GATE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
}
_CHUNK = 8192


@dataclass(frozen=True)
class MLPWeights:
    """The MLP joint_ud approximates: y = W_d σ(W_u x + b_u) + b_d, or gated
    y = W_d (act(W_g x + b_g) ⊙ (W_u x + b_u)) + b_d.

    w_u: (d_i, d);  w_d: (d_out, d_i);  w_g: (d_i, d) or None (un-gated);  b_u, b_g: (d_i,) or None;
    b_d: (d_out,) or None;  activation: a GATE_ACTIVATIONS name (gated) or "relu"."""

    w_u: torch.Tensor
    w_d: torch.Tensor
    b_u: torch.Tensor | None = None
    b_d: torch.Tensor | None = None
    w_g: torch.Tensor | None = None
    b_g: torch.Tensor | None = None
    activation: str = "relu"


@dataclass(frozen=True)
class UDOptions:
    """joint_ud's own settings beside the shared FitOptions.

    alpha, beta, gamma: the weights α, β, γ of L4's three terms (all > 0);  gate_steps: Gauss-Newton steps on the
    gate pre-activation per iteration (gated MLPs);  keep_best: return the step with the lowest output error
    instead of the last (not in the paper);  dtype: work dtype of the (N, d_i) auxiliaries (float32 halves memory;
    statistics are always float64)."""

    alpha: float = 1.0
    beta: float = 1.0
    gamma: float = 1.0
    gate_steps: int = 2
    keep_best: bool = False
    dtype: torch.dtype = torch.float64


UD_FIT = FitOptions(n_iter=4, junction="block_identity", label="mlp")  # the paper's 4 steps, local one included
UD_DEFAULT = UDOptions()


@dataclass(frozen=True)
class JointUDResult:
    """up, down, gate (None if un-gated): the chosen factors. objective / output_error: per-token L4 and
    mean ‖ŷ − y‖² right after each compression step (index 0 = local compression)."""

    up: LowRankFactors
    down: LowRankFactors
    gate: LowRankFactors | None
    objective: list[float] = field(default_factory=list)
    output_error: list[float] = field(default_factory=list)


def _affine(x: torch.Tensor, f: LowRankFactors) -> torch.Tensor:
    """(N, d_in) -> (N, d_out): x Aᵀ Bᵀ + b̂."""
    out = (x @ f.A.T.to(x.dtype)) @ f.B.T.to(x.dtype)
    return out if f.bias is None else out + f.bias.to(x.dtype)


def mlp_forward(
    x: torch.Tensor, up: LowRankFactors, down: LowRankFactors, activation: str = "relu",
    gate: LowRankFactors | None = None,
) -> torch.Tensor:
    """Compressed MLP on tokens x (N, d) -> (N, d_out)."""
    act = _activation(activation, gate is not None)
    hidden = act(_affine(x, up)) if gate is None else act(_affine(x, gate)) * _affine(x, up)
    return _affine(hidden, down)


def _activation(name: str, gated: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    if gated and name in GATE_ACTIVATIONS:
        return GATE_ACTIVATIONS[name]
    if not gated and name == "relu":
        return F.relu
    valid = tuple(GATE_ACTIVATIONS) if gated else ("relu",)
    raise AttnslimError(
        f"joint UD: activation {name!r} is not supported for a {'gated' if gated else 'non-gated'} MLP; "
        f"valid: {valid}. Compress such MLPs locally with lowrank.factorize instead."
    )


def _stats(s: torch.Tensor) -> InputStats:
    """Chunked float64 InputStats of s (N, n_in) without a full float64 copy."""
    n_in = s.shape[1]
    sxx = torch.zeros(n_in, n_in, dtype=torch.float64, device=s.device)
    sx = torch.zeros(n_in, dtype=torch.float64, device=s.device)
    ax = torch.zeros(n_in, dtype=torch.float64, device=s.device)
    for i in range(0, s.shape[0], _CHUNK):
        sc = s[i : i + _CHUNK].to(torch.float64)
        sxx += sc.T @ sc
        sx += sc.sum(0)
        ax += sc.abs().sum(0)
    return InputStats(sxx, sx, ax, s.shape[0])


def _cross(s: torch.Tensor, t: torch.Tensor) -> tuple[InputStats, torch.Tensor, torch.Tensor]:
    """(stats(s), Σ t sᵀ (n_out, n_in), Σ t (n_out,)) for s (N, n_in), t (N, n_out), in float64."""
    sts = torch.zeros(t.shape[1], s.shape[1], dtype=torch.float64, device=s.device)
    for i in range(0, s.shape[0], _CHUNK):
        sts += t[i : i + _CHUNK].to(torch.float64).T @ s[i : i + _CHUNK].to(torch.float64)
    return _stats(s), sts, t.to(torch.float64).sum(0)


def _ridge(r: torch.Tensor, w: torch.Tensor, beta: float, gamma: float) -> torch.Tensor:
    """r (N, d_i) (βI + γ WᵀW)⁻¹ for w (d_out, d_i), by Woodbury: one (d_out, d_out) solve."""
    w = w.to(r.dtype)
    inner = beta * torch.eye(w.shape[0], dtype=r.dtype, device=r.device) + gamma * (w @ w.T)
    return (r - gamma * torch.linalg.solve(inner, (r @ w.T).T).T @ w) / beta


def _relu_z(m: torch.Tensor, zp: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """Elementwise argmin_z α(z − m)² + β(z' − relu(z))² over the two branches z >= 0, z <= 0."""
    z1 = ((alpha * m + beta * zp) / (alpha + beta)).clamp_min(0.0)
    z2 = m.clamp_max(0.0)
    f1 = alpha * (z1 - m) ** 2 + beta * (zp - F.relu(z1)) ** 2
    f2 = alpha * (z2 - m) ** 2 + beta * (zp - F.relu(z2)) ** 2
    return torch.where(f1 <= f2, z1, z2)


def _gate_s(
    s: torch.Tensor, m: torch.Tensor, p: torch.Tensor, z: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor], alpha: float, beta: float, steps: int,
) -> torch.Tensor:
    """Safeguarded Gauss-Newton on f(s) = α(s − m)² + β(p − act(s) z)², elementwise (separable)."""
    def f(v: torch.Tensor) -> torch.Tensor:
        return alpha * (v - m) ** 2 + beta * (p - act(v) * z) ** 2

    for _ in range(steps):
        with torch.enable_grad():
            v = s.detach().requires_grad_(True)
            a = act(v)
            (da,) = torch.autograd.grad(a.sum(), v)  # elementwise act'(s)
        a, da = a.detach(), da.detach()
        grad = 2 * alpha * (s - m) - 2 * beta * (p - a * z) * z * da
        hess = 2 * alpha + 2 * beta * (z * da) ** 2
        cand = s - grad / hess
        s = torch.where(f(cand) < f(s), cand, s)
    return s


def joint_ud(
    x: torch.Tensor,
    mlp: MLPWeights,
    rank_u: int,
    rank_d: int,
    rank_g: int | None = None,
    *,
    y: torch.Tensor | None = None,
    options: FitOptions = UD_FIT,
    ud: UDOptions = UD_DEFAULT,
) -> JointUDResult:
    """Joint U/D compression. x: (N, d) tokens as rows; mlp: the weights (MLPWeights); rank_g: the gate's rank
    (gated MLPs only); y: (N, d_out) targets (default: the dense MLP's output).

    options.n_iter counts compression steps including the local one (paper: 4); options.damp and junction apply to
    every factorisation and refit. ud: the L4 weights and the run settings (UDOptions).
    """
    w_u, b_u, w_d, b_d, w_g, b_g, activation = mlp.w_u, mlp.b_u, mlp.w_d, mlp.b_d, mlp.w_g, mlp.b_g, mlp.activation
    n_iter, damp, junction, label = options.n_iter, options.damp, options.junction, options.label
    alpha, beta, gamma = ud.alpha, ud.beta, ud.gamma
    gate_steps, keep_best, dtype = ud.gate_steps, ud.keep_best, ud.dtype
    gated = w_g is not None
    act = _activation(activation, gated)
    if n_iter < 1:
        raise AttnslimError(f"{label}: n_iter = {n_iter} must be >= 1 (paper: 4, including the local step)")
    if min(alpha, beta, gamma) <= 0:
        raise AttnslimError(f"{label}: alpha, beta, gamma = {alpha}, {beta}, {gamma} must all be > 0")
    d_i, d = w_u.shape
    check_rank(rank_u, min(d_i, d), "rank_u", label)
    check_rank(rank_d, min(w_d.shape), "rank_d", label)
    if gated:
        if rank_g is None:
            raise AttnslimError(f"{label}: a gated MLP needs rank_g (the gate projection's rank)")
        check_rank(rank_g, min(d_i, d), "rank_g", label)
    xw = x.reshape(-1, d).to(dtype)  # (N, d)

    def dense(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:  # everything runs on x's device
        out = xw @ w.T.to(xw.device, dtype)
        return out if b is None else out + b.to(xw.device, dtype)

    s = dense(w_g, b_g) if w_g is not None else None  # (N, d_i) gate pre-activation
    z = dense(w_u, b_u)  # (N, d_i) up output / ReLU pre-activation
    zp = act(z) if s is None else act(s) * z  # (N, d_i) down input
    if y is None:  # the dense MLP's output is the fixed target
        target = zp @ w_d.T.to(xw.device, dtype) + (0.0 if b_d is None else b_d.to(xw.device, dtype))
    else:
        target = y.reshape(xw.shape[0], -1).to(xw.device, dtype)  # (N, d_out)
    x_stats = _stats(xw)
    results: list[tuple[LowRankFactors, LowRankFactors, LowRankFactors | None]] = []
    objective: list[float] = []
    output_error: list[float] = []
    n = xw.shape[0]
    precond = PrecondSpec(damp=damp)  # the local step: root covariance

    def refit(src: torch.Tensor, dst: torch.Tensor, rank: int, bias: bool, name: str) -> LowRankFactors:
        # bias only where the layer has one: a bias-free model stays bias-free
        stats, sts, st = _cross(src, dst)
        return rrr(stats, sts, st, rank, junction=junction, damp=damp, fit_bias=bias, label=f"{label}.{name}")

    for t in range(n_iter):
        if t == 0:  # local compression of the original weights (SparseLLM order)
            fu = factorize(w_u, b_u, x_stats, rank_u, precond=precond, junction=junction, label=f"{label}.up")
            fg = None
            if w_g is not None and rank_g is not None:
                fg = factorize(w_g, b_g, x_stats, rank_g, precond=precond, junction=junction, label=f"{label}.gate")
            fd = factorize(w_d, b_d, _stats(zp), rank_d, precond=precond, junction=junction, label=f"{label}.down")
        else:  # refit every weight to its auxiliary target (reduced-rank regression, §2.8)
            fu = refit(xw, z, rank_u, b_u is not None, "up")
            fg = None if s is None or rank_g is None else refit(xw, s, rank_g, b_g is not None, "gate")
            fd = refit(zp, target, rank_d, b_d is not None, "down")
        results.append((fu, fd, fg))
        m_u = _affine(xw, fu)
        m_g = None if fg is None else _affine(xw, fg)
        objective.append(_objective(m_u, m_g, z, s, zp, target, fd, act, ud) / n)
        output_error.append(float(((mlp_forward(xw, fu, fd, activation, fg) - target) ** 2).sum()) / n)
        if t == n_iter - 1:
            break
        w_d_hat = fd.weight()
        b_d_hat = 0.0 if fd.bias is None else fd.bias.to(dtype)
        if s is None or m_g is None:  # ReLU: z' ridge, then the exact two-candidate z update
            zp = _ridge(beta * act(z) + gamma * (target - b_d_hat) @ w_d_hat.to(dtype), w_d_hat, beta, gamma)
            z = _relu_z(m_u, zp, alpha, beta)
        else:  # gated: p ridge, z closed form, s safeguarded Gauss-Newton
            a = act(s)
            zp = _ridge(beta * a * z + gamma * (target - b_d_hat) @ w_d_hat.to(dtype), w_d_hat, beta, gamma)
            z = (alpha * m_u + beta * a * zp) / (alpha + beta * a * a)
            s = _gate_s(s, m_g, zp, z, act, alpha, beta, gate_steps)
    best = min(range(n_iter), key=output_error.__getitem__) if keep_best else len(results) - 1
    fu, fd, fg = results[best]
    return JointUDResult(fu, fd, fg, objective, output_error)


def _objective(
    m_u: torch.Tensor, m_g: torch.Tensor | None, z: torch.Tensor, s: torch.Tensor | None, zp: torch.Tensor,
    target: torch.Tensor, fd: LowRankFactors, act: Callable[[torch.Tensor], torch.Tensor], ud: UDOptions,
) -> float:
    """Un-normalised L4 with ud's α, β, γ (gated: plus α‖m_g − s‖² and the β term on act(s) ⊙ z)."""
    alpha, beta, gamma = ud.alpha, ud.beta, ud.gamma
    hidden = act(z) if s is None else act(s) * z
    total = alpha * ((m_u - z) ** 2).sum() + beta * ((zp - hidden) ** 2).sum()
    if s is not None and m_g is not None:
        total = total + alpha * ((m_g - s) ** 2).sum()
    total = total + gamma * ((_affine(zp, fd) - target) ** 2).sum()
    return float(total)

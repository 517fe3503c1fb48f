"""linalg.cca (NBL statistics, CCA bound, LMMSE) and linalg.pca (ATP principal components); CPU, float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnslim.errors import AttnslimError
from attnslim.linalg.cca import (
    JointStats,
    canonical_correlations,
    cca_bound,
    linear_fit_nmse,
    lmmse_map,
    require_tokens,
)
from attnslim.linalg.pca import (
    canonical_signs,
    component_mask,
    energy_kept,
    extend_components,
    principal_components,
    resolve_rank,
    svd_entropy_rank,
)

F64 = torch.float64


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _stats(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None = None) -> JointStats:
    s = JointStats.zeros(x.shape[-1], y.shape[-1])
    s.update(x, y, mask)
    return s


def _correlated(n: int = 4000, d: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    x = torch.randn(n, d, generator=g, dtype=F64) @ torch.randn(d, d, generator=g, dtype=F64) + 3.0  # (n, d)
    a = torch.randn(d, d, generator=g, dtype=F64)
    y = torch.tanh(x @ a / d) + torch.randn(n, d, generator=g, dtype=F64)  # (n, d)
    return x, y


# ---------------------------------------------------------------- CCA / LMMSE


def test_cca_bound_near_zero_for_linear_and_near_d_for_independent() -> None:
    g, n, d = _gen(1), 5000, 8
    x = torch.randn(n, d, generator=g, dtype=F64)
    a = torch.randn(d, d, generator=g, dtype=F64)
    y_lin = x @ a.T + 1e-2 * torch.randn(n, d, generator=g, dtype=F64)
    assert cca_bound(_stats(x, y_lin)) < 1e-2
    assert cca_bound(_stats(x, y_lin), residual=False) < 1e-2
    y_ind = torch.randn(n, d, generator=g, dtype=F64)
    # Y+ = Y + X is correlated with X by construction, so independence is read with residual=False
    assert d - 0.1 < cca_bound(_stats(x, y_ind), residual=False) <= d


def _numpy_cca(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Independent route: canonical correlations = singular values of Q_yᵀ Q_x (QR of centred samples)."""
    qx, _ = np.linalg.qr(x - x.mean(0))
    qy, _ = np.linalg.qr(y - y.mean(0))
    return np.linalg.svd(qy.T @ qx, compute_uv=False)


@pytest.mark.parametrize("residual", [False, True])
def test_canonical_correlations_match_direct_computation(residual: bool) -> None:
    x, y = _correlated()
    rho = canonical_correlations(_stats(x, y), residual=residual)
    yy = (y + x) if residual else y
    ref = _numpy_cca(x.numpy(), yy.numpy())
    np.testing.assert_allclose(rho.numpy(), ref, atol=1e-9)
    bound = cca_bound(_stats(x, y), residual=residual)
    assert bound == pytest.approx(float((1 - ref**2).sum()), abs=1e-8)


def test_lmmse_recovers_affine_map() -> None:
    g, n, d_x, d_y = _gen(2), 500, 7, 5
    x = torch.randn(n, d_x, generator=g, dtype=F64) * torch.linspace(0.1, 10.0, d_x, dtype=F64) + 2.0
    a = torch.randn(d_y, d_x, generator=g, dtype=F64)
    c = torch.randn(d_y, generator=g, dtype=F64)
    stats = _stats(x, x @ a.T + c)
    w, b, info = lmmse_map(stats, ridge=0.0)
    torch.testing.assert_close(w, a, atol=1e-9, rtol=0)
    torch.testing.assert_close(b, c, atol=1e-9, rtol=0)
    assert info.nmse < 1e-12 and info.n_tokens == n and info.cond >= 1.0
    w_r, _, info_r = lmmse_map(stats)  # the default relative ridge shrinks low-variance directions a little
    torch.testing.assert_close(w_r, a, atol=2e-2, rtol=0)
    assert info_r.nmse < 1e-6 and info_r.ridge_abs > 0 and info_r.cond_ridged <= info_r.cond


def test_lmmse_without_a_bias_fits_the_uncentred_moments() -> None:
    """affine=False (a target layer without a bias): y ≈ W x through the origin, b = 0; the centred fit would need
    a bias to carry the means, so on data with a mean the two fits differ."""
    g, n, d_x, d_y = _gen(5), 400, 6, 4
    x = torch.randn(n, d_x, generator=g, dtype=F64) + 3.0  # a large mean
    a = torch.randn(d_y, d_x, generator=g, dtype=F64)
    stats = _stats(x, x @ a.T)
    w, b, info = lmmse_map(stats, ridge=0.0, affine=False)
    torch.testing.assert_close(w, a, atol=1e-9, rtol=0)
    assert torch.equal(b, torch.zeros(d_y, dtype=F64)) and info.nmse < 1e-12
    y = x @ a.T + 1.0  # a constant offset W x alone cannot carry
    w0, b0, _ = lmmse_map(_stats(x, y), ridge=0.0, affine=False)
    normal = (y - x @ w0.T).T @ x  # the residual is orthogonal to every input column: least squares through 0
    assert normal.abs().max() < 1e-8 * float(y.abs().sum()) and torch.equal(b0, torch.zeros(d_y, dtype=F64))
    assert not torch.allclose(w0, lmmse_map(_stats(x, y), ridge=0.0)[0], atol=1e-3)


def test_linear_fit_nmse_equals_empirical() -> None:
    x, y = _correlated(seed=3)
    stats = _stats(x, y)
    g = _gen(4)
    random_map = (torch.randn(6, 6, generator=g, dtype=F64), torch.randn(6, generator=g))
    for w, b in [lmmse_map(stats)[:2], random_map]:
        resid = y - x @ w.T - b.to(F64)
        expected = float(resid.square().sum(1).mean() / torch.trace(torch.cov(y.T, correction=0)))
        assert linear_fit_nmse(stats, w, b) == pytest.approx(expected, rel=1e-9)
    assert lmmse_map(stats)[2].nmse <= cca_bound(stats, residual=False) + 1e-9  # the NBL bound holds


def _assert_stats_equal(a: JointStats, b: JointStats) -> None:
    assert a.n == b.n
    for name in ("sum_x", "sum_y", "sum_xx", "sum_yx", "sum_yy"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=1e-12, atol=1e-9)


def test_chunked_and_merged_stats_equal_one_batch() -> None:
    x, y = _correlated(n=900)
    whole = _stats(x, y)
    chunked = JointStats.zeros(6)
    for xs, ys in zip(x.split(250), y.split(250), strict=True):
        chunked.update(xs, ys)
    _assert_stats_equal(chunked, whole)
    _assert_stats_equal(_stats(x[:400], y[:400]).merge(_stats(x[400:], y[400:])), whole)


def test_mask_ignores_padded_rows() -> None:
    x, y = _correlated(n=60)
    xb, yb = x.reshape(3, 20, 6).clone(), y.reshape(3, 20, 6).clone()  # (b, t, d)
    mask = torch.ones(3, 20, dtype=torch.bool)
    mask[1, 12:] = False
    mask[2, 5:] = False
    xb[~mask], yb[~mask] = 1e6, float("nan")  # padding garbage must not leak
    _assert_stats_equal(_stats(xb, yb, mask), _stats(x.reshape(3, 20, 6)[mask], y.reshape(3, 20, 6)[mask]))


def test_nan_and_too_few_tokens_raise() -> None:
    x, y = _correlated(n=50)
    y[3, 2] = float("nan")
    bad = _stats(x, y)
    with pytest.raises(ValueError, match="NaN"):
        canonical_correlations(bad)
    with pytest.raises(ValueError, match="NaN"):
        lmmse_map(bad)
    few = _stats(x[:5], x[:5])
    with pytest.raises(ValueError, match=r"d\+1"):
        cca_bound(few)
    with pytest.raises(ValueError, match="windows of 2 tokens"):
        require_tokens(5, 6, window=2)
    lmmse_map(few, ridge=1e-2, allow_few_tokens=True)  # a large ridge makes the underdetermined fit explicit
    with pytest.raises(ValueError, match="empty"):
        cca_bound(JointStats.zeros(4))
    with pytest.raises(ValueError, match="d_x == d_y"):
        cca_bound(_stats(x, x[:, :3]))


# ---------------------------------------------------------------- PCA


def _low_rank(
    b: int, length: int, d: int, k: int, seed: int = 0, sigmas: list[float] | None = None
) -> torch.Tensor:
    g = _gen(seed)
    p = torch.linalg.qr(torch.randn(b, length, k, generator=g, dtype=F64)).Q  # (b, L, k)
    q = torch.linalg.qr(torch.randn(b, d, k, generator=g, dtype=F64)).Q  # (b, d, k)
    s = torch.tensor(sigmas, dtype=F64) if sigmas else torch.rand(k, generator=g, dtype=F64) + 0.5
    return (p * s) @ q.mT  # (b, L, d)


@pytest.mark.parametrize("method", ["exact", "approx"])
def test_u_orthonormal_and_xp_is_projection(method: str) -> None:
    x = torch.randn(3, 12, 20, generator=_gen(5), dtype=F64)
    u, xp = principal_components(x, 5, method=method)  # type: ignore[arg-type]
    assert u.shape == (3, 12, 5) and xp.shape == (3, 5, 20)
    torch.testing.assert_close(u.mT @ u, torch.eye(5, dtype=F64).expand(3, 5, 5), atol=1e-10, rtol=0)
    torch.testing.assert_close(xp, u.mT @ x, atol=1e-10, rtol=0)


def test_exact_reconstruction_at_rank_and_eckart_young() -> None:
    x = _low_rank(2, 16, 24, 4)
    u, xp = principal_components(x, 4)
    torch.testing.assert_close(u @ xp, x, atol=1e-12, rtol=0)
    y = torch.randn(16, 24, generator=_gen(6), dtype=F64)
    u, xp = principal_components(y, 5)
    s = torch.linalg.svdvals(y)
    assert float(torch.linalg.matrix_norm(y - u @ xp)) == pytest.approx(float(s[5:].square().sum().sqrt()))


def test_approx_matches_exact_on_low_rank() -> None:
    x = _low_rank(2, 20, 30, 3, seed=7, sigmas=[9.0, 3.0, 1.0])
    u_e, xp_e = principal_components(x, 3)
    u_a, xp_a = principal_components(x, 3, method="approx", iters=2)
    torch.testing.assert_close(u_a @ xp_a, x, atol=1e-10, rtol=0)  # same subspace after r = rank steps
    torch.testing.assert_close(u_a @ u_a.mT, u_e @ u_e.mT, atol=1e-10, rtol=0)
    u_a, xp_a = principal_components(x, 3, method="approx", iters=40)  # converged: same factors, same signs
    torch.testing.assert_close(u_a, u_e, atol=1e-8, rtol=0)
    torch.testing.assert_close(xp_a, xp_e, atol=1e-8, rtol=0)


@pytest.mark.parametrize("rule", ["colsum", "maxabs"])
def test_sign_convention_is_invariant_to_flips(rule: str) -> None:
    x = torch.randn(4, 10, 8, generator=_gen(8), dtype=F64)
    u, xp = principal_components(x, 6, sign=rule)  # type: ignore[arg-type]
    flip = torch.where(torch.rand(4, 6, generator=_gen(9)) < 0.5, -1.0, 1.0).to(F64)  # (b, r)
    u2, xp2 = canonical_signs(u * flip.unsqueeze(-2), xp * flip.unsqueeze(-1), rule)  # type: ignore[arg-type]
    assert torch.equal(u2, u) and torch.equal(xp2, xp)
    if rule == "colsum":
        assert bool((u.sum(-2) > 0).all())


@pytest.mark.parametrize("method", ["exact", "approx"])
def test_padding_and_rank_deficiency_give_no_nan(method: str) -> None:
    x = torch.randn(3, 10, 6, generator=_gen(10), dtype=F64)
    x[1, :, 3:] = x[1, :, :3]  # rank 3
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[1, 7:] = False
    mask[2, :] = False  # fully padded sequence
    u, xp = principal_components(x, 8, method=method, mask=mask)  # type: ignore[arg-type]  # r > d ≥ rank
    assert bool(torch.isfinite(u).all() and torch.isfinite(xp).all())
    assert bool((u[~mask] == 0).all())
    assert component_mask(xp).sum(-1).tolist() == [6, 3, 0]
    xm = x * mask.unsqueeze(-1)
    torch.testing.assert_close(u @ xp, xm, atol=1e-10, rtol=0)
    u1, xp1 = principal_components(x[1:2, :7], 3, method=method)  # type: ignore[arg-type]  # unpadded
    torch.testing.assert_close(u[1:2, :7, :3], u1, atol=1e-10, rtol=0)
    torch.testing.assert_close(xp[1:2, :3], xp1, atol=1e-10, rtol=0)


def test_float32_in_float32_out() -> None:
    x = torch.randn(2, 8, 5, generator=_gen(11))
    u, xp = principal_components(x, 3, method="approx")
    assert u.dtype == xp.dtype == torch.float32


def test_svd_entropy_rank_and_energy() -> None:
    for k in (1, 3, 5):
        x = _low_rank(1, 16, 12, k, sigmas=[2.0] * k)[0]
        assert svd_entropy_rank(x) == k and svd_entropy_rank(x, kind="shannon") == k
        assert energy_kept(x, k) == pytest.approx(1.0)
    y = torch.randn(16, 12, generator=_gen(12), dtype=F64)
    assert 1 <= svd_entropy_rank(y) <= svd_entropy_rank(y, kind="shannon") <= 12
    energies = [energy_kept(y, r) for r in range(1, 13)]
    assert energies == sorted(energies) and energies[-1] == pytest.approx(1.0)
    assert energy_kept(y, 0.5) == energies[7]  # ⌈0.5·16⌉ = 8
    assert svd_entropy_rank(torch.zeros(4, 3)) == 0 and energy_kept(torch.zeros(4, 3), 2) == 1.0


def test_rank_validation() -> None:
    assert resolve_rank(5, 1 / 8) == 1 and resolve_rank(30, 0.1) == 3 and resolve_rank(7, 1.0) == 7
    assert resolve_rank(7, 7) == 7
    x = torch.randn(1, 6, 4, dtype=F64)
    for bad in (0, -1, 7):
        with pytest.raises(ValueError, match=f"r={bad}.*L=6"):
            principal_components(x, bad)
    for frac in (0.0, -0.25, 1.5):
        with pytest.raises(ValueError, match="fraction"):
            resolve_rank(6, frac)
    with pytest.raises(ValueError):
        resolve_rank(6, True)
    with pytest.raises(ValueError, match="method"):
        principal_components(x, 2, method="qr")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="iters"):
        principal_components(x, 2, method="approx", iters=0)


def _rotate(y: torch.Tensor, start: int) -> torch.Tensor:
    """A RoPE-like rotation of each row (t, 2m) by its absolute position: pairs (i, i+m) turned by pos·θ_i."""
    t, two_m = y.shape
    m = two_m // 2
    angle = torch.arange(start, start + t, dtype=y.dtype)[:, None] / (10.0 ** (torch.arange(m, dtype=y.dtype) / m))
    a, b = y[:, :m], y[:, m:]
    return torch.cat([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], dim=1)


@pytest.mark.parametrize("appended", [1, 5])
def test_extend_components_equals_a_fresh_decomposition_of_the_extended_sequence(appended: int) -> None:
    """ATP notes §7 #13: for X of rank ≤ r, the block update of (X′, Uᵀ1, K′ = Uᵀ·RoPE(K), V′) after appending
    tokens equals a fresh decomposition of the extended sequence, signs and singular values included, with keys
    rotated at their positions (stored post-rotation, so the update is linear)."""
    g = torch.Generator().manual_seed(3)
    length, d, rank, r = 24, 12, 4, 6
    x = torch.randn(length + appended, rank, generator=g, dtype=torch.float64) @ torch.randn(
        rank, d, generator=g, dtype=torch.float64)  # exact rank 4 ≤ r
    wk, wv = torch.randn(d, 8, generator=g, dtype=torch.float64), torch.randn(d, 8, generator=g, dtype=torch.float64)
    keys, values = _rotate(x @ wk, 0), x @ wv  # (L + c, 8)
    u, xp = principal_components(x[:length], r)
    xp_ext, col_ext, (k_ext, v_ext) = extend_components(
        xp, u.sum(0), x[length:], length, ((u.mT @ keys[:length], keys[length:]), (u.mT @ values[:length],
                                                                                  values[length:])))
    u_f, xp_f = principal_components(x, r)
    assert torch.allclose(xp_ext, xp_f, atol=1e-9)  # rows σ_i v_iᵀ: singular values and signs match
    assert torch.allclose(col_ext, u_f.sum(0), atol=1e-9)
    assert torch.allclose(k_ext, u_f.mT @ keys, atol=1e-9) and torch.allclose(v_ext, u_f.mT @ values, atol=1e-9)
    assert component_mask(xp_ext).sum() == rank  # the null components stay zero rows


def test_extend_components_absorbing_one_token_per_step_tracks_the_fresh_decomposition() -> None:
    """Notes G2 D2 (per-step Brand absorption): eight rank-1 updates in a row, each fed the previous update's
    output, equal a fresh decomposition of all 32 tokens for X of rank ≤ r (no drift across the chain), with the
    token count and the RoPE-rotated keys advancing each step."""
    g = torch.Generator().manual_seed(5)
    start, steps, d, r = 24, 8, 12, 5
    x = torch.randn(start + steps, 4, generator=g, dtype=torch.float64) @ torch.randn(
        4, d, generator=g, dtype=torch.float64)  # rank 4 ≤ r
    keys = _rotate(x @ torch.randn(d, 8, generator=g, dtype=torch.float64), 0)  # (32, 8) rotated at their positions
    u, xp = principal_components(x[:start], r)
    col, kp = u.sum(0), u.mT @ keys[:start]
    for t in range(start, start + steps):
        xp, col, (kp,) = extend_components(xp, col, x[t:t + 1], t, ((kp, keys[t:t + 1]),))
    u_f, xp_f = principal_components(x, r)
    assert torch.allclose(xp, xp_f, atol=1e-9) and torch.allclose(col, u_f.sum(0), atol=1e-9)
    assert torch.allclose(kp, u_f.mT @ keys, atol=1e-9)
    assert not torch.allclose(xp, principal_components(x[:start], r)[1], atol=1e-3)  # the chain did move it


def test_extend_components_is_an_approximation_below_the_rank() -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(30, 10, generator=g, dtype=torch.float64)  # full rank 10 > r
    u, xp = principal_components(x[:25], 3)
    xp_ext, _, _ = extend_components(xp, u.sum(0), x[25:], 25)
    _, xp_f = principal_components(x, 3)
    assert (xp_ext.norm(dim=1) - xp_f.norm(dim=1)).abs().max() > 1e-3  # the earlier tail was already dropped
    with pytest.raises(AttnslimError, match="extend_components takes"):
        extend_components(xp, u.sum(0), x[25:, :4], 25)

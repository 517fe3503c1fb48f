"""LatentLLM tensor math on random data: precond, lowrank, tucker (joint QK), vo, joint_ud."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

from attnslim.linalg.joint_ud import UD_FIT, MLPWeights, joint_ud
from attnslim.linalg.lowrank import (
    JUNCTIONS,
    FitOptions,
    LowRankFactors,
    factorize,
    param_count,
    rrr_tokens,
)
from attnslim.linalg.precond import PRECOND_KINDS, PrecondSpec, preconditioner
from attnslim.linalg.rope import apply_rope
from attnslim.linalg.stats import InputStats
from attnslim.linalg.tucker import (
    JointQKFactors,
    QKWeights,
    causal_offsets,
    joint_qk,
    qk_logit_loss,
    rope_rotations,
    split_qk,
)
from attnslim.linalg.vo import VOWeights, joint_vo, vo_loss

F64 = torch.float64


def _tokens(n: int, d: int, seed: int = 0, mean: float = 0.5) -> torch.Tensor:
    """(n, d) correlated, unevenly scaled tokens with a non-zero mean (tokens as rows)."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=gen, dtype=F64) * 0.3 + torch.eye(d, dtype=F64)
    scale = torch.linspace(0.2, 3.0, d, dtype=F64)
    shift = mean * torch.randn(d, generator=gen, dtype=F64)
    return (torch.randn(n, d, generator=gen, dtype=F64) @ mix) * scale + shift


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _act_loss(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    return float(((x @ (w - w_hat).T) ** 2).sum())


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matrices, one intra-op thread


@pytest.fixture(scope="module")
def data() -> tuple[torch.Tensor, InputStats]:
    x = _tokens(1500, 32)
    return x, InputStats.from_tokens(x)


# ------------------------------------------------------------------ local factorisation


def test_stats_properties(data: tuple[torch.Tensor, InputStats]) -> None:
    x, st = data
    assert torch.allclose(st.mean, x.mean(0))
    assert torch.allclose(st.corr, x.T @ x / x.shape[0])
    xc = x - x.mean(0)
    assert torch.allclose(st.centred_cov, xc.T @ xc / x.shape[0])


@pytest.mark.parametrize("precond", PRECOND_KINDS)
def test_full_rank_reproduces_w(data: tuple[torch.Tensor, InputStats], precond: str) -> None:
    _, st = data
    w, b = _randn(24, 32, seed=1), _randn(24, seed=2)
    for junction in JUNCTIONS:
        f = factorize(w, b, st, 24, precond=PrecondSpec(precond), junction=junction)
        assert torch.allclose(f.weight(), w, atol=1e-9), (precond, junction)
        assert f.bias is not None and torch.allclose(f.bias, b, atol=1e-8)
    wt = _randn(40, 32, seed=3)  # d_out > d_in: rank d_in
    assert torch.allclose(factorize(wt, None, st, 32, precond=PrecondSpec(precond)).weight(), wt, atol=1e-9)


def test_junctions_leave_product_unchanged(data: tuple[torch.Tensor, InputStats]) -> None:
    _, st = data
    w = _randn(24, 32, seed=4)
    ref = factorize(w, None, st, 10, junction="left").weight()
    for junction in JUNCTIONS:
        assert torch.allclose(factorize(w, None, st, 10, junction=junction).weight(), ref, atol=1e-10)


def test_rootcov_has_lowest_activation_loss(data: tuple[torch.Tensor, InputStats]) -> None:
    x, st = data
    w, r = _randn(24, 32, seed=5), 8
    losses = {
        p: _act_loss(x, w, factorize(w, None, st, r, precond=PrecondSpec(p, damp=1e-9)).weight()) for p in PRECOND_KINDS
    }
    assert all(losses["rootcov"] <= v * (1 + 1e-9) for v in losses.values()), losses
    # and it equals the tail of the spectrum of W C^{1/2} (Eq. 5)
    p = preconditioner(st, "rootcov", damp=0.0)
    sv = torch.linalg.svdvals(p.right(w))
    assert losses["rootcov"] == pytest.approx(float((sv[r:] ** 2).sum()) * st.n, rel=1e-6)


def test_error_falls_as_rank_grows(data: tuple[torch.Tensor, InputStats]) -> None:
    x, st = data
    w = _randn(24, 32, seed=6)
    errs = [_act_loss(x, w, factorize(w, None, st, r).weight()) for r in (2, 6, 12, 18, 24)]
    assert all(a > b for a, b in zip(errs, errs[1:], strict=False)), errs
    assert errs[-1] < 1e-12 * errs[0]


def test_block_identity_structure_and_param_count(data: tuple[torch.Tensor, InputStats]) -> None:
    _, st = data
    w, r = _randn(24, 32, seed=7), 10
    f = factorize(w, None, st, r, junction="block_identity")
    assert f.perm is not None and sorted(f.perm.tolist()) == list(range(32))
    assert torch.equal(f.A[:, f.perm[:r]], torch.eye(r, dtype=F64))
    assert f.a2.shape == (r, 32 - r) and float(f.a2.abs().max()) <= 1.01
    assert f.param_count() == param_count(24, 32, r, "block_identity") == r * (24 + 32) - r * r
    assert param_count(24, 32, r, "left") == r * (24 + 32)
    assert factorize(w, None, st, r, junction="split").param_count() == r * (24 + 32)


def test_bias_update_beats_no_update() -> None:
    x = _tokens(1500, 32, seed=8, mean=2.0)
    st = InputStats.from_tokens(x)
    w, b = _randn(24, 32, seed=9), _randn(24, seed=10)
    y = x @ w.T + b

    def out_loss(f: LowRankFactors) -> float:
        assert f.bias is not None
        return float(((x @ f.weight().T + f.bias - y) ** 2).sum())

    centred = out_loss(factorize(w, b, st, 8, center=True))
    uncentred_bhat = out_loss(factorize(w, b, st, 8, center=False, update_bias=True))
    plain = out_loss(factorize(w, b, st, 8, center=False, update_bias=False))
    assert centred < uncentred_bhat < plain


def test_rrr_matches_local_factorisation(data: tuple[torch.Tensor, InputStats]) -> None:
    x, st = data
    w, b = _randn(24, 32, seed=11), _randn(24, seed=12)
    f = factorize(w, b, st, 8, precond=PrecondSpec(damp=1e-10))
    g = rrr_tokens(x, x @ w.T + b, 8, damp=1e-10)
    assert torch.allclose(g.weight(), f.weight(), atol=1e-6)
    assert g.bias is not None and f.bias is not None and torch.allclose(g.bias, f.bias, atol=1e-6)


def test_rank_deficient_covariance_warns_with_label() -> None:
    x = _tokens(10, 32)  # 10 tokens < 32 dims
    with pytest.warns(UserWarning, match=r"blk3\.q_proj.*rank-deficient"):
        factorize(_randn(8, 32, seed=13), None, InputStats.from_tokens(x), 4, label="blk3.q_proj")
    with pytest.raises(ValueError, match="damp"):
        factorize(_randn(8, 32, seed=13), None, InputStats.from_tokens(x), 4, precond=PrecondSpec(damp=0.0))


def test_rank_out_of_range_raises(data: tuple[torch.Tensor, InputStats]) -> None:
    x, st = data
    w = _randn(24, 32, seed=14)
    for bad in (0, 25):
        with pytest.raises(ValueError, match=rf"rank = {bad}.*1\.\.24"):
            factorize(w, None, st, bad)
    with pytest.raises(ValueError, match=r"rank = 40.*1\.\.24"):
        param_count(24, 32, 40)
    wq, wk = _randn(32, 32, seed=15), _randn(16, 32, seed=16)
    with pytest.raises(ValueError, match=r"r_k = 33.*1\.\.32"):
        joint_qk(QKWeights(wq, wk, 4, 2), st, 8, 33)
    with pytest.raises(ValueError, match=r"r_o = 0"):
        joint_vo(VOWeights(wk, wq.T, 4, 2), st, 8, 0)
    with pytest.raises(ValueError, match=r"rank_d = 99"):
        joint_ud(x, MLPWeights(_randn(48, 32, seed=17), _randn(32, 48, seed=18)), 8, 99)


# ------------------------------------------------------------------ joint QK (Tucker / HOSVD)

H, KV, DH = 4, 2, 8  # GQA: 4 query heads share 2 KV heads, d = 32


def _qk(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (_randn(H * DH, 32, seed=seed), _randn(KV * DH, 32, seed=seed + 1),
            _randn(H * DH, seed=seed + 2), _randn(KV * DH, seed=seed + 3))


def _brute_logit_loss(
    x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, bq: torch.Tensor | None, bk: torch.Tensor | None,
    f: JointQKFactors,
) -> float:
    """Mean over all (m, n) token pairs of Σ_heads (ℓ − ℓ̂)², with explicit HF repeat_kv order."""
    n, g = x.shape[0], H // KV

    Opt = torch.Tensor | None

    def heads(wq_: torch.Tensor, wk_: torch.Tensor, bq_: Opt, bk_: Opt) -> torch.Tensor:
        q = (x @ wq_.T + (0 if bq_ is None else bq_)).reshape(n, H, DH)  # (n, h, d_h)
        k = (x @ wk_.T + (0 if bk_ is None else bk_)).reshape(n, KV, DH)
        k = k.repeat_interleave(g, dim=1)  # (n, h, d_h): query head i*g + j reads KV head i
        return torch.einsum("mha,nha->hmn", q, k)

    wq_hat, wk_hat = f.weights()
    return float(((heads(wq, wk, bq, bk) - heads(wq_hat, wk_hat, f.bias_q, f.bias_k)) ** 2).sum()) / n**2


def test_hosvd_monotone_and_beats_split_asvd(data: tuple[torch.Tensor, InputStats]) -> None:
    x, st = data
    wq, wk, _, _ = _qk(20)
    qk = QKWeights(wq, wk, H, KV)
    f = joint_qk(qk, st, 10, 10, options=FitOptions(damp=1e-10))
    hist = f.loss_history
    assert len(hist) == 8 and all(b <= a * (1 + 1e-12) for a, b in zip(hist, hist[1:], strict=False)), hist
    assert f.a_q.shape == (10, 32) and f.b_q.shape == (H, DH, 10) and f.b_k.shape == (KV, DH, 10)
    joint = qk_logit_loss(qk, f, st)
    split = qk_logit_loss(qk, split_qk(qk, st, 10, 10, damp=1e-10), st)
    assert joint <= split
    assert joint == pytest.approx(_brute_logit_loss(x, wq, wk, None, None, f), rel=1e-9)
    assert joint == pytest.approx(hist[-1], rel=1e-6)  # whitened loss = logit loss when C is undamped


@pytest.mark.parametrize("junction", ["none", "block_identity"])
def test_full_rank_hosvd_reproduces_logits(data: tuple[torch.Tensor, InputStats], junction: str) -> None:
    x, st = data
    wq, wk, bq, bk = _qk(30)
    f = joint_qk(QKWeights(wq, wk, H, KV, bq, bk), st, 32, 32, options=FitOptions(junction=junction))
    wq_hat, wk_hat = f.weights()
    assert torch.allclose(wq_hat, wq, atol=1e-8) and torch.allclose(wk_hat, wk, atol=1e-8)
    assert _brute_logit_loss(x, wq, wk, bq, bk, f) < 1e-16
    if junction == "block_identity":
        assert f.perm_q is not None and torch.equal(f.a_q[:, f.perm_q[:32]], torch.eye(32, dtype=F64))


def test_gqa_low_rank_reconstruction_matches_loss(data: tuple[torch.Tensor, InputStats]) -> None:
    x, st = data
    wq, wk, bq, bk = _qk(40)
    qk = QKWeights(wq, wk, H, KV, bq, bk)
    aware = joint_qk(qk, st, 12, 12, options=FitOptions(damp=1e-10))
    unaware = joint_qk(qk, st, 12, 12, options=FitOptions(damp=1e-10), bias_aware=False)
    true_aware = _brute_logit_loss(x, wq, wk, bq, bk, aware)
    assert true_aware == pytest.approx(qk_logit_loss(qk, aware, st), rel=1e-9)
    assert true_aware == pytest.approx(aware.loss_history[-1], rel=1e-6)
    assert true_aware < _brute_logit_loss(x, wq, wk, bq, bk, unaware)
    # the decompressed weights keep the dense model's per-head mean query exactly (b̂ = b + (W − Ŵ)μ)
    wq_hat, _ = aware.weights()
    assert aware.bias_q is not None
    assert torch.allclose(wq_hat @ st.mean + aware.bias_q, wq @ st.mean + bq, atol=1e-9)


def test_rope_rotations_match_hf_rotate_half() -> None:
    d_h, theta, m, n = 8, 100.0, 7, 4
    inv = theta ** (-torch.arange(0, d_h, 2, dtype=F64) / d_h)

    def cos_sin(pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        emb = torch.cat([pos * inv, pos * inv])  # (d_h,) HF layout
        return emb.cos()[None, None], emb.sin()[None, None]  # (b=1, t=1, d_h)

    q, k = _randn(1, 1, 1, d_h, seed=50), _randn(1, 1, 1, d_h, seed=51)
    logit = (apply_rope(q, *cos_sin(m)) * apply_rope(k, *cos_sin(n))).sum()
    theta_d = rope_rotations(d_h, [n - m], theta=theta)[0]
    assert float(logit) == pytest.approx(float(q.flatten() @ theta_d @ k.flatten()), rel=1e-12)


def test_rope_aware_hosvd(data: tuple[torch.Tensor, InputStats]) -> None:
    _, st = data
    wq, wk, bq, bk = _qk(60)
    rope = rope_rotations(DH, causal_offsets(4), theta=100.0)
    qk, damped = QKWeights(wq, wk, H, KV), FitOptions(damp=1e-10)
    aware = joint_qk(qk, st, 10, 10, rope=rope, options=damped)
    plain = joint_qk(qk, st, 10, 10, options=damped)
    loss_aware = qk_logit_loss(qk, aware, st, rope=rope)
    assert loss_aware == pytest.approx(aware.loss_history[-1], rel=1e-6)
    assert loss_aware < qk_logit_loss(qk, plain, st, rope=rope)
    biased = joint_qk(QKWeights(wq, wk, H, KV, bq, bk), st, 10, 10, rope=rope)
    hist = biased.loss_history
    assert all(b <= a * (1 + 1e-12) for a, b in zip(hist, hist[1:], strict=False)), hist


# ------------------------------------------------------------------ joint VO (App. G.0)


def test_joint_vo(data: tuple[torch.Tensor, InputStats]) -> None:
    x, st = data
    wv, wo, bo = _randn(KV * DH, 32, seed=70), _randn(32, H * DH, seed=71), _randn(32, seed=72)
    vo = VOWeights(wv, wo, H, KV)
    f = joint_vo(vo, st, 8, 12, options=FitOptions(damp=1e-10))
    hist = f.loss_history
    assert all(b <= a * (1 + 1e-12) for a, b in zip(hist, hist[1:], strict=False)), hist
    assert f.a_v.shape == (8, 32) and f.b_v.shape == (KV, DH, 8)
    assert f.a_o.shape == (H, 12, DH) and f.b_o.shape == (32, 12)
    assert vo_loss(vo, f, st) == pytest.approx(hist[-1], rel=1e-6)
    exact = FitOptions(junction="block_identity")
    full = joint_vo(VOWeights(wv, wo, H, KV, b_o=bo), st, KV * DH, H * DH, options=exact)
    assert vo_loss(vo, full, st) < 1e-12 * hist[0]
    assert full.bias_o is not None and torch.allclose(full.bias_o, bo, atol=1e-8)


# ------------------------------------------------------------------ joint up/down (§6)


def _mlp(seed: int, d: int = 24, d_i: int = 64) -> dict[str, torch.Tensor]:
    return {
        "w_u": _randn(d_i, d, seed=seed) / d**0.5, "b_u": 0.1 * _randn(d_i, seed=seed + 1),
        "w_d": _randn(d, d_i, seed=seed + 2) / d_i**0.5, "b_d": 0.1 * _randn(d, seed=seed + 3),
        "w_g": _randn(d_i, d, seed=seed + 4) / d**0.5,
    }


def test_joint_ud_relu_lowers_objective() -> None:
    x, m = _tokens(800, 24, seed=80), _mlp(81)
    res = joint_ud(x, MLPWeights(m["w_u"], m["w_d"], m["b_u"], m["b_d"]), 10, 10, options=replace(UD_FIT, n_iter=4))
    assert len(res.objective) == 4 and res.objective[-1] < res.objective[0]
    assert res.gate is None and res.up.rank == 10 and res.down.rank == 10
    assert all(b <= a * (1 + 1e-6) for a, b in zip(res.objective, res.objective[1:], strict=False))


def test_joint_ud_swiglu_lowers_objective() -> None:
    x, m = _tokens(800, 24, seed=90), _mlp(91)
    mlp = MLPWeights(m["w_u"], m["w_d"], w_g=m["w_g"], activation="silu")
    res = joint_ud(x, mlp, 10, 10, 10, options=replace(UD_FIT, n_iter=3))
    assert res.objective[-1] < res.objective[0]
    assert res.gate is not None and res.gate.bias is None and res.up.bias is None  # stays bias-free


def test_joint_ud_rejects_unsupported_activation() -> None:
    x, m = _tokens(200, 24, seed=95), _mlp(96)
    with pytest.raises(ValueError, match="'gelu'"):
        joint_ud(x, MLPWeights(m["w_u"], m["w_d"], m["b_u"], m["b_d"], activation="gelu"), 4, 4)
    with pytest.raises(ValueError, match="'tanh'"):
        joint_ud(x, MLPWeights(m["w_u"], m["w_d"], w_g=m["w_g"], activation="tanh"), 4, 4, 4)


def test_no_warnings_on_well_conditioned_data(data: tuple[torch.Tensor, InputStats]) -> None:
    _, st = data
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        factorize(_randn(8, 32, seed=99), None, st, 4)


def test_hosvd_in_another_preconditioners_coordinates_handles_rank_deficient_inputs() -> None:
    """Table-1 ablation path: P = C + λI (cov) passed as `whiten`; its square is far too ill-conditioned to
    re-factor (the earlier route, through statistics with correlation P², refused rank-deficient inputs)."""
    x = _randn(20, 32, seed=21)  # 20 tokens in 32 dimensions: rank 20
    st = InputStats.from_tokens(x)
    wq, wk, _, _ = _qk(50)
    pc = preconditioner(st, "cov", damp=1e-2)
    qk, whiten = QKWeights(wq, wk, H, KV), (pc.matrix(), pc.inv_matrix())
    full = joint_qk(qk, st, 32, 32, whiten=whiten, bias_aware=False)
    wq_hat, wk_hat = full.weights()
    assert torch.allclose(wq_hat, wq, atol=1e-8) and torch.allclose(wk_hat, wk, atol=1e-8)
    low = joint_qk(qk, st, 12, 12, whiten=whiten, bias_aware=False)
    assert low.a_q.shape == (12, 32) and all(torch.isfinite(t).all() for t in low.weights())
    with pytest.raises(ValueError, match="exclude each other"):
        biased = QKWeights(wq, wk, H, KV, torch.zeros(H * DH, dtype=F64), torch.zeros(KV * DH, dtype=F64))
        joint_qk(biased, st, 12, 12, whiten=whiten)


def test_preconditioner_is_built_once_per_statistics_and_settings(monkeypatch):
    """q, k and v read one site, and latentllm plans and converts from it: one eigh serves them all; other
    settings, or the same values in a new statistics tensor, build their own."""
    from attnslim.linalg import precond as pre

    calls = []
    eigh = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda c: calls.append(1) or eigh(c))
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    st = pre.InputStats.from_tokens(x)
    first = pre.preconditioner(st, "rootcov", label="q")
    assert pre.preconditioner(pre.InputStats(st.sxx, st.sx, st.ax, st.n), "rootcov", label="k") is first
    assert len(calls) == 1
    assert pre.preconditioner(st, "rootcov", damp=0.1) is not first and len(calls) == 2
    again = pre.preconditioner(pre.InputStats.from_tokens(x), "rootcov")
    assert again is not first and torch.equal(again.p, first.p) and len(calls) == 3

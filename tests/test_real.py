"""Checks on the packaged SmolLM2-135M (marked `real`; part of `make test`)."""

from __future__ import annotations

import pytest
import torch

from attnslim.cli import main as cli_main
from attnslim.data import calib_windows, eval_windows
from attnslim.errors import AttnslimError

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def smol():
    from attnslim.models import load_model

    return load_model("smollm2-135m")


def test_loads_as_gqa_llama(smol):
    model, tokenizer = smol
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        "llama", 30, 9, 3)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert tokenizer("Hello world").input_ids == [19556, 905]


def test_short_perplexity_in_sane_band(smol):
    from attnslim.eval import perplexity

    model, tokenizer = smol
    result = perplexity(model, eval_windows("wiki", tokenizer, tokens=256, seq_len=256), progress=False)
    assert 3.0 < result.ppl < 30.0, result.ppl  # dense wiki ppl at 8192 tokens is 9.16
    assert result.predicted_tokens == 255


def test_inspect_cli_reports_groups_and_kv(capsys):
    assert cli_main(["inspect", "smollm2-135m"]) == 0
    out = capsys.readouterr().out
    assert "total 134,515,008" in out
    assert "46,080 bytes/token" in out  # 30 layers x 2 (K, V) x 3 kv heads x 64 dims x 4 bytes
    assert out.count("LlamaAttention") == 30


def test_unknown_model_lists_known_names(capsys):
    assert cli_main(["eval", "no-such-model", "--data", "wiki"]) == 2
    assert "smollm2-135m" in capsys.readouterr().err


def test_bad_lengths_and_sources(smol):
    _, tokenizer = smol
    with pytest.raises(AttnslimError, match="smaller than one window"):
        eval_windows("wiki", tokenizer, tokens=100, seq_len=512)
    with pytest.raises(AttnslimError, match="lower --tokens"):
        eval_windows("tiny", tokenizer, tokens=8192, seq_len=512)
    with pytest.raises(AttnslimError, match="seq_len"):
        eval_windows("wiki", tokenizer, tokens=8192, seq_len=1)
    with pytest.raises(AttnslimError, match="valid"):
        calib_windows("nope", tokenizer, 2, 64)


def test_svdllm_on_real_model_save_load(smol, tmp_path):
    """SVD-LLM at 80% on three layers: modest loss, identical logits after save/load, cached = uncached."""
    from attnslim.api import compress
    from attnslim.io import load, save
    from attnslim.models import load_model
    from attnslim.recipe import recipe_from_dict

    model, tokenizer = load_model("smollm2-135m")
    _, ref_tok = smol
    ids = eval_windows("wiki", tokenizer, tokens=128, seq_len=128).ids
    dense = model(input_ids=ids).logits
    recipe = recipe_from_dict({
        "name": "t", "calibration": {"source": "wiki", "windows": 4, "seq_len": 128},
        "steps": [{"method": "svdllm", "layers": [10, 11, 12], "args": {"ratio": 0.8}}],
    })
    report = compress(model, tokenizer, recipe, progress=False)
    logits = model(input_ids=ids).logits
    kl = torch.nn.functional.kl_div(logits.log_softmax(-1), dense.log_softmax(-1), log_target=True,
                                    reduction="batchmean") / ids.shape[1]
    assert 0 < float(kl) < 0.05, float(kl)
    assert report.params_after["attention"] < report.params_before["attention"]
    loaded, _ = load(save(model, tokenizer, tmp_path / "m", report.to_json()))
    assert torch.equal(loaded(input_ids=ids).logits, logits)
    prompt = ids[:, :12]
    assert torch.equal(loaded.generate(prompt, max_new_tokens=5, do_sample=False),
                       loaded.generate(prompt, max_new_tokens=5, do_sample=False, use_cache=False))


def test_planned_kv50_beats_uniform_mla_at_the_same_kv(smol):
    """The planner at KV 0.5 against uniform mla at kv_ratio 0.5 (same fit: no refit, the same calibration
    windows), both compressed from the packaged model and scored on the same evaluation tokens. Kept short: few
    calibration windows, two scoring windows, a four-width ladder, no sharing candidate, one refinement round.
    The full-size comparison is benchmarks/plan.py's (BENCHMARKS.md, "Planning under a budget"). About 2 min on the
    2-core host (129 s, 2026-11-30: `make test --durations`), most of it measuring every candidate of every layer."""
    import copy

    from attnslim.api import compress
    from attnslim.bench import kv_bytes_per_token
    from attnslim.eval import perplexity
    from attnslim.planner.run import PlanConfig, plan_model
    from attnslim.recipe import Calibration, recipe_from_dict

    model, tokenizer = smol
    cal = Calibration(source="wiki", windows=8, seq_len=256, seed=0, batch_size=4)
    cfg = PlanConfig(kv=0.5, kinds=("keep", "mla", "nbl", "drop"), ladder=(0.25, 0.375, 0.5, 0.625), calibration=cal,
                     score_windows=2, refine_windows=2, rounds=1, tries=3, mla_args={})
    dense_kv = kv_bytes_per_token(model)["total"]
    planned = copy.deepcopy(model)
    result = plan_model(planned, tokenizer, cfg, progress=False)
    compress(planned, tokenizer, result.recipe, progress=False)
    uniform = copy.deepcopy(model)
    compress(uniform, tokenizer, recipe_from_dict({
        "name": "mla-kv50", "calibration": {"source": "wiki", "windows": 8, "seq_len": 256, "seed": 0},
        "steps": [{"method": "mla", "layers": "all", "args": {"kv_ratio": 0.5}}]}), progress=False)
    kv_planned = kv_bytes_per_token(planned)["total"] / dense_kv
    kv_uniform = kv_bytes_per_token(uniform)["total"] / dense_kv
    assert kv_planned <= 0.5 <= kv_uniform
    windows = eval_windows("wiki", tokenizer, tokens=1024, seq_len=512)
    ppl_planned = perplexity(planned, windows, progress=False).ppl
    ppl_uniform = perplexity(uniform, windows, progress=False).ppl
    assert ppl_planned < ppl_uniform, (ppl_planned, ppl_uniform, result.report["layers"])


def test_offloaded_plan_on_real_weights_equals_the_in_memory_plan(smol, tmp_path):
    """`plan --offload` on real weights: the first four decoder layers of SmolLM2 saved as a checkpoint, planned in
    memory and with the weights on disk (one layer read in at a time, the layers above streamed through every
    score): the same per-candidate KL, start scores and plan. The KLs are real signal: every converted layer
    costs more than nothing, and dropping a layer's attention costs more than its MLA fit at KV 0.5."""
    import copy

    from attnslim.models.load import load_model
    from attnslim.planner.output import offloaded_for_plan
    from attnslim.planner.run import PlanConfig, plan_model
    from attnslim.recipe import Calibration, recipe_to_dict

    model, tokenizer = smol
    sliced = copy.deepcopy(model)
    sliced.model.layers = sliced.model.layers[:4]
    sliced.config.num_hidden_layers = 4
    sliced.config.layer_types = sliced.config.layer_types[:4] if getattr(sliced.config, "layer_types", None) else None
    ckpt = tmp_path / "smol-4"
    sliced.save_pretrained(ckpt)
    tokenizer.save_pretrained(ckpt)
    cfg = PlanConfig(kv=0.6, kinds=("keep", "mla", "drop"), ladder=(0.5,), score_windows=2, refine_windows=2,
                     rounds=1, mla_args={}, calibration=Calibration(source="wiki", windows=4, seq_len=256))
    held, tok = load_model(str(ckpt))
    in_memory = plan_model(held, tok, cfg, progress=False)
    with offloaded_for_plan(str(ckpt)) as (skeleton, tok2, residency):
        offloaded = plan_model(skeleton, tok2, cfg, progress=False, residency=residency)
        assert all(p.is_meta for p in skeleton.model.layers.parameters())
    assert recipe_to_dict(offloaded.recipe) == recipe_to_dict(in_memory.recipe)
    for i, row in in_memory.report["options"].items():
        assert row["drop"]["kl"] > row["mla@0.5"]["kl"] > 0, (i, row)
        for label, cost in row.items():
            assert offloaded.report["options"][i][label]["kl"] == pytest.approx(cost["kl"], rel=1e-4, abs=1e-9)
    for name, start in in_memory.report["starts"].items():
        assert offloaded.report["starts"][name]["measured"] == pytest.approx(start["measured"], rel=1e-4)

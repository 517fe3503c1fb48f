"""The recipe's `head:` step (methods/head.py, pipeline/head.py): LatentLLM's local fit of the LM head, untying a
tied head, its parameter counts (the paper's Table 3, notes §11.3), save/load with both loaders, and what it refuses.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from attnslim.adapters import get_adapter
from attnslim.api import check_recipe, compress, compress_offloaded
from attnslim.bench.flops import flops_per_token
from attnslim.calib.residency import InMemoryLayers
from attnslim.errors import AttnslimError
from attnslim.inspect import inspect_model
from attnslim.io import load
from attnslim.methods.head import HeadShape, uniform_total
from attnslim.modules.lowrank import LowRankLinear
from attnslim.pipeline.head import run_head
from attnslim.recipe import Recipe, apply_overrides, fingerprint, recipe_from_dict, recipe_to_dict
from attnslim.settings import HeadConfig
from conftest import TINY_BUILDERS, tiny_llama, tiny_mistral
from helpers import ByteTokenizer, SavingTokenizer, one_step, reloaded_with_both_loaders

pytestmark = pytest.mark.usefixtures("one_thread")


def _windows(seed: int, n: int = 8, t: int = 32) -> torch.Tensor:
    return torch.randint(3, 128, (n, t), generator=torch.Generator().manual_seed(seed))


def _head(model, ratio: float, **args) -> dict:
    """run_head alone on `model` (no layer step), calibrated on 8 windows of 32 random ids."""
    adapter = get_adapter(model)
    config = HeadConfig(ratio=ratio, untie=True, args=args)
    return run_head(model, adapter, config, _windows(0), 4, InMemoryLayers(model, adapter.decoder_layers()))


def _logit_error(model, dense, ids) -> float:
    with torch.no_grad():
        want = dense(input_ids=ids).logits
        return float((model(input_ids=ids).logits - want).pow(2).sum() / want.pow(2).sum())


@pytest.mark.parametrize("family", sorted(TINY_BUILDERS))
def test_full_rank_head_is_the_dense_head_in_every_family(family):
    """ratio 1 on every family's head (tied or not): untied, the logits are the dense model's; the embedding keeps
    its own weight (Gemma-3 scales it, OPT projects around it)."""
    dense, model = TINY_BUILDERS[family](), TINY_BUILDERS[family]()
    tied = get_adapter(model).head_tied()
    record = _head(model, 1.0)
    assert record["plan"]["tied"] == tied and not get_adapter(model).head_tied()
    assert record["plan"]["rank"] == min(record["plan"]["vocab"], record["plan"]["hidden"])
    assert type(model.get_output_embeddings()) is torch.nn.Linear  # full rank installs B·A dense (compact_linear)
    assert torch.equal(model.get_input_embeddings().weight, dense.get_input_embeddings().weight)
    ids = _windows(5, 2, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, dense(input_ids=ids).logits, atol=5e-5, rtol=1e-4)


def test_activation_aware_head_beats_the_identity_preconditioner_and_error_falls_with_rank():
    """The fit's own loss and the held-out logit error: root-covariance under the plain SVD at the same rank."""
    dense, held_out = tiny_mistral(), _windows(9)
    errors, losses = {}, {}
    for precond in ("rootcov", "identity"):
        for ratio in (0.3, 0.6):
            model = tiny_mistral()
            record = _head(model, ratio, precond=precond)
            losses[precond, ratio] = record["fit"]["activation_loss"]
            errors[precond, ratio] = _logit_error(model, dense, held_out)
    for ratio in (0.3, 0.6):
        assert losses["rootcov", ratio] < losses["identity", ratio], losses
        assert errors["rootcov", ratio] < errors["identity", ratio], errors
    assert errors["rootcov", 0.6] < errors["rootcov", 0.3] and losses["rootcov", 0.6] < losses["rootcov", 0.3]


def test_tied_head_is_untied_counted_and_reloads_with_both_loaders(tmp_path):
    model = tiny_llama()
    adapter = get_adapter(model)
    assert adapter.head_tied()
    recipe = replace(one_step("latentllm", {"ratio": 0.8}), head={"ratio": 0.5, "untie": True})
    before_flops = flops_per_token(model, 16)["lm_head"]
    report = compress(model, ByteTokenizer(), recipe, progress=False)
    plan = report.head["plan"]
    assert plan["tied"] and plan["form"] == "block_identity"
    assert plan["kept"] == plan["rank"] * (128 + 64) - plan["rank"] ** 2
    assert isinstance(model.lm_head, LowRankLinear) and not adapter.head_tied()
    assert model.model.embed_tokens.weight.shape == (128, 64)  # the embedding stays dense
    before, after = report.params_before, report.params_after
    assert before["head"] == 0 and after["head"] == plan["kept"] == report.head["fit"]["params_delta"]
    assert after["embedding"] == before["embedding"]
    assert after["total"] == sum(v for k, v in after.items() if k != "total")
    assert after["total"] == before["total"] - (before["attention"] - after["attention"]) + plan["kept"]
    assert flops_per_token(model, 16)["lm_head"] / before_flops == pytest.approx(plan["kept"] / plan["dense"])
    ids = _windows(3, 2, 12)
    loaded = reloaded_with_both_loaders(model, report.to_json(), tmp_path / "out", ids)
    assert isinstance(loaded.lm_head, LowRankLinear) and not loaded.config.tie_word_embeddings
    inspected = inspect_model(loaded)
    assert inspected["params"] == after
    assert inspected["head"].startswith(f"LowRankLinear(in=64, out=128, rank={plan['rank']}")
    recorded = json.loads((tmp_path / "out" / "compression.json").read_text())
    assert recorded["head"]["plan"] == plan and recorded["recipe"]["head"]["untie"] is True
    offloaded, _ = load(tmp_path / "out", offload=True)  # the head in memory, the layers read from disk
    assert torch.equal(offloaded(input_ids=ids).logits, model(input_ids=ids).logits)
    cached = loaded.generate(ids[:1], max_new_tokens=5, do_sample=False)
    uncached = loaded.generate(ids[:1], max_new_tokens=5, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)


def test_untied_head_saves_its_dense_weights():
    model = tiny_mistral()
    before = get_adapter(model).param_groups()
    assert before["head"] == 128 * 64
    record = _head(model, 0.5)
    after = get_adapter(model).param_groups()
    assert not record["plan"]["tied"] and record["fit"]["params_delta"] == record["plan"]["kept"] - 128 * 64 < 0
    assert after["head"] == record["plan"]["kept"]
    assert after["total"] - before["total"] == record["fit"]["params_delta"]


def test_head_is_refused_with_offloaded_compression(tmp_path):
    src = tmp_path / "src"
    tiny_llama().save_pretrained(src)
    SavingTokenizer().save_pretrained(src)
    recipe = replace(one_step("svd", {"ratio": 0.5}), head={"untie": True})
    with pytest.raises(AttnslimError, match="head: the LM head is fitted in memory.*without --offload"):
        compress_offloaded(src, recipe, tmp_path / "off", tokenizer=SavingTokenizer(), progress=False)
    assert not (tmp_path / "off").exists()


def test_tied_head_without_untie_is_refused_before_any_work():
    model = tiny_llama()
    attention = type(get_adapter(model).attention(0))
    recipe = replace(one_step("latentllm", {"ratio": 0.8}), head={"ratio": 0.8})
    with pytest.raises(AttnslimError, match=r"tied to its token embedding.*head.untie: true"):
        compress(model, ByteTokenizer(), recipe, progress=False)
    assert type(get_adapter(model).attention(0)) is attention  # nothing was converted


@pytest.mark.parametrize(("head", "match"), [
    ({"ratio": 0}, r"head.ratio=0 is invalid; valid: in \(0, 1\]"),
    ({"ratio": 1.5}, r"head.ratio=1.5 is invalid"),
    ({"ratio": True}, r"head.ratio=True is invalid"),
    ({"untie": "yes"}, r"head.untie='yes' is invalid"),
    ({"rank": 8}, r"head has unknown key\(s\) \['rank'\]"),
])
def test_bad_head_settings_are_refused_when_the_recipe_is_read(head, match):
    with pytest.raises(AttnslimError, match=match):
        recipe_from_dict({"name": "r", "steps": [{"method": "svd"}], "head": head})


@pytest.mark.parametrize(("head", "match"), [
    ({"method": "nbl"}, r"head.method='nbl' cannot compress the LM head.*valid: latentllm"),
    ({"method": "svdllm"}, r"head.method='svdllm' cannot compress the LM head"),
    ({"args": {"qk": "joint"}}, r"head.args has unknown key\(s\) \['qk'\]"),
    ({"args": {"precond": "nope"}}, r"precond='nope' is invalid"),
])
def test_a_method_or_argument_the_head_does_not_support_is_refused_before_loading(head, match):
    recipe = Recipe("r", steps=(one_step("svd", {}).steps[0],), head=head)
    with pytest.raises(AttnslimError, match=match):
        check_recipe(recipe)


def test_recipe_head_section_round_trips_and_leaves_other_fingerprints_alone():
    plain = one_step("latentllm", {"ratio": 0.8})
    assert "head" not in recipe_to_dict(plain)
    headed = apply_overrides(plain, ["head.untie=true", "head.args.precond=identity"])
    assert headed.head == {"method": "latentllm", "ratio": 0.8, "untie": True, "args": {"precond": "identity"}}
    assert recipe_from_dict(recipe_to_dict(headed)) == headed
    assert fingerprint(headed) != fingerprint(plain) == fingerprint(recipe_from_dict(recipe_to_dict(plain)))


# notes §11.3, "Table 3: complexity of OPT-6.7B compressed by LatentLLM": Parameters 6.66B (0%), 6.20B (10%),
# 5.53B, 4.87B, 4.20B, 3.54B, 2.87B, 2.21B, 1.54B, 880M (90%)
TABLE3_PARAMS = {0.9: 6.20e9, 0.8: 5.53e9, 0.7: 4.87e9, 0.6: 4.20e9, 0.5: 3.54e9, 0.4: 2.87e9, 0.3: 2.21e9,
                 0.2: 1.54e9, 0.1: 0.880e9}


def test_table3_parameter_counts_need_the_lm_head():
    """Notes §13 property 7 / §11.3: OPT-6.7B's counts at every ratio of Table 3, on meta shapes, match (to the
    table's three digits, 0.3%) only when the (tied, hence untied) LM head keeps κ of its weights as well: without
    it every count is 2-3% low."""
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(hidden_size=4096, num_hidden_layers=32, ffn_dim=16384, num_attention_heads=32,
                       vocab_size=50272, max_position_embeddings=2048, word_embed_proj_dim=4096)
    with torch.device("meta"):
        model = OPTForCausalLM(config)
    adapter = get_adapter(model)
    total = adapter.param_groups()["total"]
    assert total == 6_658_473_984 and adapter.head_tied()  # the notes' dense count; OPT ties its head
    d, d_i = 4096, 16384
    layer = {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d), "fc1": (d_i, d), "fc2": (d, d_i)}
    head = HeadShape(vocab=50272, hidden=d, tied=True)
    for kappa, paper in TABLE3_PARAMS.items():  # the table prints 3 digits; "880M" is 880.9M by its own rule
        with_head = uniform_total(total, [layer] * 32, kappa, "block_identity", head)
        assert abs(with_head - paper) <= 0.003 * paper, (kappa, with_head)
        without = uniform_total(total, [layer] * 32, kappa, "block_identity")
        assert abs(without - paper) > 0.02 * paper, (kappa, without)  # 6.01B at 10%: the head is needed


@pytest.mark.parametrize(("setting", "message"), [
    ("head.method=nbl", "head.method='nbl' cannot compress the LM head"),
    ("head.ratio=2", "head.ratio=2 is invalid; valid: in (0, 1]"),
])
def test_the_command_line_refuses_a_bad_head_before_loading(setting, message, tmp_path, capsys, monkeypatch):
    import attnslim.models
    from attnslim.cli import main as cli_main

    monkeypatch.setattr(attnslim.models, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    assert cli_main(["compress", "--set", setting, "--out", str(tmp_path / "x")]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_exports_refuse_a_factored_head(tmp_path):
    """The stock formats hold a dense head: both exporters refuse a factored one by name, before writing."""
    from attnslim.export import ExportOptions, export_deepseek
    from attnslim.export.deci_check import check_directory
    from attnslim.io import save

    model = tiny_llama()
    recipe = replace(one_step("drop", {"count": 1}), head={"untie": True})
    out = save(model, SavingTokenizer(), tmp_path / "drop", compress(model, ByteTokenizer(), recipe,
                                                                    progress=False).to_json())
    with pytest.raises(AttnslimError, match="LM head is factored.*without head: to export --to deci"):
        check_directory(out)
    model = tiny_llama()
    mla = one_step("mla", {"kv_ratio": 0.5, "rope_dims": 16, "layout": "deepseek"})
    compress(model, ByteTokenizer(), replace(mla, head={"untie": True}), progress=False)
    with pytest.raises(AttnslimError, match="LM head is factored.*without head: to export --to deepseek"):
        export_deepseek(model, SavingTokenizer(), tmp_path / "ds", ExportOptions())
    assert not (tmp_path / "ds").exists()

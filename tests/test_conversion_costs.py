"""analysis/conversion.py: per-layer cost of converting one layer alone (last-position KL), and its CLI."""

from __future__ import annotations

import pytest
import torch

from attnslim.analysis.conversion import (
    calibration_prompts,
    cheapest_layers,
    conversion_costs,
    conversion_report,
    format_conversion,
    joint_cost,
    last_log_probs,
)
from attnslim.errors import AttnslimError
from attnslim.methods.atp import Atp
from attnslim.methods.latentllm import LatentLLM
from conftest import tiny_gemma3, tiny_llama
from helpers import ByteTokenizer


def test_costs_are_one_kl_per_layer_and_leave_the_model_unchanged():
    model = tiny_llama()
    prompts = calibration_prompts(ByteTokenizer(), "tiny", n=4, context=24)
    before = last_log_probs(model, prompts)
    costs = conversion_costs(model, Atp(rank=0.5), prompts, progress=False)
    assert sorted(costs) == [0, 1, 2, 3] and all(c > 0 for c in costs.values())
    assert torch.equal(last_log_probs(model, prompts), before)  # every layer restored
    # measuring a subset gives the same per-layer numbers (each layer is converted alone)
    assert conversion_costs(model, Atp(rank=0.5), prompts, layers=[2], progress=False) == {2: costs[2]}
    assert joint_cost(model, Atp(rank=0.5), prompts, [2]) == costs[2]  # a group of one is the lone cost
    assert torch.equal(last_log_probs(model, prompts), before)


def test_cheapest_layers_and_the_report():
    costs = {0: 0.9, 1: 0.1, 2: 0.3, 3: 0.1}
    assert cheapest_layers(costs, 2) == [1, 3] and cheapest_layers(costs, 0) == []
    with pytest.raises(AttnslimError, match="count=5: need 0..4"):
        cheapest_layers(costs, 5)
    report = conversion_report(tiny_llama(), ByteTokenizer(), Atp(rank=0.25), source="tiny", n=2, context=16,
                               progress=False)
    assert report["args"]["rank"] == 0.25 and sorted(report["order"]) == [0, 1, 2, 3] and report["all_layers"] > 0
    text = format_conversion(report)
    assert "cheapest 1/2 (2 layers): layers: [" in text and text.count("\n") == 2 + 4 + 3
    assert "all 4 measured layers converted together: " in text


def test_a_model_with_sliding_layers_is_ranked_on_its_full_attention_layers():
    from attnslim.adapters import get_adapter

    model = tiny_gemma3()
    adapter = get_adapter(model)
    full = [i for i in range(adapter.num_layers()) if adapter.attention_spec(i).sliding_window is None]
    assert 0 < len(full) < adapter.num_layers()
    report = conversion_report(model, ByteTokenizer(), Atp(rank=0.5), source="tiny", n=2, context=16,
                               layers=full, progress=False)
    assert sorted(map(int, report["costs"])) == full and report["all_layers"] > 0


def test_selectors_typed_on_the_command_line():
    from attnslim.recipe import selector_from_text

    assert [selector_from_text(t) for t in ("all", "4:28", "5", "5,11,17", "-1")] == [
        "all", "4:28", 5, (5, 11, 17), -1]
    with pytest.raises(AttnslimError, match="not a layer selector"):
        selector_from_text("5;11")


def test_methods_that_need_statistics_and_short_sources_are_refused():
    prompts = calibration_prompts(ByteTokenizer(), "tiny", n=2, context=16)
    with pytest.raises(AttnslimError, match="needs calibration statistics"):
        conversion_costs(tiny_llama(), LatentLLM(), prompts, progress=False)
    with pytest.raises(AttnslimError, match="full-attention layers without soft-capping"):
        conversion_costs(tiny_gemma3(), Atp(), prompts, progress=False)  # its sliding layers are refused by atp
    with pytest.raises(AttnslimError, match="need > context"):
        calibration_prompts(ByteTokenizer(), "tiny", n=2, context=10**7)


@pytest.mark.real
def test_real_first_layers_cost_most_under_the_paper_layer(capsys):
    import json

    from attnslim.cli import main as cli_main
    from attnslim.models import load_model

    model, tokenizer = load_model("smollm2-135m")
    prompts = calibration_prompts(tokenizer, "wiki", n=4, context=128)
    costs = conversion_costs(model, Atp(rank=0.5, value_scale="inv_sqrt_len"), prompts, layers=[0, 1, 26],
                             progress=False)
    # with 32 windows of 256 tokens (benchmarks/atp.py): layer 0 0.61, layer 1 1.14, layer 26 0.039 nats
    assert min(costs[0], costs[1]) > 5 * costs[26] > 0
    # the cost is not from dropped components: with every key kept (r = L) the softmax over the rotated basis
    # still costs as much (32 windows of 256: layer 1 1.20 nats at r = L, 1.14 at L/2)
    every = conversion_costs(model, Atp(rank=1.0, value_scale="inv_sqrt_len"), prompts, layers=[1], progress=False)
    assert every[1] > 0.5 * costs[1]
    assert cli_main(["analyze", "smollm2-135m", "--what", "conversion", "--windows", "1", "--seq-len", "32",
                     "--arg", "rank=0.25", "--json"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index("\n{") + 1 :])
    assert report["args"]["rank"] == 0.25 and len(report["costs"]) == 30
    assert "cheapest 1/3 (10 layers): layers: [" in out
    assert cli_main(["analyze", "smollm2-135m", "--what", "conversion", "--windows", "1", "--seq-len", "32",
                     "--layers", "0,1,26", "--json"]) == 0
    out = capsys.readouterr().out
    assert sorted(json.loads(out[out.index("\n{") + 1 :])["costs"]) == ["0", "1", "26"]
    assert "all 3 measured layers converted together" in out
    assert cli_main(["analyze", "--what", "lowrank", "--arg", "rank=0.5"]) == 2
    assert "--arg and --layers are read by --what conversion only" in capsys.readouterr().err
    assert cli_main(["analyze", "--what", "conversion", "--layers", "every"]) == 2  # before the model loads
    assert "--layers = 'every' is not a layer selector" in capsys.readouterr().err

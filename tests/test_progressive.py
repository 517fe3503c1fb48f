"""analysis/progressive.py: convert in stages, recover after each, re-rank the rest on the recovered model."""

from __future__ import annotations

import pytest
import torch

from attnslim.adapters import get_adapter
from attnslim.analysis.conversion import calibration_prompts, cheapest_layers, conversion_costs
from attnslim.analysis.progressive import progressive_recovery
from attnslim.errors import AttnslimError
from attnslim.methods.atp import Atp
from attnslim.modules.principal import PrincipalKeyAttention
from attnslim.train.lora import LoraRecipe
from conftest import tiny_llama
from helpers import ByteTokenizer

RECIPE = LoraRecipe(rank=4, alpha=8, steps=2, batch_size=2, context=16, source="tiny", warmup=1, lr=1e-2, loss="kd")
IDS = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(3))


def _pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    model, teacher = tiny_llama(), tiny_llama()
    teacher.load_state_dict(model.state_dict())
    return model, teacher


def test_stages_convert_the_cheapest_layers_then_the_rest_and_train_after_each(tmp_path):
    model, teacher = _pair()
    prompts = calibration_prompts(ByteTokenizer(), "tiny", n=32, context=16)
    first = cheapest_layers(conversion_costs(teacher, Atp(rank=0.5), prompts, progress=False), 2)
    seen: list[int] = []
    logs = progressive_recovery(model, ByteTokenizer(), Atp(rank=0.5), [2, 4], RECIPE, teacher, tmp_path,
                                progress=False, after_stage=lambda s, log: seen.append(s))
    assert seen == [0, 1] and [log["layers"] for log in logs] == [first, [0, 1, 2, 3]]
    assert logs[0]["new_layers"] == first and sorted(logs[1]["new_layers"] + first) == [0, 1, 2, 3]
    assert all(log["lora"]["step"] == 2 for log in logs) and sorted(logs[0]["costs"]) == sorted(map(str, first))
    assert logs[1]["costs"] == {}  # the last stage takes every remaining layer without ranking them
    adapter = get_adapter(model)
    assert all(isinstance(adapter.attention(i), PrincipalKeyAttention) for i in range(4))
    assert not any("lora" in name for name, _ in model.named_parameters())  # merged after every stage
    plain = tiny_llama()
    plain.load_state_dict(teacher.state_dict())
    method, adapter = Atp(rank=0.5), get_adapter(plain)
    for i, entry in method.plan(adapter, list(range(4)), {}).layers.items():
        method.convert(adapter, i, entry, None)
    assert not torch.allclose(model(input_ids=IDS).logits, plain(input_ids=IDS).logits)  # the LoRA changed it


def test_a_rerun_replays_finished_stages_to_the_same_model(tmp_path):
    done, teacher = _pair()
    progressive_recovery(done, ByteTokenizer(), Atp(rank=0.5), [1, 4], RECIPE, teacher, tmp_path, progress=False)
    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("state.json")}
    again, _ = _pair()
    again.load_state_dict(teacher.state_dict())
    logs = progressive_recovery(again, ByteTokenizer(), Atp(rank=0.5), [1, 4], RECIPE, teacher, tmp_path,
                                progress=False)
    assert all(log["lora"]["step"] == 2 for log in logs)
    assert len(stamps) == 2 and all(p.stat().st_mtime_ns == t for p, t in stamps.items())  # replayed, not retrained
    assert torch.allclose(again(input_ids=IDS).logits, done(input_ids=IDS).logits, atol=1e-5)


@pytest.mark.parametrize("counts", [[], [3, 2], [0, 2], [2, 5], [2, 2]])
def test_bad_stage_counts_fail_before_anything_changes(tmp_path, counts):
    model, teacher = _pair()
    before = model(input_ids=IDS).logits
    with pytest.raises(AttnslimError, match="strictly increasing layer counts in 1..4"):
        progressive_recovery(model, ByteTokenizer(), Atp(rank=0.5), counts, RECIPE, teacher, tmp_path, progress=False)
    assert torch.equal(model(input_ids=IDS).logits, before) and not any(tmp_path.iterdir())


def test_a_model_with_converted_layers_is_refused(tmp_path):
    model, teacher = _pair()
    method, adapter = Atp(rank=0.5), get_adapter(model)
    method.convert(adapter, 1, method.plan(adapter, [1], {}).layers[1], None)
    with pytest.raises(AttnslimError, match="already has converted layers; start from the original"):
        progressive_recovery(model, ByteTokenizer(), Atp(rank=0.5), [2], RECIPE, teacher, tmp_path, progress=False)

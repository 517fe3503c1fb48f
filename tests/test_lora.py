"""train/lora.py's task fine-tuning loss ("choice"): the paper's fine-tune on the task before validation."""

from __future__ import annotations

import math

import pytest
import torch

from attnslim.api import compress
from attnslim.errors import AttnslimError
from attnslim.eval.choice import ChoiceItems
from attnslim.recipe import recipe_from_dict
from conftest import tiny_llama
from helpers import ByteTokenizer, one_step

RECOVER = {"steps": 2, "rank": 4, "alpha": 8, "batch_size": 2, "context": 16, "source": "tiny", "warmup": 1,
           "loss": "kd", "lr": 1e-2}


def _latent_then_atp(scope: str) -> dict:
    """A recipe whose first step leaves a factored (LowRankLinear) k_proj in layer 0, then atp with recovery."""
    return {"name": "mixed", "calibration": {"source": "tiny", "windows": 2, "seq_len": 16},
            "steps": [{"method": "latentllm", "layers": [0], "args": {"ratio": 0.8}},
                      {"method": "atp", "layers": "rest", "args": {"rank": 0.5, "form": "paper",
                                                                   "recover": {**RECOVER, "scope": scope}}}]}


def test_lora_targets_name_the_linears_of_the_chosen_layers_and_refuse_what_peft_cannot_wrap():
    from attnslim.train.lora import lora_targets

    model = tiny_llama()
    every = lora_targets(model, ("q_proj", "v_proj"), None)
    assert len(every) == 2 * model.config.num_hidden_layers and all(n.endswith(("q_proj", "v_proj")) for n in every)
    assert lora_targets(model, ("q_proj", "gate_proj"), [1]) == ["model.layers.1.self_attn.q_proj",
                                                                 "model.layers.1.mlp.gate_proj"]
    with pytest.raises(AttnslimError, match="no module named 'qproj'"):
        lora_targets(model, ("qproj",), [0])
    model.model.layers[2].self_attn.v_proj = model.model.layers[1].self_attn.v_proj  # shared, as cross-layer sharing
    with pytest.raises(AttnslimError, match="layer 2's self_attn.v_proj is shared with layer 1"):
        lora_targets(model, ("v_proj",), None)


def test_recover_scope_converted_trains_only_the_atp_layers_after_another_method():
    """latentllm leaves layer 0 with a factored k_proj that LoRA cannot wrap: scope "all" is a clear error naming
    the fix, scope "converted" recovers the atp layers and leaves layer 0 exactly as latentllm made it."""
    with pytest.raises(AttnslimError, match=r"layer 0's self_attn.q_proj is a LowRankLinear.*scope 'converted'"):
        compress(tiny_llama(), ByteTokenizer(), recipe_from_dict(_latent_then_atp("all")), progress=False)
    first, model = tiny_llama(), tiny_llama()
    compress(first, ByteTokenizer(), recipe_from_dict({**_latent_then_atp("converted"), "steps":
                                                       _latent_then_atp("converted")["steps"][:1]}), progress=False)
    report = compress(model, ByteTokenizer(), recipe_from_dict(_latent_then_atp("converted")), progress=False)
    assert report.steps[1]["plan"]["training"]["step"] == 2
    layer0 = {k: v for k, v in model.state_dict().items() if k.startswith("model.layers.0.")}
    assert layer0 and all(torch.equal(v, first.state_dict()[k]) for k, v in layer0.items())
    changed = [k for k, v in model.state_dict().items()
               if k.startswith("model.layers.1.") and not torch.equal(v, first.state_dict()[k])]
    assert changed and all(k.split(".")[-2] in ("q_proj", "k_proj", "v_proj") for k in changed)
    with pytest.raises(AttnslimError, match="scope='every'"):
        from attnslim.train.lora import LoraRecipe

        LoraRecipe(scope="every")


def test_choice_loss_is_cross_entropy_over_the_candidates_at_the_last_position():
    from attnslim.train.lora import choice_loss

    gen = torch.Generator().manual_seed(0)
    contexts = torch.randint(0, 128, (3, 10), generator=gen)
    choices = torch.tensor([[5, 9, 11], [7, 2, 40], [1, 3, 99]])
    items = ChoiceItems(contexts, choices, torch.tensor([0, 2, 1]), torch.ones(3, 3, dtype=torch.long), "test")
    model = tiny_llama()
    with torch.no_grad():
        got = float(choice_loss(model, items, slice(0, 3)))
        logp = model(input_ids=contexts).logits[:, -1].log_softmax(-1)  # the full-vocabulary distribution
    cand = logp.gather(-1, choices)  # renormalised over the candidates only
    expected = -(cand - cand.logsumexp(-1, keepdim=True))[torch.arange(3), items.labels].mean()
    assert got == pytest.approx(float(expected), rel=1e-5)
    with torch.no_grad():  # a row slice scores only those items
        assert float(choice_loss(model, items, slice(1, 2))) == pytest.approx(
            float(-(cand[1] - cand[1].logsumexp(-1))[2]), rel=1e-5)


@pytest.mark.real
def test_real_task_fine_tune_learns_calibration_items_without_a_teacher(tmp_path):
    from attnslim.eval.choice import choice_items
    from attnslim.models import load_model
    from attnslim.train.lora import LoraRecipe, choice_loss, recover_with_lora

    model, tokenizer = load_model("smollm2-135m")
    compress(model, tokenizer, one_step("atp", {"rank": 0.5, "form": "paper", "value_scale": "inv_sqrt_len"},
                                        layers=[28, 29], windows=1, seq_len=32), progress=False)
    recipe = LoraRecipe(steps=6, batch_size=2, context=64, loss="choice", lr=1e-3, warmup=1, dropout=0.0)
    seen = choice_items("wiki", tokenizer, split="calib", n=12, context=64)  # what the 6 steps train on, in order
    held_out = choice_items("wiki", tokenizer, split="eval", n=12, context=64)
    assert not {tuple(c) for c in seen.contexts.tolist()} & {tuple(c) for c in held_out.contexts.tolist()}
    with torch.no_grad():
        before = float(choice_loss(model, seen, slice(0, 12)))
    trained, log = recover_with_lora(model, tokenizer, recipe, tmp_path / "task", progress=False)  # no teacher
    assert log["step"] == 6 and all(math.isfinite(x) and x >= 0 for x in log["losses"])
    with torch.no_grad():
        assert float(choice_loss(trained, seen, slice(0, 12))) < 0.9 * before


def _paper_model():
    model = tiny_llama()
    compress(model, ByteTokenizer(), one_step("atp", {"rank": 0.5, "form": "paper"}, windows=2, seq_len=16),
             progress=False)
    return model


def test_a_run_killed_while_saving_resumes_from_the_last_complete_checkpoint(tmp_path):
    import json

    from attnslim.train.lora import LoraRecipe, recover_with_lora

    recipe = LoraRecipe(rank=4, alpha=8, steps=4, batch_size=2, context=16, source="tiny", warmup=1, save_every=2)
    whole, _ = recover_with_lora(_paper_model(), ByteTokenizer(), recipe, tmp_path / "a", progress=False)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        "adapter-000004.safetensors", "optimizer-000004.pt", "state.json"]  # older checkpoints removed
    # killed while writing step 4's files: they are partial and state.json still names step 2's
    recover_with_lora(_paper_model(), ByteTokenizer(), recipe, tmp_path / "b", progress=False, stop_after=2)
    (tmp_path / "b" / "adapter-000004.safetensors").write_bytes(b"\x00partial")
    (tmp_path / "b" / "optimizer-000004.pt").write_bytes(b"")
    resumed, log = recover_with_lora(_paper_model(), ByteTokenizer(), recipe, tmp_path / "b", progress=False)
    assert log["step"] == 4
    for key, value in whole.state_dict().items():
        assert torch.allclose(resumed.state_dict()[key], value, atol=1e-6), key
    # a checkpoint in the earlier layout (fixed file names, no "files" entry) still resumes
    recover_with_lora(_paper_model(), ByteTokenizer(), recipe, tmp_path / "c", progress=False, stop_after=2)
    state = json.loads((tmp_path / "c" / "state.json").read_text())
    for kind, legacy in (("adapter", "adapter.safetensors"), ("optimizer", "optimizer.pt")):
        (tmp_path / "c" / state["files"][kind]).rename(tmp_path / "c" / legacy)
    del state["files"], state["recipe"]["scope"]  # and a recipe field added since
    (tmp_path / "c" / "state.json").write_text(json.dumps(state))
    legacy, log = recover_with_lora(_paper_model(), ByteTokenizer(), recipe, tmp_path / "c", progress=False)
    assert log["step"] == 4 and not (tmp_path / "c" / "adapter.safetensors").exists()
    for key, value in whole.state_dict().items():
        assert torch.allclose(legacy.state_dict()[key], value, atol=1e-6), key

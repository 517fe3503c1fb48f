"""train/lora.py's task fine-tuning loss ("choice"): the paper's fine-tune on the task before validation."""

from __future__ import annotations

import math

import pytest
import torch

from attnslim.api import compress
from attnslim.eval.choice import ChoiceItems
from conftest import tiny_llama
from helpers import one_step


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

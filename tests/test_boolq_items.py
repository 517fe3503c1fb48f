"""BoolQ in ATP's App. D prompt as last-position two-choice items (eval/boolq.py) and their use by the scorer and
the LoRA task fine-tune, on a tiny random Llama and a character tokenizer (no data files, no network)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from attnslim.errors import AttnslimError
from attnslim.eval.boolq import FOOTER, HEADER, boolq_items, boolq_prompt, majority_rate
from attnslim.eval.choice import choice_accuracy, last_position_logits
from conftest import tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = {"Yes": 1, "No": 2}


class CharTokenizer:
    """One id per ASCII character (ids 32–126); the texts "Yes" and "No" alone are the single tokens 1 and 2."""

    bos_token_id = None

    def __call__(self, text: str, add_special_tokens: bool = True, **kw: Any) -> dict[str, list[int]]:
        return {"input_ids": [WORDS[text]] if text in WORDS else [ord(c) for c in text]}

    def decode(self, ids: list[int]) -> str:
        names = {v: k for k, v in WORDS.items()}
        return "".join(names.get(i, chr(i)) for i in ids)


ROWS = [
    {"question": "is the sky blue", "passage": "The sky is blue on a clear day.", "answer": True},
    {"question": "do fish fly", "passage": "Fish swim. " * 20, "answer": False},  # long: cut to fit
    {"question": "is ice cold", "passage": "Ice is frozen water.", "answer": True},
]


def test_the_prompt_is_the_papers_table_8_format():
    assert boolq_prompt("is it so", "A passage.") == (
        "Below is an instruction that describes a task. Write a response that appropriately completes the request."
        "\n### Instruction:\nis it so\n### Input:\nA passage.\n### Answer:\n")


def test_items_end_at_the_answer_slot_fit_the_budget_and_label_yes_no():
    tok = CharTokenizer()
    items = boolq_items(ROWS, tok, max_tokens=200)
    assert items.lengths is not None and items.lengths.tolist()[1] == 200 and int(items.lengths.max()) <= 200
    for i, row in enumerate(ROWS):
        n = int(items.lengths[i])
        text = tok.decode(items.contexts[i, -n:].tolist())
        room = 200 - len(HEADER.format(question=row["question"])) - len(FOOTER)  # characters = tokens here
        assert text == boolq_prompt(row["question"], row["passage"][:room])  # whole, or the passage cut at its end
        assert (len(row["passage"]) > room) == (i == 1) and text.endswith("### Answer:\n")  # nothing after it
    assert items.choices.tolist() == [[1, 2]] * 3 and items.labels.tolist() == [0, 1, 0]
    assert majority_rate(items) == pytest.approx(2 / 3)
    with pytest.raises(AttnslimError, match="no room"):
        boolq_items(ROWS, tok, max_tokens=40)


def test_left_padded_items_run_unpadded_and_score_only_yes_and_no():
    tok, model = CharTokenizer(), tiny_llama()
    items = boolq_items(ROWS, tok, max_tokens=200)
    assert items.lengths is not None
    with torch.no_grad():
        got = last_position_logits(model, items, slice(0, 3))  # (3, vocab)
        for i in range(3):
            row = items.contexts[i, -int(items.lengths[i]):]
            assert torch.allclose(got[i], model(input_ids=row[None]).logits[0, -1], atol=1e-5)
        expected = (got[:, [1, 2]].argmax(-1) == items.labels).float().mean()
    assert choice_accuracy(model, items, batch_size=2, progress=False).acc == pytest.approx(float(expected))

    boost = torch.full((128,), 100.0)  # every other token's logit made the largest: the answer must not move
    boost[[1, 2]] = 0
    model.lm_head.register_forward_hook(lambda module, args, out: out + boost)
    assert choice_accuracy(model, items, progress=False).acc == pytest.approx(float(expected))


def test_task_fine_tune_trains_on_the_items_it_is_given(tmp_path):
    from attnslim.train.lora import LoraRecipe, choice_loss, recover_with_lora

    tok, model = CharTokenizer(), tiny_llama()
    items = boolq_items(ROWS, tok, max_tokens=200)
    recipe = LoraRecipe(rank=4, alpha=8, dropout=0.0, steps=1, batch_size=2, context=200, source="tiny",
                        warmup=1, loss="choice")
    with torch.no_grad():
        before = float(choice_loss(model, items, slice(0, 2)))  # LoRA starts at B = 0: the same model
    _, log = recover_with_lora(model, tok, recipe, tmp_path / "a", progress=False, items=items)
    assert log["losses"][0] == pytest.approx(before, rel=1e-4)
    with pytest.raises(AttnslimError, match="steps × batch"):
        recover_with_lora(tiny_llama(), tok, LoraRecipe(rank=4, alpha=8, steps=2, batch_size=2, context=200,
                                                        source="tiny", loss="choice"), tmp_path / "b",
                          progress=False, items=items)

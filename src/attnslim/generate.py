"""Greedy text generation with the model's KV cache (replacement modules keep their own cache layout).

Every step's logits are checked: NaN/Inf logits (damaged weights, a diverged compression) stop the generation
with `NonFiniteLogits` instead of printing whatever argmax picks from them; `eval` refuses such a model the same
way (eval/perplexity.py, which also names the first tensor or layer that holds the NaN/Inf)."""

from __future__ import annotations

from typing import Any

import torch

from attnslim import _compat
from attnslim.errors import AttnslimError


class NonFiniteLogits(AttnslimError):
    """The model's next-token logits held NaN/Inf at new token `step` (0-based)."""

    def __init__(self, step: int) -> None:
        self.step = step
        super().__init__(f"the model's next-token logits are NaN/Inf at new token {step}, so no text is printed; "
                         "the weights are damaged or the compression diverged")


def _finite_logits(step: list[int]) -> Any:
    """A logits processor (called once per generated token) that raises NonFiniteLogits on NaN/Inf."""
    def check(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if not torch.isfinite(scores).all():
            raise NonFiniteLogits(step[0])
        step[0] += 1
        return scores
    return check


@torch.no_grad()
def generate_text(model: Any, tokenizer: Any, prompt: str, max_new_tokens: int = 40) -> str:
    if max_new_tokens < 1:
        raise AttnslimError(f"max_new_tokens={max_new_tokens}; use an integer >= 1")
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        raise AttnslimError("the prompt is empty after tokenization; give some text to continue")
    _compat.check_positions(model.config, ids.shape[1] + max_new_tokens, "prompt + new tokens")
    out = model.generate(
        ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id,
        attention_mask=torch.ones_like(ids), logits_processor=_compat.logits_processors(_finite_logits([0])),
    )
    return str(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))

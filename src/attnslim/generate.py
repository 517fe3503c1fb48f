"""Greedy text generation with the model's KV cache (replacement modules keep their own cache layout)."""

from __future__ import annotations

from typing import Any

import torch

from attnslim import _compat
from attnslim.errors import AttnslimError


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
        attention_mask=torch.ones_like(ids),
    )
    return str(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))

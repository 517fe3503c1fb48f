"""Greedy text generation with the model's KV cache (replacement modules keep their own cache layout)."""

from __future__ import annotations

from typing import Any

import torch


@torch.no_grad()
def generate_text(model: Any, tokenizer: Any, prompt: str, max_new_tokens: int = 40) -> str:
    if max_new_tokens < 1:
        from attnslim.errors import AttnslimError

        raise AttnslimError(f"max_new_tokens={max_new_tokens}; use an integer >= 1")
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(
        ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id,
        attention_mask=torch.ones_like(ids),
    )
    return str(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))

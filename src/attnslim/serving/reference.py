"""The HF side of the serving checks (runs in attnslim's environment): greedy tokens and prompt log-probs of a
model directory, computed the way `offline.py` asks vLLM for them (no EOS stop, log-probs of the prompt tokens)."""

from __future__ import annotations

from typing import Any

import torch


@torch.no_grad()
def greedy(model: Any, ids: list[int], max_tokens: int) -> list[int]:
    """`max_tokens` argmax tokens after `ids`, decoding with the model's KV cache (one sequence, no padding)."""
    out = model(torch.tensor([ids]), use_cache=True)
    cache, tokens = out.past_key_values, []
    for _ in range(max_tokens):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        out = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
    return tokens


@torch.no_grad()
def prompt_logprobs(model: Any, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1, in float64 from the model's logits."""
    logits = model(torch.tensor([ids])).logits[0, :-1].double()
    picked = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None])
    return [float(x) for x in picked[:, 0]]


def reference(directory: str, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from attnslim.models import load_model

    model, _ = load_model(directory)
    return {"greedy": [greedy(model, ids, max_tokens) for ids in prompts],
            "prompt_logprobs": [prompt_logprobs(model, ids) for ids in prompts]}

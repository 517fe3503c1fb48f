"""The HF side of the serving checks (runs in attnslim's environment): greedy tokens and prompt log-probs of a
model directory, computed the way `offline.py` asks vLLM for them (no EOS stop, log-probs of the prompt tokens).

Prompts of one length run as one batch (no padding, so each row is computed as if alone)."""

from __future__ import annotations

from typing import Any

import torch

from attnslim.errors import AttnslimError


def _batch(prompts: list[list[int]]) -> torch.Tensor:
    if not prompts or len({len(p) for p in prompts}) != 1:
        raise AttnslimError(f"the reference runs prompts of one length as a batch; got lengths "
                            f"{sorted({len(p) for p in prompts})}")
    return torch.tensor(prompts)


@torch.no_grad()
def greedy(model: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """`max_tokens` argmax tokens after each prompt, decoding with the model's KV cache."""
    out = model(_batch(prompts), use_cache=True)
    steps = []
    for _ in range(max_tokens):
        tokens = out.logits[:, -1].argmax(dim=-1)  # (b,)
        steps.append(tokens)
        out = model(tokens[:, None], past_key_values=out.past_key_values, use_cache=True)
    return torch.stack(steps, dim=1).tolist()


@torch.no_grad()
def prompt_logprobs(model: Any, prompts: list[list[int]]) -> list[list[float]]:
    """log p(ids[i] | ids[:i]) for i >= 1, in float64 from the model's logits."""
    ids = _batch(prompts)
    logits = model(ids).logits[:, :-1].double()
    picked = torch.log_softmax(logits, dim=-1).gather(2, ids[:, 1:, None])[..., 0]
    return picked.tolist()


def reference(directory: str, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from attnslim.models import load_model

    model, _ = load_model(directory)
    return {"greedy": greedy(model, prompts, max_tokens), "prompt_logprobs": prompt_logprobs(model, prompts)}

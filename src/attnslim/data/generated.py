"""Calibration text the dense model writes itself (`calibration: {source: self}`).

Why: a compression calibrated on Wikipedia keeps Wikipedia and loses the model's own domain (a code model
calibrated on wiki alone kept wiki perplexity but lost much more on code: BENCHMARKS.md, section "Planning under a
budget"). Text sampled from the model is its own distribution, whatever the model was trained on, and needs no data
from the user. It is what the one-command path (`compress --kv`) can calibrate on without asking for anything.

How: each window starts at the tokenizer's sequence start (its BOS; else its end-of-text token, which separates
documents in training) and is sampled at temperature 1 (the model's distribution, neither sharpened nor truncated)
to `seq_len` tokens, the end-of-text token suppressed so every window is full. Sampling is seeded: the same model,
seed, size and torch version give the same windows. Generation uses the model's KV cache, in batches.
"""

from __future__ import annotations

from typing import Any

import torch

from attnslim.errors import AttnslimError

SELF = "self"
GENERATE_BATCH = 16  # windows sampled at once


def start_token(tokenizer: Any) -> int:
    """The token each generated window starts from: BOS, else end-of-text (a document boundary in training)."""
    for name in ("bos_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    raise AttnslimError("calibration source 'self' needs a tokenizer with a BOS or end-of-text token to start "
                        "from; this one has neither: calibrate on a text source (wiki, c4, file:PATH)")


@torch.no_grad()
def generated_windows(model: Any, tokenizer: Any, n: int, seq_len: int, seed: int) -> torch.Tensor:
    """(n, seq_len) token windows sampled from `model` (see the module docstring)."""
    if n < 1 or seq_len < 2:
        raise AttnslimError(f"calibration source 'self': asked for {n} windows of {seq_len} tokens; give windows "
                            ">= 1 and seq_len >= 2")
    first = start_token(tokenizer)
    eos = getattr(tokenizer, "eos_token_id", None)
    device = next(model.parameters()).device
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)  # generate() samples from the global generator; restored below
    try:
        out = []
        for start in range(0, n, GENERATE_BATCH):
            b = min(GENERATE_BATCH, n - start)
            prompt = torch.full((b, 1), first, dtype=torch.long, device=device)
            ids = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=seq_len - 1,
                                 min_new_tokens=seq_len - 1, suppress_tokens=None if eos is None else [eos],
                                 pad_token_id=eos if eos is not None else first)
            out.append(ids[:, :seq_len].cpu())
    finally:
        torch.random.set_rng_state(gen_state)
    windows = torch.cat(out)
    if windows.shape != (n, seq_len):
        raise AttnslimError(f"internal: generation gave windows of shape {tuple(windows.shape)}, not {(n, seq_len)}")
    return windows

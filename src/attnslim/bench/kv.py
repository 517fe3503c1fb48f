"""KV-cache bytes per token, measured from what the cache really holds after a forward pass."""

from __future__ import annotations

from typing import Any

import torch

from attnslim import _compat
from attnslim.eval.causal import noncausal_layers


@torch.no_grad()
def kv_bytes_per_token(model: Any, tokens: int = 64) -> dict[str, Any]:
    """Run `tokens` tokens through the model with a fresh cache and read the bytes it holds.

    Returns {"total": bytes/token, "per_layer": [bytes/token per layer], "tokens": tokens, "no_decode": [layers
    that cannot decode at all (non-causal, eval/causal.py); they hold only a position marker, so their bytes
    are no cache size a generation could have]}.
    """
    device = next(model.parameters()).device
    ids = torch.randint(0, int(model.config.vocab_size), (1, tokens), generator=torch.Generator().manual_seed(0))
    cache = _compat.new_cache(model.config)
    model(input_ids=ids.to(device), past_key_values=cache, use_cache=True)
    per_layer = [b / tokens for b in _compat.cache_bytes_per_layer(cache)]
    return {"total": sum(per_layer), "per_layer": per_layer, "tokens": tokens, "no_decode": noncausal_layers(model)}


def no_decode_note(layers: list[int]) -> str:
    """The sentence a KV report adds when some layers cannot decode ("" when all can)."""
    return (f" (layers {layers} are non-causal: prompt-level scoring only, this model cannot generate)"
            if layers else "")

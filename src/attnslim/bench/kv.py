"""KV-cache bytes per token, measured from what the cache really holds after a forward pass."""

from __future__ import annotations

from typing import Any

import torch

from attnslim import _compat


@torch.no_grad()
def kv_bytes_per_token(model: Any, tokens: int = 64) -> dict[str, Any]:
    """Run `tokens` tokens through the model with a fresh cache and read the bytes it holds.

    Returns {"total": bytes/token, "per_layer": [bytes/token per layer], "tokens": tokens}.
    """
    device = next(model.parameters()).device
    ids = torch.randint(0, int(model.config.vocab_size), (1, tokens), generator=torch.Generator().manual_seed(0))
    cache = _compat.new_cache(model.config)
    model(input_ids=ids.to(device), past_key_values=cache, use_cache=True)
    per_layer = [b / tokens for b in _compat.cache_bytes_per_layer(cache)]
    return {"total": sum(per_layer), "per_layer": per_layer, "tokens": tokens}

"""`DroppedAttention`: the attention sub-block removed (LLM-Drop baseline). Outputs zeros, stores no KV."""

from __future__ import annotations

from typing import Any

import torch

from attnslim import _compat
from attnslim._compat import AttentionCall
from attnslim.modules.base import ReplacementAttention
from attnslim.registry import register_module


@register_module
class DroppedAttention(ReplacementAttention):
    def __init__(self, layer_idx: int, hidden_size: int) -> None:
        super().__init__()
        self.layer_idx, self.hidden_size = layer_idx, hidden_size

    def attend(self, call: AttentionCall) -> torch.Tensor:
        hidden_states, position_embeddings, attention_mask, past_key_values = call
        _compat.cache_mark_tokens(past_key_values, self.layer_idx, hidden_states)
        return torch.zeros_like(hidden_states)

    def kv_cache_bytes_per_token(self) -> int:
        return 1  # the position marker only (_compat.cache_mark_tokens)

    def describe(self) -> dict[str, Any]:
        return {"kind": "DroppedAttention"}

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx} (attention removed, no KV cache)"

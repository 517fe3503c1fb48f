"""`ReplacementAttention`: the base of every module that stands in for a decoder layer's attention.

A decoder layer calls its attention with transformers' keywords; `_compat.attention_call` turns whatever this
transformers version passes into an `AttentionCall` (hidden states, (cos, sin) or None, HF's mask, the cache),
and `_compat.attention_output` shapes the return value. A subclass writes only

    attend(call) -> (b, t, hidden)

so a change of HF's attention call signature is an edit of `_compat.py` alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from attnslim import _compat
from attnslim._compat import AttentionCall
from attnslim.adapters.base import AttentionSpec


@dataclass(frozen=True)
class AttnShape:
    """What a replacement module keeps of the attention layer it replaces, besides weights (read from its
    AttentionSpec). The modules copy the fields they use onto plain attributes, which their decode paths read.

    layer: the decoder layer (its cache slot);  hidden_size: the model's width;  n_heads query heads and n_kv_heads
    KV heads of head_dim each (GQA: query head i·g + j reads KV head i);  scaling: the logit scale;  rope: the layer
    rotates q and k;  softcap: the tanh logit cap (None: none);  sliding_window: the keys a query sees (None: all);
    layer_type: which of the model's RoPE tables (None: no RoPE)."""

    layer: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    scaling: float
    rope: bool
    softcap: float | None = None
    sliding_window: int | None = None
    layer_type: str | None = None

    @classmethod
    def of(cls, spec: AttentionSpec) -> AttnShape:
        return cls(spec.layer, spec.hidden_size, spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.scaling,
                   spec.rope is not None, spec.softcap, spec.sliding_window,
                   spec.rope.layer_type if spec.rope is not None else None)


class ReplacementAttention(nn.Module):
    layer_idx: int

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        return _compat.attention_output(self.attend(_compat.attention_call(args, kwargs)))

    def attend(self, call: AttentionCall) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement attend(call) -> (b, t, hidden)")


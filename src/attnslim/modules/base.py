"""`ReplacementAttention`: the base of every module that stands in for a decoder layer's attention.

A decoder layer calls its attention with transformers' keywords; `_compat.attention_call` turns whatever this
transformers version passes into an `AttentionCall` (hidden states, (cos, sin) or None, HF's mask, the cache),
and `_compat.attention_output` shapes the return value. A subclass writes only

    attend(call) -> (b, t, hidden)

so a change of HF's attention call signature is an edit of `_compat.py` alone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from attnslim import _compat
from attnslim._compat import AttentionCall


class ReplacementAttention(nn.Module):
    layer_idx: int

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        return _compat.attention_output(self.attend(_compat.attention_call(args, kwargs)))

    def attend(self, call: AttentionCall) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement attend(call) -> (b, t, hidden)")


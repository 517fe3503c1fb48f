"""`LinearizedAttention`: an attention sub-block replaced by one affine map y = W x + b (NBL).

No Q/K/V, no softmax, no KV cache: the layer's decode cost is one (d, d) matvec and its cache holds only
the 1-byte/token position marker (see _compat.cache_mark_tokens). The residual add stays outside, in the
decoder layer, so the layer computes h + W x + b.

`input` says what x is:
  "normed"   — x = norm(h), what the original attention received (the pre-attention norm stays);
  "residual" — x = h, the raw residual stream (NBL's reference); the adapter then replaces the layer's
               pre-attention norm by an identity, so this module sees h (`Nbl` does that at install and
               in the loading skeleton alike).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attnslim import _compat
from attnslim._compat import AttentionCall
from attnslim.errors import AttnslimError
from attnslim.modules.base import ReplacementAttention
from attnslim.registry import register_module

INPUTS = ("normed", "residual")


@register_module
class LinearizedAttention(ReplacementAttention):
    def __init__(
        self, layer_idx: int, hidden_size: int, input: str = "normed",
        dtype: torch.dtype | None = None, device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if input not in INPUTS:
            raise AttnslimError(f"LinearizedAttention input={input!r} is invalid; valid: {' | '.join(INPUTS)}")
        self.layer_idx, self.hidden_size, self.input = layer_idx, hidden_size, input
        self.weight = nn.Parameter(torch.zeros(hidden_size, hidden_size, dtype=dtype, device=device))  # (d, d)
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device))  # (d,)

    @torch.no_grad()
    def set_map(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        """Copy W (d, d) and b (d,) in, cast to this module's dtype/device."""
        d = self.hidden_size
        if tuple(weight.shape) != (d, d) or tuple(bias.shape) != (d,):
            raise AttnslimError(
                f"layer {self.layer_idx}: LinearizedAttention expects W ({d}, {d}) and b ({d},), "
                f"got W {tuple(weight.shape)} and b {tuple(bias.shape)}"
            )
        self.weight.copy_(weight.to(self.weight))
        self.bias.copy_(bias.to(self.bias))

    def attend(self, call: AttentionCall) -> torch.Tensor:
        hidden_states, position_embeddings, attention_mask, past_key_values = call
        _compat.cache_mark_tokens(past_key_values, self.layer_idx, hidden_states)
        return F.linear(hidden_states, self.weight, self.bias)  # (b, t, d)

    def kv_cache_bytes_per_token(self) -> int:
        return 1  # the position marker only

    def attention_flops(self, context: int) -> float:
        """No attention core: the map W (d, d) is counted with the layer's linear weights (bench/flops.py)."""
        return 0.0

    def describe(self) -> dict[str, Any]:
        return {"kind": "LinearizedAttention", "input": self.input, "params": self.weight.numel() + self.bias.numel()}

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, d={self.hidden_size}, input={self.input} (y = W x + b, no KV cache)"

"""The model's own RoPE frequencies, for methods that rebuild a rotation (MLA's rotary split, latentllm's RoPE-aware
fit): read from the rotary module, never from rope_theta, since scaled RoPE (llama3, yarn, ...) changes them.

Its own module, not an `Adapter` method: it calls the rotary module through `_compat` (version knowledge), and
`linalg/` imports `adapters.base`, which must stay free of `_compat` (import-linter contract).
"""

from __future__ import annotations

import torch

from attnslim import _compat
from attnslim.adapters.base import Adapter


def rotary_angles(adapter: Adapter, layer_type: str = "full_attention") -> tuple[torch.Tensor, float] | None:
    """(θ_j (d_rot/2,) float64 radians per token, RoPE's attention scale) of the model's rotary module for
    `layer_type`, or None when the adapter gives none."""
    rotary = adapter.rotary_embedding(layer_type)
    if rotary is None:
        return None
    # on the rotary module's own device: with offloaded weights the layer's tensors may not be materialised
    device = next(iter(rotary.buffers()), torch.zeros(0)).device
    x = torch.zeros(1, dtype=torch.float32, device=device)
    pos = torch.arange(2, device=device)[None]
    cos, sin = _compat.rotary_cos_sin(rotary, x, pos, layer_type)  # (1, 2, d_rot)
    half = cos.shape[-1] // 2
    return torch.atan2(sin[0, 1, :half].double(), cos[0, 1, :half].double()), float(cos[0, 0, 0])

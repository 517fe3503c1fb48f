"""Rotary position embedding in the half-split convention used by HF Llama/Gemma/Qwen."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(..., d) -> (..., d): [x1, x2] -> [-x2, x1] with x1, x2 the two halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (b, h, t, d) by cos/sin (b, t, d_rot); only the first d_rot dims rotate (partial RoPE)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (b, 1, t, d_rot)
    d_rot = cos.shape[-1]
    if d_rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :d_rot], x[..., d_rot:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)

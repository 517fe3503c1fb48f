"""LISA's head aligner: a position-wise FFN over the head axis of attention scores (modules/shared.py uses it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnslim.errors import AttnslimError
from attnslim.registry import register_module


@register_module
class Aligner(nn.Module):
    """Position-wise FFN over the head axis: (b, c_in, l, t) -> (b, h, l, t); mixes heads, never positions.

    hidden = 0: one linear c_in -> h (the paper's LISA_SL); hidden > 0: c_in -> hidden -> ReLU -> h ("DL").
    """

    max_elements = 1 << 24  # the (b, rows, t, hidden) activation is chunked over query rows above this
    per_entry = True  # its weights act on every (query, key) score entry: counted by the owner's attention_flops

    def flops_per_entry(self) -> int:
        """FLOPs of the FFN for one (query, key) entry: 2 per weight."""
        return 2 * sum(lin.weight.numel() for lin in (self.l1, self.l2) if lin is not None)

    def __init__(self, c_in: int, n_heads: int, hidden: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.c_in, self.n_heads, self.hidden = c_in, n_heads, hidden
        self.l1 = nn.Linear(c_in, hidden or n_heads, dtype=dtype)
        self.l2 = nn.Linear(hidden, n_heads, dtype=dtype) if hidden else None

    def _ffn(self, z: torch.Tensor) -> torch.Tensor:  # (b, rows, t, c_in) -> (b, rows, t, h)
        y = self.l1(z)
        return y if self.l2 is None else self.l2(F.relu(y))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        y = z.permute(0, 2, 3, 1)  # (b, l, t, c_in): channels last, so the FFN is a plain linear
        b, l, t, _ = y.shape
        rows = max(1, self.max_elements // max(1, b * t * max(self.hidden, self.c_in)))
        if rows >= l:
            out = self._ffn(y)
        else:
            out = torch.cat([self._ffn(y[:, i : i + rows]) for i in range(0, l, rows)], dim=1)
        return out.permute(0, 3, 1, 2)  # (b, h, l, t)

    @torch.no_grad()
    def identity_init(self) -> None:
        """Output = the first h input channels (A_{n-1}) exactly; other channels get zero weight.

        DL: W1 = [I; -I; random] on the A_{n-1} block, W2 = [I, -I, 0], using relu(a) - relu(-a) = a. The
        random hidden rows keep their default init (W2 reads them with 0) so they are not dead at the start.
        """
        h = self.n_heads
        eye = torch.eye(h, dtype=self.l1.weight.dtype)
        if self.l2 is None:
            self.l1.weight.zero_()
            self.l1.weight[:, :h] = eye
            self.l1.bias.zero_()
            return
        if self.hidden < 2 * h:
            raise AttnslimError(f"aligner hidden={self.hidden} < 2*heads={2 * h}: identity init needs hidden >= 2h")
        w1 = self.l1.weight  # (hidden, c_in)
        w1[: 2 * h].zero_()
        w1[:h, :h], w1[h : 2 * h, :h] = eye, -eye
        self.l1.bias[: 2 * h].zero_()
        w1[2 * h :, h:].zero_()  # the A_delta block starts silent in every hidden unit
        self.l2.weight.zero_()
        self.l2.weight[:, :h], self.l2.weight[:, h : 2 * h] = eye, -eye
        self.l2.bias.zero_()

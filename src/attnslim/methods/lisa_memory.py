"""LISA's memory arithmetic (paper §5.1, "Theoretical analysis"), with the GQA correction.

A LISA layer caches K_LR (g KV heads × r values per token) instead of K (g × d_k); a DS layer caches only V and a
one-value position marker per KV head (what an HF cache needs to count tokens). In exchange one pre-softmax score
tensor travels from each donor to its receiver: h × l × t values, only one alive at a time. So per sequence:

    saved K cache  = l · Σ_layers g·(d_k − r_n) · size            (r_n = K_LR's rank, or 1 for a DS marker)
    score tensor   = h · l · t · size                              (prefill: t = l; a decode step: l = 1)
    break-even     l* = Σ_layers g·(d_k − r_n) / h                 (the paper's N(d_k − r) with h for the K heads)

Prefill needs more memory than dense when the prompt is longer than l*; a decode step always saves. The paper
writes h for the cache's heads; with GQA they are g, hence the g/h factor. tests/test_lisa_memory.py checks these
against the bytes measured in HF caches and in the score hand-over of a converted model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from attnslim.errors import AttnslimError


@dataclass(frozen=True)
class SharedLayer:
    """What one sharing layer caches per token and KV head: `keys` values (K_LR's rank, or 1 for DS) and
    `head_dim` values of V, over `n_kv_heads` heads; `n_heads` query heads receive the donor's scores."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    keys: int


def saved_kv_per_token(layers: Iterable[SharedLayer], element_size: int) -> int:
    """Bytes of K cache per token the sharing layers save against dense keys: Σ g·(d_k − r)·size."""
    return sum(s.n_kv_heads * (s.head_dim - s.keys) * element_size for s in layers)


def score_bytes(n_heads: int, queries: int, keys: int, element_size: int) -> int:
    """Bytes of the one score tensor (b=1, h, queries, keys) alive while a receiver reads its donor's scores."""
    return n_heads * queries * keys * element_size


def prefill_break_even(layers: Iterable[SharedLayer]) -> float:
    """The prompt length l* above which a LISA prefill needs more memory than dense: saved K per token over the
    score row per token, Σ g·(d_k − r) / h (element sizes cancel)."""
    shared = list(layers)
    if not shared:
        raise AttnslimError("no sharing layers (lisa or ds): nothing is saved and no score tensor is stored")
    heads = {s.n_heads for s in shared}
    if len(heads) != 1:
        raise AttnslimError(f"sharing layers with different query head counts {sorted(heads)}: the break-even "
                            "length assumes one score shape")
    return saved_kv_per_token(shared, 1) / heads.pop()


def shared_layers(model: nn.Module) -> list[SharedLayer]:
    """The SharedAttention layers of a converted model, described for the arithmetic above."""
    from attnslim.modules.shared import SharedAttention

    out = []
    for module in model.modules():
        if isinstance(module, SharedAttention):
            s = module.shape
            out.append(SharedLayer(s.n_heads, s.n_kv_heads, s.head_dim, module.cfg.rank or 1))
    return out

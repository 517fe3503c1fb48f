"""`drop`: remove the attention sub-block of chosen layers (LLM-Drop, arXiv 2406.15786).

Selection "similarity" follows LLM-Drop: importance = 1 − mean_tokens cos(h, h + a) with h the residual stream
entering the layer and a what the attention sub-block adds to it; the `count` least important candidate layers are
dropped. Where the decoder layer normalises the attention output before the add (Gemma-3's
post_attention_layernorm), a = norm(attn(h)), as NBL scores it: the raw output's scale says nothing about what the
stream receives, and scoring it made every Gemma-3 layer look alike.
Selection "given" drops every layer of the step's selector. A dropped layer outputs zero, computes no
Q/K/V and stores no KV cache (a 1-byte/token position marker, see _compat).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnslim.adapters.base import Adapter
from attnslim.methods.base import NO_CONTEXT, Fit, Method, StepContext, require
from attnslim.methods.collect import Collector, NoStats
from attnslim.methods.selecting import Selecting
from attnslim.modules.dropped import DroppedAttention
from attnslim.plan import NoEntry, StepPlan
from attnslim.registry import register_method


class SimilarityCollector(Collector[float]):
    """Mean cosine similarity between the residual stream before and after the attention sub-block."""

    sites = {"resid_in", "attn_out"}

    def __init__(self, out_norm: torch.nn.Module | None = None) -> None:
        self.out_norm = out_norm  # the norm the decoder layer applies to the attention output (Gemma-3), or None
        self.pending: torch.Tensor | None = None
        self.total, self.n = 0.0, 0

    def __call__(self, site: str, x: torch.Tensor) -> None:
        if site == "resid_in":
            self.pending = x
            return
        assert self.pending is not None, "resid_in must be seen before attn_out"
        h = self.pending.to(torch.float64)
        added = (x if self.out_norm is None else self.out_norm(x)).to(torch.float64)  # (b, t, d)
        cos = F.cosine_similarity(h, h + added, dim=-1)  # (b, t)
        self.total += float(cos.sum())
        self.n += cos.numel()
        self.pending = None

    def result(self) -> float:
        return self.total / max(self.n, 1)


@register_method("drop")
@dataclass(frozen=True)
class Drop(Selecting[float | None], Method[NoEntry, float | None]):
    count: int | None = None
    select: str = "similarity"
    sequential = False
    selects_layers = True

    def __post_init__(self) -> None:
        require(self.select in ("similarity", "given"), self.name, "select", self.select, "similarity | given")
        if self.select == "similarity":
            require(self.count is not None and self.count >= 0, self.name, "count", self.count,
                    "an integer >= 0 (how many candidate layers to drop)")

    def collector(self, adapter: Adapter, layer: int) -> Collector[float | None]:
        if self.select == "given":
            return NoStats()
        return SimilarityCollector(adapter.attention_output_norm(layer))

    def plan(self, adapter: Adapter, layers: list[int], stats: Mapping[int, float | None],
             context: StepContext = NO_CONTEXT) -> StepPlan[NoEntry]:
        if self.select == "given":
            return StepPlan({i: NoEntry() for i in layers})
        assert self.count is not None
        require(self.count <= len(layers), self.name, "count", self.count, f"0..{len(layers)} (the candidates)")
        importance = {i: 1.0 - _similarity(stats[i]) for i in layers}
        chosen = sorted(sorted(layers, key=lambda i: importance[i])[: self.count])
        return StepPlan({i: NoEntry() for i in chosen},
                        info={"importance": {str(i): round(v, 6) for i, v in importance.items()}})

    def convert(self, adapter: Adapter, layer: int, entry: NoEntry, stats: float | None) -> Fit:
        self.skeleton(adapter, layer, entry)
        return None

    def skeleton(self, adapter: Adapter, layer: int, entry: NoEntry) -> None:
        adapter.replace_attention(layer, DroppedAttention(layer, adapter.config.hidden_size))


def _similarity(value: float | None) -> float:
    assert value is not None, "select similarity collects a similarity per candidate"
    return value

"""FLOPs per generated token at a given context length, counted from the real modules.

Linear layers cost 2 FLOPs per weight (LowRankLinear's real parameter count is used, so the block-identity
saving shows; NBL's map W counts as d² weights). The attention core (scores + weighted values) costs
4·context·n_heads·head_dim for standard attention; replacement modules report their own through
`attention_flops(context)` (0 for dropped or linearized layers; LISA's low-rank scores, aligner and values).
Embedding lookups are free; the LM head is counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from attnslim.adapters import get_adapter
from attnslim.modules.linearized import LinearizedAttention
from attnslim.modules.lowrank import LowRankLinear


def _linear_weights(module: nn.Module) -> int:
    """Weights applied once per token; submodules marked `per_entry` (LISA's aligner, applied to every score
    entry) are left to their owner's attention_flops."""
    if getattr(module, "per_entry", False):
        return 0
    if isinstance(module, nn.Linear):
        return module.weight.numel()
    if isinstance(module, LowRankLinear):
        return module.factor_weights()
    if isinstance(module, LinearizedAttention):  # the NBL map W (d, d)
        return module.weight.numel()
    return sum(_linear_weights(child) for child in module.children())


def flops_per_token(model: Any, context: int) -> dict[str, float]:
    adapter = get_adapter(model)
    core = 0.0
    for i in range(adapter.num_layers()):
        attn: Any = adapter.attention(i)
        if hasattr(attn, "attention_flops"):
            core += float(attn.attention_flops(context))
        elif not list(attn.parameters()):  # dropped: no attention core
            continue
        else:
            heads = adapter.attention_heads(i)  # not attention_spec: factored linears have no dense weight
            core += 4.0 * context * heads.n_heads * heads.head_dim
    layers = sum(2.0 * _linear_weights(layer) for layer in adapter.decoder_layers())
    head = 2.0 * sum(p.numel() for p in model.get_output_embeddings().parameters())
    return {"linear": layers, "attention_core": core, "lm_head": head, "total": layers + core + head}


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def decode_bytes_per_token(model: Any, context: int, kv_per_layer: Sequence[float]) -> dict[str, float]:
    """Bytes one decode step reads at `context` cached tokens, the memory side of `flops_per_token`:
      weights  every decoder layer's parameters once, where the attention module's are replaced by what its
               decode reads where it says (`decode_weight_bytes`: MLA reads derived absorbed maps, not its
               factors), plus the LM head; the embedding lookup (one row) is left out
      kv       each layer's bytes per cached token (measured from the cache: bench.kv's per_layer) × the rows it
               holds at `context` (the adapter's `cached_rows`: a sliding-window layer holds at most its window)
    What a cache implementation copies on top (HF's dynamic cache concatenates dense layers' whole cache at
    every step) is not counted: that is the cache's cost, not the algorithm's."""
    adapter = get_adapter(model)
    weights = 0
    for i, layer in enumerate(adapter.decoder_layers()):
        attn: Any = adapter.attention(i)
        reads = int(attn.decode_weight_bytes()) if hasattr(attn, "decode_weight_bytes") else _param_bytes(attn)
        weights += _param_bytes(layer) - _param_bytes(attn) + reads
    weights += _param_bytes(model.get_output_embeddings())
    kv = float(sum(b * adapter.cached_rows(i, context) for i, b in enumerate(kv_per_layer)))
    return {"weights": float(weights), "kv": kv, "total": weights + kv}

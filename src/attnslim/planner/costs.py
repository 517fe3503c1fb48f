"""Exact resource costs of one candidate at one layer, read from the module it would install.

Nothing is re-derived here: the candidate's method plans the layer (its own rank/rope arithmetic and refusals),
its `skeleton` builds the empty module compress would build, and the module reports what it costs
(`kv_cache_bytes_per_token`, its parameters, `decode_weight_bytes` where decode reads other tensors than its
parameters, e.g. MLA's absorbed maps). Then the layer is restored. A kept layer caches 2·n_kv·d_h values per token
in the attention weights' dtype, as HF's cache holds them.

    kv_bytes      bytes per token the layer's cache holds (what bench.kv_bytes_per_token measures)
    params        parameters of the layer's attention, plus what the conversion changes in the layers it rewires
                  (`Method.rewires`: a sharing receiver's donor)
    decode_bytes  bytes one decode step reads for the layer at `context` cached tokens: its weights as decode reads
                  them + kv_bytes × the rows it holds (`Adapter.cached_rows`: a sliding layer holds its window)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

from attnslim.adapters.base import Adapter
from attnslim.errors import AttnslimError
from attnslim.methods import Method, lookup_method
from attnslim.methods.nbl import NblEntry
from attnslim.plan import LayerEntry
from attnslim.planner.candidates import Candidate


@dataclass(frozen=True)
class Resources:
    kv_bytes: float  # per token
    params: int
    decode_bytes: float  # per decode step at the planner's context


def method_of(candidate: Candidate) -> Method[Any, Any]:
    """The candidate's method built from its step arguments (their own validation applies)."""
    assert candidate.method is not None, "keep has no method"
    return lookup_method(candidate.method).from_args(candidate.step_args())


def entry_for(method: Method[Any, Any], adapter: Adapter, layer: int) -> LayerEntry:
    """The plan entry `method` gives `layer` when the step holds that layer alone. NBL's plan ranks layers from
    their statistics; with criterion "given" it converts every layer of the step with the same entry."""
    if method.name == "nbl":
        return NblEntry(method.input)  # type: ignore[attr-defined]
    return method.plan(adapter, [layer], {}).layers[layer]


def touched(method: Method[Any, Any], layer: int) -> list[int]:
    """The layers a conversion of `layer` changes: itself and what the method rewires (a receiver's donor)."""
    return [layer, *method.rewires(layer)]


@contextmanager
def restored(adapter: Adapter, layers: list[int]) -> Iterator[None]:
    """Whatever happens to the attention modules and pre-attention norms of `layers` inside, they are put back."""
    attention = {j: adapter.attention(j) for j in layers}
    norms = {j: adapter.attention_norm(j) for j in layers}
    links = {j: (getattr(m, "link", None), getattr(m, "export", None)) for j, m in attention.items()}
    try:
        yield
    finally:
        for j in layers:
            adapter.replace_attention(j, attention[j])
            if adapter.attention_norm(j) is not norms[j]:
                adapter.replace_attention_norm(j, norms[j])
            for name, value in zip(("link", "export"), links[j], strict=True):
                if hasattr(attention[j], name):
                    setattr(attention[j], name, value)


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _read_bytes(module: nn.Module) -> int:
    reads = getattr(module, "decode_weight_bytes", None)
    return int(reads()) if callable(reads) else _param_bytes(module)


def _kv_bytes(module: nn.Module, adapter: Adapter, layer: int) -> float:
    own = getattr(module, "kv_cache_bytes_per_token", None)
    if callable(own):
        return float(own())
    if type(module).__module__.startswith("attnslim."):
        raise AttnslimError(f"internal: {type(module).__name__} at layer {layer} does not report its KV bytes")
    spec = adapter.attention_spec(layer)
    return float(2 * spec.n_kv_heads * spec.head_dim * spec.k.element_size())


def resources(adapter: Adapter, layer: int, candidate: Candidate, context: int) -> Resources:
    """The candidate's exact costs at `layer` (a refusal of its method names the layer and the reason)."""
    rows = adapter.cached_rows(layer, context)
    dense = adapter.attention(layer)
    if candidate.method is None:
        kv = _kv_bytes(dense, adapter, layer)
        return Resources(kv, _param_count(dense), float(_read_bytes(dense)) + kv * rows)
    method = method_of(candidate)
    group = touched(method, layer)
    if outside := [j for j in group if not 0 <= j < adapter.num_layers()]:
        raise AttnslimError(f"{candidate.label} at layer {layer} would change layers {outside}, which the model does "
                            "not have (sharing needs a layer before it)")
    before = {j: adapter.attention(j) for j in group}
    with restored(adapter, group):
        method.skeleton(adapter, layer, entry_for(method, adapter, layer))
        module = adapter.attention(layer)
        kv = _kv_bytes(module, adapter, layer)
        params = _param_count(module) + sum(_param_count(adapter.attention(j)) - _param_count(before[j])
                                            for j in group[1:])
        reads = _read_bytes(module) + sum(_read_bytes(adapter.attention(j)) - _read_bytes(before[j]) for j in group[1:])
    return Resources(kv, params, float(reads) + kv * rows)

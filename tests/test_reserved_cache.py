"""`_compat.ReservedRowsLayer`: a dynamic cache layer that appends in place. It must hold what HF's DynamicLayer
holds after every operation generate() performs on a cache (append, crop, beam reorder, batch repeat/select),
copy rows only when its buffer is full, and count its spare rows as cache bytes."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from attnslim import _compat
from conftest import tiny_llama, tiny_qwen2
from test_pipeline import _compress


def _rows(seed: int, t: int, b: int = 2, value_width: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 3, t, 8, generator=g), torch.randn(b, 3, t, value_width, generator=g)


@pytest.mark.parametrize("value_width", [4, 0])  # 0: a latent cache's empty value slot (modules/mla.py)
def test_holds_what_a_dynamic_layer_holds_through_every_cache_operation(value_width):
    ref, got = DynamicLayer(), _compat.ReservedRowsLayer()
    rows = functools.partial(_rows, value_width=value_width)

    def both(op: str, *args: object) -> None:
        for layer in (ref, got):
            getattr(layer, op)(*args)
        assert torch.equal(got.keys, ref.keys) and torch.equal(got.values, ref.values), op
        assert got.get_seq_length() == ref.get_seq_length()

    both("update", *rows(0, 5))  # prefill
    for step in range(1, 80):  # decode past the first growth (64 spare rows)
        both("update", *rows(step, 1))
    both("crop", -7)  # assisted decoding rejects draft tokens: the cut rows are overwritten next
    both("update", *rows(100, 3))
    both("reorder_cache", torch.tensor([1, 0]))  # beam search
    both("update", *rows(101, 1))
    both("batch_repeat_interleave", 2)
    both("update", *rows(102, 1, b=4))
    both("batch_select_indices", torch.tensor([0, 3]))
    both("update", *rows(103, 2))
    got.reset()
    assert got.reserved_bytes() == 0 and not got.is_initialized


def test_appends_in_place_and_counts_its_spare_rows():
    layer = _compat.ReservedRowsLayer()
    k, v = _rows(0, 100, b=1)
    layer.update(k, v)
    assert layer.reserved_bytes() == k.nbytes + v.nbytes  # a prefill reserves exactly its rows
    layer.update(*_rows(1, 1, b=1))  # full: one copy into a buffer with max(64, 101 // 8) spare rows
    buffer = layer.keys.data_ptr()
    assert layer.reserved_bytes() == (k.nbytes + v.nbytes) // 100 * (101 + 64)
    for step in range(64):
        layer.update(*_rows(2 + step, 1, b=1))
    assert layer.keys.data_ptr() == buffer and layer.get_seq_length() == 165  # no copy while rows are spare
    layer.update(*_rows(70, 1, b=1))
    assert layer.keys.data_ptr() != buffer and layer.get_seq_length() == 166


@pytest.mark.parametrize("method,args", [("mla", {"kv_ratio": 0.5}), ("latentllm", {"ratio": 1.0, "kv_ratio": 0.5}),
                                         ("latentllm", {"ratio": 1.0, "kv_ratio": 0.75, "cache": "values"})])
def test_reserved_cache_kind_and_latent_modules_install_it_on_full_attention_layers_only(method, args):
    model = tiny_qwen2()  # full and sliding-window layers: HF's sliding layer keeps only the window, left as it is
    cache = _compat.new_cache(model.config, "reserved")
    assert [type(layer).__name__ for layer in cache.layers] == ["ReservedRowsLayer"] * 2 + [
        "DynamicSlidingWindowLayer"] * 2
    _compress(model, method, args)
    cache = _compat.new_cache(model.config)  # generate()'s default: plain dynamic and sliding-window layers
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 6, dtype=torch.long), past_key_values=cache, use_cache=True)
    assert [type(layer).__name__ for layer in cache.layers] == ["ReservedRowsLayer"] * 2 + [
        "DynamicSlidingWindowLayer"] * 2
    layer = cache.layers[0]  # a prefill reserves exactly its rows
    assert _compat.cache_bytes_per_layer(cache)[0] == layer.keys.nbytes + layer.values.nbytes
    cache = DynamicCache()  # built without a config (HF's documented form): its layers appear as they are used
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 6, dtype=torch.long), past_key_values=cache, use_cache=True)
    assert [type(layer).__name__ for layer in cache.layers] == ["ReservedRowsLayer"] * 4
    plain = tiny_llama()  # a dense model keeps HF's layers in the default cache
    cache = _compat.new_cache(plain.config)
    with torch.no_grad():
        plain(input_ids=torch.zeros(1, 6, dtype=torch.long), past_key_values=cache, use_cache=True)
    assert all(type(layer) is DynamicLayer for layer in cache.layers)

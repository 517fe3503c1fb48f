"""LISA's memory formula and break-even length (notes §3.6, §7 #10) against the bytes a converted model really uses:
the K cache HF holds after a prefill, and the score tensor handed from donor to receiver."""

from __future__ import annotations

import warnings

import pytest
import torch

from attnslim import _compat
from attnslim.api import compress
from attnslim.errors import AttnslimError
from attnslim.methods.lisa_memory import (
    SharedLayer,
    prefill_break_even,
    saved_kv_per_token,
    score_bytes,
    shared_layers,
)
from attnslim.modules.score_link import ScoreLink
from attnslim.recipe import recipe_from_dict
from conftest import tiny_llama
from helpers import ByteTokenizer


def _lisa_and_ds():
    model = tiny_llama()  # 4 layers, 4 query heads, 2 KV heads, head_dim 16, float32
    recipe = recipe_from_dict({
        "name": "lisa-ds", "calibration": {"source": "tiny", "windows": 4, "seq_len": 32, "seed": 0, "batch_size": 2},
        "steps": [{"method": "lisa", "layers": [1], "args": {}}, {"method": "ds", "layers": [3], "args": {}}]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compress(model, ByteTokenizer(), recipe, progress=False)
    return model


def _measure(model, length: int, monkeypatch) -> tuple[int, int]:
    """(K-cache bytes of the prefill, the largest score tensor handed over, in bytes)."""
    largest = [0]
    put = ScoreLink.put

    def spy(self, scores):
        largest[0] = max(largest[0], scores.numel() * scores.element_size())
        put(self, scores)

    monkeypatch.setattr(ScoreLink, "put", spy)
    cache = _compat.new_cache(model.config)
    ids = torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    keys = sum(layer.keys.numel() * layer.keys.element_size() for layer in cache.layers)
    return keys, largest[0]


def test_formula_matches_measured_cache_and_score_bytes_and_the_break_even_length(monkeypatch):
    model = _lisa_and_ds()
    layers = shared_layers(model)
    assert [s.keys for s in layers] == [2, 1]  # K_LR rank 2 on layer 1, the DS position marker on layer 3
    dense_keys = 4 * 2 * 16 * 4  # 4 layers × g × d_k × 4 bytes, per token
    for length in (8, 16, 24):
        keys, scores = _measure(model, length, monkeypatch)
        assert dense_keys * length - keys == saved_kv_per_token(layers, 4) * length
        assert scores == score_bytes(4, length, length, 4)  # h × l × l in prefill: one tensor at a time
    l_star = prefill_break_even(layers)
    assert l_star == (2 * (16 - 2) + 2 * (16 - 1)) / 4  # Σ g (d_k − r) / h = 14.5
    # the paper's claim on measured bytes: prefill saves below l*, costs more above it
    for length in (8, 16, 24):
        keys, scores = _measure(model, length, monkeypatch)
        saves = dense_keys * length - keys > scores
        assert saves == (length < l_star), (length, l_star)


def test_decode_step_holds_one_score_row(monkeypatch):
    model = _lisa_and_ds()
    cache = _compat.new_cache(model.config)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(3))
    sizes: list[int] = []
    put = ScoreLink.put
    monkeypatch.setattr(ScoreLink, "put", lambda self, s: (sizes.append(s.numel() * s.element_size()), put(self, s)))
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        sizes.clear()
        model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    assert max(sizes) == score_bytes(4, 1, 13, 4)  # h × 1 × t: a decode step always saves


def test_break_even_refuses_what_it_cannot_describe():
    with pytest.raises(AttnslimError, match="no sharing layers"):
        prefill_break_even([])
    with pytest.raises(AttnslimError, match="different query head counts"):
        prefill_break_even([SharedLayer(4, 2, 16, 2), SharedLayer(8, 2, 16, 2)])

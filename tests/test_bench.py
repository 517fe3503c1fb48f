"""`attnslim bench` on tiny random models: sizes, KV bytes, FLOPs, interleaved speed ratios, tokenizer check."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import BatchEncoding

from attnslim.bench.report import bench_models, format_bench
from attnslim.errors import AttnslimError
from conftest import tiny_llama
from test_pipeline import _compress


class _Tok:
    def __init__(self, vocab: int = 128, shift: int = 0) -> None:
        self.vocab, self.shift = vocab, shift

    def __call__(self, text: str) -> BatchEncoding:
        return BatchEncoding({"input_ids": [(ord(c) + self.shift) % self.vocab for c in text]})

    def __len__(self) -> int:
        return self.vocab


def test_bench_reports_sizes_kv_flops_and_ratios_against_the_reference():
    dense = tiny_llama()
    dropped = copy.deepcopy(dense)
    _compress(dropped, "drop", {"count": 2})
    result = bench_models({"dense": (dense, _Tok()), "dropped": (dropped, _Tok())}, [16, 32], new_tokens=2,
                          repeats=1)
    assert result["device"] == "cpu (cpu)" and result["speed"]["reference"] == "dense"
    sizes = result["sizes"]
    assert sizes["dropped"]["kv_bytes_per_token"] < sizes["dense"]["kv_bytes_per_token"]
    assert sizes["dropped"]["params"]["attention"] < sizes["dense"]["params"]["attention"]
    for ctx in ("16", "32"):
        assert sizes["dropped"]["flops_per_token"][ctx] < sizes["dense"]["flops_per_token"][ctx]
        assert result["speed"]["models"]["dense"][ctx]["decode_ratio"] == 1.0
        assert result["speed"]["models"]["dropped"][ctx]["decode_tok_s"] > 0
    text = format_bench(result)
    assert "device: cpu (cpu)" in text and "context    32" in text and "ratios vs dense" in text
    low, high = result["speed"]["models"]["dropped"]["32"]["decode_ratio_span"]
    assert low == high == pytest.approx(result["speed"]["models"]["dropped"]["32"]["decode_ratio"])  # one repetition
    assert f"repetitions {low:.2f}-{high:.2f}x" in text


def test_bench_refuses_models_with_different_tokenizers():
    with pytest.raises(AttnslimError, match="different tokenizers"):
        bench_models({"a": (tiny_llama(), _Tok()), "b": (tiny_llama(), _Tok(shift=3))}, [16], repeats=1)


def test_speed_reports_the_span_of_paired_per_repetition_decode_ratios(monkeypatch):
    """Each repetition's ratio pairs the two models' timings of that repetition; the median ratio is checked
    against the span, which shows whether a ratio near 1 is a margin or parity."""
    from attnslim.bench import speed

    ref, new = tiny_llama(), tiny_llama()
    per_token = {id(ref): iter([0.5, 0.10, 0.10, 0.10]), id(new): iter([0.5, 0.08, 0.125, 0.10])}  # warm-up first
    monkeypatch.setattr(speed, "time_prefill_decode", lambda model, ids, n, kind: (0.01, next(per_token[id(model)])))
    result = speed.interleaved({"ref": ref, "new": new}, [16], repeats=3, progress=False)
    assert result["models"]["ref"]["16"]["decode_ratio_span"] == [1.0, 1.0]
    assert result["models"]["new"]["16"]["decode_ratio_span"] == pytest.approx([0.8, 1.25])  # 0.1/0.125, 0.1/0.08
    assert result["models"]["new"]["16"]["decode_ratio"] == pytest.approx(1.0)  # medians 0.10 and 0.10


def test_speed_runs_on_a_static_cache_sized_for_prompt_and_new_tokens():
    from attnslim import _compat
    from attnslim.bench import interleaved

    model = tiny_llama()
    result = interleaved({"dense": model}, [16], new_tokens=3, repeats=1, progress=False, cache_kind="static")
    assert result["cache"] == "static" and result["models"]["dense"]["16"]["decode_tok_s"] > 0
    cache = _compat.new_cache(model.config, "static", 20)
    model(input_ids=torch.zeros(1, 16, dtype=torch.long), past_key_values=cache, use_cache=True)
    assert cache.layers[0].keys.shape[-2] == 20 and cache.get_seq_length() == 16  # one buffer, written in place
    for kind, length in (("paged", 20), ("static", None)):
        with pytest.raises(AttnslimError, match="valid kinds.*max_length > 0"):
            _compat.new_cache(model.config, kind, length)

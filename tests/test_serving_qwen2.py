"""vLLM serves a Qwen2-family attnslim output (kept, NBL-linearised and dropped layers) through attnslim's plugin as
HF runs it (marker `serving`: `make test-serve`).

The plugin builds vLLM's own Llama layers; a Qwen2 model is one with q/k/v biases and no o_proj bias, which vLLM's
Llama takes as `qkv_bias` (serving/vllm_config.py). The model here is SmolLM2-135M's weights in transformers'
Qwen2 class with q/k/v biases drawn at random: a real tokenizer and peaked outputs at the size of the other serving
checks (the packaged Qwen2 model has 1.5B parameters: 7 GB in float32 on each side, beside CI's other jobs). float32
on both sides, the 8 wiki prompts of tests/test_serving.py, 64 greedy tokens each.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from serving_helpers import MAX_TOKENS, PROMPT_LEN, offline, perplexity, wiki_prompts

pytestmark = pytest.mark.serving
LINEARISED, DROPPED = [10, 20], [15, 25]


def qwen2_twin() -> tuple[torch.nn.Module, object]:
    """SmolLM2-135M as a Qwen2ForCausalLM, its q/k/v biases random (std 0.05, seeded)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from attnslim.models import load_model

    llama, tokenizer = load_model("smollm2-135m")
    c = llama.config
    config = Qwen2Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                         num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
                         rms_norm_eps=c.rms_norm_eps, rope_parameters=dict(c.rope_parameters),
                         tie_word_embeddings=True, use_sliding_window=False, bos_token_id=c.bos_token_id,
                         eos_token_id=c.eos_token_id)
    model = Qwen2ForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(llama.state_dict(), strict=False)
    assert not unexpected and all(name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")) for name in missing)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name in missing:
            bias = model.get_parameter(name)
            bias.copy_(0.05 * torch.randn(bias.shape, generator=generator))
    return model, tokenizer


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Path:
    from attnslim.api import compress
    from attnslim.io import save
    from attnslim.recipe import recipe_from_dict

    model, tokenizer = qwen2_twin()
    recipe = recipe_from_dict({
        "name": "serve-qwen2", "calibration": {"source": "wiki", "windows": 16, "seq_len": 256, "seed": 0},
        "steps": [{"method": "nbl", "layers": LINEARISED, "args": {"criterion": "given", "sequential": False}},
                  {"method": "drop", "layers": DROPPED, "args": {"select": "given"}}]})
    report = compress(model, tokenizer, recipe, progress=False)
    return save(model, tokenizer, tmp_path_factory.mktemp("qwen2") / "out", report.to_json())


@pytest.fixture(scope="module")
def runs(served, tmp_path_factory) -> tuple[dict, dict]:
    from attnslim.serving.reference import reference

    prompts = wiki_prompts()
    vllm = offline(tmp_path_factory.mktemp("vllm-qwen2"), [str(served)], prompts)[str(served)]
    return vllm, reference(str(served), prompts, MAX_TOKENS)


def test_the_plugin_serves_a_qwen2_output_greedy_equal_to_hf(runs):
    vllm, hf = runs
    assert vllm["architecture"] == "AttnslimForCausalLM"
    for i, (a, b) in enumerate(zip(vllm["correctness"]["greedy"], hf["greedy"], strict=True)):
        assert len(a) == len(b) == MAX_TOKENS
        first = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        assert first is None, f"prompt {i}: vLLM and HF differ from new token {first} ({a[first]} vs {b[first]})"


def test_the_plugin_serves_a_qwen2_output_within_one_percent_of_hf_perplexity(runs):
    vllm, hf = runs
    assert len(vllm["correctness"]["prompt_logprobs"][0]) == PROMPT_LEN - 1
    ours, theirs = perplexity(vllm["correctness"]["prompt_logprobs"]), perplexity(hf["prompt_logprobs"])
    assert abs(ours / theirs - 1) < 0.01, (ours, theirs)

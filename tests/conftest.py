"""Shared fixtures: tiny random models of every supported family, built from configs (no network)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def one_thread(request: pytest.FixtureRequest) -> Iterator[None]:
    """The matrices in tests on tiny models are small: intra-op threading only adds contention on a loaded 2-core
    box (a module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`). A `real` test in such a module
    keeps every thread: a packaged model's matrices are large enough for both cores to help."""
    if request.node.get_closest_marker("real") is not None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        rope_theta=10000.0, tie_word_embeddings=True, attn_implementation="sdpa",
    )
    cfg.update(overrides)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**cfg)).eval()


@pytest.fixture
def llama():
    return tiny_llama()


def _perturb_biases_and_norms(model, seed: int):
    """HF initialises biases to 0 and norm gains to 1 (Gemma: 0 for a (1 + w) gain); randomise them so
    the tests notice a dropped bias or norm. Returns the model in eval mode."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def _tiny(config_cls, model_cls, base: dict, overrides: dict, seed: int = 0):
    cfg = {**base, **overrides}
    torch.manual_seed(seed)
    return _perturb_biases_and_norms(model_cls(config_cls(**cfg)), seed)


_COMMON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    max_position_embeddings=256, initializer_range=0.1, attn_implementation="sdpa",
)


def tiny_qwen2(**overrides):
    """Qwen2: GQA, q/k/v biases, sliding window (4) in layers >= 2."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    base = dict(
        _COMMON, num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=True,
        use_sliding_window=True, sliding_window=4, max_window_layers=2,
    )
    return _tiny(Qwen2Config, Qwen2ForCausalLM, base, overrides)


def tiny_qwen25(**overrides):
    """Qwen2.5 as packaged (qwen2.5-1.5b): q/k/v biases, GQA 4/2 with head_dim = hidden / heads (32 here, 128
    there), an untied LM head, no sliding window, RoPE theta 1e6; 8 layers so that every packaged recipe's layer
    counts (drop 6, nbl 6) fit."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    base = dict(
        _COMMON, hidden_size=128, num_hidden_layers=8, num_key_value_heads=2, rope_theta=1000000.0,
        tie_word_embeddings=False, use_sliding_window=False,
    )
    return _tiny(Qwen2Config, Qwen2ForCausalLM, base, overrides)


def tiny_mistral(**overrides):
    """Mistral: GQA, untied head, sliding window (4) in every layer (no `layer_types` in its config)."""
    from transformers import MistralConfig, MistralForCausalLM

    base = dict(
        _COMMON, num_key_value_heads=2, head_dim=16, rope_theta=10000.0, tie_word_embeddings=False,
        sliding_window=4,
    )
    return _tiny(MistralConfig, MistralForCausalLM, base, overrides)


def tiny_gemma3(**overrides):
    """Gemma3 text: MQA, QK-norm, sliding (window 4) and full layers with different RoPE thetas,
    scaling from query_pre_attn_scalar (24, deliberately != head_dim)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    base = dict(
        _COMMON, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return _tiny(Gemma3TextConfig, Gemma3ForCausalLM, base, overrides)


def tiny_qwen3(**overrides):
    """Qwen3: Llama's layout with QK-norm (per-head RMS norms on q and k before RoPE, gain = weight, randomised
    here), GQA, no biases, full attention in every layer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    base = dict(_COMMON, num_key_value_heads=2, head_dim=16, rope_theta=10000.0, tie_word_embeddings=True)
    return _tiny(Qwen3Config, Qwen3ForCausalLM, base, overrides)


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def tiny_llama3(**overrides):
    """Llama-3.x rope scaling (`rope_type: llama3`): with a 32-token original context and head_dim 16, six of the
    eight frequencies are scaled down (by up to 8x), so a method that rebuilt RoPE from rope_theta would differ."""
    return tiny_llama(**{"rope_parameters": LLAMA3_ROPE, **overrides})


def tiny_phi3(**overrides):
    """Phi-3: fused qkv_proj (q, k, v rows) and gate_up_proj (gate, up rows), GQA, untied head, full attention;
    the adapter splits the fused linears into canonical ones (adapters/phi3.py)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    base = dict(
        _COMMON, num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return _tiny(Phi3Config, Phi3ForCausalLM, base, overrides)


def tiny_opt(**overrides):
    """OPT: MHA with q/k/v/out biases, learned positions, ReLU fc1/fc2 MLP, pre-norm."""
    from transformers import OPTConfig, OPTForCausalLM

    base = dict(
        _COMMON, ffn_dim=96, enable_bias=True, do_layer_norm_before=True, word_embed_proj_dim=64,
        tie_word_embeddings=True, pad_token_id=1, bos_token_id=2, eos_token_id=2,
    )
    base.pop("intermediate_size")
    return _tiny(OPTConfig, OPTForCausalLM, base, overrides)


TINY_BUILDERS = {
    "llama": tiny_llama,
    "qwen2": tiny_qwen2,
    "mistral": tiny_mistral,
    "gemma3": tiny_gemma3,
    "opt": tiny_opt,
    "qwen3": tiny_qwen3,
    "llama3": tiny_llama3,
    "phi3": tiny_phi3,
}


@pytest.fixture(params=sorted(TINY_BUILDERS))
def tiny_model(request):
    """Each supported family's tiny model in turn."""
    return TINY_BUILDERS[request.param]()

"""What a family brings beyond Llama's layout, as data the adapter hands to methods: QK-norm (Gemma3, Qwen3) as
a formula, and scaled RoPE (Llama-3.x's `llama3`) as the model's own frequencies, which every method that rebuilds
a rotation reads instead of rope_theta. The save/load/generate rows of each family are in tests/test_matrix.py."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from attnslim.adapters import get_adapter
from attnslim.adapters.rotary import rotary_angles
from attnslim.api import compress
from attnslim.linalg.rope import apply_rope
from attnslim.linalg.tucker import rope_rotations
from attnslim.modules.mla import MLAAttention
from conftest import LLAMA3_ROPE, TINY_BUILDERS, tiny_llama3
from helpers import ByteTokenizer, one_step

IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


def _compress(model, method, args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny calibration sets are rank-deficient by design
        return compress(model, ByteTokenizer(), one_step(method, args), progress=False)


def _unscaled(theta: float, d_rot: int) -> torch.Tensor:
    return theta ** (-torch.arange(0, d_rot, 2, dtype=torch.float64) / d_rot)  # (d_rot/2,)


@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
def test_qk_norm_formula_reproduces_the_models_norm_modules(family):
    """The spec's RMS formulas (Gemma3: gain 1 + w; Qwen3: gain w, eps in another attribute) compute what the
    model's own q_norm/k_norm compute, on randomised gains (conftest perturbs them)."""
    model = TINY_BUILDERS[family]()
    spec = get_adapter(model).attention_spec(1)
    x = torch.randn(2, spec.n_heads, 5, spec.head_dim, generator=torch.Generator().manual_seed(2))
    for module, rms in ((spec.q_norm, spec.q_norm_rms), (spec.k_norm, spec.k_norm_rms)):
        assert module is not None and rms is not None
        formula = rms.gain * x / (x.pow(2).mean(-1, keepdim=True) + rms.eps).sqrt()
        torch.testing.assert_close(formula, module(x), rtol=1e-6, atol=1e-6)
        assert not torch.allclose(rms.gain, torch.ones_like(rms.gain))  # the gains are not the identity


def test_llama3_rotary_angles_are_the_models_scaled_frequencies():
    """`rotary_angles` reads the scaled table, and `rope_rotations` on them is the rotation the model applies between
    two positions (theta's frequencies would not be: the tiny config scales six of eight)."""
    model = tiny_llama3()
    adapter = get_adapter(model)
    spec = adapter.attention_spec(0)
    assert spec.rope is not None
    info = rotary_angles(adapter, spec.rope.layer_type)
    assert info is not None
    angles, scale = info
    unscaled = _unscaled(LLAMA3_ROPE["rope_theta"], spec.rope.rotary_dims)
    assert scale == 1.0 and (angles - unscaled).abs().max() > 1e-2
    m, n = 3, 11
    rotary = adapter.rotary_embedding(spec.rope.layer_type)
    assert rotary is not None
    cos, sin = rotary(torch.zeros(1), torch.tensor([[m, n]]))  # (1, 2, d_rot)
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, 1, 1, spec.head_dim, generator=gen, dtype=torch.float64) for _ in range(2))
    logit = (apply_rope(q, cos[:, 1:].double(), sin[:, 1:].double()) * apply_rope(k, cos[:, :1].double(),
                                                                                  sin[:, :1].double())).sum()
    for freqs, equal in ((angles, True), (unscaled, False)):
        rotation = rope_rotations(spec.head_dim, [m - n], rotary_dim=spec.rope.rotary_dims, freqs=freqs)[0]
        assert (abs(float(logit - q.flatten() @ rotation @ k.flatten())) < 1e-6) == equal


def test_mla_with_llama3_scaled_rope_is_exact_at_full_rank_and_lossy_with_half_the_pairs():
    """mla's rotary key uses the model's scaled tables: every component kept -> the dense logits; half the rotary
    pairs dropped -> not (so the comparison can fail)."""
    ref = tiny_llama3()(input_ids=IDS).logits
    model = tiny_llama3()
    _compress(model, "mla", {"kv_ratio": None, "rank": 32, "rope_dims": 32})
    assert all(isinstance(get_adapter(model).attention(i), MLAAttention) for i in range(4))
    assert float((model(input_ids=IDS).logits - ref).abs().max().detach()) < 1e-4
    half = tiny_llama3()
    _compress(half, "mla", {"kv_ratio": None, "rank": 32, "rope_dims": 16})
    assert float((half(input_ids=IDS).logits - ref).abs().max().detach()) > 1e-3


def test_latentllm_rope_aware_fit_uses_the_models_scaled_frequencies(monkeypatch):
    """latentllm's RoPE-aware joint QK (rope_window > 1) builds its rotations from the adapter's frequencies."""
    import attnslim.methods.latentllm_attention as attention

    seen: list[torch.Tensor | None] = []

    def spy(*args, freqs=None, **kwargs):
        seen.append(freqs)
        return rope_rotations(*args, freqs=freqs, **kwargs)

    monkeypatch.setattr(attention, "rope_rotations", spy)
    model = tiny_llama3()
    expected = model.model.rotary_emb.inv_freq.double()
    _compress(model, "latentllm", {"ratio": 0.7, "rope_window": 4})
    assert len(seen) == 4
    for freqs in seen:
        assert freqs is not None
        torch.testing.assert_close(freqs, expected, rtol=1e-6, atol=1e-9)


def test_an_unsupported_fused_family_is_refused_with_the_supported_ones_and_the_checklist():
    """GPT-NeoX fuses q/k/v into one linear (query_key_value) and has no adapter: compress refuses it before any
    calibration, naming the fused linear, every registered family and where the add-a-family checklist is."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from attnslim.errors import AttnslimError
    from attnslim.registry import ADAPTERS

    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                                             num_hidden_layers=2, num_attention_heads=4,
                                             max_position_embeddings=256)).eval()
    before = {name: p.clone() for name, p in model.named_parameters()}
    with pytest.raises(AttnslimError, match=r"unsupported model_type 'gpt_neox' \(GPTNeoXForCausalLM\)") as err:
        _compress(model, "svd", {"ratio": 0.5})
    message = str(err.value)
    assert "(query_key_value)" in message and "docs/DESIGN.md, 'Checklist: add a model family'" in message
    assert "adapters/phi3.py" in message  # the example of a family whose adapter splits its fused linears
    assert all(model_type in message for model_type in ADAPTERS) and {"qwen3", "llama", "phi3"} <= set(ADAPTERS)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())  # the model is untouched
    design = (Path(__file__).resolve().parents[1] / "docs" / "DESIGN.md").read_text()
    assert "\n## Checklist: add a model family\n" in design  # the pointer leads somewhere

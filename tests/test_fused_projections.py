"""Phi-3's fused projections (qkv_proj, gate_up_proj) split into canonical linears by its adapter (adapters/phi3.py,
adapters/fused.py): the split model computes what the fused one did, its state dict is the fused checkpoint's, a
split model saves as a stock Phi-3 checkpoint, and what the adapter does not support is refused by name. The
methods' save/load/generate rows on Phi-3 are in tests/test_matrix.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors import safe_open

from attnslim.adapters import get_adapter
from attnslim.adapters.fused import SplitLinear
from attnslim.api import compress
from attnslim.errors import AttnslimError
from conftest import tiny_phi3
from helpers import ByteTokenizer, SavingTokenizer, one_step

IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_split_model_gives_the_fused_models_logits_and_state(partial):
    """Splitting changes no logit (partial rotary included), the canonical linears are the fused rows in
    q, k, v / gate, up order, and the state dict keeps the fused names and values."""
    model = tiny_phi3(partial_rotary_factor=partial)
    fused_qkv = model.model.layers[1].self_attn.qkv_proj.weight.detach().clone()
    fused_gate_up = model.model.layers[1].mlp.gate_up_proj.weight.detach().clone()
    with torch.no_grad():
        before = model(IDS).logits
    state = {k: v.clone() for k, v in model.state_dict().items()}
    adapter = get_adapter(model)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, SplitLinear)
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, SplitLinear)
    with torch.no_grad():
        after = model(IDS).logits
    torch.testing.assert_close(after, before, rtol=0, atol=1e-6)
    q, k, v = (adapter.linear(1, n).weight for n in ("q", "k", "v"))
    assert (q.shape[0], k.shape[0], v.shape[0]) == (64, 32, 32)  # 4 heads, 2 KV heads, head_dim 16
    assert torch.equal(torch.cat([q, k, v]), fused_qkv)
    gate, up = adapter.linear(1, "gate").weight, adapter.linear(1, "up").weight
    assert torch.equal(gate, fused_gate_up[:96]) and torch.equal(up, fused_gate_up[96:])
    split_state = model.state_dict()
    assert sorted(split_state) == sorted(state)
    assert all(torch.equal(split_state[key], value) for key, value in state.items())
    spec = adapter.attention_spec(1)
    assert spec.rope is not None and spec.rope.rotary_dims == int(16 * partial)
    get_adapter(model)  # taking the adapter again splits nothing twice
    assert isinstance(model.model.layers[0].self_attn.qkv_proj.q, torch.nn.Linear)


def test_split_model_saves_as_a_stock_phi3_checkpoint(tmp_path):
    """save_pretrained of a split, uncompressed model writes the fused tensors, and plain transformers (no attnslim,
    no remote code) loads them to the same logits; the fused state also loads back into a split model."""
    from transformers import Phi3ForCausalLM

    model = tiny_phi3()
    get_adapter(model)
    with torch.no_grad():
        ref = model(IDS).logits
    model.save_pretrained(tmp_path / "dense")
    with safe_open(str(tmp_path / "dense" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in keys and "model.layers.3.mlp.gate_up_proj.weight" in keys
    assert not any(".qkv_proj.q." in key or ".gate_up_proj.up." in key for key in keys)
    plain = Phi3ForCausalLM.from_pretrained(tmp_path / "dense").eval()
    assert not any(isinstance(m, SplitLinear) for m in plain.modules())
    with torch.no_grad():
        assert torch.equal(plain(IDS).logits, ref)
    other = tiny_phi3(initializer_range=0.5)  # other weights, split, then the fused checkpoint loaded into it
    get_adapter(other)
    other.load_state_dict(plain.state_dict(), strict=True)
    with torch.no_grad():
        assert torch.equal(other(IDS).logits, ref)


def test_replaced_parts_save_split_and_unreplaced_ones_fused(tmp_path):
    """After nbl replaced one layer's attention, or svd factored q, k, v and o: attnslim's save keeps the
    fused tensor for every SplitLinear whose parts are plain linears and the parts' keys where a part was replaced."""
    from attnslim.io import save

    model = tiny_phi3()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny calibration sets are rank-deficient by design
        report = compress(model, ByteTokenizer(), one_step("nbl", {"m": 1}), progress=False)
    out = save(model, SavingTokenizer(), tmp_path / "nbl", report.to_json())
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert all(f"model.layers.{i}.mlp.gate_up_proj.weight" in keys for i in range(4))  # MLPs untouched: fused
    assert sum(f"model.layers.{i}.self_attn.qkv_proj.weight" in keys for i in range(4)) == 3  # one layer replaced

    model = tiny_phi3()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = compress(model, ByteTokenizer(), one_step("svd", {"ratio": 0.5}), progress=False)
    out = save(model, SavingTokenizer(), tmp_path / "svd", report.to_json())
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert not any(key.endswith("qkv_proj.weight") for key in keys)  # svd's default linears: q, k, v, o
    assert all(f"model.layers.{i}.mlp.gate_up_proj.weight" in keys for i in range(4))
    assert "model.layers.0.self_attn.qkv_proj.k.b" in keys  # the factored part under its canonical name


def test_longrope_is_refused_by_name_before_the_model_changes():
    """Phi-3 -128k / Phi-3.5's longrope switches frequency tables with the sequence length: refused, with the fix,
    before any linear is split."""
    half = 8  # head_dim 16 rotates 8 frequency pairs
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * half,
            "long_factor": [2.0] * half, "original_max_position_embeddings": 64}
    model = tiny_phi3(rope_parameters=rope, original_max_position_embeddings=64)
    with pytest.raises(AttnslimError, match="longrope") as err:
        get_adapter(model)
    assert "Phi-3-mini-4k-instruct" in str(err.value) and "original_max_position_embeddings" in str(err.value)
    assert not any(isinstance(m, SplitLinear) for m in model.modules())


def test_offload_is_refused_for_split_projections(tmp_path):
    """--offload reads each layer's tensors by the module's names, which the split changes: refused with the fix."""
    from attnslim.models.load import load_model

    tiny_phi3().save_pretrained(tmp_path / "dense")
    SavingTokenizer().save_pretrained(tmp_path / "dense")
    with pytest.raises(AttnslimError, match="--offload does not support Phi-3") as err:
        load_model(str(tmp_path / "dense"), offload=True)
    assert "without --offload" in str(err.value)


@pytest.mark.parametrize("overrides", [{"partial_rotary_factor": 0.5}, {"sliding_window": 4}],
                         ids=["partial-rotary", "sliding"])
def test_mla_at_full_rank_is_exact_on_phi3_variants(overrides):
    """Phi-4-mini's partial rotary (here half of each head rotates) and Phi-3-mini-4k's sliding window (in every
    layer): mla keeping every rotary component at full rank reproduces the dense logits, so the adapter's rotary
    width, window and split q/k/v are what the model uses."""
    from attnslim.modules.mla import MLAAttention

    model = tiny_phi3(**overrides)
    spec = get_adapter(model).attention_spec(0)
    assert spec.rope is not None and spec.rope.rotary_dims == 16 * overrides.get("partial_rotary_factor", 1)
    assert spec.sliding_window == overrides.get("sliding_window")
    rope = spec.n_kv_heads * spec.rope.rotary_dims
    with torch.no_grad():
        ref = model(IDS).logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compress(model, ByteTokenizer(), one_step("mla", {"kv_ratio": None, "rope_dims": rope,
                                                          "rank": 2 * spec.n_kv_heads * spec.head_dim - rope}),
                 progress=False)
    adapter = get_adapter(model)
    assert all(isinstance(adapter.attention(i), MLAAttention) for i in range(4))
    assert adapter.linear(0, "q") is adapter.attention(0).q_proj  # a replaced attention: the module's own q
    with torch.no_grad():
        err = float((model(IDS).logits - ref).abs().max())
    assert err < 1e-4, err


def test_a_split_model_is_not_compressed_but_a_compressed_one_is_refused():
    """SplitLinear computes what the fused linear did: compress takes a split model, and refuses a compressed one
    naming the method's modules only."""
    model = tiny_phi3()
    get_adapter(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compress(model, ByteTokenizer(), one_step("nbl", {"m": 1}), progress=False)
        with pytest.raises(AttnslimError, match=r"already compressed by attnslim \(it already holds attnslim "
                                                r"modules LinearizedAttention\)"):
            compress(model, ByteTokenizer(), one_step("nbl", {"m": 1}), progress=False)


def test_a_fused_linear_that_does_not_match_the_config_is_refused():
    """A qkv_proj whose rows are not the config's q + k + v widths is named, not split at a wrong row."""
    model = tiny_phi3()
    model.model.layers[2].self_attn.qkv_proj = torch.nn.Linear(64, 96, bias=False)  # 4 + 2 + 2 heads need 128
    with pytest.raises(AttnslimError, match=r"fused linear has 96 rows .* does not match its config"):
        get_adapter(model)
    assert not any(isinstance(m, SplitLinear) for m in model.modules())  # no layer split before the refusal

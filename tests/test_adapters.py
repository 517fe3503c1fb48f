"""The adapter contract, checked on every family's tiny model against HF's own modules."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnslim._compat import AttentionCall, attention_call, keep_mask, rotary_cos_sin
from attnslim.adapters import Adapter, AttentionSpec, MLPSpec, get_adapter
from attnslim.errors import AttnslimError
from attnslim.linalg.attention import sliding_keep
from attnslim.linalg.spec_attention import spec_attention
from attnslim.modules import MODULES
from attnslim.modules.base import ReplacementAttention
from conftest import TINY_BUILDERS

FAMILIES = sorted(TINY_BUILDERS)
B, T = 2, 10


def _capture_attention_kwargs(adapter: Adapter, **inputs: Any) -> list[dict[str, Any]]:
    """Run the model once; return the keyword arguments each decoder layer passed to its attention."""
    seen: list[dict[str, Any]] = [{} for _ in range(adapter.num_layers())]
    handles = [
        adapter.attention(i).register_forward_pre_hook(
            lambda _m, _a, kw, i=i: seen[i].update({k: v for k, v in kw.items() if k != "hidden_states"}),
            with_kwargs=True,
        )
        for i in range(adapter.num_layers())
    ]
    try:
        with torch.no_grad():
            adapter.model(**inputs, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return seen


def _cos_sin(adapter: Adapter, spec: AttentionSpec, x: torch.Tensor, position_ids: torch.Tensor):
    if spec.rope is None:
        return None
    rotary = adapter.rotary_embedding(spec.rope.layer_type)
    assert rotary is not None
    return rotary_cos_sin(rotary, x, position_ids, spec.rope.layer_type)


def _mlp_from_spec(spec: MLPSpec, x: torch.Tensor) -> torch.Tensor:
    """x (..., hidden) -> (..., hidden) from the spec's weights alone."""
    up = F.linear(x, spec.up, spec.up_bias)  # (..., inter)
    h = spec.act_fn(up) if spec.gate is None else spec.act_fn(F.linear(x, spec.gate, spec.gate_bias)) * up
    return F.linear(h, spec.down, spec.down_bias)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("padded", [False, True])
def test_spec_attention_matches_hf(family: str, attn_implementation: str, padded: bool) -> None:
    model = TINY_BUILDERS[family](attn_implementation=attn_implementation)
    adapter = get_adapter(model)
    ids = torch.randint(3, 128, (B, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(B, T, dtype=torch.long)
    if padded:
        mask[1, :3] = 0  # left padding in row 1
    seen = _capture_attention_kwargs(adapter, input_ids=ids, attention_mask=mask)
    valid = mask.bool()  # padded query rows are undefined in HF (and zero in ours): compare real tokens
    gen = torch.Generator().manual_seed(2)
    for i in range(adapter.num_layers()):
        spec = adapter.attention_spec(i)
        x = torch.randn(B, T, spec.hidden_size, generator=gen)
        with torch.no_grad():
            ref = adapter.attention(i)(hidden_states=x, **seen[i])[0]  # (b, t, hidden)
            position_ids = seen[i].get("position_ids")
            if position_ids is None:
                position_ids = torch.arange(T)[None].expand(B, T)
            hf_keep = keep_mask(seen[i].get("attention_mask"), T, T, x.device)  # (b|1, 1, t, t)
            # unpadded: causal only, so the spec's own sliding_window must reproduce HF's window mask
            keep = hf_keep if padded else keep_mask(None, T, T, x.device)
            if not padded:
                expected = sliding_keep(keep, spec.sliding_window).expand(B, 1, T, T)
                assert torch.equal(hf_keep.expand(B, 1, T, T), expected), f"{family} layer {i}: window"
            ours = spec_attention(spec, x, _cos_sin(adapter, spec, x, position_ids), keep)
        torch.testing.assert_close(ours[valid], ref[valid], atol=1e-5, rtol=1e-4, msg=f"{family} layer {i}")


@pytest.mark.parametrize("family", FAMILIES)
def test_replacement_module_contract_reproduces_logits(family: str) -> None:
    """Modules built from the specs through ReplacementAttention (HF's call unpacked by _compat) give the dense
    logits: the base class hands `attend` the hidden states, (cos, sin) and the mask HF passed."""

    class SpecModule(ReplacementAttention):
        def __init__(self, spec: AttentionSpec) -> None:
            super().__init__()
            self.spec = spec

        def attend(self, call: AttentionCall) -> torch.Tensor:
            t = call.hidden_states.shape[1]
            keep = keep_mask(call.attention_mask, t, t, call.hidden_states.device)
            return spec_attention(self.spec, call.hidden_states, call.position_embeddings, keep)

    model = TINY_BUILDERS[family]()
    adapter = get_adapter(model)
    ids = torch.randint(3, 128, (B, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        dense = model(ids, use_cache=False).logits
        olds = [adapter.replace_attention(i, SpecModule(adapter.attention_spec(i)))
                for i in range(adapter.num_layers())]
        replaced = model(ids, use_cache=False).logits
    assert all(isinstance(adapter.attention(i), SpecModule) for i in range(adapter.num_layers()))
    assert all(type(old).__name__.endswith("Attention") for old in olds)
    torch.testing.assert_close(replaced, dense, atol=1e-4, rtol=1e-4)


def test_every_replacement_module_takes_hf_calls_through_the_one_base_forward() -> None:
    """One forward signature in modules/: every registered module that stands in for attention inherits
    ReplacementAttention.forward and implements only `attend`, so HF's call signature lives in _compat alone."""
    attention_like = {n: c for n, c in MODULES.items() if n.endswith("Attention")}
    assert len(attention_like) >= 7, sorted(attention_like)
    for name, cls in attention_like.items():
        assert issubclass(cls, ReplacementAttention), name
        assert cls.forward is ReplacementAttention.forward, f"{name} overrides forward"
        assert cls.attend is not ReplacementAttention.attend, f"{name} does not implement attend"
    call = attention_call((torch.zeros(1, 2, 4),), {"attention_mask": None, "past_key_values": "cache",
                                                     "cache_position": torch.arange(2)})
    assert call.cache == "cache" and call.position_embeddings is None and call.hidden_states.shape == (1, 2, 4)
    with pytest.raises(TypeError, match="hidden_states"):
        attention_call((), {"attention_mask": None})


@pytest.mark.parametrize("family", FAMILIES)
def test_replace_attention_returns_old_module(family: str) -> None:
    adapter = get_adapter(TINY_BUILDERS[family]())
    original = adapter.attention(1)
    new = nn.Identity()
    assert adapter.replace_attention(1, new) is original
    assert adapter.attention(1) is new
    assert adapter.replace_attention(1, original) is new


@pytest.mark.parametrize("family", FAMILIES)
def test_param_groups_count_real_tensors(family: str) -> None:
    model = TINY_BUILDERS[family]()
    adapter = get_adapter(model)
    groups = adapter.param_groups()
    # from the parameters, not the state dict: a split family's state dict holds the fused tensors (new ones)
    unique = {p.data_ptr(): p.numel() for p in model.parameters()}
    assert groups["total"] == sum(unique.values())  # tied weights once
    assert groups["total"] == sum(v for k, v in groups.items() if k != "total")
    attn = sum(w.numel() for i in range(adapter.num_layers()) for w in adapter.attention(i).parameters())
    assert groups["attention"] == attn
    mlp_names = [n for n in ("gate", "up", "down") if n in adapter.linear_paths()]
    mlp = sum(p.numel() for i in range(adapter.num_layers()) for n in mlp_names
              for p in adapter.linear(i, n).parameters())
    assert groups["mlp"] == mlp
    assert groups["embedding"] >= model.config.vocab_size * model.config.hidden_size


@pytest.mark.parametrize("family", FAMILIES)
def test_mlp_spec_recomputes_mlp_output(family: str) -> None:
    """The MLP rebuilt from the spec matches what HF's forward fed into / got out of the MLP linears."""
    model = TINY_BUILDERS[family]()
    adapter = get_adapter(model)
    ids = torch.randint(3, 128, (B, T), generator=torch.Generator().manual_seed(4))
    io: dict[int, dict[str, torch.Tensor]] = {i: {} for i in range(adapter.num_layers())}
    handles = []
    for i in range(adapter.num_layers()):
        handles.append(adapter.linear(i, "up").register_forward_pre_hook(
            lambda _m, args, i=i: io[i].__setitem__("x", args[0])))
        handles.append(adapter.linear(i, "down").register_forward_hook(
            lambda _m, _a, out, i=i: io[i].__setitem__("y", out)))
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    for i in range(adapter.num_layers()):
        spec = adapter.mlp_spec(i)
        assert (spec.gate is None) == (family == "opt")
        with torch.no_grad():
            ours = _mlp_from_spec(spec, io[i]["x"])
        torch.testing.assert_close(ours, io[i]["y"], atol=1e-5, rtol=1e-4, msg=f"{family} layer {i}")


def test_get_adapter_unsupported_model_type_names_supported() -> None:
    fake = nn.Module()
    fake.config = SimpleNamespace(model_type="gpt_bigcode")  # type: ignore[assignment]
    with pytest.raises(AttnslimError, match="gpt_bigcode") as err:
        get_adapter(fake)
    for supported in ("llama", "mistral", "qwen2", "gemma3_text", "opt"):
        assert supported in str(err.value)


@pytest.mark.parametrize("family, bad", [("llama", "fc1"), ("opt", "gate"), ("gemma3", "out_proj")])
def test_unknown_linear_name_lists_valid_names(family: str, bad: str) -> None:
    adapter = get_adapter(TINY_BUILDERS[family]())
    with pytest.raises(AttnslimError, match=bad) as err:
        adapter.linear(0, bad)
    for name in adapter.linear_paths():
        assert repr(name) in str(err.value)
    with pytest.raises(AttnslimError, match=bad):
        adapter.replace_linear(0, bad, nn.Identity())


def test_layer_index_out_of_range() -> None:
    adapter = get_adapter(TINY_BUILDERS["opt"]())
    with pytest.raises(AttnslimError, match="out of range"):
        adapter.attention_spec(4)


def test_family_specific_spec_fields() -> None:
    gemma = get_adapter(TINY_BUILDERS["gemma3"]())
    sliding, full = gemma.attention_spec(0), gemma.attention_spec(1)
    assert (sliding.sliding_window, full.sliding_window) == (4, None)
    assert sliding.rope is not None and full.rope is not None
    assert (sliding.rope.theta, full.rope.theta) == (10000.0, 1000000.0)
    assert sliding.q_norm is not None and sliding.group_size == 4 and sliding.scaling == 24**-0.5
    assert gemma.attention_norm(0) is gemma.decoder_layers()[0].input_layernorm
    assert gemma.attention_output_norm(0) is gemma.decoder_layers()[0].post_attention_layernorm
    opt = get_adapter(TINY_BUILDERS["opt"]())
    spec = opt.attention_spec(0)
    assert spec.rope is None and spec.o_bias is not None and spec.group_size == 1
    assert opt.attention_norm(0) is opt.decoder_layers()[0].self_attn_layer_norm
    mistral = get_adapter(TINY_BUILDERS["mistral"]())
    assert all(mistral.attention_spec(i).sliding_window == 4 for i in range(4))
    qwen = get_adapter(TINY_BUILDERS["qwen2"]())
    assert [qwen.attention_spec(i).sliding_window for i in range(4)] == [None, None, 4, 4]
    assert qwen.attention_spec(0).q_bias is not None and qwen.attention_spec(0).o_bias is None


@pytest.mark.parametrize("family", ["gemma3", "opt", "qwen2"])
def test_spec_to_moves_every_tensor_a_fit_reads(family: str) -> None:
    """A fit computes where its statistics are (CPU) from `spec.to(device)`: a tensor field it forgot would mix a
    GPU layer's weights with CPU statistics, which no CPU test sees; the meta device stands in for the GPU here.
    Gemma-3 has both norm gains, OPT every bias, Qwen2 q/k/v biases."""
    spec = get_adapter(TINY_BUILDERS[family]()).attention_spec(0)
    moved = spec.to(torch.device("meta"))
    tensors = {name: value for name, value in vars(moved).items() if isinstance(value, torch.Tensor)}
    tensors.update({f"{name}.gain": value.gain for name, value in vars(moved).items()
                    if name.endswith("_norm_rms") and value is not None})
    expected = {"gemma3": {"k_norm_rms.gain", "q_norm_rms.gain"}, "opt": {"q_bias", "k_bias", "v_bias", "o_bias"},
                "qwen2": {"q_bias", "k_bias", "v_bias"}}[family]
    assert {"q", "k", "v", "o"} | expected <= tensors.keys()
    assert {name: t.device.type for name, t in tensors.items()} == {name: "meta" for name in tensors}
    assert spec.q.device.type == "cpu" and moved.q.shape == spec.q.shape  # a copy: the model's spec is untouched


def test_opt_post_norm_has_no_attention_norm() -> None:
    adapter = get_adapter(TINY_BUILDERS["opt"](do_layer_norm_before=False))
    with pytest.raises(AttnslimError, match="do_layer_norm_before=False"):
        adapter.attention_norm(0)
    with pytest.raises(AttnslimError, match="no MLP container"):
        adapter.mlp(0)


def test_gemma3_softcap_config_is_not_applied_by_hf() -> None:
    """HF's Gemma3Attention ignores attn_logit_softcapping; the spec (softcap=None) must keep matching.
    If a transformers upgrade starts applying it, this fails and the adapter must pass it on."""
    model = TINY_BUILDERS["gemma3"](attn_logit_softcapping=0.5, attn_implementation="eager")
    adapter = get_adapter(model)
    spec = adapter.attention_spec(1)
    assert spec.softcap is None
    x = torch.randn(B, T, spec.hidden_size, generator=torch.Generator().manual_seed(5))
    pos = torch.arange(T)[None].expand(B, T)
    cos_sin = _cos_sin(adapter, spec, x, pos)
    keep = keep_mask(None, T, T, x.device)
    causal = torch.where(keep, 0.0, torch.finfo(x.dtype).min)
    with torch.no_grad():
        ref = adapter.attention(1)(x, position_embeddings=cos_sin, attention_mask=causal)[0]
        ours = spec_attention(spec, x, cos_sin, keep)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)

"""`attnslim export DIR --to deci --out OUT`: an attnslim output whose layers are kept or dropped (method `drop`) as
a DeciLM checkpoint (model_type "nemotron-nas", NVIDIA's Nemotron-NAS format) that vLLM serves with its own
`DeciLMForCausalLM`: no attention module and no KV cache for a dropped layer, no attnslim plugin.

Exact: every tensor is the source's, renamed to Llama's names (vLLM's DeciLM loads Llama's), cast to --dtype.
- block_configs, one per layer: a dropped layer is `attention: {no_op: true}` and has no self_attn or
  input_layernorm tensors (vLLM builds neither; its loader refuses a tensor without a parameter); a kept layer is
  `attention: {no_op: false, n_heads_in_group: heads / kv heads}`.
- ffn: `intermediate_size`, the model's own. vLLM reads it whenever the block's ffn has no `ffn_mult`; ffn_mult
  would be rounded (int(2·m·d/3), then up to a multiple of 256), so it is not written and no size is inexpressible.
- biases: Llama's attention_bias (q, k, v and o) and mlp_bias are copied with their config flags, which vLLM's
  DeciLM reads.
What it needs that no stock library ships: vLLM 0.32 and transformers (5.19, 5.23) register no "nemotron-nas"
config, so the directory carries its config class (hf_entry/configuration_decilm.py: Llama's config plus
block_configs; transformers only) and vLLM reads it with --trust-remote-code. transformers has no DeciLM model:
the export is for vLLM; transformers runs the attnslim directory itself (attnslim.load).
Refused before any output (export/deci_check.py): other methods' layers (each named with what serves it),
non-Llama families, layer 0 dropped, factorised linears.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnslim.adapters import get_adapter
from attnslim.adapters.base import Adapter
from attnslim.deci_format import ARCHITECTURE, AUTO_MAP, CONFIG_CODE, MODEL_TYPE
from attnslim.disk_format import EXPORT_MARKER
from attnslim.errors import AttnslimError
from attnslim.export.common import span, weight, write_weights
from attnslim.export.deci_check import check_family, check_first_layer, refuse_methods
from attnslim.modules.base import ReplacementAttention
from attnslim.modules.dropped import DroppedAttention
from attnslim.modules.linearized import LinearizedAttention
from attnslim.modules.mla import MLAAttention
from attnslim.modules.shared import DonorAttention, SharedAttention
from attnslim.offload import check_free_disk
from attnslim.outdir import check_output, staged_output

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ATTENTION = ("q", "k", "v", "o")
MLP = ("gate", "up", "down")
# the method behind each replacement module, for the refusal's advice (deci_check.ELSEWHERE)
METHODS: tuple[tuple[type[nn.Module] | tuple[type[nn.Module], ...], str], ...] = (
    (LinearizedAttention, "nbl"), (MLAAttention, "mla"), ((SharedAttention, DonorAttention), "lisa"))
# config keys copied from the source's Llama config (the rest of a DeciLM config is block_configs)
COPIED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
          "rope_parameters", "attention_bias", "mlp_bias", "tie_word_embeddings", "bos_token_id", "eos_token_id",
          "pad_token_id")


def export_deci(model: Any, tokenizer: Any, out: Path, dtype: str = "float32", overwrite: bool = False,
                source: Path | None = None) -> dict[str, Any]:
    """Write `model` (a Llama-family model whose layers are dense or DroppedAttention) to `out` as a DeciLM
    checkpoint; returns the report also written to out/attnslim-export.json."""
    check_output(out, overwrite, [source] if source else [])
    if dtype not in DTYPES:
        raise AttnslimError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    adapter = get_adapter(model)
    kept = attention_kept(adapter)
    check_free_disk(out, sum(p.numel() for p in model.parameters()) * DTYPES[dtype].itemsize)
    config = deci_config(adapter, kept, dtype)
    state = {k: v.to(DTYPES[dtype]) for k, v in deci_state(adapter, kept).items()}
    n, kv_layers = len(kept), sum(kept)
    report = {"architecture": ARCHITECTURE, "model_type": MODEL_TYPE, "dtype": dtype,
              "no_op_attention_layers": [i for i, k in enumerate(kept) if not k], "kv_cache_layers": kv_layers,
              "dense_kv_cache_layers": n, "kv_tokens_vs_dense": n / kv_layers,
              "serve": "attnslim serve OUT, or vLLM with --trust-remote-code (for the config class; the model is "
                       "vLLM's own DeciLMForCausalLM)"}
    with staged_output(out, overwrite) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
        shutil.copy(CONFIG_CODE, tmp / CONFIG_CODE.name)
        write_weights(state, tmp)
        del state
        tokenizer.save_pretrained(tmp)
        (tmp / EXPORT_MARKER).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return report


def attention_kept(adapter: Adapter) -> list[bool]:
    """Per layer, True for dense attention, False for dropped; a refusal naming every layer DeciLM cannot hold."""
    check_family(str(adapter.config.model_type), "this one")
    kept: list[bool] = []
    refused: dict[str, list[int]] = {}
    for i in range(adapter.num_layers()):
        module = adapter.attention(i)
        method = next((name for kind, name in METHODS if isinstance(module, kind)), type(module).__name__)
        if isinstance(module, DroppedAttention):
            kept.append(False)
        elif isinstance(module, ReplacementAttention):
            refused.setdefault(method, []).append(i)
        else:
            kept.append(True)
    refuse_methods(refused)
    check_first_layer([i for i, k in enumerate(kept) if not k])
    factorised = [f"layer {i} {name}" for i, k in enumerate(kept)
                  for name in (ATTENTION if k else ()) + MLP if not isinstance(adapter.linear(i, name), nn.Linear)]
    if factorised:
        raise AttnslimError(f"{span(factorised, 'linears')} are not dense Linears (a factorising step such as svd or "
                            "latentllm's MLP); a DeciLM layer holds dense weights: export an output compressed with "
                            "drop steps only")
    return kept


def deci_config(adapter: Adapter, kept: list[bool], dtype: str) -> dict[str, Any]:
    """config.json: the source's Llama values, block_configs, and the auto_map to the shipped config class."""
    source = adapter.config.to_dict()
    config: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
              "auto_map": AUTO_MAP, "dtype": dtype}
    config.update({key: source[key] for key in COPIED if key in source})
    if config.get("hidden_act") != "silu":
        raise AttnslimError(f"the model's MLP activation is {config.get('hidden_act')!r}; vLLM's DeciLM (Llama's "
                            "MLP) runs silu only")
    blocks = []
    for i, keep in enumerate(kept):
        heads = adapter.attention_heads(i)
        attention: dict[str, Any] = {"no_op": not keep, "replace_with_linear": False}
        if keep:
            if heads.n_heads != config["num_attention_heads"] or heads.n_heads % heads.n_kv_heads:
                raise AttnslimError(f"layer {i} has {heads.n_heads} heads over {heads.n_kv_heads} KV heads; DeciLM "
                                    f"needs num_attention_heads ({config['num_attention_heads']}) split in equal "
                                    "groups")
            attention["n_heads_in_group"] = heads.n_heads // heads.n_kv_heads
        ffn = {"no_op": False, "replace_with_linear": False, "intermediate_size": _intermediate(adapter, i)}
        blocks.append({"attention": attention, "ffn": ffn})
    config["block_configs"] = blocks
    return config


def _intermediate(adapter: Adapter, i: int) -> int:
    up = adapter.linear(i, "up")
    if not isinstance(up, nn.Linear):
        raise AttnslimError(f"layer {i} up is a {type(up).__name__}, not a dense Linear")
    return int(up.out_features)


def deci_state(adapter: Adapter, kept: list[bool]) -> dict[str, torch.Tensor]:
    """The DeciLM state dict (Llama's names, copies of the source's tensors): no self_attn or input_layernorm
    tensors for a layer without attention, lm_head only when it is not tied to the embeddings."""
    state = {"model.embed_tokens.weight": weight(adapter.embed_tokens()),
             "model.norm.weight": weight(adapter.final_norm())}
    if not adapter.config.tie_word_embeddings:
        state["lm_head.weight"] = weight(adapter.model.get_output_embeddings())
    for i, keep in enumerate(kept):
        p = f"model.layers.{i}."
        parts = [(f"self_attn.{name}_proj", adapter.linear(i, name)) for name in ATTENTION] if keep else []
        parts += [(f"mlp.{name}_proj", adapter.linear(i, name)) for name in MLP]
        for name, linear in parts:
            state[p + name + ".weight"] = weight(linear)
            flag = "mlp_bias" if name.startswith("mlp.") else "attention_bias"
            if (getattr(linear, "bias", None) is not None) != bool(getattr(adapter.config, flag, False)):
                raise AttnslimError(f"layer {i} {name} {'has' if linear.bias is not None else 'lacks'} a bias "
                                    f"against the config's {flag}; vLLM's DeciLM builds the biases the flag says")
            if linear.bias is not None:
                state[p + name + ".bias"] = weight(linear, "bias")
        if keep:
            state[p + "input_layernorm.weight"] = weight(adapter.attention_norm(i))
        state[p + "post_attention_layernorm.weight"] = weight(adapter.mlp_norm(i))
    return state

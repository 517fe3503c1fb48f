"""Gemma3 text models (`Gemma3ForCausalLM`, model_type "gemma3_text").

Architecture facts a method must respect:
- GQA/MQA with QK-norm: `q_norm`/`k_norm` (RMSNorm with a (1 + w) gain) act per head on
  (b, h, t, head_dim) after the projections and before RoPE; they are in the spec.
- Per-layer-type RoPE: one rotary module holds a table per `config.layer_types` entry
  ("sliding_attention" uses the local theta, "full_attention" the global one); it is called as
  `rotary(x, position_ids, layer_type)` and the decoder layer receives the (cos, sin) of its type.
- Sliding layers attend to the last `config.sliding_window` keys (key > query - window).
- scaling = query_pre_attn_scalar ** -0.5 (not head_dim ** -0.5).
- Decoder layer (sandwich norms):
      h = h + post_attention_layernorm(self_attn(input_layernorm(h)))
      h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))
  The AttentionSpec describes `self_attn` alone (its output before `post_attention_layernorm`). A
  replacement module takes the place of `self_attn`, so the post-norm keeps being applied to its
  output by the decoder layer; `attention_output_norm(i)` exposes that norm for methods that measure
  errors in the residual stream.
- Softcapping: transformers 5.x `Gemma3Attention` stores `attn_logit_softcapping` but never passes it
  to the attention kernel (Gemma3 replaced Gemma2's softcap by QK-norm; released configs set it to
  null), so the spec reports `softcap=None` to describe what the module computes.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from attnslim.adapters.base import Adapter, AttentionHeads, AttentionSpec, MLPSpec, QKNorm, RopeSpec
from attnslim.errors import AttnslimError
from attnslim.registry import register_adapter

_PATHS = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


@register_adapter
class Gemma3Adapter(Adapter):
    model_types = ("gemma3_text",)
    qk_norm = QKNorm(gain_offset=1.0, eps_attr="eps")  # Gemma3RMSNorm: x / rms(x) · (1 + weight), in float32

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        if getattr(self.config, "use_bidirectional_attention", False):
            raise AttnslimError(
                "Gemma3 config has use_bidirectional_attention=True (an embedding model, not a causal LM); "
                "attnslim compresses causal attention only: load the causal checkpoint instead"
            )

    def decoder_layers(self) -> nn.ModuleList:
        return self.model.model.layers

    def linear_paths(self) -> dict[str, str]:
        return dict(_PATHS)

    def embed_tokens(self) -> nn.Module:
        return self.model.model.embed_tokens  # scales by sqrt(hidden) inside its forward

    def attention_norm(self, i: int) -> nn.Module:
        return self._layer(i).input_layernorm

    def attention_output_norm(self, i: int) -> nn.Module | None:
        """`post_attention_layernorm`: applied by the decoder layer to self_attn's output."""
        return self._layer(i).post_attention_layernorm

    def rotary_embedding(self, layer_type: str = "full_attention") -> nn.Module | None:
        """The shared rotary module; call it with `layer_type` (see `_compat.rotary_cos_sin`)."""
        return self.model.model.rotary_emb

    def _layer(self, i: int) -> Any:
        return self.decoder_layers()[self._check_layer(i)]

    def _head_dim(self) -> int:
        cfg = self.config
        return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)

    def _rope(self, layer_type: str) -> RopeSpec:
        params = (getattr(self.config, "rope_parameters", None) or {}).get(layer_type) or {}
        if "rope_theta" not in params:
            raise AttnslimError(
                f"Gemma3 config has no rope_theta for layer type {layer_type!r} in rope_parameters "
                f"({sorted(self.config.rope_parameters or {})}); the config is malformed"
            )
        theta = float(params["rope_theta"])
        return RopeSpec(theta=theta, rotary_dims=self._head_dim(), layer_type=layer_type)

    def attention_heads(self, i: int) -> AttentionHeads:
        self._check_layer(i)
        cfg = self.config
        return AttentionHeads(n_heads=cfg.num_attention_heads, n_kv_heads=cfg.num_key_value_heads,
                              head_dim=self._head_dim())

    def attention_spec(self, i: int) -> AttentionSpec:
        cfg = self.config
        layer_type = self.layer_types()[i]
        return self._attention_spec_from_linears(
            i,
            scaling=float(cfg.query_pre_attn_scalar) ** -0.5,
            rope=self._rope(layer_type),
            sliding_window=cfg.sliding_window if layer_type == "sliding_attention" else None,
            softcap=None,  # see module docstring: HF's Gemma3Attention does not apply it
        )

    def mlp_spec(self, i: int) -> MLPSpec:
        act_fn = self._layer(i).mlp.act_fn
        return self._mlp_spec_from_linears(i, str(self.config.hidden_activation), act_fn)


"""Llama family: Llama, Mistral, Qwen2 (q/k/v bias), SmolLM2. GQA and RoPE; pre-norm decoder layers."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from attnslim.adapters.base import Adapter, AttentionHeads, AttentionSpec, MLPSpec, RopeSpec
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
class LlamaAdapter(Adapter):
    model_types: ClassVar[tuple[str, ...]] = ("llama", "mistral", "qwen2")  # Qwen3 subclasses it (adapters/qwen3.py)

    def decoder_layers(self) -> nn.ModuleList:
        return self.model.model.layers

    def linear_paths(self) -> dict[str, str]:
        return dict(_PATHS)

    def embed_tokens(self) -> nn.Module:
        return self.model.model.embed_tokens

    def attention_norm(self, i: int) -> nn.Module:
        return self._layer(i).input_layernorm

    def mlp_norm(self, i: int) -> nn.Module:
        return self._layer(i).post_attention_layernorm

    def final_norm(self) -> nn.Module:
        return self.model.model.norm

    def _layer(self, i: int) -> Any:
        return self.decoder_layers()[self._check_layer(i)]

    def rotary_embedding(self, layer_type: str = "full_attention") -> nn.Module | None:
        return self.model.model.rotary_emb

    def _rope(self, head_dim: int, layer_type: str) -> RopeSpec:
        cfg = self.config
        params = getattr(cfg, "rope_parameters", None) or {}
        theta = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        factor = float(params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)))
        return RopeSpec(theta=theta, rotary_dims=int(head_dim * factor), layer_type=layer_type)

    def attention_heads(self, i: int) -> AttentionHeads:
        cfg = self.config
        self._check_layer(i)
        n_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
        return AttentionHeads(n_heads=n_heads, n_kv_heads=cfg.num_key_value_heads, head_dim=head_dim)

    def attention_spec(self, i: int) -> AttentionSpec:
        cfg = self.config
        head_dim = self.attention_heads(i).head_dim
        layer_type = self.layer_types()[self._check_layer(i)]
        window = getattr(cfg, "sliding_window", None) if layer_type == "sliding_attention" else None
        return self._attention_spec_from_linears(
            i,
            scaling=head_dim**-0.5,
            rope=self._rope(head_dim, layer_type),
            sliding_window=window,
        )

    def mlp_spec(self, i: int) -> MLPSpec:
        return self._mlp_spec_from_linears(i, str(self.config.hidden_act), self._layer(i).mlp.act_fn)

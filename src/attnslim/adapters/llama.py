"""Llama family: Llama, Mistral, Qwen2 (q/k/v bias), SmolLM2. GQA and RoPE; pre-norm decoder layers."""

from __future__ import annotations

from torch import nn

from attnslim.adapters.base import Adapter, AttentionSpec, MLPSpec, RopeSpec
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


def _bias(linear: nn.Module):
    return None if getattr(linear, "bias", None) is None else linear.bias.detach()


@register_adapter
class LlamaAdapter(Adapter):
    model_types = ("llama", "mistral", "qwen2")

    def decoder_layers(self) -> nn.ModuleList:
        return self.model.model.layers

    def linear_paths(self) -> dict[str, str]:
        return dict(_PATHS)

    def embed_tokens(self) -> nn.Module:
        return self.model.model.embed_tokens

    def attention_norm(self, i: int) -> nn.Module:
        return self.decoder_layers()[self._check_layer(i)].input_layernorm

    def rotary_embedding(self, layer_type: str = "full_attention") -> nn.Module | None:
        return self.model.model.rotary_emb

    def _rope(self, head_dim: int, layer_type: str) -> RopeSpec:
        cfg = self.config
        params = getattr(cfg, "rope_parameters", None) or {}
        theta = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        factor = float(params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)))
        return RopeSpec(theta=theta, rotary_dims=int(head_dim * factor), layer_type=layer_type)

    def attention_spec(self, i: int) -> AttentionSpec:
        cfg = self.config
        n_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
        lin = {name: self.linear(i, name) for name in ("q", "k", "v", "o")}
        layer_type = self.layer_types()[i]
        window = getattr(cfg, "sliding_window", None) if layer_type == "sliding_attention" else None
        return AttentionSpec(
            layer=i,
            hidden_size=cfg.hidden_size,
            n_heads=n_heads,
            n_kv_heads=cfg.num_key_value_heads,
            head_dim=head_dim,
            q=lin["q"].weight.detach(),
            k=lin["k"].weight.detach(),
            v=lin["v"].weight.detach(),
            o=lin["o"].weight.detach(),
            q_bias=_bias(lin["q"]),
            k_bias=_bias(lin["k"]),
            v_bias=_bias(lin["v"]),
            o_bias=_bias(lin["o"]),
            scaling=head_dim**-0.5,
            rope=self._rope(head_dim, layer_type),
            sliding_window=window,
        )

    def mlp_spec(self, i: int) -> MLPSpec:
        lin = {name: self.linear(i, name) for name in ("gate", "up", "down")}
        mlp = self.mlp(i)
        return MLPSpec(
            layer=i,
            up=lin["up"].weight.detach(),
            down=lin["down"].weight.detach(),
            gate=lin["gate"].weight.detach(),
            up_bias=_bias(lin["up"]),
            down_bias=_bias(lin["down"]),
            gate_bias=_bias(lin["gate"]),
            activation=str(self.config.hidden_act),
            act_fn=mlp.act_fn,
        )

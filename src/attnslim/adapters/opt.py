"""OPT (`OPTForCausalLM`, model_type "opt"): MHA with biases, learned absolute positions, ReLU MLP.

Architecture facts a method must respect:
- Layers live at `model.model.decoder.layers`; tokens at `model.model.decoder.embed_tokens`, learned
  positions (`embed_positions`, offset 2, derived from the padding mask by cumsum) are added to the
  embeddings before layer 0, so attention has no RoPE (`rope=None`).
- q/k/v/out_proj carry biases when `enable_bias` (canonical "o" is `out_proj`). HF scales the
  projected query (bias included) by head_dim**-0.5 and calls the kernel with scaling=1.0; that is
  the same as spec scaling = head_dim**-0.5 on the scores.
- The decoder layer calls `self_attn(hidden_states=..., past_key_values=..., position_ids=...,
  attention_mask=..., **kwargs)`: no `position_embeddings`. A replacement module must take these as
  keywords (the `_compat` forward contract accepts `position_ids` through **kw) and return a tuple
  whose first item is the (b, t, hidden) output.
- The MLP has no container module: fc1 ("up") -> activation_fn (ReLU) -> fc2 ("down"), no gate, on the
  flattened (b*t, hidden) stream.
- `do_layer_norm_before=True` (all sizes but 350m) is pre-norm: `self_attn_layer_norm` feeds attention.
  With False (opt-350m) the norm follows the residual add and attention sees the raw residual stream.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from attnslim.adapters.base import Adapter, AttentionHeads, AttentionSpec, MLPSpec
from attnslim.errors import AttnslimError
from attnslim.registry import register_adapter

_PATHS = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.out_proj",
    "up": "fc1",
    "down": "fc2",
}


@register_adapter
class OPTAdapter(Adapter):
    model_types = ("opt",)

    def decoder_layers(self) -> nn.ModuleList:
        return self.model.model.decoder.layers

    def linear_paths(self) -> dict[str, str]:
        return dict(_PATHS)

    def embed_tokens(self) -> nn.Module:
        return self.model.model.decoder.embed_tokens

    def embeddings(self) -> list[nn.Module]:
        """Token and learned position tables (both count as the "embedding" group)."""
        return [self.embed_tokens(), self.model.model.decoder.embed_positions]

    def attention_norm(self, i: int) -> nn.Module:
        layer = self._layer(i)
        if not self.config.do_layer_norm_before:
            raise AttnslimError(
                f"layer {i}: this OPT model has do_layer_norm_before=False (post-norm, like opt-350m), so no "
                "norm precedes attention; hook the attention input (adapter.attention(i)) instead"
            )
        return layer.self_attn_layer_norm

    def mlp(self, i: int) -> nn.Module:
        raise AttnslimError(
            f"layer {i}: OPT has no MLP container module (fc1/fc2 sit directly in the decoder layer); "
            "use adapter.linear(i, 'up' | 'down') or adapter.mlp_spec(i)"
        )

    def _layer(self, i: int) -> Any:
        return self.decoder_layers()[self._check_layer(i)]

    def attention_heads(self, i: int) -> AttentionHeads:
        self._check_layer(i)
        n_heads = self.config.num_attention_heads
        return AttentionHeads(n_heads=n_heads, n_kv_heads=n_heads, head_dim=self.config.hidden_size // n_heads)  # MHA

    def attention_spec(self, i: int) -> AttentionSpec:
        return self._attention_spec_from_linears(
            i,
            scaling=self.attention_heads(i).head_dim**-0.5,
            rope=None,  # learned positions are added to the embeddings
        )

    def mlp_spec(self, i: int) -> MLPSpec:
        act_fn = self._layer(i).activation_fn
        return self._mlp_spec_from_linears(i, str(self.config.activation_function), act_fn)

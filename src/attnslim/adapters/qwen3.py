"""Qwen3 (`Qwen3ForCausalLM`, model_type "qwen3"): Llama's layout and paths, plus QK-norm.

Architecture facts a method must respect, and where the adapter states them:
- `self_attn.q_norm`/`k_norm` are `Qwen3RMSNorm`s over head_dim (gain = weight, eps in `variance_epsilon`) applied
  to each head's query and key after the projections and before RoPE: the `qk_norm` data below, which the base
  adapter puts in every AttentionSpec (`q_norm`/`k_norm` and their RMS formulas), as for Gemma3.
- No q/k/v/o biases by default (`attention_bias`); the spec reads whatever the linears hold.
- Sliding layers come from `config.layer_types` (`use_sliding_window`, `max_window_layers`), as for Qwen2.
- scaling = head_dim ** -0.5, RoPE from `rope_parameters` (scaled RoPE is read from the model's rotary module).
"""

from __future__ import annotations

from attnslim.adapters.base import QKNorm
from attnslim.adapters.llama import LlamaAdapter
from attnslim.registry import register_adapter


@register_adapter
class Qwen3Adapter(LlamaAdapter):
    model_types = ("qwen3",)
    qk_norm = QKNorm(gain_offset=0.0, eps_attr="variance_epsilon")

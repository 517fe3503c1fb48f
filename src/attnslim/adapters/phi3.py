"""Phi-3 (`Phi3ForCausalLM`, model_type "phi3"): Llama's decoder layout with fused projections.

Architecture facts a method must respect, and where the adapter states them:
- `self_attn.qkv_proj` is one linear whose rows are q (n_heads*head_dim), then k, then v (n_kv_heads*head_dim each);
  `mlp.gate_up_proj` is gate (intermediate) then up (intermediate); the MLP is down(up * act(gate)).
- Design: the fused linears are split into their canonical parts when the adapter is first taken on a model
  (`SplitLinear`, adapters/fused.py): `qkv_proj` becomes a module with children q, k, v, `gate_up_proj` one with
  gate, up, and the canonical paths are `self_attn.qkv_proj.q`, ..., `mlp.gate_up_proj.up`. Phi-3's own attention
  and MLP forwards keep calling `qkv_proj(x)` / `gate_up_proj(x)` and slicing, and a SplitLinear returns the parts'
  outputs concatenated in the fused order, so no HF forward is replaced or copied and every method runs unchanged.
  The split module's state dict holds the fused tensors while no method replaced a part, so a split model saves
  (attnslim's save, or `save_pretrained`) as a stock Phi-3 checkpoint; a replaced part keeps split keys, which
  `attnslim.load` reads after the same split. Chosen over splitting only inside the specs (read-only: methods
  could not replace q alone) and over a Phi-3 attention copy (HF modeling code copied per family, Style 12).
- After a method replaces the whole attention, the replacement module names its linears as HF's Llama does
  (`q_proj`, ...): those paths are used for a layer without `qkv_proj`, and likewise for a replaced MLP.
- Decoder layer: Llama's pre-norm (`input_layernorm`, `post_attention_layernorm`), residual dropouts (inactive in
  eval). RoPE from `rope_parameters`, partial rotary (`partial_rotary_factor`, Phi-4-mini) included; a
  `sliding_window` makes every layer slide (no `layer_types`), as for Mistral.
- Refused: `longrope` RoPE (Phi-3 -128k, Phi-3.5): its frequencies switch with the sequence length
  (short_factor up to `original_max_position_embeddings`, long_factor beyond), and the methods that rebuild a
  rotation from the model's frequencies (adapters/rotary.py) read one table. `--offload`: it reads a layer's
  tensors by the split names from a checkpoint that holds the fused ones.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from attnslim.adapters.base import MLPSpec
from attnslim.adapters.fused import SplitLinear
from attnslim.adapters.llama import LlamaAdapter
from attnslim.errors import AttnslimError
from attnslim.registry import register_adapter

_QKV, _GATE_UP = "self_attn.qkv_proj", "mlp.gate_up_proj"
_PATHS = {
    "q": f"{_QKV}.q",
    "k": f"{_QKV}.k",
    "v": f"{_QKV}.v",
    "o": "self_attn.o_proj",
    "gate": f"{_GATE_UP}.gate",
    "up": f"{_GATE_UP}.up",
    "down": "mlp.down_proj",
}
# where a replacement attention/MLP module (attnslim's, which follow HF Llama's names) holds the parts
_REPLACED_PATHS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                   "gate": "mlp.gate_proj", "up": "mlp.up_proj"}


@register_adapter
class Phi3Adapter(LlamaAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("phi3",)

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        rope_type = (getattr(self.config, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type not in ("default", None):
            raise AttnslimError(
                f"Phi-3 rope_type {rope_type!r} is not supported: longrope switches its frequencies with the sequence "
                "length (short_factor up to original_max_position_embeddings, long_factor beyond), and attnslim's "
                "methods rebuild a rotation from one frequency table. Use a checkpoint with default RoPE (e.g. "
                "Phi-3-mini-4k-instruct), or drop rope_scaling from config.json and set max_position_embeddings to "
                "original_max_position_embeddings (the model then keeps only its original context)"
            )
        self._split_fused()

    def refuse_offload(self) -> None:
        raise AttnslimError(
            "--offload does not support Phi-3 yet: its layers' fused qkv_proj/gate_up_proj are split into canonical "
            "linears in memory, and offloading reads each layer's tensors by name from a checkpoint that holds the "
            "fused ones; run without --offload (on a machine with memory for the model)"
        )

    def _split_fused(self) -> None:
        """Every layer's unsplit `qkv_proj`/`gate_up_proj` replaced by its SplitLinear (idempotent). Every shape is
        checked before any is split (a fused linear that does not match the config leaves the model as it was), and
        the split goes one linear at a time (the copies never hold more than one fused linear twice)."""
        heads = self.attention_heads(0)
        qkv = {"q": heads.n_heads * heads.head_dim, "k": heads.n_kv_heads * heads.head_dim,
               "v": heads.n_kv_heads * heads.head_dim}
        inter = int(self.config.intermediate_size)
        splits: list[tuple[nn.Module, str, nn.Linear, dict[str, int]]] = []
        for layer in self.decoder_layers():
            for path, widths in ((_QKV, qkv), (_GATE_UP, {"gate": inter, "up": inter})):
                owner_path, _, attr = path.rpartition(".")
                owner = _child(layer, owner_path)
                fused = getattr(owner, attr, None) if owner is not None else None
                if isinstance(fused, nn.Linear):  # unsplit (a SplitLinear is no nn.Linear)
                    SplitLinear.check(fused, widths)
                    splits.append((owner, attr, fused, widths))
        splits.reverse()
        while splits:  # popped, so a replaced fused linear is freed before the next is copied
            owner, attr, fused, widths = splits.pop()
            setattr(owner, attr, SplitLinear.of(fused, widths))

    def linear_paths(self) -> dict[str, str]:
        return dict(_PATHS)

    def _linear_path(self, i: int, name: str) -> str:
        path = super()._linear_path(i, name)
        fused_path = path.rpartition(".")[0]
        if fused_path in (_QKV, _GATE_UP) and not isinstance(_child(self._layer(i), fused_path), SplitLinear):
            return _REPLACED_PATHS[name]  # the attention (or MLP) was replaced by a module with Llama's names
        return path

    def mlp_spec(self, i: int) -> MLPSpec:
        return self._mlp_spec_from_linears(i, str(self.config.hidden_act), self._layer(i).mlp.activation_fn)


def _child(module: nn.Module, path: str) -> Any:
    """module.get_submodule(path), or None when some step of the path is missing."""
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None

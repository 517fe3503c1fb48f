"""attnslim's vLLM model: vLLM's own Llama, with NBL-linearized and dropped attention layers (runs in .venv-vllm).

Everything but the attention sub-block is vLLM's `LlamaForCausalLM` / `LlamaDecoderLayer` (fused residual norms,
parallel MLP, embeddings, LM head, weight loading). A layer whose attention is gone builds no vLLM `Attention`, so
vLLM's KV cache spec (one entry per attention layer) allocates nothing for it: the KV capacity grows with every
linearized or dropped layer. Which layer is which comes from the directory's compression.json (`plan.layer_kinds`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from vllm.model_executor.models.utils import extract_layer_index

from attnslim.serving.plan import LayerKind, layer_kinds

HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


class LinearizedMap(nn.Module):
    """NBL's y = W x + b (W (d, d), b (d,)), replicated on every tensor-parallel rank: a full output, as o_proj
    gives after its all-reduce. Parameter names match attnslim's LinearizedAttention (`self_attn.weight/bias`)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _attention_free(kind: LayerKind) -> Callable[..., nn.Module | None]:
    """Stands in for `attn_layer_type`: takes LlamaDecoderLayer's attention arguments, builds no Attention."""

    def build(*, hidden_size: int, **_attention_args: Any) -> nn.Module | None:
        return LinearizedMap(hidden_size) if kind.kind == "linearized" else None

    return build


@lru_cache(maxsize=8)
def _kinds(directory: str) -> tuple[LayerKind, ...]:
    return tuple(layer_kinds(Path(directory)))


class AttnslimDecoderLayer(LlamaDecoderLayer):
    def __init__(self, vllm_config: Any, prefix: str = "", config: Any = None) -> None:
        kind = _kinds(vllm_config.model_config.model)[extract_layer_index(prefix)]
        attention = LlamaAttention if kind.has_kv_cache else _attention_free(kind)
        super().__init__(vllm_config=vllm_config, prefix=prefix, config=config, attn_layer_type=attention)
        self.kind = kind
        if kind.kind == "linearized" and kind.input == "residual":
            del self.input_layernorm  # attnslim installed an identity there: no weight, and the map reads h itself

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's layer contract: (hidden_states, residual) in and out, h = hidden_states + residual."""
        if self.kind.has_kv_cache:
            return super().forward(positions, hidden_states, residual)
        if self.kind.kind == "dropped":  # h + 0: only the MLP sub-block runs
            if residual is None:
                residual = hidden_states
                hidden_states = self.post_attention_layernorm(hidden_states)
            else:
                hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
            return self.mlp(hidden_states), residual
        if self.kind.input == "residual":  # the map reads the raw residual stream h
            residual = hidden_states if residual is None else hidden_states + residual
            hidden_states = residual
        elif residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states, residual = self.post_attention_layernorm(self.self_attn(hidden_states), residual)
        return self.mlp(hidden_states), residual


class AttnslimLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=AttnslimDecoderLayer)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(_with_embedding(weights))


def _with_embedding(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """attnslim stores a tied embedding once, as `lm_head.weight` (io._deduplicated_state keeps the first sorted
    name). vLLM then unties the head (the checkpoint "has an lm_head", `ModelConfig.maybe_untie_word_embeddings`)
    and would leave `model.embed_tokens.weight` unloaded: a checkpoint without it gets the head's tensor there too
    (vLLM re-ties the two once it sees they are equal)."""
    head, embedding_seen = None, False
    for name, tensor in weights:
        embedding_seen |= name == EMBEDDING
        if name == HEAD:
            head = tensor
        yield name, tensor
    if head is not None and not embedding_seen:
        yield EMBEDDING, head

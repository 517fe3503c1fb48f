"""Shared fixtures: tiny random models of every supported family, built from configs (no network)."""

from __future__ import annotations

import pytest
import torch


def tiny_llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        rope_theta=10000.0, tie_word_embeddings=True, attn_implementation="sdpa",
    )
    cfg.update(overrides)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**cfg)).eval()


@pytest.fixture
def llama():
    return tiny_llama()

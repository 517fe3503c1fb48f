"""vLLM general plugin (entry point group `vllm.general_plugins`): registers attnslim's config and model.

vLLM calls `register` once per process (front end, engine core, each worker): it is cheap and idempotent, and the
model class is registered lazily by name, so nothing heavy is imported here."""

from __future__ import annotations

MODEL_CLASS = "attnslim.serving.vllm_model:AttnslimLlamaForCausalLM"


def register() -> None:
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from attnslim.serving.plan import ARCHITECTURE, MODEL_TYPE
    from attnslim.serving.vllm_config import AttnslimServeConfig

    AutoConfig.register(MODEL_TYPE, AttnslimServeConfig, exist_ok=True)
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)

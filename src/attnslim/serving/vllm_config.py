"""The transformers config vLLM reads an attnslim directory with (registered by the plugin for model_type
"attnslim"): the base Llama config, with the architecture pointed at attnslim's vLLM model, so that
vLLM serves the directory with no --hf-overrides and never runs the directory's remote code. A Qwen2 base is a Llama
with q/k/v biases (and sliding windows where its `layer_types` say, which vLLM's Llama reads too)."""

from __future__ import annotations

from typing import Any

from transformers import LlamaConfig

from attnslim.disk_format import BASE_TYPE_KEY, MODEL_TYPE
from attnslim.serving.plan import ARCHITECTURE


class AttnslimServeConfig(LlamaConfig):
    model_type = MODEL_TYPE

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        self.architectures = [ARCHITECTURE]
        if getattr(self, BASE_TYPE_KEY, None) == "qwen2":  # q/k/v biases, none on o_proj: vLLM's Llama `qkv_bias`
            self.qkv_bias = True

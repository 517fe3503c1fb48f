"""The config class of an `attnslim export --to deci` directory (model_type "nemotron-nas"): vLLM's own
`DeciLMForCausalLM` serves the directory, but neither vLLM 0.32 nor transformers (5.19, 5.23) registers a config
for "nemotron-nas", so vLLM reads config.json through this file (`--trust-remote-code`).

It is Llama's config plus `block_configs`, one per decoder layer, kept as JSON objects whose keys also read as
attributes: vLLM reads `block.attention.no_op`, `block.attention.n_heads_in_group` and, through `hasattr`, whether
`block.ffn` has `ffn_mult` (else it takes `block.ffn.intermediate_size`). Plain dicts keep the config JSON-
serialisable and picklable for vLLM's worker processes. Imports transformers only: no attnslim, no weights code.
"""

from typing import Any

from transformers import LlamaConfig


class BlockSection(dict):  # type: ignore[type-arg]
    """One section of a block config ({"no_op": ..., ...}): a dict whose keys read as attributes; a missing key is
    an AttributeError, so `hasattr` answers whether the key is present."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class BlockConfig(BlockSection):
    """{"attention": {...}, "ffn": {...}} of one decoder layer."""

    def __init__(self, value: dict[str, Any]) -> None:
        super().__init__({k: BlockSection(v) if isinstance(v, dict) else v for k, v in value.items()})


class DeciLMConfig(LlamaConfig):
    model_type = "nemotron-nas"

    def __post_init__(self, **kwargs: Any) -> None:
        # None: the default instance transformers builds to diff against (to_diff_dict), not a model's config
        blocks = kwargs.pop("block_configs", None)
        if blocks is not None and (not isinstance(blocks, list) or not all(isinstance(b, dict) for b in blocks)):
            raise ValueError("block_configs of a nemotron-nas config is a list of one object per decoder layer")
        self.block_configs = [BlockConfig(b) for b in blocks or []]
        super().__post_init__(**kwargs)
        if blocks is not None and len(blocks) != self.num_hidden_layers:
            raise ValueError(f"block_configs has {len(blocks)} entries for {self.num_hidden_layers} layers "
                             "(num_hidden_layers)")

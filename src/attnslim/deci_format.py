"""The DeciLM (nemotron-nas) format of `attnslim export --to deci`, as `export` writes it and `attnslim serve` checks
it. Only stdlib (a leaf: serve reads it without importing torch).

vLLM 0.32 serves the format with its own DeciLMForCausalLM, but no library registers its config, so the directory
carries attnslim's config class (hf_entry/configuration_decilm.py) and vLLM reads it with --trust-remote-code.
`attnslim serve` passes that flag only for a directory whose config class is byte for byte attnslim's own."""

from __future__ import annotations

from pathlib import Path

ARCHITECTURE = "DeciLMForCausalLM"
MODEL_TYPE = "nemotron-nas"
CONFIG_CODE = Path(__file__).parent / "hf_entry" / "configuration_decilm.py"
AUTO_MAP = {"AutoConfig": f"{CONFIG_CODE.stem}.DeciLMConfig"}

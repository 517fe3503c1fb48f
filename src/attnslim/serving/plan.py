"""Which layers of an attnslim output vLLM runs how: the one reading of config.json + compression.json shared by the
vLLM model (inside .venv-vllm) and `attnslim serve`'s up-front check (inside .venv). Standard library only."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnslim.errors import AttnslimError

ARCHITECTURE = "AttnslimForCausalLM"
MODEL_TYPE = "attnslim"
BASE_TYPE_KEY = "attnslim_base_model_type"
COMPRESSION_JSON = "compression.json"
SERVABLE_BASES = ("llama",)
SERVABLE_METHODS = ("nbl", "drop")
MAKE_TARGET = "make serve-setup"


@dataclass(frozen=True)
class LayerKind:
    """How one decoder layer runs: "attention" (vLLM's own), "linearized" (y = W x + b on `input`), "dropped"."""

    kind: str
    input: str = "normed"

    @property
    def has_kv_cache(self) -> bool:
        return self.kind == "attention"


def read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AttnslimError(f"{path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise AttnslimError(f"{path} is damaged ({err})") from None
    if not isinstance(value, dict):
        raise AttnslimError(f"{path} is damaged (not a JSON object)")
    return value


def is_attnslim_output(directory: Path) -> bool:
    return read_json(directory / "config.json").get("model_type") == MODEL_TYPE


def layer_kinds(directory: Path) -> list[LayerKind]:
    """Per layer, how vLLM runs it; an AttnslimError that names every method and base family vLLM cannot run."""
    config = read_json(directory / "config.json")
    if config.get("model_type") != MODEL_TYPE:
        raise AttnslimError(f"{directory} is not an attnslim output (config.json model_type is "
                            f"{config.get('model_type')!r}, not {MODEL_TYPE!r})")
    base = config.get(BASE_TYPE_KEY)
    if base not in SERVABLE_BASES:
        raise AttnslimError(f"{directory}: serving supports attnslim outputs of {', '.join(SERVABLE_BASES)} models; "
                            f"this one is {base!r}")
    layers = config.get("num_hidden_layers")
    if not isinstance(layers, int) or layers < 1:
        raise AttnslimError(f"{directory}/config.json has no valid num_hidden_layers ({layers!r})")
    kinds = [LayerKind("attention")] * layers
    refused: dict[str, list[int]] = {}
    for step in read_json(directory / COMPRESSION_JSON).get("steps", []):
        method, entries = step["method"], step["plan"]["layers"]
        for key, entry in entries.items():
            index = int(key)
            if method == "nbl":
                kinds[index] = LayerKind("linearized", entry["input"])
            elif method == "drop":
                kinds[index] = LayerKind("dropped")
            else:
                refused.setdefault(method, []).append(index)
    if refused:
        named = "; ".join(f"{m} (layers {', '.join(map(str, sorted(ix)))})" for m, ix in sorted(refused.items()))
        raise AttnslimError(f"{directory}: vLLM cannot run these methods: {named}. Servable methods: "
                            f"{', '.join(SERVABLE_METHODS)} (dense layers run as vLLM's own attention)"
                            + _export_hint(refused))
    return kinds


def _export_hint(refused: dict[str, list[int]]) -> str:
    if set(refused) <= {"mla", "transmla"}:
        return ("; an all-MLA model is served as a DeepSeek-V3 checkpoint: `attnslim export DIR --to deepseek-v3 "
                "--out OUT --kv-lora-rank 512 --dtype bfloat16` (compressed with layout: deepseek, e.g. recipe "
                "mla-deepseek), then `attnslim serve OUT`")
    return ""

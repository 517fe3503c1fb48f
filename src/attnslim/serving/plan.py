"""Which layers of an attnslim output vLLM runs how: the one reading of config.json + compression.json shared by the
vLLM model (inside .venv-vllm) and `attnslim serve`'s up-front check (inside .venv).

Imports only the standard library and attnslim's stdlib-only modules (errors, safe_files, plan): lint-imports keeps
every 5.23-only module out. The reader accepts exactly the plans `attnslim.load` accepts: layer keys by the same rule
(`attnslim.plan.layer_index`: "-1" and "abc" are refused, never read as the last layer), indices inside the model,
NBL inputs from LinearizedAttention's set. Both files are read with `safe_files.read_json` (regular files only, size
capped), so a link to /dev/zero or a FIFO is refused instead of filling memory or hanging."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnslim.disk_format import BASE_TYPE_KEY, COMPRESSION_JSON, MODEL_TYPE
from attnslim.engines import PLUGIN_BASES
from attnslim.errors import AttnslimError
from attnslim.mla_widths import VLLM_CPU_LORA_RANK
from attnslim.plan import layer_index
from attnslim.safe_files import read_json as read_json_file

ARCHITECTURE = "AttnslimForCausalLM"
SERVABLE_METHODS = ("nbl", "drop")
MAKE_TARGET = "make serve-setup"
NBL_INPUTS = ("normed", "residual")  # modules/linearized.py's INPUTS (a 5.23-side module; a test ties the two)
MAX_LAYERS = 10_000  # num_hidden_layers above this is damage (real models have < 200), refused before any list
RECREATE = "re-create the output with attnslim compress"


@dataclass(frozen=True)
class LayerKind:
    """How one decoder layer runs: "attention" (vLLM's own), "linearized" (y = W x + b on `input`), "dropped"."""

    kind: str
    input: str = "normed"

    @property
    def has_kv_cache(self) -> bool:
        return self.kind == "attention"


def read_json(path: Path) -> dict[str, Any]:
    """A model directory's JSON object (config.json, compression.json): a regular file, size capped, or an
    AttnslimError naming the file."""
    value = read_json_file(path, "model file", fix="re-create the directory (attnslim compress or export)")
    if not isinstance(value, dict):
        raise AttnslimError(f"{path} is damaged (not a JSON object); re-create the directory (attnslim compress or "
                            "export)")
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
    if base not in PLUGIN_BASES:
        raise AttnslimError(f"{directory}: serving supports attnslim outputs of {', '.join(PLUGIN_BASES)} models; "
                            f"this one is {base!r}")
    layers = config.get("num_hidden_layers")
    if not isinstance(layers, int) or isinstance(layers, bool) or not 1 <= layers <= MAX_LAYERS:
        raise AttnslimError(f"{directory}/config.json has no valid num_hidden_layers ({layers!r}; 1..{MAX_LAYERS}); "
                            + RECREATE)
    kinds = [LayerKind("attention")] * layers
    refused: dict[str, list[int]] = {}
    for where, method, entries in _steps(directory):
        for key, entry in entries.items():
            index = layer_index(key, where)
            if index >= layers:
                raise AttnslimError(f"{where}: plan layer {index} is beyond the model, whose config.json has {layers} "
                                    f"layers (0..{layers - 1}); {RECREATE}")
            if not isinstance(entry, dict):
                raise AttnslimError(f"{where}: plan layer {key!r} -> {entry!r} is not a layer's entry (a JSON "
                                    f"object); {RECREATE}")
            if method == "nbl":
                kinds[index] = LayerKind("linearized", _nbl_input(entry, f"{where} layer {key}"))
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


def _steps(directory: Path) -> list[tuple[str, str, dict[str, Any]]]:
    """(where, method, plan layers) of each step of compression.json, or an AttnslimError naming what is missing.
    `where` names the step as `attnslim.load` does ("compression.json step 2 (nbl)")."""
    path = directory / COMPRESSION_JSON
    info = read_json(path)
    if info.get("head") is not None:
        raise AttnslimError(f"{directory}: its LM head is factored (the recipe's head: section), which vLLM cannot "
                            "load; serve it with transformers (attnslim.load), or compress without head:")
    steps = info.get("steps")
    if not isinstance(steps, list):
        raise AttnslimError(f"{path} is damaged (no 'steps' list); {RECREATE}")
    found = []
    for n, step in enumerate(steps):
        method = step.get("method") if isinstance(step, dict) else None
        if not isinstance(method, str):
            raise AttnslimError(f"{path} step {n + 1} is damaged (no method name: {step!r:.200}); {RECREATE}")
        where = f"{path} step {n + 1} ({method})"
        plan = step.get("plan")
        if not isinstance(plan, dict) or not isinstance(plan.get("layers"), dict):
            raise AttnslimError(f"{where}: the plan has no 'layers' mapping; {RECREATE}")
        found.append((where, method, plan["layers"]))
    return found


def _nbl_input(entry: dict[str, Any], where: str) -> str:
    value = entry.get("input")
    if value not in NBL_INPUTS:
        raise AttnslimError(f"{where}: the NBL map's input {value!r} is not one of {' | '.join(NBL_INPUTS)}; "
                            + RECREATE)
    return str(value)


def _export_hint(refused: dict[str, list[int]]) -> str:
    if set(refused) <= {"mla", "transmla"}:
        return ("; an all-MLA model is served as a DeepSeek-V3 checkpoint: `attnslim export DIR --to deepseek-v3 "
                f"--out OUT --kv-lora-rank {VLLM_CPU_LORA_RANK} --dtype bfloat16` (on a CPU; `auto` for the smallest "
                "width a GPU serves; compressed with layout: deepseek, e.g. recipe mla-deepseek), then "
                "`attnslim serve OUT`")
    return ""

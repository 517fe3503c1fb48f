"""Which attnslim outputs `export --to deci` can write, decided from config.json and compression.json before the
model is loaded (export/deci.py checks the loaded modules again: the Python API takes a model).

A DeciLM layer (vLLM 0.32's DeciLMForCausalLM, model/executor/models/nemotron_nas.py) has full attention with its
own KV-head count (`n_heads_in_group`) or none (`attention.no_op`: no module, no KV cache). It reads no other
attention kind: the `replace_with_linear` of NVIDIA's block configs is not read by vLLM, so NBL's linear maps stay
with attnslim's plugin. Only `drop` steps are written; every other method's layers are refused, each named with
what serves it instead.

Layer 0 without attention is refused too: DeciLMDecoderLayer.forward then hands its MLP norm a residual of None
(the residual starts at the first attention layer's norm), vLLM's RMSNorm returns one tensor, not the (output,
residual) pair the layer unpacks, and vLLM 0.32 fails at the first request ("too many values to unpack").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnslim.disk_format import BASE_TYPE_KEY, COMPRESSION_JSON, MODEL_TYPE
from attnslim.engines import DECI_BASES
from attnslim.errors import AttnslimError
from attnslim.export.common import span
from attnslim.plan import layer_index
from attnslim.safe_files import read_json

METHOD = "drop"
SERVE = "`attnslim serve DIR` (attnslim's vLLM plugin)"
_SHARED = ("shares attention scores across layers, which no stock engine computes: run it with attnslim.load "
           "(transformers)")
_MLA = ("is MLA: `attnslim export DIR --to deepseek-v3` writes an all-MLA output (compressed with layout: deepseek) "
        "as a stock DeepSeek-V3 checkpoint")
ELSEWHERE: dict[str, str] = {
    "nbl": "replaces attention by a linear map, which vLLM's DeciLMForCausalLM cannot build (it reads no "
           f"replace_with_linear): served by {SERVE}",
    "mla": _MLA, "transmla": _MLA, "lisa": _SHARED, "ds": _SHARED,
}
OTHER = "has no stock-engine form: run it with attnslim.load (transformers)"
FIRST_LAYER = ("layer 0 has no attention (dropped), which vLLM 0.32's DeciLMForCausalLM cannot run: its first MLP "
               "norm gets no residual and the first request fails with 'too many values to unpack' (nemotron_nas.py, "
               f"DeciLMDecoderLayer.forward); serve this output with {SERVE}, which runs it")


def refuse_methods(found: dict[str, list[int]]) -> None:
    """An AttnslimError naming each method of `found` (method -> its layers) and what serves it instead."""
    if not found:
        return
    named = "; ".join(f"layers {span(sorted(layers))} ({method}) {ELSEWHERE.get(method, OTHER)}"
                      for method, layers in sorted(found.items()))
    raise AttnslimError(f"export --to deci writes only dropped attention (method {METHOD}) and dense layers: {named}")


def check_family(family: object, what: str) -> None:
    """Refuse a base model whose layers vLLM's DeciLM cannot hold (engines.DECI_BASES: Llama's layers, no sliding
    window, Llama's biases); `what` names the model in the message."""
    if family not in DECI_BASES:
        raise AttnslimError(f"export --to deci supports {', '.join(DECI_BASES)} models (vLLM's DeciLM layers are "
                            f"Llama's); {what} is {family!r}")


def check_directory(directory: Path) -> list[int]:
    """The dropped layers of the attnslim output `directory`, or a refusal, read from its JSON files alone."""
    recreate = "re-create it with attnslim compress"
    config = _object(directory / "config.json", recreate)
    if config.get("model_type") != MODEL_TYPE or not (directory / COMPRESSION_JSON).exists():
        raise AttnslimError(f"{directory} is not an attnslim output (no {COMPRESSION_JSON} or config.json model_type "
                            f"{config.get('model_type')!r}); export --to deci takes the directory `attnslim compress` "
                            "wrote (a dense checkpoint is served by vLLM as it is)")
    check_family(config.get(BASE_TYPE_KEY), str(directory))
    record = directory / COMPRESSION_JSON
    info = _object(record, recreate)
    if info.get("head") is not None:
        raise AttnslimError(f"{directory}: its LM head is factored (the recipe's head: section); vLLM's DeciLM serves "
                            "a dense head only: compress without head: to export --to deci")
    steps = info.get("steps")
    if not isinstance(steps, list):
        raise AttnslimError(f"{record} has no 'steps' list; {recreate}")
    dropped: set[int] = set()
    refused: dict[str, list[int]] = {}
    for n, step in enumerate(steps):
        method = step.get("method") if isinstance(step, dict) else None
        plan = step.get("plan") if isinstance(step, dict) else None
        layers = plan.get("layers") if isinstance(plan, dict) else None
        if not isinstance(method, str) or not isinstance(layers, dict):
            raise AttnslimError(f"{record} step {n + 1} has no method and plan layers; {recreate}")
        indices = [layer_index(key, f"{record} step {n + 1} ({method})") for key in layers]
        if method == METHOD:
            dropped.update(indices)
        else:
            refused.setdefault(method, []).extend(indices)
    refuse_methods(refused)
    check_first_layer(sorted(dropped))
    return sorted(dropped)


def check_first_layer(dropped: list[int]) -> None:
    if 0 in dropped:
        raise AttnslimError(FIRST_LAYER)


def _object(path: Path, fix: str) -> dict[str, Any]:
    value = read_json(path, "model file", fix=fix)
    if not isinstance(value, dict):
        raise AttnslimError(f"{path} is not a JSON object; {fix}")
    return value

"""Save / load compressed models: safetensors weights + compression.json, rebuild-then-load (no pickle).

A saved directory holds model.safetensors, config.json, tokenizer files, compression.json and attnslim_hf.py.
- config.json's `model_type` is "attnslim" (the base family is kept under `attnslim_base_model_type`): transformers
  does not know it, so loading without `trust_remote_code=True` fails loudly instead of returning the dense
  architecture with random weights in every compressed layer.
- With `trust_remote_code=True`, transformers runs the directory's own attnslim_hf.py (whatever file is there, not
  the installed package's copy), which hands over to `attnslim.io.load`. `load` itself never imports anything from
  the directory and passes `trust_remote_code=False` everywhere: use it for directories you did not write.
- compression.json records the sha256 of model.safetensors; `load` checks it, so damage anywhere in the weights is
  found before a number is computed from them. An offloaded compression (attnslim.offload) writes one shard per
  decoder layer instead, with each shard's size and sha256 (attnslim.verify: when a shard is re-hashed, which
  format versions and records are accepted).
- Every file of the directory is read as a regular file (a link to /dev/zero or a FIFO is refused), JSON with a size
  cap (safe_files), and config.json's sizes are checked against the weights' shapes before the model is built
  (config_bounds). Loading writes nothing into the directory.
- Outputs are written through `attnslim.outdir` (temp directory, no-replace install or rename swap).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from attnslim import _compat
from attnslim.checksum import sha256_file
from attnslim.config_bounds import check_config_sizes
from attnslim.disk_format import BASE_TYPE_KEY, COMPRESSION_JSON, HF_ENTRY, INDEX, MODEL_TYPE, WEIGHTS
from attnslim.errors import AttnslimError, first_line
from attnslim.outdir import describe_copies, staged_output
from attnslim.safe_files import read_json, refuse_special_files, regular_file, write_text_atomic
from attnslim.verify import READABLE_VERSIONS, SHARDED_VERSION, check_record

FORMAT_VERSION = 2  # 2: model_type "attnslim" + weights sha256; 1 (model_type of the base family) loads, warned
# SHARDED_VERSION = 3: weight shards (offloaded compression) with per-shard sizes and sha256
__all__ = ["FORMAT_VERSION", "READABLE_VERSIONS", "SHARDED_VERSION", "load", "read_compression_json", "save",
           "write_compression_json"]
_ENTRY_SOURCE = Path(__file__).parent / "hf_entry" / HF_ENTRY
_REQUIRED_KEYS = ("recipe", "steps")


def save(model: Any, tokenizer: Any, directory: str | Path, report: dict[str, Any], overwrite: bool = False) -> Path:
    """Write the compressed model to `directory` (temp directory, then a no-replace install or a rename swap)."""
    from safetensors.torch import save_file

    target = Path(directory)
    with staged_output(target, overwrite) as tmp:
        save_file(_deduplicated_state(model), str(tmp / WEIGHTS), metadata={"format": "pt"})
        info = {"format_version": FORMAT_VERSION, **report, "weights_sha256": sha256_file(tmp / WEIGHTS)}
        _write_metadata(model, tokenizer, tmp, info)
    return target


def save_sharded_metadata(model: Any, tokenizer: Any, tmp: Path, report: dict[str, Any], shards: list[str]) -> None:
    """Everything but the weights, for a directory whose weight shards an offloaded compression already wrote into
    `tmp` (the staged output): compression.json records each shard's size and sha256 instead of one file's."""
    from attnslim.offload import record_shards

    info = {"format_version": SHARDED_VERSION, **report, "weights_shards": record_shards(tmp, shards)}
    _write_metadata(model, tokenizer, tmp, info)


def _write_metadata(model: Any, tokenizer: Any, tmp: Path, info: dict[str, Any]) -> None:
    config = model.config.to_dict()
    config[BASE_TYPE_KEY], config["model_type"] = config["model_type"], MODEL_TYPE
    config["auto_map"] = {"AutoConfig": "attnslim_hf.AttnslimConfig",
                          "AutoModelForCausalLM": "attnslim_hf.AttnslimForCausalLM"}
    (tmp / "config.json").write_text(json.dumps(config, indent=1, default=str))
    tokenizer.save_pretrained(tmp)
    shutil.copy(_ENTRY_SOURCE, tmp / HF_ENTRY)
    write_compression_json(tmp, info)


def write_compression_json(directory: Path, info: dict[str, Any]) -> None:
    """The one writer of compression.json: `save` and `save_sharded_metadata` into their staged output, and the demo
    adding the metrics it measured to an output it has just written. Atomic, and never through a link
    (safe_files.write_text_atomic): a failed write leaves the old record whole."""
    write_text_atomic(directory / COMPRESSION_JSON, json.dumps(info, indent=1))


def _deduplicated_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with each tied tensor stored once, under its first name in sorted order.

    safetensors' `save_model` does the same but records the dropped names in metadata in set order, so two identical
    runs could write different bytes; `load_model` re-ties them from the model either way. Zero-element tensors (a
    LowRankLinear whose B is all structure: the left-block or LU junction at r = d_out) share no data, and
    safetensors expects each of them by name, so they are never deduplicated (they all report data_ptr 0)."""
    kept: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], str] = {}
    out = {}
    for name, tensor in sorted(model.state_dict().items()):
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
        if tensor.numel() and key in kept:
            continue
        kept[key] = name
        out[name] = tensor.detach().contiguous()
    return out


def read_compression_json(directory: Path, verify: bool = False) -> dict[str, Any]:
    """compression.json (a regular file, size and nesting bounded), with a format version and checksum record
    that guarantee a checked load (attnslim.verify.check_record)."""
    path = directory / COMPRESSION_JSON
    if not path.exists() and not path.is_symlink():
        raise AttnslimError(f"{directory} is not a compressed model (no {COMPRESSION_JSON}); run attnslim compress"
                            + describe_copies(directory))
    info = read_json(path, COMPRESSION_JSON)
    if not isinstance(info, dict):
        raise AttnslimError(f"{path} is damaged (not a JSON object); re-create the directory with attnslim compress")
    check_record(info, path, verify)
    missing = [k for k in _REQUIRED_KEYS if not isinstance(info.get(k), dict if k == "recipe" else list)]
    if missing:
        raise AttnslimError(f"{directory} is damaged ({COMPRESSION_JSON} has no valid {', '.join(missing)}); "
                            "re-create it with attnslim compress")
    return info


def load(directory: str | Path, dtype: torch.dtype = torch.float32, offload: bool = False,
         device: torch.device | None = None, verify: bool = False) -> tuple[Any, Any]:
    """Rebuild the base architecture, re-create each step's modules (skeleton), load weights strictly.

    offload=True keeps every decoder layer's weights on disk, read while the layer runs on `device` (default cpu;
    offload/dispatch.py): for outputs larger than memory. verify=True (or ATTNSLIM_VERIFY=1) hashes every weights
    file in full instead of trusting a stamp (attnslim.verify states the policy). Anything wrong with the directory
    (weights, config, plan, tokenizer) is an AttnslimError that says so; nothing is written into it."""
    from safetensors import SafetensorError

    directory = Path(directory)
    info = read_compression_json(directory, verify)
    try:
        return _load(directory, info, dtype, offload, device or torch.device("cpu"), verify)
    except AttnslimError as err:
        raise AttnslimError(str(err) if str(err).startswith(str(directory)) else f"{directory}: {err}") from err
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError, SafetensorError) as err:
        raise AttnslimError(f"{directory} is damaged ({type(err).__name__}: {first_line(err)}); "
                            "re-create it with attnslim compress") from err


def apply_skeletons(model: Any, steps: list[dict[str, Any]], head: dict[str, Any] | None = None) -> None:
    """Re-create the replacement modules named by saved plans (empty weights; loading fills them), and the factored
    LM head a "head" record names."""
    from attnslim.adapters import get_adapter
    from attnslim.methods import lookup_method
    from attnslim.methods.head import HeadEntry, head_skeleton

    adapter = get_adapter(model)
    for n, step in enumerate(steps):
        method = lookup_method(step["method"]).from_args(dict(step["args"]))
        plan = method.read_plan(step["plan"], f"{COMPRESSION_JSON} step {n + 1} ({step['method']})")
        for layer, entry in plan.layers.items():
            method.skeleton(adapter, layer, entry)
    if head is not None:  # the recipe's head: section (methods/head.py), after every step as when compressed
        head_skeleton(adapter, HeadEntry.from_json(head.get("plan"), f"{COMPRESSION_JSON} head"))


def _load(directory: Path, info: dict[str, Any], dtype: torch.dtype, offload: bool, device: torch.device,
          verify: bool) -> tuple[Any, Any]:
    from safetensors.torch import load_model
    from transformers import AutoModelForCausalLM

    from attnslim.modules import MODULES
    from attnslim.registry import lookup

    refuse_special_files(directory)
    files = _check_weights(directory, info, offload, verify)
    values = read_json(directory / "config.json", "config.json")
    if not isinstance(values, dict):
        raise AttnslimError("config.json is not a JSON object; re-create the directory with attnslim compress")
    check_config_sizes(values, files, directory / "config.json")
    values.pop("auto_map", None)
    base_type = values.pop(BASE_TYPE_KEY, values.get("model_type"))
    values["model_type"] = base_type
    config = _compat.config_from_dict(str(base_type), values)
    if offload:
        from accelerate import init_empty_weights

        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
            apply_skeletons(model, info["steps"], info.get("head"))
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        apply_skeletons(model, info["steps"], info.get("head"))
    for module in model.modules():
        kind = type(module)
        if kind.__module__.startswith("attnslim.") and kind.__name__ not in MODULES:
            lookup(MODULES, "module", kind.__name__)  # raises naming the unknown module
    if offload:
        from attnslim.adapters import get_adapter
        from attnslim.offload.dispatch import dispatch_layers

        adapter = get_adapter(model)
        adapter.refuse_offload()  # a family whose module names are not its checkpoint's
        dispatch_layers(model, adapter.decoder_layers(), directory, device, dtype)
    elif info["format_version"] >= SHARDED_VERSION:
        _load_shards(model, directory, sorted(info["weights_shards"]))
    else:
        load_model(model, str(directory / WEIGHTS), strict=True)
    # the base model's config: without it AutoTokenizer reads config.json as a bare config and warns that model
    # type "attnslim" is being instantiated as another type, at every load
    return model.eval(), load_tokenizer(directory, config=model.config)


def load_tokenizer(directory: Path, **kwargs: Any) -> Any:
    """The directory's tokenizer; damaged tokenizer files are an AttnslimError naming them."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, **kwargs, **_compat.SAFE_LOADING)
    except AttnslimError:
        raise
    except Exception as err:  # the tokenizers library raises plain Exception for a malformed tokenizer.json
        raise AttnslimError(f"{directory}: the tokenizer files are damaged ({type(err).__name__}: "
                            f"{first_line(err) or 'no detail'}); copy the model's own tokenizer files") from err


def _check_weights(directory: Path, info: dict[str, Any], offload: bool, verify: bool) -> list[Path]:
    """The weights files, each checked against compression.json's record (sizes, sha256, shard names)."""
    if info["format_version"] >= SHARDED_VERSION:
        from attnslim.offload import verify_shards

        record = info["weights_shards"]
        verify_shards(directory, record, verify)
        files = [directory / name for name in sorted(record)]
    else:
        files = [regular_file(directory / WEIGHTS, WEIGHTS)]
        expected = info.get("weights_sha256")
        if expected is not None and sha256_file(files[0]) != expected:
            raise AttnslimError(f"{WEIGHTS} does not match the sha256 recorded when it was saved (the file was "
                                "damaged or replaced); re-create the directory with attnslim compress")
    if offload:  # offloaded layers are read through the index, if any: it may name only the checked files
        from attnslim.offload import WeightSource

        if extra := sorted(set(WeightSource(directory).shards) - {f.name for f in files}):
            raise AttnslimError(f"{INDEX} names {extra[:3]}, which {COMPRESSION_JSON} does "
                                "not record (unchecked weights); re-create the directory with attnslim compress")
    return files


def _load_shards(model: Any, directory: Path, shards: list[str]) -> None:
    """Load the weight shards one at a time; every tensor of the model (tied ones once) must come from one."""
    from safetensors.torch import load_file

    needed = set(_deduplicated_state(model))
    loaded: set[str] = set()
    for shard in shards:
        state = load_file(str(directory / shard))
        unexpected = model.load_state_dict(state, strict=False).unexpected_keys
        if unexpected:
            raise AttnslimError(f"shard {shard} holds tensors the model does not have: {sorted(unexpected)[:5]}")
        loaded.update(state)
        del state
    if missing := sorted(needed - loaded):
        raise AttnslimError(f"no shard holds {missing[:5]} ({len(missing)} tensors missing)")

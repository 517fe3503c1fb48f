"""config.json's sizes checked against the weights actually present, before any model is built (issue 43, F6).

A model is built from its config before its weights are read, so a config that says 10^6 layers or an
intermediate size of 200,000 allocates (or, on the meta device, builds Python objects) without bound before any
weight could disagree. The tensor shapes in the safetensors headers cost a few KB to read; the sizes the config
may claim are bounded by them:
- every size field present (layers, hidden, intermediate, vocab, heads, head_dim, positions) is a positive integer;
- hidden_size, intermediate_size and vocab_size each equal some dimension of some stored tensor (they size the
  embedding, the projections and the MLP, so a real config always does);
- num_hidden_layers is at most one more than the largest decoder-layer index in the tensor names.
Directories without safetensors weights (.bin) get only the first check.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from attnslim.disk_format import INDEX, WEIGHTS
from attnslim.errors import AttnslimError
from attnslim.safe_files import read_json, regular_file

HEADER_LIMIT = 100 << 20  # bytes; safetensors itself refuses headers above 100 MB
POSITIVE = ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings")
MATCH_A_DIMENSION = ("hidden_size", "intermediate_size", "vocab_size")
_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)\.")
_FIX = "restore the model's own config.json (this one does not describe the weights beside it)"


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} from a safetensors file's header, read without reading the tensors."""
    regular_file(path, "weights file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if size < 8 or n > min(HEADER_LIMIT, size - 8):
            raise AttnslimError(f"{path} is not a safetensors file (its header length {n} does not fit its "
                                f"{size} bytes); copy the real weights file")
        raw = f.read(n)
    try:
        header = json.loads(raw)
        return {k: tuple(int(d) for d in v["shape"]) for k, v in header.items() if k != "__metadata__"}
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        raise AttnslimError(f"{path} is not a safetensors file (damaged header); copy the real weights file") from None


def hf_weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a Hugging Face directory: the shards its index names (plain file names), else
    model.safetensors; [] when it has neither."""
    index = directory / INDEX
    if index.exists():
        value = read_json(index, "weights index", fix="copy the complete checkpoint")
        weight_map = value.get("weight_map") if isinstance(value, dict) else None
        if not isinstance(weight_map, dict):
            raise AttnslimError(f"{index} has no weight_map; copy the complete checkpoint")
        files = [plain_file(directory, str(name)) for name in sorted(set(map(str, weight_map.values())))]
        for path in files:
            if not path.exists():
                raise AttnslimError(f"{directory}: shard {path.name} is missing (the checkpoint names it); copy the "
                                    "complete checkpoint")
        return files
    single = directory / WEIGHTS
    return [single] if single.exists() or single.is_symlink() else []


def plain_file(directory: Path, name: str) -> Path:
    """`directory/name` for a weights file name taken from an index: a plain file name, not a path (absolute or
    with `..`). A link may lead elsewhere: Hugging Face snapshot directories link every file into ../../blobs."""
    if "/" in name or "\\" in name or name in ("", ".", ".."):
        raise AttnslimError(f"{directory}: the index names weights file {name!r}, a path rather than a file of the "
                            "directory; copy the complete checkpoint")
    return directory / name


def check_config_sizes(config: dict[str, Any], files: list[Path], where: Path) -> None:
    """Refuse a config whose sizes are not positive integers or that the weights in `files` cannot back."""
    for key in POSITIVE:
        for value in _values(config.get(key)):
            if type(value) is not int or value <= 0:
                raise AttnslimError(f"{where}: config.json {key} is {value!r}, not a positive integer; {_FIX}")
    if not files:
        return
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        shapes.update(safetensors_shapes(path))
    dims = {d for shape in shapes.values() for d in shape}
    for key in MATCH_A_DIMENSION:
        for value in _values(config.get(key)):
            if value not in dims:
                raise AttnslimError(f"{where}: config.json says {key} {value:,}, but no tensor in the weights has "
                                    f"a dimension of that size; {_FIX}")
    layers = {int(m[1]) for name in shapes if (m := _LAYER.search(name))}
    wanted = config.get("num_hidden_layers")
    if layers and isinstance(wanted, int) and wanted > max(layers) + 1:
        raise AttnslimError(f"{where}: config.json says num_hidden_layers {wanted:,}, but the weights hold layers "
                            f"0-{max(layers)} only; {_FIX}")


def _values(value: object) -> list[object]:
    """A size field's values: none when absent or null, each item of a per-layer list."""
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]

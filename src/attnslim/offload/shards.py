"""Sharded safetensors outputs: names, the Hugging Face index, and per-shard checksums.

An offloaded compression writes one shard per decoder layer and one for everything outside them, as it goes, so
the compressed model is never whole in memory. compression.json records each shard's size and sha256. Loading
checks every size (a truncated or missing shard is named) and a shard's full sha256 only once per file: a stamp
(inode, mtime, size) in `VERIFIED` records that it passed, so a 16 GB model is not re-read on every load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from attnslim.checksum import sha256_file
from attnslim.errors import AttnslimError

INDEX = "model.safetensors.index.json"
VERIFIED = ".attnslim-verified.json"  # shard -> [inode, mtime_ns, size] when its sha256 last matched


def shard_name(k: int, n: int) -> str:
    """The k-th of n shards (1-based), named as Hugging Face names them."""
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    try:
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    except OSError as err:
        raise AttnslimError(f"could not write {path} ({err.strerror or err}); free disk space or choose another "
                            "--out") from err


def write_index(directory: Path, weight_map: dict[str, str]) -> None:
    total = sum((directory / shard).stat().st_size for shard in set(weight_map.values()))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX).write_text(json.dumps(index, indent=1))


def record_shards(directory: Path, shards: list[str]) -> dict[str, dict[str, Any]]:
    """{shard: {"size", "sha256"}} of the written shards, for compression.json."""
    return {s: {"size": (directory / s).stat().st_size, "sha256": sha256_file(directory / s)} for s in shards}


def verify_shards(directory: Path, record: dict[str, dict[str, Any]]) -> None:
    """Raise naming the first missing, truncated or altered shard; hash each shard fully once per file identity."""
    stamps = _read_stamps(directory)
    changed = False
    for shard, expected in sorted(record.items()):
        path = directory / shard
        if not path.is_file():
            raise AttnslimError(f"shard {shard} is missing; re-create the directory with attnslim compress")
        identity = _identity(path)
        if identity[2] != expected["size"]:
            raise AttnslimError(f"shard {shard} has {identity[2]} bytes, {expected['size']} were written (truncated "
                                "or replaced); re-create the directory with attnslim compress")
        if stamps.get(shard) == identity:
            continue
        if sha256_file(path) != expected["sha256"]:
            raise AttnslimError(f"shard {shard} does not match the sha256 recorded when it was saved (damaged or "
                                "replaced); re-create the directory with attnslim compress")
        stamps[shard], changed = identity, True
    if changed:
        try:
            (directory / VERIFIED).write_text(json.dumps(stamps))
        except OSError:
            pass  # a read-only directory: the full check simply runs again next time


def _identity(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_ino, st.st_mtime_ns, st.st_size]


def _read_stamps(directory: Path) -> dict[str, list[int]]:
    try:
        value = json.loads((directory / VERIFIED).read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}

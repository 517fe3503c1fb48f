"""Sharded safetensors outputs: names, the Hugging Face index, and per-shard checksums.

An offloaded compression writes one shard per decoder layer and one for everything outside them, as it goes, so
the compressed model is never whole in memory. compression.json records each shard's size and sha256. Loading
checks every name and size (a truncated or missing shard is named) and each shard's sha256, in full unless a stamp
in the user's cache vouches for the unchanged file (attnslim.verify states the policy), so a 16 GB model is not
re-read on every load. Loading writes nothing into the model directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from attnslim.checksum import sha256_file
from attnslim.disk_format import COMPRESSION_JSON, INDEX
from attnslim.errors import AttnslimError
from attnslim.safe_files import write_text_atomic
from attnslim.verify import check_shard_names, matches_sha256, shard_file


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
    write_text_atomic(directory / INDEX, json.dumps(index, indent=1))


def record_shards(directory: Path, shards: list[str]) -> dict[str, dict[str, Any]]:
    """{shard: {"size", "sha256"}} of the written shards, for compression.json."""
    return {s: {"size": (directory / s).stat().st_size, "sha256": sha256_file(directory / s)} for s in shards}


def verify_shards(directory: Path, record: dict[str, dict[str, Any]], verify: bool = False) -> None:
    """Raise naming the first missing, truncated or altered shard (names, sizes and sha256 as compression.json
    records them; attnslim.verify says when a full hash is skipped and where its stamps live)."""
    check_shard_names(list(record), directory / COMPRESSION_JSON)
    for shard, expected in sorted(record.items()):
        if not (directory / shard).exists():
            raise AttnslimError(f"shard {shard} is missing; re-create the directory with attnslim compress")
        path = shard_file(directory, shard)
        size = path.stat().st_size
        if size != expected["size"]:
            raise AttnslimError(f"shard {shard} has {size} bytes, {expected['size']} were written (truncated "
                                "or replaced); re-create the directory with attnslim compress")
        if not matches_sha256(path, expected["sha256"], verify):
            raise AttnslimError(f"shard {shard} does not match the sha256 recorded when it was saved (damaged or "
                                "replaced); re-create the directory with attnslim compress")

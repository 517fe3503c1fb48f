"""The input checkpoint, read tensor by tensor through safetensors' memory-mapped `safe_open`.

A directory with `model.safetensors`, or `model.safetensors.index.json` and the shards it names. Every shard is
opened (its header read) when the source is created, so a missing or truncated shard is an error naming it before
any work; a tensor is read from disk only when `get` asks for it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

from attnslim.config_bounds import plain_file
from attnslim.disk_format import INDEX, WEIGHTS
from attnslim.errors import AttnslimError
from attnslim.safe_files import read_json


class WeightSource:
    """name -> tensor of a safetensors checkpoint on disk. Files are opened (memory-mapped) only for the duration
    of one `read`: a mapping kept open would keep every page read so far resident, so RSS would grow with depth."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        self.directory = directory
        self.shards: list[str] = []
        self.where: dict[str, str] = {}  # tensor name -> shard file name
        for shard, names in _shard_plan(directory).items():
            path = plain_file(directory, shard)  # a name from the index: no path, no link leading out
            if not path.is_file():
                raise AttnslimError(f"{directory}: shard {shard} is missing (the checkpoint names it); copy the "
                                    "complete checkpoint")
            try:
                with safe_open(str(path), framework="pt", device="cpu") as handle:
                    keys = set(handle.keys())  # noqa: SIM118 - a safe_open handle, not a dict
            except Exception as err:  # safetensors raises its own error types for a bad header or short file
                raise AttnslimError(f"{directory}: shard {shard} is damaged or truncated ({type(err).__name__}: "
                                    f"{str(err)[:200]}); copy the complete checkpoint") from err
            for name in names if names is not None else keys:
                if name not in keys:
                    raise AttnslimError(f"{directory}: shard {shard} does not hold {name}, which the index puts "
                                        "there; the checkpoint is incomplete")
                self.where[name] = shard
            self.shards.append(shard)
            self._check_sizes(shard, path)

    def _check_sizes(self, shard: str, path: Path) -> None:
        """A file cut short after a complete header: the last tensor's end lies past the end of the file."""
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + header_len + end > path.stat().st_size:
            raise AttnslimError(f"{self.directory}: shard {shard} is truncated ({path.stat().st_size} bytes, its "
                                f"header needs {8 + header_len + end}); copy the complete checkpoint")

    def read(self, names: list[str], device: torch.device, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        """The tensors `names` (each one a checkpoint holds), copied to `device` in `dtype` (None: as stored), each
        file mapped once."""
        from safetensors import safe_open

        by_shard: dict[str, list[str]] = {}
        for name in names:
            by_shard.setdefault(self._shard_of(name), []).append(name)
        out = {}
        for shard, wanted in by_shard.items():
            with safe_open(str(self.directory / shard), framework="pt", device="cpu") as f:
                for name in wanted:
                    out[name] = f.get_tensor(name).to(device, dtype, copy=True)
        return out

    def _shard_of(self, name: str) -> str:
        if name not in self.where:
            raise AttnslimError(f"{self.directory}: the checkpoint has no tensor {name}; it is incomplete or of "
                                "another architecture than its config.json says")
        return self.where[name]

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def names(self) -> list[str]:
        return sorted(self.where)

    def first_of(self, names: Iterable[str]) -> str:
        """The first of `names` (tied names of one tensor) the checkpoint holds."""
        names = list(names)
        for name in names:
            if name in self.where:
                return name
        raise AttnslimError(f"{self.directory}: the checkpoint has none of {names}; it is incomplete or of another "
                            "architecture than its config.json says")

    def nbytes(self) -> int:
        return sum((self.directory / shard).stat().st_size for shard in self.shards)


def _shard_plan(directory: Path) -> dict[str, list[str] | None]:
    """shard file -> the tensor names the index puts in it (None: a single file, all its tensors)."""
    index = directory / INDEX
    if index.exists():
        value = read_json(index, "weights index", fix="copy the complete checkpoint")
        weight_map = value.get("weight_map") if isinstance(value, dict) else None
        if not isinstance(weight_map, dict):
            raise AttnslimError(f"{index} is damaged (no weight_map); copy the complete checkpoint")
        plan: dict[str, list[str] | None] = {}
        for name, shard in weight_map.items():
            names = plan.setdefault(str(shard), [])
            assert names is not None
            names.append(str(name))
        return plan
    if (directory / WEIGHTS).is_file():
        return {WEIGHTS: None}
    raise AttnslimError(f"{directory} holds neither {WEIGHTS} nor {INDEX}: --offload reads safetensors checkpoints "
                        "(convert .bin or GGUF weights to safetensors first)")

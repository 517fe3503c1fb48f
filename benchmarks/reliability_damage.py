"""Damaged copies of a compressed directory for benchmarks/reliability_probe.py (cases 156-192 of
../shared/reviews/reliability.md). Each builder takes the copy's path and damages it in place."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

WEIGHTS = "model.safetensors"


def _weights(d: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    tensors = load_file(str(d / WEIGHTS))
    edit(tensors)
    save_file(tensors, str(d / WEIGHTS), metadata={"format": "pt"})


def _json(d: Path, name: str, edit: Callable[[dict], object]) -> None:
    data = json.loads((d / name).read_text())
    out = edit(data)
    (d / name).write_text(json.dumps(data if out is None else out))


def _cut(d: Path, size: int | None = None, fraction: float | None = None) -> None:
    path = d / WEIGHTS
    data = path.read_bytes()
    path.write_bytes(data[: size if size is not None else int(len(data) * (fraction or 0))])


def _first_plan_entry(info: dict) -> dict:
    return next(iter(info["steps"][0]["plan"]["layers"].values()))


def _set_rank(info: dict, value: object) -> None:
    entry = _first_plan_entry(info)
    entry[next(iter(entry))] = value


def _add_gate(info: dict) -> None:
    entry = _first_plan_entry(info)
    entry["gate"] = next(iter(entry.values()))


def _header_length(d: Path) -> None:
    path = d / WEIGHTS
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", 10**15)
    path.write_bytes(bytes(data))


def _first_key(t: dict[str, torch.Tensor]) -> str:
    return sorted(t)[0]


DAMAGE: dict[str, Callable[[Path], None]] = {
    "156 model.safetensors cut to half": lambda d: _cut(d, fraction=0.5),
    "157 model.safetensors cut to 0 bytes": lambda d: _cut(d, size=0),
    "158 model.safetensors cut to 100 bytes": lambda d: _cut(d, size=100),
    "159 header length 10^15": _header_length,
    "160 model.safetensors deleted": lambda d: (d / WEIGHTS).unlink(),
    "161 one tensor key deleted": lambda d: _weights(d, lambda t: t.pop(_first_key(t))),
    "162 extra tensor key": lambda d: _weights(d, lambda t: t.update(extra=torch.zeros(3))),
    "163 one tensor with the wrong shape": lambda d: _weights(d, lambda t: t.update({_first_key(t): torch.zeros(3)})),
    "165 one tensor all NaN": lambda d: _weights(d, lambda t: t[_first_key(t)].fill_(float("nan"))),
    "171 compression.json {format_version} only": lambda d: _json(d, "compression.json",
                                                                 lambda i: {"format_version": i["format_version"]}),
    "172 steps removed": lambda d: _json(d, "compression.json", lambda i: i.pop("steps") and None),
    "177 plan rank 'os.system'": lambda d: _json(d, "compression.json", lambda i: _set_rank(i, "os.system")),
    "180 plan rank changed (230 -> 100)": lambda d: _json(d, "compression.json", lambda i: _set_rank(i, 100)),
    "182 plan adds gate": lambda d: _json(d, "compression.json", _add_gate),
    "185 config.json deleted": lambda d: (d / "config.json").unlink(),
    "188 model_type unknown": lambda d: _json(d, "config.json", lambda c: c.update(attnslim_base_model_type="nosuch")),
    "190 num_hidden_layers 2": lambda d: _json(d, "config.json", lambda c: c.update(num_hidden_layers=2)),
    "191 hidden_size 64": lambda d: _json(d, "config.json", lambda c: c.update(hidden_size=64)),
    "192 vocab_size 10^12": lambda d: _json(d, "config.json", lambda c: c.update(vocab_size=10**12)),
}
HOLDS = {"189 auto_map removed": lambda d: _json(d, "config.json", lambda c: c.pop("auto_map") and None)}

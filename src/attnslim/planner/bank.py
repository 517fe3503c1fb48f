"""The fitted modules the planner keeps between measuring a candidate and scoring whole plans, their weights on disk.

Measuring fits every `mla` width and `nbl` at every layer (measure.py); a whole plan is then scored with those same
modules installed (assemble.installed), without fitting again. Held in memory, the bank of a model would be about one
copy of its attention weights per ladder width on top of the model (six by default): the planner of an 8B model
would need several times its memory. So each module's own parameters go to one safetensors file in a private
temporary directory as soon as it is banked, and come back only while a whole plan that uses it runs that layer
(`on_call`): the planner holds the model, and one layer's candidates at a time.

Only a module's own parameters are spilled: a parameter it shares with the dense layer (the layer's own norm, which
`mla` keeps) stays where it is. Buffers stay in memory (rotary tables, key scales: small), and derived weights (MLA's
fused decode maps) are released, to be rebuilt from the parameters when used.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from attnslim.errors import AttnslimError
from attnslim.offload.store import release_derived

Key = tuple[int, str]  # (layer, candidate label)


class Bank:
    """Fitted (attention, pre-attention norm) per (layer, candidate label), weights spilled to disk while banked."""

    def __init__(self) -> None:
        try:
            self._dir = tempfile.TemporaryDirectory(prefix="attnslim-plan-")
        except OSError as err:
            raise AttnslimError(f"the planner keeps its fitted candidates in a temporary directory and cannot create "
                                f"one ({err}); set TMPDIR to a writable directory with free space") from err
        self._pairs: dict[Key, nn.ModuleDict] = {}  # {"attention": ..., "norm": ...}
        self._spilled: dict[Key, dict[str, tuple[torch.dtype, torch.device]]] = {}  # parameter name -> where
        self._filled: set[Key] = set()  # entries whose weights are in memory now

    def __contains__(self, key: Key) -> bool:
        return key in self._pairs

    def __len__(self) -> int:
        return len(self._pairs)

    def put(self, key: Key, attention: nn.Module, norm: nn.Module, shared: set[int]) -> None:
        """Bank the installed candidate of `key` and spill its parameters; `shared`: ids of the dense layer's
        parameters, which stay in memory (the candidate may hold some of them, e.g. the layer's own norm)."""
        pair = nn.ModuleDict({"attention": attention, "norm": norm})
        own = {name: p for name, p in pair.named_parameters() if id(p) not in shared}
        path = self._path(key)
        try:
            save_file({name: p.detach().to("cpu").contiguous() for name, p in own.items()}, str(path))
        except OSError as err:
            raise AttnslimError(f"the planner could not write its fitted candidate {key[1]} of layer {key[0]} to "
                                f"{path.parent} ({err}); set TMPDIR to a directory with more free space") from err
        self._pairs[key] = pair
        self._spilled[key] = {name: (p.dtype, p.device) for name, p in own.items()}
        self._spill(key)

    @contextmanager
    def on_call(self, key: Key) -> Iterator[tuple[nn.Module, nn.Module]]:
        """The banked modules of `key`, their weights read in only for each call: from the norm's call (it runs
        first in a pre-norm layer) to the end of the attention's. A whole plan installed this way holds one layer's
        candidate weights at a time, whatever the depth. Parameters are put back by name, so whatever replaced one
        meanwhile (an offloaded forward puts checkpoint-named parameters back on the meta device) is replaced in
        turn."""
        pair = self._pairs[key]
        hooks = [pair["norm"].register_forward_pre_hook(lambda *_: self._fill(key)),
                 pair["attention"].register_forward_pre_hook(lambda *_: self._fill(key)),
                 pair["attention"].register_forward_hook(lambda *_: self._spill(key))]
        try:
            yield pair["attention"], pair["norm"]
        finally:
            for h in hooks:
                h.remove()
            self._spill(key)

    def _fill(self, key: Key) -> None:
        if key in self._filled:
            return
        values = load_file(str(self._path(key)))
        self._set(key, {name: values[name].to(dev, dtype) for name, (dtype, dev) in self._spilled[key].items()})
        self._filled.add(key)

    def _spill(self, key: Key) -> None:
        self._set(key, {name: torch.empty(0, dtype=d, device=dev) for name, (d, dev) in self._spilled[key].items()})
        self._filled.discard(key)

    def disk_bytes(self) -> int:
        """Bytes the banked weights take on disk: what the bank would hold in memory otherwise."""
        return sum(self._path(key).stat().st_size for key in self._pairs)

    def close(self) -> None:
        """Remove the files (also done when the bank is garbage-collected)."""
        self._dir.cleanup()

    def _path(self, key: Key) -> Path:
        layer, label = key
        safe = "".join(ch if ch.isalnum() or ch in ".-" else "_" for ch in label)
        return Path(self._dir.name) / f"{layer}-{safe}.safetensors"

    def _set(self, key: Key, values: dict[str, torch.Tensor]) -> None:
        """Each named parameter of the entry becomes a new Parameter holding `values[name]` (an empty one frees
        its storage); derived weights (MLA's fused decode maps) are released with the old ones."""
        pair = self._pairs[key]
        release_derived(pair["attention"])
        for name, value in values.items():
            owner, _, leaf = name.rpartition(".")
            pair.get_submodule(owner)._parameters[leaf] = nn.Parameter(value, requires_grad=False)

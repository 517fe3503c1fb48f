"""`OffloadedLayers`: the model's weights stay on disk; one decoder layer at a time is in memory.

The model is a skeleton built under accelerate's `init_empty_weights` (every parameter on the meta device, buffers
real). `layer(i)` reads decoder layer i through safetensors' memory-mapped `safe_open` (from the input checkpoint,
or from the layer's output shard once a method converted it) onto the compute device in the compute dtype; on exit
a converted layer is written to its output shard, and the layer goes back to the meta device. `layer(j)` nests inside
`layer(i)` (j != i) for the other layers a conversion rewires (`Method.rewires`: LISA's donor). `streamed()` runs a
whole-model forward the same way, one decoder layer per forward hook, with the modules outside the layers
(embeddings, final norm; never the output head unless it is tied to them) in memory for its duration.
`finish()` writes the layers no method touched and the tensors outside the layers, so the output directory holds
every tensor, one shard per decoder layer plus one, and the model was never whole in memory.

Parameters tied to each other (lm_head and the embedding) stay one Parameter object through every read and release,
and are written once, under the first of their names in sorted order, as `attnslim.io.save` writes them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import torch
from torch import nn

from attnslim.disk_format import shard_name
from attnslim.errors import AttnslimError
from attnslim.offload.shards import write_index, write_shard
from attnslim.offload.source import WeightSource


def release_derived(module: nn.Module) -> None:
    """Drop the weights replacement modules derived from their parameters (MLA's fused decode weights), which
    would otherwise stay in memory after the parameters go back to disk: one layer's worth per layer run."""
    for sub in module.modules():
        release = getattr(sub, "release_derived", None)
        if callable(release):
            release()


class OffloadedLayers:
    """The `calib.residency.Residency` of a skeleton model whose weights are in `source` on disk."""

    offloaded = True

    def __init__(self, model: nn.Module, layers: nn.ModuleList, source: WeightSource, out_dir: Path,
                 device: torch.device | str = "cpu", skip: tuple[nn.Module, ...] = ()) -> None:
        self.model, self.layers, self.source, self.out_dir = model, layers, source, out_dir
        self.device = torch.device(device)
        self.prefix = _name_of(model, layers)
        self.n_shards = len(layers) + 1
        self.written: set[int] = set()  # layers whose current weights are in their output shard
        self.shard_keys: dict[int, set[str]] = {}  # the tensor names of each written layer's shard
        self.source_names = set(source.names())
        self.resident: set[int] = set()
        self.dirty: set[int] = set()
        skipped = tuple(_name_of(model, m) + "." for m in skip)
        # what a whole-model forward needs besides the layers: not the head (unless tied to the embedding)
        self.outside = [g for g in self.outside_all() if not all(n.startswith(skipped) for n in g)]
        self._check_complete()

    # --- the Residency verbs ------------------------------------------------------------------------------
    @contextmanager
    def layer(self, i: int) -> Iterator[None]:
        self._load_layer(i)
        try:
            yield
            if i in self.dirty:
                self._write_layer(i)
        finally:
            self._release(self._layer_prefix(i), self.layers[i])
            self.resident.discard(i)
            self.dirty.discard(i)

    def converted(self, i: int) -> None:
        self.dirty.add(i)

    @contextmanager
    def streamed(self, keep: frozenset[int] = frozenset()) -> Iterator[None]:
        """`keep`: layers being worked on inside `layer(i)` (the planner scoring a candidate of layer i from layer
        i on), which the forward uses as they are and leaves in memory."""
        if missing := sorted(set(keep) - self.resident):
            raise AttnslimError(f"internal: streamed(keep={sorted(keep)}) but layers {missing} are not in memory")
        self._fill(self.outside)
        handles = []
        for i, block in enumerate(self.layers):
            if i in keep:
                continue
            handles.append(block.register_forward_pre_hook(lambda m, a, i=i: self._load_layer(i)))
            handles.append(block.register_forward_hook(lambda m, a, o, i=i: self._release_layer(i)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            for i in sorted(self.resident - set(keep)):
                self._release_layer(i)
            for group in self.outside:
                self._assign(group, _meta_like(self.model.get_parameter(group[0])))

    def layer_in_stream(self, i: int) -> AbstractContextManager[None]:
        """Layer i read in for work on its own weights inside `streamed()` (a probe's trial conversion): a module
        the work puts in stays in memory through the forwards, the rest of the layer comes and goes with them."""
        return self.layer(i)

    # --- output ----------------------------------------------------------------------------------------------
    def finish(self) -> list[str]:
        """Write every layer not yet written and the tensors outside the layers; the index; returns the shards."""
        for i in range(len(self.layers)):
            if i not in self.written:
                self._load_layer(i)
                self._write_layer(i)
                self._release_layer(i)
        groups = self.outside_all()
        state = dict(zip([g[0] for g in groups], self._read_source(groups), strict=True))
        for name, buf in self.model.state_dict().items():
            if not name.startswith(self.prefix + ".") and name not in state and _is_buffer(self.model, name):
                state[name] = buf
        rest = shard_name(self.n_shards, self.n_shards)
        write_shard(self.out_dir / rest, state)
        weight_map = {name: rest for name in state}
        from safetensors import safe_open

        for i in range(len(self.layers)):
            shard = shard_name(i + 1, self.n_shards)
            with safe_open(str(self.out_dir / shard), framework="pt") as f:
                weight_map.update({name: shard for name in f.keys()})  # noqa: SIM118 - a safe_open handle
        write_index(self.out_dir, weight_map)
        return sorted(set(weight_map.values()))

    def outside_all(self) -> list[list[str]]:
        """Every tied group of parameters outside the decoder layers, the output head included."""
        return [g for g in _tied_groups(self.model) if not g[0].startswith(self.prefix + ".")]

    # --- internals -------------------------------------------------------------------------------------------
    def _layer_prefix(self, i: int) -> str:
        return f"{self.prefix}.{i}."

    def _load_layer(self, i: int) -> None:
        """Read layer i's offloaded (meta) parameters; parameters already in memory are a module a method put
        there for a whole-model forward (nbl's probe trial) and stay as they are."""
        if i in self.resident:
            return
        prefix = self._layer_prefix(i)
        groups = [g for g in _tied_groups(self.layers[i], prefix) if self.model.get_parameter(g[0]).is_meta]
        if i in self.written:
            from safetensors import safe_open

            with safe_open(str(self.out_dir / shard_name(i + 1, self.n_shards)), framework="pt") as f:
                for group in groups:
                    dtype = self.model.get_parameter(group[0]).dtype
                    name = next((n for n in group if n in f.keys()), group[0])  # noqa: SIM118
                    self._assign(group, f.get_tensor(name).to(self.device, dtype, copy=True))
        else:
            self._fill(groups)
        self.resident.add(i)

    def _release_layer(self, i: int) -> None:
        """After a whole-model forward's use of layer i: what can be read again (from the layer's output shard,
        or the input checkpoint) goes back to disk; a module a method put in for the forward stays in memory."""
        if i in self.dirty:
            raise AttnslimError(f"internal: layer {i} was converted inside a whole-model forward")
        saved = self.shard_keys[i] if i in self.written else self.source_names
        self._release(self._layer_prefix(i), self.layers[i], saved)
        self.resident.discard(i)

    def _release(self, prefix: str, module: nn.Module, saved: set[str] | None = None) -> None:
        """Every parameter of `module` back to the meta device (only those named in `saved`, when given)."""
        release_derived(module)
        for group in _tied_groups(module, prefix):
            if saved is None or any(n in saved for n in group):
                self._assign(group, _meta_like(self.model.get_parameter(group[0])))

    def _write_layer(self, i: int) -> None:
        prefix = self._layer_prefix(i)
        state = {}
        for group in _tied_groups(self.layers[i], prefix):
            state[group[0]] = self.model.get_parameter(group[0]).detach().to("cpu")
        for name, buf in self.layers[i].named_buffers(prefix=prefix[:-1]):
            if _is_buffer(self.model, name):
                state[name] = buf.detach().to("cpu")
        write_shard(self.out_dir / shard_name(i + 1, self.n_shards), state)
        self.written.add(i)
        self.shard_keys[i] = set(state)

    def _read_source(self, groups: list[list[str]]) -> list[torch.Tensor]:
        """One tensor per tied group from the input checkpoint, in the dtype of the group's (meta) parameter."""
        names = [self.source.first_of(g) for g in groups]
        dtypes = {self.model.get_parameter(g[0]).dtype for g in groups}
        values = {}
        for dtype in dtypes:
            wanted = [n for n, g in zip(names, groups, strict=True) if self.model.get_parameter(g[0]).dtype == dtype]
            values.update(self.source.read(wanted, self.device, dtype))
        return [values[n] for n in names]

    def _fill(self, groups: list[list[str]]) -> None:
        for group, value in zip(groups, self._read_source(groups), strict=True):
            self._assign(group, value)

    def _assign(self, group: list[str], value: torch.Tensor) -> None:
        """Put `value` under every name of a tied group, as one Parameter object."""
        old = self.model.get_parameter(group[0])
        if tuple(value.shape) != tuple(old.shape):
            raise AttnslimError(f"{group[0]}: the checkpoint holds shape {tuple(value.shape)}, the model built from "
                                f"config.json expects {tuple(old.shape)}; the checkpoint does not match its config")
        param = nn.Parameter(value, requires_grad=old.requires_grad)
        for name in group:
            owner, _, leaf = name.rpartition(".")
            self.model.get_submodule(owner)._parameters[leaf] = param

    def _check_complete(self) -> None:
        """Every parameter of the skeleton is in the checkpoint: a missing tensor is found before any work."""
        for group in _tied_groups(self.model):
            self.source.first_of(group)


def _name_of(model: nn.Module, module: nn.Module) -> str:
    for name, m in model.named_modules():
        if m is module:
            return name
    raise AttnslimError("internal: the decoder layers are not part of the model")


def _tied_groups(module: nn.Module, prefix: str = "") -> list[list[str]]:
    """Parameter names grouped by Parameter object (tied names together), each group and the list sorted."""
    groups: dict[int, list[str]] = {}
    for name, p in module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return sorted(sorted(g) for g in groups.values())


def _meta_like(p: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(p, device="meta")


def _is_buffer(model: nn.Module, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    return leaf in model.get_submodule(owner)._buffers

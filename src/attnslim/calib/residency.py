"""Where the weights of a decoder layer live while the pipeline works on it.

The pipeline brackets every piece of work on decoder layer i with `residency.layer(i)`, calls
`residency.converted(i)` after a method replaced something in it (the other layers a conversion rewires,
`Method.rewires`, are opened with `layer(j)` inside `layer(i)` and marked the same way), and runs whole-model
forwards (the runner's capture of layer 0's inputs, the KV-bytes measurement) inside `residency.streamed()`; work
on layer i's own weights during such a forward (a probe's trial conversion) goes inside `layer_in_stream(i)`. Two
implementations:

- `InMemoryLayers` (here): the whole model is in memory; where the work runs on the model's own device every verb
  is a no-op, on another device the layer (or, for `streamed`, the model) is moved there for the duration and back
  after.
- `attnslim.offload.OffloadedLayers`: weights stay in safetensors files on disk (memory-mapped); `layer(i)` reads
  layer i from the input checkpoint (or from its already-converted shard), and writes it back to its output shard
  when it was converted, then frees it.
Both run the same pipeline code on CPU and GPU. On a GPU, benchmarks/gpu.py's probe says which packaged recipes
run (BENCHMARKS "attnslim on a CUDA GPU").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Protocol

import torch
from torch import nn


class Residency(Protocol):
    device: torch.device
    offloaded: bool  # True when the weights are on disk (the model object is a skeleton)

    def layer(self, i: int) -> AbstractContextManager[None]: ...

    def converted(self, i: int) -> None: ...

    def streamed(self, keep: frozenset[int] = frozenset()) -> AbstractContextManager[None]: ...

    def layer_in_stream(self, i: int) -> AbstractContextManager[None]: ...


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are one ("cuda" and "cuda:0" are, where either leaves the index open)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


class InMemoryLayers:
    """The whole model in memory, where it was given (its home: the device of its first parameter); each layer's
    work runs on `device`, moved there and back home after when the two differ. A model on the GPU compressed on
    the GPU never moves (it used to be moved to CPU: benchmarks/gpu.py's probe found it)."""

    offloaded = False

    def __init__(self, model: nn.Module, layers: nn.ModuleList, device: torch.device | str = "cpu") -> None:
        self.model, self.layers, self.device = model, layers, torch.device(device)
        self.home = next(model.parameters()).device

    @property
    def _moves(self) -> bool:
        return not same_device(self.device, self.home)

    @contextmanager
    def layer(self, i: int) -> Iterator[None]:
        if not self._moves:
            yield
            return
        self.layers[i].to(self.device)
        try:
            yield
        finally:
            self.layers[i].to(self.home)

    def converted(self, i: int) -> None:
        """Nothing to do: the converted modules are already in the model."""

    @contextmanager
    def streamed(self, keep: frozenset[int] = frozenset()) -> Iterator[None]:
        """A whole-model forward on `device`: the model moves there for the duration (in place, ties kept). A model
        that fits in CPU memory but not on the device needs --offload. (`keep`: layers being worked on, in memory
        already, that an offloaded residency leaves there; nothing to do here.)"""
        if not self._moves:
            yield
            return
        self.model.to(self.device)
        try:
            yield
        finally:
            self.model.to(self.home)

    def layer_in_stream(self, i: int) -> AbstractContextManager[None]:
        """Nothing to do: inside `streamed()` every layer is already where the forward runs."""
        return nullcontext()

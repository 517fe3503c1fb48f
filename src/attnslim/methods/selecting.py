"""The layer-selecting capability: a step that decides from statistics of every candidate layer at once (which
layers to convert, or how much of the step's budget each gets) mixes `Selecting` into its `Method` and sets
`selects_layers` (a class constant, or a property where an option decides: latentllm's and mla's alloc=global).
The pipeline (pipeline/run.py) then collects the statistics of every candidate, hands each to `summarize` while the
layer is in memory, runs the probe where `probe_windows` asks for one (pipeline/probe.py), calls `plan` once, and
converts the chosen layers. Implemented by drop, nbl (ranking, probe), latentllm and mla (alloc=global spectra).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import ClassVar, Generic, TypeVar

from attnslim.adapters.base import Adapter
from attnslim.errors import AttnslimError

S = TypeVar("S")


class Selecting(Generic[S]):
    """The hooks a `selects_layers` method may override; the defaults read statistics only."""

    name: ClassVar[str]

    def summarize(self, adapter: Adapter, layer: int, stats: S) -> S:
        """`layer`'s statistics as `plan` (and, for a method that is not `sequential`, `convert`) will receive them.
        The pipeline calls it right after collecting them, while the layer's weights are in memory: a plan that
        reads the weights (not only the statistics) computes what it needs from them here, since with `--offload`
        they are on disk by the time `plan` runs. Default: `stats` unchanged."""
        return stats

    def probe_windows(self) -> int:
        """How many calibration windows the selection measures the loss on (0: it reads statistics only).
        Where > 0, the pipeline converts each candidate alone inside `trial`, records the calibration NLL
        increase as its "probe" score, and only then calls `plan`."""
        return 0

    def trial(self, adapter: Adapter, layer: int, stats: S) -> AbstractContextManager[None]:
        """A context in which `layer` is converted from `stats` as if chosen, undone on exit."""
        raise NotImplementedError(f"{self.name} does not measure its selection (probe_windows() is 0)")


def missing_summary(where: str, what: str) -> AttnslimError:
    """The refusal of a plan that needs what `Selecting.summarize` computes (`what`) but got raw statistics."""
    return AttnslimError(f"{where}: the plan needs {what}, which `summarize(adapter, layer, stats)` computes while "
                         "the layer is in memory; pass plan what it returns for each layer (the pipeline does)")

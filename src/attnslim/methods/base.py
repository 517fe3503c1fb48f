"""The method contract: a frozen dataclass of hyperparameters with four verbs.

    collector(adapter, layer) -> Collector     statistics it needs at one layer (streamed)
    plan(adapter, layers, stats) -> dict       pure, JSON-serialisable decisions (ranks, chosen layers, ...)
    convert(adapter, layer, entry, stats)      build and install the replacement modules (math in linalg/)
    skeleton(adapter, layer, entry)            the same modules, empty, so saved weights can load

Optionally `trains` + `train_step(model, tokenizer, teacher)`: after all its layers are converted, a step may train
its new parameters against `teacher`, a frozen copy of the model before the recipe's first step (api.compress; so a
later step also corrects what earlier steps lost), e.g. LISA's distillation, ATP's LoRA recovery.

`sequential` methods see the already-converted upstream layers when collecting statistics for a layer;
`selects_layers` methods need statistics of every candidate layer before deciding (e.g. NBL's ranking).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from torch import nn

from attnslim.adapters.base import Adapter
from attnslim.calib.stats import GramStats
from attnslim.errors import AttnslimError


class Collector:
    """Receives (site, activation) pairs during a layer's forward; `result()` gives the statistics."""

    sites: set[str] = set()

    def __call__(self, site: str, x: torch.Tensor) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def result(self) -> Any:
        raise NotImplementedError


class GramCollector(Collector):
    """Input Gram statistics at each requested site: {site: GramStats}."""

    def __init__(self, sites: set[str]) -> None:
        self.sites = set(sites)
        self.stats: dict[str, GramStats] = {}

    def __call__(self, site: str, x: torch.Tensor) -> None:
        self.stats.setdefault(site, GramStats.empty(x.shape[-1])).update(x)

    def result(self) -> dict[str, GramStats]:
        return self.stats


class NoStats(Collector):
    sites: set[str] = set()

    def __call__(self, site: str, x: torch.Tensor) -> None:
        pass

    def result(self) -> None:
        return None


@dataclass(frozen=True)
class Method:
    name: ClassVar[str] = ""
    sequential: ClassVar[bool] = True
    selects_layers: ClassVar[bool] = False

    def collector(self, adapter: Adapter, layer: int) -> Collector:
        return NoStats()

    def begin_step(self, adapter: Adapter, layers: list[int]) -> None:
        """Called once before a step converts `layers`, on the model as it enters the step (latentllm solves
        its total_ratio here). Default: nothing."""

    def plan(self, adapter: Adapter, layers: list[int], stats: dict[int, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def convert(self, adapter: Adapter, layer: int, entry: dict[str, Any], stats: Any) -> None:
        raise NotImplementedError

    def skeleton(self, adapter: Adapter, layer: int, entry: dict[str, Any]) -> None:
        raise NotImplementedError

    def probe_windows(self) -> int:
        """How many calibration windows the selection measures the loss on (0: it reads statistics only).
        Where > 0, the pipeline converts each candidate alone inside `trial`, records the calibration NLL
        increase as its "probe" score, and only then calls `plan`."""
        return 0

    def trial(self, adapter: Adapter, layer: int, stats: Any) -> AbstractContextManager[None]:
        """A context in which `layer` is converted from `stats` as if chosen, undone on exit."""
        raise NotImplementedError(f"{self.name} does not measure its selection (probe_windows() is 0)")

    def offload_problem(self) -> str | None:
        """Why this configuration cannot run with the weights offloaded (one decoder layer in memory at a time),
        or None. The pipeline holds only the layer being converted; a method whose conversion reaches another
        layer, or whose selection needs whole-model forwards with every candidate converted, says so here."""
        return None

    @property
    def trains(self) -> bool:
        """True when `train_step` must run after conversion (it then needs a teacher copy of the model)."""
        return False

    def train_step(self, model: Any, tokenizer: Any, teacher: Any, progress: bool = True) -> dict[str, Any]:
        raise NotImplementedError(f"method {self.name!r} does not train")

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> Method:
        valid = {f.name for f in fields(cls) if f.init}
        unknown = set(args) - valid
        if unknown:
            raise AttnslimError(
                f"method {cls.name!r}: unknown argument(s) {sorted(unknown)}; valid: {sorted(valid)}"
            )
        from attnslim.methods.argtypes import check_arg_types

        check_arg_types(cls.name, cls, args)
        return cls(**args)

    def args(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}


def require(cond: bool, method: str, key: str, value: Any, valid: str) -> None:
    """Validation helper for __post_init__: ValueError naming the key, the value and the valid range."""
    if not cond:
        raise AttnslimError(f"method {method!r}: {key}={value!r} is invalid; valid: {valid}")


def dense_linear(adapter: Adapter, layer: int, name: str, method: str) -> nn.Linear:
    """Layer `layer`'s linear `name` as the plain nn.Linear a factorising method starts from, or a refusal naming
    what an earlier step made of it."""
    lin = adapter.linear(layer, name)
    if not isinstance(lin, nn.Linear):
        raise AttnslimError(f"{method}: layer {layer} {name} is a {type(lin).__name__}, not a dense Linear (an earlier "
                            "step replaced it); leave this linear out of one of the two steps")
    return lin

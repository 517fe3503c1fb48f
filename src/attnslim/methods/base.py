"""The method contract: a frozen dataclass of hyperparameters with five verbs, typed by its plan entry E and its
per-layer statistics S (`Method[E, S]`).

    collector(adapter, layer) -> Collector[S]     statistics it needs at one layer (streamed)
    begin_step(adapter, layers) -> StepContext   step-wide numbers solved before planning (latentllm's κ)
    plan(adapter, layers, stats, context) -> StepPlan[E]
                                                 pure decisions (ranks, chosen layers, ...): typed entries that
                                                 round-trip through JSON (plan.py)
    convert(adapter, layer, entry, stats) -> Fit build and install the replacement modules (math in linalg/);
                                                 returns its fit diagnostics (JSON) or None; never edits the entry
    skeleton(adapter, layer, entry)              the same modules, empty, so saved weights can load

Optionally `trains` + `train_step(model, tokenizer, teacher)`: after all its layers are converted, a step may train
its new parameters against `teacher`, a frozen copy of the model before the recipe's first step (api.compress; so a
later step also corrects what earlier steps lost), e.g. LISA's distillation, ATP's LoRA recovery.

`sequential` methods see the already-converted upstream layers when collecting statistics for a layer;
`selects_layers` methods need statistics of every candidate layer before deciding (e.g. NBL's ranking).
A method with an output linear may mix in `OutputFits` (methods/output_fits.py): its options `refit_o` and
`local_steps` make the pipeline fit the converted attention to the original after each conversion (pipeline/).

`rewires(layer) -> list[int]`: the other decoder layers converting `layer` modifies (LISA's donor, layer n-1); the
pipeline holds them in memory around the conversion, so the method runs with the weights offloaded (`--offload`).
A `selects_layers` method mixes in `Selecting` (methods/selecting.py): `summarize`, and a selection measured on the
calibration loss (`probe_windows`, `trial`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, ClassVar, Generic, NamedTuple, TypeAlias, TypeVar, cast

from torch import nn

from attnslim.adapters.base import Adapter
from attnslim.errors import AttnslimError
from attnslim.methods.collect import Collector, NoStats
from attnslim.plan import JSON, LayerEntry, NoEntry, StepPlan

E = TypeVar("E", bound=LayerEntry)
S = TypeVar("S")
StepContext: TypeAlias = Mapping[str, float]  # step-wide numbers begin_step solved (latentllm: κ of total_ratio)
NO_CONTEXT: StepContext = MappingProxyType({})
Fit: TypeAlias = dict[str, JSON] | None  # what convert measured about its fit (recorded beside the entry)


class CalibrationNeed(NamedTuple):
    """What `Method.calibration_need` says a step needs of the calibration on a given model."""

    tokens: int  # the fewest calibration tokens (windows x seq_len)
    why: str  # the part of the method that needs them and its rule, for the log line


@dataclass(frozen=True)
class Method(Generic[E, S]):
    name: ClassVar[str] = ""
    entry_type: ClassVar[type[LayerEntry]] = NoEntry  # what `plan` puts per layer (read back by io's skeletons)
    sequential: ClassVar[bool] = True
    selects_layers: ClassVar[bool] = False  # True: the method mixes in Selecting (methods/selecting.py)
    later_args: ClassVar[tuple[str, ...]] = ()  # arguments added after benchmark rows were recorded (see `args`)

    def collector(self, adapter: Adapter, layer: int) -> Collector[S]:
        return cast(Collector[S], NoStats())  # methods that need no statistics (S = None)

    def begin_step(self, adapter: Adapter, layers: list[int]) -> StepContext:
        """Called once before a step converts `layers`, on the model as it enters the step; what it returns reaches
        every `plan` call of the step (latentllm solves its total_ratio here). Default: checks nothing, no
        context."""
        return NO_CONTEXT

    def plan(self, adapter: Adapter, layers: list[int], stats: Mapping[int, S],
             context: StepContext = NO_CONTEXT) -> StepPlan[E]:
        raise NotImplementedError

    def convert(self, adapter: Adapter, layer: int, entry: E, stats: S) -> Fit:
        raise NotImplementedError

    def skeleton(self, adapter: Adapter, layer: int, entry: E) -> None:
        raise NotImplementedError

    def read_plan(self, data: Mapping[str, JSON], where: str) -> StepPlan[E]:
        """A saved plan (compression.json) back as typed entries."""
        return StepPlan.from_json(data, cast(type[E], self.entry_type), where)

    def rewires(self, layer: int) -> list[int]:
        """The other decoder layers (never `layer` itself) that `convert` or `skeleton` of `layer` modifies, e.g. a
        receiver's donor that starts exporting its scores. The pipeline keeps them in memory around the conversion
        and writes them back as converted (calib/residency.py). Default: none."""
        return []

    def calibration_need(self, adapter: Adapter) -> CalibrationNeed | None:
        """The fewest calibration tokens this configuration needs on `adapter`'s model, when that depends on the
        model's sizes (mla's output refit: 24 tokens per input dimension of o_proj). `compress` raises the recipe's
        window count to meet it, with a log line, so one recipe serves models of any width. Default: none. Read only
        shapes (modules exist on the meta device with --offload)."""
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
        """Every argument, except those in `later_args` while at their default (as settings.HealConfig.to_dict):
        what a run records (compression.json) and benchmarks/common.resolved_fingerprint read, so stored rows stay
        current when a method gains an argument."""
        later = {f.name: f.default for f in fields(self) if f.name in self.later_args}
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.init and not (f.name in later and getattr(self, f.name) == later[f.name])}


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

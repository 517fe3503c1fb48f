"""A method step's plan: typed per-layer entries that round-trip through JSON.

`Method.plan` returns a `StepPlan`:
  layers  one `LayerEntry` per layer to convert: the decisions `convert` and `skeleton` need (ranks, the donor
          layer, the map's input, ...), a frozen dataclass per method;
  info    step-wide decisions a person reads but no module needs (NBL's scores, drop's importance, LISA's
          chains, a training log);
  fits    what `convert` returned for each layer (fit diagnostics), recorded by the pipeline.
`to_json` is what compression.json stores under a step's "plan" (the entry's fields, its "fit" beside them, the
info keys beside "layers"); `from_json` reads it back when `attnslim.load` re-creates the modules, and refuses an
entry whose fields do not match the method's, naming the layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Generic, TypeAlias, TypeVar

from attnslim.errors import AttnslimError

JSON: TypeAlias = "str | int | float | bool | None | list[JSON] | dict[str, JSON]"
FIT_KEY = "fit"  # where a layer's fit diagnostics sit beside its entry's fields


@dataclass(frozen=True)
class LayerEntry:
    """One layer's decisions. Subclasses declare typed fields of JSON values; a subclass whose JSON form is not
    its fields (e.g. a mapping of linear -> rank) overrides `to_json` and `from_json` together."""

    def to_json(self) -> dict[str, JSON]:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, JSON], where: str) -> LayerEntry:
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        unknown, missing = sorted(set(data) - names), sorted(required - set(data))
        if unknown or missing:
            raise AttnslimError(f"{where}: the plan entry {dict(data)} does not fit {cls.__name__} (unknown keys "
                                f"{unknown}, missing {missing}); it was written by another attnslim version or "
                                "edited: re-create the output with attnslim compress")
        return cls(**data)


def _plain(value: object) -> JSON:
    """A field value as JSON (tuples become lists)."""
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, str | int | float | bool):
        return value
    raise TypeError(f"plan entries hold JSON values only, not {type(value).__name__}")


def layer_index(key: object, where: str) -> int:
    """A saved plan's layer key as an index: only ASCII digits ("0", "12"). "-1" (Python's last layer), "abc",
    " 3" and non-ASCII digits are refused, never reinterpreted. The one rule shared by `attnslim.load` and the
    serving plan reader (serving/plan.py, which runs inside vLLM), so both accept exactly the same plans; whether
    the index is inside the model is checked where the layer count is known."""
    if not (isinstance(key, str) and key.isascii() and key.isdigit()):
        raise AttnslimError(f"{where}: plan layer {key!r} is not a layer index (0, 1, 2, ...); the file was edited "
                            "or damaged: re-create the output with attnslim compress")
    return int(key)


E = TypeVar("E", bound=LayerEntry)


@dataclass
class StepPlan(Generic[E]):
    layers: dict[int, E] = field(default_factory=dict)
    info: dict[str, JSON] = field(default_factory=dict)
    fits: dict[int, dict[str, JSON]] = field(default_factory=dict)

    def merge(self, part: StepPlan[E], layer: int) -> None:
        """Add a one-layer plan of a sequential step: its entries, and its info keyed by the layer."""
        self.layers.update(part.layers)
        self.fits.update(part.fits)
        for key, value in part.info.items():
            per_layer = self.info.setdefault(key, {})
            assert isinstance(per_layer, dict)
            per_layer[str(layer)] = value

    def record(self, layer: int, fit: dict[str, JSON] | None) -> None:
        """Keep what `convert` reported for `layer` (nothing when it reported nothing)."""
        if fit:
            self.fits[layer] = fit

    def to_json(self) -> dict[str, JSON]:
        layers: dict[str, JSON] = {}
        for i in sorted(self.layers):
            fit = self.fits.get(i)
            layers[str(i)] = self.layers[i].to_json() | ({FIT_KEY: fit} if fit else {})
        return {"layers": layers, **self.info}

    @staticmethod
    def from_json(data: Mapping[str, JSON], entry_type: type[E], where: str) -> StepPlan[E]:
        raw = data.get("layers")
        if not isinstance(raw, dict):
            raise AttnslimError(f"{where}: the plan has no 'layers' mapping; re-create the output with attnslim "
                                "compress")
        plan: StepPlan[E] = StepPlan(info={k: v for k, v in data.items() if k != "layers"})
        for key, entry in raw.items():
            index = layer_index(key, where)
            if not isinstance(entry, dict):
                raise AttnslimError(f"{where}: plan layer {key!r} -> {entry!r} is not a layer's entry (a JSON "
                                    "object); re-create the output with attnslim compress")
            body = {k: v for k, v in entry.items() if k != FIT_KEY}
            parsed = entry_type.from_json(body, f"{where} layer {key}")
            assert isinstance(parsed, entry_type)
            plan.layers[index] = parsed
            fit = entry.get(FIT_KEY)
            if isinstance(fit, dict):
                plan.fits[index] = fit
        return plan


@dataclass(frozen=True)
class NoEntry(LayerEntry):
    """A layer's entry when the method decides nothing per layer (drop: the layer is removed)."""

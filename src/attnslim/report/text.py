"""Readable text for compression.json values: numbers, argument lists, and a step's plan as a per-layer table.

Nothing here prints a Python repr: nested dicts become table columns ("ranks q"), lists become comma lists,
booleans yes/no, missing values a dash.
"""

from __future__ import annotations

import math
from typing import Any

DASH = "—"


def fmt(value: Any) -> str:
    """One value as text: 1,234 / 0.6250 → 0.625 / 1.19e+07 / ∞ / yes / q, k, v / —."""
    if value is None:
        return DASH
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return fmt_float(value)
    if isinstance(value, list | tuple):
        items = [f"({fmt(v)})" if isinstance(v, list | tuple) else fmt(v) for v in value[:12]]
        more = f", … ({len(value)} values)" if len(value) > 12 else ""
        return ("; " if any("," in i for i in items) else ", ").join(items) + more
    if isinstance(value, dict):
        return ", ".join(f"{label(k)} {fmt(v)}" for k, v in flatten(value).items())
    return str(value)


def fmt_float(v: float) -> str:
    if not math.isfinite(v):
        return "nan" if math.isnan(v) else ("∞" if v > 0 else "-∞")
    if v.is_integer() and abs(v) < 1e15:
        return f"{int(v):,}"
    if abs(v) >= 1e5 or abs(v) < 1e-3:
        return f"{v:.3g}"
    return f"{v:.4g}"


def label(key: str) -> str:
    return str(key).replace("_", " ")


def flatten(value: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"ranks": {"q": 24}, "input": "normed"} → {"ranks q": 24, "input": "normed"}."""
    out: dict[str, Any] = {}
    for key, v in value.items():
        name = f"{prefix} {label(key)}".strip()
        if isinstance(v, dict) and v:
            out.update(flatten(v, name))
        else:
            out[name] = v
    return out


def args_text(args: dict[str, Any]) -> str:
    """A method's arguments as one line, unset (None) ones left out: "ratio 0.8 · linears q, k, v, o"."""
    return " · ".join(f"{k} {fmt(v)}" for k, v in args.items() if v is not None) or "defaults"


def layer_ranges(layers: list[int]) -> str:
    """[0, 1, 2, 3, 7] → "0–3, 7"."""
    out: list[str] = []
    for i in sorted(set(layers)):
        if out and out[-1].split("–")[-1] == str(i - 1):
            out[-1] = f"{out[-1].split('–')[0]}–{i}"
        else:
            out.append(str(i))
    return ", ".join(out) or "none"


def _layer_keyed(value: Any) -> bool:
    return isinstance(value, dict) and bool(value) and all(str(k).lstrip("-").isdigit() for k in value)


def _per_layer(plan: dict[str, Any], prefix: str = "") -> tuple[dict[str, dict[int, Any]], dict[str, Any]]:
    """Plan values keyed by layer, as {column: {layer: value}}, and the rest (global decisions) by name."""
    columns: dict[str, dict[int, Any]] = {}
    rest: dict[str, Any] = {}
    for key, value in plan.items():
        name = f"{prefix} {label(key)}".strip()
        if _layer_keyed(value):
            for layer, entry in value.items():
                cells = flatten(entry, name) if isinstance(entry, dict) else {name: entry}
                for column, v in cells.items():
                    columns.setdefault(column, {})[int(layer)] = v
        elif isinstance(value, dict) and value:
            sub_columns, sub_rest = _per_layer(value, name)
            columns.update(sub_columns)
            rest.update(sub_rest)
        else:
            rest[name] = value
    return columns, rest


def plan_table(plan: dict[str, Any]) -> tuple[list[str], list[list[str]], list[str]]:
    """(header, rows, notes) of a step's plan: one row per layer the plan mentions, one column per decision or
    score; a non-numeric column equal on every row becomes a note ("same for every layer: …") to keep the table
    narrow."""
    converted = sorted(int(k) for k in plan.get("layers", {}))
    entries = {int(k): flatten(v) if isinstance(v, dict) else {"decision": v}
               for k, v in plan.get("layers", {}).items()}
    columns: dict[str, dict[int, Any]] = {}
    for layer, cells in entries.items():
        for column, v in cells.items():
            columns.setdefault(column, {})[layer] = v
    others, _ = _per_layer({k: v for k, v in plan.items() if k not in ("layers", "training")})
    columns.update(others)
    layers = sorted({*converted, *(i for c in columns.values() for i in c)})
    notes = []
    if len(layers) > 1:
        for column, by_layer in list(columns.items()):
            shown = {fmt(by_layer.get(i)) for i in layers}
            numeric = any(isinstance(v, int | float) and not isinstance(v, bool) for v in by_layer.values())
            if len(shown) == 1 and len(by_layer) == len(layers) and not numeric:
                notes.append(f"{column} {shown.pop()}")
                del columns[column]
    header = ["layer", *(["converted"] if layers != converted else []), *columns]
    rows = [[str(i), *(["yes" if i in converted else "no"] if layers != converted else []),
             *(fmt(c[i]) if i in c else "" for c in columns.values())] for i in layers]
    return header, rows, (["Same for every layer: " + "; ".join(notes)] if notes else [])


def plan_notes(plan: dict[str, Any]) -> list[tuple[str, str]]:
    """The plan's decisions that are not per layer (criterion, chosen layers, sharing chains), as (name, text)."""
    _, rest = _per_layer({k: v for k, v in plan.items() if k not in ("layers", "training")})
    return [(name, fmt(v)) for name, v in rest.items()]


def summary_pairs(report: dict[str, Any], skip: tuple[str, ...] = ("history",)) -> list[tuple[str, str]]:
    """A training/heal report as (name, text) pairs, nested settings flattened, long histories left out."""
    kept = {k: v for k, v in report.items() if k not in skip}
    return [(name, fmt(v)) for name, v in flatten(kept).items()]

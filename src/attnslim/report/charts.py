"""The report's plots, built from compression.json alone: per-layer decisions of each step, selection scores,
compressed/dense ratios of the measured metrics, KV bytes against perplexity, KV bytes per layer, the heal's KL."""

from __future__ import annotations

import math
from typing import Any

from attnslim.report.facts import better, kind, ratio
from attnslim.report.svg import bar_chart, line_chart, ratio_chart


def _numeric_decisions(layers: dict[str, Any]) -> dict[str, list[tuple[float, float]]]:
    """{name: [(layer, value)]} for every numeric field of the per-layer plan entries (ranks, widths, ...)."""
    series: dict[str, list[tuple[float, float]]] = {}
    for key, entry in layers.items():
        if not isinstance(entry, dict):
            continue
        for name, value in entry.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                series.setdefault(name, []).append((float(key), float(value)))
    return series


def step_charts(n: int, step: dict[str, Any]) -> list[str]:
    """Per-layer ranks/sizes of a step and, for selecting methods, each selection score per candidate layer."""
    out = []
    plan, label = step["plan"], f"Step {n + 1} ({step['method']})"
    decisions = _numeric_decisions(plan.get("layers", {}))
    if decisions and max(len(v) for v in decisions.values()) > 1:
        out.append(line_chart(f"{label}: per-layer decisions", dict(list(decisions.items())[:5]), "layer", "value"))
    scores = plan.get("scores")
    if isinstance(scores, dict):
        chosen = plan.get("chosen", [])
        for name, per_layer in scores.items():
            pts = [(float(k), float(v)) for k, v in per_layer.items()]
            title = f"{label}: {name} score per layer (chosen: {', '.join(map(str, chosen))})"
            out.append(line_chart(title, {name: pts}, "layer", name))
    return out


def metric_charts(info: dict[str, Any]) -> list[str]:
    """Compressed/dense ratio of every quality and speed metric on an axis around 1 (sizes have their own table:
    a halved cache on the same axis would flatten a 10% perplexity change), and KV bytes/token against ppl."""
    metrics = info.get("metrics") or {}
    rows = [(name, ratio(entry), better(name, entry)) for name, entry in metrics.items() if kind(name) != "size"]
    note = "dashed line: 1 = unchanged · green: better · red: worse"
    out = [ratio_chart("Compressed / dense, per metric", rows, note)] if rows else []
    ppl = next((k for k in metrics if "ppl" in k.lower()), None)
    if ppl is not None:
        kb, ka = info["kv_bytes_per_token_before"], info["kv_bytes_per_token_after"]
        series = {"dense": [(kb, metrics[ppl]["before"])], "compressed": [(ka, metrics[ppl]["after"])]}
        out.append(line_chart(f"KV bytes/token vs {ppl}", series, "KV bytes/token", ppl, x_from_zero=True))
    return out


def kv_layer_chart(info: dict[str, Any]) -> list[str]:
    """KV-cache bytes per token of each layer after compression, the dense layer's as a dashed line; a planned
    model's bars are labelled with what the planner chose for each layer (`compress --kv`: the plan's picture)."""
    per_layer = info.get("kv_bytes_per_layer_after")
    if not per_layer:
        return []
    dense = max(info.get("kv_bytes_per_layer_dense") or [0.0]) or None
    labels = [str(i) for i in range(len(per_layer))]
    title = "KV-cache bytes per token, per layer"
    chosen = [row.get("choice") for row in (info.get("planner") or {}).get("layers", [])]
    if len(chosen) == len(per_layer) and all(isinstance(c, str) for c in chosen):
        labels = [f"{i} {c}" for i, c in enumerate(chosen)]
        title += ", with the planner's choice for each layer"
    return [bar_chart(title, labels, [float(v) for v in per_layer], "bytes/token", reference=dense,
                      reference_label="dense" if dense else "")]


def heal_chart(heal: dict[str, Any] | None) -> list[str]:
    """The heal's distillation KL at every step."""
    history = [float(v) for v in (heal or {}).get("history", []) if math.isfinite(float(v))]
    if not history:
        return []
    return [line_chart("Heal: KL to the dense model per step", {"KL": [(float(i + 1), v) for i, v in
                                                                        enumerate(history)]}, "step", "KL")]

"""The report's plots, built from compression.json alone: per-layer decisions of each step, selection scores,
before/after ratios of the measured metrics, and KV bytes against perplexity."""

from __future__ import annotations

from typing import Any

from attnslim.report.svg import bar_chart, line_chart


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
    """Compressed/dense ratio of every measured metric (1 = unchanged), and KV bytes/token against wiki ppl."""
    metrics = info.get("metrics") or {}
    if not metrics:
        return []
    names = list(metrics)
    ratios = [metrics[k]["after"] / metrics[k]["before"] if metrics[k]["before"] else 0.0 for k in names]
    out = [bar_chart("Compressed / dense, per metric (dashed line: 1 = unchanged)", names, ratios, "ratio",
                     reference=1.0)]
    ppl = next((k for k in names if k.endswith("ppl")), None)
    if ppl is not None:
        kb, ka = info["kv_bytes_per_token_before"], info["kv_bytes_per_token_after"]
        series = {"dense": [(kb, metrics[ppl]["before"])], "compressed": [(ka, metrics[ppl]["after"])]}
        out.append(line_chart(f"KV bytes/token vs {ppl}", series, "KV bytes/token", ppl, x_from_zero=True))
    return out

"""`attnslim report DIR`: one self-contained HTML page (and Markdown) for a compressed model."""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any

from attnslim.io import read_compression_json
from attnslim.report.charts import metric_charts, step_charts
from attnslim.report.svg import bar_chart


def _rows_markdown(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _rows_html(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def sections(info: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) tables shared by the HTML and Markdown renderings."""
    before, after = info["params_before"], info["params_after"]
    size_rows = [[g, f"{before[g]:,}", f"{after[g]:,}", f"{after[g] / before[g]:.3f}"]
                 for g in ("attention", "mlp", "embedding", "total") if before.get(g)]
    kb, ka = info["kv_bytes_per_token_before"], info["kv_bytes_per_token_after"]
    size_rows.append(["KV bytes/token", f"{kb:,.0f}", f"{ka:,.0f}", f"{ka / kb:.3f}"])
    tables = [("Size", ["group", "before", "after", "kept"], size_rows)]
    metrics = info.get("metrics")
    if metrics:
        rows = [[k, f"{v['before']:.3f}", f"{v['after']:.3f}", f"{v['after'] / v['before']:.3f}"]
                for k, v in metrics.items()]
        tables.append(("Quality (same evaluation windows)", ["metric", "dense", "compressed", "ratio"], rows))
    for n, step in enumerate(info["steps"]):
        rows = [[k, ", ".join(f"{a}={b}" for a, b in v.items()) if isinstance(v, dict) else str(v)]
                for k, v in step["plan"]["layers"].items()]
        tables.append((f"Step {n + 1}: {step['method']} {step['args']}", ["layer", "decision"], rows))
    return tables


def render(directory: str | Path) -> tuple[str, str]:
    """(html, markdown) for a compressed directory."""
    info = read_compression_json(Path(directory))
    title = f"attnslim report: {info['recipe'].get('name')}"
    meta = [f"Recipe: {info['recipe'].get('description', '')}",
            f"Calibration: {info['calibration']['description']} ({info['calibration']['tokens']} tokens)",
            f"Compressed in {info['seconds']:.0f} s, peak RSS {info['peak_rss_mb']:.0f} MB; versions "
            + ", ".join(f"{k} {v}" for k, v in info.get("versions", {}).items())]
    if info.get("metrics_description"):
        meta.append(f"Evaluation: {info['metrics_description']}")
    tables = sections(info)
    md = [f"# {title}", "", *[m + "  " for m in meta], ""]
    html = [f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title><style>"
            "body{font-family:sans-serif;max-width:900px;margin:2em auto}table{border-collapse:collapse;margin:1em 0}"
            "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}</style></head><body>",
            f"<h1>{escape(title)}</h1>", *[f"<p>{escape(m)}</p>" for m in meta]]
    charts = metric_charts(info)
    per_layer = info.get("kv_bytes_per_layer_after")
    if per_layer:
        charts.append(bar_chart("KV-cache bytes per token, per layer", [str(i) for i in range(len(per_layer))],
                                per_layer, "bytes/token", reference=max(info.get("kv_bytes_per_layer_dense") or [0.0])))
    for n, step in enumerate(info["steps"]):
        charts += step_charts(n, step)
    for k, (name, header, rows) in enumerate(tables):
        md += [f"## {name}", "", _rows_markdown(header, rows), ""]
        html += [f"<h2>{escape(name)}</h2>", _rows_html(header, rows)]
        if k == len(tables) - len(info["steps"]) - 1:  # the plots go between the summary and the per-step tables
            html += ["<h2>Plots</h2>", *charts]
    html.append("</body></html>")
    return "\n".join(html), "\n".join(md)


def write_report(directory: str | Path) -> tuple[Path, Path]:
    html, md = render(directory)
    out_html, out_md = Path(directory) / "report.html", Path(directory) / "report.md"
    out_html.write_text(html)
    out_md.write_text(md)
    return out_html, out_md

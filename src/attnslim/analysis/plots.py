"""SVG figures of the analyses (`attnslim analyze --plot FILE.svg`): one page of charts per report."""

from __future__ import annotations

from typing import Any

from attnslim.report.svg import bar_chart, heat_map, line_chart


def linearity_figures(report: dict[str, Any]) -> list[str]:
    """Per-layer CCA bound (the paper's criterion) and the default criterion's score."""
    layers = report["layers"]
    labels = [str(r["layer"]) for r in layers]
    crit = report["default_criterion"]
    return [bar_chart("NBL: CCA bound per layer (lower = more linear)", labels, [r["cca"] for r in layers], "bound"),
            bar_chart(f"NBL: {crit} per layer (the default criterion)", labels, [r[crit] for r in layers], crit)]


def lowrank_figures(report: dict[str, Any]) -> list[str]:
    """Mean SVD-entropy rank ratio per site, one line per sequence length (the paper's Fig. 1)."""
    series = {}
    for length, entry in report["lengths"].items():
        sites = entry["sites"]
        series[f"L={length}"] = [(float(i), sites[s]["ratio"]["mean"]) for i, s in enumerate(sites)]
    return [line_chart("ATP: ⌈2^μ⌉/L per site (0 = embeddings, then attention inputs)", series, "site",
                       "rank ratio", x_from_zero=True)]


def similarity_figures(report: dict[str, Any]) -> list[str]:
    """Head-averaged JS divergence between every pair of layers, and adjacent-layer per-head matching."""
    out = [heat_map("LISA: head-averaged JS divergence between layers", report["js_matrix"], "0 = identical")]
    series = {name: [(float(i), float(v)) for i, v in enumerate(values)]
              for name, values in report["head_matching"].items()
              if name in ("direct", "random", "oracle", "global")}  # (layer i, JS of heads i vs i + 1)
    out.append(line_chart("LISA: per-head JS, layer i vs i+1, by head matching", series, "layer i", "JS"))
    return out


def sensitivity_figures(report: dict[str, Any]) -> list[str]:
    """NLL increase when one layer's attention is replaced (previous layer's scores, or uniform)."""
    return [line_chart(f"LISA: loss increase per layer ({sweep})",
                       {k: [(float(i), float(v)) for i, v in vals.items()] for k, vals in report[sweep].items()},
                       "layer", "nats/token") for sweep in ("single", "suffix") if sweep in report]


def conversion_figures(report: dict[str, Any]) -> list[str]:
    """KL at the last position when one layer alone is converted by the method."""
    costs = report["costs"]
    return [bar_chart(f"{report['method']}: last-position KL, one layer converted alone", list(costs),
                      [float(v) for v in costs.values()], "nats")]


FIGURES = {"linearity": linearity_figures, "lowrank": lowrank_figures, "similarity": similarity_figures,
           "sensitivity": sensitivity_figures, "conversion": conversion_figures}


def analysis_svg(what: str, report: dict[str, Any]) -> str:
    """One standalone SVG document stacking the figures of analysis `what`."""
    figures = FIGURES[what](report)
    y, width, body = 0.0, 0.0, []
    for fig in figures:
        w = float(fig.split('width="', 1)[1].split('"', 1)[0])
        h = float(fig.split('height="', 1)[1].split('"', 1)[0])
        body.append(f'<g transform="translate(0,{y:.0f})">{fig}</g>')
        y, width = y + h + 10, max(width, w)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{y:.0f}">' + "".join(body)
            + "</svg>")

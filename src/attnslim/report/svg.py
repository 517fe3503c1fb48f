"""Tiny dependency-free SVG charts (bar and line) for self-contained HTML reports."""

from __future__ import annotations

from html import escape

W, H, PAD = 640, 260, 48


def _frame(title: str, y_max: float, y_label: str) -> list[str]:
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
             f'font-size="11"><text x="{W / 2}" y="16" text-anchor="middle" font-size="13">{escape(title)}</text>',
             f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - 10}" y2="{H - PAD}" stroke="#333"/>',
             f'<line x1="{PAD}" y1="28" x2="{PAD}" y2="{H - PAD}" stroke="#333"/>',
             f'<text x="12" y="{H / 2}" transform="rotate(-90 12 {H / 2})" text-anchor="middle">'
             f'{escape(y_label)}</text>']
    for frac in (0.0, 0.5, 1.0):
        y = H - PAD - frac * (H - PAD - 28)
        parts.append(f'<text x="{PAD - 4}" y="{y + 4}" text-anchor="end">{y_max * frac:.3g}</text>')
    return parts


def bar_chart(title: str, labels: list[str], values: list[float], y_label: str = "",
              reference: float | None = None) -> str:
    y_max = max([*values, reference or 0.0, 1e-12])
    parts = _frame(title, y_max, y_label)
    n = max(len(values), 1)
    step = (W - PAD - 20) / n
    for i, (label, v) in enumerate(zip(labels, values, strict=True)):
        h = v / y_max * (H - PAD - 28)
        x = PAD + 4 + i * step
        parts.append(f'<rect x="{x:.1f}" y="{H - PAD - h:.1f}" width="{max(step - 3, 1):.1f}" height="{h:.1f}" '
                     f'fill="#4a7ab5"><title>{escape(label)}: {v:.4g}</title></rect>')
        if n <= 40:
            parts.append(f'<text x="{x + step / 2:.1f}" y="{H - PAD + 14}" text-anchor="middle">{escape(label)}</text>')
    if reference is not None:
        y = H - PAD - reference / y_max * (H - PAD - 28)
        parts.append(f'<line x1="{PAD}" y1="{y:.1f}" x2="{W - 10}" y2="{y:.1f}" stroke="#c33" stroke-dasharray="4"/>')
    return "".join(parts) + "</svg>"


def line_chart(title: str, series: dict[str, list[tuple[float, float]]], x_label: str, y_label: str,
               x_from_zero: bool = False) -> str:
    points = [p for s in series.values() for p in s] or [(0.0, 0.0)]
    x_min, x_max = min(p[0] for p in points), max(p[0] for p in points)
    x_min = min(x_min, 0.0) if x_from_zero else x_min
    y_max = max(p[1] for p in points) or 1.0
    parts = _frame(title, y_max, y_label)
    parts.append(f'<text x="{W / 2}" y="{H - 8}" text-anchor="middle">{escape(x_label)}</text>')
    for x, anchor in ((x_min, "start"), (x_max, "end")):
        parts.append(f'<text x="{PAD if anchor == "start" else W - 20}" y="{H - PAD + 14}" text-anchor="{anchor}">'
                     f'{x:.4g}</text>')
    colors = ["#4a7ab5", "#c33", "#3a3", "#a6c", "#e90"]
    span = (x_max - x_min) or 1.0
    for k, (name, pts) in enumerate(series.items()):
        coords = [(PAD + (x - x_min) / span * (W - PAD - 20), H - PAD - y / y_max * (H - PAD - 28))
                  for x, y in sorted(pts)]
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)
        color = colors[k % len(colors)]
        parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        parts += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>' for x, y in coords]
        parts.append(f'<text x="{W - 120}" y="{34 + 14 * k}" fill="{color}">{escape(name)}</text>')
    return "".join(parts) + "</svg>"


def heat_map(title: str, matrix: list[list[float]], label: str = "") -> str:
    """A square matrix as cells shaded white (0) -> dark blue (max); row/column index = layer."""
    n = max(len(matrix), 1)
    v_max = max([v for row in matrix for v in row] or [1.0]) or 1.0
    size = min((W - 2 * PAD) / n, (H * 2 - 2 * PAD) / n)
    side = 2 * PAD + n * size
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{side:.0f}" height="{side + 20:.0f}" '
             f'font-family="sans-serif" font-size="10"><text x="{side / 2:.0f}" y="16" text-anchor="middle" '
             f'font-size="13">{escape(title)} (max {v_max:.3g}{", " + escape(label) if label else ""})</text>']
    for i, row in enumerate(matrix):
        for j, v in enumerate(row):
            t = max(0.0, min(1.0, v / v_max))
            rgb = (int(255 - 181 * t), int(255 - 133 * t), int(255 - 74 * t))  # white -> #4a7ab5
            parts.append(f'<rect x="{PAD + j * size:.1f}" y="{PAD + i * size:.1f}" width="{size:.1f}" '
                         f'height="{size:.1f}" fill="rgb{rgb}"><title>{i}, {j}: {v:.4g}</title></rect>')
        if n <= 40 and i % max(1, n // 10) == 0:
            parts.append(f'<text x="{PAD - 4}" y="{PAD + (i + 0.7) * size:.1f}" text-anchor="end">{i}</text>')
            parts.append(f'<text x="{PAD + (i + 0.5) * size:.1f}" y="{PAD - 4}" text-anchor="middle">{i}</text>')
    return "".join(parts) + "</svg>"

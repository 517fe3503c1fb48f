"""Tiny dependency-free SVG charts (bars, ratios around 1, lines, heat maps) for self-contained HTML reports.

Every chart carries a viewBox, so a browser scales it down to a narrow screen instead of cutting it off, and lays
its text out from an estimated glyph width (`CHAR` · font size per character) so labels do not run into each other:
numeric x labels are thinned, long ones rotated, and the ratio chart puts one metric per row.
"""

from __future__ import annotations

import math
from html import escape

W, H, PAD = 560, 260, 48
BLUE, RED, GREEN, GREY = "#4a7ab5", "#c0392b", "#2e8b57", "#777"
COLORS = [BLUE, "#c33", "#3a3", "#a6c", "#e90", "#222", "#0aa", "#963", "#e377c2", "#7f7f7f", "#17becf", "#bcbd22"]
CHAR = 0.62  # upper estimate of a sans-serif glyph's width, as a fraction of the font size


def text_width(text: str, size: float) -> float:
    return CHAR * size * len(text)


def svg_open(width: float, height: float, font_size: int = 11) -> str:
    """The opening tag: fixed size on a wide screen, scaled (viewBox) to the container on a narrow one."""
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" style="max-width:100%;height:auto" role="img" '
            f'font-family="sans-serif" font-size="{font_size}">')


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi] (steps of 1, 2, 2.5 or 5 times a power of ten)."""
    if not hi > lo:
        lo, hi = lo - (abs(lo) or 1.0) * 0.05, hi + (abs(hi) or 1.0) * 0.05
    raw = (hi - lo) / max(count - 1, 1)
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1.0, 2.0, 2.5, 5.0, 10.0) if m * mag >= raw * (1 - 1e-9))
    start, stop = math.floor(lo / step + 1e-9) * step, math.ceil(hi / step - 1e-9) * step
    return [start + i * step for i in range(round((stop - start) / step) + 1)]


def tick_text(value: float, ticks: list[float]) -> str:
    """A tick value with as many decimals as the tick step needs."""
    step = abs(ticks[1] - ticks[0]) if len(ticks) > 1 else abs(value) or 1.0
    decimals = max(0, -math.floor(math.log10(step) + 1e-9)) + (1 if round(step / 10.0 ** math.floor(
        math.log10(step) + 1e-9), 6) == 2.5 else 0)
    return f"{0.0 if abs(value) < step * 1e-9 else value:,.{decimals}f}"


def _title(width: float, title: str, subtitle: str = "") -> list[str]:
    parts = [f'<text x="{width / 2:.0f}" y="17" text-anchor="middle" font-size="13" font-weight="bold">'
             f'{escape(title)}</text>']
    if subtitle:
        parts.append(f'<text x="{width / 2:.0f}" y="32" text-anchor="middle" fill="{GREY}">{escape(subtitle)}</text>')
    return parts


def _y_axis(left: float, right: float, top: float, bottom: float, ticks: list[float], label: str) -> list[str]:
    """Grid lines, tick labels and the rotated axis label of a vertical value axis spanning ticks[0]..ticks[-1]."""
    lo, hi = ticks[0], ticks[-1]
    parts = [f'<line x1="{left:.1f}" y1="{top:.1f}" x2="{left:.1f}" y2="{bottom:.1f}" stroke="#333"/>']
    for t in ticks:
        y = bottom - (t - lo) / (hi - lo) * (bottom - top)
        parts.append(f'<line x1="{left:.1f}" y1="{y:.1f}" x2="{right:.1f}" y2="{y:.1f}" stroke="#e4e4e4"/>')
        parts.append(f'<text class="tick" x="{left - 4:.1f}" y="{y + 4:.1f}" text-anchor="end">'
                     f'{tick_text(t, ticks)}</text>')
    mid = (top + bottom) / 2
    parts.append(f'<text x="12" y="{mid:.1f}" transform="rotate(-90 12 {mid:.1f})" text-anchor="middle">'
                 f'{escape(label)}</text>')
    return parts


def _left_margin(ticks: list[float]) -> float:
    return max(PAD, 26 + max(text_width(tick_text(t, ticks), 11) for t in ticks))


def bar_chart(title: str, labels: list[str], values: list[float], y_label: str = "",
              reference: float | None = None, reference_label: str = "") -> str:
    """Vertical bars from 0 (for counts and sizes); a dashed line at `reference` if given."""
    ticks = nice_ticks(0.0, max([*values, reference or 0.0, 1e-12]))
    left, right, top, size = _left_margin(ticks), W - 12, 44.0, 11
    n = max(len(values), 1)
    step = (right - left) / n
    widest = max((text_width(label, size) for label in labels), default=0.0)
    numeric = all(label.lstrip("-").isdigit() for label in labels)
    rotate = not numeric and widest + 6 > step
    every = max(1, math.ceil((size * 1.6 if rotate else widest + 6) / step))
    bottom = top + H - PAD - 28
    height = bottom + 22 + (widest * 0.71 if rotate else 0)
    parts = [svg_open(W, height), *_title(W, title), *_y_axis(left, right, top, bottom, ticks, y_label)]
    scale = (bottom - top) / ticks[-1]
    for i, (label, v) in enumerate(zip(labels, values, strict=True)):
        h, x = v * scale, left + i * step
        parts.append(f'<rect x="{x + 1.5:.1f}" y="{bottom - h:.1f}" width="{max(step - 3, 1):.1f}" height="{h:.1f}" '
                     f'fill="{BLUE}"><title>{escape(label)}: {v:.4g}</title></rect>')
        if n <= 12:
            parts.append(f'<text class="value" x="{x + step / 2:.1f}" y="{bottom - h - 3:.1f}" '
                         f'text-anchor="middle">{v:.4g}</text>')
        if i % every == 0:
            cx, ly = x + step / 2, bottom + 14
            turn = f' transform="rotate(-45 {cx:.1f} {ly:.1f})"' if rotate else ""
            parts.append(f'<text class="label" x="{cx:.1f}" y="{ly:.1f}" text-anchor="{"end" if rotate else "middle"}"'
                         f'{turn}>{escape(label)}</text>')
    parts.append(f'<line x1="{left:.1f}" y1="{bottom:.1f}" x2="{right:.1f}" y2="{bottom:.1f}" stroke="#333"/>')
    if reference is not None:
        y = bottom - reference * scale
        parts.append(f'<line x1="{left:.1f}" y1="{y:.1f}" x2="{right:.1f}" y2="{y:.1f}" stroke="{RED}" '
                     'stroke-dasharray="4"/>')
        if reference_label:
            parts.append(f'<text x="{right:.1f}" y="{y - 4:.1f}" text-anchor="end" fill="{RED}">'
                         f'{escape(reference_label)}</text>')
    return "".join(parts) + "</svg>"


def _wrap(text: str, width: float, size: float) -> list[str]:
    """Words of `text` on lines no wider than `width` (a single long word keeps its own line)."""
    lines: list[str] = []
    for word in text.split():
        if lines and text_width(f"{lines[-1]} {word}", size) <= width:
            lines[-1] = f"{lines[-1]} {word}"
        else:
            lines.append(word)
    return lines or [""]


def ratio_chart(title: str, rows: list[tuple[str, float, str | None]], subtitle: str = "") -> str:
    """One row per (label, ratio, better) with a bar from 1 to the ratio, on an axis around 1 (not from 0).

    `better` is "lower", "higher" or None; it is written under the label, and the bar and value are green when the
    ratio moved the better way, red when the worse way (with the words, for readers who do not see colour)."""
    size, width, value_w = 13, 520, 108
    label_w = min(max([text_width(label, size) for label, _, _ in rows] + [80.0]), 170.0)
    x0, x1 = 14 + label_w + 10, width - value_w
    finite = [r for _, r, _ in rows if math.isfinite(r)]
    lo, hi = min([*finite, 1.0]), max([*finite, 1.0])
    pad = 0.08 * max(hi - lo, 0.04)
    ticks = nice_ticks(lo - pad, hi + pad)

    def x_of(r: float) -> float:
        return x0 + (r - ticks[0]) / (ticks[-1] - ticks[0]) * (x1 - x0)

    y, body = 44.0, []
    for label, r, better in rows:
        lines = _wrap(label, label_w, size)
        row_h = max(38.0, 16.0 * len(lines) + 22)
        cy = y + row_h / 2
        ly = cy - 16.0 * (len(lines) - 1) / 2 - (2 if better else -5)
        body += [f'<text class="label" x="{x0 - 10:.1f}" y="{ly + 16 * k:.1f}" text-anchor="end">{escape(line)}</text>'
                 for k, line in enumerate(lines)]
        if better:
            body.append(f'<text class="label" x="{x0 - 10:.1f}" y="{ly + 16 * len(lines) - 2:.1f}" '
                        f'text-anchor="end" font-size="11" fill="{GREY}">{better} is better</text>')
        verdict = ("unchanged" if not math.isfinite(r) or abs(r - 1) < 5e-4 else
                   "better" if better and (r < 1) == (better == "lower") else "worse" if better else "")
        color = {"better": GREEN, "worse": RED}.get(verdict, BLUE if verdict else GREY)
        if math.isfinite(r):
            a, b = sorted((x_of(1.0), x_of(r)))
            body.append(f'<rect x="{a:.1f}" y="{cy - 7:.1f}" width="{max(b - a, 1.5):.1f}" height="14" fill="{color}">'
                        f'<title>{escape(label)}: {r:.4g}</title></rect>')
            change = f"{r:.3f} ({100 * (r - 1):+.1f}%)"
        else:
            change = "n/a"
        body.append(f'<text class="value" x="{x1 + 8:.1f}" y="{cy + 4 - (6 if verdict else 0):.1f}" '
                    f'fill="{color}">{change}</text>')
        if verdict:
            body.append(f'<text class="value" x="{x1 + 8:.1f}" y="{cy + 12:.1f}" font-size="11" fill="{color}">'
                        f'{verdict}</text>')
        y += row_h
    bottom = y + 4
    parts = [svg_open(width, bottom + 22, size), *_title(width, title, subtitle)]
    for t in ticks:
        parts.append(f'<line x1="{x_of(t):.1f}" y1="40" x2="{x_of(t):.1f}" y2="{bottom:.1f}" stroke="#e4e4e4"/>')
        parts.append(f'<text class="tick" x="{x_of(t):.1f}" y="{bottom + 15:.1f}" text-anchor="middle" '
                     f'font-size="11">{tick_text(t, ticks)}</text>')
    parts.append(f'<line x1="{x_of(1.0):.1f}" y1="40" x2="{x_of(1.0):.1f}" y2="{bottom:.1f}" stroke="#333" '
                 'stroke-dasharray="4"/>')
    return "".join(parts + body) + "</svg>"


def line_chart(title: str, series: dict[str, list[tuple[float, float]]], x_label: str, y_label: str,
               x_from_zero: bool = False, connect: bool = True, subtitle: str = "") -> str:
    """Lines with points (points alone with connect=False: a scatter plot); the y axis spans the data (rounded),
    the x axis too (from 0 with `x_from_zero`)."""
    series = {k: [(x, y) for x, y in v if math.isfinite(x) and math.isfinite(y)] for k, v in series.items()}
    points = [p for s in series.values() for p in s] or [(0.0, 0.0)]
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x_ticks = nice_ticks(min([*xs, 0.0]) if x_from_zero else min(xs), max(xs), 6)
    if all(float(x).is_integer() for x in xs) and x_ticks[1] - x_ticks[0] < 1:
        x_ticks = [float(v) for v in range(math.floor(x_ticks[0]), math.ceil(x_ticks[-1]) + 1)]
    y_ticks = nice_ticks(min(ys), max(ys))
    left, size = _left_margin(y_ticks), 11
    right = W - max(16.0, text_width(tick_text(x_ticks[-1], x_ticks), size) / 2 + 4)
    legend = _legend_slots(list(series), left, right, size) if len(series) > 1 else []
    top = 40.0 + 16 * (1 + max((row for _, row in legend), default=-1))
    bottom = H - 36
    x_span, y_span = (x_ticks[-1] - x_ticks[0]) or 1.0, (y_ticks[-1] - y_ticks[0]) or 1.0

    def at(x: float, y: float) -> tuple[float, float]:
        return left + (x - x_ticks[0]) / x_span * (right - left), bottom - (y - y_ticks[0]) / y_span * (bottom - top)

    parts = [svg_open(W, H), *_title(W, title, subtitle), *_y_axis(left, right, top, bottom, y_ticks, y_label),
             f'<line x1="{left:.1f}" y1="{bottom:.1f}" x2="{right:.1f}" y2="{bottom:.1f}" stroke="#333"/>',
             f'<text x="{(left + right) / 2:.1f}" y="{H - 4}" text-anchor="middle">{escape(x_label)}</text>']
    gap = (right - left) / max(len(x_ticks) - 1, 1)
    every = max(1, math.ceil((max(text_width(tick_text(t, x_ticks), size) for t in x_ticks) + 8) / gap))
    for i, t in enumerate(x_ticks):
        if i % every == 0:
            parts.append(f'<text class="label" x="{at(t, y_ticks[0])[0]:.1f}" y="{bottom + 14:.1f}" '
                         f'text-anchor="middle">{tick_text(t, x_ticks)}</text>')
    labelled = len(points) <= 6
    for k, (name, pts) in enumerate(series.items()):
        color = COLORS[k % len(COLORS)]
        coords = [(at(x, y), (x, y)) for x, y in sorted(pts)]
        path = " ".join(f"{cx:.1f},{cy:.1f}" for (cx, cy), _ in coords)
        if connect:
            parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        for (cx, cy), (x, y) in coords:
            parts.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="3.5" fill="{color}"><title>{escape(name)}: '
                         f'{x:.4g}, {y:.4g}</title></circle>')
            if labelled:
                anchor, dx = ("end", -6) if cx > (left + right) / 2 else ("start", 6)
                parts.append(f'<text class="value" x="{cx + dx:.1f}" y="{cy - 6:.1f}" text-anchor="{anchor}" '
                             f'fill="{color}">{y:.4g}</text>')
        if legend:
            lx, row = legend[k]
            ly = 40.0 + 16 * row + 2
            parts.append(f'<line x1="{lx:.1f}" y1="{ly:.1f}" x2="{lx + 14:.1f}" y2="{ly:.1f}" stroke="{color}" '
                         f'stroke-width="3"/><text x="{lx + 18:.1f}" y="{ly + 4:.1f}">{escape(name)}</text>')
    return "".join(parts) + "</svg>"


def _legend_slots(names: list[str], left: float, right: float, size: int) -> list[tuple[float, int]]:
    """(x, row) of each legend entry: left to right, a new row when the next entry would pass `right`."""
    slots, x, row = [], left, 0
    for name in names:
        width = 18 + text_width(name, size)
        if x > left and x + width > right:
            x, row = left, row + 1
        slots.append((x, row))
        x += width + 12
    return slots


def heat_map(title: str, matrix: list[list[float]], label: str = "") -> str:
    """A square matrix as cells shaded white (0) -> dark blue (max); row/column index = layer."""
    n = max(len(matrix), 1)
    v_max = max([v for row in matrix for v in row] or [1.0]) or 1.0
    size = min((W - 2 * PAD) / n, (H * 2 - 2 * PAD) / n)
    side = 2 * PAD + n * size
    parts = [svg_open(side, side + 20, 10), f'<text x="{side / 2:.0f}" y="16" text-anchor="middle" '
             f'font-size="13">{escape(title)} (max {v_max:.3g}{", " + escape(label) if label else ""})</text>']
    for i, row in enumerate(matrix):
        for j, v in enumerate(row):
            t = max(0.0, min(1.0, v / v_max))
            rgb = (int(255 - 181 * t), int(255 - 133 * t), int(255 - 74 * t))  # white -> BLUE
            parts.append(f'<rect x="{PAD + j * size:.1f}" y="{PAD + i * size:.1f}" width="{size:.1f}" '
                         f'height="{size:.1f}" fill="rgb{rgb}"><title>{i}, {j}: {v:.4g}</title></rect>')
        if n <= 40 and i % max(1, n // 10) == 0:
            parts.append(f'<text x="{PAD - 4}" y="{PAD + (i + 0.7) * size:.1f}" text-anchor="end">{i}</text>')
            parts.append(f'<text x="{PAD + (i + 0.5) * size:.1f}" y="{PAD - 4}" text-anchor="middle">{i}</text>')
    return "".join(parts) + "</svg>"

"""`attnslim report DIR`: one self-contained HTML page (and Markdown with the same text) for a compressed model.

The page is a list of blocks (headings, paragraphs, tables, name/value lists, charts) rendered twice: HTML, with
every text escaped and charts inline, and Markdown, with every text escaped too (a recipe's description cannot
inject markup into either) and the charts left to the HTML page.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

from attnslim.errors import AttnslimError, first_line
from attnslim.io import read_compression_json
from attnslim.report.charts import heal_chart, kv_layer_chart, metric_charts, step_charts
from attnslim.report.facts import better, heal_pairs, ratio, read_config, sample_size, summary, verdict
from attnslim.report.text import args_text, fmt_float, layer_ranges, plan_notes, plan_table, summary_pairs
from attnslim.safe_files import check_write_target, write_text_atomic


@dataclass(frozen=True)
class Block:
    kind: str  # "h1" | "h2" | "h3" | "p" | "table" | "pairs" | "svg"
    text: str = ""
    header: tuple[str, ...] = ()
    rows: tuple[tuple[str, ...], ...] = ()


def table(header: list[str], rows: list[list[str]]) -> Block:
    return Block("table", header=tuple(header), rows=tuple(tuple(r) for r in rows))


def pairs(rows: list[tuple[str, str]]) -> Block:
    return Block("pairs", rows=tuple(rows))


def quality_blocks(info: dict[str, Any]) -> list[Block]:
    metrics = info.get("metrics") or {}
    if not metrics:
        return [Block("h2", "Quality"), Block("p", "No metrics recorded in compression.json: measure the dense and "
                                                "the compressed model with attnslim eval (make demo records both).")]
    sizes = [sample_size(v) for v in metrics.values()]
    header = ["metric", "better", "dense", "compressed", "ratio", "change", *(["measured on"] if any(sizes) else [])]
    rows = [[k, better(k, v) or "—", fmt_float(float(v["before"])), fmt_float(float(v["after"])),
             f"{ratio(v):.3f}", verdict(k, v), *([n or "—"] if any(sizes) else [])]
            for (k, v), n in zip(metrics.items(), sizes, strict=True)]
    out = [Block("h2", "Quality and speed (same evaluation windows)"), table(header, rows)]
    if info.get("metrics_description"):
        out.append(Block("p", f"Evaluation: {info['metrics_description']}"))
    return out + [Block("svg", c) for c in metric_charts(info)]


def size_blocks(info: dict[str, Any]) -> list[Block]:
    before, after = info["params_before"], info["params_after"]
    rows = [[g, f"{before[g]:,}", f"{after[g]:,}", f"{after[g] / before[g]:.3f}"]
            for g in ("attention", "mlp", "embedding", "total") if before.get(g)]
    kb, ka = info["kv_bytes_per_token_before"], info["kv_bytes_per_token_after"]
    rows.append(["KV bytes/token", f"{kb:,.0f}", f"{ka:,.0f}", f"{ka / kb:.3f}" if kb else "—"])
    return [Block("h2", "Size"), table(["group", "before", "after", "kept"], rows),
            *(Block("svg", c) for c in kv_layer_chart(info))]


def heal_blocks(info: dict[str, Any]) -> list[Block]:
    heal = info.get("heal")
    if not heal:
        return [Block("h2", "Heal"), Block("p", "No heal: the recipe has no heal step.")]
    return [Block("h2", "Heal (distillation towards the dense model after compression)"), pairs(heal_pairs(heal)),
            *(Block("svg", c) for c in heal_chart(heal))]


def step_blocks(n: int, step: dict[str, Any]) -> list[Block]:
    plan = step["plan"]
    converted = [int(k) for k in plan.get("layers", {})]
    out = [Block("h2", f"Step {n + 1}: {step['method']}"), Block("p", f"Arguments: {args_text(step['args'])}"),
           Block("p", f"Layers converted: {layer_ranges(converted)} (candidates: "
                      f"{layer_ranges([int(i) for i in step.get('candidates', [])])})")]
    notes = plan_notes(plan)
    if notes:
        out.append(pairs(notes))
    header, rows, same = plan_table(plan)
    out += [Block("p", s) for s in same]
    if len(header) > 1:
        out.append(table(header, rows))
    if isinstance(plan.get("training"), dict):
        out += [Block("h3", "Training"), pairs(summary_pairs(plan["training"]))]
    return out + [Block("svg", c) for c in step_charts(n, step)]


def blocks(info: dict[str, Any], config: dict[str, Any]) -> list[Block]:
    """The whole report, top to bottom."""
    out = [Block("h1", f"attnslim report: {info['recipe'].get('name')}"), Block("h2", "Summary"),
           pairs(summary(info, config))]
    out += quality_blocks(info) + size_blocks(info) + heal_blocks(info)
    for n, step in enumerate(info["steps"]):
        out += step_blocks(n, step)
    cal = info["calibration"]
    out += [Block("h2", "Run"), pairs([
        ("calibration", f"{cal['description']} ({cal['tokens']:,} tokens)"),
        ("compression time", f"{info['seconds']:.0f} s, peak RSS {info['peak_rss_mb']:.0f} MB"),
        ("versions", ", ".join(f"{k} {v}" for k, v in info.get("versions", {}).items())),
        ("recipe fingerprint", str(info.get("recipe_fingerprint", "—")))])]
    return out


CSS = ("body{font-family:system-ui,sans-serif;max-width:880px;margin:0 auto;padding:8px 14px 40px;line-height:1.4;"
       "color:#222}h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #ddd}"
       ".scroll{overflow-x:auto}table{border-collapse:collapse;margin:.5em 0 1em}"
       "td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}"
       "td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}"
       "table.pairs th{background:#f3f5f8;min-width:5em}svg{display:block;margin:1em 0}")
_NUMBER = re.compile(r"^[-+]?[\d,]*\.?\d+(e[-+]?\d+)?%?$|^[∞—]$")


def _cell(text: str, tag: str = "td") -> str:
    cls = ' class="n"' if tag == "td" and _NUMBER.match(text) else ""
    return f"<{tag}{cls}>{escape(text)}</{tag}>"


def to_html(page: list[Block]) -> str:
    title = next((b.text for b in page if b.kind == "h1"), "attnslim report")
    out = ["<!doctype html><html lang='en'><head><meta charset='utf-8'>"
           "<meta name='viewport' content='width=device-width, initial-scale=1'>"
           f"<title>{escape(title)}</title><style>{CSS}</style></head><body>"]
    for b in page:
        if b.kind in ("h1", "h2", "h3", "p"):
            out.append(f"<{b.kind}>{escape(b.text)}</{b.kind}>")
        elif b.kind == "table":
            head = "".join(_cell(h, "th") for h in b.header)
            body = "".join("<tr>" + "".join(_cell(c) for c in r) + "</tr>" for r in b.rows)
            out.append(f"<div class='scroll'><table><tr>{head}</tr>{body}</table></div>")
        elif b.kind == "pairs":
            body = "".join(f"<tr>{_cell(k, 'th')}<td>{escape(v)}</td></tr>" for k, v in b.rows)
            out.append(f"<div class='scroll'><table class='pairs'>{body}</table></div>")
        elif b.kind == "svg":
            out.append(b.text)  # built by report.svg, which escapes every text it holds
    return "\n".join(out) + "\n</body></html>\n"


_MD_SPECIAL = re.compile(r"([\\`*_\[\]|~#!])")


def md_escape(text: str) -> str:
    """Plain text for Markdown: HTML disarmed, emphasis/link/table syntax backslash-escaped, one line."""
    return _MD_SPECIAL.sub(r"\\\1", escape(" ".join(str(text).split()), quote=False))


def to_markdown(page: list[Block]) -> str:
    out: list[str] = []
    charts = sum(b.kind == "svg" for b in page)
    for b in page:
        if b.kind in ("h1", "h2", "h3"):
            out += [f"{'#' * int(b.kind[1])} {md_escape(b.text)}", ""]
        elif b.kind == "p":
            out += [md_escape(b.text), ""]
        elif b.kind == "table":
            out += ["| " + " | ".join(md_escape(h) for h in b.header) + " |", "|" + "---|" * len(b.header)]
            out += ["| " + " | ".join(md_escape(c) for c in r) + " |" for r in b.rows] + [""]
        elif b.kind == "pairs":
            out += [f"- **{md_escape(k)}**: {md_escape(v)}" for k, v in b.rows] + [""]
    if charts:
        out += [f"_{charts} chart{'s' if charts > 1 else ''} in report.html._", ""]
    return "\n".join(out)


def render(directory: str | Path) -> tuple[str, str]:
    """(html, markdown) for a compressed directory; a compression.json whose fields are missing or of the wrong
    kind is an AttnslimError naming the field, not a traceback."""
    path = Path(directory)
    info = read_compression_json(path)
    try:
        page = blocks(info, read_config(path))
    except KeyError as err:
        raise AttnslimError(f"{path / 'compression.json'} is damaged (it has no {err}); re-create the directory "
                            "with attnslim compress") from None
    except (TypeError, ValueError, AttributeError, ArithmeticError, IndexError, RecursionError) as err:
        if isinstance(err, AttnslimError):
            raise
        raise AttnslimError(f"{path / 'compression.json'} is damaged ({type(err).__name__}: {first_line(err)}); "
                            "re-create the directory with attnslim compress") from None
    return to_html(page), to_markdown(page)


def write_report(directory: str | Path) -> tuple[Path, Path]:
    """Write report.html and report.md into `directory` through temp files (safe_files.write_text_atomic): a
    `report.*` that is a link or not a regular file is refused, never written through, and a full disk leaves the
    old reports whole."""
    html, md = render(directory)
    out_html, out_md = Path(directory) / "report.html", Path(directory) / "report.md"
    for target in (out_html, out_md):
        check_write_target(target)  # both before either is written
    write_text_atomic(out_html, html)
    write_text_atomic(out_md, md)
    return out_html, out_md

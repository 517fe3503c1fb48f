"""`attnslim report`: what a person reading report.html / report.md must find, and charts that stay legible
(labels that do not collide, an axis around 1 for ratios, a page that scales to a phone)."""

from __future__ import annotations

import json
import math
import re
import warnings
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest

from attnslim.api import compress
from attnslim.io import save
from attnslim.recipe import recipe_from_dict
from attnslim.report import write_report
from attnslim.report.svg import bar_chart, ratio_chart
from helpers import ByteTokenizer, SavingTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
NAME = "tiny-llama-for-report"
GLYPH = 0.6  # a sans-serif glyph's average width / font size (digits and lower case are ~0.55 in common fonts)


def _saved(model, tmp_path, steps, heal=None, description="two steps", metrics=None):
    model.config._name_or_path = f"/some/cache/models/{NAME}"  # what from_pretrained records for a local dir
    spec = {"name": "report-test", "description": description,
            "calibration": {"source": "tiny", "windows": 4, "seq_len": 32}, "steps": steps}
    if heal is not None:
        spec["heal"] = heal
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny calibration sets are rank-deficient by design
        info = compress(model, ByteTokenizer(), recipe_from_dict(spec), progress=False).to_json()
    if metrics is not None:
        info["metrics"] = metrics
    out = save(model, SavingTokenizer(), tmp_path / "m", info)
    html, md = write_report(out)
    return html.read_text(), md.read_text(), json.loads((out / "compression.json").read_text())


NBL_SVD = [{"method": "nbl", "layers": "all", "args": {"m": 1}},
           {"method": "svdllm", "layers": "rest", "args": {"ratio": 0.6}}]
PPL_UP = {"wiki ppl": {"before": 20.0, "after": 21.4}, "c4 ppl": {"before": 30.0, "after": 34.5},
          "hellaswag acc": {"before": 0.5, "after": 0.48, "n": 400}}


@pytest.fixture
def nbl_svd(llama, tmp_path):
    return _saved(llama, tmp_path, NBL_SVD, metrics=PPL_UP)


def _svgs(html):
    return [ET.fromstring(s) for s in re.findall(r"<svg.*?</svg>", html, re.S)]


def _title_of(svg):
    return " ".join(t.text or "" for t in svg.iter("{http://www.w3.org/2000/svg}text"))


class _Tables(HTMLParser):
    """Every <table> of a page as rows of cell texts."""

    def __init__(self, html):
        super().__init__()
        self.tables, self._cell = [], None
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = ""

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.tables[-1][-1].append(self._cell)
            self._cell = None


def _boxes(svg, cls):
    """Corner points of each text of class `cls`, from its anchor, font size and rotation (estimated width)."""
    size_of = float(svg.get("font-size", 11))
    out = []
    for t in svg.iter("{http://www.w3.org/2000/svg}text"):
        if t.get("class") != cls or not (t.text or "").strip():
            continue
        x, y, size = float(t.get("x")), float(t.get("y")), float(t.get("font-size", size_of))
        w = GLYPH * size * len(t.text)
        x0 = {"start": x, "middle": x - w / 2, "end": x - w}[t.get("text-anchor", "start")]
        corners = [(x0, y - 0.8 * size), (x0 + w, y - 0.8 * size), (x0 + w, y + 0.2 * size), (x0, y + 0.2 * size)]
        turn = re.match(r"rotate\(([-\d.]+) ([-\d.]+) ([-\d.]+)\)", t.get("transform", ""))
        if turn:
            a, cx, cy = math.radians(float(turn[1])), float(turn[2]), float(turn[3])
            corners = [(cx + (px - cx) * math.cos(a) - (py - cy) * math.sin(a),
                        cy + (px - cx) * math.sin(a) + (py - cy) * math.cos(a)) for px, py in corners]
        out.append((t.text, corners))
    return out


def _intersect(p, q):
    """Separating-axis test for two convex quadrilaterals."""
    for poly in (p, q):
        for i in range(4):
            (x1, y1), (x2, y2) = poly[i], poly[(i + 1) % 4]
            nx, ny = y2 - y1, x1 - x2
            a = [nx * x + ny * y for x, y in p]
            b = [nx * x + ny * y for x, y in q]
            if max(a) <= min(b) or max(b) <= min(a):
                return False
    return True


def _assert_no_overlap(svg, cls="label"):
    boxes = _boxes(svg, cls)
    assert boxes
    for i, (ta, a) in enumerate(boxes):
        for tb, b in boxes[i + 1:]:
            assert not _intersect(a, b), f"labels {ta!r} and {tb!r} overlap"


def test_report_names_the_base_model_and_the_heal_result(llama, tmp_path):
    heal = {"steps": 3, "batch_size": 1, "seq_len": 16, "source": "tiny"}
    html, md, info = _saved(llama, tmp_path, [{"method": "svdllm", "layers": "all", "args": {"ratio": 0.6}}], heal)
    result = info["heal"]
    for text in (html, md):
        assert NAME in text and "/some/cache" not in text  # the name, not the local path it was loaded from
        assert "llama" in text and f"{info['params_before']['total']:,}" in text
        assert f"{result['trainable_params']:,}" in text
        line = next(x for x in text.replace("<tr>", "\n").splitlines() if "KL to the dense model" in x)
        shown = [float(v) for v in re.findall(r"\d+\.\d+(?:e-?\d+)?", line)][:2]
        assert shown == pytest.approx([result["kl_first"], result["kl_last"]], rel=1e-3)
    assert "Heal: KL to the dense model per step" in html  # the KL curve
    summary = _Tables(html).tables[0]
    assert [row[0] for row in summary][:1] == ["base model"] and any(row[0] == "heal" for row in summary)


def test_report_without_heal_or_metrics_says_so(llama, tmp_path):
    html, md, _ = _saved(llama, tmp_path, [{"method": "drop", "layers": "all", "args": {"count": 1}}])
    for text in (html, md):
        assert "no heal step" in text and "No metrics recorded" in text


def test_page_fits_a_phone(nbl_svd):
    html, _, _ = nbl_svd
    assert '<meta name=\'viewport\' content=\'width=device-width' in html
    svgs = _svgs(html)
    assert len(svgs) >= 4
    for svg in svgs:
        w, h = float(svg.get("width")), float(svg.get("height"))
        assert svg.get("viewBox") == f"0 0 {w:.0f} {h:.0f}"  # scales down instead of being cut off
        assert "max-width:100%" in svg.get("style", "")


def test_ratio_axis_is_around_one_and_marks_which_way_is_better(nbl_svd):
    html, md, _ = nbl_svd
    chart = next(s for s in _svgs(html) if "Compressed / dense, per metric" in _title_of(s))
    ticks = [float(t.text.replace(",", "")) for t in chart.iter("{http://www.w3.org/2000/svg}text")
             if t.get("class") == "tick"]
    assert 0.9 <= min(ticks) <= 0.96 and max(ticks) >= 1.15, ticks  # ratios 0.96 .. 1.15: not an axis from 0
    bars = {r.find("{http://www.w3.org/2000/svg}title").text.split(":")[0]: float(r.get("width"))
            for r in chart.iter("{http://www.w3.org/2000/svg}rect")}
    assert bars["c4 ppl"] / bars["wiki ppl"] == pytest.approx(0.15 / 0.07, rel=0.05)  # a 7% rise is visible
    text = _title_of(chart)
    assert text.count("lower is better") == 2 and text.count("higher is better") == 1
    verdicts = [t.text for t in chart.iter("{http://www.w3.org/2000/svg}text") if t.get("class") == "value"]
    assert verdicts.count("worse") == 3  # ppl up and accuracy down are all worse
    quality = next(t for t in _Tables(html).tables if t[0][:2] == ["metric", "better"])
    assert ["hellaswag acc", "higher"] == quality[3][:2] and "400" in quality[3]  # sample size beside the accuracy
    assert "| wiki ppl | lower |" in md and "+15.0% (worse)" in md


def test_chart_labels_do_not_overlap(nbl_svd):
    html, _, _ = nbl_svd
    for svg in _svgs(html):
        if _boxes(svg, "label"):
            _assert_no_overlap(svg)
    long_names = ["wikitext-2 perplexity (4096 tokens)", "penn treebank perplexity (4096 tokens)",
                  "hellaswag accuracy (normalised)", "decode tokens/s at 512 context"]
    _assert_no_overlap(ET.fromstring(ratio_chart("t", [(n, 1.0 + k / 20, "lower") for k, n in enumerate(long_names)])))
    _assert_no_overlap(ET.fromstring(bar_chart("t", [str(i) for i in range(80)], [1.0] * 80)))  # 80 layers
    _assert_no_overlap(ET.fromstring(bar_chart("t", long_names * 3, [1.0] * 12)))  # long labels: rotated


def test_steps_and_layers_are_tables_not_dict_dumps(nbl_svd):
    html, md, info = nbl_svd
    for text in (html, md):
        assert "{'" not in text and "{&#x27;" not in text and "': " not in text and "&#x27;: " not in text
        assert "Step 1: nbl" in text and "Step 2: svdllm" in text
    tables = _Tables(html).tables
    svd = info["steps"][1]["plan"]["layers"]
    ranks = next(t for t in tables if t[0][0] == "layer" and "q" in t[0])
    q = ranks[0].index("q")
    assert {row[0]: row[q] for row in ranks[1:]} == {k: str(v["q"]) for k, v in svd.items()}
    nbl = info["steps"][0]["plan"]
    scores = next(t for t in tables if t[0][0] == "layer" and "converted" in t[0])
    assert [row[1] for row in scores[1:]] == ["yes" if str(i) in nbl["layers"] else "no" for i in range(4)]


def test_recipe_text_cannot_inject_markup(llama, tmp_path):
    evil = "<script>alert(1)</script> **bold** [link](javascript:x) | cell"
    html, md, _ = _saved(llama, tmp_path, [{"method": "drop", "layers": "all", "args": {"count": 1}}],
                         description=evil)
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert "<script>" not in md and "**bold**" not in md and "[link](" not in md
    assert "&lt;script&gt;" in md and r"\*\*bold\*\*" in md and r"\| cell" in md


def test_kv_layer_chart_labels_a_planned_model_with_each_layers_choice() -> None:
    from attnslim.report.charts import kv_layer_chart

    info = {"kv_bytes_per_layer_after": [384.0, 0.0, 192.0], "kv_bytes_per_layer_dense": [768.0] * 3}
    plain = kv_layer_chart(info)[0]
    planned = kv_layer_chart({**info, "planner": {"layers": [{"choice": "mla@0.5"}, {"choice": "nbl"},
                                                             {"choice": "mla@0.25"}]}})[0]
    assert "mla@0.25" in planned and "nbl" in planned and "the planner" in planned
    assert "mla@" not in plain and "planner" not in plain

"""`attnslim analyze --plot`: every analysis' figures are one well-formed SVG document with its charts."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from attnslim.analysis.plots import FIGURES, analysis_svg

REPORTS = {
    "linearity": {"default_criterion": "resid",
                  "layers": [{"layer": i, "cca": 10.0 + i, "resid": 0.01 * (i + 1)} for i in range(4)]},
    "lowrank": {"lengths": {str(n): {"sites": {s: {"ratio": {"mean": 0.5 / (1 + i) * 128 / n}}
                                               for i, s in enumerate(("embed", "0", "1"))}} for n in (128, 256)}},
    "similarity": {"js_matrix": [[abs(i - j) * 0.1 for j in range(4)] for i in range(4)],
                   "head_matching": {"direct": [0.3, 0.2, 0.1], "random": [0.3, 0.25, 0.1],
                                     "oracle": [0.2, 0.1, 0.05], "global": [0.2, 0.1, 0.06],
                                     "global_match": [[0, 1], [1, 0], [0, 1]]}},
    "sensitivity": {"single": {"ds": {"1": 0.3, "2": 0.1}, "avg": {"1": 0.2, "2": 0.1}},
                    "suffix": {"ds": {"1": 5.0, "2": 4.0}, "avg": {"1": 6.0, "2": 3.0}}},
    "conversion": {"method": "atp", "costs": {"0": 0.8, "1": 0.05, "2": 0.1}},
}


@pytest.mark.parametrize("what", sorted(FIGURES))
def test_figures_are_well_formed_svg(what):
    root = ET.fromstring(analysis_svg(what, REPORTS[what]))
    ns = "{http://www.w3.org/2000/svg}"
    charts = root.findall(f"{ns}g/{ns}svg")
    assert root.tag == f"{ns}svg" and len(charts) == {"linearity": 2, "lowrank": 1, "similarity": 2,
                                                       "sensitivity": 2, "conversion": 1}[what]
    assert float(root.get("height")) >= sum(float(c.get("height")) for c in charts)


def test_heat_map_has_one_cell_per_entry():
    root = ET.fromstring(analysis_svg("similarity", REPORTS["similarity"]))
    cells = [r for r in root.iter("{http://www.w3.org/2000/svg}rect") if r.find("{http://www.w3.org/2000/svg}title")
             is not None and ", " in r.find("{http://www.w3.org/2000/svg}title").text]
    assert len(cells) == 16

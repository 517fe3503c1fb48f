"""benchmarks/make_report.py: a result's notes become paragraphs, and a table's rows stay one markdown table."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPORT = Path(__file__).resolve().parents[1] / "benchmarks" / "make_report.py"


def _report() -> ModuleType:
    sys.path.insert(0, str(REPORT.parent))
    spec = importlib.util.spec_from_file_location("benchmarks_make_report", REPORT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_notes_are_paragraphs_and_table_rows_stay_contiguous() -> None:
    env = {"command": "benchmarks/mla.py --groups speed", "threads": 2, "device": "cpu", "torch": "t",
           "transformers": "x", "attnslim": "a"}
    notes = ["Decode against dense:", "", "| model | tok/s |", "|---|---|", "| dense | 1.0 |", "| mla | 1.1 |",
             "A closing remark."]
    lines = _report().section("mla-speed", {"environment": env, "notes": notes})
    start = lines.index("| model | tok/s |")
    assert lines[start : start + 4] == notes[2:6]  # no blank line inside the table: markdown renders one table
    assert lines[start - 1] == "" and lines[start - 2] == "Decode against dense:"
    assert lines[start + 4 : start + 6] == ["", "A closing remark."]  # prose after it is its own paragraph


def test_readme_summary_is_the_generated_table(tmp_path: Path) -> None:
    """README's Summary block is what make_report writes from the results: it cannot go stale silently."""
    report = _report()
    results = {p.stem: json.loads(p.read_text()) for p in sorted(report.RESULTS.glob("*.json"))
               if not p.stem.startswith("reliability") and "environment" in json.loads(p.read_text())}
    readme = REPORT.parents[1] / "README.md"
    copy = tmp_path / "README.md"
    copy.write_text(readme.read_text())
    report.write_summary(copy, report.summary(results))
    assert copy.read_text() == readme.read_text(), "README's summary is stale: run benchmarks/make_report.py"
    rows = [line for line in copy.read_text().splitlines() if line.startswith("| mla (+ 40-step heal) |")]
    assert len(rows) == 1


def test_write_summary_needs_its_markers(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# no markers here\n")
    with pytest.raises(SystemExit, match="no summary markers"):
        _report().write_summary(readme, ["| a |", "|---|", "| 1 |"])

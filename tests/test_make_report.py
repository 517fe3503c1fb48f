"""benchmarks/make_report.py: a result's notes become paragraphs, and a table's rows stay one markdown table."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

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

"""docs/paper-properties.md maps the papers' properties to tests: every test it names must exist, and its counts
table must match its own rows (a renamed or deleted test, or a row moved between columns, fails here)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "paper-properties.md"


def _sections() -> dict[str, list[str]]:
    """{paper: its property rows}, from the "## Paper (notes …)" tables."""
    out = {}
    for section in re.split(r"\n## ", DOC.read_text())[1:]:
        out[section.split(" ", 1)[0]] = [line for line in section.splitlines() if re.match(r"\| \d+ \|", line)]
    return out


def test_every_test_the_doc_names_exists() -> None:
    named = 0
    for line in DOC.read_text().splitlines():
        current = None
        for match in re.finditer(r"`(tests/[\w/]+\.py)?::(\w+)`", line):
            current = match.group(1) or current
            assert current is not None, line
            source = (ROOT / current).read_text()
            assert re.search(rf"^def {match.group(2)}\(", source, re.M), f"{current}::{match.group(2)} is gone"
            named += 1
    assert named > 50


def test_the_counts_table_matches_the_rows() -> None:
    counts = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 7 and cells[1].isdigit():
            counts[cells[0]] = (int(cells[1]), int(cells[2]), int(cells[3]))
    for paper, rows in _sections().items():
        tested = [r for r in rows if "`tests/" in r.split("|")[3]]
        real = [r for r in tested if "**real**" in r]
        assert counts[paper] == (len(rows), len(tested), len(real)), paper

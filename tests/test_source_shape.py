"""The source keeps the shape DESIGN promises: short method headers, no measured figure in a docstring, small files."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import attnslim
from attnslim.methods import METHODS

SRC = Path(attnslim.__file__).parent
HEADER_LINES = 25  # DESIGN, Style 8: what, from which paper, what is approximated, the cost, where it lives
FILE_LINES = 400  # DESIGN, Style 9
PARAMETERS = 10  # DESIGN, Style 9: more travel together in a small frozen dataclass
# a measured outcome written as a ratio, a percentage of a result, a time or a perplexity (goals, settings and formats
# name no such unit: targets.py's "≤ 0.5 × dense" has a space before ×, a setting has no unit)
MEASURED = re.compile(r"\b\d+(\.\d+)?(x|×)\s+(slower|faster|dense|smaller|larger)|\b\d+(\.\d+)?\s?s at n\b|"
                      r"\bppl \d+\.\d+|\b\d\.\d\d nats\b|\bacc \d\.\d+")


def _docstrings(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield node, doc


def test_every_method_module_header_is_short():
    modules = {SRC.joinpath(*cls.__module__.split(".")[1:]).with_suffix(".py") for cls in METHODS.values()}
    assert len(modules) >= 8  # every registered method's module (baselines share files)
    long = {}
    for path in sorted(modules):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False) or ""
        if doc.count("\n") + 1 > HEADER_LINES:
            long[str(path.relative_to(SRC))] = doc.count("\n") + 1
    assert long == {}, f"method headers over {HEADER_LINES} lines (move the rest to docs/methods/NAME.md): {long}"


def test_no_docstring_carries_a_measured_figure():
    hits = [f"{path.relative_to(SRC)}:{node.lineno if hasattr(node, 'lineno') else 1}: {m.group(0)}"
            for path in sorted(SRC.rglob("*.py")) for node, doc in _docstrings(path)
            for m in [MEASURED.search(doc)] if m]
    assert hits == [], f"name the BENCHMARKS.md section instead of the figure: {hits}"


def test_no_source_file_is_over_the_size_limit():
    sizes = {str(p.relative_to(SRC)): len(p.read_text(encoding="utf-8").splitlines()) for p in SRC.rglob("*.py")}
    assert {name: n for name, n in sizes.items() if n > FILE_LINES} == {}


def _parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Positional, keyword-only and star parameters, without a method's self / cls."""
    a = node.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    bound = 1 if names[:1] in (["self"], ["cls"]) else 0
    return len(names) - bound + (a.vararg is not None) + (a.kwarg is not None)


def test_parameter_count_reads_every_kind_of_parameter():
    tree = ast.parse("class C:\n    def f(self, a, /, b, *c, d, **e): ...\ndef g(cls_, a=1, *, b): ...\n")
    counts = {n.name: _parameter_count(n) for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert counts == {"f": 5, "g": 3}


def test_no_signature_takes_more_than_ten_parameters():
    long = {f"{path.relative_to(SRC)}:{node.lineno} {node.name}": n
            for path in sorted(SRC.rglob("*.py")) for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and (n := _parameter_count(node)) > PARAMETERS}
    assert long == {}, f"signatures over {PARAMETERS} parameters (group those that travel together): {long}"

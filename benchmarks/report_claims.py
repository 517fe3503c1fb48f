"""BENCHMARKS.md's section "What the papers claim, and what we measure", for make_report.py.

benchmarks/claims.yaml names, per paper claim, where each model's number lives in benchmarks/results (file, JSON
path, optional baseline) and the rule that makes it hold. The verdict is computed here from the numbers, never
written by hand; a number the results lack renders "not measured" with what is missing (no crash, no guess).
Accuracy cells read benchmarks/summary_accuracy.py's per-item scores: the difference is paired on the same items,
and a verdict that would flip within two paired standard errors is "within noise".
"""

from __future__ import annotations

import json
import math
import operator
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from report_accuracy import paired_difference

ROOT = Path(__file__).parent
CLAIMS = ROOT / "claims.yaml"
RESULTS = ROOT / "results"
TITLE = "What the papers claim, and what we measure"
MODELS = {"smollm2-135m": "SmolLM2-135M", "gemma3-270m": "Gemma-3 270M", "qwen2.5-1.5b": "Qwen2.5 1.5B"}
OPS: dict[str, Callable[[float, float], bool]] = {"<": operator.lt, "<=": operator.le, ">": operator.gt,
                                                  ">=": operator.ge, "==": operator.eq}
NOT_MEASURED = "not measured"


@dataclass(frozen=True)
class Measurement:
    """One number and its rule. `value`/`baseline` are JSON paths in results/<file>.json (`baseline_file` if the
    baseline lives elsewhere); a "*" step averages over every child. q = value/baseline (`compare: ratio`, the
    default), value − baseline (`difference`), or value alone; the cell holds when `holds_if` holds for q.
    `accuracy` = (run, variant, baseline) of summary_accuracy.json instead of paths (of a harness file, whose rows
    carry their own suite, run is "standard"): q = the paired difference. `median_over`: suffixes of the variant
    key (the path's step after "variants"): value and baseline are each the median over those rows (repeats of one
    row under other seeds)."""

    label: str
    file: str
    holds_if: tuple[str, float, float]  # (op, x, y): y only for "within" (x <= q <= y)
    value: tuple[str, ...] = ()
    baseline: tuple[str, ...] | None = None
    baseline_file: str | None = None
    compare: str = "ratio"
    accuracy: tuple[str, str, str] | None = None
    pending: str = ""  # why the number may be absent today (the test checks every other path resolves)
    median_over: tuple[str, ...] = ()  # e.g. ("", "-seed1", "-seed2")


@dataclass(frozen=True)
class Claim:
    paper: str
    claim: str
    paper_number: str
    tried: str
    cells: dict[str, tuple[Measurement, ...] | str]  # model -> measurements, or why it is not measured


def _fail(where: str, problem: str) -> SystemExit:
    return SystemExit(f"{CLAIMS.name}: {where}: {problem}")


def _measurement(raw: dict[str, Any], where: str) -> Measurement:
    rule = raw.get("holds_if")
    if not isinstance(rule, list) or not rule or rule[0] not in (*OPS, "within") or len(rule) != (
            3 if rule[0] == "within" else 2):
        raise _fail(where, f"holds_if {rule!r}: write [op, x] with op one of {', '.join(OPS)}, or [within, lo, hi]")
    acc = raw.get("accuracy")
    compare = str(raw.get("compare", "ratio" if "baseline" in raw else "value"))
    if acc is None and not raw.get("value"):
        raise _fail(where, "no value path: give value: [key, ...] or accuracy: [run, variant, baseline]")
    median_over = tuple(str(x) for x in raw.get("median_over", ()))
    paths = [raw.get("value") or [], *([raw["baseline"]] if "baseline" in raw else [])]
    if median_over and (acc is not None or any(len(path) < 2 or path[0] != "variants" for path in paths)):
        raise _fail(where, "median_over needs value (and baseline) paths of the form [variants, ROW, ...]")
    if acc is None and (compare not in ("ratio", "difference", "value") or (compare == "value") == ("baseline" in raw)):
        raise _fail(where, f"compare {compare!r}: use value (no baseline), or ratio / difference with a baseline")
    return Measurement(
        label=str(raw.get("label", "")), file=str(raw["file"]),
        holds_if=(rule[0], float(rule[1]), float(rule[2]) if len(rule) == 3 else math.nan),
        value=tuple(str(k) for k in raw.get("value", ())),
        baseline=tuple(str(k) for k in raw["baseline"]) if "baseline" in raw else None,
        baseline_file=raw.get("baseline_file"), compare=compare,
        accuracy=(str(acc[0]), str(acc[1]), str(acc[2])) if acc else None, pending=str(raw.get("pending", "")),
        median_over=median_over)


def parse_claims(raw: list[dict[str, Any]]) -> list[Claim]:
    """claims.yaml's list, checked: every model named is a column, every rule is well formed."""
    out = []
    for i, item in enumerate(raw, 1):
        where = f"claim {i} ({item.get('claim', '?')})"
        cells: dict[str, tuple[Measurement, ...] | str] = {}
        for model, cell in (item.get("models") or {}).items():
            if model not in MODELS:
                raise _fail(where, f"model {model!r} is not a column; use one of {', '.join(MODELS)}")
            cells[model] = str(cell) if isinstance(cell, str) else tuple(
                _measurement(m, f"{where}, {model}") for m in cell)
        out.append(Claim(str(item["paper"]), str(item["claim"]), str(item["paper_number"]),
                         str(item.get("tried", "")), cells))
    return out


def load_claims(path: Path = CLAIMS) -> list[Claim]:
    return parse_claims(yaml.safe_load(path.read_text()))


def load_results(folder: Path = RESULTS) -> dict[str, Any]:
    """Every results JSON of `folder` by its stem ("nbl"; qwen15/ holds CLI logs, not JSON files)."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def _lookup(data: Any, path: tuple[str, ...], file: str) -> float | str:
    """The number at `path` ("*" = mean over children), or the reason it is missing."""
    for i, key in enumerate(path):
        if key == "*" and isinstance(data, dict) and data:
            values = [_lookup(v, path[i + 1:], file) for v in data.values()]
            numbers = [v for v in values if isinstance(v, float)]
            return sum(numbers) / len(numbers) if len(numbers) == len(values) else next(
                v for v in values if isinstance(v, str))
        if not isinstance(data, dict) or key not in data:
            return f"no `{'.'.join(path[: i + 1])}` in {file}.json"
        data = data[key]
    if isinstance(data, bool) or not isinstance(data, int | float):
        return f"`{'.'.join(path)}` in {file}.json is not a number"
    return float(data)


def _num(x: float) -> str:
    if x.is_integer() and abs(x) < 1e9:
        return f"{int(x):,}"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.3f}" if abs(x) >= 0.1 else f"{x:.3g}"


def _holds(rule: tuple[str, float, float], q: float) -> bool:
    op, x, y = rule
    return x <= q <= y if op == "within" else OPS[op](q, x)


def _rule(m: Measurement, scale: float = 1.0, unit: str = "") -> str:
    """"holds if < 1" (`scale`, `unit`: accuracy rules read in points)."""
    op, x, y = m.holds_if
    return f"holds if {f'in [{scale * x:g}, {scale * y:g}]' if op == 'within' else f'{op} {scale * x:g}'}{unit}"


def _accuracy(m: Measurement, results: dict[str, Any]) -> tuple[str, str]:
    """(text, verdict) of an accuracy measurement: paired difference in points ± its paired standard error."""
    assert m.accuracy is not None
    run_key, key, base = m.accuracy
    data = results.get(m.file, {})
    if "variants" in data:  # a harness file (benchmarks/common.py): each row's suite under "standard"
        models = {k: r["standard"] for k, r in {"dense": data.get("dense", {}), **data["variants"]}.items()
                  if "standard" in r}
    else:
        models = data.get(run_key, {}).get("models", {})
    absent = [k for k in (key, base) if k not in models]
    if absent:
        why = m.pending or f"no `{'`, `'.join(absent)}` in {m.file}.json run {run_key}"
        return f"{NOT_MEASURED}: {why}", NOT_MEASURED
    diff, se = paired_difference(models[key]["items"], models[base]["items"])
    verdicts = {_holds(m.holds_if, diff + s * 2 * se) for s in (-1, 0, 1)}
    verdict = "within noise" if len(verdicts) > 1 else "holds" if verdicts == {True} else "fails"
    acc = {k: 100 * models[k]["average"]["acc"] for k in (key, base)}
    text = f"{acc[key]:.1f} vs {acc[base]:.1f} (Δ {100 * diff:+.1f} ± {100 * se:.1f}; {_rule(m, 100, ' pts')})"
    return text, verdict


def _find(results: dict[str, Any], file: str, path: tuple[str, ...], median_over: tuple[str, ...] = ()
          ) -> float | str:
    """The number at `path` of results/<file>.json; with `median_over`, the median over the rows whose variant key
    (path[1]) carries each suffix."""
    if file not in results:
        return f"no {file}.json"
    if not median_over:
        return _lookup(results[file], path, file)
    values = [_lookup(results[file], (path[0], path[1] + suffix, *path[2:]), file) for suffix in median_over]
    missing = [v for v in values if isinstance(v, str)]
    return missing[0] if missing else statistics.median(v for v in values if isinstance(v, float))


def _other_windows(results: dict[str, Any], file: str, other: str) -> str | None:
    """Why a baseline of another file is not comparable: both files record a dense perplexity and they differ
    (other evaluation windows). None when comparable or when either file records none."""
    ppl = [results.get(f, {}).get("dense", {}).get("ppl") for f in (file, other)]
    if all(isinstance(p, dict) and p for p in ppl) and ppl[0] != ppl[1]:
        return f"{file}.json and {other}.json evaluate different windows (their dense perplexities differ)"
    return None


def _number(m: Measurement, results: dict[str, Any]) -> tuple[str, str]:
    """(text, verdict) of a measurement read from JSON paths."""
    value = _find(results, m.file, m.value, m.median_over)
    base = None if m.baseline is None else _find(results, m.baseline_file or m.file, m.baseline, m.median_over)
    if m.baseline_file and isinstance(value, float) and isinstance(base, float):
        base = _other_windows(results, m.file, m.baseline_file) or base
    if isinstance(value, str) or isinstance(base, str):
        return f"{NOT_MEASURED}: {m.pending or (value if isinstance(value, str) else base)}", NOT_MEASURED
    if base is None:
        return f"{_num(value)} ({_rule(m)})", "holds" if _holds(m.holds_if, value) else "fails"
    q = value / base if m.compare == "ratio" else value - base
    name = "ratio" if m.compare == "ratio" else "Δ"
    verdict = "holds" if _holds(m.holds_if, q) else "fails"
    runs = f"medians of {len(m.median_over)} runs; " if m.median_over else ""
    return f"{_num(value)} vs {_num(base)} ({runs}{name} {_num(q)}; {_rule(m)})", verdict


def measure(m: Measurement, results: dict[str, Any]) -> tuple[str, str]:
    """(the cell's text, its verdict: holds / fails / within noise / not measured)."""
    text, verdict = _accuracy(m, results) if m.accuracy is not None else _number(m, results)
    label = f"{m.label}: " if m.label else ""
    return f"{label}{text} **{verdict}**" if verdict != NOT_MEASURED else f"{label}{text}", verdict


def overall(verdicts: list[str]) -> str:
    """A claim's verdict over its measured cells: holds / fails when all agree, else each count."""
    measured = [v for v in verdicts if v != NOT_MEASURED]
    if not measured:
        return NOT_MEASURED
    kinds = [k for k in ("holds", "fails", "within noise") if k in measured]
    return kinds[0] if len(kinds) == 1 else "mixed: " + ", ".join(f"{measured.count(k)} {k}" for k in kinds)


def claims_section(claims: list[Claim], results: dict[str, Any]) -> list[str]:
    out = [f"## {TITLE}", "",
           "One row per claim of the four papers (and of this project's own methods), generated by "
           "`benchmarks/report_claims.py` from `benchmarks/claims.yaml` and `benchmarks/results/`: each cell is the "
           "measured number (ratios to dense unless stated) beside its baseline from the same evaluation, and the "
           "rule that makes it hold; the verdict is computed from the numbers. Accuracy cells are the standard "
           "suite's average (section \"Standard zero-shot suite on the Summary's headline rows\"), differences "
           "paired on the same items ± paired standard error; \"within noise\": the verdict would flip within two "
           "paired standard errors. \"not measured\" says what is missing. The papers' numbers are on their "
           "models (OPT, Llama-2/3, BERT, DeepSeek-R1-Distill-8B) and tasks, so only directions compare exactly. "
           "The notes' testable properties, each mapped to its test: "
           "[docs/paper-properties.md](docs/paper-properties.md).",
           "", "| paper | claim | paper's number (setting) | " + " | ".join(MODELS.values())
           + " | verdict | where it fails: what was tried |", "|---|---|---|" + "---|" * len(MODELS) + "---|---|"]
    for c in claims:
        cells, verdicts = [], []
        for model in MODELS:
            cell = c.cells.get(model, "no result for this model")
            if isinstance(cell, str):
                cells.append(f"{NOT_MEASURED}: {cell}")
                continue
            texts = [measure(m, results) for m in cell]
            cells.append("; ".join(t for t, _ in texts))
            verdicts += [v for _, v in texts]
        verdict = overall(verdicts)
        tried = c.tried if c.tried and "fails" in verdicts else "–"
        out.append(f"| {c.paper} | {c.claim} | {c.paper_number} | {' | '.join(cells)} | {verdict} | {tried} |")
    return out + [""]

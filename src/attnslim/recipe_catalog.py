"""The packaged recipes and what was measured of each (`attnslim recipes`).

No figure is written here: a recipe's headline is read from the benchmark results (`benchmarks/results/*.json` of a
source checkout, or `--results DIR`). A result's variant measures a packaged recipe when its recorded recipe builds the
same model: the same steps (layers, and each method's arguments compared after the method filled in its defaults), the
same calibration and the same heal; name and description do not count. A variant that records no recipe (the lisa and
atp runs record only their method's arguments, not the calibration) or whose recipe no longer builds measures no
packaged recipe, and the recipe reads "not measured". Per model the headline is taken from a result that
BENCHMARKS.md cites (a current section) before one only the archive cites (a superseded run, such as Gemma-3 scored
without its <bos>), then by file name. Results do not record the code's commit, so a run made before a method's default
changed still matches: the BENCHMARKS.md section of the result file says what was run.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnslim.errors import AttnslimError
from attnslim.methods import lookup_method
from attnslim.recipe import RECIPES_DIR, Recipe, load_recipe, recipe_from_dict
from attnslim.safe_files import read_json


@dataclass(frozen=True)
class Measured:
    """One variant of one result file that measured a recipe, on one model."""

    result: str  # the result file's stem (benchmarks/results/NAME.json)
    current: bool  # cited by BENCHMARKS.md (False: archived, or no BENCHMARKS.md beside the results)
    variant: str
    model: str
    kv: float  # KV bytes per token as a fraction of the dense model's
    wiki: float | None  # wiki perplexity as a multiple of the dense model's
    kept_total: float | None  # kept fraction of all parameters
    decode: float | None  # decode tokens/s as a multiple of dense's, where the run timed it


@dataclass(frozen=True)
class CatalogEntry:
    """A packaged recipe (by the name `--recipe` takes), its purpose, and its measurements, one per model."""

    name: str
    description: str
    methods: tuple[str, ...]
    measured: tuple[Measured, ...]


def default_results_dir() -> Path:
    """benchmarks/results of the source checkout this package runs from (absent from an installed wheel)."""
    return Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _built(recipe: Recipe) -> tuple[Any, ...] | None:
    """What of a recipe decides the model it builds; None if a step's method or arguments no longer exist."""
    steps = []
    for step in recipe.steps:
        try:
            method = lookup_method(step.method).from_args(step.args)
        except AttnslimError:
            return None
        steps.append((step.layers, method))
    return tuple(steps), recipe.calibration, recipe.heal


def cited_results(results: Path) -> set[str]:
    """Stems of the result files BENCHMARKS.md (two folders above `results`) cites: its current sections'."""
    report = results.parent.parent / "BENCHMARKS.md"
    if not report.is_file():
        return set()
    return set(re.findall(r"benchmarks/results/([\w.+-]+)\.json", report.read_text(encoding="utf-8")))


def _measured(result: tuple[str, bool], model: str, variant: str, run: Mapping[str, Any],
              dense: Mapping[str, Any]) -> Measured:
    ratio = run.get("ppl_ratio", {})
    speed = run.get("speed", {})
    return Measured(*result, variant, model, kv=run["kv_bytes_per_token"] / dense["kv_bytes_per_token"],
                    wiki=ratio.get("wiki"), kept_total=run.get("kept", {}).get("total"),
                    decode=speed.get("decode_ratio") if isinstance(speed, Mapping) else None)


def _variants(results: Path) -> Iterable[tuple[tuple[Any, ...], Measured]]:
    """(what the variant's recipe builds, its headline) for every variant of every result that records a recipe."""
    cited = cited_results(results)
    for path in sorted(results.glob("*.json"), key=lambda p: (p.stem not in cited, p.stem)):
        data = read_json(path, "benchmark result", fix="regenerate it with its benchmarks/ script")
        if not isinstance(data, dict) or not isinstance(data.get("variants"), dict) or "dense" not in data:
            continue  # kernel timings, probes and reports: no model variants against a dense model
        for key, run in data["variants"].items():
            if not isinstance(run, dict) or not isinstance(run.get("recipe"), dict) or "kv_bytes_per_token" not in run:
                continue
            try:
                built = _built(recipe_from_dict(run["recipe"]))
            except AttnslimError:
                continue  # a recipe today's code no longer reads measures no packaged recipe
            if built is not None:
                model = str(data.get("model", "?"))
                yield built, _measured((path.stem, path.stem in cited), model, key, run, data["dense"])


def catalog(results: Path | None = None) -> list[CatalogEntry]:
    """Every packaged recipe in name order, with its measurements in `results` (default: the checkout's); per model
    the first result that measured it, those BENCHMARKS.md cites first."""
    results = default_results_dir() if results is None else results
    variants = list(_variants(results)) if results.is_dir() else []
    entries = []
    for path in sorted(RECIPES_DIR.glob("*.yaml"), key=lambda p: p.stem):
        recipe = load_recipe(path)
        built = _built(recipe)
        per_model: dict[str, Measured] = {}
        for other, measured in variants:
            if other == built:
                per_model.setdefault(measured.model, measured)
        entries.append(CatalogEntry(path.stem, recipe.description, tuple(s.method for s in recipe.steps),
                                    tuple(per_model.values())))
    return entries


def _headline(m: Measured) -> str:
    wiki = "wiki not measured" if m.wiki is None else f"wiki ppl {m.wiki:.3f}x"
    kept = "" if m.kept_total is None else f", params {m.kept_total:.3f}"
    decode = "decode not timed" if m.decode is None else f"decode {m.decode:.2f}x"
    where = f"{m.result}.json: {m.variant}" + ("" if m.current else ", not in a current BENCHMARKS.md section")
    return f"{m.model}: KV {m.kv:.2f}x, {wiki}{kept}, {decode} (dense = 1; {where})"


def format_catalog(entries: list[CatalogEntry], results: Path) -> str:
    """The catalog as text: a recipe per block, its purpose on the first line, then one headline per model."""
    lines = []
    for entry in entries:
        lines.append(f"{entry.name:<15} {entry.description}")
        if entry.measured:
            lines += [f"{'':<15}   {_headline(m)}" for m in entry.measured]
        else:
            lines.append(f"{'':<15}   not measured (no result in {results} records this recipe)")
    lines.append("")
    if not results.is_dir():
        lines.append(f"no results at {results}: a source checkout has benchmarks/results/; give --results DIR")
    lines.append("Use one: attnslim compress MODEL --recipe NAME --out DIR; each headline's section in BENCHMARKS.md "
                 "(by its result file) says how it was run.")
    return "\n".join(lines)

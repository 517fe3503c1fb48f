"""benchmarks/summary_accuracy.py scores the models the Summary's rows measured: the recipes it rebuilds are the
recorded ones (no model is loaded here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import summary_accuracy  # noqa: E402
from make_report import HEADLINES  # noqa: E402

from attnslim.recipe import fingerprint  # noqa: E402


def test_every_scorable_headline_key_once() -> None:
    keys = summary_accuracy.headline_keys("smollm2-135m")
    names = [k for _, k in keys]
    assert len(names) == len(set(names))  # svdllm-attn-80 is two rows' model: compressed and scored once
    for _method, name, key, base, _ in HEADLINES:
        if name in summary_accuracy.SKIPPED:
            assert key not in names
            continue
        assert key in names and base in names


def test_rebuilt_recipes_are_the_recorded_ones() -> None:
    for name, key in summary_accuracy.headline_keys("smollm2-135m"):
        row = json.loads((BENCHMARKS / "results" / f"{name}.json").read_text())["variants"][key]
        recipe = summary_accuracy.recorded_recipe(name, key)
        if "recipe_fingerprint" in row:
            assert fingerprint(recipe) == row["recipe_fingerprint"], key
        else:  # lisa.py's rows: the recorded method, layers and distillation budget
            step = recipe.steps[0]
            assert (step.method, list(step.layers)) == (row["method"], row["layers"]), key
            assert ("train" in step.args) == row["training"]["trained"], key
            if "train" in step.args:
                assert step.args["train"]["steps"] == row["training"]["steps"]


def test_two_runs_of_one_model_keep_each_others_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each write re-reads the file: a run that started before another wrote must not erase the other's row."""
    monkeypatch.setattr(summary_accuracy, "PATH", tmp_path / "summary_accuracy.json")
    header = {"model": "m", "limit": 5, "tasks": ["piqa"], "models": {}}
    summary_accuracy.save_row("m@limit5", header, "a", {"average": 1})  # run 1
    summary_accuracy.save_row("m@limit5", header, "b", {"average": 2})  # run 2, same header object
    models = json.loads((tmp_path / "summary_accuracy.json").read_text())["m@limit5"]["models"]
    assert models == {"a": {"average": 1}, "b": {"average": 2}}
    assert header["models"] == {}

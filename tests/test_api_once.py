"""One `attnslim compress` resolves its inputs once (issue 47, code review section 8.5): each step's `Method` is
built once and the input's config.json is read once, in memory and with --offload. Before, the methods were built
four times (the CLI's check, the memory estimate, `compress`) and config.json read six times (two skeletons for the
memory estimate and the loader, each reading it once to check and once more through transformers). `compress --kv`
built the planned recipe's methods twice (the planner's check, then `compress`)."""

from __future__ import annotations

import builtins
import io
import json
import os
from collections import Counter
from pathlib import Path

import pytest

import attnslim.api
from attnslim.cli import main as cli_main
from attnslim.methods import lookup_method
from attnslim.recipe import dump_recipe, recipe_from_dict
from conftest import tiny_llama
from helpers import SavingTokenizer

STEPS = [("svd", [0], {"ratio": 0.5}), ("asvd", [1], {"ratio": 0.5}), ("svd", [2], {"ratio": 0.25})]


@pytest.fixture
def dense_dir(tmp_path: Path) -> Path:
    """A tiny Llama saved as a Hugging Face directory (the input of `compress`)."""
    directory = tmp_path / "dense"
    tiny_llama().save_pretrained(directory)
    SavingTokenizer().save_pretrained(directory)
    return directory


def _count_builds(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts `from_args` calls per method name (the one way a recipe step becomes a Method)."""
    builds: Counter[str] = Counter()
    for name in {name for name, _, _ in STEPS}:
        cls = lookup_method(name)
        real = cls.from_args.__func__  # type: ignore[attr-defined]

        def spy(klass, args, _real=real, _name=name):  # type: ignore[no-untyped-def]
            builds[_name] += 1
            return _real(klass, args)

        monkeypatch.setattr(cls, "from_args", classmethod(spy))
    return builds


def _count_opens(monkeypatch: pytest.MonkeyPatch, target: Path) -> list[str]:
    """Every open of `target` by Python code (attnslim's readers and transformers' both go through `open`;
    pathlib's through `io.open`)."""
    opened: list[str] = []
    real_open = builtins.open
    target = target.resolve()

    def spy(file, *args, **kwargs):  # type: ignore[no-untyped-def]
        if isinstance(file, str | os.PathLike) and Path(file).resolve() == target:
            opened.append(os.fspath(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy)
    monkeypatch.setattr(io, "open", spy)
    return opened


@pytest.mark.parametrize("offload", [False, True], ids=["in-memory", "offload"])
def test_compress_builds_each_method_once_and_reads_config_once(offload, dense_dir, tmp_path, monkeypatch, capsys):
    recipe = recipe_from_dict({
        "name": "three-steps", "calibration": {"source": "tiny", "windows": 2, "seq_len": 32},
        "steps": [{"method": m, "layers": layers, "args": args} for m, layers, args in STEPS],
    })
    dump_recipe(recipe, tmp_path / "recipe.yaml")
    builds = _count_builds(monkeypatch)
    opened = _count_opens(monkeypatch, dense_dir / "config.json")
    out = tmp_path / "out"
    argv = ["compress", str(dense_dir), "--recipe", str(tmp_path / "recipe.yaml"), "--out", str(out),
            *(["--offload"] if offload else [])]
    assert cli_main(argv) == 0, capsys.readouterr().err
    assert builds == Counter(name for name, _, _ in STEPS)  # {"svd": 2, "asvd": 1}: once per step
    assert len(opened) == 1, opened
    assert (out / "compression.json").is_file()


def test_compress_kv_builds_each_planned_method_once(dense_dir, tmp_path, monkeypatch, capsys):
    """`compress --kv`: the plan's recipe is checked once (planner/assemble.py) and its methods go to `compress`.
    `api.check_recipe` is where a recipe's steps become Methods (`lookup_method(step.method).from_args`); the
    planner's per-candidate trials build theirs in planner/costs.py, which this spy does not count."""
    builds: Counter[str] = Counter()
    real = attnslim.api.lookup_method

    def spy(name):  # type: ignore[no-untyped-def]
        builds[name] += 1
        return real(name)

    monkeypatch.setattr(attnslim.api, "lookup_method", spy)
    out = tmp_path / "out"
    argv = ["compress", str(dense_dir), "--kv", "0.6", "--candidates", "keep,mla,drop", "--ladder", "0.5",
            "--calib-source", "tiny", "--calib-windows", "4", "--score-windows", "2", "--rounds", "1",
            "--out", str(out)]
    assert cli_main(argv) == 0, capsys.readouterr().err
    steps = json.loads((out / "compression.json").read_text())["recipe"]["steps"]
    assert steps and builds == Counter(step["method"] for step in steps)  # once per step, not twice

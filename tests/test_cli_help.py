"""The command line explains itself: every --help shows an example that parses, `compress --help` names the packaged
recipes and what MODEL may be, and `attnslim recipes` reads each recipe's headline from the results, never from code."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from attnslim import cli_parsers
from attnslim.cli import build_parser
from attnslim.cli import main as cli_main
from attnslim.recipe import load_recipe, recipe_to_dict
from attnslim.recipe_catalog import catalog


def _subparsers():
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return parser, action.choices


def test_every_command_shows_an_example_that_parses():
    parser, commands = _subparsers()
    assert set(commands) == set(cli_parsers.EXAMPLES)  # a new command without an example fails here
    for name, sub in commands.items():
        example = cli_parsers.EXAMPLES[name]
        assert f"example:\n  {example}" in sub.format_help()
        argv = shlex.split(example)
        assert argv[:2] == ["attnslim", name]
        assert parser.parse_args(argv[1:]).command == name  # argparse exits on an example that does not parse


def test_compress_help_names_the_recipes_and_what_model_may_be():
    from attnslim.models import ZOO
    from attnslim.recipe import RECIPES_DIR

    assert cli_parsers.PACKAGED_MODELS == tuple(ZOO) and cli_parsers.RECIPES_DIR == RECIPES_DIR
    text = " ".join(_subparsers()[1]["compress"].format_help().split())
    for recipe in sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")):
        assert f" {recipe}," in text or f" {recipe}." in text, recipe
    for model in ZOO:
        assert model in text
    assert "local Hugging Face directory" in text and "not an attnslim output" in text


def _result(tmp_path: Path, stem: str, variants: dict, model: str = "smollm2-135m") -> None:
    data = {"model": model, "dense": {"kv_bytes_per_token": 1000.0}, "variants": variants}
    (tmp_path / f"{stem}.json").write_text(json.dumps(data))


def _variant(recipe: dict, kv: float, wiki: float, decode: float | None = None) -> dict:
    run = {"recipe": recipe, "kv_bytes_per_token": kv, "ppl_ratio": {"wiki": wiki}, "kept": {"total": 0.9}}
    return run if decode is None else {**run, "speed": {"decode_ratio": decode}}


def test_a_recipe_is_measured_by_a_run_that_builds_the_same_model(tmp_path):
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    svd = recipe_to_dict(load_recipe("svd"))
    same = {**svd, "name": "another-name", "steps": [{**svd["steps"][0], "args": {
        **svd["steps"][0]["args"], "linears": ["q", "k", "v", "o"]}}]}  # written differently, builds the same
    other_ratio = {**svd, "steps": [{**svd["steps"][0], "args": {**svd["steps"][0]["args"], "ratio": 0.5}}]}
    other_data = {**svd, "calibration": {**svd["calibration"], "windows": 3}}
    _result(results, "a-old", {"svd-x": _variant(same, 1000.0, 9.0)})
    _result(results, "b-new", {"svd-80": _variant(same, 500.0, 1.25, decode=1.5),
                               "svd-50": _variant(other_ratio, 250.0, 2.0),
                               "svd-cal3": _variant(other_data, 1000.0, 3.0)})
    _result(results, "c-gemma", {"svd-80": _variant(same, 400.0, 1.5)}, model="gemma3-270m")
    (tmp_path / "BENCHMARKS.md").write_text("Command: ... → `benchmarks/results/b-new.json`\n"
                                            "→ `benchmarks/results/c-gemma.json`\n")
    entries = {e.name: e for e in catalog(results)}
    measured = {m.model: m for m in entries["svd"].measured}
    assert set(measured) == {"smollm2-135m", "gemma3-270m"}
    first = measured["smollm2-135m"]  # the run BENCHMARKS.md cites wins over a-old, which sorts first by name
    assert (first.result, first.variant, first.current) == ("b-new", "svd-80", True)
    assert (first.kv, first.wiki, first.decode) == (0.5, 1.25, 1.5)
    assert measured["gemma3-270m"].kv == 0.4
    assert entries["svdllm"].measured == () and entries["default"].measured == ()


def test_recipes_command_prints_headlines_and_says_not_measured(tmp_path, capsys):
    svd = recipe_to_dict(load_recipe("svd"))
    _result(tmp_path, "runs", {"svd-80": _variant(svd, 500.0, 1.25)})
    assert cli_main(["recipes", "--results", str(tmp_path), "--json"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    svd_line = lines[next(i for i, line in enumerate(lines) if line.startswith("svd ")) + 1]
    assert "KV 0.50x" in svd_line and "wiki ppl 1.250x" in svd_line and "decode not timed" in svd_line
    # no BENCHMARKS.md beside the results: no run is current
    assert "runs.json: svd-80, not in a current BENCHMARKS.md section" in svd_line
    nbl_line = lines[next(i for i, line in enumerate(lines) if line.startswith("nbl ")) + 1]
    assert "not measured" in nbl_line
    listed = json.loads(lines[-1])["recipes"]
    assert [r["name"] for r in listed] == sorted(p.stem for p in cli_parsers.RECIPES_DIR.glob("*.yaml"))


@pytest.mark.parametrize("argv,message", [
    (["recipes", "--results", "{tmp}/absent"], "--results {tmp}/absent: not a directory"),
])
def test_recipes_refuses_a_missing_results_folder(argv, message, tmp_path, capsys):
    assert cli_main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    assert message.replace("{tmp}", str(tmp_path)) in capsys.readouterr().err

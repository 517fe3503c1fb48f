"""Calibration that follows the model (issue 45, item 7): one recipe calibrated on Wikipedia text, on text the dense
model samples itself (`self`, data/generated.py) and on a mixture, each scored on wiki, ptb, c4 and code (the
exllamav3 code snippets: the domain of a code model, and part of SmolLM2's training mix).

The question: does wiki-only calibration strip a model of its own domain, and does `self` keep it, at what cost
on wiki? Rows `RECIPE-calibSOURCE`, one results file per model (benchmarks/results/calib-source-MODEL.json); the
recipe's calibration keeps its windows, lengths and seed, only the source changes. `--heal`: each row also with the
recipe's heal on the same source when that samples the model (planner.run.standard_heal's rule), else as written;
`--one-shot`: without the recipe's heal. `--windows N`: N calibration windows instead of the recipe's, for a
model where sampling the recipe's count from the dense model costs too much on the CPU (the 1.5B coder model:
recipes/mla.yaml's conversion without its heal and without the output refit, whose token rule would ask 73 windows
there, as benchmarks/scale_real.py's `mla` rows; the row name records the count).

    python benchmarks/calib_source.py --model smollm2-135m --recipe mla-oneshot --calib wiki,self,self+wiki
    python benchmarks/calib_source.py --model qwen2.5-1.5b --recipe mla --one-shot --windows 8 --tokens 2048
"""

from __future__ import annotations

import argparse
from typing import Any

from common import Harness

from attnslim.planner.run import standard_heal
from attnslim.recipe import load_recipe, recipe_to_dict


def with_source(recipe: dict[str, Any], source: str, heal: bool, one_shot: bool = False,
                windows: int | None = None) -> dict[str, Any]:
    """`recipe` calibrated on `source` (its windows, lengths and seed kept unless `windows` is given); with `heal`,
    the default heal on it; with `one_shot`, no heal at all."""
    calibration = {**recipe["calibration"], "source": source, **({"windows": windows} if windows else {})}
    name = recipe["name"] + ("-oneshot" if one_shot else "") + (f"-w{windows}" if windows else "")
    out = {**recipe, "name": f"{name}-calib{source}", "calibration": calibration}
    if one_shot:
        out.pop("heal", None)
    if heal:
        out["heal"] = standard_heal(source)
        out["name"] += "-heal"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--recipe", default="mla-oneshot", help="a packaged recipe name")
    p.add_argument("--calib", default="wiki,self,self+wiki", help="calibration sources to compare")
    p.add_argument("--sources", default="wiki,ptb,c4,code", help="evaluation texts")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--heal", action="store_true")
    p.add_argument("--one-shot", action="store_true", help="drop the recipe's own heal")
    p.add_argument("--windows", type=int, help="calibration windows of the recipe's length (default: the recipe's)")
    args = p.parse_args()
    if args.heal and args.one_shot:
        p.error("--heal and --one-shot contradict each other: give one")
    harness = Harness(f"calib-source-{args.model}", args.model, tuple(args.sources.split(",")), args.tokens)
    recipe = recipe_to_dict(load_recipe(args.recipe))
    for source in args.calib.split(","):
        row = with_source(recipe, source, args.heal, args.one_shot, args.windows)
        harness.run(row["name"], row)


if __name__ == "__main__":
    main()

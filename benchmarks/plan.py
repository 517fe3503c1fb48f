"""The planner against single-method recipes at the same KV budget, one-shot (issue 45).

For each budget: `attnslim plan`'s recipe (planned on calibration text, timed), uniform `mla` with refit_o (the
best one-shot single method, recipes/mla-oneshot.yaml at that kv_ratio) and `transmla`, each compressed from the
same model and scored on the same evaluation windows by the benchmark harness (benchmarks/common.py). The
candidates are measured once for all budgets (plan seconds: that measurement plus the budget's solve and
refinement). Rows go to
benchmarks/results/plan-MODEL.json; each planned row carries its plan report (choices, additive estimate against
the measured whole-plan KL, plan seconds).

    python benchmarks/plan.py --budgets 0.5,0.25 --sources wiki
    ATTNSLIM_BENCH_DEVICE=cuda python benchmarks/plan.py ...     # on a GPU (benchmarks/common.py)

`--heal 0.25`: at those budgets the plan and uniform `mla` also get the standard heal (recipes/default.yaml's:
40 steps of logit distillation on wiki + c4 + TinyStories), rows `plan-kvF-heal40` and `mla-kvF-heal40`.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from typing import Any

from common import Harness, calibration, load_on_device

from attnslim.planner.candidates import DEFAULT_KINDS, DEFAULT_LADDER
from attnslim.planner.run import PlanConfig, choose, prepare
from attnslim.recipe import Calibration, load_recipe, recipe_to_dict

STANDARD_HEAL = load_recipe("default").heal  # the demo recipe's heal


def baseline(method: str, kv: float) -> dict[str, Any]:
    """A single-method row at `kv`: mla with refit_o (recipes/mla-oneshot.yaml's one-shot fit), others as they are."""
    args = {"kv_ratio": kv, **({"refit_o": True} if method == "mla" else {})}
    return {"name": f"{method}-kv{kv:g}", "calibration": calibration(),
            "steps": [{"method": method, "layers": "all", "args": args}]}


def _plans(model_name: str, budgets: list[float], args: argparse.Namespace
           ) -> list[tuple[float, dict[str, Any], dict[str, Any]]]:
    """One measurement of every candidate (planner.run.prepare), then a plan per budget: (kv, recipe, summary)."""
    model, tokenizer = load_on_device(model_name)
    cfg = PlanConfig(kv=min(budgets), kinds=tuple(args.candidates.split(",")),
                     ladder=tuple(float(f) for f in args.ladder.split(",")), score_windows=args.score_windows,
                     refine_windows=args.score_windows, rounds=args.rounds, calibration=Calibration(**calibration()))
    prepared = prepare(model, tokenizer, cfg)
    out = []
    for kv in budgets:
        start = time.time()
        result = choose(model, prepared, replace(cfg, kv=kv))
        report = result.report
        summary = {"plan_seconds": round(prepared.seconds + time.time() - start, 1),
                   "plan_measure_seconds": round(prepared.seconds, 1),
                   "plan_layers": [r["choice"] for r in report["layers"]], "plan_used": report["used"],
                   "plan_estimate": report["estimate"], "plan_refine": report["refine"],
                   "plan_starts": report["starts"], "plan_start": report["start"],
                   "plan_config": report["config"], "plan_windows": report["windows"]}
        out.append((kv, recipe_to_dict(result.recipe), summary))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--budgets", default="0.5,0.25")
    p.add_argument("--sources", default="wiki", help="evaluation texts, comma-separated (wiki,ptb,c4)")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--candidates", default=",".join(DEFAULT_KINDS))
    p.add_argument("--ladder", default=",".join(f"{f:g}" for f in DEFAULT_LADDER))
    p.add_argument("--score-windows", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--baselines", default="mla,transmla", help="single-method rows beside each plan")
    p.add_argument("--name", default=None, help="results file stem (default plan-MODEL)")
    p.add_argument("--heal", default="", help="budgets whose plan and uniform mla also get the standard heal")
    args = p.parse_args()
    harness = Harness(args.name or f"plan-{args.model}", args.model, tuple(args.sources.split(",")), args.tokens)
    healed = {float(b) for b in args.heal.split(",") if b}
    for kv, recipe, summary in _plans(args.model, [float(b) for b in args.budgets.split(",")], args):
        harness.run(f"plan-kv{kv:g}", recipe, summary)  # each budget's rows together: a cut run keeps pairs
        for method in filter(None, args.baselines.split(",")):
            harness.run(f"{method}-kv{kv:g}", baseline(method, kv))
        if kv in healed:
            harness.run(f"plan-kv{kv:g}-heal40", {**recipe, "heal": STANDARD_HEAL}, summary)
            harness.run(f"mla-kv{kv:g}-heal40", {**baseline("mla", kv), "heal": STANDARD_HEAL})


if __name__ == "__main__":
    main()

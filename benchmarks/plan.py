"""The planner against single-method recipes at the same KV budget, one-shot and healed (issue 45).

For each budget: `attnslim plan`'s recipe (planned on calibration text, timed) beside single-method rows at the
same KV, each compressed from the same model and scored on the same evaluation windows by the benchmark harness
(benchmarks/common.py):
- `mla` with refit_o (recipes/mla-oneshot.yaml's conversion at that kv_ratio), `transmla`;
- `nbl` and `drop` of the fewest layers that bring the KV under the budget, selected by the packaged recipes'
  criterion (recipes/nbl.yaml, recipes/drop.yaml: similarity);
- sharing (`ds`/`lisa`) has no row: a receiver keeps its own V, so sharing saves at most half of a layer's cache,
  and with its protected leading layers (methods/lisa.py: protected_layers) it cannot reach KV 0.5 or below.
The candidates are measured once for all budgets (plan seconds: that measurement plus the budget's solve and
refinement). Rows go to benchmarks/results/plan-MODEL.json; each planned row carries its plan report (choices,
additive estimate against the measured whole-plan KL, plan seconds).

    python benchmarks/plan.py --budgets 0.5,0.25 --sources wiki
    ATTNSLIM_BENCH_DEVICE=cuda python benchmarks/plan.py ...     # on a GPU (benchmarks/common.py)

`--heal 0.25`: at those budgets the plan and uniform `mla` also get the standard heal (recipes/default.yaml's:
40 steps of logit distillation on wiki + c4 + TinyStories), rows `plan-kvF-heal40` and `mla-kvF-heal40`.
`--norefit-heal 0.5`: the same heal after converting without the output refit (the plan's mla steps without refit_o;
uniform mla as recipes/default.yaml converts), rows `plan-kvF-norefit-heal40` and `mla-kvF-norefit-heal40`.
`--local 0.25`: at those budgets, the strongest single-method MLA recipe (recipes/mla-kv25.yaml: global ranks,
o_proj refit, 96 local-fit steps per layer) at that kv_ratio beside the plan given the same local fit on its mla
layers: rows `mla-kvF-local`, `plan-kvF-local` (one-shot: the local fit trains each layer alone towards the dense
attention on calibration text); where `--heal` names the budget too, also after mla-kv25's heal (40 steps of every
parameter at lr 3e-4): rows `-heal40-all`; `--heal-seeds 1,2` repeats those healed rows (the plan's and uniform
mla's) with those heal seeds (rows `-heal40-all-seedN`: the heal's data order; the fit is deterministic), so that
a target met by one heal, or a plan's lead over uniform mla, reads against the heal's own spread (each row costs a
fit and a heal); `--heal-steps 160` gives those rows a longer heal (rows `-heal160-all`).
`--global-alloc 0.5`: at those budgets the plan with its mla layers joined in one `mla` step under `alloc: global`
at their mean width (with_global; the plan still chooses which layers keep attention or lose their cache), row
`plan-kvF-global`, and with the local fit where `--local` names the budget, `plan-kvF-global-local`.
`--plans-from STEM` takes the plans an earlier run recorded in benchmarks/results/STEM.json instead of planning
again (e.g. a GPU run's plans, compressed and scored here; or the plan of a run cut before it scored it: each plan is
recorded under `planned` as soon as it is chosen: a plan's time on a large model is its `plan_seconds` there,
e.g. benchmarks/results/plan-narrow-qwen2.5-1.5b.json).
The plan's rows compress on the calibration windows the planner drew (attnslim.compress(windows=)): with `self` in
the source, the model's own text is sampled once.
`--calib-source wiki+c4+tiny`: the planner's costs, its whole-plan score and every row's fits calibrated on that text
instead of wiki (the heal's own text is unchanged unless the source holds the model's own text, `self` or a file:
then the heal is on it too, as `compress --kv --heal` heals); rows end in `-calibSOURCE`, the report sets them
against the rows calibrated on wiki. The question: wiki-only costs win the plan wiki and lose it ptb; does broader text?
`--engine vllm --baselines nbl,drop --name plan-vllm-MODEL`: plans only of what stock vLLM serves (`attnslim plan
--engine vllm`: on SmolLM2 below KV 0.83 the plugin's keep/nbl/drop), beside the single-method rows vLLM also
serves; benchmarks/serve.py serves the same budgets' plans (variants plan-vllm-kvF).
`--speed 512,4096`: decode and prefill speed of each budget's plan and uniform mla against dense, interleaved
(benchmarks/mla.py's speed group), into its own results file (`--name`):

    python benchmarks/plan.py --plans-from plan-smollm2-135m-h100 --budgets 0.25 --speed 512,4096 \
        --name plan-speed-smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from common import RESULTS, Harness, calibration, load_on_device
from mla import speed

from attnslim.adapters import get_adapter
from attnslim.data import TokenWindows
from attnslim.models import load_model
from attnslim.planner.candidates import DEFAULT_KINDS, DEFAULT_LADDER, DEFAULT_MLA_ARGS, candidate_set
from attnslim.planner.costs import resources
from attnslim.planner.run import PlanConfig, choose, prepare, standard_heal
from attnslim.recipe import Calibration, load_recipe, recipe_to_dict

LOCAL = load_recipe("mla-kv25")  # the strongest single-method MLA recipe: its conversion args and its heal
LOCAL_ARGS = {k: v for k, v in LOCAL.steps[0].args.items() if k != "kv_ratio"}  # alloc, refit_o, local_steps
DEFAULT_ARGS = {k: v for k, v in load_recipe("default").steps[0].args.items() if k != "kv_ratio"}  # no refit_o


def shape(model_name: str) -> tuple[int, float]:
    """(decoder layers, the bytes per token a KV-free layer keeps as a fraction of a dense layer's), from the
    planner's own exact costs (planner/costs.py): nbl and drop keep a position marker (modules/dropped.py), which the
    baselines' layer count must include to hold the budget."""
    model, _ = load_model(model_name)
    adapter = get_adapter(model)
    keep, drop = (resources(adapter, 0, c, context=1).kv_bytes for c in candidate_set(("keep", "drop")))
    return adapter.num_layers(), drop / keep


def baseline(method: str, kv: float, layers: int, marker: float = 0.0, source: str = "wiki") -> dict[str, Any]:
    """A single-method row at `kv` for a model of `layers` layers (`marker`: see `shape`), calibrated on `source`.
    mla: with refit_o (recipes/mla-oneshot.yaml's one-shot fit); nbl/drop: the fewest layers whose removed KV
    brings the cache to at most `kv` (similarity-selected, as the packaged recipes)."""
    removed = math.ceil((1.0 - kv) * layers / (1.0 - marker) - 1e-9)  # (L - m + m·marker) / L <= kv
    args: dict[str, Any] = {
        "mla": {"kv_ratio": kv, "refit_o": True}, "transmla": {"kv_ratio": kv},
        "mla-local": {"kv_ratio": kv, **LOCAL_ARGS}, "mla-norefit": {"kv_ratio": kv, **DEFAULT_ARGS},
        "nbl": {"m": removed, "criterion": "similarity"}, "drop": {"count": removed, "select": "similarity"},
    }[method]
    base, _, suffix = method.partition("-")
    return {"name": f"{base}-kv{kv:g}{'-' + suffix if suffix else ''}", "calibration": calibration(source=source),
            "steps": [{"method": base, "layers": "all", "args": args}]}


def without_refit(recipe: dict[str, Any]) -> dict[str, Any]:
    """`recipe` with no output refit on its mla steps (widths kept), as recipes/default.yaml converts before its heal.
    The question it answers: uniform mla at KV 0.5 heals further without the refit (mla.json's mla-kv50-heal40 rows);
    does a plan too? (BENCHMARKS.md, "Planning under a budget", rows -norefit-heal40.)"""
    steps = [{**s, "args": {k: v for k, v in s["args"].items() if k != "refit_o"}} if s["method"] == "mla" else s
             for s in recipe["steps"]]
    return {**recipe, "name": f"{recipe['name']}-norefit", "steps": steps}


def with_local(recipe: dict[str, Any]) -> dict[str, Any]:
    """`recipe` with mla-kv25's local fit (refit_o and local_steps) on every mla step (per-layer widths kept)."""
    extra = {k: v for k, v in LOCAL_ARGS.items() if k != "alloc"}  # alloc spreads one ratio: the plan set widths
    steps = [{**s, "args": {**s["args"], **extra}} if s["method"] == "mla" else s for s in recipe["steps"]]
    return {**recipe, "name": f"{recipe['name']}-local", "steps": steps}


def with_global(recipe: dict[str, Any]) -> dict[str, Any]:
    """`recipe` with its mla layers in one mla step under `alloc: global` at their mean kv_ratio: the plan chooses which
    layers keep attention, lose their cache or take a latent, and the latent budget the plan gave those layers is
    spread over them by their spectra, as uniform `mla` spreads its own (the plan's ladder widths are coarser). The
    mean is over layers: the same total KV where every layer's dense cache is the same size (SmolLM2, Gemma-3)."""
    mla = [s for s in recipe["steps"] if s["method"] == "mla"]
    if len({json.dumps({k: v for k, v in s["args"].items() if k != "kv_ratio"}, sort_keys=True) for s in mla}) != 1:
        raise SystemExit(f"{recipe['name']}: its mla steps differ beyond kv_ratio; one global step cannot join them")
    layers = sorted(i for s in mla for i in s["layers"])
    kv = sum(s["args"]["kv_ratio"] * len(s["layers"]) for s in mla) / len(layers)
    args = {**mla[0]["args"], "kv_ratio": round(kv, 6), "alloc": "global"}  # the row measures its KV
    joined = {"method": "mla", "layers": layers, "args": args}
    first = recipe["steps"].index(mla[0])  # a sharing step stays last (the recipe's own check)
    steps = [s for s in recipe["steps"][:first] if s["method"] != "mla"] + [joined] + [
        s for s in recipe["steps"][first:] if s["method"] != "mla"]
    return {**recipe, "name": f"{recipe['name']}-global", "steps": steps}


Plans = Iterator[tuple[float, dict[str, Any], dict[str, Any], TokenWindows | None]]


def _plans(model_name: str, budgets: list[float], args: argparse.Namespace) -> Plans:
    """One measurement of every candidate (planner.run.prepare), then a plan per budget: (kv, recipe, summary, the
    plan's calibration windows), each yielded as soon as it is chosen (its rows run before the next budget is
    planned)."""
    model, tokenizer = load_on_device(model_name)
    mla_args = {**DEFAULT_MLA_ARGS, "local_steps": args.local_steps} if args.local_steps else None
    cfg = PlanConfig(kv=min(budgets), kinds=tuple(args.candidates.split(",")),
                     ladder=tuple(float(f) for f in args.ladder.split(",")), score_windows=args.score_windows,
                     refine_windows=args.score_windows, rounds=args.rounds,
                     calibration=Calibration(**calibration(source=args.calib_source)),
                     mla_args=mla_args, engine=args.engine)
    prepared = prepare(model, tokenizer, cfg)
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
        yield kv, recipe_to_dict(result.recipe), summary, result.windows


def _stored_plans(stem: str, budgets: list[float], cal: str = "") -> Plans:
    """The plans an earlier run recorded in benchmarks/results/STEM.json (rows plan-kvF, or plan-kvF-calibSOURCE
    for `cal`; or, for a run cut before it scored its plan, the plan as chosen: `planned`): (kv, recipe, summary,
    None: their windows are drawn again)."""
    data = json.loads((RESULTS / f"{stem}.json").read_text())
    for kv in budgets:
        row = data["variants"].get(f"plan-kv{kv:g}{cal}") or data.get("planned", {}).get(f"plan-kv{kv:g}{cal}")
        if row is None:
            raise SystemExit(f"{stem}.json has no row plan-kv{kv:g}{cal}: plan it first (plan.py --budgets {kv:g})")
        yield kv, row["recipe"], {k: v for k, v in row.items() if k.startswith("plan_")}, None


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
    p.add_argument("--baselines", default="mla,transmla,nbl,drop", help="single-method rows beside each plan")
    p.add_argument("--name", default=None, help="results file stem (default plan-MODEL)")
    p.add_argument("--heal", default="", help="budgets whose plan and uniform mla also get the standard heal")
    p.add_argument("--baselines-only", action="store_true", help="no planning: only the single-method rows")
    p.add_argument("--speed", default="", help="contexts (e.g. 512,4096): instead of perplexity, decode and prefill "
                   "speed of each budget's plan and uniform mla against dense (mla.py's speed group; own results file)")
    p.add_argument("--repeats", type=int, default=3, help="--speed: interleaved repetitions")
    p.add_argument("--plans-from", default="", help="results file stem whose plan-kvF recipes to use (no planning)")
    p.add_argument("--local", default="", help="budgets with the local-fit rows (recipes/mla-kv25.yaml's fit)")
    p.add_argument("--norefit-heal", default="", help="budgets whose plan (its mla steps without refit_o) and "
                   "recipes/default.yaml's mla conversion also get the standard heal: rows -norefit-heal40")
    p.add_argument("--calib-source", default="wiki", help="the plan's and the baselines' calibration text (the "
                   "planner's costs and every fit); other than wiki, rows end in -calibSOURCE")
    p.add_argument("--global-alloc", default="", help="budgets whose plan also runs with its mla layers under one "
                   "global rank allocation (with_global): rows plan-kvF-global, and plan-kvF-global-local where "
                   "--local names the budget")
    p.add_argument("--heal-seeds", default="", help="heal seeds besides 0 for the -local-heal40-all rows, the "
                   "plan's and uniform mla's (rows -heal40-all-seedN)")
    p.add_argument("--heal-steps", type=int, default=0, help="the -local-healN-all rows' heal steps instead of "
                   "mla-kv25's 40 (rows -healN-all): does a longer heal reach the target, and does the plan's lead "
                   "hold?")
    p.add_argument("--engine", default="hf", choices=("hf", "vllm"), help="plan as `attnslim plan --engine`: vllm "
                   "keeps one route vLLM serves (the plugin's keep/nbl/drop, or mla at every layer at width 320/576)")
    p.add_argument("--local-steps", type=int, default=0, help="plan with every mla candidate measured after this "
                   "many local-fit steps (attnslim plan --local-steps): rows plan-kvF-local-planned")
    args = p.parse_args()
    harness = Harness(args.name or f"plan-{args.model}", args.model, tuple(args.sources.split(",")), args.tokens)
    healed = {float(b) for b in args.heal.split(",") if b}
    local = {float(b) for b in args.local.split(",") if b}
    norefit = {float(b) for b in args.norefit_heal.split(",") if b}
    joined = {float(b) for b in args.global_alloc.split(",") if b}
    seeds = [int(s) for s in args.heal_seeds.split(",") if s]
    budgets = [float(b) for b in args.budgets.split(",")]
    layers, marker = shape(args.model)
    src = args.calib_source
    cal = "" if src == "wiki" else f"-calib{src}"  # last in every row name: the report reads the rest as before
    heal = standard_heal(src)  # the default recipe's, as `compress --kv --heal` heals a plan calibrated on src
    local_heal = {**(LOCAL.heal or {}), **({"steps": args.heal_steps} if args.heal_steps else {})}
    tag = f"heal{local_heal['steps']}-all"  # the -local rows' heal: mla-kv25's, or --heal-steps long
    if args.baselines_only:
        for kv in budgets:
            for method in filter(None, args.baselines.split(",")):
                harness.run(f"{method}-kv{kv:g}{cal}", baseline(method, kv, layers, marker, src))
        return
    plans = _stored_plans(args.plans_from, budgets, cal) if args.plans_from else _plans(args.model, budgets, args)
    if args.speed:
        recipes, harness.data["plans"] = {}, {}
        for kv, recipe, summary, _ in plans:
            recipes[f"plan-kv{kv:g}"], recipes[f"mla-kv{kv:g}"] = recipe, baseline("mla", kv, layers, source=src)
            if not args.plans_from:  # planned here: the plan seconds are this machine's
                harness.data["plans"][f"plan-kv{kv:g}"] = summary
        speed(harness, recipes, list(recipes), [int(c) for c in args.speed.split(",")], new_tokens=32,
              repeats=args.repeats, cache_kind="dynamic")
        return
    planned = "-local-planned" if args.local_steps else ""  # its rivals are the -local rows (report_plan)
    for kv, recipe, summary, windows in plans:
        plan_key = f"plan-kv{kv:g}{planned}{cal}"
        if not args.plans_from:  # kept as soon as chosen: a run cut before its rows are scored keeps its plan
            harness.data.setdefault("planned", {})[plan_key] = {"recipe": recipe, **summary}  # --plans-from reads it
            harness.save()
        harness.run(plan_key, recipe, summary, windows)  # a budget's rows together: a cut run keeps pairs
        for method in filter(None, args.baselines.split(",")):
            harness.run(f"{method}-kv{kv:g}{cal}", baseline(method, kv, layers, marker, src))
        if kv in healed:
            harness.run(f"plan-kv{kv:g}-heal40{cal}", {**recipe, "heal": heal}, summary, windows)
            harness.run(f"mla-kv{kv:g}-heal40{cal}", {**baseline("mla", kv, layers, source=src), "heal": heal})
        if kv in norefit:
            harness.run(f"plan-kv{kv:g}-norefit-heal40{cal}", {**without_refit(recipe), "heal": heal},
                        summary)
            harness.run(f"mla-kv{kv:g}-norefit-heal40{cal}", {**baseline("mla-norefit", kv, layers, source=src),
                                                               "heal": heal})
        if kv in joined:
            harness.run(f"plan-kv{kv:g}-global{cal}", with_global(recipe), summary)
        if kv in local:
            pairs = [(f"plan-kv{kv:g}-local{cal}", with_local(recipe))]  # the plan first: a cut run has it
            if kv in joined:  # the global step takes the local fit as uniform mla-local does (its alloc is global)
                pairs.append((f"plan-kv{kv:g}-global-local{cal}", with_local(with_global(recipe))))
            pairs.append((f"mla-kv{kv:g}-local{cal}", baseline("mla-local", kv, layers, source=src)))
            for key, row in pairs:
                harness.run(key, row, summary if key.startswith("plan") else None)
                if kv in healed:
                    harness.run(f"{key.removesuffix(cal)}-{tag}{cal}", {**row, "heal": local_heal},
                                summary if key.startswith("plan") else None)
                    for seed in seeds:
                        harness.run(f"{key.removesuffix(cal)}-{tag}-seed{seed}{cal}",
                                    {**row, "heal": {**local_heal, "seed": seed}},
                                    summary if key.startswith("plan") else None)


if __name__ == "__main__":
    main()

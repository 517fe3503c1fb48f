"""`plan_model`: from budgets to a recipe and the report of why (the `attnslim plan` command).

    1. candidates per layer with their exact resource costs (candidates.py, costs.py); a layer that cannot take a
       candidate loses it (the method's refusal is recorded), a layer left with none is refused by name
    2. the budgets checked against what any plan reaches, before any measurement (solve.py refuses with the
       smallest reachable value)
    3. each candidate's quality cost measured alone (measure.py)
    4. the exact additive optimum (solve.py) and a few other starts (starts.py), each re-scored whole; the best
       refined (refine.py)
    5. the recipe (assemble.py) and the report
Steps 1-3 (`prepare`) do not depend on the budgets: one measurement serves several (`choose`).
Calibration: the fits use the recipe's calibration windows (what compress will use), raised as compress raises
them when a candidate's fit needs more tokens on this model (mla's output refit: api.raised_calibration); per-layer
costs and the whole-plan score use other windows of the same calibration source, drawn with seeds +1 and +2.
The source is `self+wiki` by default (PLAN_SOURCE), wiki with --offload (OFFLOAD_SOURCE): see PLAN_SOURCE.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from attnslim.adapters import get_adapter
from attnslim.adapters.base import Adapter
from attnslim.api import raised_calibration
from attnslim.api_checks import refuse_compressed
from attnslim.bench.flops import decode_bytes_per_token
from attnslim.calib.residency import InMemoryLayers, Residency
from attnslim.data import TokenWindows, calib_windows
from attnslim.data.generated import SELF
from attnslim.data.sources import mixture
from attnslim.engines import HOW
from attnslim.engines import routes as serving_routes
from attnslim.errors import AttnslimError
from attnslim.methods import Method
from attnslim.planner.assemble import choice_table, installed, plan_recipe
from attnslim.planner.candidates import DEFAULT_KINDS, DEFAULT_LADDER, SHARING, Candidate, candidate_set
from attnslim.planner.costs import Resources, method_of, resources
from attnslim.planner.measure import Measured, measure
from attnslim.planner.refine import Refined, refine
from attnslim.planner.routes import ANY, route_rows
from attnslim.planner.score import ScoreSet, kl, score_set
from attnslim.planner.solve import Budget, Option, Solution, solve
from attnslim.planner.starts import start_plans
from attnslim.recipe import Calibration, Recipe, load_recipe

# The planner's default calibration: half text the dense model samples itself (data/generated.py), half Wikipedia.
# Why not wiki alone, the recipes' default: the planner picks the layers to compress by their cost on calibration
# text, so wiki alone strips a model of its own domain (code), which self+wiki keeps for a little on wiki, ptb and c4:
# BENCHMARKS.md, "Planning under a budget, calibrated on the model's own text"; docs/planning.md says why.
PLAN_SOURCE = "self+wiki"
OFFLOAD_SOURCE = "wiki"  # with --offload, which keeps the dense model on disk, where `self` cannot sample it


def _plan_calibration() -> Calibration:
    return Calibration(source=PLAN_SOURCE)


@dataclass(frozen=True)
class PlanConfig:
    kv: float  # kept fraction of the dense KV cache (bytes per token)
    params: float | None = None  # kept fraction of the dense model's parameters
    decode_bytes: float | None = None  # kept fraction of the bytes a dense decode step reads at `decode_at`
    decode_at: int = 4096
    engine: str = "hf"
    kinds: tuple[str, ...] = DEFAULT_KINDS
    ladder: tuple[float, ...] = DEFAULT_LADDER
    calibration: Calibration = field(default_factory=_plan_calibration)
    score_windows: int = 4  # per-layer cost windows (scored at their second half)
    score_seq_len: int = 256
    refine_windows: int = 4  # held-out windows of the whole-plan score
    rounds: int = 4  # refinement rounds (0: no refinement, the solver's plan)
    tries: int = 6  # changes measured per round
    mla_args: dict[str, Any] | None = None
    nbl_args: dict[str, Any] | None = None
    heal: dict[str, Any] | None = None  # the plan's heal (recipe `heal:` block); None: one-shot
    fit_steps: int = 0  # local-fit steps on the chosen mla layers, after planning (their costs measured without)

    def __post_init__(self) -> None:
        """Settings no plan can use are refused here, before any model is measured (minutes later otherwise): for
        the CLI too, whose budget messages name the flag (solve.NAMES); it checks its integer flags first."""
        for resource, value in (("kv", self.kv), ("params", self.params), ("decode", self.decode_bytes)):
            if value is not None:
                Budget(resource, value, 1.0)
        for name, low in (("decode_at", 1), ("score_windows", 1), ("score_seq_len", 2), ("refine_windows", 1),
                          ("rounds", 0), ("tries", 1), ("fit_steps", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise AttnslimError(f"PlanConfig.{name}={value!r}: give an integer >= {low}")
        candidate_set(self.kinds, self.ladder, self.engine, self.mla_args, self.nbl_args)
        if self.fit_steps and "mla" not in self.kinds:
            raise AttnslimError(f"fit_steps={self.fit_steps} (--fit-steps) fits the plan's mla layers, and mla is not "
                                f"among the candidates {list(self.kinds)}: add it, or leave the fit out")
        if self.fit_steps and (self.mla_args or {}).get("local_steps"):
            raise AttnslimError("fit_steps (--fit-steps: fit the chosen mla layers after planning) and local_steps in "
                                "mla_args (--local-steps: fit every candidate before measuring it, and the plan's "
                                "layers too) both fit the plan's mla layers: give one")

    def budgets_text(self) -> str:
        parts = [f"kv {self.kv:g}"]
        if self.params is not None:
            parts.append(f"params {self.params:g}")
        if self.decode_bytes is not None:
            parts.append(f"decode bytes {self.decode_bytes:g} at {self.decode_at}")
        return ", ".join(parts)


@dataclass
class PlanResult:
    recipe: Recipe
    report: dict[str, Any]
    methods: list[Method]  # the recipe's steps as check_recipe built them: compress(methods=) builds none again
    windows: TokenWindows  # the fit windows, drawn under recipe.calibration: compress(windows=) samples none again


def layer_options(adapter: Adapter, cands: Sequence[Candidate], context: int, engine: str
             ) -> tuple[list[list[tuple[Candidate, Resources]]], dict[str, dict[str, str]]]:
    """Per layer the candidates it can take with their costs; the refusals of the others, per layer."""
    out: list[list[tuple[Candidate, Resources]]] = []
    refused: dict[str, dict[str, str]] = {}
    for i in range(adapter.num_layers()):
        row = []
        for c in cands:
            try:
                row.append((c, resources(adapter, i, c, context)))
            except AttnslimError as err:
                refused.setdefault(str(i), {})[c.label] = str(err)
        if not row:
            why = "; ".join(f"{k}: {v}" for k, v in refused.get(str(i), {}).items())
            raise AttnslimError(f"layer {i}: engine {engine!r} serves none of the candidates "
                                f"{[c.label for c in cands]} for it ({why}); offer keep (--candidates keep,...) "
                                "or use --engine hf")
        out.append(row)
    return out, refused


def _budgets(model: Any, adapter: Adapter, cfg: PlanConfig, dense: list[Resources]) -> list[Budget]:
    """The budgets as rows over the attention's per-layer costs; the rest of the model is the fixed part."""
    kv_total = sum(r.kv_bytes for r in dense)
    out = [Budget("kv", cfg.kv, kv_total)]
    if cfg.params is not None:
        total = float(adapter.param_groups()["total"])
        out.append(Budget("params", cfg.params, total, total - sum(r.params for r in dense)))
    if cfg.decode_bytes is not None:
        total = decode_bytes_per_token(model, cfg.decode_at, [r.kv_bytes for r in dense])["total"]
        out.append(Budget("decode", cfg.decode_bytes, total, total - sum(r.decode_bytes for r in dense)))
    return out


def _as_options(rows: list[list[tuple[Candidate, Resources]]], quality: dict[tuple[int, str], float]
                ) -> list[list[Option]]:
    return [[Option(c.label, quality.get((i, c.label), 0.0),
                    {"kv": r.kv_bytes, "params": float(r.params), "decode": r.decode_bytes},
                    ("keep", *SHARING) if c.kind in SHARING else None) for c, r in row]
            for i, row in enumerate(rows)]


@dataclass
class Prepared:
    """Everything a plan needs that does not depend on the budgets: candidates, their costs, measured KL, and the
    fitted modules (so one measurement serves several budgets: `choose`)."""

    rows: list[list[tuple[Candidate, Resources]]]
    refused: dict[str, dict[str, str]]
    dense: list[Resources]
    measured: Measured
    held_out: ScoreSet
    windows: dict[str, Any]
    seconds: float
    residency: Residency  # where the weights are while plans are scored (the model in memory, or on disk)
    calibration: Calibration  # cfg's, its windows raised to what the candidates' fits need (api.raised_calibration)
    fit: TokenWindows  # the windows drawn under `calibration`


@torch.no_grad()
def prepare(model: Any, tokenizer: Any, cfg: PlanConfig, progress: bool = True,
            residency: Residency | None = None) -> Prepared:
    """Candidates and exact costs per layer, `cfg`'s budgets checked against them, then every candidate measured.
    `residency`: offload.OffloadedLayers plans a skeleton whose weights stay on disk (one decoder layer in memory
    at a time, the layers above it streamed through each score); the model in memory by default."""
    start = time.time()
    adapter = get_adapter(model)
    res = residency or InMemoryLayers(model, adapter.decoder_layers(), next(model.parameters()).device)
    if res.offloaded:
        refuse_offloaded_plan(cfg)
    rope = adapter.attention_spec(0).rope
    cands = candidate_set(cfg.kinds, cfg.ladder, cfg.engine, cfg.mla_args, cfg.nbl_args,
                          None if rope is None else rope.rotary_dims)
    rows, refused = layer_options(adapter, cands, cfg.decode_at, cfg.engine)
    keep = Candidate("keep", {}, "keep")
    dense = [resources(adapter, i, keep, cfg.decode_at) for i in range(adapter.num_layers())]
    _solved(rows, {}, _budgets(model, adapter, cfg, dense), cfg.engine, adapter)  # refused before any measurement
    cal = raised_calibration(cfg.calibration, [(f"the planner's candidate {c.label}", method_of(c))
                                               for c in cands if c.method is not None], adapter)
    fit = calib_windows(cal.source, tokenizer, cal.windows, cal.seq_len, cal.seed, model=model)
    with res.streamed():  # the dense model's reference log-probabilities
        scores = score_set(model, tokenizer, cal.source, cfg.score_windows, cfg.score_seq_len, cal.seed + 1)
        held_out = score_set(model, tokenizer, cal.source, cfg.refine_windows, cfg.score_seq_len, cal.seed + 2)
    measured = measure(model, adapter, {i: [c for c, _ in row] for i, row in enumerate(rows)}, fit.ids, scores,
                       cal.batch_size, progress, res)
    for (i, label), why in measured.refused.items():
        refused.setdefault(str(i), {})[label] = why
    kept = {c.label for i, row in enumerate(rows) for c, _ in row if (i, c.label) not in measured.refused}
    if lost := sorted({label for _, label in measured.refused} - kept):  # a setting's problem, not a layer's
        why = next(w for (_, label), w in sorted(measured.refused.items()) if label == lost[0])
        raise AttnslimError(f"candidate {lost[0]} was refused at every layer that could hold it: {why}")
    rows = [[(c, r) for c, r in row if (i, c.label) not in measured.refused] for i, row in enumerate(rows)]
    windows = {"fit": fit.description, "score": scores.description, "held_out": held_out.description,
               "scored_tokens": scores.tokens, "held_out_tokens": held_out.tokens}
    return Prepared(rows, refused, dense, measured, held_out, windows, time.time() - start, res, cal, fit)


def refuse_offloaded_plan(cfg: PlanConfig) -> None:
    """What an offloaded plan cannot do, before any work: sharing reads the previous layer's weights while layer i
    is converted (one layer is in memory), and `self` calibration samples the whole dense model."""
    if shared := [k for k in cfg.kinds if k in SHARING]:
        raise AttnslimError(f"candidates {shared} (sharing) are not offered with --offload: converting a receiver "
                            "reads its donor's weights too; leave them out of --candidates")
    if SELF in mixture(cfg.calibration.source):
        raise AttnslimError("calibration source 'self' samples the dense model, which --offload keeps on disk; plan "
                            "without --offload, or calibrate on a text source (wiki, c4, file:PATH)")


@torch.no_grad()
def choose(model: Any, prepared: Prepared, cfg: PlanConfig, progress: bool = True) -> PlanResult:
    """The plan under `cfg`'s budgets from `prepared`'s measurements: solved, re-scored whole, refined."""
    start = time.time()
    adapter = get_adapter(model)
    measured = prepared.measured
    budgets = _budgets(model, adapter, cfg, prepared.dense)
    solved, why = _solved(prepared.rows, measured.quality, budgets, cfg.engine, adapter)
    searched = {route: _search(model, adapter, prepared, rows, options, first, budgets, cfg, progress)
                for route, (rows, options, first) in solved.items()}
    route = min(searched, key=lambda name: searched[name].refined.measured)
    found = searched[route]
    rows, options, first, starts, start_cost = found.rows, found.options, found.first, found.starts, found.start_cost
    refined, best = found.refined, found.best
    chosen = [with_fit(rows[i][o][0], cfg.fit_steps) for i, o in enumerate(refined.choice)]
    recipe, methods = plan_recipe(chosen, f"plan-{cfg.budgets_text().replace(' ', '')}",
                         f"attnslim plan: {cfg.budgets_text()} (engine {cfg.engine}); per-layer choice by "
                         "measured KL under the budgets", prepared.calibration, cfg.heal)
    table = {i: {c.label: {"kv_bytes": r.kv_bytes, "params": r.params, "decode_bytes": r.decode_bytes,
                           "kl": measured.quality.get((i, c.label), 0.0)} for c, r in row}
             for i, row in enumerate(rows)}
    report = {
        "budgets": {b.resource: b.fraction for b in budgets}, "engine": cfg.engine,
        "decode_at": cfg.decode_at, "used": solve_summary(options, refined.choice, budgets),
        "binding": first.binding, "layers": choice_table(chosen, table),
        "options": {str(i): t for i, t in table.items()}, "refused": prepared.refused,
        "starts": {name: {"measured": start_cost[name], "additive": _additive(options, choice),
                          "kv": solve_summary(options, choice, budgets)["kv"]} for name, choice in starts.items()},
        "start": best,
        "estimate": {"additive_first": first.quality, "measured_first": start_cost["additive"],
                     "additive_start": refined.additive, "measured_start": refined.measured_first,
                     "additive": sum(options[i][o].quality for i, o in enumerate(refined.choice)),
                     "measured": refined.measured,
                     "measured_over_additive_first": start_cost["additive"] / max(first.quality, 1e-12)},
        "route": route, "routes": {**{name: {"measured": done.refined.measured} for name, done in searched.items()},
                                   **{name: {"refused": reason} for name, reason in why.items()}},
        "serving": {name: HOW[name] for name in serving_routes(
            [c.kind for c in chosen], str(adapter.config.model_type), mla_served=cfg.engine == "vllm")},
        "refine": refined.history, "windows": prepared.windows, "bank_mb": measured.bank.disk_bytes() / 2**20,
        "config": {k: v for k, v in asdict(cfg).items() if k != "calibration"},
        "calibration": asdict(prepared.calibration),
        "seconds": {"measure": measured.seconds, "prepare": prepared.seconds, "refine": refined.seconds,
                    "total": prepared.seconds + time.time() - start},
    }
    return PlanResult(recipe, report, methods, prepared.fit)


@dataclass
class Searched:
    """One route's plan: its candidate rows and options, the solver's plan, the starts and their measured costs,
    the refinement from the best start."""

    rows: list[list[tuple[Candidate, Resources]]]
    options: list[list[Option]]
    first: Solution
    starts: dict[str, list[int]]
    start_cost: dict[str, float]
    best: str
    refined: Refined


def _solved(rows: list[list[tuple[Candidate, Resources]]], quality: dict[tuple[int, str], float],
            budgets: list[Budget], engine: str, adapter: Adapter
            ) -> tuple[dict[str, tuple[list[list[tuple[Candidate, Resources]]], list[list[Option]], Solution]],
                       dict[str, str]]:
    """Per serving route (planner/routes.py) that can hold the model under `budgets`: (its rows, options, the
    solver's plan); and why each other route cannot. The solver's own refusal (the reachable minimum) where no route
    is left and there was one to try; else a refusal naming every route's reason."""
    sets, why = route_rows(rows, engine, str(adapter.config.model_type))
    out = {}
    for route, kept in sets.items():
        options = _as_options(kept, quality)
        try:
            out[route] = (kept, options, solve(options, budgets))
        except AttnslimError as err:
            if route == ANY:
                raise
            why[route] = str(err)
    if not out:
        raise AttnslimError("no vLLM route serves a plan of this model under the budgets: "
                            + "; ".join(f"{route}: {reason}" for route, reason in why.items())
                            + ". No vLLM model mixes MLA with other layers yet (docs/serving.md); plan with "
                            "--engine hf (attnslim.load serves any plan) or relax the budget")
    return out, why


def _search(model: Any, adapter: Adapter, prepared: Prepared, rows: list[list[tuple[Candidate, Resources]]],
            options: list[list[Option]], first: Solution, budgets: list[Budget], cfg: PlanConfig,
            progress: bool) -> Searched:
    """The starts (planner/starts.py) of one route's options measured whole, the best refined."""

    def whole(choice: list[int]) -> float:
        with (installed(model, adapter, [rows[i][o][0] for i, o in enumerate(choice)], prepared.measured.bank),
              prepared.residency.streamed()):
            return kl(model, prepared.held_out)

    starts = start_plans(options, [[c.kind for c, _ in row] for row in rows], budgets, first.choice)
    start_cost = {name: whole(choice) for name, choice in starts.items()}
    best = min(start_cost, key=lambda name: start_cost[name])
    refined = refine(options, starts[best], budgets, whole, cfg.rounds, cfg.tries, progress, start_cost[best],
                     {tuple(c) for c in starts.values()})
    return Searched(rows, options, first, starts, start_cost, best, refined)


def with_fit(candidate: Candidate, steps: int) -> Candidate:
    """`candidate` with `steps` local-fit steps in its step arguments if it is an mla one (recipes/mla-kv25.yaml's
    fit: each layer's attention trained towards the dense attention's output), else as it is. `fit_steps` applies
    it to the chosen layers only: on SmolLM2-135M at KV 0.5 and 0.25 the fit after planning beat the plan measured
    with every candidate fitted (`local_steps` in mla_args) on two of three sets, for a fraction of the planning
    time (docs/planning.md, "Fitting the plan's mla layers")."""
    if not steps or candidate.kind != "mla":
        return candidate
    return replace(candidate, args={**candidate.args, "local_steps": steps})


def standard_heal(calibration_source: str) -> dict[str, Any]:
    """The default recipe's heal, on the calibration source when that holds the model's own text (sampled from it,
    `self`, or the user's, `file:PATH`): a model calibrated on its own domain should not be healed towards another."""
    heal = dict(load_recipe("default").heal or {})
    if any(part == SELF or part.startswith("file:") for part in mixture(calibration_source)):
        heal["source"] = calibration_source
    return heal


def plan_model(model: Any, tokenizer: Any, cfg: PlanConfig, progress: bool = True,
               residency: Residency | None = None) -> PlanResult:
    """The recipe meeting `cfg`'s budgets with the least measured divergence, and the report of why. A model
    attnslim compressed already is refused (its plan would be measured against a compressed reference).
    `residency`: as in `prepare` (offloaded weights)."""
    refuse_compressed(model)
    return choose(model, prepare(model, tokenizer, cfg, progress, residency), cfg, progress)


def _additive(options: list[list[Option]], choice: list[int]) -> float:
    return float(sum(options[i][o].quality for i, o in enumerate(choice)))


def solve_summary(options: list[list[Option]], choice: list[int], budgets: list[Budget]) -> dict[str, float]:
    """Each budgeted resource's use by `choice`, as a fraction of the dense model's."""
    return {b.resource: b.as_fraction(sum(options[i][o].costs[b.resource] for i, o in enumerate(choice)))
            for b in budgets}

"""Where the refinement starts: several plans, each measured whole, the best one refined (planner/refine.py).

The solver's plan is optimal for the additive estimate Σ_i KL_i, but per-layer costs do not add up (EvoPress),
and not equally for every kind: a layer without KV cache (`nbl`, `drop`, `ds`) removes or replaces a whole
attention, and its error compounds with its neighbours' more than a narrower latent does (seen on SmolLM2-135M:
the additive plan at KV 0.5 lost to uniform `mla` on held-out text). A local search from one start cannot cross
that gap in a few rounds, so the planner measures a few structurally different plans first:

    additive      the solver's optimum
    no-KV ×λ      the optimum with the cost of every no-KV candidate multiplied by λ (2, 4): how far to trust the
                  additive estimate of removing a layer's cache
    uniform       the same candidate with a KV cache (keep excluded, e.g. `mla@0.25`) at every layer, the widest
                  that meets the budgets (what a single-method recipe such as uniform `mla` builds)
    KIND on N     for a candidate without KV cache (`nbl`, `drop`), that kind on the fewest layers that meet the
                  budgets, where it costs least alone, every other layer kept: what the single-method recipe of
                  that kind builds (recipes/nbl.yaml, drop.yaml convert m layers, never all of them; the layers
                  are chosen by the measured cost instead of the recipe's own criterion)

Each is a feasible plan under the same budgets; identical plans are measured once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from attnslim.planner.refine import feasible
from attnslim.planner.solve import Budget, Option, solve

NO_KV_KINDS = ("nbl", "drop", "ds")
NO_KV_PENALTIES = (2.0, 4.0)


def _penalised(options: Sequence[Sequence[Option]], kinds: Sequence[Sequence[str]], factor: float
               ) -> list[list[Option]]:
    return [[replace(opt, quality=opt.quality * factor) if kind in NO_KV_KINDS else opt
             for opt, kind in zip(opts, row_kinds, strict=True)] for opts, row_kinds in zip(options, kinds,
                                                                                               strict=True)]


def uniform_plan(options: Sequence[Sequence[Option]], kinds: Sequence[Sequence[str]], budgets: Sequence[Budget]
                 ) -> tuple[str, list[int]] | None:
    """(label, choice) of the feasible plan holding one label of a kind with a KV cache at every layer with the most
    KV cache, or None. A kind without KV at every layer removes every attention: no recipe builds that."""
    no_kv = {opt.label for opts, row in zip(options, kinds, strict=True) for opt, kind in zip(opts, row, strict=True)
             if kind in NO_KV_KINDS}
    labels = set.intersection(*({opt.label for opt in opts} for opts in options)) - {"keep"} - no_kv
    best: tuple[float, str, list[int]] | None = None
    for label in sorted(labels):
        choice = [next(o for o, opt in enumerate(opts) if opt.label == label) for opts in options]
        if not feasible(options, choice, budgets):
            continue
        kv = sum(options[i][o].costs["kv"] for i, o in enumerate(choice))
        if best is None or kv > best[0]:
            best = (kv, label, choice)
    return None if best is None else (best[1], best[2])


def fewest_plans(options: Sequence[Sequence[Option]], kinds: Sequence[Sequence[str]], budgets: Sequence[Budget]
                 ) -> dict[str, list[int]]:
    """{"KIND on N": choice} per kind without KV cache offered at every layer beside keep: that kind on the fewest
    layers, cheapest alone first, every other layer kept, once the plan meets the budgets (none where it never
    does)."""
    out: dict[str, list[int]] = {}
    if not all("keep" in row for row in kinds):
        return out
    keep = [row.index("keep") for row in kinds]
    for kind in NO_KV_KINDS:
        if not all(kind in row for row in kinds):
            continue
        at = [row.index(kind) for row in kinds]
        choice = list(keep)
        for n, i in enumerate(sorted(range(len(options)), key=lambda i: options[i][at[i]].quality), start=1):
            choice[i] = at[i]
            if feasible(options, choice, budgets):
                out[f"{kind} on {n}"] = list(choice)
                break
    return out


def start_plans(options: Sequence[Sequence[Option]], kinds: Sequence[Sequence[str]], budgets: Sequence[Budget],
                first: list[int]) -> dict[str, list[int]]:
    """Named feasible plans to measure before refining (see the module docstring), without duplicates."""
    out: dict[str, list[int]] = {"additive": list(first)}
    for factor in NO_KV_PENALTIES:
        out[f"no-KV x{factor:g}"] = solve(_penalised(options, kinds, factor), budgets).choice
    if (uniform := uniform_plan(options, kinds, budgets)) is not None:
        out[f"uniform {uniform[0]}"] = uniform[1]
    out |= fewest_plans(options, kinds, budgets)
    unique: dict[tuple[int, ...], str] = {}
    for name, choice in out.items():
        unique.setdefault(tuple(choice), name)
    return {name: list(choice) for choice, name in unique.items()}

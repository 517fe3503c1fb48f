"""Re-score the assembled plan as a whole and refine it by local swaps (EvoPress: per-layer errors do not add up).

The solver's plan is optimal for the additive estimate Σ_i KL_i. The measured cost of the whole plan (every chosen
layer installed at once from the fitted modules, KL on held-out calibration windows that neither the fits nor the
per-layer costs saw) differs from it. Refinement is a local search on the measured cost:

    each round  every feasible change of one layer's option, and of two layers' options at once (one layer gives
                KV/parameters that another takes), ranked by its additive estimate; the `tries` best not yet
                measured are measured, and the best of them replaces the plan if it lowers the measured cost
    stop        when no measured change improves, or after `rounds` rounds

The candidates are ranked by the additive estimate because it is cheap and right about most of the ordering; it is
the measured cost that decides.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from attnslim.planner.solve import Budget, Option


@dataclass
class Refined:
    choice: list[int]
    additive: float  # Σ per-layer KL of the first (solver's) plan
    measured_first: float  # its measured whole-plan KL
    measured: float  # the refined plan's measured KL
    history: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0


def feasible(options: Sequence[Sequence[Option]], choice: Sequence[int], budgets: Sequence[Budget]) -> bool:
    """Every budget holds and every option's donor requirement is met."""
    for b in budgets:
        if sum(options[i][o].costs[b.resource] for i, o in enumerate(choice)) > b.limit:
            return False
    for i, o in enumerate(choice):
        prev = options[i][o].prev
        if prev is not None and (i == 0 or options[i - 1][choice[i - 1]].label not in prev):
            return False
    return True


def _changes(options: Sequence[Sequence[Option]], choice: list[int], budgets: Sequence[Budget]
             ) -> list[tuple[float, tuple[int, ...]]]:
    """(additive delta, new choice) for every feasible one- and two-layer change, cheapest first."""
    singles = [(i, o) for i, opts in enumerate(options) for o in range(len(opts)) if o != choice[i]]
    out: dict[tuple[int, ...], float] = {}
    for moves in itertools.chain(((s,) for s in singles), itertools.combinations(singles, 2)):
        if len({i for i, _ in moves}) < len(moves):
            continue
        new = list(choice)
        for i, o in moves:
            new[i] = o
        if feasible(options, new, budgets):
            out[tuple(new)] = sum(options[i][o].quality - options[i][choice[i]].quality for i, o in moves)
    return sorted(((d, c) for c, d in out.items()), key=lambda x: x[0])


def refine(options: Sequence[Sequence[Option]], choice: list[int], budgets: Sequence[Budget],
           measure: Callable[[list[int]], float], rounds: int = 4, tries: int = 6, progress: bool = True,
           measured: float | None = None, seen: set[tuple[int, ...]] | None = None) -> Refined:
    """Local search from `choice` on `measure` (the whole plan's KL); see the module docstring. `measured`: the
    start's measured cost when already known; `seen`: plans measured before (not proposed again)."""
    start = time.time()
    additive = sum(options[i][o].quality for i, o in enumerate(choice))
    current, best = list(choice), measure(choice) if measured is None else measured
    out = Refined(list(choice), additive, best, best)
    seen = set(seen or ()) | {tuple(choice)}
    for r in tqdm(range(rounds), desc="planner: refine", disable=not progress, leave=False):
        proposals = [(d, c) for d, c in _changes(options, current, budgets) if c not in seen][:tries]
        if not proposals:
            break
        scored = []
        for delta, cand in proposals:
            seen.add(cand)
            scored.append((measure(list(cand)), delta, cand))
        value, delta, cand = min(scored)
        out.history.append({"round": r, "measured": [round(v, 6) for v, _, _ in scored], "best": value,
                            "accepted": value < best})
        if value >= best:
            break
        changed = [i for i in range(len(current)) if cand[i] != current[i]]
        out.history[-1]["changed"] = {str(i): [options[i][current[i]].label, options[i][cand[i]].label]
                                      for i in changed}
        current, best = list(cand), value
    out.choice, out.measured, out.seconds = current, best, time.time() - start
    return out

"""The planner's choice: one option per layer minimising the summed quality cost under resource budgets.

A multiple-choice knapsack with a few extra rows, solved exactly as a mixed-integer programme by scipy's `milp`
(HiGHS): binary x[i, o] per layer i and option o,

    minimise   Σ q[i, o] x[i, o]
    subject to Σ_o x[i, o] = 1                              every layer takes exactly one option
               fixed_r + Σ cost_r[i, o] x[i, o] ≤ f_r · total_r   for each budgeted resource r (kv, params, decode)
               x[i, o] ≤ Σ_{p ∈ prev(o)} x[i-1, p]          an option that needs its donor layer in some state
                                                            (sharing reads layer i-1's scores: i-1 must compute them)

Why a MILP and not a dynamic programme over the budget: several budgets at once (a DP's table grows with each),
real-valued costs (a DP discretises them), and the donor rows; HiGHS solves a few hundred binaries in milliseconds.
Budgets are checked again on the chosen options in exact arithmetic; a float-tolerance overrun tightens the row and
solves again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from attnslim.errors import AttnslimError

RESOURCES = ("kv", "params", "decode")
NAMES = {"kv": "KV cache (--kv)", "params": "parameters (--params)", "decode": "decode bytes (--decode-bytes)"}


@dataclass(frozen=True)
class Option:
    label: str
    quality: float
    costs: Mapping[str, float]  # resource -> this option's amount (every resource in RESOURCES)
    prev: tuple[str, ...] | None = None  # labels layer i-1 must hold for this option (None: any)


@dataclass(frozen=True)
class Budget:
    """fixed + Σ chosen costs ≤ fraction · total (fraction of the dense model's total of this resource)."""

    resource: str
    fraction: float
    total: float
    fixed: float = 0.0

    def __post_init__(self) -> None:
        if self.resource not in RESOURCES:
            raise AttnslimError(f"budget resource {self.resource!r} is unknown; valid: {', '.join(RESOURCES)}")
        if not isinstance(self.fraction, int | float) or isinstance(self.fraction, bool) \
                or not 0 < self.fraction <= 1:
            raise AttnslimError(f"the {NAMES[self.resource]} budget is {self.fraction!r}; give a fraction of the "
                                "dense model's in (0, 1], e.g. 0.25")

    @property
    def limit(self) -> float:
        return self.fraction * self.total - self.fixed

    def as_fraction(self, used: float) -> float:
        return (self.fixed + used) / self.total


@dataclass(frozen=True)
class Solution:
    choice: list[int]  # option index per layer
    quality: float  # the summed (additive) quality cost
    used: dict[str, float]  # resource -> fraction of the dense total (fixed part included)
    binding: list[str]  # budgets whose removal alone would lower the quality cost


def _system(options: Sequence[Sequence[Option]]) -> tuple[list[tuple[int, int]], list[LinearConstraint]]:
    index = [(i, o) for i, opts in enumerate(options) for o in range(len(opts))]
    where = {key: k for k, key in enumerate(index)}
    n = len(index)
    rows: list[LinearConstraint] = []
    one = np.zeros((len(options), n))
    for k, (i, _) in enumerate(index):
        one[i, k] = 1.0
    rows.append(LinearConstraint(one, 1.0, 1.0))
    for i, opts in enumerate(options):
        for o, opt in enumerate(opts):
            if opt.prev is None:
                continue
            row = np.zeros(n)
            row[where[(i, o)]] = 1.0
            if i > 0:
                for p, before in enumerate(options[i - 1]):
                    if before.label in opt.prev:
                        row[where[(i - 1, p)]] -= 1.0
            rows.append(LinearConstraint(row[None], -np.inf, 0.0))
    return index, rows


def _optimise(options: Sequence[Sequence[Option]], objective: Sequence[float], budgets: Sequence[Budget],
              slack: Mapping[str, float] | None = None) -> list[int] | None:
    """Option per layer minimising `objective` (flattened like `_system`'s index), or None when infeasible."""
    index, rows = _system(options)
    for b in budgets:
        row = np.array([options[i][o].costs[b.resource] for i, o in index], dtype=np.float64)
        scale = max(float(np.abs(row).max()), 1.0)
        rows.append(LinearConstraint(row[None] / scale, -np.inf, (b.limit - (slack or {}).get(b.resource, 0.0))
                                     / scale))
    res = milp(np.asarray(objective, dtype=np.float64), constraints=rows, integrality=np.ones(len(index)),
               bounds=Bounds(0.0, 1.0))
    if res.status != 0 or res.x is None:
        return None
    choice = [0] * len(options)
    for k, (i, o) in enumerate(index):
        if res.x[k] > 0.5:
            choice[i] = o
    return choice


def _total(options: Sequence[Sequence[Option]], choice: Sequence[int], resource: str) -> float:
    return float(sum(options[i][o].costs[resource] for i, o in enumerate(choice)))


def _feasible_choice(options: Sequence[Sequence[Option]], objective: Sequence[float],
                     budgets: Sequence[Budget]) -> list[int] | None:
    """`_optimise`, then the budgets checked on the chosen costs exactly; an overrun within the solver's tolerance
    tightens that row by the overrun and solves again (twice at most)."""
    slack: dict[str, float] = {}
    for _ in range(3):
        choice = _optimise(options, objective, budgets, slack)
        if choice is None:
            return None
        over = {b.resource: _total(options, choice, b.resource) - b.limit for b in budgets}
        if all(v <= 0 for v in over.values()):
            return choice
        for r, v in over.items():
            if v > 0:
                slack[r] = slack.get(r, 0.0) + v * 1.001 + 1e-9
    return None


def smallest(options: Sequence[Sequence[Option]], budget: Budget, others: Sequence[Budget]) -> float | None:
    """The smallest fraction of `budget`'s resource any plan reaches under the `others` (None: they are infeasible
    on their own)."""
    objective = [options[i][o].costs[budget.resource] for i, opts in enumerate(options) for o in range(len(opts))]
    choice = _feasible_choice(options, objective, others)
    return None if choice is None else budget.as_fraction(_total(options, choice, budget.resource))


def _refusal(options: Sequence[Sequence[Option]], budgets: Sequence[Budget]) -> AttnslimError:
    """Why no plan meets `budgets`: a budget below what any plan reaches on its own, or budgets that contradict."""
    alone = [(b, smallest(options, b, [])) for b in budgets]
    below = [(b, m) for b, m in alone if m is not None and m > b.fraction]
    if below:
        parts = [f"the {NAMES[b.resource]} budget {b.fraction:g} is below the smallest any plan reaches, {m:.4g}"
                 for b, m in below]
        return AttnslimError("; ".join(parts) + "; raise it to at least that, or offer cheaper candidates")
    parts = []
    for b in budgets:
        rest = [o for o in budgets if o is not b]
        m = smallest(options, b, rest)
        if m is not None:
            given = ", ".join(f"{NAMES[o.resource]} ≤ {o.fraction:g}" for o in rest)
            parts.append(f"under {given} the smallest {NAMES[b.resource]} is {m:.4g}")
    return AttnslimError("the budgets contradict: each is reachable alone but not together (" + "; ".join(parts)
                         + "); raise one of them to the value named")


def solve(options: Sequence[Sequence[Option]], budgets: Sequence[Budget]) -> Solution:
    """The exact optimum of the additive quality cost under `budgets` (a refusal names the reachable minimum)."""
    if not options or any(not opts for opts in options):
        empty = [i for i, opts in enumerate(options) if not opts]
        raise AttnslimError(f"layers {empty} have no candidate; offer at least one (keep) for every layer")
    quality = [opt.quality for opts in options for opt in opts]
    choice = _feasible_choice(options, quality, budgets)
    if choice is None:
        raise _refusal(options, budgets)
    total = float(sum(options[i][o].quality for i, o in enumerate(choice)))
    binding = []
    for b in budgets:
        relaxed = _feasible_choice(options, quality, [o for o in budgets if o is not b])
        if relaxed is not None and sum(options[i][o].quality for i, o in enumerate(relaxed)) < total - 1e-12:
            binding.append(b.resource)
    used = {b.resource: b.as_fraction(_total(options, choice, b.resource)) for b in budgets}
    return Solution(choice, total, used, binding)

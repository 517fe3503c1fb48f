"""The planner's solver on constructed costs: the brute-force optimum, every budget honoured, refusals."""

from __future__ import annotations

import itertools
import random

import pytest

from attnslim.errors import AttnslimError
from attnslim.planner.solve import Budget, Option, smallest, solve


def _random_options(rng: random.Random, layers: int, per_layer: int, donor: bool = False) -> list[list[Option]]:
    out = []
    for i in range(layers):
        opts = [Option("keep", 0.0, {"kv": 100.0, "params": 50.0, "decode": 200.0})]
        for o in range(per_layer - 1):
            kv = float(rng.randint(0, 90))
            opts.append(Option(f"c{o}", rng.uniform(0.01, 2.0), {"kv": kv, "params": float(rng.randint(10, 70)),
                                                                 "decode": 100.0 + kv}))
        if donor and i > 0:  # a sharing-like option: cheap, but only after a kept (or shared) layer
            opts.append(Option("ds", rng.uniform(0.0, 0.3), {"kv": 40.0, "params": 30.0, "decode": 140.0},
                               prev=("keep", "ds")))
        out.append(opts)
    return out


def _brute(options: list[list[Option]], budgets: list[Budget]) -> float | None:
    best = None
    for choice in itertools.product(*(range(len(o)) for o in options)):
        picked = [options[i][o] for i, o in enumerate(choice)]
        if any(p.prev is not None and (i == 0 or options[i - 1][choice[i - 1]].label not in p.prev)
               for i, p in enumerate(picked)):
            continue
        if any(b.fixed + sum(p.costs[b.resource] for p in picked) > b.limit + b.fixed for b in budgets):
            continue
        q = sum(p.quality for p in picked)
        best = q if best is None or q < best else best
    return best


@pytest.mark.parametrize("seed", range(12))
def test_solver_finds_the_brute_force_optimum_and_honours_every_budget(seed: int) -> None:
    rng = random.Random(seed)
    options = _random_options(rng, layers=4, per_layer=4, donor=seed % 2 == 0)
    budgets = [Budget("kv", rng.uniform(0.3, 0.8), 400.0)]
    if seed % 3 == 0:
        budgets.append(Budget("params", rng.uniform(0.6, 1.0), 200.0))
    if seed % 4 == 0:
        budgets.append(Budget("decode", rng.uniform(0.7, 1.0), 1000.0, fixed=150.0))
    best = _brute(options, budgets)
    if best is None:
        with pytest.raises(AttnslimError):
            solve(options, budgets)
        return
    sol = solve(options, budgets)
    assert sol.quality == pytest.approx(best, abs=1e-9)
    picked = [options[i][o] for i, o in enumerate(sol.choice)]
    for b in budgets:
        assert b.fixed + sum(p.costs[b.resource] for p in picked) <= b.fraction * b.total
        assert sol.used[b.resource] <= b.fraction
    for i, p in enumerate(picked):
        assert p.prev is None or options[i - 1][sol.choice[i - 1]].label in p.prev


def test_sharing_needs_its_donor_to_compute_scores() -> None:
    cheap = {"kv": 0.0, "params": 1.0, "decode": 1.0}
    options = [[Option("keep", 0.0, {"kv": 12.0, "params": 1.0, "decode": 1.0}), Option("mla", 0.1, cheap)],
               [Option("keep", 0.0, {"kv": 12.0, "params": 1.0, "decode": 1.0}),
                Option("ds", 0.0, {"kv": 5.0, "params": 1.0, "decode": 1.0}, prev=("keep", "ds")),
                Option("mla", 1.0, cheap)]]
    # ds at layer 1 is free but needs layer 0 kept: KV ≤ 10 must choose mla at 0 and then cannot take ds
    sol = solve(options, [Budget("kv", 10 / 24, 24.0)])
    assert [options[i][o].label for i, o in enumerate(sol.choice)] == ["mla", "mla"]
    sol = solve(options, [Budget("kv", 17 / 24, 24.0)])
    assert [options[i][o].label for i, o in enumerate(sol.choice)] == ["keep", "ds"]


def test_infeasible_budget_names_the_smallest_reachable() -> None:
    options = [[Option("keep", 0.0, {"kv": 100.0, "params": 1, "decode": 1}),
                Option("half", 1.0, {"kv": 50.0, "params": 1, "decode": 1})] for _ in range(3)]
    with pytest.raises(AttnslimError, match=r"below the smallest any plan reaches, 0\.5\b"):
        solve(options, [Budget("kv", 0.4, 300.0)])
    assert smallest(options, Budget("kv", 0.4, 300.0), []) == pytest.approx(0.5)


def test_contradictory_budgets_say_which_binds() -> None:
    # the KV-free option costs parameters: KV ≤ 0.5 needs it on two layers, params ≤ 0.7 allows it on one
    options = [[Option("keep", 0.0, {"kv": 10.0, "params": 10.0, "decode": 1}),
                Option("linear", 1.0, {"kv": 0.0, "params": 20.0, "decode": 1})] for _ in range(3)]
    budgets = [Budget("kv", 0.5, 30.0), Budget("params", 0.7, 60.0)]
    with pytest.raises(AttnslimError, match="contradict") as err:
        solve(options, budgets)
    assert "under parameters (--params) ≤ 0.7 the smallest KV cache (--kv) is 0.6667" in str(err.value)
    assert "under KV cache (--kv) ≤ 0.5 the smallest parameters (--params) is 0.8333" in str(err.value)
    sol = solve(options, [Budget("kv", 0.7, 30.0), Budget("params", 0.9, 60.0)])
    assert sol.binding == ["kv"]


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_budget_out_of_range_is_refused(fraction: float) -> None:
    with pytest.raises(AttnslimError, match=r"in \(0, 1\]"):
        Budget("kv", fraction, 100.0)


def test_refinement_starts_add_penalised_and_uniform_plans_without_duplicates() -> None:
    """Three layers; keep (2 KV), mla (1 KV, costs 0.9/0.8/0.7), nbl (0 KV, costs 0.4/0.5/0.6); KV at most half
    (3 of 6). Additive optimum: nbl, nbl, keep (0.9). With nbl's cost x2: nbl, keep, mla (1.5, next 1.6); x4 gives
    the same plan (2.3, next 2.4: measured once). Uniform: mla everywhere (nbl everywhere fits too but removes every
    attention: no recipe builds it). nbl on the fewest layers, cheapest alone first: layers 0 and 1 (the additive
    plan, measured once); at KV 1/3 the third layer too."""
    from attnslim.planner.starts import fewest_plans, start_plans, uniform_plan

    def opt(label: str, q: float, kv: float) -> Option:
        return Option(label, q, {"kv": kv, "params": 0.0, "decode": 0.0})

    options = [[opt("keep", 0.0, 2.0), opt("mla@0.5", m, 1.0), opt("nbl", q, 0.0)]
               for m, q in ((0.9, 0.4), (0.8, 0.5), (0.7, 0.6))]
    kinds = [["keep", "mla", "nbl"]] * 3
    budgets = [Budget("kv", 0.5, 6.0)]
    first = solve(options, budgets).choice
    assert first == [2, 2, 0]
    starts = start_plans(options, kinds, budgets, first)
    assert starts == {"additive": [2, 2, 0], "no-KV x2": [2, 0, 1], "uniform mla@0.5": [1, 1, 1]}
    assert uniform_plan(options, kinds, [Budget("kv", 0.1, 6.0)]) is None  # only nbl everywhere would fit
    assert fewest_plans(options, kinds, budgets) == {"nbl on 2": [2, 2, 0]}
    assert fewest_plans(options, kinds, [Budget("kv", 0.1, 6.0)]) == {"nbl on 3": [2, 2, 2]}
    swapped = [[*row[:2], opt("nbl", q, 0.0)] for row, q in zip(options, (0.6, 0.1, 0.2), strict=True)]
    assert fewest_plans(swapped, kinds, budgets) == {"nbl on 2": [0, 2, 2]}  # the cheapest alone, not the first
    assert fewest_plans(options, [["mla", "mla", "nbl"]] * 3, budgets) == {}  # no keep offered: no such recipe


def test_vllm_mla_candidates_keep_the_fastest_frequencies_on_heads_wider_than_deepseeks_rotary_key() -> None:
    from attnslim.planner.candidates import candidate_set

    wide = [c for c in candidate_set(("mla",), engine="vllm", rotary_dims=128)]
    narrow = [c for c in candidate_set(("mla",), engine="vllm", rotary_dims=64)]
    assert [c.args.get("rope_fastest") for c in wide] == [32, 32]
    assert all("rope_fastest" not in c.args for c in narrow)
    assert all("rope_fastest" not in c.args for c in candidate_set(("mla",), engine="hf", rotary_dims=128))

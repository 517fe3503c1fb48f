"""A plan (one candidate per layer) as an ordinary recipe, and the installation of a whole plan for scoring.

The recipe groups the layers that chose the same candidate into one step (`layers: [..]`), steps ordered by their
first layer so that a step's sequential fits see most of their upstream layers already converted, sharing steps
last (a receiver reads its donor's scores inside one model forward, which the later steps' layer-by-layer
calibration would break: modules/score_link.py); kept layers are in no step. It is validated by the recipe's own
checks (methods and arguments, disjoint layers) before it is returned, with the steps' methods that check built
(so `compress --kv` hands them to `compress(methods=)` and builds each once), and it is what `compress` runs: each
layer fitted on the outputs of the layers converted before it."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

from attnslim.adapters.base import Adapter
from attnslim.api import check_recipe
from attnslim.errors import AttnslimError
from attnslim.methods import METHODS, Method
from attnslim.planner.bank import Bank
from attnslim.planner.candidates import SHARING, Candidate
from attnslim.planner.costs import entry_for, method_of, restored
from attnslim.recipe import Calibration, Recipe, Step


def plan_recipe(choice: Sequence[Candidate], name: str, description: str, calibration: Calibration,
                heal: dict[str, Any] | None = None) -> tuple[Recipe, list[Method]]:
    """The recipe that applies `choice[i]` to layer i (keep: no step), and its steps' methods as
    `check_recipe` built them."""
    groups: dict[str, tuple[Candidate, list[int]]] = {}
    for i, c in enumerate(choice):
        if c.method is not None:
            groups.setdefault(c.label, (c, []))[1].append(i)
    ordered = sorted(groups.values(), key=lambda g: (g[0].kind in SHARING, g[1][0]))
    steps = [Step(c.kind, list(layers), c.step_args()) for c, layers in ordered]
    if not steps:  # every layer kept: a recipe needs a step
        raise AttnslimError("the budget keeps every layer as it is; there is nothing to compress (ask for a "
                            "smaller --kv)")
    recipe = Recipe(name, calibration, tuple(steps), description, heal)
    recipe.resolve(len(choice), dict(METHODS))
    return recipe, check_recipe(recipe)


@contextmanager
def installed(model: Any, adapter: Adapter, choice: Sequence[Candidate], bank: Bank) -> Iterator[None]:
    """The whole plan installed from the bank's fitted modules, their weights read in while each runs (drop and
    sharing rebuilt), undone on exit."""
    with restored(adapter, list(range(adapter.num_layers()))), ExitStack() as held:
        for i, c in enumerate(choice):
            if c.method is None:
                continue
            if (i, c.label) in bank:
                attention, norm = held.enter_context(bank.on_call((i, c.label)))
                adapter.replace_attention(i, attention)
                if adapter.attention_norm(i) is not norm:
                    adapter.replace_attention_norm(i, norm)
                continue
            method = method_of(c)
            method.convert(adapter, i, entry_for(method, adapter, i), None)
        yield


def choice_table(choice: Sequence[Candidate], options: Mapping[int, Mapping[str, Mapping[str, float]]]
                 ) -> list[dict[str, Any]]:
    """Per layer: the chosen label and its costs (what the report prints)."""
    return [{"layer": i, "choice": c.label, **options[i][c.label]} for i, c in enumerate(choice)]

"""The candidate sets a plan may draw from, one per serving route (engines.py).

`--engine hf`: one set, every candidate (transformers runs any mix). `--engine vllm`: one set per vLLM route that
serves the model's family, each holding only the kinds that route serves (attnslim's plugin: keep, nbl, drop;
the DeepSeek-V3 export: MLA at a served width on every layer), because no vLLM model mixes MLA layers with others
yet. The planner solves and refines within each set and keeps the plan with the least measured cost; a route that
cannot hold the model (its family, a layer none of its candidates fits, a budget it cannot reach) is named with the
reason in the report, and in the refusal when no route is left.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from attnslim.engines import ROUTE_BASES, VLLM_ROUTES
from attnslim.planner.candidates import Candidate

ANY = "any"  # --engine hf: one set of every candidate
R = TypeVar("R")
Rows = list[list[tuple[Candidate, R]]]


def route_rows(rows: Sequence[Sequence[tuple[Candidate, R]]], engine: str, model_type: str
               ) -> tuple[dict[str, Rows[R]], dict[str, str]]:
    """({route: the rows restricted to its kinds}, {route: why it cannot hold this model})."""
    if engine != "vllm":
        return {ANY: [list(row) for row in rows]}, {}
    out: dict[str, Rows[R]] = {}
    why: dict[str, str] = {}
    for route, kinds in VLLM_ROUTES.items():
        if model_type not in ROUTE_BASES[route]:
            why[route] = f"it serves {', '.join(ROUTE_BASES[route])} models; this one is {model_type!r}"
            continue
        kept = [[(c, r) for c, r in row if c.kind in kinds] for row in rows]
        if empty := [i for i, row in enumerate(kept) if not row]:
            why[route] = f"it serves {', '.join(kinds)} layers; layers {empty} take none of them"
            continue
        out[route] = kept
    return out, why

"""latentllm's compression time with the preconditioner built once per site (linalg/precond.py) against rebuilding
it for every linear and pass, as before (issue 23, item 2). Same recipe, same process, interleaved runs, medians;
the converted weights must be identical either way.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/precond_once.py [--repeats 2] [--recipe latentllm]
writes benchmarks/results/precond_once.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from typing import Any

import torch
from common import RESULTS, environment

from attnslim import compress, load_model, load_recipe
from attnslim.linalg import precond


class _NoMemo(dict):  # type: ignore[type-arg]
    """Stands in for the memo: never keeps what it is given (every call builds its preconditioner)."""

    def setdefault(self, key: Any, default: Any = None) -> Any:
        return {}


def run(recipe: Any, shared: bool) -> tuple[float, dict[str, torch.Tensor]]:
    saved = precond._BUILT
    precond._BUILT = precond.WeakTensorKeyDictionary() if shared else _NoMemo()  # type: ignore[assignment]
    try:
        model, tokenizer = load_model("smollm2-135m")
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compress(model, tokenizer, recipe, progress=False)
        return time.perf_counter() - start, {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        precond._BUILT = saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--recipe", default="latentllm")
    a = ap.parse_args()
    recipe = load_recipe(a.recipe)
    seconds: dict[str, list[float]] = {"shared": [], "rebuilt": []}
    identical = True
    for _ in range(a.repeats):
        t_shared, w_shared = run(recipe, True)
        t_rebuilt, w_rebuilt = run(recipe, False)
        seconds["shared"].append(round(t_shared, 1))
        seconds["rebuilt"].append(round(t_rebuilt, 1))
        identical &= all(torch.equal(w_shared[k], w_rebuilt[k]) for k in w_shared)
        print(seconds, identical, flush=True)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    out = {"environment": environment(), "recipe": a.recipe, "seconds": seconds, "median_seconds": med,
           "ratio_shared_to_rebuilt": round(med["shared"] / med["rebuilt"], 3), "weights_identical": identical}
    (RESULTS / "precond_once.json").write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("median_seconds", "ratio_shared_to_rebuilt", "weights_identical")}))


if __name__ == "__main__":
    main()

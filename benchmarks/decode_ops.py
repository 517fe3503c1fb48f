"""What one decode step dispatches, dense against a compressed model: operator calls per step and per attention
layer, and where the profiled time goes.

At 512 tokens of context a small model's decode step reads little cache, and a step's time is weights read plus a
fixed cost per dispatched operator (Python and torch's dispatcher, several µs each on these CPUs). The operator
counts are exact and reproducible (no timing noise); the profiled times are torch.profiler's self CPU time per
operator, noisy and inflated by the profiler itself, so they say where time goes, not how fast a model runs
(benchmarks/mla.py --groups speed measures that, interleaved).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/decode_ops.py --model smollm2-135m --recipe recipes/mla.yaml
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/decode_ops.py --model gemma3-270m --recipe recipes/mla.yaml

The recipe's heal is skipped (it changes weights, not which operators run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from common import environment
from torch.profiler import ProfilerActivity, profile, record_function

from attnslim import _compat
from attnslim.adapters import get_adapter
from attnslim.api import compress
from attnslim.models import load_model
from attnslim.recipe import load_recipe

RESULTS = Path(__file__).parent / "results"
ATTENTION = "attnslim::attention"  # the label each attention module's forward runs under while profiled


@contextmanager
def labelled_attention(model: Any) -> Iterator[None]:
    """Run every attention module's forward inside a profiler label, so its operators can be counted apart."""
    adapter, labels, handles = get_adapter(model), [], []

    def enter(*_: Any) -> None:
        labels.append(record_function(ATTENTION))
        labels[-1].__enter__()

    def leave(*_: Any) -> None:
        labels.pop().__exit__(None, None, None)

    for i in range(adapter.num_layers()):
        handles += [adapter.attention(i).register_forward_pre_hook(enter),
                    adapter.attention(i).register_forward_hook(leave)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def decode_profile(model: Any, context: int, steps: int, top: int) -> dict[str, Any]:
    """Operators of `steps` greedy decode steps after a `context`-token prompt, per step: calls in all and inside
    attention modules (per layer too), profiled self time, and the `top` operators by self time."""
    ids = torch.randint(0, 1000, (1, context), generator=torch.Generator().manual_seed(0))
    cache = _compat.new_cache(model.config, "dynamic", context + 2 * steps)
    token = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    for _ in range(steps):  # warm-up: derived weights, rotary tables, reserved cache rows
        token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    with labelled_attention(model), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    events = [e for e in prof.events() if e.name != ATTENTION and not e.name.startswith("ProfilerStep")]
    labels = [e for e in prof.events() if e.name == ATTENTION]
    top_level = [e for e in events if e.cpu_parent is None or e.cpu_parent.name == ATTENTION]
    in_attention = sum(len([c for c in lab.cpu_children if c.name != ATTENTION]) for lab in labels)
    totals = prof.key_averages()
    layers = get_adapter(model).num_layers()
    return {
        "context": context, "steps": steps,
        "ops_per_step": len(top_level) / steps,
        "attention_ops_per_layer": in_attention / steps / layers,
        "self_ms_per_step": sum(e.self_cpu_time_total for e in totals if e.key != ATTENTION) / steps / 1e3,
        "attention_ms_per_step": sum(lab.cpu_time_total for lab in labels) / steps / 1e3,
        "top": [{"op": e.key, "calls_per_step": e.count / steps,
                 "self_ms_per_step": e.self_cpu_time_total / steps / 1e3}
                for e in sorted((e for e in totals if e.key != ATTENTION), key=lambda e: -e.self_cpu_time_total)[:top]],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--recipe", default="recipes/mla.yaml", help="compressed model: this recipe without its heal")
    parser.add_argument("--name", default=None, help="results file benchmarks/results/NAME.json "
                        "(default decode-ops-MODEL)")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    recipe = dataclasses.replace(load_recipe(args.recipe), heal=None)
    dense, tokenizer = load_model(args.model)
    compressed, _ = load_model(args.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compress(compressed, tokenizer, recipe, progress=False)
    runs = {"dense": decode_profile(dense.eval(), args.context, args.steps, args.top),
            recipe.name: decode_profile(compressed.eval(), args.context, args.steps, args.top)}
    d, c = runs["dense"], runs[recipe.name]
    lines = [f"{args.model}, one greedy decode step after {args.context} tokens of context (HF dynamic cache, "
             f"float32), counted over {args.steps} steps: operators dispatched (top-level aten calls; exact), those "
             "inside the attention modules per layer, and torch.profiler's self CPU time (noisy, profiler-inflated: "
             f"where time goes, not speed). `{recipe.name}`: {args.recipe} without its heal.", "",
             "| model | ops per step | attention ops per layer | profiled ms per step | of it in attention |",
             "|---|---|---|---|---|"]
    for name, run in runs.items():
        lines.append(f"| {name} | {run['ops_per_step']:.0f} | {run['attention_ops_per_layer']:.1f} | "
                     f"{run['self_ms_per_step']:.1f} | {run['attention_ms_per_step']:.1f} |")
    lines += ["", f"{recipe.name} dispatches {c['ops_per_step'] - d['ops_per_step']:+.0f} operators per step "
              f"({c['attention_ops_per_layer'] - d['attention_ops_per_layer']:+.1f} per attention layer)."]
    path = RESULTS / f"{args.name or 'decode-ops-' + args.model}.json"
    path.write_text(json.dumps({"environment": environment(), "model": args.model, "recipe": args.recipe,
                                "runs": runs, "notes": lines}, indent=1))
    print("\n".join(lines))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

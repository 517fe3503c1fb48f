"""NBL measurements of issue 5 on smollm2-135m, every variant in the same harness (benchmarks/common.py).

Groups (--groups, comma-separated; default all):
  sweep    wiki/ptb/c4 perplexity for m = 3, 6, 9, 12, 15 linearized layers: NBL one-shot with the default
           criterion (resid), NBL sequential, the paper's configuration (cca bound, X = raw residual h), NBL
           with layers chosen by the cca bound / LLM-Drop cosine similarity / random (seeded) / highest bound,
           and attention drop (LLM-Drop) on its own similarity layers and on the layers the default NBL chose
  calib    calibration-size sensitivity: the default NBL at m = 6, 12 with 64 and 256 calibration windows
  speed    decode tokens/s and prefill time against dense at 512 and 2048 tokens (attnslim.bench.interleaved);
           linearized layers are built with `Nbl.skeleton` (timing does not depend on the fitted values)

    .venv/bin/python benchmarks/nbl.py                                   # the full run (hours on a 2-core CPU)
    .venv/bin/python benchmarks/nbl.py --groups sweep --m 6,12 --only nbl-resid-m6,nbl-cca-m6
    .venv/bin/python benchmarks/nbl.py --name nbl-small --tokens 2048 --windows 16 --m 6
    .venv/bin/python benchmarks/nbl.py --model gemma3-270m --name nbl-gemma3    # once its adapter exists
    .venv/bin/python benchmarks/make_report.py                           # regenerates BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from common import Harness, calibration

from attnslim.adapters import get_adapter
from attnslim.bench import interleaved
from attnslim.methods.nbl import DEFAULT_CRITERION, Nbl
from attnslim.models import load_model

BASELINE_CRITERIA = ("cca", "similarity", "random", "highest")


def nbl(args: dict[str, Any], layers: Any = "all") -> list[dict[str, Any]]:
    return [{"method": "nbl", "layers": layers, "args": args}]


def sweep_variants(m: int) -> dict[str, list[dict[str, Any]]]:
    """Variants that need no other variant's result (drop on the NBL layers is added after NBL ran)."""
    out = {f"nbl-{DEFAULT_CRITERION}-m{m}": nbl({"m": m})}
    out[f"nbl-seq-{DEFAULT_CRITERION}-m{m}"] = nbl({"m": m, "sequential": True})
    out[f"nbl-paper-m{m}"] = nbl({"m": m, "criterion": "cca", "input": "residual"})
    out |= {f"nbl-{c}-m{m}": nbl({"m": m, "criterion": c}) for c in BASELINE_CRITERIA}
    out[f"drop-similarity-m{m}"] = [{"method": "drop", "layers": "all", "args": {"count": m, "select": "similarity"}}]
    return out


def chosen_layers(h: Harness, key: str) -> list[int] | None:
    variant = h.data["variants"].get(key)
    return None if variant is None else list(variant["plans"][0]["plan"]["chosen"])


def speed(h: Harness, ms: list[int], contexts: list[int], new_tokens: int, repeats: int) -> None:
    """Dense and NBL with m linearized layers, interleaved in one run (ratios to dense)."""
    models: dict[str, Any] = {}
    dense, _ = load_model(h.model_name)
    models["dense"] = dense.eval()
    n_layers = get_adapter(dense).num_layers()
    for m in ms:
        model, _ = load_model(h.model_name)
        adapter = get_adapter(model)
        layers = chosen_layers(h, f"nbl-{DEFAULT_CRITERION}-m{m}") or list(range(n_layers - m, n_layers))
        for i in layers:
            Nbl(m=m).skeleton(adapter, i, {"input": "normed"})
        models[f"nbl-m{m}"] = model.eval()
    result = interleaved(models, contexts, new_tokens=new_tokens, repeats=repeats)
    h.data["speed"] = result
    lines = ["Decode speed (greedy, HF DynamicCache, float32; medians of interleaved repetitions, ratio to dense; "
             f"target decode ratio ≥ 0.9/(1 − m/{n_layers})):", "",
             "| model | " + " | ".join(f"decode tok/s @{c} (×dense) | prefill ms @{c} (×dense)" for c in contexts)
             + " |", "|---|" + "---|---|" * len(contexts)]
    for name, rows in result["models"].items():
        cells = " | ".join(f"{rows[str(c)]['decode_tok_s']:.1f} ({rows[str(c)]['decode_ratio']:.2f}×) | "
                           f"{rows[str(c)]['prefill_s'] * 1000:.0f} ({rows[str(c)]['prefill_ratio']:.2f}×)"
                           for c in contexts)
        lines.append(f"| {name} | {cells} |")
    h.data["notes"] = lines
    h.save()
    print("\n".join(lines), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", default="nbl", help="results file benchmarks/results/NAME.json")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=8192, help="evaluation tokens per source")
    parser.add_argument("--sources", default="wiki,ptb,c4")
    parser.add_argument("--windows", type=int, default=32, help="calibration windows")
    parser.add_argument("--seq-len", type=int, default=512, help="calibration window length")
    parser.add_argument("--m", default="3,6,9,12,15", help="numbers of linearized layers")
    parser.add_argument("--groups", default="sweep,calib,speed")
    parser.add_argument("--only", default="", help="comma-separated variant keys to run")
    parser.add_argument("--contexts", default="512,2048")
    parser.add_argument("--speed-m", default="6,12")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    h = Harness(args.name, model=args.model, tokens=args.tokens, sources=tuple(args.sources.split(",")))
    cal = calibration(args.windows, args.seq_len)
    groups = set(args.groups.split(","))
    only = {k for k in args.only.split(",") if k}
    ms = [int(m) for m in args.m.split(",")]

    def run(key: str, steps: list[dict[str, Any]], calib: dict[str, Any] = cal) -> None:
        if only and key not in only:
            return
        start = time.time()
        h.run(key, {"name": key, "calibration": calib, "steps": steps})
        print(f"  {key}: {time.time() - start:.0f} s", flush=True)

    h.dense()
    if "sweep" in groups:
        for m in ms:
            for key, steps in sweep_variants(m).items():
                run(key, steps)
            for source in (f"nbl-{DEFAULT_CRITERION}-m{m}", f"nbl-cca-m{m}"):  # drop the layers NBL linearized
                layers = chosen_layers(h, source)
                if layers:
                    tag = source.split("-")[1]
                    run(f"drop-{tag}-layers-m{m}", [{"method": "drop", "layers": layers, "args": {"select": "given"}}])
    if "calib" in groups:
        for m in (6, 12):
            for windows in (64, 256):
                run(f"nbl-{DEFAULT_CRITERION}-m{m}-cal{windows}", nbl({"m": m}), calibration(windows, args.seq_len))
    if "speed" in groups:
        contexts = [int(c) for c in args.contexts.split(",")]
        speed(h, [int(m) for m in args.speed_m.split(",")], contexts, args.new_tokens, args.repeats)


if __name__ == "__main__":
    main()

"""LISA (issue 6) on smollm2-135m (--model: another packaged model): the paper's analyses, LISA on ~50% / ~70% of
the layers after a CPU distillation budget, `ds` on the same layers, the Table-8 ablation (+Align / +Diff.),
K-cache bytes per token and decode speed against the dense model in the same run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lisa.py                 # full: results/lisa.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lisa.py --small --out /tmp/lisa_small.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lisa.py --model gemma3-270m --out benchmarks/results/lisa-gemma3.json\
        --tokens 4096 --steps 100 --fractions 0.5 --ablation-fraction 0.5   # the claims' Gemma-3 cells
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lisa.py --model qwen2.5-1.5b \
        --out benchmarks/results/lisa-qwen2.5-1.5b.json --tokens 2048 --fractions "" --ablation-fraction 0 \
        --sens-windows 1   # the analyses only (no fraction: no variant), the claims' 1.5B cells
    .venv/bin/python benchmarks/make_report.py                            # regenerates BENCHMARKS.md

Layers: `select_layers(L, fraction, cost)` with cost = single-layer DS loss increase of the sensitivity sweep (never
the first max(2, ⌈L/10⌉) layers, the last, nor one whose donor has another attention type). Training:
`train/distill.py` with the budget of --steps x --batch x --seq-len tokens from the --source calibration split
(wiki, or a mixture such as wiki+c4), teacher = the dense model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch
from common import Harness, selected

from attnslim import _compat
from attnslim.adapters import get_adapter
from attnslim.analysis.similarity import (
    format_sensitivity,
    format_similarity,
    sensitivity_cost,
    sensitivity_report,
    similarity_report,
)
from attnslim.api import compress
from attnslim.bench import interleaved
from attnslim.errors import AttnslimError
from attnslim.methods.lisa import select_layers, unshareable_layers
from attnslim.models import load_model
from attnslim.recipe import recipe_from_dict
from attnslim.train.distill import DistillConfig

ABLATIONS: dict[str, dict[str, Any]] = {"align-only": {"compensate": False},
                                        "diff-only": {"align": False, "integrate": "add"}}


def key_cache_bytes(model: Any, tokens: int = 64) -> list[float]:
    """Bytes per token of the *keys* each layer's cache holds (K, K_LR, or DS's position marker:
    one value per KV head; 1 byte per token in the rows measured before static caches were supported)."""
    ids = torch.randint(0, 1000, (1, tokens), generator=torch.Generator().manual_seed(0))
    cache = _compat.new_cache(model.config)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    return [layer.keys.numel() * layer.keys.element_size() / tokens for layer in cache.layers]


def recipe(name: str, method: str, layers: list[int], args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "calibration": {"source": "wiki", "windows": 1, "seq_len": 64, "seed": 0},
            "steps": [{"method": method, "layers": layers, "args": args}]}


class LisaBench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.h = Harness("lisa", model=args.model, tokens=args.tokens, seq_len=args.eval_seq_len)
        if args.out:  # another results file: start from its own contents, not from lisa.json's
            self.h.path = Path(args.out)
            old = json.loads(self.h.path.read_text()) if self.h.path.exists() else {"variants": {}}
            self.h.data = {**old, **{k: self.h.data[k] for k in ("model", "eval", "environment")}}
        self.dense, self.tokenizer = load_model(self.args.model)
        self.h.data["dense_key_cache_bytes_per_token"] = key_cache_bytes(self.dense)
        self.train = DistillConfig(steps=args.steps, batch_size=args.batch, seq_len=args.seq_len, lr=args.lr,
                                   source=args.source)

    def analyses(self) -> dict[int, float] | None:
        a = self.args
        if a.skip_analysis:
            return None
        if "analysis" not in self.h.data:
            start = time.time()
            sim = similarity_report(self.dense, self.tokenizer, "wiki", a.sim_windows, a.analysis_seq_len)
            sens = sensitivity_report(self.dense, self.tokenizer, "wiki", a.sens_windows, a.analysis_seq_len,
                                      sweeps=tuple(a.sweeps.split(",")))
            self.h.data["analysis"] = {"similarity": sim, "sensitivity": sens, "seconds": round(time.time() - start)}
            self.h.save()
            text = format_similarity(sim) + "\n\n" + format_sensitivity(sens) + "\n"
            self.h.path.with_suffix(".txt").write_text(text)
            print(text, flush=True)
        return sensitivity_cost(self.h.data["analysis"]["sensitivity"])

    def variant(self, key: str, method: str, layers: list[int], args: dict[str, Any], train: bool) -> None:
        if key in self.h.data["variants"]:
            print(f"[skip] {key}", flush=True)
            return
        dense = self.h.dense()
        model, tokenizer = load_model(self.args.model)
        step_args = {**args, "train": dataclasses.asdict(self.train)} if train else args  # compress distils
        start = time.time()
        report = compress(model, tokenizer, recipe_from_dict(recipe(key, method, layers, step_args)), progress=False)
        training = report.steps[0]["plan"].get("training", {"trained": False})
        result = self.h.evaluate(model, tokenizer, key)
        keys = key_cache_bytes(model)
        speed = interleaved({"dense": self.dense, key: model}, [self.args.context], new_tokens=self.args.new_tokens,
                            repeats=self.args.repeats, progress=False)
        result.update({
            "layers": layers, "method": method, "args": args, "plans": [s["plan"] for s in report.steps],
            "training": {k: v for k, v in training.items() if k != "history"},
            "loss_curve": [h["loss"] for h in training.get("history", [])],
            "key_cache_bytes_per_token": keys, "speed": speed["models"][key][str(self.args.context)],
            "wall_seconds": round(time.time() - start, 1),
            "ppl_ratio": {s: result["ppl"][s] / dense["ppl"][s] for s in self.h.sources},
            "kept": {g: result["params"][g] / dense["params"][g] for g in ("attention", "mlp", "total")},
        })
        self.h.data["variants"][key] = result
        self.h.data["notes"] = notes(self.h.data, self.train, self.args)
        self.h.save()
        ratios = ", ".join(f"{s} {v:.3f}x" for s, v in result["ppl_ratio"].items())
        print(f"[done] {key}: {ratios}; decode x{result['speed']['decode_ratio']:.2f}", flush=True)


def notes(data: dict[str, Any], train: DistillConfig, args: argparse.Namespace) -> list[str]:
    out = [f"Training budget per LISA variant: {train.steps} steps x {train.batch_size} x {train.seq_len} tokens "
           f"= {train.steps * train.batch_size * train.seq_len:,} {train.source} calibration tokens (lr {train.lr}, "
           f"beta {train.beta}); decode speed: context {args.context}, {args.new_tokens} new tokens, "
           f"median of {args.repeats}, interleaved with the dense model.", "",
           "| variant | layers | train s | loss first→last | K B/token (shared layers) | decode tok/s (×dense) |",
           "|---|---|---|---|---|---|"]
    for key, v in data["variants"].items():
        layers = v["layers"]
        k = sum(v["key_cache_bytes_per_token"][i] for i in layers) / len(layers)
        dense_k = sum(data["dense_key_cache_bytes_per_token"][i] for i in layers) / len(layers)
        t = v["training"]
        loss = f"{t['first']['loss']:.3f}→{t['last']['loss']:.3f}" if t.get("trained") else "–"
        out.append(f"| {key} | {len(layers)}: {layers} | {t.get('seconds', '–')} | {loss} | {k:.0f} "
                   f"({dense_k / k:.1f}× smaller) | {v['speed']['decode_tok_s']:.1f} "
                   f"(×{v['speed']['decode_ratio']:.2f}) |")
    analysis = data.get("analysis")
    if analysis:
        s = analysis["similarity"]["summary"]
        sens = analysis["sensitivity"]
        single = sens.get("single", {}).get("ds", {})
        worst = sorted(single, key=lambda k: -single[k])[:3]
        out += ["", f"Analyses ({analysis['similarity']['description']}; sensitivity: {sens['description']}): "
                f"adjacent-layer JS {s['adjacent_js_mean']:.4f} vs |i−j|≥4 {s['distant_js_mean']:.4f}; "
                f"most dissimilar layer {s['most_dissimilar_layer']}; per-head JS " + ", ".join(
                    f"{k} {v:.4f}" for k, v in s["head_js_mean"].items()) + "; adjacent cosine " + ", ".join(
                    f"{k} {v:.2f}" for k, v in s["cosine_mean"].items()) + f"; layers most sensitive to DS: {worst}."]
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--small", action="store_true", help="50 steps, 2048 eval tokens, LISA/ds at 50%% only")
    p.add_argument("--model", default="smollm2-135m", help="a packaged model name (gemma3-270m: `make gemma`)")
    p.add_argument("--out", default="", help="results JSON path (default benchmarks/results/lisa.json)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--source", default="wiki", help="training text: a source or a mixture such as wiki+c4")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--eval-seq-len", type=int, default=512)
    p.add_argument("--fractions", default="0.5,0.7")
    p.add_argument("--ablation-fraction", type=float, default=0.5)
    p.add_argument("--skip-analysis", action="store_true")
    p.add_argument("--sim-windows", type=int, default=8)
    p.add_argument("--sens-windows", type=int, default=2)
    p.add_argument("--analysis-seq-len", type=int, default=256)
    p.add_argument("--sweeps", default="single,suffix")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", default="", help="comma-separated variant keys")
    args = p.parse_args()
    if args.small:
        args.steps, args.tokens, args.fractions, args.sim_windows, args.sens_windows = 50, 2048, "0.5", 2, 1
        args.ablation_fraction, args.new_tokens, args.repeats = 0.0, 16, 2
    fractions = [float(f) for f in args.fractions.split(",") if f]
    jobs: list[tuple[str, str, float, dict[str, Any], bool]] = []  # (key, method, fraction, args, train)
    for frac in fractions:
        pct = round(100 * frac)
        jobs += [(f"ds-{pct}", "ds", frac, {}, False), (f"lisa-{pct}", "lisa", frac, {}, True)]
    if args.ablation_fraction:
        pct = round(100 * args.ablation_fraction)
        jobs += [(f"{k}-{pct}", "lisa", args.ablation_fraction, a, True) for k, a in ABLATIONS.items()]
    only = selected(args.only, [job[0] for job in jobs])  # before the model loads
    bench = LisaBench(args)
    adapter = get_adapter(bench.dense)
    n_layers, skip = adapter.num_layers(), unshareable_layers(adapter)
    for frac in [*fractions, *([args.ablation_fraction] if args.ablation_fraction else [])]:
        try:  # a fraction this model cannot share stops here, before the analyses' minutes
            select_layers(n_layers, frac, skip=skip)
        except AttnslimError as err:
            raise SystemExit(f"--fractions/--ablation-fraction: {err}") from err
    cost = bench.analyses()
    for key, method, frac, margs, train in jobs:
        if key in only:
            bench.variant(key, method, select_layers(n_layers, frac, cost, skip=skip), margs, train)


if __name__ == "__main__":
    main()

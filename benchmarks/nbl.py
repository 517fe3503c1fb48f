"""NBL measurements of issue 5 on smollm2-135m, every variant in the same harness (benchmarks/common.py).

Groups (--groups, comma-separated; default all):
  stats    one pass over the dense model: every layer's LMMSE fits (X = norm(h) and X = h), the selection
           scores and diagnostics (E‖Y‖²/E‖h‖², CCA of Y alone, ...) → "linearity" in the results; and the
           measured damage of linearizing each layer alone (NLL on 2 held-out *calibration-split* windows)
  sweep    wiki/ptb/c4 perplexity for m in --m: NBL one-shot with the default criterion, the paper's
           configuration (cca bound, X = raw residual h), NBL with layers chosen by the cca bound / LLM-Drop
           cosine similarity / relative fit error (resid) / random (seeded) / highest bound (whichever is not
           the default); attention drop (LLM-Drop) on the layers the
           default NBL, the paper and similarity chose; NBL sequential at --seq-m
  probe    NBL with criterion "probe" (each candidate linearized alone, the increase of the NLL of the first
           --probe-windows calibration windows measured; the m cheapest chosen), and drop on the same layers
  calib    calibration-size sensitivity: the default NBL at --calib-m with --calib-windows windows
  ridge    ridge sensitivity: the default NBL at --calib-m with the relative ridges --ridges (default 1e-6)
  speed    decode tokens/s and prefill time against dense at --contexts (attnslim.bench.interleaved);
           linearized layers are built with `Nbl.skeleton` (timing does not depend on the fitted values)

One-shot variants share the dense statistics: they depend only on the dense model and the calibration windows,
so `stats` collects them once and each variant runs exactly what `compress` runs after the statistics
(`Nbl.plan`, then `Nbl.convert` of the chosen layers; pipeline/run.py, _run_selecting). Sequential and drop variants
go through `compress` (Harness.run). `--check` also runs the default variant at the first m through
`compress` and records both, so the shortcut is verified in the results file.

    .venv/bin/python benchmarks/nbl.py                                   # the full run (hours on a 2-core CPU)
    .venv/bin/python benchmarks/nbl.py --name nbl-small --tokens 2048 --windows 32 --m 3,6,9,12,15 --seq-m 6,12
    .venv/bin/python benchmarks/nbl.py --model gemma3-270m --name nbl-gemma3    # once its adapter exists
    .venv/bin/python benchmarks/nbl.py --model gemma3-270m --name nbl-gemma3-speed --groups speed --sources wiki \
        --tokens 2048 --speed-m 6 --selection-from nbl-gemma3-bos --repeats 5   # decode speed on Gemma-3's choice
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/nbl.py --model qwen2.5-1.5b --name nbl-qwen2.5-1.5b --groups sweep \
        --m 6,12 --only nbl-paper-m6,nbl-random-m6,drop-paper-layers-m6,nbl-paper-m12,nbl-random-m12 --sources wiki \
        --tokens 4096 --windows 8                                        # the claims table's 1.5B cells
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/nbl.py --model qwen2.5-1.5b --name nbl-qwen2.5-1.5b --groups speed \
        --speed-m 12 --contexts 512,2048 --repeats 3 --sources wiki --tokens 4096   # its decode-speed cells
    .venv/bin/python benchmarks/make_report.py                           # regenerates BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch
from common import RESULTS, Harness, calibration, selected

from attnslim.adapters import get_adapter
from attnslim.bench import interleaved
from attnslim.bench.flops import flops_per_token
from attnslim.calib.runner import LayerRunner
from attnslim.data import calib_windows
from attnslim.eval import perplexity
from attnslim.linalg.cca import cca_bound, lmmse_map
from attnslim.methods.nbl import DEFAULT_CRITERION, LayerFit, LinearityCollector, Nbl, NblEntry
from attnslim.models import load_model
from attnslim.recipe import fingerprint, recipe_from_dict

SELECTIONS = tuple(c for c in ("cca", "similarity", "resid", "random", "highest") if c != DEFAULT_CRITERION)
# NBL (X = norm(h)) with the other layer choices
PAPER: dict[str, Any] = {"criterion": "cca", "input": "residual"}  # the paper's configuration


def nbl(args: dict[str, Any], layers: Any = "all") -> list[dict[str, Any]]:
    return [{"method": "nbl", "layers": layers, "args": args}]


def recipe(key: str, cal: dict[str, Any], steps: list[dict[str, Any]]) -> dict[str, Any]:
    return {"name": key, "calibration": cal, "steps": steps}


class SharedFits:
    """Dense one-shot statistics of every layer, collected once per calibration: fits for both inputs."""

    def __init__(self, h: Harness, cal: dict[str, Any], ridge: float = 1e-6) -> None:
        start = time.time()
        model, tokenizer = load_model(h.model_name)
        adapter = get_adapter(model)
        windows = calib_windows(cal["source"], tokenizer, cal["windows"], cal["seq_len"], cal["seed"])
        runner = LayerRunner(model, adapter, windows.ids, cal["batch_size"])
        self.fits: dict[str, dict[int, LayerFit]] = {"normed": {}, "residual": {}}
        self.diagnostics: dict[int, dict[str, float]] = {}
        for i in range(adapter.num_layers()):
            collector = Nbl(m=0).collector(adapter, i)  # X = norm(h); it also streams (h, Y) for the bound
            assert isinstance(collector, LinearityCollector)
            with torch.no_grad():
                runner.run_layer(i, collector.sites, collector, advance=True)
            fit = collector.result()
            res = collector.res
            assert res is not None
            w, b, info = lmmse_map(res, ridge=ridge)  # the paper's X = h (its `resid` score is not recomputed)
            self.fits["normed"][i] = fit
            self.fits["residual"][i] = LayerFit(i, w.float(), b.float(), fit.scores, info)
            energy_y, energy_h = float(torch.trace(res.sum_yy)) / res.n, float(torch.trace(res.sum_xx)) / res.n
            self.diagnostics[i] = {
                **fit.scores, "nmse_residual_input": info.nmse,
                "cca_plain": cca_bound(res, residual=False),  # Σ(1 − ρ²) of (Y, h): Y's own linearity
                "y_over_h": energy_y / energy_h,  # E‖Y‖² / E‖h‖²: how much the block adds to the stream
                "h_rms": (energy_h / res.d_x) ** 0.5, "cond": fit.info.cond,
            }
            print(f"  stats layer {i}: " + ", ".join(f"{k} {v:.4g}" for k, v in self.diagnostics[i].items()),
                  flush=True)
        self.calibration = {"description": windows.description, "tokens": windows.n_tokens,
                            "fingerprint": windows.fingerprint()}
        self.seconds = time.time() - start
        self.n_layers = adapter.num_layers()

    def apply(self, model: Any, args: dict[str, Any]) -> dict[str, Any]:
        """What `compress` does after the statistics: plan (selection), then install the chosen fits."""
        method = Nbl(**args)
        adapter = get_adapter(model)
        fits = self.fits[method.input]
        plan = method.plan(adapter, list(range(self.n_layers)), fits)
        for i, entry in plan.layers.items():
            plan.record(i, method.convert(adapter, i, entry, fits[i]))
        return plan.to_json()

    def single_layer_damage(self, h: Harness, cal: dict[str, Any]) -> dict[int, float]:
        """NLL increase when only layer i is linearized, on 2 windows of the calibration split (seed + 1)."""
        model, tokenizer = load_model(h.model_name)
        probe = calib_windows(cal["source"], tokenizer, 2, cal["seq_len"], cal["seed"] + 1)
        base = perplexity(model, probe, progress=False).nll
        adapter = get_adapter(model)
        out = {}
        for i in range(self.n_layers):
            original = adapter.attention(i)
            Nbl(criterion="given").convert(adapter, i, NblEntry("normed"), self.fits["normed"][i])
            out[i] = perplexity(model, probe, progress=False).nll - base
            adapter.replace_attention(i, original)
            print(f"  damage layer {i}: {out[i]:+.4f} nats", flush=True)
        return out


def run_shared(h: Harness, shared: SharedFits, key: str, cal: dict[str, Any], args: dict[str, Any]) -> None:
    """A one-shot NBL variant on the shared statistics, recorded like Harness.run records a compress run."""
    rec = recipe_from_dict(recipe(key, cal, nbl(args)))
    done = h.data["variants"].get(key)
    if done and done.get("recipe_fingerprint") == fingerprint(rec):
        print(f"[skip] {key}: already measured", flush=True)
        return
    dense = h.dense()
    start = time.time()
    model, tokenizer = load_model(h.model_name)
    plan = shared.apply(model, args)
    result = h.evaluate(model, tokenizer, key)
    result.update({
        "recipe": recipe(key, cal, nbl(args)), "recipe_fingerprint": fingerprint(rec),
        "plans": [{"method": "nbl", "plan": plan}], "calibration": shared.calibration,
        "compress_seconds": round(shared.seconds, 1), "statistics": "shared dense pass (see module docstring)",
        "command": h.data["environment"]["command"],
        "wall_seconds": round(time.time() - start, 1),
    })
    h.record(key, result, dense, note=f"layers {plan['chosen']}")


def chosen_layers(h: Harness, key: str, variants: dict[str, Any] | None = None) -> list[int] | None:
    """The layers variant `key` linearized, from `variants` (another run's) or this run's results."""
    variant = (h.data["variants"] if variants is None else variants).get(key)
    return None if variant is None else list(variant["plans"][0]["plan"]["chosen"])


def speed(h: Harness, ms: list[int], contexts: list[int], new_tokens: int, repeats: int,
          selection: dict[str, Any] | None = None) -> None:
    """Dense and NBL with m linearized layers, interleaved in one run (ratios to dense). The layers are those the
    default criterion chose at m in this run's results, or in `selection` (another results file's variants); the
    last m layers where neither has that m (recorded in the results' "layers" with where they came from)."""
    models: dict[str, Any] = {}
    dense, _ = load_model(h.model_name)
    models["dense"] = dense.eval()
    n_layers = get_adapter(dense).num_layers()
    picked: dict[str, dict[str, Any]] = {}
    for m in ms:
        model, _ = load_model(h.model_name)
        adapter = get_adapter(model)
        key = f"nbl-{DEFAULT_CRITERION}-m{m}"
        chosen = chosen_layers(h, key, selection)
        layers = chosen or list(range(n_layers - m, n_layers))
        picked[f"nbl-m{m}"] = {"layers": layers, "from": key if chosen else "the last m layers (no selection)"}
        for i in layers:
            Nbl(m=m).skeleton(adapter, i, NblEntry("normed"))
        models[f"nbl-m{m}"] = model.eval()
    result = interleaved(models, contexts, new_tokens=new_tokens, repeats=repeats)
    result["layers"] = picked
    # the decode ratio a pure FLOP count predicts: linearizing removes q/k/v/o and the core, not the MLP or LM head
    flops = {n: {str(c): flops_per_token(mdl, c)["total"] for c in contexts} for n, mdl in models.items()}
    result["flop_ratio"] = {n: {c: flops["dense"][c] / f for c, f in fl.items()} for n, fl in flops.items()}
    h.data["speed"] = result
    threads = torch.get_num_threads()
    lines = [f"Decode speed (greedy, HF DynamicCache, float32, {threads} thread{'s' * (threads > 1)}; medians of "
             f"interleaved repetitions, ratio to dense; target decode ratio ≥ 0.9/(1 − m/{n_layers})). "
             "\"FLOP model\" = dense FLOPs per token ÷ the model's (attnslim.bench.flops): the speed-up if time "
             "followed FLOPs. The target assumes whole layers vanish; a linearized layer keeps its MLP (3x its "
             "attention weights) and the LM head stays, so the FLOP model stays far below it (linearized layers: "
             + "; ".join(f"{k} {v['layers']} ({v['from']})" for k, v in picked.items()) + "):", "",
             "| model | " + " | ".join(f"decode tok/s @{c} (×dense) | FLOP model @{c} | prefill ms @{c} (×dense)"
                                    for c in contexts) + " |", "|---|" + "---|---|---|" * len(contexts)]
    for name, rows in result["models"].items():
        cells = " | ".join(f"{rows[str(c)]['decode_tok_s']:.1f} ({rows[str(c)]['decode_ratio']:.2f}×) | "
                           f"{result['flop_ratio'][name][str(c)]:.2f}× | "
                           f"{rows[str(c)]['prefill_s'] * 1000:.0f} ({rows[str(c)]['prefill_ratio']:.2f}×)"
                           for c in contexts)
        lines.append(f"| {name} | {cells} |")
    h.data["notes"] = lines
    h.save()
    print("\n".join(lines), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", default="nbl", help="results file benchmarks/results/NAME.json")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=8192, help="evaluation tokens per source")
    parser.add_argument("--sources", default="wiki,ptb,c4")
    parser.add_argument("--windows", type=int, default=32, help="calibration windows")
    parser.add_argument("--seq-len", type=int, default=512, help="calibration window length")
    parser.add_argument("--m", default="3,6,9,12,15", help="numbers of linearized layers")
    parser.add_argument("--seq-m", default="6,12", help="m for NBL sequential")
    parser.add_argument("--groups", default="stats,sweep,probe,calib,speed")
    parser.add_argument("--only", default="", help="comma-separated variant keys to run (others are skipped)")
    parser.add_argument("--check", action="store_true", help="also run the first default variant via compress")
    parser.add_argument("--probe-windows", type=int, default=4, help="calibration windows of the probe criterion")
    parser.add_argument("--calib-m", default="6", help="m for the calibration-size sensitivity")
    parser.add_argument("--calib-windows", default="64,256")
    parser.add_argument("--ridges", default="1e-4,1e-2", help="ridge group: ridges relative to mean eig(C_XX)")
    parser.add_argument("--contexts", default="512,2048")
    parser.add_argument("--speed-m", default="6,12")
    parser.add_argument("--selection-from", default="", help="speed: the results file (stem) whose default-criterion "
                        "rows give the linearized layers (default: this run's)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    h = Harness(args.name, model=args.model, tokens=args.tokens, sources=tuple(args.sources.split(",")))
    cal = calibration(args.windows, args.seq_len)
    groups = set(args.groups.split(","))
    ms = [int(m) for m in args.m.split(",") if m]  # in the order given (run the important ones first)
    seq_ms = {int(m) for m in args.seq_m.split(",") if m}
    default = f"nbl-{DEFAULT_CRITERION}"
    shared: list[SharedFits] = []  # the sweep's dense statistics, collected once after the dense model is scored
    jobs: list[tuple[str, Callable[[], None]]] = []  # (variant key, its run), in run order

    def run(key: str, steps: Callable[[], list[dict[str, Any]] | None], calib: dict[str, Any] = cal) -> None:
        def job() -> None:
            chosen = steps()
            if chosen is None:  # a drop of layers no variant of this run (or its file) selected
                return
            start = time.time()
            h.run(key, recipe(key, calib, chosen))
            print(f"  {key}: {time.time() - start:.0f} s", flush=True)
        jobs.append((key, job))

    def given(steps: list[dict[str, Any]]) -> Callable[[], list[dict[str, Any]]]:
        return lambda: steps

    def drop(key: str, source: str) -> None:  # attention drop of the layers variant `source` linearized
        def steps() -> list[dict[str, Any]] | None:
            layers = chosen_layers(h, source)
            return [{"method": "drop", "layers": layers, "args": {"select": "given"}}] if layers else None
        run(key, steps)

    def one_shot(key: str, nbl_args: dict[str, Any]) -> None:
        jobs.append((key, lambda: run_shared(h, shared[0], key, cal, nbl_args)))

    if "sweep" in groups:
        for m in ms:
            one_shot(f"{default}-m{m}", {"m": m})
            one_shot(f"nbl-paper-m{m}", {"m": m, **PAPER})
            for c in SELECTIONS:
                one_shot(f"nbl-{c}-m{m}", {"m": m, "criterion": c})
            for source in dict.fromkeys((default, "nbl-paper", "nbl-similarity")):  # attention drop, same layers
                drop(f"drop-{source.removeprefix('nbl-')}-layers-m{m}", f"{source}-m{m}")
            if m in seq_ms:
                run(f"nbl-seq-{DEFAULT_CRITERION}-m{m}", given(nbl({"m": m, "sequential": True})))
        if args.check and ms:
            run(f"{default}-m{ms[0]}-compress", given(nbl({"m": ms[0]})))
    if "probe" in groups:  # the measured criterion (calibration NLL of each single-layer trial), through compress
        for m in ms:
            run(f"nbl-probe-m{m}", given(nbl({"m": m, "criterion": "probe", "probe": args.probe_windows})))
            drop(f"drop-probe-layers-m{m}", f"nbl-probe-m{m}")
    if "calib" in groups:
        for m in [int(m) for m in args.calib_m.split(",") if m]:
            for windows in [int(w) for w in args.calib_windows.split(",") if w]:
                run(f"{default}-m{m}-cal{windows}", given(nbl({"m": m})), calibration(windows, args.seq_len))
    if "ridge" in groups:
        for m in [int(m) for m in args.calib_m.split(",") if m]:
            for ridge in [float(r) for r in args.ridges.split(",") if r]:
                run(f"{default}-m{m}-ridge{ridge:g}", given(nbl({"m": m, "ridge": ridge})))
    only = selected(args.only, [key for key, _ in jobs], args.groups)  # before any work

    h.dense()
    if groups & {"stats", "sweep"}:
        shared.append(SharedFits(h, cal))
        h.data["linearity"] = {"calibration": shared[0].calibration, "seconds": round(shared[0].seconds, 1),
                               "layers": {str(i): d for i, d in shared[0].diagnostics.items()}}
        h.save()
    if "stats" in groups and shared:
        damage = shared[0].single_layer_damage(h, cal)
        for i, v in damage.items():
            h.data["linearity"]["layers"][str(i)]["damage_nll"] = v
        h.save()
    for key, job in jobs:
        if key in only:
            job()
    if "speed" in groups:
        contexts = [int(c) for c in args.contexts.split(",")]
        selection = (json.loads((RESULTS / f"{args.selection_from}.json").read_text())["variants"]
                     if args.selection_from else None)
        speed(h, [int(m) for m in args.speed_m.split(",")], contexts, args.new_tokens, args.repeats, selection)


if __name__ == "__main__":
    main()

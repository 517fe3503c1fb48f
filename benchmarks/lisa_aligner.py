"""LISA property 19 (notes §7): a trained single-linear (SL) aligner is permutation-like.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lisa_aligner.py      # -> results/lisa-aligner-smollm2-135m.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lisa_aligner.py --model gemma3-270m

LISA_SL (align_hidden 0) on four deep non-adjacent layers (lisa_runs.LAYERS: 18, 20, 22, 24 of smollm2-135m; each
donor an unchanged dense layer), distilled with the project defaults (beta 0.25, lr 1e-2) for --steps x --batch x
--seq-len wiki calibration tokens, once from each init: "ds" (identity on A_{n-1}: starts permutation-like by
construction, so only a move towards the global matching counts) and "default" (random: any structure is learned).
For each receiver n, analysis/aligner.py's head mass of the A_{n-1} block gives the concentration (top-1 share of
each output head's row) and the agreement of each row's argmax with the global most-similar head of the dense model
(similarity_report, --windows x --sim-seq-len wiki evaluation tokens), before and after training; chance is 1/h (1/9
on SmolLM2, 1/4 on Gemma-3).
Budget: 2 trainings of 100 steps x 2 x 128 tokens, ~2.1 s a step alone on one thread; the recorded run took
16 minutes in all on a loaded 2-core machine (results JSON: `seconds`).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from common import RESULTS, environment
from lisa_runs import lisa_copy, receivers, train

from attnslim.adapters import get_adapter
from attnslim.analysis.aligner import head_mass, permutation_likeness
from attnslim.analysis.similarity import similarity_report
from attnslim.models import load_model
from attnslim.modules.aligner import Aligner
from attnslim.train.distill import DistillConfig


def likeness(model: Any, layers: list[int], matching: list[list[int]]) -> dict[str, Any]:
    """Per receiver n: permutation_likeness of its aligner against the global matching of pair (n-1, n)."""
    adapter = get_adapter(model)
    per = {str(n): asdict(permutation_likeness(head_mass(_aligner(adapter.attention(n))), matching[n - 1]))
           for n in layers}
    return {"layers": per, **{k: sum(p[k] for p in per.values()) / len(per) for k in ("concentration", "agreement")}}


def _aligner(attention: Any) -> Aligner:
    align = attention.align
    if not isinstance(align, Aligner):
        raise TypeError(f"layer {attention.layer_idx} has no aligner: {align!r}")
    return align


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--sim-seq-len", type=int, default=256)
    p.add_argument("--inits", default="ds,default")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--layers", default="", help="N,N,... LISA layers (default: lisa_runs.LAYERS of the model)")
    p.add_argument("--out", default="", help="results JSON (default results/lisa-aligner-MODEL.json)")
    args = p.parse_args()
    layers = receivers(args.model, args.layers)
    out_path = Path(args.out) if args.out else RESULTS / f"lisa-aligner-{args.model}.json"
    torch.manual_seed(0)
    dense, tokenizer = load_model(args.model)
    start = time.time()
    sim = similarity_report(dense, tokenizer, "wiki", args.windows, args.sim_seq_len, progress=False)
    matching = sim["head_matching"]["global_match"]
    h = sim["heads"]
    out: dict[str, Any] = {
        "model": args.model, "environment": environment(), "layers": layers, "heads": h,
        "matching": {"description": sim["description"], "global_match": {str(n): matching[n - 1] for n in layers},
                     "identity_agreement": {str(n): sum(b == a for a, b in enumerate(matching[n - 1])) / h
                                            for n in layers}},
        "variants": {},
    }
    cfg = DistillConfig(steps=args.steps, batch_size=args.batch, seq_len=args.seq_len)
    for init in args.inits.split(","):
        model = lisa_copy(dense, tokenizer, layers, {"align_hidden": 0, "init": init})
        before = likeness(model, layers, matching)
        report = train(model, dense, tokenizer, cfg)
        after = likeness(model, layers, matching)
        out["variants"][f"sl-{init}"] = {"init": init, "untrained": before, "trained": after, "training": report}
        print(f"[done] sl-{init}: concentration {before['concentration']:.3f} -> {after['concentration']:.3f}, "
              f"agreement {before['agreement']:.3f} -> {after['agreement']:.3f}", flush=True)
    out["seconds"] = round(time.time() - start)
    out["notes"] = notes(out, cfg)
    out_path.write_text(json.dumps(out, indent=1) + "\n")


def notes(out: dict[str, Any], cfg: DistillConfig) -> list[str]:
    lines = [f"LISA_SL (single linear aligner) on layers {out['layers']}, distilled {cfg.steps} steps x "
             f"{cfg.batch_size} x {cfg.seq_len} wiki calibration tokens (beta {cfg.beta}, lr {cfg.lr}); reference: "
             f"the dense model's global most-similar head matching on {out['matching']['description']}. Concentration "
             f"= mean top-1 share of each output head's |weight| over source heads of A_(n-1); agreement = fraction "
             f"of output heads whose argmax is the global match (chance 1/{out['heads']} = {1 / out['heads']:.3f}; "
             f"the identity itself agrees on {_mean(out['matching']['identity_agreement']):.3f}).", "",
             "| init | concentration untrained → trained | agreement untrained → trained |", "|---|---|---|"]
    for v in out["variants"].values():
        u, t = v["untrained"], v["trained"]
        lines.append(f"| {v['init']} | {u['concentration']:.3f} → {t['concentration']:.3f} | "
                     f"{u['agreement']:.3f} → {t['agreement']:.3f} |")
    return lines


def _mean(d: dict[str, float]) -> float:
    return sum(d.values()) / len(d)


if __name__ == "__main__":
    main()

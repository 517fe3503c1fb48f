"""LISA property 20 (notes §7): KD helps. beta = 0.25 (score Huber + LM) against beta = 0 (LM only) at equal steps.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lisa_beta.py         # -> results/lisa-beta-smollm2-135m.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lisa_beta.py --model gemma3-270m

The project's default LISA (two-layer aligner, init ds) on lisa_runs.LAYERS (18, 20, 22, 24 of smollm2-135m),
distilled with `train/distill.distill` at each --betas value and each --seeds seed (the seed of both the training
windows and the new weights' init), the same --steps x --batch x --seq-len wiki calibration tokens and lr. Measured
on held-out text, the first --windows x --eval-seq-len tokens of wiki's evaluation split (never drawn for training):
the score Huber error (distill's KD term: mean over the LISA layers of Huber(delta 1) between the student's
integrated scores and the dense teacher's, attended entries only) and the LM loss (perplexity = its exp), also
before training.
Budget: 4 trainings of 100 steps x 2 x 128 tokens, ~2.1 s a step alone on one thread (~17 min in all); the recorded
run took 33 minutes on a loaded 2-core machine (results JSON: `seconds`).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
from common import RESULTS, environment
from lisa_runs import held_out, lisa_copy, receivers, train

from attnslim.data import eval_windows
from attnslim.eval import perplexity
from attnslim.models import load_model
from attnslim.train.distill import DistillConfig


def summary(runs: dict[str, dict[str, Any]], betas: list[float], seeds: list[int]) -> dict[str, Any]:
    """Per beta: the held-out Huber error and LM loss averaged over seeds."""
    out: dict[str, Any] = {}
    for beta in betas:
        rows = [runs[key(beta, s)]["held_out"] for s in seeds]
        out[str(beta)] = {k: sum(r[k] for r in rows) / len(rows) for k in ("huber", "lm_loss", "ppl")}
    return out


def key(beta: float, seed: int) -> str:
    return f"beta{beta:g}-seed{seed}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--betas", default="0,0.25")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--eval-seq-len", type=int, default=256)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--layers", default="", help="N,N,... LISA layers (default: lisa_runs.LAYERS of the model)")
    args = p.parse_args()
    layers = receivers(args.model, args.layers)
    betas = [float(b) for b in args.betas.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    dense, tokenizer = load_model(args.model)
    windows = eval_windows("wiki", tokenizer, args.windows * args.eval_seq_len, args.eval_seq_len)
    start = time.time()
    out: dict[str, Any] = {"model": args.model, "environment": environment(), "layers": layers,
                           "held_out_text": windows.description,
                           "dense_ppl": perplexity(dense, windows).ppl, "runs": {}}
    for seed in seeds:
        base = lisa_copy(dense, tokenizer, layers, {"seed": seed})
        out["runs"][f"untrained-seed{seed}"] = {"held_out": held_out(base, dense, windows.ids)}
        for beta in betas:
            torch.manual_seed(seed)
            model = lisa_copy(dense, tokenizer, layers, {"seed": seed})
            cfg = DistillConfig(steps=args.steps, batch_size=args.batch, seq_len=args.seq_len, beta=beta, seed=seed)
            report = train(model, dense, tokenizer, cfg)
            result = held_out(model, dense, windows.ids)
            out["runs"][key(beta, seed)] = {"beta": beta, "seed": seed, "held_out": result, "training": report}
            print(f"[done] {key(beta, seed)}: huber {result['huber']:.4f}, lm {result['lm_loss']:.4f}", flush=True)
    out["summary"] = summary(out["runs"], betas, seeds)
    out["seconds"] = round(time.time() - start)
    out["notes"] = notes(out, args)
    (RESULTS / f"lisa-beta-{args.model}.json").write_text(json.dumps(out, indent=1) + "\n")


def notes(out: dict[str, Any], args: argparse.Namespace) -> list[str]:
    lines = [f"LISA (default two-layer aligner) on layers {out['layers']}; each run distilled {args.steps} steps x "
             f"{args.batch} x {args.seq_len} wiki calibration tokens, seeds {args.seeds}; held out: "
             f"{out['held_out_text']} (dense perplexity {out['dense_ppl']:.2f}). Huber = the KD term (mean over the "
             "LISA layers, attended entries); "
             "LM loss = next-token cross entropy.", "",
             "| run | beta | seed | held-out score Huber | held-out LM loss | ppl |", "|---|---|---|---|---|---|"]
    for name, r in out["runs"].items():
        h = r["held_out"]
        lines.append(f"| {name} | {r.get('beta', '–')} | {r.get('seed', name[-1])} | {h['huber']:.4f} | "
                     f"{h['lm_loss']:.4f} | {h['ppl']:.2f} |")
    return lines


if __name__ == "__main__":
    main()

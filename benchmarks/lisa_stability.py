"""LISA property 15 (notes §7): the adjacent-layer JS profile is stable across inputs, on smollm2-135m
(--model: another packaged model).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lisa_stability.py    # -> results/lisa-stability-smollm2-135m.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lisa_stability.py --model gemma3-270m  # -> …-gemma3-270m.json

similarity_report on an easy text (TinyStories, "tiny") and a hard one (Wikipedia, "wiki"; PTB as a second hard
set), the first --windows windows of each evaluation split, at each of --seq-lens: the Spearman correlation of the
L − 1 adjacent-pair JS values (easy against each hard set), the mean adjacent JS and the mean JS over every pair of
distinct layers. Budget: about 2 minutes on one thread.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
from common import RESULTS, environment
from scipy.stats import spearmanr

from attnslim.analysis.similarity import adjacent_js, mean_pair_js, similarity_report
from attnslim.models import load_model

EASY, HARD = "tiny", ("wiki", "ptb")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m", help="a packaged model name (gemma3-270m: `make gemma`)")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--seq-lens", default="128,256")
    args = p.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_model(args.model)
    start = time.time()
    out: dict[str, Any] = {"model": args.model, "environment": environment(), "easy": EASY, "hard": list(HARD),
                           "windows": args.windows, "lengths": {}}
    for seq_len in (int(s) for s in args.seq_lens.split(",")):
        sets = {}
        for source in (EASY, *HARD):
            r = similarity_report(model, tokenizer, source, args.windows, seq_len, progress=False)
            js = r["js_matrix"]
            sets[source] = {"description": r["description"], "adjacent": adjacent_js(js),
                            "adjacent_mean": r["summary"]["adjacent_js_mean"], "pair_mean": mean_pair_js(js)}
        spearman = {h: float(spearmanr(sets[EASY]["adjacent"], sets[h]["adjacent"]).statistic) for h in HARD}
        out["lengths"][str(seq_len)] = {"sets": sets, "spearman": spearman}
    out["seconds"] = round(time.time() - start)
    out["notes"] = notes(out)
    (RESULTS / f"lisa-stability-{args.model}.json").write_text(json.dumps(out, indent=1) + "\n")
    print("\n".join(out["notes"]))


def notes(out: dict[str, Any]) -> list[str]:
    pairs = len(next(iter(out["lengths"].values()))["sets"][out["easy"]]["adjacent"])
    lines = [f"Easy = {out['easy']}, hard = {', '.join(out['hard'])}: the first {out['windows']} windows of each "
             f"evaluation split. Spearman over the {pairs} adjacent-pair JS values, easy against each hard set; mean "
             "adjacent JS and mean JS over every pair of distinct layers.", "",
             "| tokens per window | set | Spearman with easy | mean adjacent JS | mean pair JS |",
             "|---|---|---|---|---|"]
    for seq_len, v in out["lengths"].items():
        for source, s in v["sets"].items():
            rho = f"{v['spearman'][source]:.3f}" if source in v["spearman"] else "–"
            lines.append(f"| {seq_len} | {source} | {rho} | {s['adjacent_mean']:.4f} | {s['pair_mean']:.4f} |")
    return lines


if __name__ == "__main__":
    main()

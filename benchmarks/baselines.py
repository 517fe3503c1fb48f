"""Baselines of the pipeline issue: svd / asvd / svdllm on q,k,v,o at 80% and 50% kept attention
parameters, and drop (similarity-selected) at 3 / 6 / 9 layers, on smollm2-135m.

    .venv/bin/python benchmarks/baselines.py            # writes benchmarks/results/baselines.json
    .venv/bin/python benchmarks/make_report.py          # regenerates BENCHMARKS.md
"""

from __future__ import annotations

import argparse

from common import Harness, calibration, selected


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--only", default="", help="comma-separated variant keys to run")
    args = parser.parse_args()
    h = Harness("baselines", tokens=args.tokens)
    variants = {}
    for method in ("svd", "asvd", "svdllm"):
        for ratio in (0.8, 0.5):
            variants[f"{method}-attn-{int(ratio * 100)}"] = {
                "name": f"{method}-attn-{int(ratio * 100)}", "calibration": calibration(),
                "steps": [{"method": method, "layers": "all",
                           "args": {"ratio": ratio, "linears": ["q", "k", "v", "o"]}}],
            }
    for count in (3, 6, 9):
        variants[f"drop-{count}"] = {
            "name": f"drop-{count}", "calibration": calibration(),
            "steps": [{"method": "drop", "layers": "all", "args": {"count": count, "select": "similarity"}}],
        }
    only = selected(args.only, variants)
    h.dense()
    for key, recipe in variants.items():
        if key in only:
            h.run(key, recipe)


if __name__ == "__main__":
    main()

"""Composed recipes (issue 8) on smollm2-135m: NBL linearizes the most linear attention blocks (no KV cache there),
LatentLLM turns the rest into latent attention; measured against the issue's targets for the default recipe
(KV ≤ 0.5× dense, total parameters ≤ 0.85×, wiki perplexity ≤ 1.25×, zero-shot accuracy within 3 points on
the demo's tasks, decode tokens/s ≥ dense). Recipes followed by healing are measured by benchmarks/heal.py.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/composed.py                   # results/composed.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/composed.py --only nbl6-lat-kv60
    .venv/bin/python benchmarks/make_report.py                                  # regenerates BENCHMARKS.md

Each variant: compress a fresh model, evaluate (Harness), then decode/prefill against the dense model interleaved
in the same process (medians of --repeats, ratio to dense). `recipes/default.yaml` is evaluated as "default".
"""

from __future__ import annotations

import argparse
from typing import Any

from common import Harness, calibration, selected

from attnslim.api import compress
from attnslim.bench import interleaved
from attnslim.demo import TASKS
from attnslim.eval.lmeval_run import evaluate_standard
from attnslim.eval.standard import materialise
from attnslim.eval.tasks import TASK_DIR
from attnslim.models import load_model
from attnslim.recipe import load_recipe, recipe_from_dict, recipe_to_dict
from attnslim.targets import check_targets, targets_met
from attnslim.user_cache import cache_root


def composed(name: str, m: int, latent: dict[str, Any], windows: int, criterion: str = "resid") -> dict[str, Any]:
    return {"name": name, "calibration": calibration(windows),
            "steps": [{"method": "nbl", "layers": "all", "args": {"m": m, "criterion": criterion}},
                      {"method": "latentllm", "layers": "rest", "args": latent}]}


def variants(windows: int) -> dict[str, dict[str, Any]]:
    kv = {"ratio": 1.0}  # q and o at full rank: the KV budget alone decides the latent ranks
    return {
        "default": recipe_to_dict(load_recipe("default")),
        "nbl6-lat-80": composed("nbl6-lat-80", 6, {"ratio": 0.8}, windows),
        "nbl6-lat-kv60": composed("nbl6-lat-kv60", 6, {**kv, "kv_ratio": 0.6}, windows),
        "nbl9-lat-kv70": composed("nbl9-lat-kv70", 9, {**kv, "kv_ratio": 0.7}, windows),
        "nbl12-lat-kv80": composed("nbl12-lat-kv80", 12, {**kv, "kv_ratio": 0.8}, windows),
        "lat-80-kv75": {"name": "lat-80-kv75", "calibration": calibration(windows),
                        "steps": [{"method": "latentllm", "layers": "all", "args": {"ratio": 0.8, "kv_ratio": 0.75}}]},
        "nblprobe6-lat-80-kv75": composed("nblprobe6-lat-80-kv75", 6, {"ratio": 0.8, "kv_ratio": 0.75}, windows,
                                          "probe"),
        "nblprobe6-lat-kv60": composed("nblprobe6-lat-kv60", 6, {**kv, "kv_ratio": 0.6}, windows, "probe"),
        "nbl9-lat-50": composed("nbl9-lat-50", 9, {"ratio": 0.5, "kv_ratio": 0.7}, windows),
        # cache=values: rotated keys stay dense, values become absorbed latents (decode-speed neutral with RoPE)
        "nbl6-val-kv62": composed("nbl6-val-kv62", 6, {**kv, "cache": "values", "kv_ratio": 0.62}, windows),
        "nbl9-val-kv70": composed("nbl9-val-kv70", 9, {**kv, "cache": "values", "kv_ratio": 0.7}, windows),
        "nbl12-val-kv80": composed("nbl12-val-kv80", 12, {**kv, "cache": "values", "kv_ratio": 0.8}, windows),
    }


def targets(result: dict[str, Any], dense: dict[str, Any]) -> dict[str, bool]:
    """{target: met} for one results row (attnslim.targets: the default recipe's targets)."""
    return targets_met(check_targets(
        kv=result["kv_bytes_per_token"] / dense["kv_bytes_per_token"], total=result["kept"]["total"],
        wiki=result["ppl_ratio"]["wiki"], acc_drop={t: 100 * (dense["acc"][t] - result["acc"][t]) for t in TASKS},
        decode=result["speed"]["decode_ratio"]))


def dense_with_accuracy(h: Harness, model: Any, tokenizer: Any, limit: int | None) -> dict[str, Any]:
    """The harness's dense row, with the zero-shot accuracy measured once and stored."""
    if "acc" not in h.dense():
        h.data["dense"]["acc"] = accuracy(model, tokenizer, limit)
        h.save()
    return h.dense()


def report_fields(report: Any, h: Harness) -> dict[str, Any]:
    """What a results row keeps of a CompressionReport (plans as layer lists) and of the run."""
    return {"recipe": report.recipe, "recipe_fingerprint": report.recipe_fingerprint,
            "plans": [{"method": s["method"], "layers": sorted(int(k) for k in s["plan"]["layers"])}
                      for s in report.steps],
            "calibration": report.calibration, "command": h.data["environment"]["command"],
            "compress_seconds": round(report.seconds, 1), "peak_rss_mb": round(report.peak_rss_mb)}


def accuracy(model: Any, tokenizer: Any, limit: int | None) -> dict[str, float]:
    """acc of the demo's zero-shot tasks (lm-eval's standard tasks: first `limit` items each, all if None)."""
    scores = evaluate_standard(model, tokenizer, list(TASKS), materialise(cache_root(), TASK_DIR), limit)["tasks"]
    return {t: r["acc"] for t, r in scores.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default="composed")
    ap.add_argument("--tokens", type=int, default=2048, help="evaluation tokens per source")
    ap.add_argument("--windows", type=int, default=16, help="calibration windows of 512 tokens")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", default="", help="comma-separated variant keys")
    ap.add_argument("--task-limit", type=int, default=None, help="zero-shot items per task (all if omitted)")
    args = ap.parse_args()
    todo = variants(args.windows)
    only = selected(args.only, todo)  # before the model loads
    h = Harness(args.name, tokens=args.tokens)
    dense_model, tokenizer = load_model(h.model_name)
    dense = dense_with_accuracy(h, dense_model, tokenizer, args.task_limit)
    for key in [k for k in todo if k in only]:
        recipe = recipe_from_dict(todo[key])
        model, tokenizer = load_model(h.model_name)
        report = compress(model, tokenizer, recipe)
        result = h.evaluate(model, tokenizer, key)
        speed = interleaved({"dense": dense_model, key: model}, [args.context], new_tokens=args.new_tokens,
                            repeats=args.repeats, progress=False)
        result.update({
            **report_fields(report, h),
            "ppl_ratio": {s: result["ppl"][s] / dense["ppl"][s] for s in h.sources},
            "kept": {g: result["params"][g] / dense["params"][g] for g in ("attention", "mlp", "total")},
            "kv_ratio": result["kv_bytes_per_token"] / dense["kv_bytes_per_token"],
            "speed": speed["models"][key][str(args.context)],
            "dense_speed": speed["models"]["dense"][str(args.context)],
            "acc": accuracy(model, tokenizer, args.task_limit),
        })
        result["targets_met"] = targets(result, dense)
        h.data["variants"][key] = result
        h.save()
        print(f"[done] {key}: wiki {result['ppl_ratio']['wiki']:.3f}x, KV {result['kv_ratio']:.3f}x, params "
              f"{result['kept']['total']:.3f}x, decode {result['speed']['decode_ratio']:.2f}x, acc {result['acc']}; "
              f"targets {result['targets_met']}", flush=True)


if __name__ == "__main__":
    main()

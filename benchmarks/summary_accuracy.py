"""Average accuracy on the standard zero-shot suite for every headline row of the BENCHMARKS Summary: the row's
variant, its baseline and the dense model, on one fixed subset of items.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/summary_accuracy.py --model smollm2-135m --limit 50
    .venv/bin/python benchmarks/make_report.py      # the Summary's "avg acc" column and its BENCHMARKS section

Which models: `make_report.HEADLINES` names, per Summary row, the result file, the headline variant and its
baseline. Each is compressed with the recipe its row RECORDED in that file (`variants[key]["recipe"]`), so the
scored model is the one whose perplexity the Summary shows, not today's packaged recipe. LISA's rows (lisa.py
records no recipe) are rebuilt the way lisa.py builds them: the recorded layers and method, and for `lisa` the
recorded distillation config. A key that two rows share (svdllm-attn-80 is the svd row's variant and the
latentllm row's baseline, with the same recipe fingerprint) is compressed and scored once. ATP's row is not
scored: its variant is a decode-time cache policy measured by `continuation_nll` on atp.py's own path, not a
compressed model that lm-eval's HFLM can call.

Scoring: `attnslim.eval.lmeval_run.evaluate_standard` (lm-eval's simple_evaluate, 0-shot, the same call as
`attnslim eval --tasks standard`) on the first --limit items of each task: the same items for the dense model and
every variant (lm-eval's --limit takes the first N documents of the split). Every accuracy has lm-eval's standard
error; the average is the mean of the tasks' `acc` with its standard error. The per-item correctness is kept
(`items`) so that a variant and its baseline can be compared item by item (the paired standard error of their
difference is much smaller than either standard error: the same items are easy or hard for both).

Results: benchmarks/results/summary_accuracy.json, one entry per model and limit, written after every model
(a run that stops resumes: a key already scored with the same recipe fingerprint is skipped). Each write re-reads
the file and merges its one row, so two runs of one model with disjoint `--keys` (one per core) keep each other's
rows; start the second once the first has scored dense, or both will score it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from typing import Any

import torch
from common import RESULTS, environment, selected
from lisa import recipe as lisa_recipe
from make_report import HEADLINES

from attnslim.api import compress
from attnslim.eval.lmeval_run import check_limit, evaluate_standard
from attnslim.eval.standard import SUITES, materialise
from attnslim.eval.tasks import TASK_DIR
from attnslim.models import load_model
from attnslim.models.zoo import cache_root
from attnslim.recipe import Recipe, fingerprint, recipe_from_dict
from attnslim.safe_files import write_text_atomic
from attnslim.train.distill import DistillConfig

PATH = RESULTS / "summary_accuracy.json"
DENSE = "dense"
SKIPPED = {"atp": "a decode-time cache policy (atp.py's serving form, scored by continuation_nll), not a compressed "
                  "model lm-eval's HFLM can call"}


def headline_keys(model: str) -> list[tuple[str, str]]:
    """[(result file stem, variant key)] of every scorable Summary row, variant then baseline, each key once.
    SmolLM2's rows are make_report.HEADLINES; for another model, the rows its own result files hold
    (`--keys FILE:KEY,...`)."""
    out: list[tuple[str, str]] = []
    for _method, name, key, base, _recipe in HEADLINES:
        if name in SKIPPED:
            continue
        for k in (key, base):
            if k not in {seen for _, seen in out}:
                out.append((name, k))
    return out


def recorded_recipe(name: str, key: str) -> Recipe:
    """The recipe the row's result file recorded for `key` (see the module docstring for LISA's rows)."""
    row = json.loads((RESULTS / f"{name}.json").read_text())["variants"][key]
    if isinstance(row.get("recipe"), dict):
        return recipe_from_dict(row["recipe"])
    if row.get("method") in ("lisa", "ds"):  # lisa.py's LisaBench.variant
        args = dict(row.get("args", {}))
        training = row.get("training", {})
        if training.get("trained"):
            args["train"] = asdict(DistillConfig.from_dict(training["config"]))
        return recipe_from_dict(lisa_recipe(key, row["method"], list(row["layers"]), args))
    raise SystemExit(f"{name}.json: {key} records neither a recipe nor lisa.py's method/layers; cannot rebuild it")


def score(model: Any, tokenizer: Any, names: list[str], limit: int, batch_size: int) -> dict[str, Any]:
    task_dir = materialise(cache_root(), TASK_DIR)
    started = time.perf_counter()
    result = evaluate_standard(model, tokenizer, names, task_dir, limit, batch_size, log_samples=True)
    items = {name: [int(s["acc"]) for s in sorted(result["samples"][name], key=lambda s: s["doc_id"])]
             for name in names}
    return {"tasks": result["tasks"], "average": result["average"], "lm_eval": result["lm_eval"],
            "items": items, "eval_seconds": round(time.perf_counter() - started, 1)}


def save_row(entry_key: str, header: dict[str, Any], key: str, row: dict[str, Any]) -> None:
    """Merge one scored model into the results file as it is now (another run may have written since)."""
    data: dict[str, Any] = json.loads(PATH.read_text()) if PATH.exists() else {}
    entry = data.setdefault(entry_key, {**header, "models": {}})  # a fresh copy: `header` stays empty
    entry["models"][key] = row
    entry["skipped"] = SKIPPED
    entry["environment"] = environment()
    write_text_atomic(PATH, json.dumps(data, indent=1) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tasks", default="standard")
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--keys", default="", help="FILE:KEY,... result-file rows to score (default: the Summary's "
                        "headline rows, which are SmolLM2's)")
    parser.add_argument("--only", default="", help="comma-separated keys of those (dense is always scored first)")
    args = parser.parse_args()
    names = list(SUITES.get(args.tasks, args.tasks.split(",")))
    check_limit(names, args.limit)  # bad tasks or limit fail before any model loads
    keys = ([(k.split(":", 1)[0], k.split(":", 1)[-1]) for k in args.keys.split(",") if k] if args.keys
            else headline_keys(args.model))
    only = selected(args.only, [key for _, key in keys])
    jobs: list[tuple[str, Recipe | None]] = [(DENSE, None)] + [
        (key, recorded_recipe(name, key)) for name, key in keys if key in only]
    data: dict[str, Any] = json.loads(PATH.read_text()) if PATH.exists() else {}
    entry_key = f"{args.model}@limit{args.limit}"
    header: dict[str, Any] = {"model": args.model, "limit": args.limit, "tasks": names, "models": {}}
    entry: dict[str, Any] = data.get(entry_key, header)
    if entry["tasks"] != names:
        raise SystemExit(f"{PATH} holds {entry_key} scored on {entry['tasks']}; use those tasks")
    for key, recipe in jobs:
        done = entry["models"].get(key)
        if done and done.get("recorded_fingerprint") == (fingerprint(recipe) if recipe else None):
            print(f"[skip] {key}: already scored", flush=True)
            continue
        model, tokenizer = load_model(args.model)
        row: dict[str, Any] = {"threads": torch.get_num_threads(), "command": environment()["command"]}
        if recipe is not None:
            report = compress(model, tokenizer, recipe, progress=False)
            row.update({"source": f"benchmarks/results/{dict((k, n) for n, k in keys)[key]}.json",
                        "recorded_fingerprint": fingerprint(recipe), "recipe": report.recipe,
                        "recipe_fingerprint": report.recipe_fingerprint, "peak_rss_mb": round(report.peak_rss_mb),
                        "compress_seconds": round(report.seconds, 1)})
        row.update(score(model, tokenizer, names, args.limit, args.batch_size))
        save_row(entry_key, header, key, row)
        avg = row["average"]
        print(f"[done] {key}: average acc {100 * avg['acc']:.1f} ± {100 * avg['acc_stderr']:.1f} "
              f"({row['eval_seconds']} s scoring)", flush=True)
    print(f"wrote {PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

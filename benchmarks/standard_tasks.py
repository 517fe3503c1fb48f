"""Dense scores on the standard zero-shot suite (lm-eval's own tasks, local data) beside a published lm-eval run.

    OMP_NUM_THREADS=1 python benchmarks/standard_tasks.py --model smollm2-135m --limit 200 [--tasks standard]

Scores each task with `attnslim.eval.lmeval_run.evaluate_standard` (lm-eval's simple_evaluate on the loaded model,
the same call as `attnslim eval --tasks`) on the first --limit items (the same items for every model), one task at a
time so that each task's seconds are recorded; writes benchmarks/results/standard_tasks.json (one entry per model
and limit). The reference numbers are NOT the model card's: the SmolLM2-135M-Instruct model card versions the
project's search tool holds have no evaluation section (Model Summary, Limitations, Training, License, Citation).
They are a third-party lm-eval 0-shot run of SmolLM2-135M-Instruct on lm-eval's splits (ARC: test), the
"Baseline" column of https://hface.pages.dev/lldois/SmolLM2-135M-Reasoning-SLERP-Champion. Our weights are the
same model quantized to Q4_1 upstream and dequantized to float32, and ARC is scored on its validation split here
(the test split does not ship), on the first --limit items: a sanity check for the scoring, not a target.
For qwen2.5-1.5b (`make qwen15`) the only published numbers are the Qwen2.5-Coder report's few-shot scores of the
base model on four tasks (PUBLISHED says which and why they compare only loosely):

    python benchmarks/standard_tasks.py --model qwen2.5-1.5b --tasks hellaswag,winogrande,arc_challenge --limit 50
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from common import RESULTS, environment
from published import PUBLISHED

from attnslim.eval.lmeval_run import average, evaluate_standard
from attnslim.eval.standard import SUITES, materialise
from attnslim.eval.tasks import TASK_DIR
from attnslim.models import load_model
from attnslim.models.zoo import cache_root


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tasks", default="standard")
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    names = list(SUITES.get(args.tasks, args.tasks.split(",")))
    task_dir = materialise(cache_root(), TASK_DIR)
    model, tokenizer = load_model(args.model)
    path = RESULTS / "standard_tasks.json"
    data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    key = f"{args.model}@limit{args.limit}"
    entry: dict[str, Any] = {"model": args.model, "limit": args.limit, "batch_size": args.batch_size,
                             "threads": 1, "tasks": {}, "environment": environment(),
                             "command": " ".join(["python benchmarks/standard_tasks.py", *sys.argv[1:]])}
    for name in names:
        started = time.perf_counter()
        result = evaluate_standard(model, tokenizer, [name], task_dir, args.limit, args.batch_size)
        entry["tasks"][name] = {**result["tasks"][name], "seconds": round(time.perf_counter() - started, 1)}
        entry["lm_eval"] = result["lm_eval"]
        print(f"{name}: {entry['tasks'][name]}", flush=True)
        entry["average"] = average(entry["tasks"])
        data[key] = entry
        path.write_text(json.dumps(data, indent=1) + "\n")
    if args.model in PUBLISHED:
        entry["published"] = PUBLISHED[args.model]
        path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

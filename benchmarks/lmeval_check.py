"""attnslim's zero-shot scorer against the real lm-eval CLI on the same model directories and tasks.

    python benchmarks/lmeval_check.py --models DENSE_DIR,COMPRESSED_DIR --limit 100 \
        --lm-eval /tmp/lmeval-venv/bin/lm_eval [--full-dense]

For each directory: `lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True,dtype=float32
--include_path TASK_DIR --tasks ... --limit N --batch_size B --log_samples` in a subprocess (an environment with
lm_eval and attnslim installed), then attnslim's `evaluate_tasks`-equivalent per-choice loglikelihoods in this
process; records acc / acc_norm of both, their differences and the largest per-choice loglikelihood difference.
--full-dense also records dense acc / acc_norm on every item with the seconds per task (one thread).
Writes benchmarks/results/lmeval_check.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import RESULTS, environment

from attnslim.eval.tasks import TASK_DIR, Request, encode_pair, load_items, loglikelihoods, score, task_names
from attnslim.models import load_model


def attnslim_lls(model: Any, tokenizer: Any, names: list[str], limit: int | None, batch_size: int) -> dict[str, Any]:
    """{task: (items, per-choice loglikelihoods)}, computed exactly as evaluate_tasks (all tasks pooled)."""
    items = {name: load_items(name, limit) for name in names}
    requests = [Request(*map(tuple, encode_pair(tokenizer, it["context"], " " + c)))
                for name in names for it in items[name] for c in it["choices"]]
    lls = loglikelihoods(model, requests, batch_size)
    out, pos = {}, 0
    for name in names:
        count = sum(len(it["choices"]) for it in items[name])
        out[name] = (items[name], lls[pos : pos + count])
        pos += count
    return out


def run_lm_eval(
    lm_eval: str, directory: str, names: list[str], limit: int, batch_size: int,
    model: tuple[str, str] | None = None,
) -> tuple[dict[str, Any], str]:
    """{task: (acc, acc_norm, per-choice loglikelihoods in item order)} from the lm_eval CLI; `model` is lm-eval's
    (--model, --model_args), by default its `hf` model on `directory`."""
    kind, model_args = model or ("hf", f"pretrained={directory},trust_remote_code=True,dtype=float32")
    with tempfile.TemporaryDirectory() as out:
        cmd = [lm_eval, "--model", kind, "--model_args", model_args,
               "--include_path", str(TASK_DIR), "--tasks", ",".join(names), "--limit", str(limit),
               "--batch_size", str(batch_size), "--device", "cpu", "--output_path", out, "--log_samples"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        subprocess.run(cmd, check=True, env=env, stdout=sys.stderr)
        (result_file,) = Path(out).rglob("results_*.json")
        results = json.loads(result_file.read_text())["results"]
        found = {}
        for name in names:
            (samples_file,) = Path(out).rglob(f"samples_{name}_*.jsonl")
            samples = sorted((json.loads(line) for line in samples_file.read_text().splitlines()),
                             key=lambda s: s["doc_id"])
            lls = [float(r[0]) for s in samples for r in s["filtered_resps"]]
            found[name] = (results[name]["acc,none"], results[name]["acc_norm,none"], lls)
        return found, " ".join(cmd)


def compare(directory: str, args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    started = time.perf_counter()
    reference, command = run_lm_eval(args.lm_eval, directory, names, args.limit, args.batch_size)
    lm_eval_s = time.perf_counter() - started
    model, tokenizer = load_model(directory)
    started = time.perf_counter()
    ours = attnslim_lls(model, tokenizer, names, args.limit, args.batch_size)
    attnslim_s = time.perf_counter() - started
    tasks = {}
    for name in names:
        items, lls = ours[name]
        mine = score(items, lls)
        acc, acc_norm, ref_lls = reference[name]
        tasks[name] = {
            "n": mine["n"], "attnslim": {"acc": mine["acc"], "acc_norm": mine["acc_norm"]},
            "lm_eval": {"acc": acc, "acc_norm": acc_norm},
            "abs_diff": {"acc": abs(acc - mine["acc"]), "acc_norm": abs(acc_norm - mine["acc_norm"])},
            "max_abs_loglikelihood_diff": max(abs(a - b) for a, b in zip(lls, ref_lls, strict=True)),
        }
        print(f"{directory} {name}: {tasks[name]}", flush=True)
    agree = all(t["abs_diff"]["acc"] <= 1e-6 and t["abs_diff"]["acc_norm"] <= 1e-6 for t in tasks.values())
    seconds = {"lm_eval_cli": round(lm_eval_s, 1), "attnslim": round(attnslim_s, 1)}
    return {"lm_eval_command": command, "limit": args.limit, "batch_size": args.batch_size, "tasks": tasks,
            "identical_to_1e-6": agree, "seconds": seconds}


def full_dense(model_name: str, names: list[str], batch_size: int) -> dict[str, Any]:
    model, tokenizer = load_model(model_name)
    out: dict[str, Any] = {}
    for name in names:
        started = time.perf_counter()
        ((items, lls),) = attnslim_lls(model, tokenizer, [name], None, batch_size).values()
        out[name] = {**score(items, lls), "chance": 0.25, "seconds": round(time.perf_counter() - started, 1)}
        print(f"dense {name}: {out[name]}", flush=True)
    out["seconds_all_tasks"] = round(sum(v["seconds"] for v in out.values()), 1)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="", help="comma-separated model directories to compare")
    parser.add_argument("--tasks", default=",".join(task_names()))
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lm-eval", default="lm_eval", help="lm_eval executable (with attnslim installed)")
    parser.add_argument("--full-dense", action="store_true", help="also dense smollm2-135m on every item")
    args = parser.parse_args()
    names = args.tasks.split(",")
    path = RESULTS / "lmeval_check.json"
    data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    data["environment"] = environment()
    data["task_dir_files"] = sorted(p.name for p in TASK_DIR.iterdir() if p.suffix in (".jsonl", ".yaml"))
    if args.full_dense:
        data["dense_full"] = {"model": "smollm2-135m", "tasks": full_dense("smollm2-135m", names, args.batch_size)}
        path.write_text(json.dumps(data, indent=1) + "\n")
    data.setdefault("comparisons", {})
    for directory in [d for d in args.models.split(",") if d]:
        data["comparisons"][directory] = compare(directory, args, names)
        path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

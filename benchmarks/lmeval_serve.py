"""lm-eval's own OpenAI client (`local-completions`) against `attnslim serve`: the packaged zero-shot tasks scored
through vLLM's server, beside attnslim's HF scorer on the same items (a second client nobody here wrote).

    make serve-setup lmeval-setup
    .venv/bin/python benchmarks/lmeval_serve.py [--variants dense,nbl-6] [--limit 100]

Per variant (attnslim.serving.variants, SmolLM2-135M): `attnslim serve DIR --dtype float32`, then
`.venv-lmeval/bin/lm_eval --model local-completions` on its /v1/completions (loglikelihoods from the prompt
log-probs vLLM returns with echo), then attnslim's evaluate_tasks-equivalent scorer on the same directory in this
process (HF). Records acc / acc_norm of both, their standard errors (binomial, from the HF side) and whether every
difference is within one standard error; writes benchmarks/results/lmeval_serve.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import RESULTS, environment
from lmeval_check import attnslim_lls, run_lm_eval

from attnslim.eval.tasks import score, task_names
from attnslim.models import load_model
from attnslim.serving.probe import free_port, wait_ready
from attnslim.serving.variants import build

LM_EVAL = Path(__file__).resolve().parents[1] / ".venv-lmeval" / "bin" / "lm_eval"


def served_scores(directory: str, names: list[str], limit: int, log: Path) -> tuple[dict[str, Any], str, float]:
    port = free_port()
    argv = [sys.executable, "-m", "attnslim", "serve", directory, "--port", str(port), "--dtype", "float32",
            "--max-model-len", "1024", "--kv-cache-gib", "1"]
    with log.open("w") as sink:
        env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}  # a keyless loopback server
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}/health", timeout=600)
        args = (f"model={directory},base_url=http://127.0.0.1:{port}/v1/completions,tokenizer_backend=huggingface,"
                f"tokenizer={directory},tokenized_requests=True,num_concurrent=1,max_retries=3")
        start = time.perf_counter()
        found, command = run_lm_eval(str(LM_EVAL), directory, names, limit, 1, ("local-completions", args))
        return found, command, time.perf_counter() - start
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default="dense,nbl-6")
    parser.add_argument("--tasks", default=",".join(task_names()))
    parser.add_argument("--limit", type=int, default=100)
    args = parser.parse_args()
    if not LM_EVAL.exists():
        sys.exit(f"{LM_EVAL} is missing: run `make lmeval-setup`")
    names = args.tasks.split(",")
    out: dict[str, Any] = {"environment": environment(), "limit": args.limit, "variants": {}}
    with tempfile.TemporaryDirectory(prefix="attnslim-lmeval-serve-") as tmp:
        for variant in args.variants.split(","):
            directory = str(build(variant, Path(tmp) / variant))
            served, command, seconds = served_scores(directory, names, args.limit, Path(tmp) / f"{variant}.log")
            model, tokenizer = load_model(directory)
            ours = attnslim_lls(model, tokenizer, names, args.limit, 16)
            tasks = {}
            for name in names:
                items, lls = ours[name]
                mine = score(items, lls)
                acc, acc_norm, served_lls = served[name]
                n = int(mine["n"])
                stderr = {k: math.sqrt(float(mine[k]) * (1 - float(mine[k])) / n) for k in ("acc", "acc_norm")}
                diff = {"acc": abs(acc - float(mine["acc"])), "acc_norm": abs(acc_norm - float(mine["acc_norm"]))}
                tasks[name] = {"n": n, "hf": {"acc": mine["acc"], "acc_norm": mine["acc_norm"]},
                               "served": {"acc": acc, "acc_norm": acc_norm}, "stderr_hf": stderr, "abs_diff": diff,
                               "within_stderr": all(diff[k] <= stderr[k] for k in diff),
                               "max_abs_loglikelihood_diff": max(abs(a - b) for a, b in
                                                                 zip(lls, served_lls, strict=True))}
                print(f"{variant} {name}: {tasks[name]}", flush=True)
            out["variants"][variant] = {"lm_eval_command": command, "lm_eval_seconds": round(seconds, 1),
                                        "tasks": tasks, "all_within_stderr": all(t["within_stderr"]
                                                                                 for t in tasks.values())}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "lmeval_serve.json").write_text(json.dumps(out, indent=1))
    print(f"wrote {RESULTS / 'lmeval_serve.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

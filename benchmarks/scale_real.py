"""The 1.5B model in one harness against dense (issue 44 item 3): perplexity on wiki / ptb / c4 and lm-eval's
standard zero-shot suite, compression time and peak RSS, for every row below.

    make qwen15                                          # the model, once (opt-in, 1.1 GB)
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/scale_real.py
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/scale_real.py --only mla-kv0.625,transmla-kv0.625
    .venv/bin/python benchmarks/make_report.py           # BENCHMARKS "Evidence at 1.5B"
    ATTNSLIM_BENCH_DEVICE=cuda python3 benchmarks/scale_real.py --limit 300 --batch-size 64 \
        --name scale-real-qwen2.5-1.5b-h200   # with the standard suite, on a GPU: benchmarks/gpu_scale_real.sh

Rows (ROWS, run in that order, each skipped when already measured with the same recipe):
- `mla` one-shot at KV 0.625 (256 + 64 per KV head pair: the width stock vLLM serves), 0.5 and 0.25, each beside
  `transmla` at the same KV. `mla` is recipes/mla.yaml's conversion without its heal and without the output refit:
  the refit's token rule asks 73 windows of 512 at hidden size 1536 (methods/output_fits.py), nine times this
  harness's calibration, so every row here shares one smaller calibration (`--windows`, default 8).
- `nbl` and `drop` of 6 and 12 layers (recipes/nbl.yaml's and recipes/drop.yaml's criterion: similarity), and
  `latentllm` at 80% of the attention parameters (recipes/latentllm.yaml) beside its baseline at the same size,
  SVD-LLM on q/k/v/o (recipes/svdllm.yaml).
- `--heal`: `mla-kv0.5-heal40`, the KV 0.5 row followed by the standard heal (recipes/default.yaml's heal);
  opt-in because on 2 CPU cores one step of a 1.5B model takes minutes.

Evaluation: the same first `--tokens` tokens of each source for every row (benchmarks/common.py's Harness), and
the same first `--limit` items of each standard task (lm-eval's --limit), never a different subset per row. The
default `--limit 0` skips the suite: on 2 CPU cores the 1.5B model scores tens of tokens a second, so the suite is
run on a GPU (`ATTNSLIM_BENCH_DEVICE=cuda`, common.py), into its own results file (`--name`), whose rows also
check the GPU's compression against the CPU's perplexity rows.

Each row runs in its own process (this script with `--row KEY`), so that its peak RSS is its own: the kernel's
high-water mark of a process that compressed three models is the largest of the three, not each one's.
Results: benchmarks/results/scale-real-qwen2.5-1.5b.json, saved after every row.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Any

from common import Harness, calibration
from summary_accuracy import score

from attnslim.eval.lmeval_run import check_limit
from attnslim.eval.standard import SUITES
from attnslim.recipe import load_recipe

MODEL = "qwen2.5-1.5b"
KV_POINTS = (0.625, 0.5, 0.25)


def packaged(name: str) -> tuple[str, dict[str, Any]]:
    """(method, args) of the packaged recipe's only step: the rows follow the recipes users run."""
    step = load_recipe(name).steps[0]
    return step.method, dict(step.args)


def rows(windows: int) -> dict[str, dict[str, Any]]:
    """{row key: recipe dict}: the variants of the module docstring, all on one calibration."""
    cal = calibration(windows=windows)

    def recipe(key: str, step: tuple[str, dict[str, Any]], heal: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"name": key, "calibration": cal, "steps": [{"method": step[0], "layers": "all", "args": step[1]}],
                **({"heal": heal} if heal else {})}

    mla, nbl, drop = packaged("mla"), packaged("nbl"), packaged("drop")
    out: dict[str, dict[str, Any]] = {}
    for kv in KV_POINTS:
        out[f"mla-kv{kv}"] = recipe(f"mla-kv{kv}", ("mla", {**mla[1], "kv_ratio": kv}))
        out[f"transmla-kv{kv}"] = recipe(f"transmla-kv{kv}", ("transmla", {"kv_ratio": kv}))
    for m in (6, 12):
        out[f"nbl-{m}"] = recipe(f"nbl-{m}", ("nbl", {**nbl[1], "m": m}))
        out[f"drop-{m}"] = recipe(f"drop-{m}", ("drop", {**drop[1], "count": m}))
    out["latentllm-attn-80"] = recipe("latentllm-attn-80", packaged("latentllm"))
    out["svdllm-attn-80"] = recipe("svdllm-attn-80", packaged("svdllm"))
    out["mla-kv0.5-heal40"] = recipe("mla-kv0.5-heal40", ("mla", {**mla[1], "kv_ratio": 0.5}),
                                     load_recipe("default").heal)
    return out


class ScaleHarness(Harness):
    """Harness whose evaluation adds the standard suite on the first `limit` items of each task."""

    def __init__(self, name: str, model: str, tokens: int, limit: int, tasks: list[str], batch_size: int = 8
                 ) -> None:
        super().__init__(name, model=model, tokens=tokens)
        self.limit, self.tasks, self.batch_size = limit, tasks, batch_size
        stored = self.data.get("suite", {})
        if stored and stored != {"standard_tasks": tasks, "standard_limit": limit}:
            raise SystemExit(f"{self.path} holds rows scored on {stored}: use that --limit, or another --name")
        self.data["suite"] = {"standard_tasks": tasks, "standard_limit": limit}

    def evaluate(self, model: Any, tokenizer: Any, label: str) -> dict[str, Any]:
        result = super().evaluate(model, tokenizer, label)
        if self.limit:
            suite = score(model, tokenizer, self.tasks, self.limit, batch_size=self.batch_size)
            result["standard"] = suite
            avg = suite["average"]
            print(f"[suite] {label}: average acc {100 * avg['acc']:.1f} ± {100 * avg['acc_stderr']:.1f} "
                  f"({suite['eval_seconds']} s)", flush=True)
        return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--tokens", type=int, default=2048, help="evaluation tokens per source")
    parser.add_argument("--limit", type=int, default=0, help="first items of each standard task (default 0: no "
                        "suite; on 2 CPU cores it takes hours per row, see the module docstring)")
    parser.add_argument("--batch-size", type=int, default=8, help="lm-eval's batch size for the suite")
    parser.add_argument("--windows", type=int, default=8, help="calibration windows of 512 tokens, every row")
    parser.add_argument("--only", default="", help="comma-separated row keys (default: every row but the heal's)")
    parser.add_argument("--heal", action="store_true", help="also the healed KV 0.5 row")
    parser.add_argument("--name", default="", help="results file stem (default scale-real-MODEL)")
    parser.add_argument("--row", default="", help=argparse.SUPPRESS)  # one row, in this process (the parent's call)
    args = parser.parse_args()
    tasks = list(SUITES["standard"])
    if args.limit:
        check_limit(tasks, args.limit)  # bad input fails before any model loads
    table = rows(args.windows)
    wanted = [k for k in args.only.split(",") if k] or [k for k in table if args.heal or "heal" not in k]
    unknown = sorted(set(wanted) - set(table))
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; known: {', '.join(table)}")
    name = args.name or f"scale-real-{args.model}"
    if args.row:  # the child: one row (or the dense reference) in this process
        h = ScaleHarness(name, args.model, args.tokens, args.limit, tasks, args.batch_size)
        if args.row == "dense":
            h.dense()
        else:
            h.run(args.row, table[args.row])
        return 0
    passed = [f"--{k}={v}" for k, v in (("model", args.model), ("tokens", args.tokens), ("limit", args.limit),
                                         ("windows", args.windows), ("name", name),
                                         ("batch-size", args.batch_size))]
    for key in ["dense", *wanted]:
        code = subprocess.call([sys.executable, __file__, *passed, f"--row={key}"])
        if code:
            print(f"[fail] {key}: exit status {code}", flush=True)
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())

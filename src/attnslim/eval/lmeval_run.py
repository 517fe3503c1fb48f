"""Score a loaded model on the standard tasks with lm-eval itself (`simple_evaluate` on its HFLM wrapper).

attnslim does not re-implement the standard tasks' scoring: the model object attnslim loaded (dense, compressed or
offloaded) is handed to lm-eval's `HFLM`, and the task folder of `standard.materialise` supplies lm-eval's own
task definitions with local data. So `attnslim eval --tasks arc_easy` and
`lm_eval --model hf --include_path $(attnslim tasks --path) --tasks arc_easy` run the same code on the same rows
(tests/test_standard_tasks.py compares them). Every accuracy is reported with lm-eval's standard error and the
number of items scored; the suite average is the plain mean of the tasks' `acc`, with the standard error of that
mean (tasks independent: sqrt(sum se^2) / k).
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from attnslim.errors import AttnslimError
from attnslim.eval.causal import require_causal
from attnslim.eval.standard import LAMBADA, MMLU, TASKS, data_dir, task_size

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
OVERRIDE_NOTICE = "overrides existing task"  # lm-eval's warning, once per task, that an included task replaces its own


class _NoOverrideNotices(logging.Filter):
    """Drops lm-eval's per-task "overrides existing task" warnings: overriding lm-eval's data location is what the
    task folder is for (same names, only the data changed), and 70 such lines bury the scores."""

    def filter(self, record: logging.LogRecord) -> bool:
        return OVERRIDE_NOTICE not in str(record.msg)


@contextmanager
def offline() -> Iterator[None]:
    """HF_DATASETS_OFFLINE / HF_HUB_OFFLINE set for the call, restored after: the tasks read local files and the
    model is an object, so nothing should reach the hub; if something in lm-eval or datasets tried, it fails fast
    instead of waiting on a network that is not there. lm-eval's notices that our tasks override its own are dropped
    for the call (they are the point of the task folder)."""
    saved = {k: os.environ.get(k) for k in OFFLINE}
    os.environ.update(OFFLINE)
    index_log, quiet = logging.getLogger("lm_eval.tasks._index"), _NoOverrideNotices()
    index_log.addFilter(quiet)
    try:
        yield
    finally:
        index_log.removeFilter(quiet)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def check_limit(names: list[str], limit: int | None) -> dict[str, int]:
    """{task: items that will be scored}. --limit takes the first N items of each task, as lm-eval's --limit does
    (for MMLU: of each of its 57 subjects, lm-eval's rule). A limit above a task's size is clamped to it and said
    so on stderr (a suite mixes sizes from 299 to 10,042 items, so an error would forbid one limit for all)."""
    if limit is not None and limit < 1:
        raise AttnslimError(f"--limit must be >= 1 (or left out for every item), got {limit}")
    data = data_dir()
    counts = {}
    for name in names:
        size = task_size(name, data)
        counts[name] = size if limit is None or name == MMLU else min(limit, size)
        if limit is not None and limit > size and name != MMLU:
            print(f"{name}: --limit {limit} is more than its {size} items ({TASKS[name].split} split): all {size} "
                  "are scored", file=sys.stderr, flush=True)
    return counts


def _task_row(name: str, results: dict[str, Any], n: int) -> dict[str, Any]:
    res = results[name]
    row: dict[str, Any] = {"n": n, "split": TASKS[name].split, "lm_eval_split": TASKS[name].lm_eval_split}
    for metric in ("acc", "acc_norm", "perplexity"):
        if f"{metric},none" in res:
            row[metric] = float(res[f"{metric},none"])
            stderr = res.get(f"{metric}_stderr,none")
            if metric != "perplexity" and isinstance(stderr, float):
                row[f"{metric}_stderr"] = stderr
    return row


def average(rows: dict[str, dict[str, Any]]) -> dict[str, float | int]:
    """Mean `acc` over tasks and its standard error (tasks independent)."""
    accs = [r["acc"] for r in rows.values()]
    ses = [r.get("acc_stderr", math.nan) for r in rows.values()]
    k = len(accs)
    return {"acc": sum(accs) / k, "acc_stderr": math.sqrt(sum(s * s for s in ses)) / k, "tasks": k}


def evaluate_standard(
    model: Any, tokenizer: Any, names: list[str], task_dir: Path, limit: int | None = None, batch_size: int = 16,
    log_samples: bool = False, counts: dict[str, int] | None = None,
) -> dict[str, Any]:
    """{"tasks": {task: {"acc", "acc_stderr", ["acc_norm", "acc_norm_stderr"], ["perplexity"], "n", "split"}},
    "average": ..., ["samples": lm-eval's per-item records]} from lm-eval 0-shot on `model` (any attnslim model
    object). `task_dir` is `standard.materialise`'s folder; `counts` is `check_limit`'s answer when the caller
    checked the limit already (before loading the model)."""
    require_causal(model, "zero-shot tasks")  # the continuation is inside the input
    counts = counts if counts is not None else check_limit(names, limit)
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
    except ImportError as err:
        raise AttnslimError(f"the standard tasks run through lm-eval, which is not importable ({err}); install it "
                            "with: make setup (or: pip install lm_eval==0.4.13)") from None
    with offline():
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        # lm-eval's defaults otherwise (0-shot for every task here, its seeds), as a plain `lm_eval` run has them
        out = lm_eval.simple_evaluate(model=lm, tasks=list(names), limit=limit, log_samples=log_samples,
                                      task_manager=task_manager(task_dir, names))
    if out is None:
        raise AttnslimError("lm-eval returned no results (a non-zero rank of a distributed run?)")
    rows = {name: _task_row(name, out["results"], _scored(out, name)) for name in names}
    for name, row in rows.items():  # lm-eval's own count of the items it scored, checked against ours
        if name != MMLU and row["n"] != counts[name]:
            raise AttnslimError(f"{name}: lm-eval scored {row['n']} items, attnslim expected {counts[name]}; the "
                                "task folder and the data disagree: rewrite it with `attnslim tasks --path`")
    result: dict[str, Any] = {"tasks": rows, "average": average(rows), "limit": limit,
                              "lm_eval": out.get("lm_eval_version") or lm_eval.__version__}
    if log_samples:
        result["samples"] = out["samples"]
    return result


def task_manager(task_dir: Path, names: list[str]) -> Any:
    """lm-eval's TaskManager over the task folder. Its default index (lm-eval's ~15k task YAMLs, parsed at every
    construction: seconds, most of a short evaluation) is read only for MMLU, whose group is lm-eval's own
    _mmlu.yaml found by name; every other task file includes lm-eval's definition by absolute path, and loads the
    same config without the index (tests/test_standard_tasks.py)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(task_dir), include_defaults=MMLU in names)


def _scored(out: dict[str, Any], name: str) -> int:
    """Items lm-eval scored for a task (for the MMLU group: the sum over its subjects)."""
    samples = out["n-samples"]
    if name == MMLU:
        return sum(int(v["effective"]) for k, v in samples.items() if k.startswith("mmlu_"))
    return int(samples[name]["effective"])


def format_rows(result: dict[str, Any]) -> list[str]:
    """One line per task: acc ± se (and acc_norm ± se, LAMBADA's perplexity), n and split; then the average."""
    lines = []
    for name, r in result["tasks"].items():
        text = f"{name:<15} acc {r['acc']:.4f} ± {r.get('acc_stderr', math.nan):.4f}"
        if "acc_norm" in r:
            text += f"  acc_norm {r['acc_norm']:.4f} ± {r.get('acc_norm_stderr', math.nan):.4f}"
        if name == LAMBADA and "perplexity" in r:
            text += f"  ppl {r['perplexity']:.2f}"
        lines.append(f"{text}  (n={r['n']}, {r['split']})")
    avg = result["average"]
    lines.append(f"{'average':<15} acc {avg['acc']:.4f} ± {avg['acc_stderr']:.4f}  ({avg['tasks']} tasks)")
    return lines

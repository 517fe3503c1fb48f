"""BENCHMARKS.md's section for the standard zero-shot suite (benchmarks/standard_tasks.py), for make_report.py."""

from __future__ import annotations

from typing import Any


def _cell(task: dict[str, Any], key: str) -> str:
    value = task.get(key)
    return "–" if value is None else f"{100 * value:.1f} ± {100 * task[key + '_stderr']:.1f}"


def standard_section(data: dict[str, dict[str, Any]]) -> list[str]:
    """One table per model and item limit: acc and acc_norm with their standard errors, n, the split scored, and
    the published reference where one exists."""
    out = ["## Standard zero-shot suite (lm-eval's own tasks on the packaged data), dense models", "",
           "lm-eval 0.4.13's task definitions with only the data location changed (`attnslim eval --tasks "
           "standard`, or `lm_eval --include_path $(attnslim tasks --path)`), 0-shot, on the first n items of each "
           "task, the same items for every model. ARC, OpenBookQA and SciQ are scored on their validation split "
           "(the packaged data has no test split); BoolQ reads the google/boolq rows (the same questions as "
           "SuperGLUE's). Accuracy in percent ± its standard error.", ""]
    for run in data.values():
        published = run.get("published", {})
        out += [f"Model `{run['model']}`, first {run['limit']} items per task. Command: "
                f"`OMP_NUM_THREADS={run['threads']} .venv/bin/{run['command'].removeprefix('.venv/bin/')}` → "
                "`benchmarks/results/standard_tasks.json`.", "",
                "| task | split (lm-eval's) | n | acc | acc_norm | published |", "|---|---|---|---|---|---|"]
        for name, task in run["tasks"].items():
            ref = published.get(name, {})
            ref_cell = ", ".join(f"{k} {v:.1f}" for k, v in ref.items()) or "–"  # "acc?": metric not stated
            out.append(f"| {name} | {task['split']} ({task['lm_eval_split']}) | {task['n']} | {_cell(task, 'acc')} | "
                       f"{_cell(task, 'acc_norm')} | {ref_cell} |")
        avg = run["average"]
        out.append(f"| **average** ({avg['tasks']} tasks) | | | **{100 * avg['acc']:.1f} ± "
                   f"{100 * avg['acc_stderr']:.1f}** | | |")
        if published.get("source"):
            note = published.get("note", "lm-eval's full splits, so a sanity check of the scoring within the "
                                 "standard errors, not a target (our weights are dequantized Q4)")
            out += ["", f"Published column: {published['source']}; {note}."]
        out.append("")
    return out

"""The Summary's average-accuracy column and BENCHMARKS.md's section for benchmarks/summary_accuracy.py (the
standard zero-shot suite on every headline variant, its baseline and dense), for make_report.py."""

from __future__ import annotations

import math
from typing import Any

SCRIPT = "benchmarks/summary_accuracy.py"
SUMMARY_MODEL = "smollm2-135m"  # the model of the Summary's rows (make_report.HEADLINES)
TITLE = "Standard zero-shot suite on the Summary's headline rows"
# accuracy of a uniform random choice among each task's answers (LAMBADA: one exact word from the vocabulary)
CHANCE = {"arc_easy": 0.25, "arc_challenge": 0.25, "piqa": 0.5, "hellaswag": 0.25, "winogrande": 0.5, "boolq": 0.5,
          "lambada_openai": 0.0, "openbookqa": 0.25}
# why a run scored fewer items than the script's default (100 per task)
RUN_NOTES = {"smollm2-135m@limit50": "50 items per task, not the script's default 100: on the shared 2-core machine "
             "(one thread) one model's scoring took about 5 minutes and the two healed rows about 15 and 8 minutes "
             "of compression, and all ten models had to fit one session. `--limit 100` halves the variance.",
             "gemma3-270m@limit50": "The same rows' kinds on Gemma-3 270M, each compressed with the recipe its Gemma-3 "
             "result file recorded (`--keys`: latentllm-gemma3, nbl-gemma3, plan-gemma3-270m, lisa-gemma3, "
             "mla-gemma3); 50 items per task as for SmolLM2, so that the rows fit one session on the shared 2-core "
             "machine (three runs with disjoint `--keys`, one thread each, two at a time; dense scored in about 7 "
             "minutes)."}


def chance_average(tasks: list[str]) -> float | None:
    """Percent a uniform random choice averages over `tasks`; None if one of them has no entry in CHANCE."""
    if not tasks or not all(t in CHANCE for t in tasks):
        return None
    return 100 * sum(CHANCE[t] for t in tasks) / len(tasks)


def summary_entry(data: dict[str, dict[str, Any]], model: str) -> dict[str, Any] | None:
    """The run of `model` with the most items per task that scored the dense model (the Summary's reference);
    None when there is none. Runs at different limits are never mixed: every cell of a column reads one run."""
    runs = [e for e in data.values() if e["model"] == model and "dense" in e["models"]]
    return max(runs, key=lambda e: e["limit"]) if runs else None


def _pct(avg: dict[str, Any]) -> str:
    return f"{100 * avg['acc']:.1f} ± {100 * avg['acc_stderr']:.1f}"


def dense_header(entry: dict[str, Any] | None) -> str:
    """The column's header: the dense reference of the run it reads."""
    if entry is None:
        return "avg acc % (dense: not scored)"
    return f"avg acc % (dense {_pct(entry['models']['dense']['average'])}, n={entry['limit']}/task)"


def accuracy_cell(entry: dict[str, Any] | None, key: str, base: str) -> str:
    """"variant ± se (base ± se)" for a row whose variant AND baseline were scored in the run, else "–"."""
    models = entry["models"] if entry else {}
    if key not in models or base not in models:
        return "–"
    return f"{_pct(models[key]['average'])} (base {_pct(models[base]['average'])})"


def paired_difference(a: dict[str, list[int]], b: dict[str, list[int]]) -> tuple[float, float]:
    """Mean over tasks of (acc of a - acc of b) on the same items, and its paired standard error (per task: sample
    sd of the per-item differences / sqrt(n); tasks independent: sqrt(sum se^2) / k). Both in accuracy units."""
    diffs, variances = [], []
    for task, xs in a.items():
        d = [x - y for x, y in zip(xs, b[task], strict=True)]  # same items in the same order: one run's subset
        n = len(d)
        mean = sum(d) / n
        diffs.append(mean)
        variances.append(sum((v - mean) ** 2 for v in d) / (n - 1) / n if n > 1 else math.nan)
    k = len(diffs)
    return sum(diffs) / k, math.sqrt(sum(variances)) / k


def _delta(models: dict[str, Any], key: str, ref: str) -> str:
    diff, se = paired_difference(models[key]["items"], models[ref]["items"])
    return f"{round(100 * diff, 1) + 0.0:+.1f} ± {100 * se:.1f}"  # + 0.0: no "-0.0" for a rounding-size difference


Row = tuple[str, str, str, str, str]  # make_report.HEADLINES: method, result file, variant, baseline, recipe


def missing_rows(entry: dict[str, Any] | None, rows: tuple[Row, ...]) -> str:
    """Why Summary rows have no average accuracy in `entry` (the run the column reads), "" when all have one."""
    models = entry["models"] if entry else {}
    skipped = entry.get("skipped", {}) if entry else {}
    absent = [(method, name) for method, name, key, base, _ in rows if key not in models or base not in models]
    parts = [f"{method}: not scored, {skipped[name]}" for method, name in absent if name in skipped]
    pending = [method for method, name in absent if name not in skipped]
    if pending:
        limit = f" --limit {entry['limit']}" if entry else ""
        parts.append(f"{', '.join(pending)}: not scored yet (`{SCRIPT}{limit}` scores them)")
    return "; ".join(parts)


def accuracy_section(data: dict[str, dict[str, Any]], rows: tuple[Row, ...]) -> list[str]:
    """One table per run: each model's accuracy per task and average (± standard error), its difference from
    dense and from its row's baseline on the same items (± paired standard error), and compression seconds.
    `rows` is make_report.HEADLINES."""
    out = [f"## {TITLE}", "",
           "The Summary's `avg acc` column: lm-eval 0.4.13's own tasks on the packaged data (the suite of the "
           "section above), 0-shot, on the first n items of each task, the same items for the dense model and "
           "every variant. Each variant and baseline is compressed with the recipe its Summary row recorded in its "
           "result file (the scored model is the one whose perplexity the Summary shows). Accuracy in percent ± "
           "its standard error; Δ columns are differences in points on the same items ± the paired standard error "
           "(the same items are easy or hard for both models, so it is much smaller than either standard error).",
           ""]
    role: dict[str, list[str]] = {"dense": ["reference"]}  # a key can be one row's variant, another's baseline
    for method, _, key, base, _ in rows:
        role.setdefault(key, []).append(f"{method} variant")
        role.setdefault(base, []).append(f"{method} baseline")
    base_of = {key: base for _, _, key, base, _ in rows}
    for entry in sorted(data.values(), key=lambda e: (e["model"], -e["limit"])):
        models, tasks = entry["models"], entry["tasks"]
        if "dense" not in models:
            continue
        command = next(iter(models.values()))["command"]
        chance = chance_average(tasks)
        scale = (f"For scale: random choice averages {chance:.1f} on these tasks (ARC's few 3- and 5-choice items "
                 "aside), so a model's distance from chance, not only from dense, says how much a small model's "
                 "average can fall. " if chance is not None else "")
        out += [f"Model `{entry['model']}`, first {entry['limit']} items per task. {scale}Command: "
                f"`OMP_NUM_THREADS={models['dense']['threads']} .venv/bin/python {command}` → "
                "`benchmarks/results/summary_accuracy.json` (each model's own command is in the JSON). "
                + RUN_NOTES.get(f"{entry['model']}@limit{entry['limit']}", ""), "",
                "| model | Summary row | " + " | ".join(tasks) + " | **average** | Δ dense | Δ its baseline | "
                "compress s |", "|---|---|" + "---|" * (len(tasks) + 4)]
        for key, row in models.items():
            cells = " | ".join(f"{100 * row['tasks'][t]['acc']:.0f} ± {100 * row['tasks'][t]['acc_stderr']:.0f}"
                               for t in tasks)
            vs_dense = "–" if key == "dense" else _delta(models, key, "dense")
            base = base_of.get(key, "")
            vs_base = _delta(models, key, base) if base in models else "–"
            out.append(f"| {key} | {'; '.join(role.get(key, []))} | {cells} | **{_pct(row['average'])}** | "
                       f"{vs_dense} | {vs_base} | {row.get('compress_seconds', '–')} |")
        missing = missing_rows(entry, rows) if entry["model"] == SUMMARY_MODEL else ""
        if missing:
            out += ["", f"Summary rows without an average accuracy in this run: {missing}."]
        out.append("")
    return out

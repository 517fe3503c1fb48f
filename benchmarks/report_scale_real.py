"""BENCHMARKS.md's section for the 1.5B harness (benchmarks/scale_real.py), for make_report.py: perplexity ratios,
the standard suite's average with paired differences, compression time and peak RSS per row, then the issue's
verdicts (mla against transmla at each KV point; the KV 0.625 targets) read from the same rows. A run on a GPU
(benchmarks/gpu_scale_real.sh, its own results file) gets its own section: the standard suite is scored there, and its
dense scores are set beside the published ones (published.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from published import PUBLISHED
from report_accuracy import paired_difference

TITLE = "Evidence at 1.5B: Qwen2.5-Coder-1.5B-Instruct against dense, perplexity and the standard suite"
GPU_TITLE = "Evidence at 1.5B on a GPU: the standard suite"
CPU_STEM, GPU_STEM = "scale-real-qwen2.5-1.5b", "scale-real-qwen2.5-1.5b-h200"
# row prefix -> its baseline's prefix (the same suffix: KV point, layer count or size)
RIVALS = {"mla-kv": "transmla-kv", "nbl-": "drop-", "latentllm-attn-": "svdllm-attn-"}


def _avg(row: dict[str, Any]) -> str:
    avg = row.get("standard", {}).get("average")
    return f"{100 * avg['acc']:.1f} ± {100 * avg['acc_stderr']:.1f}" if avg else "–"


def _diff(row: dict[str, Any], ref: dict[str, Any]) -> str:
    if "standard" not in row or "standard" not in ref:
        return "–"
    diff, se = paired_difference(row["standard"]["items"], ref["standard"]["items"])
    return f"{round(100 * diff, 1) + 0.0:+.1f} ± {100 * se:.1f}"


def _verdicts(dense: dict[str, Any], rows: dict[str, dict[str, Any]], sources: list[str]) -> list[str]:
    out = []
    for key, row in rows.items():  # each method against its baseline row (RIVALS)
        rival = next((r + key[len(m):] for m, r in RIVALS.items() if key.startswith(m)), "")
        base = rows.get(rival)
        if base is None or "heal" in key:
            continue
        ppl = [s for s in sources if row["ppl"][s] < base["ppl"][s]]
        acc = ""
        if "standard" in row and "standard" in base:
            diff, se = paired_difference(row["standard"]["items"], base["standard"]["items"])
            acc = f"; average accuracy {100 * diff:+.1f} ± {100 * se:.1f} points against it (paired)"
        out.append(f"- {key} beats {rival} on {len(ppl)} of {len(sources)} sources"
                   f"{' (' + ', '.join(ppl) + ')' if ppl else ''}{acc}.")
    for key, row in rows.items():  # each healed row against its own one-shot conversion
        shot = rows.get(key.split("-heal")[0]) if "-heal" in key else None
        if shot is None:
            continue
        moved = ", ".join(f"{s} {shot['ppl_ratio'][s]:.3f}× → {row['ppl_ratio'][s]:.3f}×" for s in sources)
        acc = (f"; average accuracy {_diff(row, shot)} points against the one-shot row (paired)"
               if "standard" in row and "standard" in shot else "")
        out.append(f"- {key} against {key.split('-heal')[0]} (the heal alone): {moved}{acc}.")
    target = rows.get("mla-kv0.625")
    if target is not None:
        wiki = target["ppl_ratio"]["wiki"]
        verdict = "met" if wiki <= 1.10 else "missed"
        acc = (f"average accuracy {_diff(target, dense)} points against dense (target within 2)" if "standard" in target
               else "accuracy not scored in this run (target: within 2 points of dense)")
        out.append(f"- mla at KV 0.625 one-shot: wiki {wiki:.3f}× (target ≤ 1.10×: {verdict}); {acc}.")
    return out


def _published(model: str, dense: dict[str, Any]) -> list[str]:
    """Our dense scores beside the published ones (issue 44 item 5); a metric written "acc?" is one the source does
    not name, so both of ours are shown."""
    ref, tasks = PUBLISHED.get(model), dense.get("standard", {}).get("tasks", {})
    if ref is None or not tasks:
        return []
    cells = []
    for task, metrics in ref.items():
        if task not in tasks:
            continue
        for metric, value in metrics.items():
            ours = [m for m in ((metric.rstrip("?"),) if not metric.endswith("?") else ("acc", "acc_norm"))
                    if m in tasks[task]]
            mine = " / ".join(f"{m} {100 * tasks[task][m]:.1f}" for m in ours)
            label = "metric not stated" if metric.endswith("?") else metric
            cells.append(f"{task}: published {value} ({label}), ours {mine}")
    note = f" {ref['note'][0].upper()}{ref['note'][1:]}." if "note" in ref else ""
    return [f"Dense against published ({ref['source']}): " + "; ".join(cells) + f".{note}", ""]


def cpu_rows() -> dict[str, Any]:
    """The CPU run's rows (its results file), which a GPU run's rows are set against."""
    path = Path(__file__).parent / "results" / f"{CPU_STEM}.json"
    return dict(json.loads(path.read_text())["variants"]) if path.exists() else {}


def scale_real_section(data: dict[str, Any], stem: str = CPU_STEM, cpu: dict[str, Any] | None = None
                       ) -> list[str]:
    """The section of one results file; `cpu`: the CPU run's rows, for a GPU run (whose rows are a subset)."""
    env, ev, suite = data["environment"], data["eval"], data.get("suite", {})
    sources, dense, rows = ev["sources"], data["dense"], data["variants"]
    first: dict[str, Any] = next(iter(rows.values()), {})
    cal = first.get("calibration", {})
    limit = suite.get("standard_limit")
    command = " ".join(a for a in env["command"].split() if not a.startswith("--row="))  # the parent's call
    gpu = env["device"] == "cuda"
    seconds = sorted(r["standard"]["eval_seconds"] for r in [dense, *rows.values()]
                     if "eval_seconds" in r.get("standard", {}))
    how = (f"`benchmarks/gpu_scale_real.sh rows KEY...` (the model's parts carried to the GPU machine, see its "
           f"header), i.e. `ATTNSLIM_BENCH_DEVICE=cuda python3 {command}` per row" if gpu else
           f"`OMP_NUM_THREADS={env['threads']} .venv/bin/python {command}` (each row in its own process; "
           "`--row=KEY` re-runs one)")
    out = [f"## {GPU_TITLE if gpu else TITLE}", "",
           f"Command: {how} → `benchmarks/results/{stem}.json`. "
           f"Model `{data['model']}` (`make qwen15`: the dequantized Q4_K_M weights, float32), in memory. Evaluation: "
           f"the same first {ev['tokens']} tokens of each of {', '.join(sources)} for every row"
           + (f", and the first {limit} items of each of lm-eval's {len(suite['standard_tasks'])} standard tasks "
              f"(0-shot; a fixed subset, the same for every row; {seconds[0]}–{seconds[-1]} s per row for the suite "
              "here)" if limit and seconds else f", and the first {limit} items of each standard task" if limit
              else f"; no standard suite in this run (`--limit 0`; the section \"{GPU_TITLE}\" scores it)")
           + f". Calibration for every row: {cal.get('description', '?')} ({cal.get('tokens', '?')} tokens; mla "
           "without the output refit, whose token rule asks 73 windows at this width). "
           f"Device {env.get('gpu', env['device'])}, {env.get('cpu', '?')}, {env['threads']} threads; torch "
           f"{env['torch']}, "
           f"transformers {env['transformers']}. Peak RSS: the row's process up to the end of compression.", "",
           "| variant | " + " | ".join(f"{s} ppl (×dense)" for s in sources)
           + " | KV ×dense | avg acc % | Δ vs dense (paired) | compress s | peak RSS GB |",
           "|---|" + "---|" * (len(sources) + 5)]
    kv0 = dense["kv_bytes_per_token"]
    out.append("| dense | " + " | ".join(f"{dense['ppl'][s]:.3f}" for s in sources)
               + f" | 1.00 | {_avg(dense)} | – | – | – |")
    for key, row in rows.items():
        cells = " | ".join(f"{row['ppl'][s]:.3f} ({row['ppl_ratio'][s]:.3f}×)" for s in sources)
        out.append(f"| {key} | {cells} | {row['kv_bytes_per_token'] / kv0:.3f} | {_avg(row)} | {_diff(row, dense)} "
                   f"| {row.get('compress_seconds', '–')} | {row.get('peak_rss_mb', 0) / 1e3:.2f} |")
    cpu = cpu or {}
    missing = [k for k in cpu if k not in rows]
    shared = [k for k in rows if k in cpu]
    if shared:  # the same recipe compressed on the GPU and on the CPU: their perplexity ratios should agree
        gap = max(abs(rows[k]["ppl_ratio"][s] / cpu[k]["ppl_ratio"][s] - 1) for k in shared for s in sources)
        out += ["", f"The same rows compressed on the CPU ({CPU_STEM}.json): their perplexity ratios differ from "
                    f"these by at most {gap:.1e} (relative), over all {len(shared)} rows and every source."]
    left = [f"Rows of the CPU run not measured in this one: {', '.join(missing)}.", ""] if missing else []
    return out + ["", *_verdicts(dense, rows, sources), "", *_published(data["model"], dense), *left]


SCALE_REAL_SPECIAL: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    CPU_STEM: scale_real_section, GPU_STEM: lambda data: scale_real_section(data, GPU_STEM, cpu_rows())}

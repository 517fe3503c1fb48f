"""BENCHMARKS.md's section for the 1.5B harness (benchmarks/scale_real.py), for make_report.py: perplexity ratios,
the standard suite's average with paired differences, compression time and peak RSS per row, then the issue's
verdicts (mla against transmla at each KV point; the KV 0.625 targets) read from the same rows."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from report_accuracy import paired_difference

TITLE = "Evidence at 1.5B: Qwen2.5-Coder-1.5B-Instruct against dense, perplexity and the standard suite"


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
    for key, row in rows.items():  # each method against its baseline row: mla / transmla, nbl / drop (same layers)
        rival = ("transmla-" + key[4:] if key.startswith("mla-kv") else "drop-" + key[4:] if key.startswith("nbl-")
                 else "")
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
    target = rows.get("mla-kv0.625")
    if target is not None:
        wiki = target["ppl_ratio"]["wiki"]
        verdict = "met" if wiki <= 1.10 else "missed"
        acc = (f"average accuracy {_diff(target, dense)} points against dense (target within 2)" if "standard" in target
               else "accuracy not scored in this run (target: within 2 points of dense)")
        out.append(f"- mla at KV 0.625 one-shot: wiki {wiki:.3f}× (target ≤ 1.10×: {verdict}); {acc}.")
    return out


def scale_real_section(data: dict[str, Any]) -> list[str]:
    env, ev, suite = data["environment"], data["eval"], data.get("suite", {})
    sources, dense, rows = ev["sources"], data["dense"], data["variants"]
    first: dict[str, Any] = next(iter(rows.values()), {})
    cal = first.get("calibration", {})
    limit = suite.get("standard_limit")
    command = " ".join(a for a in env["command"].split() if not a.startswith("--row="))  # the parent's call
    out = [f"## {TITLE}", "",
           f"Command: `OMP_NUM_THREADS={env['threads']} .venv/bin/python {command}` (each row in its own process; "
           f"`--row=KEY` re-runs one) → `benchmarks/results/scale-real-{data['model']}.json`. "
           f"Model `{data['model']}` (`make qwen15`: the dequantized Q4_K_M weights, float32), in memory. Evaluation: "
           f"the same first {ev['tokens']} tokens of each of {', '.join(sources)} for every row"
           + (f", and the first {limit} items of each of lm-eval's {len(suite['standard_tasks'])} standard tasks "
              "(0-shot; a fixed subset, the same for every row: scoring a 1.5B model runs at tens of tokens a second "
              "on 2 cores)" if limit else "; no standard suite in this run (`--limit 0`: at 1.5B lm-eval's "
              "8 tasks take about an hour per row at 20 items each on this 2-core CPU, so they wait for a GPU run)")
           + f". Calibration for every row: {cal.get('description', '?')} ({cal.get('tokens', '?')} tokens; mla "
           "without the output refit, whose token rule asks 73 windows at this width). "
           f"Device {env['device']}, {env.get('cpu', '?')}, {env['threads']} threads; torch {env['torch']}, "
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
    return out + ["", *_verdicts(dense, rows, sources), ""]


SCALE_REAL_SPECIAL: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "scale-real-qwen2.5-1.5b": scale_real_section}

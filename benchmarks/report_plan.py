"""BENCHMARKS.md section for benchmarks/plan.py's results (plan-*.json); used by make_report.py."""

from __future__ import annotations

import re
from collections.abc import Callable
from itertools import groupby
from typing import Any

SOURCES = ("wiki", "ptb", "c4")


def _budget(key: str) -> float:
    found = re.search(r"kv([0-9.]+)", key)
    return float(found.group(1)) if found else 1.0


def _layers(choices: list[str]) -> str:
    """Runs of equal choices: 'L0 mla@0.125 · L1–3 keep · …'."""
    out, i = [], 0
    for label, run in groupby(choices):
        n = len(list(run))
        out.append(f"L{i}{f'–{i + n - 1}' if n > 1 else ''} {label}")
        i += n
    return " · ".join(out)


def _rows(data: dict[str, Any]) -> list[str]:
    dense = data["dense"]
    out = ["| KV budget | variant | KV measured | wiki | ptb | c4 | compress s | plan s | refined from (whole-plan "
           "KL of each start) |", "|---|---|---|---|---|---|---|---|---|"]
    variants = data["variants"]
    for key in sorted(variants, key=lambda k: (-_budget(k), not k.startswith("plan"), "heal" in k, k)):
        v = variants[key]
        kv = v["kv_bytes_per_token"] / dense["kv_bytes_per_token"]
        cells = " | ".join(f"{v['ppl_ratio'][s]:.3f}" if s in v["ppl_ratio"] else "–" for s in SOURCES)
        starts = "–"
        if "plan_starts" in v and "heal" not in key:
            listed = ", ".join(f"{n} {s['measured']:.3f}" for n, s in v["plan_starts"].items())
            starts = f"{v['plan_start']} → {v['plan_estimate']['measured']:.3f} ({listed})"
        plan_s = f"{v['plan_seconds']:.0f}" if "plan_seconds" in v and "heal" not in key else "–"
        out.append(f"| {_budget(key):g} | {key} | {kv:.3f} | {cells} | {v.get('compress_seconds', '–')} | "
                   f"{plan_s} | {starts} |")
    return out


def plan_section(data: dict[str, Any]) -> list[str]:
    env, ev = data["environment"], data["eval"]
    device = env.get("gpu", env.get("cpu", env["device"]))
    out = ["## Planning under a budget: the planner against uniform MLA and TransMLA at the same KV cache", "",
           f"Command: `{'ATTNSLIM_BENCH_DEVICE=cuda ' if env['device'] == 'cuda' else ''}python "
           f"{env['command']}` → `benchmarks/results/{data.get('name', 'plan')}.json`.  ",
           f"Model `{data['model']}` (float32), evaluation: {', '.join(ev.get('descriptions', {}).values())} "
           f"({ev['tokens']} tokens per set). Device: {device}; torch {env['torch']}, transformers "
           f"{env['transformers']}, attnslim {env['attnslim']}.  ",
           "Ratios to the dense model of the same run. `plan-kvF` is `attnslim plan --kv F` (every candidate: keep, "
           "`mla` at per-layer KV 0.125–0.75 with refit_o, `nbl`, `drop`, `ds`; costs measured on calibration "
           "windows, never evaluation text) compressed by its recipe; `mla-kvF` is uniform `mla` with refit_o "
           "(recipes/mla-oneshot.yaml at that budget), `transmla-kvF` the TransMLA baseline; `-heal40` adds the "
           "default recipe's 40-step heal. Plan s: measuring every candidate of every layer once (shared by all "
           "budgets) plus the budget's solve, starts and refinement. The last column: the start the refinement "
           "began from and its result, each start's whole-plan KL per token on held-out calibration windows "
           "(planner/starts.py).", "", *_rows(data), ""]
    plans = [(k, v) for k, v in data["variants"].items() if "plan_layers" in v and "heal" not in k]
    if plans:
        out += ["What each plan chose, per layer:", ""]
        out += [f"- `{k}`: {_layers(v['plan_layers'])}" for k, v in sorted(plans, key=lambda kv: -_budget(kv[0]))]
        out.append("")
    for note in data.get("notes") or []:
        out += [note, ""]
    return out


PLAN_SPECIAL: dict[str, Callable[[dict[str, Any]], list[str]]] = {"plan-smollm2-135m-h100": plan_section}

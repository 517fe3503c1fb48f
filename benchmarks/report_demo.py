"""BENCHMARKS.md lines for `make demo`'s wall time (benchmarks/demo_time.py), placed under the section of the
heal-precision run that chose the default recipe's heal precision; used by make_report.py."""

from __future__ import annotations

from typing import Any

SECTION = "heal-precision"  # the results file whose section the demo's time follows


def heal_time_lines(data: dict[str, Any]) -> list[str]:
    """Each healed row's heal: precision, wall and CPU seconds, threads, and the KL at its start and end (from the
    heal's own report in the row)."""
    rows = {k: v["heal"] for k, v in data["variants"].items() if v.get("heal")}
    if not rows:
        return []
    out = ["The heals themselves (each row's heal report; wall seconds depend on the threads and on the machine's "
           "load, CPU seconds less so):", "",
           "| row | precision | steps | heal wall s | heal CPU s | threads | KL first → last |",
           "|---|---|---|---|---|---|---|"]
    for key, h in rows.items():
        cpu = h.get("cpu_seconds")
        out.append(f"| {key} | {h.get('precision', 'float32')} | {h['steps']} | {h['seconds']:.0f} | "
                   f"{'–' if cpu is None else f'{cpu:.0f}'} | {data['variants'][key].get('threads', '–')} | "
                   f"{h['kl_first']:.4f} → {h['kl_last']:.4f} |")
    return out + [""]


def demo_time_lines(data: dict[str, Any]) -> list[str]:
    runs = data["runs"]
    if not runs:
        return []
    stages = list(runs[-1]["stages"])
    budget = data["budget_s"]
    out = [f"`make demo`'s wall time against its {budget} s budget (`.venv/bin/python benchmarks/demo_time.py` → "
           "`benchmarks/results/demo-time.json`; stages from the demo's own clock; the load average before each "
           "run says whether the machine was quiet: the demo uses every core):", "",
           "| run (UTC) | commit | CPU | load before | heal precision | " + " | ".join(stages)
           + " | total s | budget |",
           "|---" * (len(stages) + 7) + "|"]
    for r in runs:
        cells = [f"{r['stages'].get(s, float('nan')):.0f}" for s in stages]
        out.append(f"| {r['when']} | {r.get('commit', '–')} | {r['host']['cpu']}, {r['host']['threads']} threads | "
                   f"{r['load_before']:.1f} | "
                   f"{r['heal_precision']} | " + " | ".join(cells) +
                   f" | {r['wall_s']:.0f} | {'met' if r['wall_s'] <= budget else 'missed'} |")
    return out + [""]

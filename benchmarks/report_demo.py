"""BENCHMARKS.md lines for `make demo`'s wall time (benchmarks/demo_time.py), placed under the section of the
heal-precision run that chose the default recipe's heal precision; used by make_report.py."""

from __future__ import annotations

from typing import Any

SECTION = "heal-precision"  # the results file whose section the demo's time follows


def demo_time_lines(data: dict[str, Any]) -> list[str]:
    runs = data["runs"]
    if not runs:
        return []
    stages = list(runs[-1]["stages"])
    budget = data["budget_s"]
    out = [f"`make demo`'s wall time against its {budget} s budget (`.venv/bin/python benchmarks/demo_time.py` → "
           "`benchmarks/results/demo-time.json`; stages from the demo's own clock; the load average before each "
           "run says whether the machine was quiet: the demo uses every core):", "",
           "| run (UTC) | CPU | load before | heal precision | " + " | ".join(stages) + " | total s | budget |",
           "|---" * (len(stages) + 6) + "|"]
    for r in runs:
        cells = [f"{r['stages'].get(s, float('nan')):.0f}" for s in stages]
        out.append(f"| {r['when']} | {r['host']['cpu']}, {r['host']['threads']} threads | {r['load_before']:.1f} | "
                   f"{r['heal_precision']} | " + " | ".join(cells) +
                   f" | {r['wall_s']:.0f} | {'met' if r['wall_s'] <= budget else 'missed'} |")
    return out + [""]

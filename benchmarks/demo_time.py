"""`make demo`'s wall time, stage by stage, against its 6-minute budget (the brief's target for a warm venv).

    .venv/bin/python benchmarks/demo_time.py --runs 1      # runs `attnslim demo` as `make demo` does
    .venv/bin/python benchmarks/make_report.py             # BENCHMARKS.md, under the heal-precision section

Each run is a fresh `python -m attnslim demo --overwrite` into a scratch directory (the warm venv is this one); the
stages come from the demo's own clock (demo.Stages, kept in compression.json as demo_seconds), the heal's precision
and seconds from its report. The one-minute load average before each run is recorded: the demo uses every core, so
a run beside other jobs is not a measurement of the target (the table says which runs were).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import RESULTS, environment

BUDGET_S = 360  # the brief: `make demo` in at most 6 minutes with a warm venv


def one_run(out: Path) -> dict[str, Any]:
    load = os.getloadavg()[0]
    began = time.perf_counter()
    subprocess.run([sys.executable, "-m", "attnslim", "demo", "--out", str(out), "--overwrite"], check=True)
    wall = time.perf_counter() - began
    info = json.loads((out / "compression.json").read_text())
    heal = info.get("heal") or {}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"commit": commit or "unknown", "wall_s": round(wall, 1), "stages": info["demo_seconds"],
            "load_before": round(load, 2),
            "heal_precision": heal.get("precision", "float32"), "heal_s": heal.get("seconds"),
            "recipe": info["recipe"]["name"], "when": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--name", default="demo-time")
    args = ap.parse_args()
    path = RESULTS / f"{args.name}.json"
    data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {"runs": []}
    with tempfile.TemporaryDirectory(prefix="attnslim-demo-time-") as scratch:
        for _ in range(args.runs):
            data["runs"].append({**one_run(Path(scratch) / "demo"), "host": environment()})
            data["budget_s"] = BUDGET_S
            path.write_text(json.dumps(data, indent=1))
            print(f"demo: {data['runs'][-1]['wall_s']:.0f} s (budget {BUDGET_S} s)", flush=True)


if __name__ == "__main__":
    main()

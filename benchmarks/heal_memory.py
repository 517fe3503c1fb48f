"""Peak memory of the heal under its memory settings (train/heal.py: teacher_dtype, checkpoint).

Each setting runs in its own process (peak RSS is per process): the model is loaded, compressed by the default
recipe's mla step (calibration cut to --windows windows, which sets conversion time, not the heal's memory) and
healed for --steps steps of the default recipe's heal (batch 4 x 256 tokens, the rest as recipes/default.yaml); the
row records the RSS after compression (student + teacher copy) and the process's peak RSS (getrusage), which
the heal sets, with the heal's seconds and losses.

    python benchmarks/heal_memory.py --model smollm2-135m --steps 4     # -> results/heal-memory.json
    python benchmarks/heal_memory.py --model qwen2.5-1.5b --steps 2 --settings bf16+ckpt --name heal-memory-qwen15
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from common import RESULTS, environment

SETTINGS = {  # name -> heal overrides
    "float32": [],
    "bf16": ["heal.teacher_dtype=bfloat16"],
    "ckpt": ["heal.checkpoint=true"],
    "bf16+ckpt": ["heal.teacher_dtype=bfloat16", "heal.checkpoint=true"],
}


def current_rss_mb() -> float:
    """This process's resident memory now (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_one(model_name: str, setting: str, steps: int, windows: int) -> dict[str, Any]:
    """Compress and heal in this process; the row of `setting`."""
    import warnings

    from attnslim.api import compress, peak_rss_mb
    from attnslim.models import load_model
    from attnslim.recipe import apply_overrides, load_recipe, recipe_to_dict

    recipe = apply_overrides(load_recipe("default"), [f"calibration.windows={windows}", f"heal.steps={steps}",
                                                      *SETTINGS[setting]])
    model, tokenizer = load_model(model_name)
    loaded = current_rss_mb()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = compress(model, tokenizer, recipe, progress=False)
    assert report.heal is not None
    return {"setting": setting, "recipe": recipe_to_dict(recipe), "rss_after_load_mb": round(loaded),
            "rss_after_heal_mb": round(current_rss_mb()), "peak_rss_mb": round(peak_rss_mb()),
            "heal_seconds": report.heal["seconds"], "history": report.heal["history"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    parser.add_argument("--name", default="heal-memory")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one setting, print its row as JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.model, args.one, args.steps, args.windows)))
        return
    rows = []
    for setting in args.settings.split(","):
        if setting not in SETTINGS:
            raise SystemExit(f"unknown setting {setting!r}; valid: {', '.join(SETTINGS)}")
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--steps", str(args.steps),
                              "--windows", str(args.windows), "--one", setting],
                             check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(f"{setting}: peak RSS {rows[-1]['peak_rss_mb']} MB, heal {rows[-1]['heal_seconds']} s", flush=True)
    path = RESULTS / f"{args.name}.json"
    path.write_text(json.dumps({"model": args.model, "steps": args.steps, "windows": args.windows, "rows": rows,
                                "environment": environment(), "command": " ".join(sys.argv)}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

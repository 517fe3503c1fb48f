"""Regenerate docs/quality.svg (the README's picture) and docs/plan.svg (BENCHMARKS' planner section) from
benchmarks/results/*.json; never edit them by hand.

Two scatter charts of SmolLM2-135M variants evaluated on 8192 tokens per set (the files in FILES): wiki
perplexity against the KV cache kept, and against the parameters kept, both as ratios to the dense model of the
same run; one colour per method (the recipe's steps joined with "+", "+ heal" when the recipe heals). Variants
above MAX_RATIO are left out of the picture (the subtitle says how many); BENCHMARKS.md lists every one.
docs/plan.svg: wiki perplexity against the KV cache kept for the planner and the single-method rows of
benchmarks/plan.py (report_plan.plan_series), one line per method, above PLAN_MAX_RATIO left out.

    .venv/bin/python benchmarks/make_plot.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from report_plan import CPU_FILE, plan_series

from attnslim.report.svg import line_chart

ROOT = Path(__file__).parent
RESULTS = ROOT / "results"
OUT = ROOT.parent / "docs" / "quality.svg"
# the 8192-token SmolLM2 result files (the small runs use other windows and are not comparable)
FILES = ("baselines", "latentllm", "latentllm-attn50", "latentllm-whole", "nbl", "nbl-calib", "lisa",
         "lisa-250steps", "lisa-mix", "mla")
MAX_RATIO = 2.0
PLAN_FILES = ("plan-smollm2-135m-h100", CPU_FILE)
PLAN_MAX_RATIO = 4.0


def method_of(file: str, variant: dict[str, Any]) -> str:
    recipe = variant.get("recipe")
    if not recipe:  # LISA's harness records no recipe: its file names the method
        return file.split("-")[0]
    name = "+".join(dict.fromkeys(step["method"] for step in recipe["steps"]))
    return f"{name} + heal" if recipe.get("heal") else name


def points(files: tuple[str, ...] = FILES) -> tuple[dict[str, list[tuple[float, float, float]]], int]:
    """{method: [(kv kept, params kept, wiki ratio)]} over the files that exist, and how many exceed MAX_RATIO."""
    out: dict[str, list[tuple[float, float, float]]] = {}
    left_out = 0
    for file in files:
        path = RESULTS / f"{file}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        if data.get("eval", {}).get("tokens") != 8192:
            continue
        dense = data["dense"]
        for variant in data.get("variants", {}).values():
            wiki = variant["ppl_ratio"]["wiki"]
            if wiki > MAX_RATIO:
                left_out += 1
                continue
            kv = variant["kv_bytes_per_token"] / dense["kv_bytes_per_token"]
            params = variant["params"]["total"] / dense["params"]["total"]
            out.setdefault(method_of(file, variant), []).append((kv, params, wiki))
    return dict(sorted(out.items())), left_out


def figure() -> str:
    pts, left_out = points()
    if not pts:
        raise SystemExit("no 8192-token result files under benchmarks/results: run the benchmarks first")
    note = f"SmolLM2-135M, 8192 tokens per set; {left_out} variants above {MAX_RATIO:g}x not shown"
    kv = line_chart("Wiki perplexity against the KV cache kept", {m: [(k, w) for k, _, w in p] for m, p in pts.items()},
                    "KV cache kept (x dense)", "wiki ppl (x dense)", connect=False, subtitle=note)
    par = line_chart("Wiki perplexity against the parameters kept",
                     {m: [(q, w) for _, q, w in p] for m, p in pts.items()}, "parameters kept (x dense)",
                     "wiki ppl (x dense)", connect=False, subtitle=note)
    return stack([kv, par])


def plan_figure() -> str | None:
    files = tuple(json.loads(p.read_text()) for f in PLAN_FILES if (p := RESULTS / f"{f}.json").is_file())
    if not files:
        return None
    series = plan_series(files)
    shown = {k: [(x, y) for x, y in v if y <= PLAN_MAX_RATIO] for k, v in series.items()}
    left_out = sum(len(v) for v in series.values()) - sum(len(v) for v in shown.values())
    return line_chart("Planned and single-method models: wiki perplexity against the KV cache kept",
                      {k: v for k, v in shown.items() if v}, "KV cache kept (x dense)", "wiki ppl (x dense)",
                      subtitle=f"SmolLM2-135M, 8192 tokens; {left_out} points above {PLAN_MAX_RATIO:g}x not shown")


def stack(charts: list[str]) -> str:
    """One SVG holding the charts one below the other."""
    heights = [float(c.split('height="', 1)[1].split('"', 1)[0]) for c in charts]
    width = max(float(c.split('width="', 1)[1].split('"', 1)[0]) for c in charts)
    body, y = [], 0.0
    for chart, h in zip(charts, heights, strict=True):
        body.append(f'<g transform="translate(0,{y:.0f})">{chart}</g>')
        y += h
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{y:.0f}" '
            f'viewBox="0 0 {width:.0f} {y:.0f}">{"".join(body)}</svg>\n')


def main() -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(figure())
    print(f"wrote {OUT}")
    if (plan := plan_figure()) is not None:
        (OUT.parent / "plan.svg").write_text(plan)
        print(f"wrote {OUT.parent / 'plan.svg'}")


if __name__ == "__main__":
    main()

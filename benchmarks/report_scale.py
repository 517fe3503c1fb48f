"""BENCHMARKS.md sections for the offloading results (scale.json, offload_time.json); used by make_report.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _env(env: dict[str, Any]) -> str:
    return (f"Device {env['device']} ({env['threads']} threads); torch {env['torch']}, transformers "
            f"{env['transformers']}, attnslim {env['attnslim']}.")


def scale_section(data: dict[str, Any]) -> list[str]:
    s, cal = data["shapes"], data["calibration"]
    out = ["## Offloaded compression at Llama-3-8B shapes (random weights)", "",
           f"Command (latest run): `OMP_NUM_THREADS={data['environment']['threads']} .venv/bin/python "
           f"{data['environment']['command']}` → `benchmarks/results/scale.json`; each row is a run of the same "
           "script with `--methods` and `--depths` set to its method and layer count (a rerun keeps the other "
           "rows).  ",
           f"**{data['note']}** Shapes: hidden {s['hidden_size']}, {s['num_attention_heads']} heads, "
           f"{s['num_key_value_heads']} KV heads, FFN {s['intermediate_size']}, vocab {s['vocab_size']}; bf16 on "
           f"disk, compute dtype {data['dtype']}, `compress --offload` in a fresh process per run. Calibration: "
           f"{cal['windows']} × {cal['seq_len']} tokens of {cal['source']}. Layer subsets of the "
           f"{data['full_model_layers']}-layer model (see the depth column).  ", _env(data["environment"]), "",
           "Peak RSS is the kernel's ru_maxrss, which counts the checkpoint's memory-mapped pages (reclaimable, and "
           "growing with every layer read); the anonymous peak (tensors, statistics, activations), sampled every "
           "50 ms, is the memory the run needs. NBL fits each candidate's map inside its statistics pass, so its "
           "fit time is under calibration.", "",
           "| method | layers | converted | peak RSS (MB) | peak anonymous RSS (MB) | calibration s/layer | "
           "conversion s/converted layer | total s | checkpoint GB | output GB |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["runs"]:
        anon = f"{r['peak_anon_rss_mb']:,.0f}" if "peak_anon_rss_mb" in r else "–"
        out.append(f"| {r['method']} | {r['layers']} | {len(r['converted_layers'])} | {r['peak_rss_mb']:,.0f} | "
                   f"{anon} | "
                   f"{r['calibration_s_per_layer']} | {r['conversion_s_per_converted_layer']} | {r['seconds']} | "
                   f"{r['checkpoint_bytes'] / 1e9:.2f} | {r['output_bytes'] / 1e9:.2f} |")
    plans = [r for r in data["runs"] if r["method"] == "plan"]
    if plans:
        c = plans[0]["plan_config"]
        out += ["", f"`plan` rows: `attnslim plan --offload --kv 0.5` (the API call, scale.py's `plan_child`), the "
                "weights on disk as in `compress --offload`: candidates "
                f"{', '.join(c['kinds'])} (mla at KV {', '.join(map(str, c['ladder']))} per layer, without its "
                "output refit, whose token rule asks ~98k calibration tokens at hidden 4096; nbl's map needs as "
                "many), 2 scoring windows of 256 tokens, one refinement round; `converted` counts the layers the "
                "plan changes, conversion s is the mla conversions' time, and the output is the recipe only. The "
                "fitted candidates wait on disk (planner/bank.py): "
                + "; ".join(f"{r['layers']} layers: {r['bank_mb']:,.0f} MB spilled, plan "
                            f"{' · '.join(r['plan'])}" for r in plans) + ". The plan rows ran with "
                f"{plans[0].get('threads', '?')} thread(s), the other rows with 2 (their runs' setting)."]
    out += ["", "Extrapolation to 70B shapes (hidden 8192, FFN 28672, 80 layers) from the deepest run, under the "
            "stated assumptions (not measured):", ""]
    for method, e in data["extrapolation_70b"].items():
        anon = (f", anonymous ~{e['peak_anon_rss_mb_estimate']:,.0f} MB" if "peak_anon_rss_mb_estimate" in e else "")
        out.append(f"- {method}: ~{e['hours_if_every_layer_converted']} h if every layer is converted, peak RSS "
                   f"~{e['peak_rss_mb_estimate']:,.0f} MB{anon} ({e['assumptions']}).")
    return out + [""]


def offload_time_section(data: dict[str, Any]) -> list[str]:
    cal, med = data["calibration"], data["median_seconds"]
    return ["## Offloaded against in-memory compression (SmolLM2-135M)", "",
            f"Command: `OMP_NUM_THREADS={data['environment']['threads']} .venv/bin/python "
            f"{data['environment']['command']}` → `benchmarks/results/offload_time.json`.  ",
            f"Method {data['method']} {data['args']}, calibration {cal['windows']} × {cal['seq_len']} tokens of "
            f"{cal['source']}; the two paths run in turn in one process, medians of "
            f"{len(data['seconds']['in_memory'])} runs each.  ", _env(data["environment"]), "",
            "| path | median s | runs (s) |", "|---|---|---|",
            f"| in memory | {med['in_memory']} | {data['seconds']['in_memory']} |",
            f"| offloaded | {med['offloaded']} | {data['seconds']['offloaded']} |", "",
            f"Offloaded / in memory: **{data['ratio_offloaded_to_in_memory']}×**; weights bit-identical in every "
            f"run: **{data['bit_identical']}**.", ""]


def precond_once_section(data: dict[str, Any]) -> list[str]:
    med = data["median_seconds"]
    return ["## LatentLLM: each preconditioner built once (SmolLM2-135M)", "",
            f"Command: `OMP_NUM_THREADS={data['environment']['threads']} .venv/bin/python "
            f"{data['environment']['command']}` → `benchmarks/results/precond_once.json`.  ",
            f"`attnslim compress --recipe {data['recipe']}` in one process, alternating the shared preconditioner "
            "(one eigh per statistics site, reused by every linear that reads it and by planning and conversion) "
            f"with rebuilding it per linear and pass, as before; medians of {len(data['seconds']['shared'])} runs "
            "each.  ", _env(data["environment"]), "",
            "| preconditioner | median s | runs (s) |", "|---|---|---|",
            f"| shared | {med['shared']} | {data['seconds']['shared']} |",
            f"| rebuilt per linear | {med['rebuilt']} | {data['seconds']['rebuilt']} |", "",
            f"Shared / rebuilt: **{data['ratio_shared_to_rebuilt']}×**; converted weights identical: "
            f"**{data['weights_identical']}**.", ""]


SPECIAL: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "scale": scale_section, "offload_time": offload_time_section, "precond_once": precond_once_section,
}

"""BENCHMARKS.md section for benchmarks/gpu.py's results (gpu-*.json); used by make_report.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _checks(models: dict[str, Any]) -> list[str]:
    out = ["| model | dtype | dense: cached vs full | mla-kv50: cached vs full | generate() = greedy loop "
           "(dense / mla) |", "|---|---|---|---|---|"]
    for name, r in models.items():
        for dtype, c in r["checks"].items():
            gen = (f"{c['dense']['generate_equals_greedy']} / {c['mla-kv50']['generate_equals_greedy']}"
                   if "generate_equals_greedy" in c["dense"] else "not run (bfloat16 ties)")
            out.append(f"| {name} | {dtype} | {c['dense']['cached_vs_full']:.2e} | "
                       f"{c['mla-kv50']['cached_vs_full']:.2e} | {gen} |")
    return out


def _speed(models: dict[str, Any]) -> list[str]:
    out = ["| model | dtype, batch | context | KV B/token dense → mla | decode tok/s dense | mla | mla ×dense "
           "[lowest–highest repetition] | prefill ms dense / mla |", "|---|---|---|---|---|---|---|---|"]
    for name, r in models.items():
        for setting, s in r["speed"].items():
            kv = r["kv_bytes_per_token"][setting.split("-")[0]]
            for c in s["contexts"]:
                d, m = s["models"]["dense"][str(c)], s["models"]["mla-kv50"][str(c)]
                lo, hi = m["decode_ratio_span"]
                out.append(f"| {name} | {setting.replace('-batch', ', batch ')} | {c} | {kv['dense']:,.0f} → "
                           f"{kv['mla-kv50']:,.0f} | {d['decode_tok_s']:.1f} | {m['decode_tok_s']:.1f} | "
                           f"{m['decode_ratio']:.2f}× [{lo:.2f}–{hi:.2f}] | {d['prefill_s'] * 1000:.0f} / "
                           f"{m['prefill_s'] * 1000:.0f} |")
    return out


def gpu_section(data: dict[str, Any]) -> list[str]:
    env = data["environment"]
    out = [f"## attnslim on a CUDA GPU ({env['gpu']}): MLA checks, decode speed, which recipes run", "",
           f"Command: `python3 {env['command']}` (inputs from `benchmarks/gpu.py --pack DIR`; see its docstring).  ",
           f"torch {env['torch']}, transformers {env['transformers']}, attnslim {env['attnslim']}. Random weights "
           "with each packaged model's real config (the weights cannot travel to the GPU machine): what is measured "
           "here does not depend on the weights' values, and perplexity is not measured.", ""]
    models = data.get("models", {})
    if models:
        converted = ", ".join(f"{n}: {r['converted_on']}" for n, r in models.items())
        out += [f"MLA at KV 0.5 (one-shot `mla`, converted on {converted}). Cached decode (absorbed) against the "
                "full forward without a cache (decompressed): max |difference| / max |logit| over 32 decoded "
                "positions, dense beside it as the floor of the same kernels:", "", *_checks(models), "",
                "Decode and prefill against dense (greedy, HF DynamicCache, 64 new tokens, medians of interleaved "
                "repetitions):", "", *_speed(models), ""]
    probe = data.get("probe")
    if probe:
        out += [f"Probe: each packaged recipe on a {probe['model']}-shaped model that lives on the GPU "
                "(`compress(model_on_cuda, ...)`, float32, 4 × 128 calibration tokens, every training, recovery and "
                "heal cut to 2 steps):", "", "| recipe | result |", "|---|---|",
                *[f"| {k} | {v} |" for k, v in probe["recipes"].items()], ""]
    for note in data.get("notes") or []:
        out += [note, ""]
    return out


GPU_SPECIAL: dict[str, Callable[[dict[str, Any]], list[str]]] = {"gpu-h200": gpu_section, "gpu-probe-h100": gpu_section}

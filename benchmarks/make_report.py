"""Regenerate BENCHMARKS.md, and the Summary table in README.md, from benchmarks/results/*.json (never edit
either by hand).

    .venv/bin/python benchmarks/make_report.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from report_accuracy import (  # noqa: E402
    SUMMARY_MODEL,
    accuracy_cell,
    accuracy_section,
    chance_average,
    dense_header,
    missing_rows,
    summary_entry,
)
from report_accuracy import TITLE as ACCURACY_TITLE  # noqa: E402
from report_claims import claims_section, load_claims, load_results  # noqa: E402
from report_demo import SECTION as DEMO_SECTION  # noqa: E402
from report_demo import demo_time_lines, heal_time_lines  # noqa: E402
from report_gpu import GPU_SPECIAL  # noqa: E402
from report_plan import PLAN_SPECIAL  # noqa: E402
from report_qwen import heal_memory_section, qwen15_section  # noqa: E402
from report_reliability import reliability_section, write_summary  # noqa: E402
from report_scale import SPECIAL as SCALE_SPECIAL  # noqa: E402
from report_scale_real import SCALE_REAL_SPECIAL  # noqa: E402
from report_serve import SERVE_SPECIAL  # noqa: E402
from report_standard import standard_section  # noqa: E402
from report_widths import WIDTH_SPECIAL  # noqa: E402

ROOT = Path(__file__).parent
RESULTS = ROOT / "results"
ACCURACY = RESULTS / "summary_accuracy.json"  # benchmarks/summary_accuracy.py
SPECIAL = {**SCALE_SPECIAL, **SCALE_REAL_SPECIAL, **SERVE_SPECIAL, **GPU_SPECIAL, **PLAN_SPECIAL, **WIDTH_SPECIAL}
SECTIONS = {
    "baselines": ("Baselines", "benchmarks/baselines.py"),
    "plan-smollm2-135m-h100": ("Planning under a budget: the planner against uniform MLA and TransMLA at the same KV "
                               "cache", "benchmarks/plan.py"),
    "plan-gemma3-270m": ("Planning under a budget on Gemma-3 270M: the planner against uniform MLA at KV 0.5 "
                         "(one-shot, CPU)", "benchmarks/plan.py"),
    "calib-source-smollm2-135m": ("Calibration that follows the model: wiki against text the model writes itself "
                                  "(`self`)", "benchmarks/calib_source.py"),
    "plan-selfwiki-smollm2-135m": ("Planning under a budget, calibrated on the model's own text: the KV-0.5 and 0.25 "
                                   "plans on wiki against `self+wiki`, scored on code beside wiki, ptb and c4",
                                   "benchmarks/plan.py"),
    "plan-narrow-qwen2.5-1.5b": ("Planning under a budget on the 1.5B coder: KV 0.5 with the default calibration "
                                 "(`self+wiki`), a narrowed planner, scored on code beside wiki, ptb and c4",
                                 "benchmarks/plan.py"),
    "calib-source-qwen2.5-1.5b": ("Calibration that follows the model on the 1.5B coder: wiki, text the model writes "
                                  "itself (`self`), and code, scored on code beside wiki, ptb and c4",
                                  "benchmarks/calib_source.py"),
    "nbl": ("NBL: linearized attention layers", "benchmarks/nbl.py"),
    "latentllm": ("LatentLLM", "benchmarks/latentllm.py"),
    "latentllm-ud": ("LatentLLM's joint up/down MLP fit (§4.3, App. H) against local MLP compression, 80% of all "
                     "parameters, one harness", "benchmarks/latentllm.py"),
    "latentllm-ablations": ("LatentLLM's q/k ablations: joint QKV (App. C) and split-head (App. D) beside joint QK "
                            "and the local fit, 80% of attention, uniform ranks", "benchmarks/latentllm.py"),
    "latentllm-small": ("LatentLLM (small run: 2048 evaluation tokens, 16 calibration windows)",
                        "benchmarks/latentllm.py"),
    "nbl-small": ("NBL (small run)", "benchmarks/nbl.py"),
    "composed": ("Composed recipes: NBL + LatentLLM (the default recipe's targets)", "benchmarks/composed.py"),
    "atp": ("ATP: attention on principal keys", "benchmarks/atp.py"),
    "atp-boolq": ("ATP on BoolQ with the paper's App. D prompt (Table 4's protocol): 1/2 and 1/4 principal keys, "
                  "zero-shot and after the same LoRA task fine-tune as dense", "benchmarks/atp_boolq.py"),
    "atp-recovery": ("ATP: recovery of the paper's layer on all 30 layers (losses compared) and on the cheapest "
                     "layers", "benchmarks/atp.py"),
    "lisa": ("LISA: cross-layer attention sharing", "benchmarks/lisa.py"),
    "lisa-250steps": ("LISA on ~50% of the layers with a 250-step distillation budget", "benchmarks/lisa.py"),
    "lisa-mix": ("LISA with a 250-step distillation budget on mixed text (wiki + c4)", "benchmarks/lisa.py"),
    "lisa-stability-smollm2-135m": ("LISA #15: the adjacent-layer JS profile on easy and hard text",
                                    "benchmarks/lisa_stability.py"),
    "lisa-aligner-smollm2-135m": ("LISA #19: is a trained single-linear aligner permutation-like?",
                                  "benchmarks/lisa_aligner.py"),
    "lisa-aligner-smollm2-135m-250steps": ("LISA #19 with a 250-step budget", "benchmarks/lisa_aligner.py"),
    "lisa-aligner-gemma3-270m": ("LISA #19 on Gemma-3 270M", "benchmarks/lisa_aligner.py"),
    "lisa-gemma3": ("LISA on Gemma-3 270M: the analyses, LISA and DS, the ablation", "benchmarks/lisa.py"),
    "lisa-stability-gemma3-270m": ("LISA #15 on Gemma-3 270M: the adjacent-layer JS profile on easy and hard text",
                                   "benchmarks/lisa_stability.py"),
    "atp-gemma3": ("ATP on Gemma-3 270M", "benchmarks/atp.py"),
    "lisa-qwen2.5-1.5b": ("LISA's analyses on the 1.5B model: layer similarity and sharing sensitivity (no trained "
                          "variant)", "benchmarks/lisa.py"),
    "lisa-stability-qwen2.5-1.5b": ("LISA #15 on the 1.5B model: the adjacent-layer JS profile on easy and hard text",
                                    "benchmarks/lisa_stability.py"),
    "nbl-qwen2.5-1.5b": ("NBL on the 1.5B model: the paper's CCA selection against random and against dropping the "
                         "same layers (4096 wiki tokens, 8 calibration windows); decode speed with 12 layers "
                         "linearised", "benchmarks/nbl.py"),
    "latentllm-qwen2.5-1.5b": ("LatentLLM's ablations on the 1.5B model at 80% of attention (4096 wiki tokens, 8 "
                               "calibration windows): pre-conditioners, junctions, joint QK / QKV / V/O, split-head, "
                               "RoPE-aware", "benchmarks/latentllm.py"),
    "atp-qwen2.5-1.5b": ("ATP on the 1.5B model: low-rankness of layer inputs, one layer's speed at its shapes, and "
                         "the serving form's continuation perplexity (4 wiki sequences)", "benchmarks/atp.py"),
    "lisa-beta-gemma3-270m": ("LISA #20 on Gemma-3 270M: score distillation (beta 0.25) against LM loss only",
                              "benchmarks/lisa_beta.py"),
    "lisa-beta-smollm2-135m": ("LISA #20: score distillation (beta 0.25) against LM loss only (beta 0)",
                               "benchmarks/lisa_beta.py"),
    "nbl-calib": ("NBL: calibration-size and ridge sensitivity (8192 evaluation tokens)", "benchmarks/nbl.py"),
    "latentllm-attn50": ("LatentLLM: attention-only at 50% kept attention parameters", "benchmarks/latentllm.py"),
    "nbl-gemma3-small": ("NBL on Gemma-3 270M (small run, 16 calibration windows)", "benchmarks/nbl.py"),
    "nbl-gemma3-bos": ("NBL on Gemma-3 270M (2048 evaluation tokens, 64 calibration windows, every window starting "
                       "with <bos>)", "benchmarks/nbl.py"),
    "nbl-gemma3-speed": ("NBL on Gemma-3 270M: decode speed against dense, the default criterion's 6 layers",
                         "benchmarks/nbl.py"),
    "nbl-gemma3": ("NBL on Gemma-3 270M: windows without <bos> (the first measurement, superseded; 2048 evaluation "
                   "tokens, 64 calibration windows)", "benchmarks/nbl.py"),
    "lmeval_check": ("Zero-shot tasks: attnslim vs lm-eval", "benchmarks/lmeval_check.py"),
    "latentllm-table": ("LatentLLM: Table 1/2 ablations at 8192 evaluation tokens", "benchmarks/latentllm.py"),
    "latentllm-whole": ("LatentLLM: whole model and healing at 8192 evaluation tokens", "benchmarks/latentllm.py"),
    "heal-sweep": ("Healing settings on one composed model", "benchmarks/heal.py"),
    "latentllm-head": ("LatentLLM: the LM head factored (Table 3 with lm_head) on SmolLM2's tied head, untied",
                       "benchmarks/latentllm.py"),
    "heal-precision": ("The default recipe's heal in float32 and in bfloat16 autocast (heal.precision), and "
                       "`make demo`'s wall time", "benchmarks/heal.py"),
    "heal-values": ("Healing NBL + LatentLLM values-cache, no MLP compression", "benchmarks/heal.py"),
    "heal-default": ("Healing the default recipe's compression: MLA (the default) beside LatentLLM's latent caches "
                     "(the previous default), and which text to heal on",
                     "benchmarks/heal.py"),
    "mla": ("MLA: multi-head latent attention with decoupled RoPE beside TransMLA", "benchmarks/mla.py"),
    "mla-kv375-ablations": ("MLA at KV 0.375: the ablations, FreqFold and the rope_dims sweep that set today's "
                            "default (8192 evaluation tokens)", "benchmarks/mla.py"),
    "mla-kv25-ablations": ("MLA at KV 0.25: FreqFold against one pair per frequency, d_rope under FreqFold, and the "
                           "global rank allocation (8192 evaluation tokens)", "benchmarks/mla.py"),
    "mla-gemma3": ("MLA on Gemma-3 270M: QK-norm layers with cached key scales, beside TransMLA (8192 evaluation "
                   "tokens, every window starting with <bos>)", "benchmarks/mla.py"),
    "mla-gemma3-calib": ("MLA on Gemma-3 270M: which layers and how much calibration (the real test's configuration "
                         "against the benchmark's; 2048 wiki tokens)", "benchmarks/mla.py"),
    "mla-gemma3-nobos": ("MLA on Gemma-3 270M: windows without <bos> (the first measurement, superseded)",
                         "benchmarks/mla.py"),
    "mla-gemma3-small": ("MLA on Gemma-3 270M (small run: 2048 evaluation tokens, 16 calibration windows): mla's "
                         "default d_rope against TransMLA's", "benchmarks/mla.py"),
    "mla-small": ("MLA: multi-head latent attention with decoupled RoPE beside TransMLA (small run: 2048 evaluation "
                  "tokens, 16 calibration windows; `mla` rows are of the previous default split, no FreqFold and "
                  "d_rope E²/1.5D)", "benchmarks/mla.py"),
    "mla-deepseek-small": ("MLA: the DeepSeek-V3 layout (what `attnslim export` takes) against the free layout "
                           "(small run: 2048 evaluation tokens, 16 calibration windows)", "benchmarks/mla.py"),
    "mla-speed": ("MLA: decode and prefill speed against dense, with FLOPs and KV bytes",
                  "benchmarks/mla.py"),
    "mla-speed-fold": ("MLA: decode speed of the default split (FreqFold, d_rope 32) against the previous one (d_rope "
                       "64), 2 threads", "benchmarks/mla.py"),
    "mla-speed-2t": ("MLA: decode and prefill speed against dense on 2 threads (quiet machine)",
                     "benchmarks/mla.py"),
    "mla-speed-static": ("MLA: decode and prefill speed against dense on a static KV cache "
                         "(generate's cache_implementation=\"static\"), 2 threads", "benchmarks/mla.py"),
    "mla-speed-reserved": ("MLA: decode and prefill speed against dense when every layer of both appends to its "
                           "KV cache in place (cache kind `reserved`), 2 threads", "benchmarks/mla.py"),
    "mla-kernels": ("MLA: decode core kernels (grouped GEMMs against the split flash kernel) beside dense's core",
                    "benchmarks/mla_kernels.py"),
    "mla-kernels-mkl-intel": ("MLA: decode core kernels with MKL's Intel code paths forced (diagnosis: why hosts "
                              "differ)", "benchmarks/mla_kernels.py"),
    "mla-speed-kernels": ("MLA: whole-model decode with the split and the grouped decode core, 2 threads",
                          "benchmarks/mla.py"),
    "mla-speed-kernels-mkl-intel": ("MLA: whole-model decode with the split and the grouped decode core, MKL's "
                                    "Intel code paths forced (diagnosis), 2 threads", "benchmarks/mla.py"),
    "mla-speed-onednn": ("MLA: whole-model decode with every linear layer on oneDNN (`--cpu-linear onednn`, dense "
                         "included), 2 threads", "benchmarks/mla.py"),
    "mla-speed-intel": ("MLA: whole-model decode with the split and the grouped decode core on an Intel host (MKL's "
                        "own fast kernels), 2 threads", "benchmarks/mla.py"),
    "mla-speed-bytes": ("MLA: decode against dense with the bytes each new token reads (weights + KV cache), 2 "
                        "threads", "benchmarks/mla.py"),
    "mla-speed-512": ("MLA: decode against dense at 512 tokens of context, many repetitions (the issue's 512-token "
                      "target), 2 threads", "benchmarks/mla.py"),
    "mla-kernels-intel": ("MLA: decode core kernels on an Intel host (grouped GEMMs, the split flash kernel and one "
                          "flash call) beside dense's core", "benchmarks/mla_kernels.py"),
    "decode-ops-smollm2-135m-before": ("What one decode step dispatches, SmolLM2-135M dense against MLA, before the "
                                       "decode-path cuts", "benchmarks/decode_ops.py"),
    "decode-ops-smollm2-135m": ("What one decode step dispatches, SmolLM2-135M dense against MLA",
                                "benchmarks/decode_ops.py"),
    "decode-ops-gemma3-270m-before": ("What one decode step dispatches, Gemma-3 270M dense against MLA, before the "
                                      "decode-path cuts", "benchmarks/decode_ops.py"),
    "decode-ops-gemma3-270m": ("What one decode step dispatches, Gemma-3 270M dense against MLA",
                               "benchmarks/decode_ops.py"),
    "mla-gemma3-speed": ("MLA on Gemma-3 270M: decode and prefill against dense, with the bytes each new token reads, "
                         "2 threads", "benchmarks/mla.py"),
}


def device_details(env: dict[str, Any]) -> str:
    """", AMD EPYC" where the run recorded a CPU model (older runs recorded only the architecture, x86_64), with
    the BLAS torch used where recorded, and a preloaded library (with_mkl_intel_paths.sh) where there was one."""
    cpu = env.get("cpu", "")
    name = f", {cpu}" if cpu and cpu not in ("x86_64", "aarch64", "arm64", "i386") else ""
    if env.get("blas"):
        name += f", BLAS {env['blas']}"
    if env.get("ld_preload"):
        name += " with MKL's Intel code paths forced (LD_PRELOAD: benchmarks/with_mkl_intel_paths.sh)"
    return name


# sections in this order (by method), then any other result file in name order
ORDER = ("scale-real-qwen2.5-1.5b", "scale-real-qwen2.5-1.5b-h200",
         "baselines", "latentllm", "latentllm-table", "latentllm-attn50", "latentllm-whole",
         "latentllm-small", "latentllm-gemma3",
         "composed", "heal-default", "heal-precision", "heal-sweep", "heal-values", "mla", "mla-kv375-ablations",
         "mla-kv25-ablations",
         "mla-gemma3", "mla-gemma3-calib", "mla-gemma3-nobos", "mla-gemma3-small",
         "mla-small", "mla-deepseek-small", "export", "mla-speed", "mla-speed-2t",
         "mla-speed-fold", "mla-speed-static",
         "mla-speed-reserved", "mla-speed-kernels", "mla-kernels", "mla-speed-kernels-mkl-intel",
         "mla-kernels-mkl-intel", "mla-speed-onednn", "mla-speed-intel", "mla-speed-bytes", "mla-kernels-intel",
         "decode-ops-smollm2-135m-before", "decode-ops-smollm2-135m", "mla-speed-512", "decode-ops-gemma3-270m-before",
         "decode-ops-gemma3-270m",
         "mla-gemma3-speed", "gpu-h200", "gpu-probe-h100", "plan-smollm2-135m-h100", "plan-gemma3-270m",
         "plan-selfwiki-smollm2-135m", "calib-source-smollm2-135m", "plan-narrow-qwen2.5-1.5b",
         "calib-source-qwen2.5-1.5b",
         "bias-drop-qwen2.5-1.5b", "rope-stride-qwen2.5-1.5b", "rope-stride-kv0.625-qwen2.5-1.5b",
         "bias-fold-local-qwen2.5-1.5b", "nbl", "nbl-calib",
         "nbl-small", "nbl-gemma3-bos", "nbl-gemma3-speed", "nbl-gemma3",
         "nbl-gemma3-small", "lisa", "lisa-250steps", "lisa-mix", "lisa-stability-smollm2-135m",
         "lisa-aligner-smollm2-135m", "lisa-aligner-smollm2-135m-250steps", "lisa-beta-smollm2-135m", "lisa-gemma3",
         "lisa-stability-gemma3-270m", "lisa-aligner-gemma3-270m", "lisa-beta-gemma3-270m", "atp", "atp-boolq",
         "atp-recovery", "atp-gemma3", "lisa-qwen2.5-1.5b", "lisa-stability-qwen2.5-1.5b", "atp-qwen2.5-1.5b",
         "nbl-qwen2.5-1.5b", "latentllm-qwen2.5-1.5b", "lmeval_check")
# the one-screen summary: (method, result file, headline variant, its baseline in the same run, recipe or command)
HEADLINES = (
    ("svd / asvd / svdllm", "baselines", "svdllm-attn-80", "svd-attn-80", "--recipe svdllm"),
    ("latentllm", "latentllm", "latentllm-80", "svdllm-attn-80", "--recipe latentllm"),
    ("mla (+ 40-step heal)", "mla", "mla-kv50-heal40", "transmla-kv50-heal40", "--recipe default"),
    ("nbl", "nbl", "nbl-similarity-m6", "drop-similarity-layers-m6", "--recipe nbl"),
    ("lisa", "lisa", "lisa-50", "ds-50", "--recipe lisa"),
    ("atp (serving cache)", "atp", "hybrid r=1/4", "recent r=1/4", "--recipe atp"),
    ("planner (mla, nbl, drop, keep per layer)", "plan-smollm2-135m-h100", "plan-kv0.5", "mla-kv0.5",
     "--kv 0.5 --calib-source wiki"),
)


# Superseded or exploratory runs: docs/benchmarks-archive.md, generated from the same results. Every other result is
# a current section of BENCHMARKS.md (a new result lands there until it is archived here).
ARCHIVE = ("latentllm-head",
           "latentllm-attn50", "latentllm-small", "composed", "heal-sweep", "heal-values", "mla-kv375-ablations",
           "mla-gemma3-calib", "mla-gemma3-nobos", "mla-gemma3-small", "mla-small", "mla-deepseek-small", "mla-speed",
           "mla-speed-2t", "mla-speed-fold", "mla-speed-static", "mla-speed-reserved", "mla-speed-kernels",
           "mla-kernels", "mla-speed-kernels-mkl-intel", "mla-kernels-mkl-intel", "mla-speed-onednn",
           "mla-speed-intel", "mla-kernels-intel", "decode-ops-smollm2-135m-before", "decode-ops-gemma3-270m-before",
           "decode-ops-gemma3-270m", "nbl-calib", "nbl-small", "nbl-gemma3", "nbl-gemma3-small", "lisa-250steps",
           "lisa-mix", "atp-recovery", "offload_time", "precond_once",
           # measured once to settle a default or a target, superseded as headline evidence by the sections kept
           "latentllm-table", "mla-kv25-ablations", "decode-ops-smollm2-135m", "mla-speed-512", "lmeval_serve",
           "nbl-gemma3-bos", "latentllm-whole", "mla-gemma3-speed",
           # one-off studies whose conclusions live in docs/serving.md; a probe re-run (the GPU fixes hold)
           "bias-drop-qwen2.5-1.5b", "rope-stride-qwen2.5-1.5b", "rope-stride-kv0.625-qwen2.5-1.5b",
           "bias-fold-local-qwen2.5-1.5b", "gpu-probe-h100",
           # settled a default (wiki calibration stays; the heal's bf16 teacher), superseded by the 1.5B measurement
           "calib-source-smollm2-135m", "heal-memory",
           # LISA properties whose verdicts the claims table carries; the 250-step aligner run supersedes the 100-step
           "lisa-aligner-smollm2-135m", "lisa-stability-smollm2-135m",
           # the export's exactness check (docs/serving.md states it; the serving section is the current evidence)
           "export",
           # joint UD against local MLP, LISA #19 (250 steps) and #20: the claims table carries the verdicts; the
           # 1.5B heal-memory run settled the heal's memory default (docs/cli.md)
           "latentllm-ud", "lisa-aligner-smollm2-135m-250steps", "lisa-beta-smollm2-135m", "heal-memory-qwen15",
           # the paper's joint QKV and split-head ablations: the claims table carries the verdicts
           "latentllm-ablations",
           # the claims table's Gemma-3 column: it carries the verdicts
           "latentllm-gemma3", "lisa-gemma3", "lisa-stability-gemma3-270m", "atp-gemma3", "plan-gemma3-270m",
           "lisa-aligner-gemma3-270m", "lisa-beta-gemma3-270m", "nbl-gemma3-speed",
           # the claims table's 1.5B column (analyses only): it carries the verdicts
           "lisa-qwen2.5-1.5b", "lisa-stability-qwen2.5-1.5b", "atp-qwen2.5-1.5b", "nbl-qwen2.5-1.5b",
           "latentllm-qwen2.5-1.5b",
           # the claims table carries their verdicts: ATP's BoolQ protocol, MLA against TransMLA on Gemma-3
           "atp-boolq", "mla-gemma3",
           # the previous default's heal comparison (its title says so); decode bytes per token: docs/cpu-speed.md
           "heal-default", "mla-speed-bytes")
ARCHIVE_PAGE = "docs/benchmarks-archive.md"


def load_accuracy() -> dict[str, dict[str, Any]]:
    """benchmarks/summary_accuracy.py's runs (one per model and item limit), {} before the first."""
    return json.loads(ACCURACY.read_text()) if ACCURACY.is_file() else {}


def summary(results: dict[str, dict[str, Any]], accuracy: dict[str, dict[str, Any]] | None = None) -> list[str]:
    """One row per method's headline result beside its baseline of the same run (wiki ppl ratios to dense), with
    the average accuracy of both on the standard suite where summary_accuracy.py scored them (one run, the one
    with the most items per task; the dense reference in the column's header)."""
    entry = summary_entry(accuracy or {}, SUMMARY_MODEL)
    lines = ["## Summary", "",
             "One row per method: its headline variant and the baseline it improves on, measured in the same run; "
             "ratios to the dense model. The section named in the last column has the exact command and setup "
             "(a packaged recipe may differ in budget or calibration).", "",
             "| method | variant | wiki | ptb | c4 | KV ×dense | kept total | baseline: wiki "
             f"| {dense_header(entry)} | packaged recipe of this kind | section |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for method, name, key, base, recipe in HEADLINES:
        data = results.get(name, {})
        v, b = data.get("variants", {}).get(key), data.get("variants", {}).get(base)
        if v is None or b is None:
            continue
        ratio = v.get("ppl_ratio", {})
        cells = " | ".join(f"{ratio[s]:.3f}" if s in ratio else "–" for s in ("wiki", "ptb", "c4"))
        kv = v["kv_bytes_per_token"] / data["dense"]["kv_bytes_per_token"]
        base_wiki = b.get("ppl_ratio", {}).get("wiki")
        base_cell = f"{base}: {base_wiki:.3f}" if base_wiki is not None else base
        title = SECTIONS.get(name, (name, ""))[0]
        lines.append(f"| {method} | {key} | {cells} | {kv:.2f} | {v['kept']['total']:.3f} | {base_cell} | "
                     f"{accuracy_cell(entry, key, base)} | `attnslim compress {recipe}` | {title} |")
    missing = missing_rows(entry, HEADLINES)
    chance = chance_average(entry["tasks"]) if entry else None
    lines += ["", "avg acc: mean accuracy (percent ± standard error) over lm-eval's 8 standard zero-shot tasks on "
              "the same first n items of each, variant (baseline), each compressed with its row's recorded recipe: "
              f"BENCHMARKS \"{ACCURACY_TITLE}\"."
              + (f" Random choice averages {chance:.1f}." if chance is not None else "")
              + (f" –: {missing}." if missing else "")]
    return lines + [""]


def ppl_table(data: dict[str, Any]) -> list[str]:
    sources = data["eval"]["sources"]
    speed = any("decode_ratio" in v.get("speed", {}) for v in data["variants"].values())
    dense = data["dense"]
    tasks = list(dense.get("acc", {}))
    head = "| variant | " + " | ".join(f"{s} ppl (×dense)" for s in sources)
    head += " | kept attention | kept total | KV B/token (×dense) | compress s |"
    head += " decode ×dense |" if speed else ""
    head += "".join(f" {t.removeprefix('attnslim_')} acc (Δ pts) |" for t in tasks)
    lines = [head, "|" + "---|" * (len(sources) + 5 + speed + len(tasks))]
    cells = " | ".join(f"{dense['ppl'][s]:.3f}" for s in sources)
    kv0 = dense["kv_bytes_per_token"]
    lines.append(f"| dense | {cells} | 1.000 | 1.000 | {kv0:,.0f} | – |" + (" 1.00 |" if speed else "")
                 + "".join(f" {dense['acc'][t]:.3f} |" for t in tasks))
    for key, v in data["variants"].items():
        cells = " | ".join(f"{v['ppl'][s]:.3f} ({v['ppl_ratio'][s]:.2f}×)" for s in sources)
        decode = f" {v['speed']['decode_ratio']:.2f} |" if "decode_ratio" in v.get("speed", {}) else " – |"
        seconds = f"{v.get('compress_seconds', '–')}" + (f" ({v['threads']} thr)" if "threads" in v else "")
        acc = v.get("acc", {})
        accs = "".join(f" {acc[t]:.3f} ({100 * (acc[t] - dense['acc'][t]):+.1f}) |" if t in acc else " – |"
                       for t in tasks)
        lines.append(
            f"| {key} | {cells} | {v['kept']['attention']:.3f} | {v['kept']['total']:.3f} | "
            f"{v['kv_bytes_per_token']:,.0f} ({v['kv_bytes_per_token'] / kv0:.2f}×) | "
            f"{seconds} |" + (decode if speed else "") + accs
        )
    return lines


def section(name: str, data: dict[str, Any]) -> list[str]:
    title, script = SECTIONS.get(name, (name, f"benchmarks/{name}.py"))
    env = data["environment"]
    ev = data.get("eval")  # absent from kernel micro-benchmarks, which evaluate no model
    variants: dict[str, dict[str, Any]] = data.get("variants", {})
    cal = next(iter(variants.values()), {}).get("calibration", {})
    out = [f"## {title}", ""]
    command = env.get("command", script)
    command = command if command.startswith("benchmarks/") else f"benchmarks/{command}"
    runner = "benchmarks/with_mkl_intel_paths.sh" if env.get("ld_preload") else ".venv/bin/python"
    out.append(f"Command (latest run): `OMP_NUM_THREADS={env['threads']} {runner} {command}` → "
               f"`benchmarks/results/{name}.json`; variants measured by earlier runs of the script record their own "
               "`command` in the JSON.  ")
    if ev is not None:
        out.append(
            f"Model `{data['model']}` (float32), evaluation: {', '.join(ev.get('descriptions', {}).values())} "
            f"({ev['tokens']} tokens, {ev['seq_len']}-token windows per set).  "
        )
    if cal:
        others = {v.get("calibration", {}).get("description") for v in variants.values()} - {cal.get("description")}
        differs = " (the first row's; other rows differ: each row's `calibration` in the JSON)" if others else ""
        out.append(f"Calibration: {cal.get('description')} ({cal.get('tokens')} tokens){differs}.  ")
    out.append(
        f"Device {env['device']}{device_details(env)} ({env['threads']} threads); torch {env['torch']}, transformers "
        f"{env['transformers']}, attnslim {env['attnslim']}."
    )
    out.append("")
    if data.get("dense", {}).get("ppl"):  # a run of only non-perplexity groups (e.g. atp.py --groups choice)
        out.extend(ppl_table(data))
    for note in data.get("notes") or []:  # a paragraph each, but a table's rows stay one table
        if not note:  # paragraphs are separated here
            continue
        same_table = note.startswith("|") and out[-1].startswith("|")
        out += [note] if same_table or not out[-1] else ["", note]
    return out + [""]


def main() -> None:
    lines = [
        "# Benchmarks",
        "",
        "Generated by `benchmarks/make_report.py` from `benchmarks/results/*.json`; every number comes from the",
        "command given in its section. Perplexity ratios are against the dense model evaluated on the same windows",
        "in the same harness; \"kept\" is the fraction of the parameter group counted from the real tensors.",
        "",
    ]
    results = {}
    probes = sorted(RESULTS.glob("reliability*.json"))
    standard = RESULTS / "standard_tasks.json"  # one entry per model and item limit (benchmarks/standard_tasks.py)
    heal_memory = sorted(RESULTS.glob("heal-memory*.json"))  # one per model (benchmarks/heal_memory.py --name)
    demo_time = RESULTS / "demo-time.json"  # benchmarks/demo_time.py: rendered under DEMO_SECTION
    for path in sorted(set(RESULTS.glob("*.json")) - set(probes) - set(heal_memory) - {standard, ACCURACY, demo_time}):
        data = json.loads(path.read_text())
        if "environment" not in data:  # not a benchmarks/common.py Harness file (e.g. reliability.json)
            print(f"skipped {path.name}: no 'environment' (not a perplexity/speed harness result)")
            continue
        if "planned" in data and not data.get("variants"):  # plan.py cut before it scored its plan
            print(f"skipped {path.name}: no row scored yet (benchmarks/plan.py --plans-from {path.stem} scores it)")
            continue
        results[path.stem] = data
    accuracy = load_accuracy()
    lines += summary(results, accuracy)
    lines += claims_section(load_claims(), load_results(RESULTS))  # benchmarks/claims.yaml
    if standard.is_file():
        lines += standard_section(json.loads(standard.read_text()))
    if accuracy:
        lines += accuracy_section(accuracy, HEADLINES)
    for path in heal_memory:
        if path.stem not in ARCHIVE:
            lines += heal_memory_section(json.loads(path.read_text()), path.stem)
    write_summary(ROOT.parent / "README.md", summary(results, accuracy))
    archive = ["# Benchmarks archive", "",
               "Superseded and exploratory runs, generated by `benchmarks/make_report.py` from `benchmarks/results/` "
               "like BENCHMARKS.md (whose current sections supersede these). Each section keeps its command.", ""]
    qwen15 = (RESULTS / "qwen15" / "compress.time").is_file()
    if qwen15:  # the first 1.5B row, superseded by scale-real's (benchmarks/scale_real.py)
        archive += qwen15_section(RESULTS / "qwen15")
    for path in heal_memory:
        if path.stem in ARCHIVE:
            archive += heal_memory_section(json.loads(path.read_text()), path.stem)
    for name in sorted(results, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n)):
        text = SPECIAL[name](results[name]) if name in SPECIAL else section(name, results[name])
        if name == DEMO_SECTION:
            text += heal_time_lines(results[name])
            text += demo_time_lines(json.loads(demo_time.read_text())) if demo_time.is_file() else []
        if name in ARCHIVE:
            archive += text
        else:
            lines += text
    lines += reliability_section(probes)
    archived = sum(n in results for n in ARCHIVE) + sum(p.stem in ARCHIVE for p in heal_memory) + qwen15
    lines += [f"Superseded and exploratory runs ({archived} sections): "
              f"[{ARCHIVE_PAGE}]({ARCHIVE_PAGE}).", ""]
    (ROOT.parent / "BENCHMARKS.md").write_text("\n".join(lines))
    (ROOT.parent / ARCHIVE_PAGE).write_text("\n".join(archive))
    print(f"wrote {ROOT.parent / 'BENCHMARKS.md'} and {ROOT.parent / ARCHIVE_PAGE}")


if __name__ == "__main__":
    main()

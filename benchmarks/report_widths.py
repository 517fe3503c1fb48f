"""BENCHMARKS.md sections for the served-width studies on the 1.5B model: what dropping Qwen's attention biases
costs (benchmarks/bias_drop.py) and which rotary frequencies a 64-dim DeepSeek key can keep
(benchmarks/rope_stride.py); used by make_report.py. The width table itself is in docs/serving.md
(benchmarks/served_widths.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _head(title: str, data: dict[str, Any]) -> list[str]:
    env = data["environment"]
    return [f"## {title}", "",
            f"Command (latest run; the script's docstring gives the full one): `OMP_NUM_THREADS={env['threads']} "
            f".venv/bin/python {env['command']}`.  ",
            f"Model `{data['model']}` ({data['dtype']}), evaluated on {data['evaluated_on']}; device {env['device']} "
            f"({env.get('cpu', '')}), torch {env['torch']}, transformers {env['transformers']}.", ""]


def bias_drop_section(data: dict[str, Any]) -> list[str]:
    out = _head("Qwen2.5's attention biases: what dropping them costs (why no Qwen model serves as stock "
                "DeepSeek-V3 in vLLM, which loads no attention bias)", data)
    out += ["| biases zeroed | perplexity | ×dense | top-1 agreement with dense |", "|---|---|---|---|",
            f"| none (dense) | {data['dense']['ppl']:.2f} | 1.00 | 1.000 |"]
    out += [f"| {name} | {r['ppl']:,.0f} | {r['ppl_ratio']:,.0f} | {r['top1_agreement']:.3f} |"
            for name, r in data["dropped"].items()]
    if "folded" in data:  # each bias folded into its weight by least squares (bias_drop.py's docstring)
        fold = data["fold"]
        out += ["", f"Folded instead (W x + b → (W + b aᵀ) x, aᵀx ≈ 1 fitted on {fold['calibration']}; ρ = μᵀa "
                f"{min(fold['rho']):.4f}–{max(fold['rho']):.4f} over the layers):", "",
                "| biases folded | perplexity | ×dense | top-1 agreement with dense |", "|---|---|---|---|"]
        out += [f"| {name} | {r['ppl']:,.2f} | {r['ppl_ratio']:,.3f} | {r['top1_agreement']:.3f} |"
                for name, r in data["folded"].items()]
        if "ridge_sweep" in fold:  # how the fold's ridge was chosen: residual on other calibration windows
            out += ["", f"Ridge {fold['ridge']:g} here (`--ridge`; `mla` keeps its own, linalg/bias_fold.RIDGE: "
                    "docs/serving.md says why). The residual E[(1 − aᵀx)²] on other calibration windows per ridge "
                    "(mean / max over the layers): " + "; ".join(
                        f"{k}: {v['mean']:.4f} / {v['max']:.4f}" for k, v in fold["ridge_sweep"].items()) + "."]
    return out + [""]


def rope_stride_section(data: dict[str, Any]) -> list[str]:
    out = _head("MLA on 128-dim heads at a served width: which rotary frequencies a 64-dim DeepSeek key keeps", data)
    out += [f"`mla` at KV 0.25 one-shot, calibration {data['calibration']}; dense perplexity "
            f"{data['dense']['ppl']:.2f}. `free` keeps 32 rotary pairs wherever the fit chooses (not servable: "
            "DeepSeek's key rotates at fixed frequencies); `rope_fastest=32` the 32 fastest (exported with "
            "rope_theta √θ), `rope_stride=2` every other frequency.", "",
            "| rotary frequencies | perplexity | ×dense | top-1 agreement | compress s |", "|---|---|---|---|---|"]
    return out + _variant_rows(data) + [""]


def bias_fold_section(data: dict[str, Any]) -> list[str]:
    first = next(iter(data["variants"].values()))
    kv, steps, layers = first["args"]["kv_ratio"], first["args"].get("local_steps", 0), first.get("layers", "all")
    where = "every layer" if layers == "all" else f"layers {', '.join(map(str, layers))} (the rest dense)"
    fit = f"after {steps} local-fit steps per layer" if steps else "one-shot"
    out = _head("Qwen2.5's biases folded: the 1.5B MLA model in the bias-free DeepSeek-V3 layout vLLM loads"
                + (f" ({where}, {fit})" if steps or layers != "all" else ""), data)
    out += [f"`mla` at KV {kv:g} on {where}, {fit}, with the 32 fastest rotary frequencies (the servable 64-dim key), "
            f"calibration {data['calibration']}; dense perplexity {data['dense']['ppl']:.2f}. `rope_fastest=32`: the "
            "free layout (every bias exact, mean correction); `uncentred`: the same without the mean correction; "
            "`deepseek+fold`: layout deepseek with `biases: fold`, the form that exports (its cost beside "
            "`uncentred` is the fold's own)" + ("; `deepseek+fold@R` the same with the fold's ridge at R "
                                               "(`fold_ridge`; default 1e-6)" if any(
                                                   k.startswith("deepseek+fold@") for k in data["variants"]) else "")
            + ".", "",
            "| variant | perplexity | ×dense | top-1 agreement | compress s |", "|---|---|---|---|---|"]
    return out + _variant_rows(data) + [""]


def _variant_rows(data: dict[str, Any]) -> list[str]:
    return [f"| {name} | {r['ppl']:.1f} | {r['ppl_ratio_to_dense']:.2f} | {r['top1_agreement']:.3f} | "
            f"{r['compress_seconds']:.0f} |" for name, r in data["variants"].items()]


WIDTH_SPECIAL: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "bias-drop-qwen2.5-1.5b": bias_drop_section, "rope-stride-qwen2.5-1.5b": rope_stride_section,
    "rope-stride-kv0.625-qwen2.5-1.5b": bias_fold_section, "bias-fold-local-qwen2.5-1.5b": bias_fold_section}

"""LatentLLM measurements of issue 4 on smollm2-135m (--model: another packaged model), every variant in the same
harness (benchmarks/common.py).

Groups (--groups, comma-separated; default all):
  attn       attention-only (q, k, v, o) at 80% and 50% kept attention parameters: svd, asvd, svdllm, local
             root-covariance with dense factors and with block identity, LatentLLM (joint QK + separate V/O)
             with the paper's uniform ranks and with the default spectrum allocation, joint V/O (Remark 11)
             with either allocation, RoPE-aware joint QK (8-offset window), joint QKV (App. C) with either
             allocation and split-head q/k (App. D) with uniform ranks
  precond    joint QK (+ V/O) with each pre-conditioner of Table 1, at 80%, uniform ranks; diagonal l2 with the
             spectrum allocation at 80% and 50%
  whole      attention + MLP at 90/80/70% of all parameters: LatentLLM (joint UD), local MLP, SVD-LLM; and
             LatentLLM with every attention/MLP linear at 90/80/70% of its weights (the paper's convention)
  kv         KV bytes/token against perplexity: LatentLLM at more ratios, and kv_ratio sweeps (q, o full rank)
  speed      decode tokens/s and prefill time against dense at 512 and 2048 tokens (attnslim.bench.interleaved)
  head       LatentLLM at 80% with the LM head factored too (recipe `head:`, untied: SmolLM2 ties it) at 80% of its
             weights, root-covariance and, as the baseline, the identity pre-conditioner; beside latentllm-80.
             Not in the default run: --groups head --name latentllm-head
  heal       whole-model LatentLLM at 80% (also with the KV cache at 50%) and the KV-only 50% variant, followed
             by the recipe's `heal` section (train/heal.py: logit distillation against the dense model,
             --heal-steps x 4 x 256 tokens of wiki+c4): not in the default run

    .venv/bin/python benchmarks/latentllm.py                         # the full run (hours on a 2-core CPU)
    .venv/bin/python benchmarks/latentllm.py --groups whole --only latentllm-total-80   # alone: honest peak RSS
    .venv/bin/python benchmarks/latentllm.py --name latentllm-small --tokens 2048 --windows 16 --groups attn
    .venv/bin/python benchmarks/latentllm.py --name latentllm-ablations --groups attn --only "\
        latentllm-uniform-80,latentllm-jointqkv-uniform-80,local-rootcov-blockid-80,local-splithead-uniform-80,\
        latentllm-80,latentllm-jointqkv-80"
    .venv/bin/python benchmarks/latentllm.py --model gemma3-270m --name latentllm-gemma3 --sources wiki \
        --groups attn,precond,kv --only "svdllm-attn-80,local-rootcov-dense-80,local-rootcov-blockid-80,latentllm-80,\
        local-rootcov-blockid-spectrum-80,latentllm-vojoint-80,latentllm-jointqkv-80,local-splithead-uniform-80,\
        latentllm-l2-80,latentllm-90,svdllm-attn-50,latentllm-50"   # Gemma-3 cells (uniform joint QK: refused)
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/latentllm.py --model qwen2.5-1.5b --name latentllm-qwen2.5-1.5b \
        --sources wiki --tokens 4096 --windows 8 --groups attn,precond,kv --only "latentllm-80,svdllm-attn-80,\
        local-rootcov-blockid-spectrum-80,latentllm-jointqkv-80,latentllm-vojoint-80,latentllm-l2-80,latentllm-90,\
        latentllm-uniform-80,local-rootcov-dense-80,local-rootcov-blockid-80,local-splithead-uniform-80,\
        latentllm-rope8-80"   # the 1.5B cells (`make qwen15`; 4-8 min a row on 2 cores)
    .venv/bin/python benchmarks/make_report.py                       # regenerates BENCHMARKS.md

Peak RSS is the process maximum (ru_maxrss): only a variant run alone in its process gives its own number.
"""

from __future__ import annotations

import argparse
import time
import warnings
from typing import Any

from common import Harness, calibration, selected
from torch import nn

from attnslim.adapters import get_adapter
from attnslim.api import compress
from attnslim.bench import interleaved
from attnslim.methods.latentllm_ranks import ATTENTION, MLP, kappa_for_total
from attnslim.models import load_model
from attnslim.recipe import recipe_from_dict

ALL_LINEARS = [*ATTENTION, *MLP]
PRECONDS = ("identity", "hessian", "l1", "l2", "cov", "rootcov")


def step(method: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"method": method, "layers": "all", "args": args}


def attention_variants(ratio: float) -> dict[str, list[dict[str, Any]]]:
    p = int(round(ratio * 100))
    qkvo = ["q", "k", "v", "o"]
    uni = {"ratio": ratio, "alloc": "uniform"}  # the notes' per-matrix rule (the paper's)
    out = {f"{m}-attn-{p}": [step(m, {"ratio": ratio, "linears": qkvo})] for m in ("svd", "asvd", "svdllm")}
    out |= {
        f"local-rootcov-dense-{p}": [step("latentllm", {**uni, "qk": "split", "junction": "left"})],
        f"local-rootcov-blockid-{p}": [step("latentllm", {**uni, "qk": "split"})],
        f"latentllm-uniform-{p}": [step("latentllm", uni)],
        f"latentllm-vojoint-uniform-{p}": [step("latentllm", {**uni, "vo": "joint"})],
        f"local-rootcov-blockid-spectrum-{p}": [step("latentllm", {"ratio": ratio, "qk": "split"})],
        f"latentllm-{p}": [step("latentllm", {"ratio": ratio})],  # defaults: joint QK, alloc spectrum
        f"latentllm-vojoint-{p}": [step("latentllm", {"ratio": ratio, "vo": "joint"})],
        f"latentllm-rope8-{p}": [step("latentllm", {"ratio": ratio, "rope_window": 8})],
        # the paper's ablations beside joint QK (App. C, D): one shared A for q/k/v (o local; dense KV cache), and
        # per-head SVDs of q and k (block-diagonal B; v and o local as in local-rootcov-blockid)
        f"latentllm-jointqkv-uniform-{p}": [step("latentllm", {**uni, "qk": "joint_qkv", "cache": "dense"})],
        f"latentllm-jointqkv-{p}": [step("latentllm", {"ratio": ratio, "qk": "joint_qkv", "cache": "dense"})],
        f"local-splithead-uniform-{p}": [step("latentllm", {**uni, "qk": "split_head"})],
    }
    return out


def precond_variants() -> dict[str, list[dict[str, Any]]]:
    """Table 1 ablation with the paper's uniform ranks, so only the pre-conditioner changes."""
    out = {f"jointqk-{pc}-uniform-80": [step("latentllm", {"ratio": 0.8, "alloc": "uniform", "precond": pc})]
           for pc in PRECONDS}
    # diagonal l2 beat root-covariance at uniform ranks (8192 tokens: 1.11x against 1.25x): the same with the
    # default spectrum allocation, at 80% and 50%
    out |= {f"latentllm-l2-{p}": [step("latentllm", {"ratio": p / 100, "precond": "l2"})] for p in (80, 50)}
    return out


def whole_variants(shapes: dict[str, tuple[int, int]], n_layers: int, total: int) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for ratio in (0.9, 0.8, 0.7):
        p = int(round(ratio * 100))
        out[f"latentllm-total-{p}"] = [step("latentllm", {"ratio": None, "total_ratio": ratio, "mlp": "joint_ud"})]
        # the paper's convention: every attention and MLP linear keeps `ratio` of its weights (embeddings,
        # 21% of SmolLM2's parameters, are not counted), so total parameters stay above `ratio`
        out[f"latentllm-linears-{p}"] = [step("latentllm", {"ratio": ratio, "mlp": "joint_ud"})]
        out[f"latentllm-global-total-{p}"] = [step("latentllm", {"ratio": None, "total_ratio": ratio,
                                                                "mlp": "joint_ud", "alloc": "global"})]
        out[f"latentllm-total-{p}-kv50"] = [step("latentllm", {"ratio": None, "total_ratio": ratio,
                                                               "mlp": "joint_ud", "kv_ratio": 0.5})]
        out[f"latentllm-localmlp-total-{p}"] = [step("latentllm", {"ratio": None, "total_ratio": ratio,
                                                                   "mlp": "local"})]
        # joint UD against local at the paper's convention: on Gemma-3 the embeddings are 63% of the parameters,
        # so a total ratio cuts the linears far deeper than the paper's tables do
        out[f"latentllm-localmlp-linears-{p}"] = [step("latentllm", {"ratio": ratio, "mlp": "local"})]
        kappa = kappa_for_total([shapes] * n_layers, total, ratio, "left")  # the same total with dense factors
        out[f"svdllm-total-{p}"] = [step("svdllm", {"ratio": round(kappa, 6), "linears": ALL_LINEARS})]
    return out


HEAL = {"steps": 200, "batch_size": 4, "seq_len": 256, "lr": 1e-4, "source": "wiki+c4"}  # recipe `heal` section


def heal_variants(compressed: dict[str, list[dict[str, Any]]], steps: int
                  ) -> dict[str, tuple[list[dict[str, Any]], dict[str, Any]]]:
    """Variants followed by healing (train/heal.py): what a short distillation buys back."""
    keys = ("latentllm-total-80", "latentllm-linears-80", "latentllm-total-80-kv50", "latentllm-kvonly-50")
    return {f"{key}-heal{steps}": (compressed[key], {**HEAL, "steps": steps}) for key in keys}


def head_variants() -> dict[str, tuple[list[dict[str, Any]], dict[str, Any]]]:
    """latentllm-80 with the LM head factored at 80% (methods/head.py), each with its recipe `head:` section."""
    steps = [step("latentllm", {"ratio": 0.8})]
    return {"latentllm-80-head80": (steps, {"ratio": 0.8, "untie": True}),
            "latentllm-80-head80-identity": (steps, {"ratio": 0.8, "untie": True, "args": {"precond": "identity"}})}


def kv_variants() -> dict[str, list[dict[str, Any]]]:
    out = {f"latentllm-{int(r * 100)}": [step("latentllm", {"ratio": r})] for r in (0.9, 0.7, 0.6)}
    for kv in (0.75, 0.6, 0.5, 0.4):  # q and o at full rank: only the cached projections are cut
        out[f"latentllm-kvonly-{int(kv * 100)}"] = [step("latentllm", {"ratio": 1.0, "kv_ratio": kv})]
    out["latentllm-80-kv50"] = [step("latentllm", {"ratio": 0.8, "kv_ratio": 0.5})]
    return out


def model_shapes(model_name: str) -> tuple[dict[str, tuple[int, int]], int, int]:
    model, _ = load_model(model_name)
    adapter = get_adapter(model)
    shapes = {n: _out_in(adapter.linear(0, n)) for n in ALL_LINEARS}
    return shapes, adapter.num_layers(), adapter.param_groups()["total"]


def _out_in(linear: nn.Module) -> tuple[int, int]:
    """(d_out, d_in) of an nn.Linear."""
    assert isinstance(linear, nn.Linear)
    return linear.out_features, linear.in_features


def speed(h: Harness, keys: list[str], recipes: dict[str, dict[str, Any]], contexts: list[int],
          new_tokens: int, repeats: int) -> None:
    """Decode tokens/s and prefill time of dense and each variant, interleaved in one run (ratios to dense)."""
    models: dict[str, Any] = {}
    dense, tokenizer = load_model(h.model_name)
    models["dense"] = dense.eval()
    for key in keys:
        model, _ = load_model(h.model_name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compress(model, tokenizer, recipe_from_dict(recipes[key]), progress=False)
        models[key] = model.eval()
    result = interleaved(models, contexts, new_tokens=new_tokens, repeats=repeats)
    h.data["speed"] = result
    h.save()
    lines = ["Decode speed (greedy, HF DynamicCache, float32; medians of interleaved repetitions, ratio to dense):", "",
             "| model | " + " | ".join(f"decode tok/s @{c} (×dense) | prefill ms @{c}" for c in contexts) + " |",
             "|---|" + "---|---|" * len(contexts)]
    for name, rows in result["models"].items():
        cells = " | ".join(f"{rows[str(c)]['decode_tok_s']:.1f} ({rows[str(c)]['decode_ratio']:.2f}×) | "
                           f"{rows[str(c)]['prefill_s'] * 1000:.0f}" for c in contexts)
        lines.append(f"| {name} | {cells} |")
    h.data["notes"] = lines
    h.save()
    print("\n".join(lines), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", default="latentllm", help="results file benchmarks/results/NAME.json")
    parser.add_argument("--model", default="smollm2-135m", help="a packaged model name (gemma3-270m: `make gemma`)")
    parser.add_argument("--tokens", type=int, default=8192, help="evaluation tokens per source")
    parser.add_argument("--sources", default="wiki,ptb,c4")
    parser.add_argument("--windows", type=int, default=32, help="calibration windows")
    parser.add_argument("--seq-len", type=int, default=512, help="calibration window length")
    parser.add_argument("--groups", default="attn,precond,whole,kv,speed")
    parser.add_argument("--only", default="", help="comma-separated variant keys to run")
    parser.add_argument("--heal-steps", type=int, default=HEAL["steps"], help="steps of the heal group's variants")
    parser.add_argument("--contexts", default="512,2048")
    parser.add_argument("--speed-variants",
                        default="latentllm-80,latentllm-values-80,latentllm-densecache-80,svdllm-attn-80")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    h = Harness(args.name, model=args.model, tokens=args.tokens, sources=tuple(args.sources.split(",")))
    cal = calibration(args.windows, args.seq_len)
    groups = set(args.groups.split(","))
    variants: dict[str, list[dict[str, Any]]] = {}
    if "attn" in groups:
        variants |= attention_variants(0.8) | attention_variants(0.5)
    if "precond" in groups:
        variants |= precond_variants()
    if "whole" in groups:
        variants |= whole_variants(*model_shapes(h.model_name))
    if "kv" in groups:
        variants |= kv_variants()
    heals: dict[str, dict[str, Any]] = {}
    if "heal" in groups:
        compressed = whole_variants(*model_shapes(h.model_name)) | kv_variants()
        for key, (steps, heal) in heal_variants(compressed, args.heal_steps).items():
            variants[key], heals[key] = steps, heal
    heads: dict[str, dict[str, Any]] = {}
    if "head" in groups:
        variants["latentllm-80"] = [step("latentllm", {"ratio": 0.8})]  # the same run without the head
        for key, (steps, head) in head_variants().items():
            variants[key], heads[key] = steps, head
    recipes = {k: {"name": k, "calibration": cal, "steps": s, **({"heal": heals[k]} if k in heals else {}),
                   **({"head": heads[k]} if k in heads else {})} for k, s in variants.items()}
    recipes["latentllm-80"] = {"name": "latentllm-80", "calibration": cal, "steps": [step("latentllm", {"ratio": 0.8})]}
    recipes["latentllm-densecache-80"] = {"name": "latentllm-densecache-80", "calibration": cal,
                                          "steps": [step("latentllm", {"ratio": 0.8, "cache": "dense"})]}
    recipes["latentllm-values-80"] = {"name": "latentllm-values-80", "calibration": cal,
                                      "steps": [step("latentllm", {"ratio": 0.8, "cache": "values"})]}
    recipes["svdllm-attn-80"] = {"name": "svdllm-attn-80", "calibration": cal,
                                 "steps": [step("svdllm", {"ratio": 0.8, "linears": ["q", "k", "v", "o"]})]}
    only = selected(args.only, variants, args.groups)
    h.dense()
    for key in (k for k in variants if k in only):
        start = time.time()
        h.run(key, recipes[key])
        print(f"  {key}: {time.time() - start:.0f} s", flush=True)
    if "speed" in groups:
        contexts = [int(c) for c in args.contexts.split(",")]
        speed(h, args.speed_variants.split(","), recipes, contexts, args.new_tokens, args.repeats)


if __name__ == "__main__":
    main()

"""Issue 20: multi-head latent attention with decoupled RoPE (`mla`) beside TransMLA (`transmla`) on smollm2-135m.

Groups (--groups, comma-separated; default oneshot,speed):
  oneshot  at every KV point (--kv, default 0.5,0.375,0.25 of the dense cache, measured from the cache): `mla`
           (query-weighted rotary choice, attention-weighted latent: the defaults) and `transmla` (RoRoPE +
           FreqFold 4 + BKV-PCA) at the same cached elements per token; at 0.5 also `mla` with kv_weight=rootcov,
           with alloc=global, with TransMLA's RoRoPE choice (rope_select=pca), a plain truncated SVD of
           [k_nope; v] (kv_weight=svd), today's latent cache (latentllm q/o dense, kv_ratio 0.5, exact RoPE) and
           `mla` in DeepSeek-V3's layout (layout=deepseek, recipes/mla-deepseek.yaml: what `attnslim export` takes)
  heal     `mla` and `transmla` at every KV point followed by the standard 40-step heal (recipes/default.yaml's);
           at 0.5 and 0.25 also `mla` healed with larger learning rates, with every parameter trained,
           and with the hidden-state term (heal.hidden; at 0.25 also on
           three more draws of the heal's data, with and without it; recipes/mla.yaml's heal at 0.5 on two more)
  speed    decode tok/s and prefill ms against dense at --contexts (512,2048,4096), interleaved medians, with the
           attention-core FLOPs per new token and the KV bytes per token of each model beside them (--kernels:
           each mla variant also with the grouped decode core, as KEY-grouped, against the split one;
           --cpu-linear onednn: every model's float32 linear layers on oneDNN, dense included)
  recount  the stored speed run's FLOPs and MB read counted again by today's attnslim.bench.flops, without timing
           (for a results file whose counts predate a fix of the counting; give the speed run's --kv)

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mla.py                                  # 8192 tokens per set
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mla.py --name mla-small --tokens 2048 --windows 16 --kv 0.5
    .venv/bin/python benchmarks/make_report.py                                            # BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings
from typing import Any

from common import Harness, calibration, selected

from attnslim._compat import CACHE_KINDS
from attnslim.api import compress
from attnslim.bench import interleaved, kv_bytes_per_token
from attnslim.bench.flops import decode_bytes_per_token, flops_per_token
from attnslim.methods.mla_base import default_rope_dims
from attnslim.models import load_model
from attnslim.modules.cpu_linear import KERNELS as CPU_LINEAR_KERNELS
from attnslim.modules.cpu_linear import set_cpu_linear
from attnslim.modules.mla import MLAAttention
from attnslim.recipe import recipe_from_dict

HEAL: dict[str, Any] = {"steps": 40, "batch_size": 4, "seq_len": 256, "lr": 1.0e-4,
                        "source": "wiki+c4+tiny"}  # default.yaml's
HEAL_ABLATIONS: dict[str, dict[str, Any]] = {"lr3e-4": {"lr": 3.0e-4}, "lr1e-3": {"lr": 1.0e-3},
                  **{f"all-lr{lr}": {"lr": float(lr), "params": "all"} for lr in ("2e-4", "3e-4", "5e-4", "1e-3")},
                  # the hidden-state term (train/heal.py) beside the logit KL
                  **{f"all-lr3e-4-hidden{w}": {"lr": 3.0e-4, "params": "all", "hidden": float(w)}
                     for w in ("1", "10", "30")},
                  # other draws of the heal's data (seeds 1-3): how much of a difference is the draw
                  **{f"all-lr3e-4{tag}-seed{seed}": {"lr": 3.0e-4, "params": "all", "hidden": w, "seed": seed}
                     for tag, w in (("", 0.0), ("-hidden10", 10.0)) for seed in (1, 2, 3)},
                  "lr3e-4-hidden10": {"lr": 3.0e-4, "hidden": 10.0},
                  **{f"lr3e-4-seed{seed}": {"lr": 3.0e-4, "seed": seed} for seed in (1, 2)}}  # recipes/mla.yaml's


# mla's local fit in the rows that use it (pipeline/local_fit.py)
LOCAL = {"local_steps": 96, "local_lr": 3.0e-3}


def step(method: str, args: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"method": method, "layers": "all", "args": args}]


def legacy(kv: float) -> dict[str, Any]:
    """`mla`'s first default split (no FreqFold, d_rope = E²/1.5D: 64 / 36 / 16 at KV 0.5 / 0.375 / 0.25 on
    SmolLM2's 3 KV heads x 64 rotary dims; recipes/mla.yaml's at 0.5), pinned in the rows measured with it."""
    return {"kv_ratio": kv, "rope_fold": 1, "rope_dims": default_rope_dims(64, int(kv * 384), 384)}


def oneshot_variants(kv: float, ablate: bool, fold_rope_dims: tuple[int, ...] = ()) -> dict[str, list[dict[str, Any]]]:
    p = f"{kv * 100:g}".replace(".", "")
    old = legacy(kv)
    out = {f"mla-kv{p}": step("mla", {"kv_ratio": kv}), f"transmla-kv{p}": step("transmla", {"kv_ratio": kv}),
           f"mla-legacy-kv{p}": step("mla", old),  # the first default, beside today's
           f"mla-refit-kv{p}": step("mla", {"kv_ratio": kv, "refit_o": True}),  # o_proj refitted (pipeline/refit.py)
           # then every parameter of the layer trained towards the dense attention's output (pipeline/local_fit.py)
           f"mla-refit-local-kv{p}": step("mla", {"kv_ratio": kv, "refit_o": True, **LOCAL})}
    if ablate:  # the ablations (default: at KV 0.5 only, --ablations-at), on the legacy split unless they vary it
        out |= {
            f"mla-rootcov-kv{p}": step("mla", {**old, "kv_weight": "rootcov"}),
            f"mla-uncentred-kv{p}": step("mla", {**old, "center": False}),
            f"mla-global-kv{p}": step("mla", {**old, "alloc": "global"}),
            f"mla-global-fold-kv{p}": step("mla", {"kv_ratio": kv, "alloc": "global"}),  # on today's split
            f"mla-global-fold-refit-kv{p}": step("mla", {"kv_ratio": kv, "alloc": "global", "refit_o": True}),
            f"mla-global-fold-refit-local-kv{p}": step("mla", {"kv_ratio": kv, "alloc": "global", "refit_o": True,
                                                               **LOCAL}),
            f"mla-rorope-kv{p}": step("mla", {**old, "rope_select": "pca"}),
            # FreqFold (4 neighbouring frequencies share one change of basis) under either rotary choice
            f"mla-fold4-kv{p}": step("mla", {**old, "rope_fold": 4}),
            f"mla-rorope-fold4-kv{p}": step("mla", {**old, "rope_select": "pca", "rope_fold": 4}),
            f"mla-rootcov-fold4-kv{p}": step("mla", {**old, "kv_weight": "rootcov", "rope_fold": 4}),
            f"mla-fold2-kv{p}": step("mla", {**old, "rope_fold": 2}),
            f"mla-fold8-kv{p}": step("mla", {**old, "rope_fold": 8}),
            f"mla-spread-kv{p}": step("mla", {**old, "rope_spread": True}),
            **{f"mla-fold4-rope{d}-kv{p}": step("mla", {"kv_ratio": kv, "rope_fold": 4, "rope_dims": d})
               for d in fold_rope_dims},  # a rope_dims sweep under FreqFold (--fold-rope-dims)
            f"mla-plainsvd-kv{p}": step("mla", {**old, "kv_weight": "svd"}),
            f"latentllm-kvonly-kv{p}": step("latentllm", {"ratio": 1.0, "kv_ratio": kv}),
            # DeepSeek-V3's layout (exportable): one rotary pair per frequency, no mean correction (no o bias)
            f"mla-deepseek-kv{p}": step("mla", {"kv_ratio": kv, "rope_dims": 64, "layout": "deepseek"}),
        }
    return out


def speed_models(h: Harness, recipes: dict[str, dict[str, Any]], keys: list[str], kernels: bool = False,
                 cpu_linear: str = "torch") -> dict[str, Any]:
    """Dense and each variant of `keys`, compressed (kernels: each mla variant also as KEY-grouped, a copy whose
    decode core never splits the cache; cpu_linear: every model's linear layers on that kernel, dense included)."""
    dense, tokenizer = load_model(h.model_name)
    models: dict[str, Any] = {"dense": dense.eval()}
    for key in keys:
        model, _ = load_model(h.model_name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compress(model, tokenizer, recipe_from_dict(recipes[key]), progress=False)
        models[key] = model.eval()
        if kernels and any(isinstance(m, MLAAttention) for m in model.modules()):
            models[f"{key}-grouped"] = copy.deepcopy(model)
            for m in models[f"{key}-grouped"].modules():
                if isinstance(m, MLAAttention):
                    m.decode_kernel = "grouped"
    for model in models.values():
        set_cpu_linear(model, cpu_linear)
    return models


def costs_of(models: dict[str, Any], contexts: list[int]) -> dict[str, dict[str, Any]]:
    """Per model: KV bytes per token, and per context the FLOPs and bytes read per new token (attnslim.bench.flops)."""
    costs: dict[str, dict[str, Any]] = {}
    for name, m in models.items():
        kv = kv_bytes_per_token(m)
        costs[name] = {"kv_bytes_per_token": kv["total"], **{
            str(c): {**flops_per_token(m, c), "bytes_read": decode_bytes_per_token(m, c, kv["per_layer"])}
            for c in contexts}}
    return costs


def speed(h: Harness, recipes: dict[str, dict[str, Any]], keys: list[str], contexts: list[int], new_tokens: int,
          repeats: int, cache_kind: str, kernels: bool = False, cpu_linear: str = "torch") -> None:
    """Interleaved decode/prefill medians of dense and each variant, with FLOPs and KV bytes beside them."""
    models = speed_models(h, recipes, keys, kernels, cpu_linear)
    result = interleaved(models, contexts, new_tokens=new_tokens, repeats=repeats, cache_kind=cache_kind)
    result["cpu_linear"] = cpu_linear
    h.data["speed"], h.data["costs"] = result, costs_of(models, contexts)
    h.data.pop("costs_recounted", None)  # these counts are the run's own
    h.data.pop("comments", None)  # a person's comments were about the previous run
    speed_notes(h)


def recount(h: Harness, recipes: dict[str, dict[str, Any]]) -> None:
    """The stored speed run's FLOPs and bytes counted again by today's attnslim.bench.flops (no timing): for a
    results file whose counts predate a fix of the counting."""
    result = h.data.get("speed")
    if not result:
        raise SystemExit(f"{h.path} holds no speed run to recount; run --groups speed first")
    keys = [n for n in result["models"] if n != "dense" and not n.endswith("-grouped")]
    if missing := [k for k in keys if k not in recipes]:
        raise SystemExit(f"no recipe for {missing} under these arguments: give the speed run's --kv / --suffix")
    kernels = any(n.endswith("-grouped") for n in result["models"])
    models = speed_models(h, recipes, keys, kernels, result.get("cpu_linear", "torch"))
    h.data["costs"] = costs_of(models, result["contexts"])
    h.data["costs_recounted"] = h.data["environment"]["command"]
    h.data["environment"] = h.stored_environment  # the timings' machine, not this run's
    speed_notes(h)


def speed_notes(h: Harness) -> None:
    """The speed table (decode, prefill, FLOPs, bytes) as the results file's notes; saves the file."""
    result, costs = h.data["speed"], h.data["costs"]
    contexts, cache_kind, cpu_linear = result["contexts"], result["cache"], result.get("cpu_linear", "torch")
    cache_name = {"dynamic": "HF DynamicCache: dense concatenates at every step, the latent modules' layers (mla, "
                             "latentllm) append in place (ReservedRowsLayer)",
                  "static": "HF StaticCache",
                  "reserved": "HF DynamicCache with every layer a ReservedRowsLayer, dense included"}[cache_kind]
    linear_name = {"torch": "", "onednn": ", every model's linear layers on oneDNN (--cpu-linear onednn)"}[cpu_linear]
    lines = [f"Decode and prefill against dense (greedy, {cache_name}{linear_name}, float32, medians of interleaved "
             f"repetitions, the lowest and highest repetition's ratio in brackets; per new token: FLOPs of the "
             "attention core / of the whole model, and MB read, weights + KV cache (attnslim.bench.flops)):", "",
             "| model | KV B/token | " + " | ".join(
                 f"decode tok/s @{c} (×dense) | prefill ms @{c} | attn-core MFLOPs @{c} | total MFLOPs @{c} | "
                 f"MB read @{c} (weights + KV)" for c in contexts) + " |",
             "|---|---|" + "---|---|---|---|---|" * len(contexts)]
    for name, rows in result["models"].items():
        cells = []
        for c in contexts:
            row, cost = rows[str(c)], costs[name][str(c)]
            lo, hi = row["decode_ratio_span"]
            read = cost["bytes_read"]
            cells.append(f"{row['decode_tok_s']:.1f} ({row['decode_ratio']:.2f}× [{lo:.2f}–{hi:.2f}]) | "
                         f"{row['prefill_s'] * 1000:.0f} | {cost['attention_core'] / 1e6:.1f} | "
                         f"{cost['total'] / 1e6:.1f} | {read['total'] / 1e6:.1f} ({read['weights'] / 1e6:.1f} + "
                         f"{read['kv'] / 1e6:.1f})")
        lines.append(f"| {name} | {costs[name]['kv_bytes_per_token']:,.0f} | {' | '.join(cells)} |")
    if h.data.get("costs_recounted"):
        lines += ["", f"FLOPs and MB read recounted without timing by `{h.data['costs_recounted']}` (the timings "
                      "are the speed run's)."]
    h.data["notes"] = lines + [""] + h.data.get("comments", [])  # comments: what a person wrote of the run
    h.save()
    print("\n".join(lines), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", default="mla", help="results file benchmarks/results/NAME.json")
    parser.add_argument("--model", default="smollm2-135m", help="a packaged model name (gemma3-270m: `make gemma`)")
    parser.add_argument("--tokens", type=int, default=8192, help="evaluation tokens per source")
    parser.add_argument("--sources", default="wiki,ptb,c4")
    parser.add_argument("--windows", type=int, default=32, help="calibration windows")
    parser.add_argument("--seq-len", type=int, default=512, help="calibration window length")
    parser.add_argument("--kv", default="0.5,0.375,0.25", help="kept fractions of the dense KV cache")
    parser.add_argument("--layers", default="all",
                        help="the layers every variant converts: a recipe selector string (\"0:6\": the real tests')")
    parser.add_argument("--ablations-at", default="0.5", help="KV points that also get the one-shot ablations")
    parser.add_argument("--fold-rope-dims", default="24,48", help="rope_dims tried with rope_fold 4 (ablations)")
    parser.add_argument("--suffix", default="",
                        help="appended to every variant key: runs of other layers or calibration in one results file")
    parser.add_argument("--groups", default="oneshot,speed")
    parser.add_argument("--only", default="", help="comma-separated variant keys to run")
    parser.add_argument("--contexts", default="512,2048,4096")
    parser.add_argument("--speed-variants", default="mla-kv50,latentllm-kvonly-kv50")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", default="dynamic", choices=list(CACHE_KINDS),
                        help="the speed group's KV cache: generate()'s default, cache_implementation='static', or "
                             "a dynamic cache whose every layer appends in place (dense too)")
    parser.add_argument("--kernels", action="store_true",
                        help="speed: also run each mla variant with the grouped decode core (KEY-grouped)")
    parser.add_argument("--cpu-linear", default="torch", choices=list(CPU_LINEAR_KERNELS),
                        help="speed: every model's float32 linear layers on this kernel, dense included "
                             "(modules/cpu_linear.py)")
    args = parser.parse_args()
    h = Harness(args.name, model=args.model, tokens=args.tokens, sources=tuple(args.sources.split(",")))
    cal = calibration(args.windows, args.seq_len)
    groups = set(args.groups.split(","))
    kvs = [float(k) for k in args.kv.split(",")]
    variants: dict[str, list[dict[str, Any]]] = {}
    ablate_at = {float(k) for k in args.ablations_at.split(",") if k}
    for kv in kvs:
        variants |= oneshot_variants(kv, kv in ablate_at, tuple(int(d) for d in args.fold_rope_dims.split(",") if d))
    if args.layers != "all":
        variants = {k: [{**st, "layers": args.layers} for st in s] for k, s in variants.items()}
    variants = {k + args.suffix: s for k, s in variants.items()}
    recipes = {k: {"name": k, "calibration": cal, "steps": s} for k, s in variants.items()}
    heals: dict[str, dict[str, Any]] = {f"{k}-heal40": {**recipes[k], "name": f"{k}-heal40", "heal": HEAL}
             for k in variants if k.startswith(("mla-kv", "mla-legacy-kv", "transmla-kv", "mla-global-fold-kv",
                                                "mla-refit-kv", "mla-global-fold-refit-kv", "mla-refit-local-kv",
                                                "mla-global-fold-refit-local-kv"))}
    # heal ablations: larger steps, every parameter trained (mla-legacy-kv50-heal40-lr3e-4 is recipes/mla.yaml's
    # compression on the previous split; at KV 0.25 transmla gets the best setting of mla too, and so does
    # alloc=global on today's split, which at KV 0.5 also gets recipes/mla.yaml's heal)
    for base in ("mla-kv50", "mla-legacy-kv50", "mla-deepseek-kv50", "mla-kv25", "transmla-kv25",
                 "mla-global-fold-kv25", "mla-global-fold-kv50", "mla-refit-kv50", "mla-refit-kv25",
                 "mla-global-fold-refit-kv25", "mla-refit-local-kv50", "mla-refit-local-kv25",
                 "mla-global-fold-refit-local-kv25"):
        if base in recipes:
            for tag, change in HEAL_ABLATIONS.items():
                heals[f"{base}-heal40-{tag}"] = {**recipes[base], "name": f"{base}-heal40-{tag}",
                                                 "heal": {**HEAL, **change}}
    todo = (set(variants) if "oneshot" in groups else set()) | (set(heals) if "heal" in groups else set())
    only = selected(args.only, [k for k in recipes | heals if k in todo], args.groups)
    h.dense()
    for key, recipe in (recipes | heals).items():
        if key in todo and key in only:
            start = time.time()
            h.run(key, recipe)
            print(f"  {key}: {time.time() - start:.0f} s", flush=True)
    if "recount" in groups:  # --groups recount: the stored speed run's FLOPs and bytes, counted again
        recount(h, recipes)
    if "speed" in groups:
        speed(h, recipes, args.speed_variants.split(","), [int(c) for c in args.contexts.split(",")],
              args.new_tokens, args.repeats, args.cache, args.kernels, args.cpu_linear)


if __name__ == "__main__":
    main()

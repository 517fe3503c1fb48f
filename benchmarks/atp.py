"""ATP measurements of issue 7 on smollm2-135m → benchmarks/results/atp.json (+ BENCHMARKS.md via make_report).
Variants convert every full-attention layer: all of SmolLM2's, and only the global layers of a model with sliding
ones (--model gemma3-270m: 3 of 18; the method refuses sliding-window layers).

Groups (--groups, comma-separated; default all four):
  lowrank   the paper's Fig. 1/5 on the real model: ⌈2^μ⌉/L and the energy kept by the top ⌈f·L⌉ components of
            the embeddings and of every attention layer's input, over --lowrank-n sequences of each length
  serving   continuation perplexity of the serving form: --n sequences of --context + --continuation tokens
            from wiki and c4; the context is compressed at --context (r = f·context, f = 1/2, 1/4, 1/8, exact
            recent --window) and the continuation is scored; against the full cache (dense) and the equal-
            budget baselines (recent window; sink + recent), plus ablations at f = 1/4 (the paper's orthonormal
            principal keys "principal-mix", and principal without the merged mass). KV bytes/token are read
            from a real cache after prefilling one context.
  choice    prompt-level multiple-choice accuracy (eval/choice.py: next-word items, answer read at the last
            position) of the paper's non-causal layer at 1/2, 1/3, 1/4 principal keys, zero-shot and after LoRA
            recovery (train/lora.py: rank 32 on q/k/v, --lora-steps steps, checkpoints in runs/atp_lora/ so an
            interrupted run resumes; --lora-loss: last_token (default), last_kd (KL to the dense model at
            the last position), kd (the same KL at every position), hidden (hidden states of every layer at
            every position) or layer (layer-local distillation));
            dense zero-shot and dense + the same
            LoRA recipe as references; the layer at 1/2 keys on only the last --choice-last layers
            (zero-shot), the trade-off between the two; the same with values scaled by 1/√L ("V/sqrt(L)",
            value_scale=inv_sqrt_len, notes G8), also on the --choice-cheapest K layers whose lone conversion
            costs least (analysis/conversion.py: last-position KL on calibration windows)
  speed     one attention layer (the first converted layer's shapes, batch 1, float32) against sequence length:
            causal SDPA attention vs PrincipalKeyAttention at fixed r = --speed-rank (exact SVD, Alg. 1), and the
            attention core alone (scores + PV over r principal keys vs SDPA over L keys); interleaved medians

    .venv/bin/python benchmarks/atp.py                                   # everything (many hours on a 2-core CPU)
    .venv/bin/python benchmarks/atp.py --groups serving --n 4 --context 256 --continuation 64 --name atp-small
    .venv/bin/python benchmarks/atp.py --model gemma3-270m --name atp-gemma3 --groups lowrank,serving --n 4
    .venv/bin/python benchmarks/atp.py --model qwen2.5-1.5b --name atp-qwen2.5-1.5b --groups lowrank,speed  # 1.5B cells
    .venv/bin/python benchmarks/atp.py --model qwen2.5-1.5b --name atp-qwen2.5-1.5b --groups serving --n 4 \
        --sources wiki
    .venv/bin/python benchmarks/make_report.py
Results are saved after every variant; a rerun skips what its JSON already holds (same settings).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from common import RESULTS, environment

from attnslim import _compat
from attnslim.adapters import get_adapter
from attnslim.adapters.base import AttentionSpec
from attnslim.analysis.conversion import calibration_prompts, cheapest_layers, conversion_costs
from attnslim.analysis.lowrank import format_lowrank, lowrank_report
from attnslim.analysis.progressive import progressive_recovery
from attnslim.data import eval_windows
from attnslim.eval.choice import choice_accuracy, choice_items
from attnslim.linalg.attention import repeat_kv, softmax_attention
from attnslim.methods.atp import Atp
from attnslim.models import load_model
from attnslim.modules.principal import PrincipalKeyAttention
from attnslim.modules.principal_serving import continuation_nll
from attnslim.train.lora import LoraRecipe, recover_with_lora

FRACTIONS = {"1/2": 0.5, "1/4": 0.25, "1/8": 0.125}
PAPER_FRACTIONS = {"1/2": 0.5, "1/3": 1 / 3, "1/4": 0.25}
LOSS_TAGS = {"layer": "layer-match ", "last_kd": "last-position KD ", "kd": "all-position KD ",
             "hidden": "hidden-state "}  # how a "+ LoRA" row names its loss (last_token: untagged)


class Store:
    """The results JSON in make_report's schema (eval/dense/variants/notes) plus raw per-group data."""

    def __init__(self, name: str, args: argparse.Namespace, serving: bool) -> None:
        """`serving`: this run measures the serving group, whose stored rows of another setting it replaces (they
        are not comparable); a run of the other groups keeps them, whatever its serving arguments."""
        self.path = RESULTS / f"{name}.json"
        self.data: dict[str, Any] = json.loads(self.path.read_text()) if self.path.exists() else {}
        setting = {"context": args.context, "continuation": args.continuation, "n": args.n, "window": args.window}
        if serving and self.data.get("setting") != setting:
            self.data.update({"dense": {}, "variants": {}, "setting": setting})
        setting = self.data.setdefault("setting", setting)
        self.data.setdefault("groups", {})
        self.data.update({"model": args.model, "environment": environment(), "eval": {
            "sources": args.sources, "tokens": setting["n"] * (setting["context"] + setting["continuation"]),
            "seq_len": setting["context"] + setting["continuation"],
            "descriptions": self.data.get("eval", {}).get("descriptions", {}),
        }})

    def save(self) -> None:
        self.data["notes"] = notes(self.data)
        RESULTS.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=float))
        tmp.replace(self.path)


def install(model: Any, dense: dict[int, Any], args: dict[str, Any] | None, layers: list[int] | None = None) -> Any:
    """Restore the dense attention modules, then (if args) apply atp with `args` to `layers` (default: all)."""
    adapter = get_adapter(model)
    for i, module in dense.items():
        adapter.replace_attention(i, module)
    if args is not None:
        method = Atp(**args)
        chosen = sorted(dense) if layers is None else layers
        for i, entry in method.plan(adapter, chosen, {}).layers.items():
            method.convert(adapter, i, entry, None)
    return model


def choice_layers(model: Any, tokenizer: Any, dense: dict[int, Any], group: dict[str, Any], args: dict[str, Any],
                  which: tuple[str, int] | None, context: int) -> list[int] | None:
    """The layers a choice variant converts: all (None), the last k, or the k of lowest lone conversion cost
    (analysis/conversion.py on 32 calibration windows; cached in the group per atp arguments)."""
    if which is None:
        return None
    kind, k = which
    if kind == "last":
        return sorted(dense)[-k:]
    key = json.dumps(args, sort_keys=True)
    if key not in group.setdefault("conversion_costs", {}):
        install(model, dense, None)
        prompts = calibration_prompts(tokenizer, "wiki", n=32, context=context)
        group["conversion_costs"][key] = conversion_costs(model, Atp(**args), prompts)
    costs = {int(i): c for i, c in group["conversion_costs"][key].items()}
    return cheapest_layers(costs, k)


# --- serving ----------------------------------------------------------------------------------------------------

def serving_variants(window: int) -> dict[str, dict[str, Any] | None]:
    out: dict[str, dict[str, Any] | None] = {}
    for label, f in FRACTIONS.items():
        for compress in ("principal", "hybrid", "recent", "sink"):
            out[f"{compress} r={label}"] = {"rank": f, "form": "serving", "window": window, "compress": compress}
    out["principal-mix r=1/4"] = {"rank": 0.25, "form": "serving", "window": window, "compress": "principal-mix"}
    out["principal no-mass r=1/4"] = {"rank": 0.25, "form": "serving", "window": window, "mass": False}
    return out


def kv_bytes_per_token(model: Any, ids: torch.Tensor) -> float:
    """Bytes the cache really holds after prefilling one context, per context token."""
    cache = _compat.new_cache(model.config)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    return sum(_compat.cache_bytes_per_layer(cache)) / ids.shape[1]


def run_serving(store: Store, model: Any, tokenizer: Any, dense: dict[int, Any], args: argparse.Namespace) -> None:
    seq = args.context + args.continuation
    windows = {s: eval_windows(s, tokenizer, tokens=args.n * seq, seq_len=seq) for s in args.sources}
    store.data["eval"]["descriptions"] = {
        s: f"{w.description}; ppl of the last {args.continuation} tokens after {args.context} context tokens"
        for s, w in windows.items()
    }
    variants: dict[str, dict[str, Any] | None] = {"dense": None, **serving_variants(args.window)}
    for key, atp_args in variants.items():
        done = store.data["dense"] if key == "dense" else store.data["variants"].get(key)
        if done:
            print(f"[skip] {key}", flush=True)
            continue
        install(model, dense, atp_args)
        start, ppl = time.time(), {}
        for source, w in windows.items():
            total, count = 0.0, 0
            for row in w.ids:
                nll, n = continuation_nll(model, row[None], args.context)
                total, count = total + nll, count + n
            ppl[source] = math.exp(total / count)
        probe = windows[args.sources[0]].ids[:1, : args.context]
        result = {"ppl": ppl, "kv_bytes_per_token": kv_bytes_per_token(model, probe),
                  "seconds": round(time.time() - start, 1),
                  "command": store.data["environment"]["command"]}  # the file's environment names the last run only
        if key == "dense":
            store.data["dense"] = result
        else:
            dense_ppl = store.data["dense"]["ppl"]
            result.update({"args": atp_args, "ppl_ratio": {s: ppl[s] / dense_ppl[s] for s in ppl},
                           "kept": {"attention": 1.0, "total": 1.0}, "compress_seconds": "–"})
            store.data["variants"][key] = result
        store.save()
        print(f"[done] {key}: " + ", ".join(f"{s} {v:.3f}" for s, v in ppl.items()), flush=True)


# --- choice -----------------------------------------------------------------------------------------------------

def run_choice(store: Store, model: Any, tokenizer: Any, dense: dict[int, Any], args: argparse.Namespace) -> None:
    group = store.data["groups"].setdefault("choice", {"results": {}})
    items = choice_items("wiki", tokenizer, n=args.choice_n, context=args.choice_context)
    # --lora-steps 0 runs the zero-shot rows only (the recipe, which needs steps >= 1, is then never used)
    recipe = LoraRecipe(steps=max(1, args.lora_steps), context=args.choice_context, batch_size=args.lora_batch,
                        lr=args.lora_lr, warmup=min(args.lora_warmup, args.lora_steps), loss=args.lora_loss,
                        targets=tuple(f"{t}_proj" for t in args.lora_targets.split(",")))
    teacher = load_model(args.model)[0].to(args.device) if recipe.loss != "last_token" and args.lora_steps else None
    group.update({"items": items.description, "lora_source": "wiki calibration split (first 90% of documents)"})
    group.setdefault("lora", {**vars(recipe), "targets": list(recipe.targets)})  # the budget of "+ LoRA" rows
    Which = tuple[str, int] | None  # converted layers: all (None), ("last", k) or ("cheapest", k)
    variants: dict[str, tuple[dict[str, Any] | None, Which]] = {"dense": (None, None)}
    variants |= {f"atp {label}": ({"rank": f, "form": "paper"}, None) for label, f in PAPER_FRACTIONS.items()}
    variants |= {f"atp 1/2, last {k} layers": ({"rank": 0.5, "form": "paper"}, ("last", k)) for k in args.choice_last}
    for label, f in PAPER_FRACTIONS.items():  # notes G8 ablation: V′ / √L
        scaled = {"rank": f, "form": "paper", "value_scale": "inv_sqrt_len"}
        variants |= {f"atp {label} V/sqrt(L)": (scaled, None)}
        variants |= {f"atp {label} V/sqrt(L), last {k} layers": (scaled, ("last", k)) for k in args.choice_last}
        variants |= {f"atp {label} V/sqrt(L), cheapest {k} layers": (scaled, ("cheapest", k))
                     for k in args.choice_cheapest}
    task = LoraRecipe(steps=max(1, args.task_steps), context=args.choice_context, batch_size=args.lora_batch,
                      lr=args.task_lr, warmup=min(args.lora_warmup, args.task_steps), loss="choice",
                      targets=recipe.targets)
    for key, (atp_args, which) in variants.items():
        for mode in ("zero-shot", "lora", "lora+task"):
            # a LoRA row names its budget (earlier runs: 40 steps at lr 2e-4, warm-up 20, in the group's "lora")
            on = "" if args.lora_targets == "q,k,v" else f" on {args.lora_targets.replace(',', '/')}"
            kind = LOSS_TAGS.get(recipe.loss, "")
            batch = "" if recipe.batch_size == 4 else f", batch {recipe.batch_size}"  # 4: every earlier row
            tag = f"LoRA{on} {kind}{recipe.steps} steps, lr {recipe.lr:g}{batch}"
            no_teacher_target = atp_args is None and recipe.loss != "last_token"  # dense matches itself: no recovery
            steps = {"zero-shot": [], "lora": [] if no_teacher_target else [recipe],
                     "lora+task": ([] if no_teacher_target else [recipe]) + [task]}[mode]
            name = key + "".join(f" + {tag}" if r is recipe else
                                 f" + task fine-tune {task.steps} steps, lr {task.lr:g}" for r in steps)
            wanted = not args.choice_variants or key in args.choice_variants.split(";")
            skip = ((mode == "lora" and (not args.lora_steps or no_teacher_target))
                    or (mode == "lora+task" and not args.task_steps) or (recipe in steps and not args.lora_steps))
            if name in group["results"] or not wanted or skip:
                continue
            layers = choice_layers(model, tokenizer, dense, group, atp_args or {}, which, args.choice_context)
            install(model, dense, atp_args, layers)
            state = {k: v.clone() for k, v in model.state_dict().items()} if steps else None
            logs: list[dict[str, Any]] = []
            work = Path(args.lora_dir) / (key + (f" + {tag}" if recipe in steps else "")).replace(
                " ", "_").replace("/", "-").replace(",", "")
            for r in steps:  # the recovery first (resumed / replayed from its checkpoint), then the task fine-tune
                here = work if r is recipe else work / f"task-{task.steps}-{task.lr:g}"
                model, log = recover_with_lora(model, tokenizer, r, here, stop_after=args.lora_stop_after,
                                               teacher=teacher)
                logs.append(log)
                if log["step"] < r.steps:
                    print(f"[paused] {name} at step {log['step']}/{r.steps}; rerun to continue", flush=True)
                    break
            if logs and logs[-1]["step"] < steps[-1].steps:
                assert state is not None
                model.load_state_dict(state)
                continue
            res = choice_accuracy(model, items)
            log = logs[-1] if logs else {}
            group["results"][name] = {"acc": res.acc, "acc_norm": res.acc_norm, "items": res.items,
                                      "layers": "all" if layers is None else layers,
                                      "lora_seconds": round(sum(lg["seconds"] for lg in logs), 1),
                                      "lora_first_loss": log["losses"][0] if log else None,
                                      "lora_final_loss": log["losses"][-1] if log else None,
                                      "command": store.data["environment"]["command"],
                                      **({"lora_recipe": log["recipe"]} if log else {}),
                                      **({"recovery_recipes": [lg["recipe"] for lg in logs]} if len(logs) > 1 else {})}
            if state is not None:
                model.load_state_dict(state)  # merged LoRA weights out again before the next variant
            store.save()
            print(f"[done] {name}: acc {res.acc:.3f} acc_norm {res.acc_norm:.3f}", flush=True)
    if args.choice_progressive and args.lora_steps:
        run_progressive(store, group, model, tokenizer, dense, args, items, recipe, teacher)


def run_progressive(store: Store, group: dict[str, Any], model: Any, tokenizer: Any, dense: dict[int, Any],
                    args: argparse.Namespace, items: Any, recipe: LoraRecipe, teacher: Any) -> None:
    """The layer at 1/2 keys (V′/√L) converted in stages (analysis/progressive.py), LoRA after each; accuracy
    per stage."""
    counts = args.choice_progressive
    kind = LOSS_TAGS.get(recipe.loss, "")
    name = (f"atp 1/2 V/sqrt(L), progressive {'→'.join(map(str, counts))} + LoRA {kind}{recipe.steps} steps/stage, "
            f"lr {recipe.lr:g}")
    if name in group["results"]:
        return
    if teacher is None:
        raise SystemExit("--choice-progressive needs a teacher loss (--lora-loss kd, last_kd, hidden or layer)")
    install(model, dense, None)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    stages: list[dict[str, Any]] = []

    def evaluate(s: int, log: dict[str, Any]) -> None:
        res = choice_accuracy(model, items)
        stages.append({"layers": log["layers"], "new_layers": log["new_layers"], "acc": res.acc, "items": res.items,
                       "acc_norm": res.acc_norm, "lora_seconds": round(log["lora"]["seconds"], 1),
                       "lora_first_loss": log["lora"]["losses"][0], "lora_final_loss": log["lora"]["losses"][-1]})
        print(f"[stage {s}] {len(log['layers'])} layers {log['layers']}: acc {res.acc:.3f}", flush=True)

    work = Path(args.lora_dir) / name.replace(" ", "_").replace("/", "-").replace(",", "").replace("→", "-")
    args_atp: dict[str, Any] = {"rank": 0.5, "form": "paper", "value_scale": "inv_sqrt_len"}
    progressive_recovery(model, tokenizer, Atp(**args_atp), counts, recipe, teacher, work, after_stage=evaluate)
    last = stages[-1]
    group["results"][name] = {"acc": last["acc"], "acc_norm": last["acc_norm"], "items": last["items"],
                              "layers": "all" if len(last["layers"]) == len(dense) else last["layers"],
                              "lora_seconds": round(sum(st["lora_seconds"] for st in stages), 1),
                              "lora_final_loss": last["lora_final_loss"], "stages": stages,
                              "command": store.data["environment"]["command"], "lora_recipe": vars(recipe) | {
                                  "targets": list(recipe.targets)}}
    install(model, dense, None)
    model.load_state_dict(state)
    store.save()
    print(f"[done] {name}: acc {last['acc']:.3f}", flush=True)


# --- speed -------------------------------------------------------------------------------------------------------

def standard_attention(module: PrincipalKeyAttention, x: torch.Tensor, cos_sin: Any) -> torch.Tensor:
    """The same layer as dense causal attention (projections, RoPE, SDPA over L keys, o_proj)."""
    q, k = module.qk_post(module.heads(module.q_proj(x)), module.heads(module.k_proj(x)), cos_sin)
    assert q is not None and k is not None
    v, groups = module.heads(module.v_proj(x)), module.n_heads // module.n_kv_heads
    out = torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups),
                                                           is_causal=True, scale=module.scaling)
    return module.merge(out)


def time_length(layers: dict[str, PrincipalKeyAttention], rotary: Any, spec: AttentionSpec, length: int,
                args: argparse.Namespace) -> dict[str, float]:
    """Median seconds of each variant at one sequence length, timed interleaved after warm-up."""
    ref, r = layers["exact"], args.speed_rank
    hd, groups = ref.head_dim, ref.n_heads // ref.n_kv_heads
    gen = torch.Generator().manual_seed(length)
    x = torch.randn(1, length, spec.hidden_size, generator=gen)
    layer_type = None if spec.rope is None else spec.rope.layer_type
    cos_sin = _compat.rotary_cos_sin(rotary, x, torch.arange(length)[None], layer_type)
    q = torch.randn(1, ref.n_heads, length, hd, generator=gen)
    kv = repeat_kv(torch.randn(1, ref.n_kv_heads, length, hd, generator=gen), groups)
    kp, keep = kv[:, :, :r], torch.ones(1, 1, 1, r, dtype=torch.bool)
    fns = {
        "standard layer (SDPA, causal)": lambda: standard_attention(ref, x, cos_sin),
        f"principal layer r={r} (exact SVD)": lambda: layers["exact"](x, cos_sin)[0],
        f"principal layer r={r} (Alg. 1)": lambda: layers["approx"](x, cos_sin)[0],
        "standard core (SDPA over L keys)": lambda: torch.nn.functional.scaled_dot_product_attention(
            q, kv, kv, is_causal=True, scale=ref.scaling),
        f"principal core (over r={r} keys)": lambda: softmax_attention(q, kp, kp, keep, ref.scaling),
    }
    samples: dict[str, list[float]] = {k: [] for k in fns}
    with torch.no_grad():
        for rep in range(args.speed_warmup + args.speed_repeats):
            for key, fn in fns.items():
                start = time.perf_counter()
                fn()
                if rep >= args.speed_warmup:
                    samples[key].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in samples.items()}


def run_speed(store: Store, model: Any, layer: int, args: argparse.Namespace) -> None:
    """One attention layer at the shapes of decoder layer `layer` (the first one ATP converts) against length."""
    adapter = get_adapter(model)
    spec = adapter.attention_spec(layer)
    layers = {svd: PrincipalKeyAttention(spec, args.speed_rank, svd) for svd in ("exact", "approx")}  # type: ignore[arg-type]
    rows: dict[str, dict[str, float]] = {}
    for length in args.lengths:
        rows[str(length)] = time_length(layers, adapter.rotary_embedding(), spec, length, args)
        print(f"[speed] L={length}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in rows[str(length)].items()),
              flush=True)
    store.data["groups"]["speed"] = {"rank": args.speed_rank, "repeats": args.speed_repeats, "layer": layer,
                                     "threads": torch.get_num_threads(), "seconds": rows}
    store.save()


# --- report -------------------------------------------------------------------------------------------------------

def notes(data: dict[str, Any]) -> list[str]:
    """Markdown for the groups make_report's perplexity table does not cover."""
    out: list[str] = []
    setting = data.get("setting", {})
    if data.get("variants"):
        out += [f"Serving form: r = fraction × {setting.get('context')}-token context, exact window "
                f"{setting.get('window')}, 4 sink tokens (principal, sink); KV B/token = bytes held after prefilling "
                "one context ÷ context length (dense 1.0×). The perplexity is of the continuation only.", ""]
    groups = data.get("groups", {})
    if "lowrank" in groups:
        out += ["### Low-rankness of layer inputs (paper Fig. 1/5)", "", *groups["lowrank"]["table"].splitlines(), ""]
    if "choice" in groups:
        ch = groups["choice"]
        out += ["### Prompt-level multiple choice, paper layer (non-causal)", "", f"Items: {ch['items']}.  ",
                f"LoRA: rank {ch['lora']['rank']} on q/k/v (rows \"LoRA on q/k/v/o\": also o), batch "
                f"{ch['lora']['batch_size']}, on {ch['lora_source']}; "
                f"rows \"+ LoRA\": {ch['lora']['steps']} steps, lr {ch['lora']['lr']}, warm-up {ch['lora']['warmup']}; "
                "rows \"+ LoRA N steps, lr X[, batch B]\" name their budget (warm-up in the JSON's lora_recipe); "
                "\"layer-match\" "
                "rows train with the layer-local loss (every converted layer's output matched to the dense layer's on "
                "the dense input, train/layer_match.py; final loss = mean relative squared error), \"last-position "
                "KD\" rows with KL(dense ‖ model) of the next-token distributions at the last position, \"all-"
                "position KD\" with that KL at every position, \"hidden-state\" with every layer's hidden states "
                "matched at every position on the converted upstream, the others with next-token cross-entropy at "
                "the last position. \"V/sqrt(L)\": values scaled by 1/√L (notes G8). \"cheapest k layers\": the k "
                "layers whose lone conversion costs least (analysis/conversion.py, last-position KL on 32 "
                "calibration windows; `attnslim analyze --what conversion`). \"progressive a→b→c\": converted in "
                "stages of a, b, c layers, each stage's new layers the cheapest on the model as recovered so far, "
                "each stage followed by the LoRA budget named (analysis/progressive.py). \"+ task fine-tune N steps\": "
                "then the paper's task fine-tuning (§5.2; train/lora.py loss \"choice\": next-word items from the "
                "calibration split, one per sequence, CE over the candidates at the last position), LoRA s summed "
                "over both trainings, final loss the fine-tune's.",
                "",
                "| variant | acc | acc_norm | LoRA s | final LoRA loss |", "|---|---|---|---|---|"]
        for key, v in ch["results"].items():
            out.append(f"| {key} | {v['acc']:.3f} | {v['acc_norm']:.3f} | {v['lora_seconds']} | "
                       f"{v['lora_final_loss'] if v['lora_final_loss'] is not None else '–'} |")
        out.append("")
        chosen = {k.split(", cheapest ")[1].split(" + ")[0]: v["layers"] for k, v in ch["results"].items()
                  if ", cheapest " in k}
        out += [f"Cheapest {k}: layers {layers}." for k, layers in chosen.items()] + ([""] if chosen else [])
        for key, v in ch["results"].items():
            if "stages" in v:  # progressive rows: every stage's layers and accuracy
                out += [f"{key}, by stage (each stage: the layers of lowest conversion cost on the model recovered so "
                        "far, then LoRA; KD loss first → last step):", ""]
                out += [f"- {len(st['layers'])} layers (+{st['new_layers']}): acc {st['acc']:.2f}, loss "
                        f"{st['lora_first_loss']:.2f} → {st['lora_final_loss']:.2f}, {st['lora_seconds']} s"
                        for st in v["stages"]] + [""]
    if "speed" in groups:
        sp = groups["speed"]["seconds"]
        lengths = list(sp)
        keys = list(sp[lengths[0]])
        shapes = f"decoder layer {groups['speed']['layer']}'s shapes; " if "layer" in groups["speed"] else ""
        out += [f"### One attention layer against sequence length (ms, {shapes}median of "
                f"{groups['speed']['repeats']}; {groups['speed']['threads']} threads)", "",
                "| variant | " + " | ".join(f"L={n}" for n in lengths) + f" | growth {lengths[0]}→{lengths[-1]} |",
                "|---|" + "---|" * (len(lengths) + 1)]
        for key in keys:
            cells = " | ".join(f"{sp[n][key] * 1e3:.1f}" for n in lengths)
            out.append(f"| {key} | {cells} | {sp[lengths[-1]][key] / sp[lengths[0]][key]:.1f}× |")
        out.append("")
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--groups", default="lowrank,serving,choice,speed")
    p.add_argument("--name", default="atp")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cpu",
                   help="cpu or cuda; only the choice group (conversion costs, LoRA, scoring) is device-aware")
    p.add_argument("--sources", default="wiki,c4")
    p.add_argument("--n", type=int, default=8, help="sequences per source (serving)")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--continuation", type=int, default=256)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--lowrank-n", type=int, default=8)
    p.add_argument("--lowrank-lengths", default="128,256,512,1024")
    p.add_argument("--choice-n", type=int, default=200)
    p.add_argument("--choice-context", type=int, default=256)
    p.add_argument("--choice-last", default="3,10", help="also the paper's layer at 1/2 keys on the last K layers only")
    p.add_argument("--choice-cheapest", default="", help="also the layer (V/sqrt(L)) on the K layers of lowest lone "
                   "conversion cost (analysis/conversion.py, calibration split), e.g. '10,15'")
    p.add_argument("--choice-progressive", default="", help="also the layer (V/sqrt(L), 1/2 keys) converted in "
                   "stages of these layer counts, each stage's layers the cheapest on the recovered model and followed "
                   "by --lora-steps of LoRA (analysis/progressive.py), e.g. '15,22,30'")
    p.add_argument("--lora-steps", type=int, default=300)
    p.add_argument("--lora-batch", type=int, default=4)
    p.add_argument("--lora-lr", type=float, default=2e-4)
    p.add_argument("--lora-warmup", type=int, default=20, help="warm-up steps (capped at --lora-steps)")
    p.add_argument("--lora-targets", default="q,k,v", help="projections that get LoRA (the paper: q,k,v)")
    p.add_argument("--lora-loss", default="last_token", choices=["last_token", "last_kd", "kd", "hidden", "layer"],
                   help="last_token: next-token CE at the last position; last_kd: KL to the dense model's "
                   "distribution there; kd: that KL at every position; hidden: every layer's hidden states at every "
                   "position; layer: layer-local distillation")
    p.add_argument("--choice-variants", default="", help="';'-separated choice variants to run (default: all), "
                   "e.g. 'atp 1/2, last 3 layers'")
    p.add_argument("--task-steps", type=int, default=0, help="also every '+ LoRA' row (and dense) followed by this "
                   "many steps of the paper's task fine-tuning (train/lora.py loss 'choice': next-word items from the "
                   "calibration split, CE over the candidates at the last position)")
    p.add_argument("--task-lr", type=float, default=2e-4, help="learning rate of the task fine-tune")
    p.add_argument("--lora-stop-after", type=int, default=None, help="time box: LoRA steps per run of this script")
    p.add_argument("--lora-dir", default="runs/atp_lora")
    p.add_argument("--lengths", default="512,1024,2048,4096,8192", help="speed: sequence lengths")
    p.add_argument("--speed-rank", type=int, default=128)
    p.add_argument("--speed-repeats", type=int, default=5)
    p.add_argument("--speed-warmup", type=int, default=1)
    args = p.parse_args()
    args.sources = args.sources.split(",")
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.choice_last = [int(x) for x in args.choice_last.split(",") if x]
    args.choice_cheapest = [int(x) for x in args.choice_cheapest.split(",") if x]
    args.choice_progressive = [int(x) for x in args.choice_progressive.split(",") if x]
    groups = set(args.groups.split(","))
    store = Store(args.name, args, serving="serving" in groups)
    model, tokenizer = load_model(args.model)
    model.to(args.device)  # converted layers follow: adapters put a replacement on the device of the replaced
    adapter = get_adapter(model)
    # the layers ATP converts: every full-attention layer (all of SmolLM2's; Gemma-3's global layers 5, 11, 17), as
    # the method refuses sliding-window and soft-capped layers (methods/atp.py)
    specs = {i: adapter.attention_spec(i) for i in range(adapter.num_layers())}
    dense = {i: adapter.attention(i) for i, spec in specs.items()
             if spec.sliding_window is None and spec.softcap is None}
    store.data["converted_layers"] = sorted(dense)
    if "lowrank" in groups and "lowrank" not in store.data["groups"]:
        lengths = [int(x) for x in args.lowrank_lengths.split(",")]
        report = lowrank_report(model, tokenizer, "wiki", lengths=lengths, n=args.lowrank_n)
        store.data["groups"]["lowrank"] = {"report": report, "table": format_lowrank(report)}
        store.save()
        print(format_lowrank(report), flush=True)
    if "serving" in groups:
        run_serving(store, model, tokenizer, dense, args)
    if "choice" in groups:
        run_choice(store, model, tokenizer, dense, args)
    if "speed" in groups:
        run_speed(store, install(model, dense, None), min(dense), args)
    store.save()


if __name__ == "__main__":
    main()

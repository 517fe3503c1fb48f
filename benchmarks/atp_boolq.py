"""ATP on BoolQ with the paper's App. D prompt (Table 4's protocol) on smollm2-135m → benchmarks/results/atp-boolq.json.

The paper (seed 004, §5.2, App. C/D) converts every Llama-2 attention layer to its non-causal layer over the top
principal keys, fine-tunes LoRA (rank 32, q/k/v) on the task, and scores BoolQ validation by the argmax over
"Yes"/"No" of the next-token logits at the prompt's last position; "Orig" is the dense model fine-tuned the same way.
Rows here:
  dense                      zero-shot
  dense + LoRA …             the same LoRA task fine-tune (the paper's "Orig")
  atp 1/2                    the paper's layer (form "paper") at ⌈L/2⌉ principal keys in every layer, zero-shot
  atp 1/2 + LoRA …           the same fine-tune (same items, order, steps, lr, seed) with ATP on
  (atp 1/4, atp 1/4 + LoRA … with --fractions 1/2,1/4)
Data (eval/boolq.py): only BoolQ's validation split ships offline, so the fine-tune uses its first --train-rows
rows (shuffled with --seed, one item per example, each used at most once) and accuracy is measured on its last
--eval-n rows (disjoint). Prompts ≤ --max-tokens tokens (passage cut from the end), the same for every row.
LoRA: train/lora.py loss "choice" (CE over the Yes/No logits at the last position), rank 32, alpha 64, dropout
0.05 on q/k/v of every layer, AdamW lr 2e-4, wd 1e-2 (App. C), --warmup steps then cosine.

CPU budget of the default run (recorded in the JSON with the wall times): 2 fine-tunes × 80 steps × batch 4 ×
≤ 160 tokens (320 prompts each, ~125 tokens on average), 4 evaluations of 300 prompts, OMP_NUM_THREADS=1 on a
2-core CPU shared with another job; about 30 minutes in all.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/atp_boolq.py
    .venv/bin/python benchmarks/make_report.py
Results are saved after every row; a rerun with the same settings skips the rows its JSON holds (a changed setting
starts the file afresh). LoRA checkpoints go to --lora-dir, so an interrupted fine-tune resumes.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from atp import install
from common import RESULTS, environment

from attnslim.adapters import get_adapter
from attnslim.eval.boolq import boolq_items, boolq_rows, majority_rate
from attnslim.eval.choice import ChoiceItems, choice_accuracy
from attnslim.models import load_model
from attnslim.train.lora import LoraRecipe, recover_with_lora

FRACTIONS = {"1/2": 0.5, "1/4": 0.25}


def split_items(tokenizer: Any, args: argparse.Namespace) -> tuple[ChoiceItems, ChoiceItems]:
    """(training items: a seeded shuffle of the first --train-rows rows, evaluation items: the last --eval-n rows)."""
    rows = boolq_rows()
    if args.train_rows + args.eval_n > len(rows):
        raise SystemExit(f"--train-rows + --eval-n exceeds the {len(rows)} BoolQ validation rows")
    order = torch.randperm(args.train_rows, generator=torch.Generator().manual_seed(args.seed)).tolist()
    train = boolq_items([rows[i] for i in order], tokenizer, args.max_tokens,
                        f" (validation rows 0–{args.train_rows - 1}, shuffled with seed {args.seed})")
    first = len(rows) - args.eval_n
    held = boolq_items(rows[first:], tokenizer, args.max_tokens, f" (validation rows {first}–{len(rows) - 1})")
    return train, held


def notes(data: dict[str, Any]) -> list[str]:
    """Markdown for make_report's section: the rows with their standard errors, beside chance and the majority."""
    b = data.get("budget", {})
    seconds = sum(r["eval_seconds"] + (r["lora_seconds"] or 0) for r in data["rows"].values())
    out = [f"Training: {data['train_items']}. Evaluation: {data['eval_items']}.  ",
           f"LoRA (train/lora.py, loss \"choice\": cross-entropy over the Yes/No logits at the last position): rank "
           f"{data['lora_recipe']['rank']} on q/k/v of every layer, {data['lora_recipe']['steps']} steps × batch "
           f"{data['lora_recipe']['batch_size']}, lr {data['lora_recipe']['lr']:g}, warm-up "
           f"{data['lora_recipe']['warmup']} then cosine, seed {data['lora_recipe']['seed']}; the same for every "
           "\"+ LoRA\" row (same items in the same order).  ",
           f"CPU budget: {b.get('fine_tune_prompts')} prompts ({b.get('fine_tune_tokens')} tokens) per fine-tune, "
           f"{b.get('eval_tokens')} tokens per evaluation, {b.get('threads')} thread(s); the rows below took "
           f"{seconds / 60:.0f} min in all.  ",
           f"Chance 0.5; always answering the held-out items' majority label scores {data['majority']:.3f}. "
           "± is the binomial standard error √(p(1−p)/n); CE = mean training loss of the first → last 10 steps.", "",
           "| row | acc | ± s.e. | n | LoRA s | eval s | CE |", "|---|---|---|---|---|---|---|"]
    for name, r in data["rows"].items():
        ce = "–" if r["lora_first_loss"] is None else f"{r['lora_first_loss']:.3f} → {r['lora_final_loss']:.3f}"
        out.append(f"| {name} | {r['acc']:.3f} | {r['se']:.3f} | {r['n']} | {r['lora_seconds'] or '–'} | "
                   f"{r['eval_seconds']} | {ce} |")
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--name", default="atp-boolq")
    p.add_argument("--fractions", default="1/2", help="ATP fractions of the principal keys, e.g. 1/2,1/4")
    p.add_argument("--train-rows", type=int, default=2000)
    p.add_argument("--eval-n", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lora-dir", default="runs/atp_boolq")
    args = p.parse_args()
    setting = {k: getattr(args, k) for k in ("model", "train_rows", "eval_n", "max_tokens", "steps", "batch", "lr",
                                              "warmup", "seed")}
    path = RESULTS / f"{args.name}.json"
    data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    if data.get("setting") != setting:
        data = {"setting": setting, "rows": {}}

    def save() -> None:
        data["environment"] = environment()
        data["notes"] = notes(data)
        RESULTS.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)

    model, tokenizer = load_model(args.model)
    adapter = get_adapter(model)
    dense = {i: adapter.attention(i) for i in range(adapter.num_layers())}
    train, held = split_items(tokenizer, args)
    recipe = LoraRecipe(steps=args.steps, batch_size=args.batch, context=args.max_tokens, lr=args.lr,
                        warmup=args.warmup, loss="choice", seed=args.seed)
    used = train.lengths[: args.steps * args.batch] if train.lengths is not None else None
    data.update({"train_items": train.description, "eval_items": held.description, "chance": 0.5,
                 "majority": majority_rate(held), "lora_recipe": {**vars(recipe), "targets": list(recipe.targets)},
                 "budget": {"threads": torch.get_num_threads(), "fine_tune_prompts": args.steps * args.batch,
                            "fine_tune_tokens": int(used.sum()) if used is not None else None,
                            "eval_tokens": int(held.lengths.sum()) if held.lengths is not None else None}})
    tag = f"LoRA {args.steps} steps × {args.batch}, lr {args.lr:g}"
    variants: dict[str, dict[str, Any] | None] = {"dense": None}
    variants |= {f"atp {f}": {"rank": FRACTIONS[f], "form": "paper"} for f in args.fractions.split(",")}
    for key, atp_args in variants.items():
        for tuned in (False, True):
            name = f"{key} + {tag}" if tuned else key
            if name in data["rows"]:
                print(f"[skip] {name}", flush=True)
                continue
            install(model, dense, atp_args)
            state = {k: v.clone() for k, v in model.state_dict().items()} if tuned else None
            log: dict[str, Any] = {}
            if tuned:
                work = Path(args.lora_dir) / name.replace(" ", "_").replace("/", "-").replace(",", "")
                model, log = recover_with_lora(model, tokenizer, recipe, work, items=train)
            start = time.time()
            res = choice_accuracy(model, held, batch_size=8)
            k = round(res.acc * res.items)
            data["rows"][name] = {
                "acc": res.acc, "se": math.sqrt(res.acc * (1 - res.acc) / res.items), "n": res.items, "correct": k,
                "eval_seconds": round(time.time() - start, 1),
                "lora_seconds": round(log["seconds"], 1) if log else None,
                "lora_first_loss": sum(log["losses"][:10]) / 10 if log else None,  # mean of the first 10 steps
                "lora_final_loss": sum(log["losses"][-10:]) / 10 if log else None,  # and of the last 10
            }
            if state is not None:
                model.load_state_dict(state)  # the merged LoRA weights out again before the next row
            save()
            print(f"[done] {name}: acc {res.acc:.3f} ± {data['rows'][name]['se']:.3f} (n {res.items})", flush=True)
    install(model, dense, None)
    save()


if __name__ == "__main__":
    main()

"""Healing settings on one compressed model (train/heal.py): compress once, then heal copies of it with each
setting and evaluate every copy in the same harness as benchmarks/composed.py (perplexity, the demo's zero-shot
accuracy, KV bytes, parameters; decode speed is measured once, on the unhealed model: healing changes weights,
not shapes). Checked against the issue-8 targets of the default recipe (attnslim.targets).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/heal.py --base nbl12-val-kv80-mlp70 --steps 40 \\
        --configs "lr=1e-4;lr=3e-4;lr=3e-4,params=all"
    .venv/bin/python benchmarks/make_report.py                                  # regenerates BENCHMARKS.md

A setting is "key=value,..." of `heal` fields (train/heal.HealConfig); --steps, batch 4 x 256 tokens of wiki+c4
unless set. Rows: BASE (unhealed) and BASE-healSTEPS-SETTING.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

from common import Harness, calibration
from composed import accuracy, dense_with_accuracy, report_fields, targets

from attnslim.api import compress
from attnslim.bench import interleaved
from attnslim.models import load_model
from attnslim.recipe import recipe_from_dict
from attnslim.targets import TARGETS
from attnslim.train.heal import HealConfig, heal

HEAL = {"batch_size": 4, "seq_len": 256, "source": "wiki+c4"}
VALUES = {"ratio": 1.0, "cache": "values"}  # q/o full rank; rotated keys cached, values as absorbed latents


def nbl_then_latent(m: int, latent: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"method": "nbl", "layers": "all", "args": {"m": m}},
            {"method": "latentllm", "layers": "rest", "args": latent}]


BASES = {
    # recipes/latentllm-kv50.yaml's compression (the default before MLA)
    "latentllm-kv50": [{"method": "latentllm", "layers": "all", "args": {"ratio": 1.0, "kv_ratio": 0.5}}],
    "mla-kv50": [{"method": "mla", "layers": "all", "args": {"kv_ratio": 0.5}}],  # default.yaml's, mla.yaml's
    # the parameter target by attention alone: embeddings + MLP are 80% of the model, so attention must keep <= 25%
    "latentllm-a20": [{"method": "latentllm", "layers": "all", "args": {"ratio": 0.2}}],
    "nbl12-val-kv80": nbl_then_latent(12, {**VALUES, "kv_ratio": 0.8}),
    "nbl12-val-kv80-mlp70": nbl_then_latent(12, {**VALUES, "kv_ratio": 0.8, "mlp": "local", "mlp_ratio": 0.7}),
    "nbl9-val-kv70-mlp70": nbl_then_latent(9, {**VALUES, "kv_ratio": 0.7, "mlp": "local", "mlp_ratio": 0.7}),
    # attention is where LatentLLM is cheapest per parameter (50%: 1.08x alone), so less is taken from the MLP
    "nbl12-val50-kv80-mlp85": nbl_then_latent(12, {**VALUES, "ratio": 0.5, "kv_ratio": 0.8, "mlp": "local",
                                                   "mlp_ratio": 0.85}),
}


def parse_setting(text: str) -> dict[str, Any]:
    """"lr=3e-4,params=all" -> {"lr": 3e-4, "params": "all"} (numbers parsed, everything else a string)."""
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        try:
            out[key.strip()] = int(value) if value.strip().isdigit() else float(value)
        except ValueError:
            out[key.strip()] = value.strip()
    return out


def slug(text: str) -> str:
    """The row name of a setting as written: "lr=3e-4,params=all" -> "lr3e-4-paramsall"."""
    return text.replace("=", "").replace(",", "-").replace(" ", "") or "defaults"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default="heal-sweep")
    ap.add_argument("--base", default="nbl12-val-kv80-mlp70", choices=sorted(BASES))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--configs", default="lr=1e-4", help="';'-separated settings, e.g. 'lr=1e-4;params=all'")
    ap.add_argument("--tokens", type=int, default=2048, help="evaluation tokens per source")
    ap.add_argument("--windows", type=int, default=16, help="calibration windows of 512 tokens")
    ap.add_argument("--task-limit", type=int, default=None, help="zero-shot items per task (all if omitted)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    texts = args.configs.split(";")
    settings = [parse_setting(c) for c in texts]
    configs = [HealConfig.from_dict({**HEAL, "steps": args.steps, **s}) for s in settings]  # refuse bad ones now
    h = Harness(args.name, tokens=args.tokens)
    dense_model, tokenizer = load_model(h.model_name)
    dense = dense_with_accuracy(h, dense_model, tokenizer, args.task_limit)
    recipe = recipe_from_dict({"name": args.base, "calibration": calibration(args.windows), "steps": BASES[args.base]})
    base, _ = load_model(h.model_name)
    report = compress(base, tokenizer, recipe)
    speed = interleaved({"dense": dense_model, args.base: base}, [args.context], new_tokens=32,
                        repeats=args.repeats, progress=False)["models"][args.base][str(args.context)]
    common = {**report_fields(report, h), "threads": h.data["environment"]["threads"], "speed": speed}

    def measure(key: str, model: Any, extra: dict[str, Any]) -> None:
        result = {**h.evaluate(model, tokenizer, key), **common, **extra,
                  "acc": accuracy(model, tokenizer, args.task_limit)}
        result["kv_ratio"] = result["kv_bytes_per_token"] / dense["kv_bytes_per_token"]
        result = h.record(key, result, dense, note=f"KV {result['kv_ratio']:.3f}x")
        result["targets_met"] = targets(result, dense)
        h.save()
        print(f"  {key}: acc {result['acc']}, decode {speed['decode_ratio']:.2f}x; targets met "
              f"{result['targets_met']} ({TARGETS})", flush=True)

    measure(args.base, base, {})
    for text, cfg in zip(texts, configs, strict=True):
        model = copy.deepcopy(base)  # every setting starts from the same compressed weights
        healed = heal(model, dense_model, tokenizer, cfg)
        measure(f"{args.base}-heal{args.steps}-{slug(text)}", model, {"heal": healed})
        del model


if __name__ == "__main__":
    main()

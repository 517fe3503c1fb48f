"""Shared by benchmarks/lisa_aligner.py and benchmarks/lisa_beta.py: LISA on a few deep layers, a short
distillation, and the held-out score/LM losses of `train/distill.distill_loss` on evaluation windows."""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import torch

from attnslim.api import compress
from attnslim.recipe import recipe_from_dict
from attnslim.train.distill import DistillConfig, distill, distill_loss, trainable_layers

# Per model: non-adjacent receivers, so every donor (layer n-1) is an unchanged dense layer and the dense model's
# head matching between n-1 and n is exactly what each aligner can learn; deep layers, past the sensitive first
# ones. Gemma-3's receivers and donors are all sliding-window layers (its global layers 5, 11, 17 and the layer
# after each cannot share: methods/lisa.unshareable_layers).
LAYERS: dict[str, list[int]] = {"smollm2-135m": [18, 20, 22, 24], "gemma3-270m": [8, 10, 14, 16]}


def receivers(model: str, given: str) -> list[int]:
    """The LISA layers of a run: `given` ("8,10,...") or the model's LAYERS entry."""
    if given:
        return [int(n) for n in given.split(",")]
    if model not in LAYERS:
        raise SystemExit(f"no default LISA layers for {model}: give --layers N,N,... (non-adjacent deep layers whose "
                         f"donor n-1 has the same attention type); defaults exist for {', '.join(LAYERS)}")
    return LAYERS[model]


def lisa_copy(dense: Any, tokenizer: Any, layers: list[int], args: dict[str, Any]) -> Any:
    """A copy of `dense` with LISA (method args `args`, untrained) on `layers`."""
    model = copy.deepcopy(dense)
    recipe = recipe_from_dict({"name": "lisa-props", "calibration": {"source": "wiki", "windows": 1, "seq_len": 64,
                                                                     "seed": 0},
                               "steps": [{"method": "lisa", "layers": layers, "args": args}]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compress(model, tokenizer, recipe, progress=False)
    return model


def train(model: Any, dense: Any, tokenizer: Any, cfg: DistillConfig) -> dict[str, Any]:
    """distill() with `dense` as the teacher; the report without its per-step history, plus the loss curve."""
    report = distill(model, dense, tokenizer, cfg, progress=False)
    curve = [h["loss"] for h in report.pop("history")]
    return {**report, "loss_curve": curve}


@torch.no_grad()
def held_out(model: Any, dense: Any, ids: torch.Tensor, batch: int = 2) -> dict[str, float]:
    """Mean over windows ids (n, l) of the score Huber error (the KD term: mean over LISA layers of the Huber loss
    on the attended entries) and the LM loss, with perplexity = exp(LM loss)."""
    layers = trainable_layers(model)
    cfg = DistillConfig()  # distill_loss reads beta (not used here: kd and lm come back separately) and delta
    kd, lm = [], []
    for i in range(0, ids.shape[0], batch):
        _, k, m = distill_loss(model, dense, layers, ids[i : i + batch], cfg)
        kd.append(k)
        lm.append(m)
    mean_lm = sum(lm) / len(lm)
    return {"huber": sum(kd) / len(kd), "lm_loss": mean_lm, "ppl": math.exp(mean_lm)}

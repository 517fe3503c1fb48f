"""What dropping a Qwen-family model's attention biases costs: the question behind exporting such a model to
DeepSeek-V3 for vLLM, whose DeepSeek model (vllm 0.32.0, model_executor/models/deepseek_v2.py) builds every MLA
projection without a bias and skips `*.bias` tensors it has no parameter for (docs/serving.md, "Biased models").

The dense model is scored as it is and with the q, k or v biases of every layer set to zero (and all three), on
the same wiki windows; each variant is compared with the dense logits (relative max |Δ logit|, top-1 agreement)
and by perplexity. `folded` rows keep no bias either, but fold each into its weight by least squares: no input
carries a constant, yet the normalised attention input x has a large common part, so a constant is nearly a linear
function of it, 1 ≈ aᵀx by least squares on calibration windows (linalg/bias_fold.py), and W x + b becomes
(W + b aᵀ) x. `rho` = μᵀa, the fraction of the constant's energy the fit reproduces.
The dense model stands for the attnslim MLA model here: mla keeps q_proj and its bias as they are and carries the v
bias exactly through o_proj's bias, so these are the costs an export without biases adds.

    .venv/bin/python benchmarks/bias_drop.py --model qwen2.5-1.5b --tokens 512 --ridge 1e-4
writes benchmarks/results/bias-drop-MODEL.json (about 10 minutes on one thread and 9 GB of memory for qwen2.5-1.5b).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, environment  # noqa: E402

from attnslim.adapters import get_adapter  # noqa: E402
from attnslim.calib.hooks import Callback, capture_sites  # noqa: E402
from attnslim.data import calib_windows, eval_windows  # noqa: E402
from attnslim.linalg.bias_fold import RIDGE, constant_fit, fold_bias  # noqa: E402
from attnslim.linalg.stats import InputStats  # noqa: E402
from attnslim.models import load_model  # noqa: E402

VARIANTS = {"q": ("q",), "k": ("k",), "v": ("v",), "qkv": ("q", "k", "v")}
FOLDED = {"q": ("q",), "k": ("k",), "v": ("v",), "qv": ("q", "v")}
RIDGES = (1e-6, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 1e-2)


def ridge_sweep(fit: list[tuple[torch.Tensor, torch.Tensor]], held: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> dict[str, dict[str, float]]:
    """Per ridge: the residual energy E[(1 − aᵀx)²] = 1 − 2μᵀa + aᵀCa on held-out calibration tokens (other windows
    of the calibration split) of the a fitted on `fit`, mean and max over the layers."""
    out = {}
    for ridge in RIDGES:
        res = []
        for (corr, mean), (held_corr, held_mean) in zip(fit, held, strict=True):
            a, _ = constant_fit(corr, mean, ridge)
            res.append(float(1 - 2 * held_mean @ a + a @ held_corr @ a))
        out[f"{ridge:g}"] = {"mean": sum(res) / len(res), "max": max(res)}
    return out


def input_moments(model: Any, adapter: Any, windows: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (E[xxᵀ], E[x]) of the attention input x, float64, over every token of `windows`."""
    stats = [InputStats.empty(model.config.hidden_size) for _ in range(adapter.num_layers())]
    def add(s: InputStats) -> Callback:
        return lambda _site, x: s.update(x)

    with ExitStack() as hooks, torch.no_grad():
        for i, s in enumerate(stats):
            hooks.enter_context(capture_sites(adapter, i, {"attn_in"}, add(s)))
        for window in windows.split(2):
            model(window)
    for i, s in enumerate(stats):
        s.check(f"layer {i} attention input")
    return [(s.corr, s.mean) for s in stats]


def nll(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--windows", type=int, default=8, help="calibration windows of the folds")
    ap.add_argument("--calib-seq-len", type=int, default=512)
    ap.add_argument("--ridge", type=float, default=RIDGE, help="the folds' ridge (default mla's, linalg/bias_fold.py)")
    a = ap.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_model(a.model)
    adapter = get_adapter(model)
    ids = eval_windows("wiki", tokenizer, tokens=a.tokens, seq_len=a.seq_len).ids
    start = time.perf_counter()
    with torch.no_grad():
        ref = model(ids).logits.double()
    base = nll(ref, ids)
    out: dict[str, Any] = {"environment": environment(), "model": a.model, "dtype": "float32",
                           "evaluated_on": f"{ids.numel()} tokens of wiki (evaluation split), windows of {a.seq_len}",
                           "dense": {"nll": base, "ppl": math.exp(base)}, "dropped": {}}
    def score(label: str, group: str, saved: list[tuple[torch.Tensor, torch.Tensor]], extra: dict[str, Any]) -> None:
        with torch.no_grad():
            got = model(ids).logits.double()
        for tensor, value in saved:
            tensor.data.copy_(value)
        loss = nll(got, ids)
        row = {**extra, "nll": loss, "ppl": math.exp(loss), "ppl_ratio": math.exp(loss - base),
               "relative_logit_error": float((got - ref).abs().max() / ref.abs().max()),
               "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).double().mean())}
        out[group][label] = row
        print(group, label, json.dumps(row), flush=True)

    for label, names in VARIANTS.items():
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i in range(adapter.num_layers()):
            for name in names:
                bias = getattr(adapter.linear(i, name), "bias", None)
                if isinstance(bias, torch.Tensor):
                    saved.append((bias, bias.detach().clone()))
                    bias.data.zero_()
        score(label, "dropped", saved, {"biases_zeroed": len(saved)})
    cal = calib_windows("wiki", tokenizer, a.windows, a.calib_seq_len).ids
    moments = input_moments(model, adapter, cal)
    held = input_moments(model, adapter, calib_windows("wiki", tokenizer, a.windows, a.calib_seq_len, seed=1).ids)
    fits = [constant_fit(corr, mean, a.ridge) for corr, mean in moments]
    out["folded"] = {}
    out["fold"] = {"calibration": f"{cal.numel()} tokens of wiki (calibration split), windows of {a.calib_seq_len}",
                   "ridge": a.ridge, "rho": [rho for _, rho in fits], "ridge_sweep": ridge_sweep(moments, held)}
    for label, names in FOLDED.items():
        saved = []
        for i, (vec, _) in enumerate(fits):
            for name in names:
                weight, bias = adapter.linear(i, name).weight, getattr(adapter.linear(i, name), "bias", None)
                if isinstance(weight, torch.Tensor) and isinstance(bias, torch.Tensor):
                    saved += [(weight, weight.detach().clone()), (bias, bias.detach().clone())]
                    weight.data.copy_(fold_bias(weight, bias, vec))
                    bias.data.zero_()
        score(label, "folded", saved, {"biases_folded": len(saved) // 2})
    out["seconds"] = round(time.perf_counter() - start, 1)
    path = RESULTS / f"bias-drop-{Path(a.model).name}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

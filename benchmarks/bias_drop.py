"""What dropping a Qwen-family model's attention biases costs: the question behind exporting such a model to
DeepSeek-V3 for vLLM, whose DeepSeek model (vllm 0.32.0, model_executor/models/deepseek_v2.py) builds every MLA
projection without a bias and skips `*.bias` tensors it has no parameter for (docs/serving.md, "Biased models").

The dense model is scored as it is and with the q, k or v biases of every layer set to zero (and all three), on
the same wiki windows; each variant is compared with the dense logits (relative max |Δ logit|, top-1 agreement)
and by perplexity. The dense model stands for the attnslim MLA model here: mla keeps q_proj and its bias as they
are and carries the v bias exactly through o_proj's bias, so these are the costs an export without biases adds.

    .venv/bin/python benchmarks/bias_drop.py --model qwen2.5-1.5b --tokens 512
writes benchmarks/results/bias-drop-MODEL.json (about 2 minutes and 9 GB of memory for qwen2.5-1.5b).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, environment  # noqa: E402

from attnslim.adapters import get_adapter  # noqa: E402
from attnslim.data import eval_windows  # noqa: E402
from attnslim.models import load_model  # noqa: E402

VARIANTS = {"q": ("q",), "k": ("k",), "v": ("v",), "qkv": ("q", "k", "v")}


def nll(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=256)
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
    for label, names in VARIANTS.items():
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i in range(adapter.num_layers()):
            for name in names:
                bias = getattr(adapter.linear(i, name), "bias", None)
                if isinstance(bias, torch.Tensor):
                    saved.append((bias, bias.detach().clone()))
                    bias.data.zero_()
        with torch.no_grad():
            got = model(ids).logits.double()
        for bias, value in saved:
            bias.data.copy_(value)
        loss = nll(got, ids)
        row = {"biases_zeroed": len(saved), "nll": loss, "ppl": math.exp(loss), "ppl_ratio": math.exp(loss - base),
               "relative_logit_error": float((got - ref).abs().max() / ref.abs().max()),
               "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).double().mean())}
        out["dropped"][label] = row
        print(label, json.dumps(row), flush=True)
    out["seconds"] = round(time.perf_counter() - start, 1)
    path = RESULTS / f"bias-drop-{Path(a.model).name}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

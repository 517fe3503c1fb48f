"""What mla's `rope_stride: 2` and `rope_fastest: 32` cost: on 128-dim heads they keep rotary pairs only at the
frequencies a 64-dim DeepSeek-V3 key can rotate at (the even ones at rope_theta, the 32 fastest at its square
root), so the export reaches a width vLLM serves (docs/serving.md, "Served widths"). Every variant keeps one pair
per frequency (rope_spread, as layout deepseek does) without FreqFold, so the allowed frequencies are the only
difference; each is compressed from a fresh copy of the model and scored against the dense one on the
same wiki windows (perplexity, top-1 agreement with the dense logits).

    .venv/bin/python benchmarks/rope_stride.py --model qwen2.5-1.5b --kv-ratio 0.25
writes benchmarks/results/rope-stride-MODEL.json (qwen2.5-1.5b: about 10 minutes, 9 GB of memory).

`deepseek+fold` is the whole servable form of a Qwen-family model: the 32 fastest frequencies, `layout: deepseek`
and `biases: fold` (its q/k/v biases folded into the weights by least squares; docs/serving.md, "Biased models"),
set against `rope_fastest=32` in the free layout, which carries the biases exactly, and against `uncentred`, the
same without the mean correction (layout deepseek fits uncentred: it has no o_proj bias to carry the mean), so the
fold's own cost is deepseek+fold ÷ uncentred. At the width vLLM's GPU backends serve on the 1.5B model (256 + 64 =
320 of 512 values, KV 0.625):

    .venv/bin/python benchmarks/rope_stride.py --model qwen2.5-1.5b --kv-ratio 0.625 \
        --variants rope_fastest=32,uncentred,deepseek+fold --name rope-stride-kv0.625-qwen2.5-1.5b

(`--variants deepseek+fold@1e-4,deepseek+fold@1e-8`: the fold at other ridges than the default 1e-6),
and what mla's local fit (96 steps per layer towards the dense attention's output) recovers, on the first four
layers (the hardest: tests/test_qwen15_real.py), about 10 minutes:

    .venv/bin/python benchmarks/rope_stride.py --model qwen2.5-1.5b --kv-ratio 0.5 --layers 0,1,2,3 \
        --local-steps 96 --tokens 1024 --variants uncentred,deepseek+fold --name bias-fold-local-qwen2.5-1.5b
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bias_drop import nll  # noqa: E402
from common import RESULTS, environment  # noqa: E402

from attnslim.api import compress  # noqa: E402
from attnslim.data import eval_windows  # noqa: E402
from attnslim.models import load_model  # noqa: E402
from attnslim.recipe import recipe_from_dict  # noqa: E402

# any frequency (what the export cannot serve on 128-dim heads), the even ones (a 64-dim key at θ), the 32 fastest
# (a 64-dim key at √θ)
VARIANTS: dict[str, dict[str, Any]] = {"free": {}, "rope_stride=2": {"rope_stride": 2},
                                       "rope_fastest=32": {"rope_fastest": 32},
                                       "uncentred": {"rope_fastest": 32, "center": False},
                                       "deepseek+fold": {"rope_fastest": 32, "layout": "deepseek", "biases": "fold"},
                                       # the fold's ridge on either side of the default 1e-6: 1e-4 suits the dense
                                       # model's q fold (bias_drop.py's ridge sweep)
                                       **{f"deepseek+fold@{label}": {"rope_fastest": 32, "layout": "deepseek",
                                                                       "biases": "fold", "fold_ridge": float(label)}
                                          for label in ("1e-4", "1e-8")}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--kv-ratio", type=float, default=0.25)
    ap.add_argument("--rope-dims", type=int, default=64)
    ap.add_argument("--calib-windows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--variants", default="free,rope_stride=2,rope_fastest=32", help=f"of {', '.join(VARIANTS)}")
    ap.add_argument("--name", default=None, help="results file stem (default rope-stride-MODEL)")
    ap.add_argument("--layers", default="all", help="converted layers, e.g. 0,1,2,3 (default all)")
    ap.add_argument("--local-steps", type=int, default=0, help="mla's local fit on every converted layer")
    a = ap.parse_args()
    labels = [v for v in a.variants.split(",") if v]
    unknown = [v for v in labels if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants {', '.join(unknown)}: unknown; known: {', '.join(VARIANTS)}")
    model, tokenizer = load_model(a.model)
    ids = eval_windows("wiki", tokenizer, tokens=a.tokens, seq_len=256).ids
    with torch.no_grad():
        ref = model(ids).logits.double()
    del model
    base = nll(ref, ids)
    out: dict[str, Any] = {"environment": environment(), "model": a.model, "dtype": "float32",
                           "evaluated_on": f"{ids.numel()} tokens of wiki (evaluation split), windows of 256",
                           "calibration": f"{a.calib_windows} wiki windows of 256", "dense": {"ppl": math.exp(base)},
                           "variants": {}}
    path = RESULTS / f"{a.name or 'rope-stride-' + Path(a.model).name}.json"
    stored = json.loads(path.read_text()) if path.exists() else {}
    if {k: stored.get(k) for k in ("model", "evaluated_on", "calibration", "dense")} == {
            k: out[k] for k in ("model", "evaluated_on", "calibration", "dense")}:
        out["variants"] = stored["variants"]  # the same windows and dense model: other variants' rows stay
    for label, extra in ((v, VARIANTS[v]) for v in labels):
        args = {"kv_ratio": a.kv_ratio, "rope_dims": a.rope_dims, "rope_spread": True, "rope_fold": 1, **extra,
                **({"local_steps": a.local_steps} if a.local_steps else {})}
        layers: str | list[int] = "all" if a.layers == "all" else [int(i) for i in a.layers.split(",")]
        recipe = recipe_from_dict({
            "name": label, "calibration": {"source": "wiki", "windows": a.calib_windows, "seq_len": 256,
                                                       "seed": 0},
            "steps": [{"method": "mla", "layers": layers, "args": args}]})
        model, _ = load_model(a.model)
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compress(model, tokenizer, recipe, progress=False)
        seconds = time.perf_counter() - start
        with torch.no_grad():
            got = model(ids).logits.double()
        del model
        loss = nll(got, ids)
        row = {"args": args, "ppl": math.exp(loss), "ppl_ratio_to_dense": math.exp(loss - base),
               "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).double().mean()),
               "compress_seconds": round(seconds, 1), "layers": layers, "command": environment()["command"]}
        out["variants"][label] = row
        print(label, json.dumps(row), flush=True)
        path.write_text(json.dumps(out, indent=1) + "\n")  # after every row: a cut run keeps what it measured
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

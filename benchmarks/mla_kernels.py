"""MLA's absorbed decode core, kernel by kernel, against dense's attention core: µs per layer, medians.

One new token of SmolLM2-135M at KV 0.5 (the default recipe's shapes: 9 query heads, 3 KV heads of 64; a latent
of r = 160 plus a rotary key of 32 per token) attends to T cached tokens:
  dense    SDPA over per-head keys and values (b, 3, T, 64) with enable_gqa (what HF's sdpa path runs)
  grouped  `grouped_attention`: scores q (9 × 192) against the rows [c, k_r], softmax, values the rows' latent
           columns: two skinny GEMMs over the whole cache (MLAAttention's decode_kernel = "grouped")
  split    `split_attention`: the cache in 2 pieces, torch's CPU flash kernel per piece in parallel, merged by
           log-sum-exps (decode_kernel = "auto" picks it as `split_count` advises: from 2 threads, and 1024 cached
           tokens where MKL runs its fast kernels, 512 where it runs generic code)
  flash    the same kernel in one call over the whole cache (one piece: one thread runs it)
Each repetition runs each kernel in turn over 30 distinct caches, one per layer, as a decode step does, so the caches
are read from memory rather than from a warm cache of the same 3 MB. The value up-projection and everything
else outside the core is the same for both MLA kernels and not timed.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/mla_kernels.py                 # threads 1 and 2
    benchmarks/with_mkl_intel_paths.sh benchmarks/mla_kernels.py --name mla-kernels-mkl-intel   # diagnosis
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from common import environment

from attnslim.linalg.attention import grouped_attention
from attnslim.linalg.split_attention import split_attention, split_count

RESULTS = Path(__file__).parent / "results"
HEADS, KV_HEADS, HEAD_DIM, RANK, ROPE, LAYERS = 9, 3, 64, 160, 32, 30


def per_layer_us(kernels: dict[str, Callable[[int], object]], repeats: int) -> dict[str, float]:
    """Median per layer (µs) of each kernel's pass over every layer's cache, the kernels interleaved within each
    repetition (a noisy neighbour slows all of them alike), after one warm-up pass each."""
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for rep in range(repeats + 1):
        for name, fn in kernels.items():
            start = time.perf_counter()
            for layer in range(LAYERS):
                fn(layer)
            if rep:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) / LAYERS * 1e6 for name, t in times.items()}


def measure(context: int, repeats: int) -> dict[str, float | int]:
    g = torch.Generator().manual_seed(context)
    width = RANK + ROPE
    # the latent cache as decode holds it: a view of the first T rows of a buffer with spare capacity
    rows = [torch.randn(1, 1, context + 256, width, generator=g)[:, :, :context] for _ in range(LAYERS)]
    keys = [torch.randn(1, KV_HEADS, context, HEAD_DIM, generator=g) for _ in range(LAYERS)]
    values = [torch.randn(1, KV_HEADS, context, HEAD_DIM, generator=g) for _ in range(LAYERS)]
    q = torch.randn(1, HEADS, 1, width, generator=g)
    q_dense = torch.randn(1, HEADS, 1, HEAD_DIM, generator=g)
    ref = grouped_attention(q, rows[0], rows[0][..., :RANK], None, 1.0)
    assert torch.allclose(split_attention(q, rows[0], None, 1.0, 2)[..., :RANK], ref, atol=1e-5)
    out: dict[str, float | int] = dict(per_layer_us({
        "dense": lambda i: F.scaled_dot_product_attention(q_dense, keys[i], values[i], enable_gqa=True),
        "grouped": lambda i: grouped_attention(q, rows[i], rows[i][..., :RANK], None, 1.0),
        "split": lambda i: split_attention(q, rows[i], None, 1.0, 2),
        "flash": lambda i: split_attention(q, rows[i], None, 1.0, 1),
    }, repeats))
    out["auto_pieces"] = split_count(q, context)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", default="mla-kernels", help="results file benchmarks/results/NAME.json")
    parser.add_argument("--contexts", default="256,512,1024,2048,4096")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    env = environment()  # its `threads` is the process's; each row names the threads it ran on
    runs: dict[str, dict[str, float | int]] = {}
    lines = ["SmolLM2-135M's shapes at KV 0.5 (9 query heads; dense: 3 KV heads of 64; MLA: cached rows of a "
             "160-wide latent and a 32-wide rotary key). Decode attention core of one new token, µs per layer "
             "(median of repetitions, each over 30 distinct layer caches); ratio = dense's time over the kernel's "
             "(above 1: faster than dense). `auto` is what MLAAttention runs: `split` where it advises 2 or more "
             "pieces, else `grouped`.", "",
             "| threads | context | dense µs | grouped µs (×dense) | split, 2 pieces µs (×dense) | "
             "flash, 1 piece µs (×dense) | auto picks |",
             "|---|---|---|---|---|---|---|"]
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for context in (int(c) for c in args.contexts.split(",")):
            row = measure(context, args.repeats)
            runs[f"{threads}/{context}"] = row
            d = row["dense"]
            pick = "split" if int(row["auto_pieces"]) > 1 else "grouped"
            lines.append(f"| {threads} | {context} | {d:.0f} | {row['grouped']:.0f} ({d / row['grouped']:.2f}×) | "
                         f"{row['split']:.0f} ({d / row['split']:.2f}×) | "
                         f"{row['flash']:.0f} ({d / row['flash']:.2f}×) | {pick} |")
            print(lines[-1], flush=True)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{args.name}.json"
    path.write_text(json.dumps({"environment": env, "runs": runs, "notes": lines}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

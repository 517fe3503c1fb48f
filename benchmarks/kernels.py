"""Micro-benchmarks behind two implementation choices, one thread, medians → benchmarks/results/kernels.txt.

  decode attention  one query (9 heads, 3 KV heads, d_h 64) over 512 cached entries: SDPA with dense values,
                    SDPA with absorbed value latents (width 192 ≠ 64: its math fallback), and
                    `grouped_attention` on the same latents (what LatentAttention uses for ≤ 16 new queries)
  pivot_tokens      the serving form's token pick at n = 1024 prompt tokens, r = 252 and 508, batch 2

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/kernels.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from attnslim.linalg.attention import grouped_attention
from attnslim.modules.principal_serving import pivot_tokens

OUT = Path(__file__).parent / "results" / "kernels.txt"


def median_us(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 9, 1, 64, generator=g)
    k, v = torch.randn(1, 3, 512, 64, generator=g), torch.randn(1, 3, 512, 64, generator=g)
    latent = torch.randn(1, 1, 512, 192, generator=g)  # (b, 1, kv, r_v): one shared value latent
    rows = [
        ("SDPA, dense values (d_h 64)",
         median_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), 300)),
        ("SDPA, value latents (192 wide, expanded)",
         median_us(lambda: F.scaled_dot_product_attention(q, k, latent.expand(1, 3, 512, 192), enable_gqa=True),
                   300)),
        ("grouped_attention, value latents", median_us(lambda: grouped_attention(q, k, latent, None, 0.125), 300)),
    ]
    for r in (252, 508):
        x = torch.randn(2, 1024, 576, generator=g)
        u = torch.linalg.svd(x, full_matrices=False).U[..., :r]
        avail = torch.ones(2, 1024, dtype=torch.bool)
        rows.append((f"pivot_tokens n=1024 r={r} batch 2", median_us(partial(pivot_tokens, u, avail, r), 3, warmup=1)))
    lines = ["| kernel | median µs (1 thread) |", "|---|---|"] + [f"| {name} | {us:,.0f} |" for name, us in rows]
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""ATP's motivating analysis (seed 004 §3, Fig. 1/5): how low-rank are sequences?

For each sequence length L, the first n windows of L tokens of the source's evaluation split are run through
the model; for the embedding output ("embed", the paper's Fig. 1) and the input of every attention layer (what
ATP decomposes, after the pre-attention norm) we record, per sequence:
  - ratio   ⌈2^μ⌉ / L with μ the SVD entropy of Eq. 4 (Rényi-2 of the L1-normalised singular values, the
            paper's literal form; `ratio_shannon` uses the classical Shannon form, always ≥);
  - energy  Σ_{i≤r} σ_i² / Σ σ_i² for r = ⌈f·L⌉, f in `fractions` (Fig. 5).
The SVD is uncentred (as ATP's). Distributions over sequences are kept (values) and summarised
(mean, p10, p50, p90). One SVD per layer and sequence, float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from tqdm import tqdm

from attnslim import _compat
from attnslim.adapters import get_adapter
from attnslim.calib.hooks import capture_sites
from attnslim.data import eval_windows
from attnslim.linalg.pca import resolve_rank

FRACTIONS = (0.125, 0.25, 0.5, 0.75)


def spectrum_stats(x: torch.Tensor, fractions: Sequence[float] = FRACTIONS) -> dict[str, Any]:
    """Low-rankness of one sequence x (L, d): the same definitions as linalg/pca (svd_entropy_rank, energy_kept)."""
    s = torch.linalg.svdvals(x.detach().to(torch.float64))  # (min(L, d),)
    length, total = x.shape[0], float(s.sum())
    if total == 0.0:
        return {"ratio": 0.0, "ratio_shannon": 0.0, "energy": {str(f): 1.0 for f in fractions}}
    p = s / total
    renyi = min(max(1, math.ceil(1.0 / float(p.square().sum()) - 1e-6)), s.numel())
    q = p[p > 0]
    shannon = min(max(1, math.ceil(2.0 ** float(-(q * torch.log2(q)).sum()) - 1e-6)), s.numel())
    s2 = s.square()
    energy = {str(f): float(s2[: resolve_rank(length, float(f))].sum() / s2.sum()) for f in fractions}
    return {"ratio": renyi / length, "ratio_shannon": shannon / length, "energy": energy}


@contextmanager
def _layer_inputs(model: Any, sink: dict[str, torch.Tensor]) -> Iterator[None]:
    """While active, every forward stores the embedding output and each attention layer's input in `sink`."""
    adapter = get_adapter(model)

    def store(key: str) -> Callable[[str, torch.Tensor], None]:
        return lambda _site, x: sink.__setitem__(key, x)

    with ExitStack() as stack:
        for i in range(adapter.num_layers()):
            stack.enter_context(capture_sites(adapter, i, {"attn_in"}, store(str(i))))
        handle = adapter.embed_tokens().register_forward_hook(lambda _m, _a, out: sink.__setitem__("embed", out))
        stack.callback(handle.remove)
        yield


def _summary(values: list[float]) -> dict[str, float]:
    t = torch.tensor(values, dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
    return {"mean": float(t.mean()), "p10": float(q[0]), "p50": float(q[1]), "p90": float(q[2])}


@torch.no_grad()
def lowrank_report(
    model: Any, tokenizer: Any, source: str = "wiki", lengths: Sequence[int] = (128, 256, 512, 1024), n: int = 8,
    fractions: Sequence[float] = FRACTIONS, progress: bool = True,
) -> dict[str, Any]:
    """Per length and site ("embed", "0", "1", ...): distributions of the rank ratio and energy kept (see module)."""
    device = _compat.input_device(model)
    report: dict[str, Any] = {"source": source, "n": n, "fractions": list(fractions), "lengths": {}}
    for length in lengths:
        windows = eval_windows(source, tokenizer, tokens=n * length, seq_len=length)
        per_site: dict[str, dict[str, list[float]]] = {}
        for row in tqdm(windows.ids, desc=f"lowrank L={length}", disable=not progress, leave=False):
            inputs: dict[str, torch.Tensor] = {}
            with _layer_inputs(model, inputs):
                model(input_ids=row[None].to(device), use_cache=False)
            for site, x in inputs.items():
                stats = spectrum_stats(x[0], fractions)
                bucket = per_site.setdefault(site, {"ratio": [], "ratio_shannon": [],
                                                    **{f"energy@{f}": [] for f in fractions}})
                bucket["ratio"].append(stats["ratio"])
                bucket["ratio_shannon"].append(stats["ratio_shannon"])
                for f in fractions:
                    bucket[f"energy@{f}"].append(stats["energy"][str(f)])
        report["lengths"][str(length)] = {
            "description": windows.description,
            "sites": {site: {key: {"values": vals, **_summary(vals)} for key, vals in stats.items()}
                      for site, stats in per_site.items()},
        }
    return report


def format_lowrank(report: dict[str, Any]) -> str:
    """Text table: median rank ratio ⌈2^μ⌉/L (p10–p90) per site and length, and mean energy kept at the largest L."""
    lengths = list(report["lengths"])
    last = report["lengths"][lengths[-1]]["sites"]
    fractions = report["fractions"]
    sites = sorted(last, key=lambda s: -1 if s == "embed" else int(s))
    head = ["site"] + [f"ratio L={n}" for n in lengths] + [f"energy@{f:g} (L={lengths[-1]})" for f in fractions]
    lines = [_row(head), _row(["---"] * len(head))]
    for site in sites:
        cells = [site]
        for n in lengths:
            r = report["lengths"][n]["sites"][site]["ratio"]
            cells.append(f"{r['p50']:.3f} ({r['p10']:.3f}-{r['p90']:.3f})")
        cells += [f"{last[site][f'energy@{f}']['mean']:.3f}" for f in fractions]
        lines.append(_row(cells))
    lines.append(f"\nsource {report['source']}, {report['n']} sequences per length; ratio = ceil(2^mu)/L, "
                 "mu = Renyi-2 SVD entropy (paper Eq. 4); site = input of that attention layer (embed = embeddings)")
    return "\n".join(lines)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"

"""Rank allocation for `latentllm` (LatentLLM §5, Table 3): pure functions of matrix shapes.

Rule (uniform): every compressed linear keeps a fraction κ of its own weights under the real parameter count
of its factors — r(d_out + d_in) − r² with the block-identity junction, r(d_out + d_in) with dense factors.
For MHA this is exactly the paper's joint-QK rule with r_q = r_k (the per-head J_i term is not implemented);
for GQA it gives r_k < r_q, the same fraction of each matrix. A target fraction of the *total* parameters is
met by one κ shared by every compressed linear of every layer (bisection over κ, integer ranks included).
The ablation forms count their own weights: `qkv` (qk=joint_qkv) is one factor pair of the stacked
(d_q + 2 d_kv) × d matrix, r(d_q + 2 d_kv + d) [− r²]; the linears named in `heads` (qk=split_head) hold
r d_in + d_out r/h, their ranks multiples of h (linalg/split_head.py).
"""

from __future__ import annotations

import heapq
import warnings
from collections.abc import Callable, Mapping

import torch

from attnslim.errors import AttnslimError
from attnslim.linalg.ranks import factor_weights, max_rank, rank_for_ratio
from attnslim.linalg.split_head import split_head_max_rank, split_head_rank_for_ratio, split_head_weights

ATTENTION = ("q", "k", "v", "o")
ATTENTION_GROUP = (*ATTENTION, "qkv")  # "qkv": the stacked q/k/v of qk=joint_qkv
MLP = ("gate", "up", "down")
Shapes = Mapping[str, tuple[int, int]]  # linear name -> (d_out, d_in)
Heads = Mapping[str, int]  # split-head linear name -> its head count (h for q, n_kv for k)
NO_HEADS: Heads = {}


def uniform_ranks(shapes: Shapes, kappa: Mapping[str, float], junction: str, heads: Heads = NO_HEADS
                  ) -> dict[str, int]:
    """Per-linear ranks keeping kappa[name] of each matrix's weights (split-head linears by their own count)."""
    return {n: split_head_rank_for_ratio(d_out, d_in, kappa[n], heads[n]) if n in heads
            else rank_for_ratio(d_out, d_in, kappa[n], junction) for n, (d_out, d_in) in shapes.items()}


def dense_weights(shapes: Shapes) -> int:
    return sum(d_out * d_in for d_out, d_in in shapes.values())


def kept_weights(shapes: Shapes, ranks: Mapping[str, int], junction: str, heads: Heads = NO_HEADS) -> int:
    return sum(split_head_weights(d_out, d_in, ranks[n], heads[n]) if n in heads
               else factor_weights(d_out, d_in, ranks[n], junction) for n, (d_out, d_in) in shapes.items())


def kappa_for_total(
    per_layer: list[Shapes], total_before: int, total_ratio: float, junction: str, where: str = "latentllm",
    heads: Heads = NO_HEADS,
) -> float:
    """Largest uniform κ such that compressing the linears `per_layer[j]` of each of the step's layers leaves
    at most total_ratio · total_before parameters (embeddings, norms, biases and the layers outside the step
    are kept as they are)."""

    def total_after(kappa: float) -> int:
        saved = 0
        for shapes in per_layer:
            ranks = uniform_ranks(shapes, dict.fromkeys(shapes, kappa), junction, heads)
            saved += dense_weights(shapes) - kept_weights(shapes, ranks, junction, heads)
        return total_before - saved

    target = total_ratio * total_before
    if total_after(1e-9) > target:
        floor = total_after(1e-9) / total_before
        names = sorted({n for shapes in per_layer for n in shapes})
        raise AttnslimError(
            f"{where}: total_ratio={total_ratio} is unreachable: compressing {names} in the {len(per_layer)} "
            f"layers of this step to rank 1 still keeps {floor:.3f} of the parameters (embeddings, norms and the "
            f"other layers stay); use total_ratio >= {floor:.3f}, more layers, or compress more linears "
            "(mlp: local | joint_ud)"
        )
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if total_after(mid) <= target else (lo, mid)
    return lo


def check_explicit(
    ranks: Mapping[str, int], shapes: Shapes, junction: str, cap: bool, layer: int, heads: Heads = NO_HEADS
) -> dict[str, int]:
    """Explicit ranks, refused (or capped, with a warning, when `cap`) where they would not save weights; a
    split-head linear's rank must be a multiple of its head count."""
    out: dict[str, int] = {}
    for name, (d_out, d_in) in shapes.items():
        if name not in ranks:
            raise AttnslimError(
                f"latentllm: ranks has no entry for {name!r} (layer {layer}); give ranks for {sorted(shapes)}"
            )
        r = ranks[name]
        top = split_head_max_rank(d_out, d_in, heads[name]) if name in heads else max_rank(d_out, d_in, junction)
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise AttnslimError(f"latentllm: ranks[{name!r}]={r!r} is invalid; valid: an integer 1..{top}")
        if name in heads and r % heads[name]:
            raise AttnslimError(
                f"latentllm: ranks[{name!r}]={r} (layer {layer}) is not a multiple of its {heads[name]} heads: "
                f"qk=split_head gives every head r/h latents; use a multiple of {heads[name]} (e.g. "
                f"{max(heads[name], r - r % heads[name])})")
        if r > top:
            why = (f"rank {r} for the {d_out}x{d_in} {name} weight (layer {layer}) would increase its "
                   f"parameters with junction={junction!r}; the largest rank that does not is {top}")
            if not cap:
                raise AttnslimError(f"latentllm: {why}; lower it or set cap_ranks: true to cap it")
            warnings.warn(f"latentllm: {why}; capped to {top} (cap_ranks)", stacklevel=3)
            r = top
        out[name] = r
    return out


def check_joint_qk(ranks: Mapping[str, int], head_dim: int, layer: int) -> None:
    """Joint QK needs r_q, r_k >= head_dim: each head's bilinear form W_qᵢᵀW_kᵢ has rank up to head_dim."""
    low = {n: ranks[n] for n in ("q", "k") if ranks[n] < head_dim}
    if low:
        raise AttnslimError(
            f"latentllm: layer {layer}: joint QK ranks {low} are below head_dim={head_dim}; every head's "
            f"q·k form has rank up to head_dim, so the shared latent would cut all heads at once. Use ranks "
            f">= {head_dim} (a larger ratio), or qk: split"
        )


def spectrum_ranks(
    spectra: Mapping[str, torch.Tensor], shapes: Shapes, budget: int, junction: str,
    floor: Mapping[str, int] | None = None, unit: str = "weights",
) -> dict[str, int]:
    """Data-driven allocation within one group of linears: the ranks minimising Σ_m (lost whitened energy of
    m) / (total whitened energy of m) under a budget, by greedy marginal gain per unit of cost.

    spectra[m]: descending singular values (k,) of W_m P_m (the local activation-aware spectrum), so the
    lost energy at rank r is Σ_{i>r} σ_i². unit "weights": Σ_m weights(m) <= budget; unit "ranks": Σ_m r_m
    <= budget (a KV-cache budget: each rank of k or v is one cached value per token). floor[m]: the smallest
    rank allowed (head_dim for joint QK).
    """
    floor = floor or {}
    energy = {m: (s.double() ** 2) / float((s.double() ** 2).sum()) for m, s in spectra.items()}
    ranks = {m: max(1, floor.get(m, 1)) for m in shapes}

    def size(m: str, r: int) -> int:
        return r if unit == "ranks" else factor_weights(*shapes[m], r, junction)

    spent = sum(size(m, ranks[m]) for m in shapes)
    if spent > budget:
        raise AttnslimError(
            f"latentllm: the rank floors {ranks} already need {spent} {unit}, over the budget {budget}; "
            "raise the ratio (or kv_ratio), or use alloc: uniform"
        )
    heap: list[tuple[float, str]] = []

    def push(m: str) -> None:
        if ranks[m] < max_rank(*shapes[m], junction):
            step = max(size(m, ranks[m] + 1) - size(m, ranks[m]), 1)
            heapq.heappush(heap, (-float(energy[m][ranks[m]]) / step, m))

    for m in shapes:
        push(m)
    while heap:
        _, m = heapq.heappop(heap)
        step = size(m, ranks[m] + 1) - size(m, ranks[m])
        if spent + step > budget:
            continue  # this matrix no longer fits; others with cheaper steps may
        ranks[m] += 1
        spent += step
        push(m)
    return ranks


def groups(shapes: Shapes) -> dict[str, dict[str, tuple[int, int]]]:
    """{"attention": {...}, "mlp": {...}}: the non-empty parameter groups of `shapes`."""
    out = {"attention": {n: s for n, s in shapes.items() if n in ATTENTION_GROUP},
           "mlp": {n: s for n, s in shapes.items() if n in MLP}}
    return {g: s for g, s in out.items() if s}


def allocate(
    shapes: Shapes, ranks: Mapping[str, int], spectra: Callable[[list[str]], Mapping[str, torch.Tensor]], *,
    alloc: str, kv_ratio: float | None, kv_full: int, junction: str, floors: Mapping[str, int],
    dense_keys: bool = False,
) -> dict[str, int]:
    """kv_ratio: r_k + r_v <= kv_ratio · 2 · kv_full (the dense cache per token is 2 · n_kv · d_h values), split
    by spectrum energy per cached value; with v left dense (no "v" in shapes) only r_k is cut; with dense_keys
    (cache=values: rotated keys are cached) only r_v is cut, to kv_ratio · 2 · kv_full − kv_full.
    alloc=spectrum: the rest of each group's weight budget (that of `ranks`) re-spread by energy per weight."""
    out = dict(ranks)
    fixed: set[str] = set()
    if kv_ratio is not None:
        names = ([] if dense_keys else ["k"]) + (["v"] if "v" in shapes else [])
        dense_part = (kv_full if dense_keys else 0) + (0 if "v" in shapes else kv_full)
        kv = int(kv_ratio * 2 * kv_full) - dense_part  # latent values cached per token
        if not names or kv < len(names):
            raise AttnslimError(f"latentllm: kv_ratio={kv_ratio} leaves no room for latents: dense keys or values "
                                f"already hold {dense_part} of {2 * kv_full} cached values per token; raise kv_ratio "
                                "above that share (cache=values needs vo != none and kv_ratio > 0.5)")
        out |= spectrum_ranks(spectra(names), {n: shapes[n] for n in names}, kv, junction, floors, unit="ranks")
        fixed = set(names)
    if alloc == "spectrum":
        for sub in groups(shapes).values():
            free = {n: s for n, s in sub.items() if n not in fixed}
            if free:
                # the group's budget is that of the incoming ranks; the KV-fixed ranks' weights come off it
                budget = kept_weights(sub, ranks, junction) - kept_weights(
                    {n: sub[n] for n in fixed if n in sub}, out, junction)
                out |= spectrum_ranks(spectra(list(free)), free, budget, junction, floors)
    return out

"""Joint QKV activation-aware factorisation, LatentLLM App. C (Eq. 50, Remark 8): the paper's ablation.

Approximated: the stacked projection [W_q; W_k; W_v] x + [b_q; b_k; b_v] ((h·d_h + 2·n_kv·d_h) rows under GQA) by
[B_q; B_k; B_v] (A x) + b̂ with ONE shared A (r, d_in): min E‖(W − B A) x‖² over the stacked W, whose optimum is
svd_r(W C^{1/2}) (RootCov; C the centred covariance C0 with the bias correction b̂ = b + (W − BA) μ when the layer
has biases, exactly the local fit of linalg.lowrank.factorize, which this calls on the stacked matrix).
RoPE acts on q and k after they are formed, so a shared input-side A needs nothing RoPE-specific.
Weights: r (d_q + 2 d_kv + d_in), minus r² with a block-identity/LU junction; split QKV at one rank r stores
3r(d' + d) [− 3r²] for d_q = d_kv = d' (App. C: 50% more rank for joint QKV at equal size).
Remark 8: worse end to end than joint QK, since q, k and v magnitudes are not balanced in one loss.
"""

from __future__ import annotations

import torch

from attnslim.linalg.lowrank import LowRankFactors, factorize
from attnslim.linalg.precond import ROOTCOV, PrecondSpec
from attnslim.linalg.ranks import factor_weights
from attnslim.linalg.stats import InputStats


def joint_qkv_weights(d_q: int, d_kv: int, d_in: int, rank: int, junction: str) -> int:
    """Weights of the shared-A factors: A (r, d_in), stacked B (d_q + 2 d_kv, r), r² fewer with a saving junction."""
    return factor_weights(d_q + 2 * d_kv, d_in, rank, junction)


def stack_qkv(
    w: tuple[torch.Tensor, torch.Tensor, torch.Tensor], b: tuple[torch.Tensor | None, ...]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W_q (d_q, d), W_k (d_kv, d), W_v (d_kv, d)) and their biases -> W (d_q + 2 d_kv, d) and the stacked bias
    (None when no part has one; a missing part's bias is zeros, so b̂ corrects it like the others)."""
    big_w = torch.cat(w)  # (d_q + 2 d_kv, d)
    if all(x is None for x in b):
        return big_w, None
    parts = [torch.zeros(m.shape[0], dtype=m.dtype, device=m.device) if x is None else x
             for m, x in zip(w, b, strict=True)]
    return big_w, torch.cat(parts)  # (d_q + 2 d_kv,)


def joint_qkv_factorize(
    w: tuple[torch.Tensor, torch.Tensor, torch.Tensor], b: tuple[torch.Tensor | None, ...], stats: InputStats,
    rank: int, *, precond: PrecondSpec = ROOTCOV, junction: str = "block_identity", label: str = "layer",
) -> LowRankFactors:
    """Shared-A factors of the stacked q/k/v: B (d_q + 2 d_kv, r) whose row blocks are B_q, B_k, B_v, A (r, d_in),
    the stacked bias b̂ (float64). `precond`, `junction` as `factorize` (the junction gauges the shared pair)."""
    big_w, big_b = stack_qkv(w, b)
    return factorize(big_w, big_b, stats, rank, precond=precond, junction=junction, label=f"{label} qkv")

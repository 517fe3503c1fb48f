"""One attention layer -> multi-head latent attention with decoupled RoPE (pure math; modules/mla.py runs it).

Per token x (d,), with the stacked keys k = W_k x + b_k split by a `RotarySplit` (linalg/mla_rope.py):
    rotary key     k_r = R_k k                      (d_rope,)  cached after RoPE, shared by every head
    latent         c = A x                          (r,)       cached
    [k_n; v] ≈ B c, B = [B_k; B_v]                  (D_n + n_kv·d_h, r): non-rotary key and every head's value
    query head i   q_i = W_q,i x + b_q,i;  q_r,i = R_q,i q_i (d_rope,);  q_n,i = N_q,i q_i (D_n,)
    logit          q_n,i · k_n + RoPE(q_r,i) · RoPE(k_r)
Decode absorbs B_k into the query (q̃_i = B_kᵀ N_q,i q_i, (r,)) and B_v into the output; modules/mla.py.
Exact parts: the rotary split (every component kept reproduces the logits), the query and rotary-key biases,
the non-rotary key bias (q_n,i · b_n is the same for every key: softmax ignores it, so it is dropped) and the
value bias (softmax rows sum to one: folded into the output bias, b_o + W_o b_v).
Approximated: the de-rotated components lose their phase, and [k_n; v] = W_kv x is fitted at rank r by
    min E‖S (W_kv − B A)(x − μ)‖²  =>  B = S⁻¹ U_r, A = U_rᵀ S W_kv, U_r the top-r left singular vectors of
    S W_kv C^{1/2}; the mean error of the values (W_v − B_v A) μ joins the value bias (LatentLLM Eq. 45).
S is the output-side weight (`kv_weight`), C the input covariance (`centre`: centred, or the second moment
TransMLA's PCA uses, or the identity for a plain truncated SVD of the weights).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnslim.errors import AttnslimError
from attnslim.linalg.lowrank import LowRankFactors, block_identity
from attnslim.linalg.mla_rope import RotarySplit
from attnslim.linalg.precond import root_pair
from attnslim.linalg.stats import InputStats

_F64 = torch.float64


@dataclass(frozen=True)
class MLAFactors:
    """Everything MLAAttention holds besides q_proj (unchanged) and o's weight (unchanged).

    q_rope (h, d_rope, d_h), q_nope (h, D_n, d_h), freq (d_rope/2,) long, k_rope (d_rope, d) and its bias
    (d_rope,) or None, kv: LowRankFactors B (D_n + n_kv·d_h, r), A (r, d), block-identity perm; o_bias (d_out,).
    """

    q_rope: torch.Tensor
    q_nope: torch.Tensor
    freq: torch.Tensor
    k_rope: torch.Tensor
    k_rope_bias: torch.Tensor | None
    kv: LowRankFactors
    o_bias: torch.Tensor


def second_moment(w: torch.Tensor, b: torch.Tensor | None, stats: InputStats) -> torch.Tensor:
    """(m, m) E[y yᵀ] of y = W x + b, W (m, d), from the streamed input statistics."""
    w64 = w.to(_F64)
    out = w64 @ stats.corr @ w64.T
    if b is not None:
        wb = torch.outer(w64 @ stats.mean, b.to(_F64))  # (m, m) E[W x] bᵀ
        out = out + wb + wb.T + torch.outer(b.to(_F64), b.to(_F64))
    return 0.5 * (out + out.T)


def mean_square(w: torch.Tensor, b: torch.Tensor | None, stats: InputStats) -> float:
    """E[mean_j y_j²] of y = W x + b (m outputs): the mean square of one output entry."""
    return float(torch.trace(second_moment(w, b, stats))) / w.shape[0]


def head_moments(q: torch.Tensor, q_bias: torch.Tensor | None, stats: InputStats, n_heads: int) -> torch.Tensor:
    """(h, d_h, d_h) E[q_i q_iᵀ] per query head of q = W_q x + b_q, W_q (h·d_h, d)."""
    d_h = q.shape[0] // n_heads
    full = second_moment(q, q_bias, stats).view(n_heads, d_h, n_heads, d_h)
    return full.diagonal(dim1=0, dim2=2).permute(2, 0, 1)  # (d_h, d_h, h) -> (h, d_h, d_h)


def attention_weight(q: torch.Tensor, q_bias: torch.Tensor | None, v: torch.Tensor, o: torch.Tensor,
                     split: RotarySplit, stats: InputStats, *, n_heads: int, n_kv_heads: int, scaling: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Output-side weights of the [k_n; v] fit: (D_n, D_n) for the keys, (n_kv·d_h, n_kv·d_h) for the values.

    Keys: an error e in k_n moves head i's logit by scaling · q_n,iᵀ e; a logit error moves the output by about
    the spread of that head's outputs W_o,i v over the keys, so it is weighted by w_i = tr(W_o,i Cov(v) W_o,iᵀ):
    Σ_i w_i scaling² N_q,i E[q_i q_iᵀ] N_q,iᵀ. Values: head i's error reaches the output through W_o,i:
    block g = Σ_{i in g} W_o,iᵀ W_o,i. (First-order, keys independent of queries; measured in BENCHMARKS.)
    """
    h, d_h = n_heads, o.shape[1] // n_heads
    g = n_heads // n_kv_heads
    o_heads = o.to(_F64).view(o.shape[0], h, d_h).transpose(0, 1)  # (h, d_out, d_h)
    cov_v = v.to(_F64) @ stats.centred_cov @ v.to(_F64).T  # (n_kv·d_h, n_kv·d_h)
    q_mom = head_moments(q, q_bias, stats, h)  # (h, d_h, d_h)
    d_n = split.nope_key.shape[0]
    w_k = torch.zeros(d_n, d_n, dtype=_F64)
    w_v = torch.zeros_like(cov_v)
    for i in range(h):
        s = slice((i // g) * d_h, (i // g + 1) * d_h)
        spread = float(torch.trace(o_heads[i] @ cov_v[s, s] @ o_heads[i].T))
        nq = split.nope_query[i].to(_F64)  # (D_n, d_h)
        w_k += spread * scaling**2 * (nq @ q_mom[i] @ nq.T)
        w_v[s, s] += o_heads[i].T @ o_heads[i]
    return w_k, w_v


def _weighted(w_kv: torch.Tensor, cov: torch.Tensor, weights: list[torch.Tensor] | None, damp: float, label: str
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e (D,) descending, U (D, D) its eigenvectors, S W (D, d), S⁻¹ (D, D)) of S W C Wᵀ S."""
    d_out, d_in = w_kv.shape
    s, s_inv = torch.eye(d_out, dtype=_F64), torch.eye(d_out, dtype=_F64)
    if weights is not None:
        start = 0
        for blk in weights:
            n = blk.shape[0]
            if n:  # no warning: a rank-deficient output weight (key directions no query reads) is expected, and
                # errors in its null space do not reach the output, so λ deciding those directions is harmless
                s[start : start + n, start : start + n], s_inv[start : start + n, start : start + n] = root_pair(
                    blk, damp, label=f"{label} output weight", warn=False)
            start += n
    sw = s @ w_kv.to(_F64)  # (D, d)
    c = cov.to(_F64)  # damped like every LatentLLM covariance: directions calibration never saw keep their weight
    c = c + damp * float(torch.diagonal(c).mean()) * torch.eye(d_in, dtype=_F64)
    e, u = torch.linalg.eigh(sw @ c @ sw.T)  # (D,) ascending: left singular vectors of S W C^{1/2}
    order = torch.argsort(e, descending=True)
    return e[order].clamp_min(0.0), u[:, order], sw, s_inv


def latent_spectrum(w_kv: torch.Tensor, cov: torch.Tensor, weights: list[torch.Tensor] | None, damp: float,
                    label: str) -> torch.Tensor:
    """(min(D, d),) descending squared singular values of S W_kv C^{1/2}: rank k + 1 removes entry k of the
    weighted error `fit_latent` leaves."""
    e = _weighted(w_kv, cov, weights, damp, label)[0]
    return e[: min(w_kv.shape)]


def fit_latent(w_kv: torch.Tensor, cov: torch.Tensor, rank: int, weights: list[torch.Tensor] | None,
               damp: float, label: str) -> LowRankFactors:
    """W_kv (D, d) ≈ B A at rank r minimising ‖S (W_kv − B A) C^{1/2}‖, S = blockdiag(weights)^{1/2} (the
    identity for None), C = cov (d, d) + λI, λ = damp · mean(diag(cov)). Returned with the block-identity
    junction (A has an r×r identity block)."""
    if not 1 <= rank <= min(w_kv.shape):
        raise AttnslimError(f"{label}: kv rank = {rank} is out of range; valid 1..{min(w_kv.shape)}")
    _, u, sw, s_inv = _weighted(w_kv, cov, weights, damp, label)
    u_r = u[:, :rank]  # (D, r)
    b, a = s_inv @ u_r, u_r.T @ sw  # (D, r), (r, d)
    b2, a2, perm = block_identity(b, a)
    return LowRankFactors(b2, a2, None, perm)


def allocate_ranks(spectra: dict[int, torch.Tensor], budget: int, floor: int) -> dict[int, int]:
    """Latent ranks per layer summing to `budget`, each >= `floor` and <= its spectrum's length: the largest
    entries of the spectra, each normalised to unit total energy (the relative weighted error each rank removes,
    comparable across layers), greedily — LatentLLM's alloc=global, for one cached latent per layer."""
    ranks = {i: min(floor, int(e.numel())) for i, e in spectra.items()}
    if sum(ranks.values()) > budget:
        raise AttnslimError(f"the KV budget of {budget} latent values over {len(spectra)} layers is below the "
                            f"floor of {floor} per layer; raise kv_ratio")
    gains = [(float(e[k]) / max(float(e.sum()), 1e-300), i, k) for i, e in spectra.items()
             for k in range(ranks[i], e.numel())]
    gains.sort(reverse=True)
    for _, i, _k in gains[: budget - sum(ranks.values())]:
        ranks[i] += 1
    return ranks


def assemble(q: torch.Tensor, k: torch.Tensor, k_bias: torch.Tensor | None, v: torch.Tensor,
             v_bias: torch.Tensor | None, o: torch.Tensor, o_bias: torch.Tensor | None, split: RotarySplit,
             kv: LowRankFactors, mean: torch.Tensor | None) -> MLAFactors:
    """The module's tensors from the split and the fitted latent; `mean` (d,) adds the value mean correction."""
    d_h = split.rope_query.shape[2]
    k64, d_n = k.to(_F64), split.nope_key.shape[0]
    k_rope = split.rope_key @ k64  # (d_rope, d)
    k_rope_bias = None if k_bias is None else split.rope_key @ k_bias.to(_F64)
    b_v = torch.zeros(v.shape[0], dtype=_F64) if v_bias is None else v_bias.to(_F64)
    if mean is not None:
        b_v = b_v + (v.to(_F64) - kv.B[d_n:] @ kv.A) @ mean.to(_F64)  # (n_kv·d_h,)
    o64 = o.to(_F64)
    g = q.shape[0] // d_h // (v.shape[0] // d_h)
    b_heads = b_v.view(-1, d_h).repeat_interleave(g, 0).reshape(-1)  # (h·d_h,): query head i sees v of g(i)
    new_o_bias = o64 @ b_heads + (0 if o_bias is None else o_bias.to(_F64))
    return MLAFactors(split.rope_query, split.nope_query, split.freq, k_rope, k_rope_bias, kv, new_o_bias)


"""Per-sequence principal components of a layer input (ATP, Niu, Prakash, Avestimehr; paper §4, Eq. 5, Alg. 1).

ATP writes one sequence's hidden states X (L, d) as X ≈ U X′ with U (L, r) orthonormal columns and X′ (r, d)
whose row i is σ_i v_iᵀ (uncentred truncated SVD, Eq. 5), then attends over the r rows of X′ instead of the
L tokens.

- `method="exact"`: LAPACK/cuSOLVER SVD, the Eckart–Young optimum.
- `method="approx"`: the paper's Alg. 1 (rank-1 alternating least squares with deflation, `iters` inner
  steps), matrix products only. The paper leaves its initialisation open; here v⁰ is the residual's
  largest-norm row (deterministic, already in the row space). The returned U uses û_i = u_i/‖u_i‖ and
  X′ = ÛᵀX, which holds exactly because Alg. 1's u_i are mutually orthogonal (each inner loop ends with the
  v-update).

Conventions shared by both methods, and why:
- components are sorted by σ descending and given a canonical sign (`sign="colsum"`: Σ_l U_{l,i} > 0 as the
  notes' G7 recommend, ties by the largest-|·| entry of v_i; `"maxabs"`: largest-|·| entry of v_i positive),
  so outputs do not depend on the solver's arbitrary sign flips;
- components with σ ≈ 0 (rank-deficient input, r > rank, padding) come back as exact zero columns of U and
  zero rows of X′ instead of an arbitrary orthonormal complement: deterministic, never NaN, and detectable
  with `component_mask` so attention can mask them;
- padded rows (mask False) are zeroed before the decomposition and their rows of U are zero.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from attnslim.errors import AttnslimError

Method = Literal["exact", "approx"]
SignRule = Literal["colsum", "maxabs"]
_TIE = 1e-6  # |Σ_l U_li| ≤ _TIE·√L counts as a tie in the colsum sign rule


def resolve_rank(length: int, rank: int | float) -> int:
    """Number of components for a sequence of `length` tokens: an int r in [1, L], or a fraction f in (0, 1].

    A fraction gives ⌈f·L⌉ clamped to [1, L] (⌈·⌉ with a 1e-9 tolerance so 0.1·30 is 3, not 4).
    """
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise AttnslimError(f"sequence length must be an int ≥ 1, got {length!r}")
    if isinstance(rank, bool):
        raise AttnslimError(f"rank must be an int in [1, {length}] or a fraction in (0, 1], got {rank!r}")
    if isinstance(rank, int):
        if not 1 <= rank <= length:
            raise AttnslimError(f"r={rank} out of range for sequence length L={length}: need 1 ≤ r ≤ L")
        return rank
    if isinstance(rank, float):
        if not 0.0 < rank <= 1.0:
            raise AttnslimError(f"rank fraction must be in (0, 1], got {rank} (for L={length})")
        return min(length, max(1, math.ceil(rank * length - 1e-9)))
    raise AttnslimError(f"rank must be an int or a float fraction, got {type(rank).__name__} {rank!r}")


def _tolerance(x: torch.Tensor) -> torch.Tensor:
    """σ below this is numerically zero: ‖X‖_F · max(L, d) · eps, per matrix (..., 1)."""
    length, d = x.shape[-2:]
    return torch.linalg.matrix_norm(x).unsqueeze(-1) * (max(length, d) * torch.finfo(x.dtype).eps)


def _maxabs_sign(xp: torch.Tensor) -> torch.Tensor:
    """Sign (..., r) of the largest-|·| entry of each row of xp (..., r, d); 0 for a zero row."""
    idx = xp.abs().argmax(dim=-1, keepdim=True)  # (..., r, 1)
    return torch.take_along_dim(xp, idx, dim=-1).squeeze(-1).sign()


def canonical_signs(
    u: torch.Tensor, xp: torch.Tensor, sign: SignRule = "colsum"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flip components of u (..., L, r), xp (..., r, d) so the rule's statistic is positive; u @ xp unchanged.

    Both rules are odd in the component, so flipping any u_i, x′_i pair before the call gives the same result.
    """
    s = _signs(u.sum(dim=-2), xp, sign, u.shape[-2])  # (..., r)
    return u * s.unsqueeze(-2), xp * s.unsqueeze(-1)


def _signs(col: torch.Tensor, xp: torch.Tensor, sign: SignRule, length: int) -> torch.Tensor:
    """±1 (..., r) that makes the rule's statistic positive, from U's column sums col (..., r) = Uᵀ1 and xp."""
    s = _maxabs_sign(xp)  # (..., r)
    if sign == "colsum":
        s = torch.where(col.abs() > _TIE * math.sqrt(length), col.sign(), s)
    elif sign != "maxabs":
        raise AttnslimError(f"sign rule must be 'colsum' or 'maxabs', got {sign!r}")
    return torch.where(s == 0, torch.ones_like(s), s)


def component_mask(xp: torch.Tensor) -> torch.Tensor:
    """(..., r) bool: True where the component is real (σ > 0); null components are exact zero rows of xp."""
    return xp.ne(0).any(dim=-1)


def _exact(x: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-m SVD factors of x (..., L, d): U (..., L, m), X′ (..., m, d), null components zeroed."""
    u, s, vh = torch.linalg.svd(x, full_matrices=False)  # (..., L, k), (..., k), (..., k, d)
    u, s, vh = u[..., :m], s[..., :m], vh[..., :m, :]
    s = torch.where(s > _tolerance(x), s, torch.zeros_like(s))  # (..., m)
    u = u * s.ne(0).unsqueeze(-2).to(u.dtype)
    return u, s.unsqueeze(-1) * vh


def _alternating(x: torch.Tensor, m: int, iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ATP Alg. 1 on x (..., L, d): m deflation steps of `iters` alternating rank-1 updates; matmuls only."""
    tiny = torch.finfo(x.dtype).tiny
    res = x.clone()  # (..., L, d) deflated residual
    cols, sigmas = [], []
    for _ in range(m):
        idx = res.square().sum(-1).argmax(-1)  # (...,) largest-norm row of the residual
        v = torch.take_along_dim(res, idx[..., None, None], dim=-2).squeeze(-2)  # (..., d)
        u = torch.zeros_like(res[..., 0])  # (..., L)
        for _ in range(iters):
            u = (res @ v.unsqueeze(-1)).squeeze(-1)  # (..., L)
            u = u / v.square().sum(-1, keepdim=True).clamp_min(tiny)
            v = (res.mT @ u.unsqueeze(-1)).squeeze(-1)  # (..., d)
            v = v / u.square().sum(-1, keepdim=True).clamp_min(tiny)
        res = res - u.unsqueeze(-1) * v.unsqueeze(-2)
        cols.append(u)
        sigmas.append(u.norm(dim=-1) * v.norm(dim=-1))  # (...,) norm of the removed rank-1 term
    u = torch.stack(cols, dim=-1)  # (..., L, m)
    # judge σ on the deflation itself: a unit vector built from a round-off residual is a random direction
    keep = torch.stack(sigmas, dim=-1) > _tolerance(x)  # (..., m)
    u = u / u.norm(dim=-2, keepdim=True).clamp_min(tiny) * keep.unsqueeze(-2).to(u.dtype)
    xp = u.mT @ x  # (..., m, d) = ÛᵀX
    order = torch.argsort(xp.norm(dim=-1), dim=-1, descending=True, stable=True)  # (..., m)
    u = torch.take_along_dim(u, order.unsqueeze(-2), dim=-1)
    xp = torch.take_along_dim(xp, order.unsqueeze(-1), dim=-2)
    return u, xp


def principal_components(
    x: torch.Tensor,
    r: int,
    method: Method = "exact",
    iters: int = 2,
    mask: torch.Tensor | None = None,
    sign: SignRule = "colsum",
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-r principal components of each sequence: x (..., L, d) ≈ U (..., L, r) @ X′ (..., r, d).

    U has orthonormal (or zero, for σ ≈ 0) columns; X′ row i = σ_i v_iᵀ = u_iᵀ X. The SVD is uncentred, as in
    the paper. mask (..., L) bool, True = real token. Computed in `compute_dtype`, returned in x.dtype.
    """
    if x.dim() < 2 or not x.is_floating_point():
        raise AttnslimError(f"x must be a floating tensor (..., L, d), got {x.dtype} {tuple(x.shape)}")
    length, d = x.shape[-2:]
    if isinstance(r, bool) or not isinstance(r, int):
        raise AttnslimError(f"r must be an int (use resolve_rank for fractions), got {r!r}")
    resolve_rank(length, r)
    if iters < 1:
        raise AttnslimError(f"iters must be ≥ 1 (the paper uses 2), got {iters}")
    xc = x.detach().to(compute_dtype)
    if mask is not None:
        if mask.dtype != torch.bool or mask.shape != x.shape[:-1]:
            raise AttnslimError(
                f"mask must be bool with shape {tuple(x.shape[:-1])} (True = real token), "
                f"got {mask.dtype} {tuple(mask.shape)}"
            )
        xc = xc * mask.unsqueeze(-1).to(compute_dtype)
    m = min(r, length, d)  # beyond min(L, d) every component is null
    if method == "exact":
        u, xp = _exact(xc, m)
    elif method == "approx":
        u, xp = _alternating(xc, m, iters)
    else:
        raise AttnslimError(f"method must be 'exact' or 'approx', got {method!r}")
    u, xp = canonical_signs(u, xp, sign)
    if mask is not None:
        u = u * mask.unsqueeze(-1).to(compute_dtype)  # exact zeros on padded rows
    if m < r:  # pad with null components so shapes are always (.., L, r), (.., r, d)
        u = torch.nn.functional.pad(u, (0, r - m))
        xp = torch.nn.functional.pad(xp, (0, 0, 0, r - m))
    return u.to(x.dtype), xp.to(x.dtype)


def extend_components(
    xp: torch.Tensor, colsum: torch.Tensor, x_new: torch.Tensor, length: int,
    carried: tuple[tuple[torch.Tensor, torch.Tensor], ...] = (), sign: SignRule = "colsum",
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The block (Brand) update of one sequence's rank-r decomposition when c tokens are appended (decoding with a
    cache, which the ATP paper does not address), without the L earlier tokens or U itself.

    xp (r, d) = UᵀX and colsum (r,) = Uᵀ1 of the `length` tokens so far, x_new (c, d) the new tokens' inputs;
    each carried pair (P (r, k) = UᵀY, Y_new (c, k)) is a row-aligned quantity projected alike (ATP's rotated keys
    K′ = Uᵀ·RoPE(K) and values V′ = UᵀV: stored after rotation, so the update is linear). With B = diag(U, I_c)
    (orthonormal columns) the extended input is B·M, M = [X′; X_new] ((r + c), d), so an SVD M = W S Zᵀ gives the
    extended basis U_ext = B·W_r without forming it: X′_ext = W_rᵀM, U_extᵀ1 = W_rᵀ[colsum; 1], U_extᵀY_ext =
    W_rᵀ[P; Y_new]. Cost O((r + c)²·d) per update, independent of the length.

    Exact when X = U·X′ held (rank ≤ r): the result is then the fresh decomposition of the extended sequence,
    canonical signs included (tests/test_linalg_cca_pca.py). Below that it keeps the best rank-r subspace of the
    approximation it was given, so errors accumulate across updates. Returns (X′_ext (r, d), colsum_ext (r,),
    [U_extᵀY_ext (r, k) per carried pair]), in xp's dtype; null components are zero rows as in principal_components.
    """
    r, c = xp.shape[0], x_new.shape[0]
    if xp.dim() != 2 or x_new.dim() != 2 or x_new.shape[1] != xp.shape[1] or colsum.shape != (r,):
        raise AttnslimError(f"extend_components takes xp (r, d), colsum (r,), x_new (c, d); got "
                            f"{tuple(xp.shape)}, {tuple(colsum.shape)}, {tuple(x_new.shape)}")
    dt = torch.float64
    w, xp_ext = _exact(torch.cat([xp, x_new]).to(dt), r)  # W_r (r + c, r) with null columns zeroed
    col = torch.cat([colsum.to(dt), torch.ones(c, dtype=dt, device=xp.device)]) @ w  # (r,)
    s = _signs(col, xp_ext, sign, length + c)
    out = []
    for p, y_new in carried:
        if p.shape[0] != r or y_new.shape[0] != c or p.shape[1:] != y_new.shape[1:]:
            raise AttnslimError(f"carried pair {tuple(p.shape)}, {tuple(y_new.shape)} does not match r={r}, c={c}")
        out.append(((w.mT @ torch.cat([p, y_new]).to(dt)) * s[:, None]).to(xp.dtype))
    return (xp_ext * s[:, None]).to(xp.dtype), (col * s).to(xp.dtype), out


def _singular_values(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or not x.is_floating_point():
        raise AttnslimError(f"x must be one floating matrix (L, d), got {x.dtype} {tuple(x.shape)}")
    return torch.linalg.svdvals(x.detach().to(torch.float64))  # (min(L, d),) descending


def svd_entropy_rank(x: torch.Tensor, kind: Literal["renyi2", "shannon"] = "renyi2") -> int:
    """ATP's "necessary number of principal components" ⌈2^μ⌉ of x (L, d), in [1, min(L, d)] (0 for x = 0).

    σ̄ = σ / Σσ (L1-normalised), log base 2. "renyi2" is Eq. 4 literally: μ = −log₂ Σσ̄², so 2^μ = (Σσ)²/Σσ².
    "shannon" is the classical SVD entropy μ = −Σ σ̄ log₂ σ̄ (always ≥ renyi2). ⌈·⌉ has a 1e-6 tolerance.
    """
    s = _singular_values(x)
    total = float(s.sum())
    if total == 0.0:
        return 0
    p = s / total
    if kind == "renyi2":
        value = 1.0 / float(p.square().sum())
    elif kind == "shannon":
        p = p[p > 0]
        value = 2.0 ** float(-(p * torch.log2(p)).sum())
    else:
        raise AttnslimError(f"kind must be 'renyi2' or 'shannon', got {kind!r}")
    return min(max(1, math.ceil(value - 1e-6)), s.numel())


def energy_kept(x: torch.Tensor, r: int | float) -> float:
    """Σ_{i≤r} σ_i² / Σ_i σ_i² of x (L, d) (Fig. 5); r an int or a fraction of L. 1.0 for x = 0."""
    s2 = _singular_values(x).square()  # (min(L, d),)
    rank = resolve_rank(int(x.shape[0]), r)
    total = float(s2.sum())
    return float(s2[:rank].sum()) / total if total > 0.0 else 1.0

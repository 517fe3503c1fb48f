"""Junctions of a factor pair W ≈ B A: the free r×r gauge J in B A = (B J)(J⁻¹ A) (LatentLLM §3.3, Remarks 4-5,
App. A.2). Every junction here leaves the product B A unchanged (up to round-off) and stores r(d_out + d_in) − r²
weights instead of r(d_out + d_in), because r² entries become structural (an identity or the zeros and unit
diagonal of a triangle).

  block_identity       (right block identity, Eq. 8-9) A[:, perm[:r]] = I_r:  J = m[:, perm[:r]].
  left_block_identity  (Remark 5-i, App. A.2 "J = [U S]_{:r}⁺") B[out_perm[:r]] = I_r: the same construction on
                       the transposed pair, J = B[out_perm[:r]]⁻¹.
  lu                   (Remark 5-ii, "nullify the upper triangular of B and A like LU factorisation")
                       B[out_perm[:r]] = L (unit lower-triangular), A[:, perm[:r]] = U (upper-triangular), with
                       L U the pivoted LU of the r×r block Ŵ[out_perm[:r]][:, perm[:r]]; L's unit diagonal and
                       both zero triangles are structural: r(r − 1)/2 + r(r + 1)/2 = r² stored for the two blocks.
Pivots (Remark 4; the paper does not say how): QR column pivoting plus maxvol swaps (`pivot_columns`), on A's
columns and on the rows of the right-block-identity B; partial pivoting inside the LU. All math in float64.
"""

from __future__ import annotations

import torch

from attnslim.errors import AttnslimError

_F64 = torch.float64
RANK_TOL = 1e-12  # a pivot column whose residual norm is below this fraction of the first one: rank deficient


def pivot_columns(
    m: torch.Tensor, max_swaps: int | None = None, tol: float = 1.01, what: str = "junction"
) -> torch.Tensor:
    """Column permutation (d,) whose first r columns of m (r, d) form a well-conditioned block.

    QR column pivoting (Businger-Golub) picks r columns greedily; maxvol swaps then exchange a pivot
    column for any column whose coefficient |(J⁻¹ m)_ij| exceeds `tol` (each swap grows |det J|,
    so it terminates), which bounds the entries of A2 = J⁻¹ m[:, rest] by `tol`. A rank-deficient m (no
    invertible r×r block) is refused, naming `what`.
    """
    r, d = m.shape
    res = m.to(_F64).clone()  # (r, d) residual of the columns after projecting out chosen ones
    chosen: list[int] = []
    taken = torch.zeros(d, dtype=torch.bool, device=m.device)
    first = 0.0
    for step in range(r):
        norms = (res * res).sum(0).masked_fill(taken, -1.0)  # (d,)
        j = int(norms.argmax())
        first = float(norms[j]) if step == 0 else first
        if not float(norms[j]) > RANK_TOL**2 * first:  # also catches an all-zero m (first = 0)
            raise AttnslimError(
                f"{what}: the ({r}, {d}) factor has rank {step} < r = {r}, so no r×r block of it is invertible "
                "and the junction cannot put an identity or triangular block there (the fitted product has rank "
                f"below r: W P has fewer than r non-zero singular values). Use a rank <= {step}, or junction: "
                "block_identity (its right factor always has full rank)"
            )
        chosen.append(j)
        taken[j] = True
        qv = res[:, j] / norms[j].sqrt()  # (r,)
        res -= torch.outer(qv, qv @ res)
    piv = torch.tensor(chosen, dtype=torch.long, device=m.device)
    coef = torch.linalg.solve(m[:, piv].to(_F64), m.to(_F64))  # (r, d), identity at piv
    for _ in range(10 * r if max_swaps is None else max_swaps):
        flat = int(coef.abs().argmax())
        i, c = divmod(flat, d)
        if abs(float(coef[i, c])) <= tol:
            break
        row = coef[i] / coef[i, c]  # (d,)
        coef = coef - torch.outer(coef[:, c], row)
        coef[i] = row
        piv[i] = c
    rest = torch.ones(d, dtype=torch.bool, device=m.device)
    rest[piv] = False
    return torch.cat([piv, torch.nonzero(rest).flatten()])


def block_identity(b: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Re-gauge b (d_out, r) @ m (r, d) so the right factor holds an exact I_r (Remark 4, Eq. 8-9).

    Returns (B = b J, A = J⁻¹ m with A[:, perm[:r]] = I_r exactly, perm (d,)), J = m[:, perm[:r]].
    """
    r = m.shape[0]
    perm = pivot_columns(m)
    j = m[:, perm[:r]].to(_F64)  # (r, r)
    a = torch.linalg.solve(j, m.to(_F64))  # (r, d)
    a[:, perm[:r]] = torch.eye(r, dtype=_F64, device=m.device)
    return b.to(_F64) @ j, a, perm


def left_block_identity(b: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Re-gauge b (d_out, r) @ m (r, d) so the left factor holds an exact I_r in r of its rows (Remark 5-i).

    Returns (B = b J with B[out_perm[:r]] = I_r exactly, A = J⁻¹ m, out_perm (d_out,)), J = b[out_perm[:r]]⁻¹:
    `block_identity` of the transposed pair (mᵀ, bᵀ). Needs b of full column rank (r <= d_out)."""
    r = m.shape[0]
    if b.shape[0] < r:
        raise AttnslimError(
            f"junction left_block_identity: B is {tuple(b.shape)}, fewer rows than the rank {r}, so it has no "
            f"r×r identity block. Use a rank <= {b.shape[0]}, or junction: block_identity"
        )
    out_perm = pivot_columns(b.T, what="junction left_block_identity")
    j = b[out_perm[:r]].to(_F64)  # (r, r) = J⁻¹
    big_b = torch.linalg.solve(j, b.to(_F64), left=False)  # (d_out, r) b J
    big_b[out_perm[:r]] = torch.eye(r, dtype=_F64, device=b.device)
    return big_b, j @ m.to(_F64), out_perm


def lu_junction(b: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Re-gauge b (d_out, r) @ m (r, d) into the LU-like form (Remark 5-ii).

    Returns (B (d_out, r), A (r, d), perm (d,), out_perm (d_out,)) with B[out_perm[:r]] = L unit lower-triangular
    and A[:, perm[:r]] = U upper-triangular (both exact), L U = Ŵ[out_perm[:r]][:, perm[:r]] and B A = b m.
    Built on the right block identity (B1, A1 with A1[:, perm[:r]] = I): its row block B1[rows] is the r×r block
    of Ŵ; pivoted LU of that block, B = B1 U⁻¹, A = U A1."""
    r = m.shape[0]
    if b.shape[0] < r:
        raise AttnslimError(
            f"junction lu: B is {tuple(b.shape)}, fewer rows than the rank {r}, so Ŵ has no invertible r×r "
            f"block to factor. Use a rank <= {b.shape[0]}, or junction: block_identity"
        )
    b1, a1, perm = block_identity(b, m)
    out_perm = pivot_columns(b1.T, what="junction lu")  # a well-conditioned row block of Ŵ's pivot columns
    p, lower, upper = torch.linalg.lu(b1[out_perm[:r]])  # (r, r) each; block = p L U
    out_perm[:r] = out_perm[:r][p.argmax(0)]  # rows in LU order: block[order] = pᵀ block = L U
    big_b = torch.linalg.solve_triangular(upper, b1, upper=True, left=False)  # (d_out, r) B1 U⁻¹
    big_b[out_perm[:r]] = lower.tril(-1) + torch.eye(r, dtype=_F64, device=b.device)
    a = upper @ a1  # (r, d)
    a[:, perm[:r]] = upper.triu()
    return big_b, a, perm, out_perm

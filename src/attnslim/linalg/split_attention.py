"""Split-KV ("flash-decoding") attention of a few queries over one shared row per cached token (MLA's latent).

MLA's absorbed decode scores every query head against the same cached rows [c, k_r] and takes the attention-
weighted rows as values: per new token and layer, two skinny GEMMs with M = h·t rows (9 for SmolLM2) over the
whole cache, which BLAS runs on little more than one core, reading the cache twice. Here the cache is cut into
`splits` contiguous pieces, each attended by torch's fused CPU flash kernel (scores and values block by block,
while the block is in cache), the pieces in parallel, and the pieces' outputs are merged exactly by their
log-sum-exps:
    out = Σ_j exp(lse_j − m) o_j / Σ_j exp(lse_j − m),   m = max_j lse_j
(Dao et al., "Flash-Decoding for long-context inference", 2023). Same values as one softmax over all rows, up
to float rounding (tested against `grouped_attention`). Measured: BENCHMARKS "MLA: decode core kernels".

The kernel is `aten::_scaled_dot_product_flash_attention_for_cpu`, the op that `F.scaled_dot_product_attention`
itself dispatches to on the CPU, called directly because only it returns the log-sum-exp. `split_count` says
whether splitting pays; callers use `grouped_attention` where it does not (one thread, short caches, other
devices, a torch without the op), which computes the same values.
"""

from __future__ import annotations

import torch

from attnslim import host

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# cached rows per piece at least. Where MKL runs its fast kernels, the grouped GEMMs win below the kernel's own
# block of 512 keys per piece; where it runs generic code (non-Intel CPUs: `host.mkl_runs_generic_code`) the
# pieces in parallel win from 256 rows per piece on 2 threads (BENCHMARKS "MLA: decode core kernels" and its
# forced-Intel-paths twin, measured on the same host)
MIN_ROWS = 512
MIN_ROWS_GENERIC_BLAS = 256


def split_count(q: torch.Tensor, rows: int) -> int:
    """Pieces for q (b, h, t, e) over `rows` cached rows: one per thread, each at least `MIN_ROWS` rows
    (`MIN_ROWS_GENERIC_BLAS` where MKL runs generic code); 1 where splitting cannot pay (one thread, a short
    cache) or the kernel cannot run (not the CPU, not float32/bfloat16, a torch without the op)."""
    if not runs_on(q):
        return 1
    least = MIN_ROWS_GENERIC_BLAS if host.mkl_runs_generic_code() else MIN_ROWS
    return max(1, min(torch.get_num_threads(), rows // least))


def runs_on(q: torch.Tensor) -> bool:
    """Whether the kernel can run on q's device and dtype in this torch."""
    return _FLASH_CPU is not None and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)


def split_attention(q: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor | None, scaling: float, splits: int
                    ) -> torch.Tensor:
    """q (b, h, t, e) against rows (b, 1, T, e) used as both keys and values -> (b, h, t, e).

    keep (b|1, 1, t, T) boolean or None (every query sees every row). Rows with no allowed key give zeros, as
    in `grouped_attention`. `splits` pieces (at most T), as `split_count` advises; q on the CPU."""
    assert _FLASH_CPU is not None, "split_attention needs torch's CPU flash kernel (see `split_count`)"
    b, h, t, e = q.shape
    total = rows.shape[2]
    n = max(1, min(splits, total))
    size = total // n
    q_rows = q.reshape(b, 1, h * t, e)  # row i·t + s: query s of head i
    mask = None if keep is None else keep.expand(keep.shape[0], 1, t, total).repeat(1, 1, h, 1)  # (b|1, 1, h·t, T)
    # n equal pieces as the kernel's head dimension (b, n, size, e): a view, and one kernel call run in parallel
    pieces = rows[:, 0, : n * size].unflatten(1, (n, size))
    piece_mask = None if mask is None else mask[..., : n * size].unflatten(-1, (n, size)).movedim(-2, 1)[:, :, 0]
    out, lse = _attend_piece(q_rows.expand(b, n, h * t, e), pieces, piece_mask, scaling)  # (b, n, h·t, e|)
    if n * size < total:  # the few rows left over (fewer than n): a second, small kernel call
        tail = _attend_piece(q_rows, rows[:, :, n * size :], None if mask is None else mask[..., n * size :], scaling)
        out, lse = torch.cat([out, tail[0]], dim=1), torch.cat([lse, tail[1]], dim=1)
    weight = torch.softmax(lse, dim=1)  # (b, n', h·t)
    if keep is not None:  # a row with no allowed key in any piece: every lse −inf, NaN weights
        weight = weight.nan_to_num_(0.0)
    return (out * weight.unsqueeze(-1).to(out.dtype)).sum(dim=1).view(b, h, t, e)


def _attend_piece(q: torch.Tensor, k: torch.Tensor, keep: torch.Tensor | None, scaling: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """q (b, n, m, e) against k (b, n, s, e) as keys and values, keep (b|1, n, m, s) or None -> the output
    (b, n, m, e) and log-sum-exp (b, n, m) in float32, −inf where a row has no allowed key."""
    assert _FLASH_CPU is not None
    bias = None
    if keep is not None:  # the kernel takes an additive mask of q's dtype
        bias = torch.zeros(keep.shape, dtype=q.dtype).masked_fill_(~keep, torch.finfo(q.dtype).min)
    out, lse = _FLASH_CPU(q, k, k, scale=scaling, attn_mask=bias)[:2]
    if keep is not None:  # the kernel reports a finite lse for fully masked rows: make them weigh nothing
        lse = lse.masked_fill(~keep.any(dim=-1), float("-inf"))
    return out, lse.float()


"""Shared attention math: the grouped and split decode paths against the reference, and dense layers at full
rank."""

from __future__ import annotations

import pytest
import torch

from attnslim.linalg import split_attention as split
from attnslim.linalg.attention import grouped_attention, repeat_kv, softmax_attention
from attnslim.linalg.lowrank import LowRankFactors
from attnslim.linalg.scores import heads, merge_heads
from attnslim.modules.lowrank import LowRankLinear, compact_linear, empty_compact_linear


@pytest.mark.parametrize("t, softcap", [(1, None), (5, None), (5, 30.0)])
@pytest.mark.parametrize("latent_v", [False, True])
def test_grouped_attention_matches_repeated_heads(t: int, softcap: float | None, latent_v: bool) -> None:
    g = torch.Generator().manual_seed(t)
    b, n, groups, kv, e = 2, 3, 4, 11, 8
    q = torch.randn(b, n * groups, t, e, generator=g)
    k = torch.randn(b, n, kv, e, generator=g)
    v = torch.randn(b, 1 if latent_v else n, kv, 24 if latent_v else e, generator=g)  # a shared latent: width 24
    keep = torch.ones(t, kv, dtype=torch.bool).tril(kv - t)[None, None].repeat(b, 1, 1, 1)
    keep[1, ..., :3] = False  # left padding in the second row
    ref = softmax_attention(q, repeat_kv(k, groups), repeat_kv(v.expand(b, n, kv, v.shape[-1]), groups), keep,
                            0.3, softcap)
    torch.testing.assert_close(grouped_attention(q, k, v, keep, 0.3, softcap), ref)


@pytest.mark.parametrize("t", [1, 3])
def test_grouped_attention_key_scale_is_attention_to_scaled_keys(t: int) -> None:
    """key_scale (a key norm's 1/rms per key and KV head) multiplies the logits: the same as scaled keys."""
    g = torch.Generator().manual_seed(t)
    b, n, groups, kv, e = 2, 2, 3, 9, 8
    q, k = torch.randn(b, n * groups, t, e, generator=g), torch.randn(b, n, kv, e, generator=g)
    v, scale = torch.randn(b, 1, kv, 5, generator=g), torch.rand(b, n, kv, generator=g) * 3
    keep = torch.ones(t, kv, dtype=torch.bool).tril(kv - t)[None, None].repeat(b, 1, 1, 1)
    keep[0, ..., :2] = False
    ref = grouped_attention(q, k * scale[..., None], v, keep, 0.4)
    torch.testing.assert_close(grouped_attention(q, k, v, keep, 0.4, None, scale), ref)
    assert not torch.allclose(grouped_attention(q, k, v, keep, 0.4), ref, atol=1e-3)


def test_grouped_attention_fully_masked_rows_are_zero_not_nan() -> None:
    q, k, v = torch.randn(1, 2, 1, 4), torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4)
    keep = torch.zeros(1, 1, 1, 5, dtype=torch.bool)
    out = grouped_attention(q, k, v, keep, 1.0)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("b, t, rows, splits", [(1, 1, 1100, 2), (2, 1, 1001, 3), (3, 4, 40, 4), (1, 2, 3, 8)])
@pytest.mark.parametrize("mask", ["none", "padding", "batch-shared", "empty-rows"])
def test_split_attention_merges_pieces_into_one_softmax(b: int, t: int, rows: int, splits: int, mask: str) -> None:
    """Pieces (with rows left over when `splits` does not divide them) merged by their log-sum-exps give the one
    softmax of `grouped_attention` over the same rows as keys and values; rows with no allowed key give zeros."""
    g = torch.Generator().manual_seed(rows)
    q = torch.randn(b, 9, t, 24, generator=g)
    cache = torch.randn(b, 1, rows + 7, 24, generator=g)[:, :, :rows]  # a view into spare capacity, as in decode
    keep: torch.Tensor | None = None
    if mask != "none":
        keep = torch.rand(1 if mask == "batch-shared" else b, 1, t, rows, generator=g) > 0.4
        if mask == "empty-rows":
            keep[0, 0, 0] = False  # query 0 of batch row 0: nothing to attend to
            keep[..., -1] = True  # the rest: at least one key, in the last piece only
            keep[0, 0, 0, -1] = False
    out = split.split_attention(q, cache, keep, 0.3, splits)
    torch.testing.assert_close(out, grouped_attention(q, cache, cache, keep, 0.3))
    if mask == "empty-rows":
        assert torch.equal(out[0, :, 0], torch.zeros_like(out[0, :, 0]))


def test_split_attention_in_bfloat16_stays_within_its_rounding() -> None:
    """bfloat16 is a dtype `split_count` admits: the kernel's pieces and the float32 merge of their log-sum-exps
    stay within bfloat16 rounding of the float32 softmax."""
    g = torch.Generator().manual_seed(5)
    q, cache = torch.randn(1, 9, 1, 24, generator=g), torch.randn(1, 1, 1500, 24, generator=g)
    ref = grouped_attention(q, cache, cache, None, 0.3)
    out = split.split_attention(q.bfloat16(), cache.bfloat16(), None, 0.3, 3)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("generic_blas", [False, True])
def test_split_count_uses_threads_where_pieces_are_long_enough(generic_blas: bool, monkeypatch) -> None:
    """Pieces of at least a kernel block (512 rows) where MKL runs its fast kernels, of 256 where it runs generic
    code (the grouped GEMMs are slow there)."""
    monkeypatch.setattr(split.host, "mkl_runs_generic_code", lambda: generic_blas)
    q = torch.zeros(1, 9, 1, 24)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        expected = [1, 2, 2, 2, 2] if generic_blas else [1, 1, 1, 2, 2]
        assert [split.split_count(q, n) for n in (511, 512, 1023, 1024, 8192)] == expected
        assert split.split_count(q.double(), 8192) == 1  # the kernel takes float32 / bfloat16 only
        assert split.split_count(torch.zeros(1, 9, 1, 24, device="meta"), 8192) == 1
        torch.set_num_threads(1)
        assert split.split_count(q, 8192) == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rank, dense", [(6, True), (4, False)])
def test_compact_linear_is_dense_exactly_at_full_rank(rank: int, dense: bool) -> None:
    g = torch.Generator().manual_seed(0)
    d_out, d_in = 6, 10
    b, a = torch.randn(d_out, rank, generator=g), torch.randn(rank, d_in, generator=g)
    bias = torch.randn(d_out, generator=g)
    mod = compact_linear(LowRankFactors(b, a, bias, None), torch.float32)
    assert isinstance(mod, torch.nn.Linear) is dense and isinstance(mod, LowRankLinear) is not dense
    x = torch.randn(3, d_in, generator=g)
    torch.testing.assert_close(mod(x), x @ (b @ a).T + bias)
    empty = empty_compact_linear(d_in, d_out, rank, True, False, torch.float32)  # what loading builds
    assert type(empty) is type(mod)
    empty.load_state_dict(mod.state_dict())  # strict: the same tensors
    torch.testing.assert_close(empty(x), mod(x))


@pytest.mark.parametrize("blas, vendor, generic", [("mkl", "AuthenticAMD", True), ("mkl", "GenuineIntel", False),
                                                   ("openblas", "AuthenticAMD", False), ("mkl", "", False)])
def test_mkl_generic_code_is_read_from_the_blas_and_the_cpu_vendor(blas, vendor, generic, monkeypatch) -> None:
    from attnslim import host

    monkeypatch.setattr(host, "blas_name", lambda: blas)
    monkeypatch.setattr(host, "cpu_info", lambda field: vendor if field == "vendor_id" else "")
    host.mkl_runs_generic_code.cache_clear()
    try:
        assert host.mkl_runs_generic_code() is generic
    finally:
        host.mkl_runs_generic_code.cache_clear()


def test_a_decode_mask_that_keeps_every_row_is_dropped() -> None:
    """HF passes a static cache's decode step a mask; where it keeps every filled row the kernels run unmasked
    (None), and a mask that hides a row (left padding), several queries or a softcap keep it."""
    from attnslim.modules.latent import attention_keep

    full = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    assert attention_keep(full, 1, 9, full.device, None, None) is None
    assert attention_keep(torch.zeros(2, 1, 1, 9), 1, 9, full.device, None, None) is None  # additive: 0 = keep
    padded = full.clone()
    padded[1, ..., :2] = False
    keep = attention_keep(padded, 1, 9, full.device, None, None)
    assert keep is not None and torch.equal(keep, padded)
    assert attention_keep(full, 1, 9, full.device, None, 30.0) is not None
    assert attention_keep(full, 1, 9, full.device, 4, None) is not None  # the window hides the first rows
    causal = torch.ones(2, 9, dtype=torch.bool).tril(7)[None, None]  # two queries: not all rows
    assert attention_keep(causal, 2, 9, full.device, None, None) is not None


@pytest.mark.parametrize("t", [1, 3])
def test_heads_and_merge_heads_undo_each_other_on_views_of_wider_rows(t: int) -> None:
    """`heads` takes the first h·d columns of a fused projection's output (a view with a wider row stride);
    one token goes through a view with no transpose: the same values as the transposing form."""
    y = torch.randn(2, t, 5 * 4 + 7)[..., : 5 * 4]  # (b, t, h·d) of a wider GEMM output
    split = heads(y, 4)  # (b, h, t, d)
    assert torch.equal(split, y.reshape(2, t, 5, 4).transpose(1, 2))
    assert torch.equal(merge_heads(split), y)
    assert torch.equal(merge_heads(split.transpose(1, 2).contiguous().transpose(1, 2)), y)  # non-contiguous

"""LatentLLM's r²-saving junctions (notes §2.5, §13 property 2; paper Remark 5, App. A.2): the left block identity
and the LU-like form beside the right block identity: exact structure, the weights the notes count, the same product
(so the same error) as the truncated SVD, the module forms, and the refusals where a junction cannot apply."""

from __future__ import annotations

import warnings

import pytest
import torch

from attnslim.api import compress
from attnslim.errors import AttnslimError
from attnslim.linalg.junctions import left_block_identity, lu_junction
from attnslim.linalg.lowrank import factorize, param_count, regauge
from attnslim.linalg.precond import PrecondSpec, preconditioner
from attnslim.linalg.stats import InputStats
from attnslim.modules.lowrank import LowRankLinear, empty_compact_linear
from conftest import TINY_BUILDERS
from helpers import ByteTokenizer, one_step

F64 = torch.float64
SAVING = ("block_identity", "left_block_identity", "lu")

pytestmark = pytest.mark.usefixtures("one_thread")


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


@pytest.fixture(scope="module")
def data() -> tuple[torch.Tensor, InputStats]:
    x = _randn(400, 32, seed=0) @ _randn(32, 32, seed=1) + 0.5  # (N, d) correlated, non-centred tokens
    return x, InputStats.from_tokens(x)


def _act_loss(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    return float(((w - w_hat) @ x.T).pow(2).sum())


@pytest.mark.parametrize("d_out,d_in", [(24, 32), (40, 32)])
def test_saving_junctions_match_the_truncated_svd_and_store_r_squared_fewer_weights(data, d_out, d_in):
    """Notes §2.5-2.6: every junction gives the same B A (the rank-r optimum, loss Σ_{i>r} σ_i²(W C^{1/2})), and the
    three r²-saving ones store r(d'+d) − r² weights in their module."""
    x, st = data
    w, r = _randn(d_out, d_in, seed=2), 10
    p = preconditioner(st, "rootcov", damp=0.0)
    tail = float((torch.linalg.svdvals(p.right(w))[r:] ** 2).sum()) * st.n
    exact = PrecondSpec("rootcov", damp=1e-9)  # the optimum of the undamped loss
    dense = factorize(w, None, st, r, precond=exact, junction="left").weight()
    for junction in SAVING:
        f = factorize(w, None, st, r, precond=exact, junction=junction)
        assert f.form == junction
        assert torch.allclose(f.weight(), dense, atol=1e-10), junction
        assert _act_loss(x, w, f.weight()) == pytest.approx(tail, rel=1e-6), junction
        mod = LowRankLinear.from_factors(f, F64)
        assert mod.factor_weights() == f.param_count() == param_count(d_out, d_in, r, junction)
        assert f.param_count() == r * (d_out + d_in) - r * r
        assert torch.allclose(mod.dense_weight(), dense, atol=1e-10), junction
        assert torch.allclose(mod.decompression(), f.B, atol=1e-12), junction  # what LatentAttention multiplies by


def test_left_block_identity_has_an_exact_identity_in_the_rows_of_b(data):
    """Remark 5-i / App. A.2 (J = [U S]_{:r}⁻¹ with pivoted rows): B[out_perm[:r]] = I_r, |B2| <= 1.01 (maxvol)."""
    _, st = data
    w, r = _randn(24, 32, seed=3), 10
    f = factorize(w, None, st, r, junction="left_block_identity")
    assert f.out_perm is not None and f.perm is None and sorted(f.out_perm.tolist()) == list(range(24))
    assert torch.equal(f.B[f.out_perm[:r]], torch.eye(r, dtype=F64))
    assert f.b2.shape == (24 - r, r) and float(f.b2.abs().max()) <= 1.01


def test_lu_form_is_triangular_and_factors_the_pivot_block_of_w_hat(data):
    """Remark 5-ii: B's pivot block is unit lower-triangular, A's upper-triangular, and their product is the r×r
    block of Ŵ at those rows and columns (an LU of it)."""
    _, st = data
    w, r = _randn(24, 32, seed=4), 10
    f = factorize(w, None, st, r, junction="lu")
    assert f.perm is not None and f.out_perm is not None
    low, up = f.B[f.out_perm[:r]], f.A[:, f.perm[:r]]
    assert torch.equal(low.diagonal(), torch.ones(r, dtype=F64))
    assert torch.equal(low.triu(1), torch.zeros(r, r, dtype=F64))
    assert torch.equal(up.tril(-1), torch.zeros(r, r, dtype=F64))
    assert float(up.diagonal().abs().min()) > 0
    assert float(low.abs().max()) <= 1.0 + 1e-12  # partial pivoting
    block = f.weight()[f.out_perm[:r]][:, f.perm[:r]]
    assert torch.allclose(low @ up, block, atol=1e-10)
    assert not torch.allclose(low, torch.eye(r, dtype=F64))  # a real triangle, not the left block identity


def test_module_forms_apply_the_factors_to_tokens(data):
    """LowRankLinear of each form maps tokens as B (A x) + b̂, and the empty module loading builds has the same
    parameter shapes (what a saved state dict needs)."""
    x, st = data
    w, b = _randn(24, 32, seed=5), _randn(24, seed=6)
    for junction in SAVING:
        f = factorize(w, b, st, 10, junction=junction)
        mod = LowRankLinear.from_factors(f, F64)
        assert f.bias is not None
        assert torch.allclose(mod(x), x @ f.weight().T + f.bias, atol=1e-9), junction
        empty = empty_compact_linear(32, 24, 10, True, junction == "block_identity", F64, junction)
        shapes = {k: v.shape for k, v in mod.state_dict().items()}
        assert shapes == {k: v.shape for k, v in empty.state_dict().items()}, junction


def test_b_side_junctions_refuse_a_rank_deficient_product(data):
    """A fitted product of rank < r has no invertible r×r block: the left block identity and the LU-like form are
    refused with the rank found and the fix; the right block identity (whose A always has full rank) still works."""
    _, st = data
    w = _randn(24, 6, seed=7) @ _randn(6, 32, seed=8)  # rank 6
    for junction in ("left_block_identity", "lu"):
        with pytest.raises(AttnslimError, match=r"rank 6 < r = 10.*Use a rank <= 6, or junction: block_identity"):
            factorize(w, None, st, 10, junction=junction)
    assert factorize(w, None, st, 10, junction="block_identity").rank == 10


def test_regauge_refusals_name_the_fix():
    b, a = _randn(8, 10, seed=9), _randn(10, 20, seed=10)  # B with fewer rows than the rank
    for fn in (left_block_identity, lu_junction):
        with pytest.raises(AttnslimError, match="fewer rows than the rank 10.*Use a rank <= 8"):
            fn(b, a)
    with pytest.raises(AttnslimError, match="without its singular values; valid here"):
        regauge(_randn(12, 4, seed=11), _randn(4, 20, seed=12), None, "right")
    with pytest.raises(AttnslimError, match="form='upper' is invalid"):
        LowRankLinear(8, 8, 2, False, False, form="upper")


def _compress(model, args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny calibration sets are rank-deficient by design
        return compress(model, ByteTokenizer(), one_step("latentllm", args), progress=False)


@pytest.mark.parametrize("family,extra", [("llama", {}), ("opt", {"vo": "joint", "mlp": "joint_ud"})])
def test_saving_junctions_give_one_model_at_one_size(family, extra):
    """Notes §2.5 (J has no effect on the loss) through the whole method: at the same ratio the three r²-saving
    junctions pick the same ranks, keep the same parameters and give the same logits up to round-off, on a RoPE +
    GQA model (llama: the junctions gauge the shared latents, not a per-head J_i, so RoPE does not restrict them)
    and on OPT with joint V/O and joint U/D (the junction re-gauges the joint factors)."""
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    logits, kept = {}, {}
    for junction in SAVING:
        model = TINY_BUILDERS[family]()
        report = _compress(model, {"ratio": 0.7, "junction": junction, **extra})
        kept[junction] = (report.params_after["attention"], report.params_after["total"])
        with torch.no_grad():
            logits[junction] = model(input_ids=ids).logits
    ref = logits["block_identity"]
    assert len(set(kept.values())) == 1, kept
    for junction in ("left_block_identity", "lu"):
        gap = float((logits[junction] - ref).abs().max())
        assert gap < 1e-4, (junction, gap)
    dense = TINY_BUILDERS[family]()
    with torch.no_grad():
        assert (dense(input_ids=ids).logits - ref).abs().max() > 1e-2  # the compression did change the model

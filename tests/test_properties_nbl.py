"""NBL properties from the implementation notes (shared/methods/nbl.md) that the other tests leave open: the
CCA-chosen linearization against dropping the same attention, a CCA ranking that follows constructed
near-affine layers across calibration seeds, and the map stored in the model's dtype."""

from __future__ import annotations

import warnings

import pytest
import torch

from attnslim.adapters import get_adapter
from attnslim.api import compress
from attnslim.data.windows import eval_windows
from attnslim.modules.linearized import LinearizedAttention
from attnslim.recipe import Recipe, recipe_from_dict
from conftest import TINY_BUILDERS
from helpers import ByteTokenizer, one_step

FAMILIES = ["llama", "opt", "gemma3"]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matrices, one intra-op thread


def _compress(model, recipe: Recipe):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return compress(model, ByteTokenizer(), recipe, progress=False)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _mse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).pow(2).mean())


def _held_out(tokens: int = 1024) -> torch.Tensor:
    """(tokens / 64, 64) byte-token windows of the evaluation split (the calibration draws from the other split)."""
    return eval_windows("tiny", ByteTokenizer(), tokens=tokens, seq_len=64).ids


@pytest.mark.parametrize("family", FAMILIES)
def test_cca_choice_beats_dropping_that_layer_and_the_highest_bound(family):
    """NBL notes property 3: the lowest-bound layer linearized beats dropping its attention and the highest pick."""
    ids = _held_out()
    ref = _logits(TINY_BUILDERS[family](), ids)
    errors, chosen = {}, {}
    for criterion in ("cca", "highest"):
        model = TINY_BUILDERS[family]()
        plan = _compress(model, one_step("nbl", {"m": 1, "criterion": criterion}, windows=16, seq_len=64)
                         ).steps[0]["plan"]
        chosen[criterion] = plan["chosen"]
        errors[criterion] = _mse(_logits(model, ids), ref)
    (layer,) = chosen["cca"]
    assert chosen["highest"] != chosen["cca"]
    dropped = TINY_BUILDERS[family]()
    _compress(dropped, one_step("drop", {"select": "given"}, layers=[layer], windows=16, seq_len=64))
    errors["drop"] = _mse(_logits(dropped, ids), ref)
    assert errors["cca"] < errors["drop"], (layer, errors)  # the LMMSE map keeps more than no attention at all
    assert errors["cca"] < errors["highest"], (chosen, errors)


def _seeded(seed: int) -> Recipe:
    return recipe_from_dict({
        "name": "nbl-seed",
        "calibration": {"source": "tiny", "windows": 8, "seq_len": 32, "seed": seed, "batch_size": 2},
        "steps": [{"method": "nbl", "layers": "all", "args": {"m": 2, "criterion": "cca"}}],
    })


@pytest.mark.parametrize("family", FAMILIES)
def test_cca_ranking_finds_near_affine_layers_on_every_calibration_seed(family):
    """NBL notes property 2: the CCA bound's ranking of near-affine layers is stable across seeds (that it lies in
    [0, d] holds by construction of the clamped correlations, so it is not asserted)."""
    near_affine = [1, 2]  # o_proj scaled by 0.05: h + attn(h) is then nearly the identity (an affine map) of h
    plain = _compress(TINY_BUILDERS[family](), _seeded(0)).steps[0]["plan"]
    assert plain["chosen"] != near_affine  # without the construction the bound picks other layers
    fingerprints = set()
    for seed in range(4):
        model = TINY_BUILDERS[family]()
        adapter = get_adapter(model)
        with torch.no_grad():
            for i in near_affine:
                adapter.linear(i, "o").weight.mul_(0.05)
        report = _compress(model, _seeded(seed))
        fingerprints.add(report.calibration["fingerprint"])
        plan = report.steps[0]["plan"]
        cca = {int(k): v for k, v in plan["scores"]["cca"].items()}
        assert plan["chosen"] == near_affine, (seed, cca)
        others = [v for i, v in cca.items() if i not in near_affine]
        assert max(cca[i] for i in near_affine) < 0.5 * min(others), (seed, cca)  # a clear gap, not a near tie
    assert len(fingerprints) == 4  # four different calibration sets


@pytest.mark.parametrize("family", FAMILIES)
def test_map_is_stored_in_the_model_dtype(family):
    """NBL notes "Bias and dtype" decision: in a bf16 model W and b are bf16, logits finite and as good as fp32's."""
    ids = _held_out(512)
    models = {torch.float32: TINY_BUILDERS[family](), torch.bfloat16: TINY_BUILDERS[family]().to(torch.bfloat16)}
    dense = {dt: _logits(m, ids) for dt, m in models.items()}
    after = {}
    for dt, model in models.items():
        _compress(model, one_step("nbl", {"criterion": "given"}, layers=[2], windows=8, seq_len=32))
        module = get_adapter(model).attention(2)
        assert isinstance(module, LinearizedAttention)
        assert module.weight.dtype == module.bias.dtype == dt
        assert {p.dtype for p in model.parameters()} == {dt}  # nothing of the fit leaks in as float64/float32
        after[dt] = _logits(model, ids)
    assert bool(torch.isfinite(after[torch.bfloat16]).all())
    own_error = _mse(after[torch.float32], dense[torch.float32])  # what linearizing layer 2 costs
    # the bf16 model differs from the fp32 one by bf16 rounding only, far less than the linearization itself
    assert _mse(after[torch.bfloat16], after[torch.float32]) < 0.1 * own_error
    assert _mse(after[torch.bfloat16], dense[torch.bfloat16]) == pytest.approx(own_error, rel=0.1)

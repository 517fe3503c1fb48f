"""LatentLLM's perplexity properties (notes §13 #8, #11) on the packaged SmolLM2-135M.

Both compress a slice of SmolLM2's attention (layers 8–15 of 30: past the sensitive first layers) and compare
perplexity on the same held-out wiki windows, each variant beside its baseline in the same test. BENCHMARKS.md's
claims rows "RootCov is the best pre-conditioner" and "10% smaller is about as good as dense" run the whole model
on 8192 tokens per text.
"""

from __future__ import annotations

import copy
import warnings

import pytest

from attnslim.api import compress
from attnslim.data import eval_windows
from attnslim.eval import perplexity
from attnslim.recipe import recipe_from_dict

pytestmark = pytest.mark.real

LAYERS = list(range(8, 16))
CALIBRATION = {"source": "wiki", "windows": 8, "seq_len": 256, "seed": 0}


@pytest.fixture(scope="module")
def smol():
    from attnslim.models import load_model

    model, tokenizer = load_model("smollm2-135m")
    windows = eval_windows("wiki", tokenizer, tokens=1024, seq_len=256)  # 4 held-out windows
    return model, tokenizer, windows, perplexity(model, windows, progress=False).ppl


def _ppl(smol, method: str, args: dict) -> float:
    dense, tokenizer, windows, _ = smol
    model = copy.deepcopy(dense)
    recipe = recipe_from_dict({"name": method, "calibration": CALIBRATION,
                               "steps": [{"method": method, "layers": LAYERS, "args": args}]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fits' rank warnings
        compress(model, tokenizer, recipe, progress=False)
    return perplexity(model, windows, progress=False).ppl


def test_real_activation_aware_preconditioners_beat_identity_and_rootcov_beats_the_hessian(smol) -> None:
    """#8, Table 2's ordering RootCov < ℓ2 < Hessian ≪ Identity, with the paper's uniform ranks at 80% so that only
    the pre-conditioner changes. Measured on this slice (dense 15.25): RootCov 15.26, ℓ2 15.29, Hessian 15.97,
    Identity (plain SVD of W) 18.15. Asserted: RootCov and ℓ2 below the diagonal Hessian, and the perplexity each
    activation-aware kind adds a small fraction of what Identity adds (RootCov's and ℓ2's under 1/20, the Hessian's
    under 1/2). RootCov before ℓ2 is not asserted: here by 0.2%, and on the whole model ℓ2 leads (claims row)."""
    _, _, _, dense_ppl = smol
    ppl = {pc: _ppl(smol, "latentllm", {"ratio": 0.8, "alloc": "uniform", "precond": pc})
           for pc in ("rootcov", "l2", "hessian", "identity")}
    print(ppl)  # shown by pytest -rP
    added = {pc: p - dense_ppl for pc, p in ppl.items()}
    assert ppl["rootcov"] < ppl["hessian"] and ppl["l2"] < ppl["hessian"], ppl
    assert max(added["rootcov"], added["l2"]) < added["identity"] / 20, added
    assert added["hessian"] < added["identity"] / 2, added


def test_real_ten_percent_smaller_attention_is_about_as_good_as_dense(smol) -> None:
    """#11: at 90% of the attention weights (the default joint QK, spectrum ranks) perplexity stays within 3% of
    dense, where SVD-LLM at the same 90% of q, k, v, o loses more."""
    _, _, _, dense_ppl = smol
    latent = _ppl(smol, "latentllm", {"ratio": 0.9})
    baseline = _ppl(smol, "svdllm", {"ratio": 0.9, "linears": ["q", "k", "v", "o"]})
    print(dense_ppl, latent, baseline)
    assert latent < 1.03 * dense_ppl, (latent, dense_ppl)
    assert latent < baseline, (latent, baseline)

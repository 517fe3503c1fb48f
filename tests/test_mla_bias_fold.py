"""`mla` with `layout: deepseek, biases: fold`: a model with q/k/v biases (Qwen) in the bias-free DeepSeek-V3 form vLLM
loads. Each bias is folded into its weight by least squares over the layer's calibration input (linalg/bias_fold.py);
the non-rotary key bias is dropped exactly. The tiny model carries a planted token-independent channel, as the
real models' normalised inputs carry a large common part (benchmarks/bias_drop.py measures the 1.5B model)."""

from __future__ import annotations

import warnings

import pytest
import torch

from attnslim.api import compress
from attnslim.errors import AttnslimError
from attnslim.export import ExportOptions, export_deepseek
from attnslim.models import load_model
from attnslim.modules.mla import MLAAttention
from conftest import tiny_llama, tiny_qwen25
from helpers import SavingTokenizer, one_step, reloaded_with_both_loaders

IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
pytestmark = pytest.mark.usefixtures("one_thread")


def _biased(zero_biases: bool = False) -> torch.nn.Module:
    """Tiny Qwen2.5 with large q/k/v biases and a large embedding channel shared by every token."""
    model = tiny_qwen25()
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 8.0
        for layer in model.model.layers:
            for name in ("q_proj", "k_proj", "v_proj"):
                getattr(layer.self_attn, name).bias.mul_(0.0 if zero_biases else 10.0)
    return model


def _mla(model: torch.nn.Module, method: str = "mla", **args: object) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny calibration sets are rank-deficient by design
        done = compress(model, SavingTokenizer(), one_step(method, {"kv_ratio": 0.5, "rope_dims": 16, **args},
                                                           windows=8), progress=False)
    return done.to_json()


def _error(model: torch.nn.Module, ref: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(IDS).logits - ref).norm() / ref.norm())


@pytest.mark.parametrize("method", ["mla", "transmla"])  # transmla inherits the fold from MLABase
def test_folded_biases_keep_the_exact_layout_s_logits_where_dropping_them_does_not(method):
    exact = _biased()
    _mla(exact, method, layout="free")  # carries every bias exactly (o_proj's bias, the rotary key's bias)
    with torch.no_grad():
        ref = exact(IDS).logits
    folded, dropped = _biased(), _biased(zero_biases=True)
    report = _mla(folded, method, layout="deepseek", biases="fold")
    _mla(dropped, method, layout="deepseek", biases="fold")  # zero biases: folding them is dropping them
    assert _error(folded, ref) < _error(dropped, ref) / 20
    for layer in folded.model.layers:
        attn = layer.self_attn
        assert isinstance(attn, MLAAttention)
        assert attn.q_proj.bias is None and attn.o_proj.bias is None and attn.k_rope.bias is None
    rhos = [layer["fit"]["bias_fold_rho"] for layer in report["steps"][0]["plan"]["layers"].values()]
    assert len(rhos) == 8 and min(rhos) > 0.9


def test_a_folded_model_reloads_and_exports_to_a_stock_deepseek_checkpoint(tmp_path):
    model = _biased()
    report = _mla(model, layout="deepseek", biases="fold")
    loaded = reloaded_with_both_loaders(model, report, tmp_path / "saved", IDS)  # q_proj without its bias
    export = export_deepseek(loaded, SavingTokenizer(), tmp_path / "ds", ExportOptions())
    exported, _ = load_model(str(tmp_path / "ds"))
    assert type(exported).__name__ == "DeepseekV3ForCausalLM"
    with torch.no_grad():
        ref = model(IDS).logits
        assert float((exported(IDS).logits - ref).abs().max() / ref.abs().max()) < 1e-5
    assert export["top1_agreement"] == 1.0 and not export["dropped_biases"]


def test_bias_options_that_cannot_work_are_refused_before_any_work():
    with pytest.raises(AttnslimError, match=r"biases: fold is for layout: deepseek|fold is for layout: deepseek"):
        _mla(_biased(), layout="free", biases="fold")
    with pytest.raises(AttnslimError, match=r"q/k/v biases .* Fold them into the weights with biases: fold"):
        _mla(_biased(), layout="deepseek")
    llama = tiny_llama(attention_bias=True)  # q, k, v and o biases: o_proj's input carries no common part
    with pytest.raises(AttnslimError, match=r"layer 0 has o biases \(o_proj\).*not an o_proj bias"):
        _mla(llama, layout="deepseek", biases="fold")


def test_fold_ridge_reaches_the_fit_and_is_refused_without_a_fold():
    rhos = {}
    for ridge in (None, 1.0):  # 1.0: λ as large as the mean diagonal, a fit far from least squares
        report = _mla(_biased(), layout="deepseek", biases="fold", **({} if ridge is None else {"fold_ridge": ridge}))
        rhos[ridge] = [layer["fit"]["bias_fold_rho"] for layer in report["steps"][0]["plan"]["layers"].values()]
        assert ("fold_ridge" in report["steps"][0]["args"]) == (ridge is not None)  # recorded only when set
    assert max(rhos[1.0]) < min(rhos[None])  # a larger ridge shrinks a: the fit reproduces less of the constant
    with pytest.raises(AttnslimError, match=r"fold_ridge=0.0001 is invalid.*null unless biases: fold"):
        _mla(_biased(), layout="free", fold_ridge=1e-4)
    with pytest.raises(AttnslimError, match=r"fold_ridge=-1 is invalid.*a number > 0"):
        _mla(_biased(), layout="deepseek", biases="fold", fold_ridge=-1)

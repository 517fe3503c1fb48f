"""oneDNN linear layers (modules/cpu_linear.py): the same values as F.linear on every family and on compressed
modules, the kernel really runs, training keeps autograd's linear, bad requests are refused."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from attnslim import host
from attnslim.api import compress
from attnslim.errors import AttnslimError
from attnslim.modules import cpu_linear
from attnslim.modules.cpu_linear import OneDNNLinear, set_cpu_linear
from attnslim.modules.lowrank import LowRankLinear
from attnslim.modules.mla import MLAAttention
from conftest import TINY_BUILDERS
from helpers import ByteTokenizer, one_step

pytestmark = pytest.mark.skipif(not host.onednn_linear_available(), reason="torch built without oneDNN")
IDS = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def onednn_calls(monkeypatch):
    """Weight shapes of every oneDNN linear call."""
    shapes: list[tuple[int, ...]] = []
    real = host.onednn_linear

    def spy(x, weight, bias):
        shapes.append(tuple(weight.shape))
        return real(x, weight, bias)

    monkeypatch.setattr(host, "onednn_linear", spy)
    return shapes


@torch.no_grad()
def _logits_and_greedy(model) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=IDS).logits
    tokens = model.generate(IDS[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
    return logits, tokens


def _compressed(family: str, method: str, args: dict):
    model = TINY_BUILDERS[family]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny calibration sets are rank-deficient by design
        report = compress(model, ByteTokenizer(), one_step(method, args), progress=False)
    return model.eval(), report.to_json()


@pytest.mark.parametrize("family", sorted(TINY_BUILDERS))
def test_onednn_gives_torchs_values_on_every_family_and_switches_back(family, onednn_calls):
    model = TINY_BUILDERS[family]().eval()
    ref_logits, ref_tokens = _logits_and_greedy(model)
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    assert set_cpu_linear(model, "onednn") == len(linears) > 0
    assert all(type(m) is OneDNNLinear for m in linears)
    logits, tokens = _logits_and_greedy(model)
    assert len(onednn_calls) >= len(linears)  # every linear ran on oneDNN, the cached decode steps too
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-5)
    assert torch.equal(tokens, ref_tokens)
    set_cpu_linear(model, "torch")
    assert all(type(m) is nn.Linear for m in linears)
    assert torch.equal(_logits_and_greedy(model)[0], ref_logits)  # back on F.linear: bit for bit


@pytest.mark.parametrize("method, args, module", [
    ("mla", {"kv_ratio": 0.5}, MLAAttention),  # the fused decode projection
    ("latentllm", {"ratio": 0.5}, LowRankLinear),
])
def test_compressed_modules_follow_the_switch(method, args, module, onednn_calls):
    model, _ = _compressed("llama", method, args)
    ref_logits, ref_tokens = _logits_and_greedy(model)
    set_cpu_linear(model, "onednn")
    found = [m for m in model.modules() if isinstance(m, module)]
    assert found and all(m.linear_kernel == "onednn" for m in found)
    logits, tokens = _logits_and_greedy(model)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-5)
    assert torch.equal(tokens, ref_tokens)
    if module is MLAAttention:  # decode ran its fused [q; latent; rotary key] rows on oneDNN
        fused = found[0].fused()
        assert fused is not None and tuple(fused.w_in.shape) in onednn_calls
    else:
        assert any(shape == tuple(found[0].b.shape) for shape in onednn_calls)


def test_training_keeps_autograds_linear(onednn_calls):
    model = TINY_BUILDERS["llama"]()
    ref = TINY_BUILDERS["llama"]()  # the same seed: the same weights
    set_cpu_linear(model, "onednn")
    grads = []
    for m in (model, ref):
        m.zero_grad()
        m(input_ids=IDS, labels=IDS).loss.backward()
        grads.append(m.model.layers[0].self_attn.q_proj.weight.grad)
    assert onednn_calls == []
    assert grads[0] is not None and torch.equal(grads[0], grads[1])


def test_strided_weights_and_other_dtypes_go_through_f_linear(onednn_calls):
    x, w = torch.randn(3, 8), torch.randn(8, 5)
    out = cpu_linear.linear(x, w.t(), None, "onednn")  # (5, 8) as a transposed view
    assert torch.equal(out, torch.nn.functional.linear(x, w.t()))
    cpu_linear.linear(x.double(), w.t().contiguous().double(), None, "onednn")
    assert onednn_calls == []
    cpu_linear.linear(x, w.t().contiguous(), None, "onednn")
    assert onednn_calls == [(5, 8)]


def test_bad_requests_are_refused_with_the_fix(monkeypatch):
    model = TINY_BUILDERS["llama"]()
    with pytest.raises(AttnslimError, match="'mkl' is unknown; valid: torch, onednn"):
        set_cpu_linear(model, "mkl")
    with torch.device("meta"):
        on_meta = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(AttnslimError, match="runs on the CPU; the model has weights on meta: move it to the CPU"):
        set_cpu_linear(on_meta, "onednn")
    assert type(on_meta[0]) is nn.Linear  # refused before anything was switched
    monkeypatch.setattr(host, "onednn_linear_available", lambda: False)
    with pytest.raises(AttnslimError, match="no oneDNN linear op .*use 'torch'"):
        set_cpu_linear(model, "onednn")


def test_cli_runs_both_models_of_a_command_on_onednn(tmp_path, capsys, onednn_calls):
    """`--cpu-linear onednn` switches the model and the --vs reference alike, and generates the same text."""
    from attnslim.cli import main
    from attnslim.io import save
    from helpers import SavingTokenizer

    model, report = _compressed("llama", "mla", {"kv_ratio": 0.5})
    save(model, SavingTokenizer(), tmp_path / "mla", report)
    TINY_BUILDERS["llama"]().save_pretrained(tmp_path / "dense")
    SavingTokenizer().save_pretrained(tmp_path / "dense")
    texts = []
    for kernel in ("torch", "onednn"):
        assert main(["generate", str(tmp_path / "mla"), "--prompt", "A", "--max-new-tokens", "8", "--device", "cpu",
                     "--cpu-linear", kernel]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and onednn_calls
    onednn_calls.clear()
    assert main(["bench", str(tmp_path / "mla"), "--vs", str(tmp_path / "dense"), "--device", "cpu", "--contexts",
                 "8", "--new-tokens", "2", "--repeats", "1", "--cpu-linear", "onednn"]) == 0
    assert "linear layers on onednn" in capsys.readouterr().out
    dense_lm_head = tuple(TINY_BUILDERS["llama"]().lm_head.weight.shape)
    assert onednn_calls.count(dense_lm_head) >= 2  # both models' vocabulary projections ran on oneDNN

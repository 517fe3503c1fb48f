"""The recipe's `head:` step on the packaged SmolLM2-135M (tied head, 49152×576): LatentLLM's activation-aware fit of
the untied head against the plain SVD (identity pre-conditioner) at the same rank, on held-out text."""

from __future__ import annotations

import copy

import pytest
import torch

from attnslim.adapters import get_adapter
from attnslim.calib.residency import InMemoryLayers
from attnslim.data import calib_windows, eval_windows
from attnslim.eval import perplexity
from attnslim.pipeline.head import run_head
from attnslim.settings import HeadConfig

pytestmark = pytest.mark.real


def test_real_activation_aware_head_beats_plain_svd_at_the_same_rank():
    from attnslim.models import load_model

    dense, tokenizer = load_model("smollm2-135m")
    calib = calib_windows("wiki", tokenizer, 8, 256, seed=0).ids  # 2048 tokens for a 576-wide input
    held_out = eval_windows("wiki", tokenizer, tokens=2048, seq_len=256)
    before = get_adapter(dense).param_groups()
    with torch.no_grad():
        want = dense(input_ids=held_out.ids[:2]).logits
    ppl, err, records = {}, {}, {}
    for precond in ("rootcov", "identity"):
        model = copy.deepcopy(dense)
        adapter = get_adapter(model)
        config = HeadConfig(ratio=0.8, untie=True, args={"precond": precond})
        records[precond] = run_head(model, adapter, config, calib, 4, InMemoryLayers(model, adapter.decoder_layers()))
        ppl[precond] = perplexity(model, held_out, progress=False).ppl
        with torch.no_grad():
            err[precond] = float((model(input_ids=held_out.ids[:2]).logits - want).pow(2).sum() / want.pow(2).sum())
        after = adapter.param_groups()
        plan = records[precond]["plan"]
        assert plan["tied"] and after["total"] == before["total"] + plan["kept"]  # untied: the head's weights add
        assert after["embedding"] == before["embedding"] and after["head"] == plan["kept"]
    assert records["rootcov"]["plan"] == records["identity"]["plan"]  # the same rank and form
    dense_ppl = perplexity(dense, held_out, progress=False).ppl
    assert dense_ppl < ppl["rootcov"] < ppl["identity"], (dense_ppl, ppl)
    assert err["rootcov"] < err["identity"], err
    assert records["rootcov"]["fit"]["activation_loss"] < records["identity"]["fit"]["activation_loss"]

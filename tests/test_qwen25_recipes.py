"""Every packaged recipe on a tiny Qwen2.5 (tests/conftest.tiny_qwen25: q/k/v biases, head_dim = hidden / heads, an
untied LM head): what `attnslim compress qwen2.5-1.5b --recipe NAME` runs, shrunk only in the sizes that set its
time (calibration windows, training and heal steps). Each compressed model saves and reloads with identical logits
through both loaders, its LM head stays untied and unchanged, and its logits stay finite and differ from dense.

Not shrunk: the calibration a step needs on the model (mla's refit raises the windows itself, tested in
tests/test_output_refit.py) and layer selections. Two recipes cannot fit Qwen2.5 and are refused with the reason
(REFUSED)."""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

import pytest
import torch

from attnslim.api import compress
from attnslim.errors import AttnslimError
from attnslim.recipe import RECIPES_DIR, load_recipe
from conftest import tiny_qwen25
from helpers import ByteTokenizer, reloaded_with_both_loaders

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
PACKAGED = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
# refused on Qwen2.5, before any work, with the reason: atp-paper lists SmolLM2's layers (30 of them; re-run its
# layer analysis for another model), mla-deepseek writes DeepSeek-V3's layout, which has no attention biases
REFUSED = {"atp-paper": "out of range", "mla-deepseek": r"q/k/v biases \(q_proj, k_proj, v_proj\); layout: deepseek"}
EXACT_PREFILL = {"atp"}  # ATP's serving form: exact causal prefill, compresses the cache only for decode
SHORT = {"steps": 2, "batch_size": 2, "seq_len": 32}  # a training budget's size keys, shrunk


def _shrunk(args: dict[str, Any]) -> dict[str, Any]:
    """A step's args with every training budget (lisa's train, atp's recover, mla's local_steps) cut to 2 steps."""
    out = dict(args)
    for key in ("train", "recover"):
        if isinstance(out.get(key), dict):
            out[key] = {**out[key], **{k: v for k, v in SHORT.items() if k in out[key] or k == "steps"}}
    if out.get("local_steps"):
        out["local_steps"] = 2
    return out


def _tiny_recipe(name: str):
    recipe = load_recipe(name)
    heal = None if recipe.heal is None else {**recipe.heal, **SHORT}
    return replace(recipe, calibration=replace(recipe.calibration, windows=8, seq_len=32, batch_size=2),
                   steps=tuple(replace(step, args=_shrunk(dict(step.args))) for step in recipe.steps), heal=heal)


@pytest.mark.parametrize("name", sorted(set(PACKAGED) - set(REFUSED)))
def test_every_packaged_recipe_runs_on_qwen25_and_reloads(name, tmp_path):
    model = tiny_qwen25()
    head = model.lm_head.weight.detach().clone()
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()  # untied, as packaged
    with torch.no_grad():
        dense = model(input_ids=IDS).logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny calibration sets are rank-deficient by design
        report = compress(model, ByteTokenizer(), _tiny_recipe(name), progress=False)
    assert all(step["plan"]["layers"] for step in report.steps), report.steps  # every step converted layers
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
    assert torch.isfinite(logits).all() and torch.equal(logits, dense) == (name in EXACT_PREFILL)
    if report.heal is None:  # only the heal may train the head (params: all); no step touches it
        assert torch.equal(model.lm_head.weight, head)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    reloaded_with_both_loaders(model, report.to_json(), tmp_path / "m", IDS)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_the_recipes_that_cannot_fit_qwen25_are_refused_with_the_reason(name):
    with pytest.raises(AttnslimError, match=REFUSED[name]):
        compress(tiny_qwen25(), ByteTokenizer(), _tiny_recipe(name), progress=False)

"""Plans are typed: every method's plan entries are its own dataclass, the saved JSON reads back into the same
entries (what `attnslim.load` rebuilds the modules from), `convert` reports its fit beside the entry instead of
editing it, and an entry that does not fit its method is refused naming the step and the layer."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from attnslim.adapters import get_adapter
from attnslim.api import compress
from attnslim.calib.hooks import capture_sites
from attnslim.errors import AttnslimError
from attnslim.linalg.stats import InputStats
from attnslim.methods import METHODS, lookup_method
from attnslim.methods.mla_base import MLAEntry
from attnslim.methods.mla_stats import MLAStats
from attnslim.plan import StepPlan
from conftest import tiny_llama
from helpers import ByteTokenizer, one_step

RUNS = {  # method -> (args, layers): one small run per registered method
    "svd": ({"ratio": 0.5}, "all"),
    "asvd": ({"ratio": 0.5}, "all"),
    "svdllm": ({"ratio": 0.5}, "all"),
    "drop": ({"count": 1}, "all"),
    "latentllm": ({"ratio": 0.7}, "all"),
    "mla": ({"kv_ratio": 0.5}, "all"),
    "transmla": ({"kv_ratio": 0.5}, "all"),
    "nbl": ({"m": 1}, "all"),
    "lisa": ({}, [2, 3]),
    "ds": ({}, [2, 3]),
    "atp": ({"rank": 0.5}, "all"),
}
FITTED = {"latentllm", "mla", "transmla", "nbl"}  # methods whose convert reports fit diagnostics


def test_every_registered_method_is_covered():
    assert set(RUNS) == set(METHODS)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_saved_plan_reads_back_into_the_same_typed_entries(name):
    args, layers = RUNS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny calibration sets are rank-deficient by design
        report = compress(tiny_llama(), ByteTokenizer(), one_step(name, args, layers=layers), progress=False)
    step = report.steps[0]
    method = lookup_method(name).from_args(dict(step["args"]))
    plan = method.read_plan(step["plan"], "step 1")
    assert plan.layers and all(type(e) is method.entry_type for e in plan.layers.values())
    assert plan.to_json() == step["plan"]  # the JSON round trip is exact, fits and step-wide info included
    assert bool(plan.fits) == (name in FITTED)


def test_convert_returns_its_fit_and_leaves_the_entry_alone():
    model = tiny_llama()
    method = lookup_method("mla").from_args({"kv_ratio": 0.5})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = compress(model, ByteTokenizer(), one_step("mla", {"kv_ratio": 0.5}), progress=False)
    saved = report.steps[0]["plan"]["layers"]["0"]
    assert saved["fit"]["rope_freq"]  # the conversion's diagnostics, recorded by the pipeline beside the entry
    entry = method.read_plan(report.steps[0]["plan"], "step 1").layers[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        entry.rank = 1  # type: ignore[misc]
    fresh = tiny_llama()
    stats = MLAStats({"attn_in": _attn_in_stats(fresh)})
    fit = method.convert(get_adapter(fresh), 0, entry, stats)
    assert fit is not None and fit["rope_freq"] and entry == MLAEntry(**{k: saved[k] for k in
                                                                         ("rank", "rope_dims", "kv_elements",
                                                                          "dense_kv_elements")})


def _attn_in_stats(model):
    st = InputStats.empty(model.config.hidden_size)
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), capture_sites(get_adapter(model), 0, {"attn_in"}, lambda site, x: st.update(x)):
        model(input_ids=ids)
    return st


@pytest.mark.parametrize("entry,message", [
    ({"rank": 8, "rope_dims": 8, "kv_elements": 16}, r"missing \['dense_kv_elements'\]"),
    ({"rank": 8, "rope_dims": 8, "kv_elements": 16, "dense_kv_elements": 64, "extra": 1}, r"unknown keys \['extra'\]"),
])
def test_an_entry_that_does_not_fit_its_method_is_refused_naming_the_layer(entry, message):
    data = {"layers": {"3": entry}}
    with pytest.raises(AttnslimError, match=rf"step 2 layer 3: the plan entry .*{message}.*attnslim compress"):
        StepPlan.from_json(data, MLAEntry, "step 2")

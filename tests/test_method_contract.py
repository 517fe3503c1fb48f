"""The method contract's capabilities (methods/selecting.py, methods/output_fits.py): every registered method that
can select layers mixes in `Selecting`, and the pipeline refuses one that does not instead of running it with
defaults it never chose."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import attnslim.methods  # noqa: F401  (fills the registry)
from attnslim.adapters import get_adapter
from attnslim.errors import AttnslimError
from attnslim.methods.base import Method
from attnslim.methods.collect import GramCollector
from attnslim.methods.output_fits import OutputFits
from attnslim.methods.selecting import Selecting
from attnslim.pipeline import run_step
from attnslim.registry import METHODS
from conftest import tiny_llama


def test_every_method_that_can_select_layers_mixes_in_selecting():
    # selects_layers is True, or a property an option decides (latentllm's and mla's alloc)
    can_select = {name for name, cls in METHODS.items() if cls.selects_layers is not False}
    assert {"drop", "nbl", "latentllm", "mla"} <= can_select
    assert sorted(name for name in can_select if not issubclass(METHODS[name], Selecting)) == []
    # the pipeline's fits run on the layer's calibration inputs, which only a sequential step has
    fitting = [cls for cls in METHODS.values() if issubclass(cls, OutputFits)]
    assert fitting and all(cls.sequential is True for cls in fitting)


@dataclass(frozen=True)
class _Bare(Method[object, object]):  # selects layers without the capability
    name = "bare"
    selects_layers = True

    def collector(self, adapter, layer):
        return GramCollector({"attn_in"})


def test_a_selecting_method_without_the_capability_is_refused():
    model = tiny_llama()
    windows = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with pytest.raises(AttnslimError, match="internal: bare selects layers but does not mix in Selecting"):
        run_step(model, get_adapter(model), _Bare(), [0, 1], windows, 2, progress=False)

"""Measured quality cost of every candidate at every layer: that layer alone converted, the rest dense.

One walk over the decoder with a calibration runner (calib/runner.py) on the fit windows (the recipe's calibration,
what compress will fit on): at layer i every method's statistics are collected in one run of the layer, each
candidate is converted exactly as its recipe step would convert it (the method's `convert`, then its output refit
and local fit: pipeline.convert_and_fit), the KL to the dense model is measured on separate scoring windows from
layer i on (score.kl_from), and the layer is restored. A candidate whose conversion the method refuses at a layer
(e.g. a fit on a degenerate covariance) is not offered there; the refusal is recorded. The fitted modules of `mla`
and `nbl` are kept (`Bank`, planner/bank.py: their weights on disk while banked), so a whole plan can be assembled
and scored without fitting again (refine.py); `drop` and `ds` are rebuilt."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from attnslim.adapters.base import Adapter
from attnslim.calib.residency import InMemoryLayers, Residency
from attnslim.calib.runner import LayerRunner
from attnslim.errors import AttnslimError
from attnslim.methods import Method
from attnslim.methods.collect import Collector
from attnslim.pipeline import convert_and_fit
from attnslim.planner.bank import Bank
from attnslim.planner.candidates import Candidate
from attnslim.planner.costs import entry_for, method_of, restored, touched
from attnslim.planner.score import ScoreSet, kl_from

KEPT_KINDS = ("mla", "nbl")  # fitted modules worth keeping for whole-plan scoring; the others rebuild for free


@dataclass
class Measured:
    quality: dict[tuple[int, str], float]  # KL per scored token, keep = 0
    bank: Bank
    seconds: float
    refused: dict[tuple[int, str], str] = field(default_factory=dict)  # the method's refusal at that layer


class _Remembered(nn.Module):
    """The dense attention of the layer being measured, remembering its output per call input: every candidate's
    fit (output refit, local fit) runs it on the same calibration batches, so only the first candidate computes it.
    A call is recognised by its hidden states (equal values) and its other arguments (the same objects: the layer
    runner passes each batch's stored mask and rotary tables); any other call is computed afresh."""

    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.attention = attention
        self.seen: list[tuple[torch.Tensor, dict[str, Any], Any]] = []  # (hidden (b, t, d), kwargs, output)

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> Any:
        for x, kw, out in self.seen:
            if (kw.keys() == kwargs.keys() and all(kw[k] is v for k, v in kwargs.items())
                    and x.shape == hidden_states.shape and torch.equal(x, hidden_states)):
                return out
        out = self.attention(hidden_states, **kwargs)
        self.seen.append((hidden_states.detach().clone(), dict(kwargs), out))
        return out


class _FanOut(Collector[None]):
    """One run of a layer feeding every method's collector the sites it asked for."""

    def __init__(self, collectors: list[Collector[Any]]) -> None:
        self.collectors = collectors
        self.sites = set().union(*(c.sites for c in collectors)) if collectors else set()

    def __call__(self, site: str, x: torch.Tensor) -> None:
        for c in self.collectors:
            if site in c.sites:
                c(site, x)


def _statistics(runner: LayerRunner, adapter: Adapter, layer: int,
                methods: Mapping[str, Method[Any, Any]]) -> dict[str, Any]:
    """Each method's statistics of `layer` on the runner's current (dense) inputs, from one run of the layer. The
    candidates of one method share them: a candidate set gives one method the same arguments but its size (mla's
    kv_ratio, which its statistics do not depend on), so each method collects once."""
    collectors: dict[str, Collector[Any]] = {}
    for m in methods.values():
        if m.name not in collectors:
            collectors[m.name] = m.collector(adapter, layer)
    fan = _FanOut([c for c in collectors.values() if c.sites])
    if fan.sites:
        runner.run_layer(layer, fan.sites, fan, advance=False)
    results = {name: c.result() for name, c in collectors.items()}
    return {label: results[m.name] for label, m in methods.items()}


@torch.no_grad()
def measure(model: Any, adapter: Adapter, options: Mapping[int, list[Candidate]], fit_ids: torch.Tensor,
            scores: ScoreSet, batch_size: int, progress: bool = True, residency: Residency | None = None
            ) -> Measured:
    """KL of each (layer, candidate) in `options` converted alone; `keep` costs 0 by definition. `residency`:
    where the weights are (offload.OffloadedLayers: on disk, layer i read in while its candidates are measured, the
    layers above it streamed through each candidate's score); the model in memory by default."""
    start = time.time()
    res = residency or InMemoryLayers(model, adapter.decoder_layers(), next(model.parameters()).device)
    runner = LayerRunner(model, adapter, fit_ids, batch_size, res)
    scored = LayerRunner(model, adapter, scores.ids, scores.ids.shape[0], res)  # one batch: dense inputs per layer
    out = Measured({}, Bank(), 0.0)
    inputs: dict[int, torch.Tensor] = {}
    for i in tqdm(range(adapter.num_layers()), desc="planner: candidates per layer", disable=not progress,
                  leave=False):
        inputs[i] = scored.hidden[0]
        inputs.pop(i - 2, None)
        with res.layer(i):
            _measure_layer(model, adapter, i, options.get(i, []), runner, scores, inputs, res, out)
            runner.run_layer(i)
            scored.run_layer(i)
    out.seconds = time.time() - start
    return out


def _measure_layer(model: Any, adapter: Adapter, i: int, options: list[Candidate], runner: LayerRunner,
                   scores: ScoreSet, inputs: dict[int, torch.Tensor], res: Residency, out: Measured) -> None:
    """Every candidate of layer i (in memory) converted, fitted, scored from its first touched layer up, banked."""
    methods = {c.label: method_of(c) for c in options if c.method is not None}
    stats = _statistics(runner, adapter, i, methods)
    dense = _Remembered(adapter.attention(i))
    shared = {id(p) for p in adapter.decoder_layers()[i].parameters()}  # the dense layer's: never spilled
    for c in options:
        if c.method is None:
            out.quality[(i, c.label)] = 0.0
            continue
        method = methods[c.label]
        group = touched(method, i)
        if res.offloaded and group != [i]:
            raise AttnslimError(f"internal: {c.label} at layer {i} changes layers {group[1:]} too, which the "
                                "offloaded planner does not read in (sharing is not offered with --offload)")
        with restored(adapter, group):
            try:
                convert_and_fit(runner, method, adapter, i, entry_for(method, adapter, i), stats[c.label], dense)
            except AttnslimError as err:  # this layer cannot take it (e.g. a fit on a degenerate layer)
                out.refused[(i, c.label)] = str(err)
                continue
            first = min(group)
            with res.streamed(keep=frozenset(group)):
                out.quality[(i, c.label)] = kl_from(model, adapter, scores, first, inputs[first])
            if c.kind in KEPT_KINDS:
                out.bank.put((i, c.label), adapter.attention(i), adapter.attention_norm(i), shared)

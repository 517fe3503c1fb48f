"""Runs one method step over a model: statistics layer by layer, plan, convert (one-shot or sequential), then the
post-conversion fits (refit.py, local_fit.py); a selection measured on the loss runs its probe (probe.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from torch import nn
from tqdm import tqdm

from attnslim.adapters.base import Adapter
from attnslim.calib.residency import InMemoryLayers, Residency
from attnslim.calib.runner import LayerRunner
from attnslim.errors import AttnslimError
from attnslim.methods.base import Fit, Method, StepContext
from attnslim.methods.output_fits import OutputFits
from attnslim.methods.selecting import Selecting
from attnslim.pipeline.local_fit import LocalFit, fit_locally
from attnslim.pipeline.probe import probe
from attnslim.pipeline.refit import OutputRefit, refit_output
from attnslim.plan import LayerEntry, StepPlan

AnyMethod = Method[Any, Any]  # the pipeline runs every method alike; each method types its own entries and stats


def _collect(runner: LayerRunner, method: AnyMethod, adapter: Adapter, layer: int, advance: bool) -> Any:
    collector = method.collector(adapter, layer)
    runner.run_layer(layer, collector.sites, collector, advance=advance)
    return collector.result()


def run_step(
    model: Any, adapter: Adapter, method: AnyMethod, layers: list[int], windows: Any, batch_size: int,
    progress: bool = True, residency: Residency | None = None,
) -> StepPlan[Any]:
    """Apply `method` to `layers` of `model` in place; returns the step's plan, with each layer's fit diagnostics.

    Every piece of work on decoder layer i runs inside `residency.layer(i)` (calib/residency.py), so the same code
    compresses a model held in memory and one whose weights stay on disk, on CPU or GPU."""
    res = residency or InMemoryLayers(model, adapter.decoder_layers(), next(model.parameters()).device)
    context = method.begin_step(adapter, layers)
    needs_stats = bool(method.collector(adapter, layers[0]).sites)
    if not needs_stats:
        direct = method.plan(adapter, layers, {}, context)
        for i, entry in direct.layers.items():
            _convert(res, method, adapter, i, entry, None, direct)
        return direct
    if method.selects_layers:
        return _run_selecting(model, adapter, method, layers, windows, batch_size, progress, res, context)
    plan: StepPlan[Any] = StepPlan()
    runner = LayerRunner(model, adapter, windows, batch_size, res)
    chosen = set(layers)
    for i in tqdm(range(max(layers) + 1), desc=f"{method.name}", disable=not progress, leave=False):
        with res.layer(i):
            if i not in chosen:
                runner.run_layer(i)
                continue
            stats = _collect(runner, method, adapter, i, advance=not method.sequential)
            part = method.plan(adapter, [i], {i: stats}, context)
            plan.merge(part, i)
            with _converting(res, method, adapter, i):
                plan.record(i, convert_and_fit(runner, method, adapter, i, part.layers[i], stats))
            if method.sequential:
                runner.run_layer(i)  # propagate through the converted layer
    return plan


def _convert(res: Residency, method: AnyMethod, adapter: Adapter, i: int, entry: LayerEntry, stats: Any,
             plan: StepPlan[Any]) -> None:
    """Convert layer i without a calibration runner (no statistics, or a step that is not sequential)."""
    with res.layer(i), _converting(res, method, adapter, i):
        plan.record(i, method.convert(adapter, i, entry, stats))
        if isinstance(method, OutputFits) and (method.refit_o or method.local_steps):
            raise AttnslimError(f"internal: {method.name} asks for an output refit or a local fit, which needs a "
                                "sequential step with statistics (pipeline/refit.py, pipeline/local_fit.py)")


def convert_and_fit(runner: LayerRunner, method: AnyMethod, adapter: Adapter, i: int, entry: LayerEntry,
                   stats: Any, original: nn.Module | None = None) -> Fit:
    """Convert layer i, then, for a method with `OutputFits` (methods/output_fits.py), refit its output linear
    (`refit_o`) and train the installed attention (`local_steps`), both on the runner's inputs of layer i
    (pipeline/refit.py, pipeline/local_fit.py); the fit's diagnostics gain theirs under "output_refit" and
    "local_fit". `original`: what the fits match, the installed attention by default (the planner passes one that
    remembers its outputs across the candidates of a layer)."""
    original = adapter.attention(i) if original is None else original
    fit = dict(method.convert(adapter, i, entry, stats) or {})
    if isinstance(method, OutputFits) and method.refit_o:
        refit = OutputRefit(method.output_linear(adapter, i), method.refit_ridge())
        fit["output_refit"] = refit_output(runner, adapter, i, original, refit)
    if isinstance(method, OutputFits) and method.local_steps:
        local = LocalFit(adapter.attention(i), method.local_steps, float(method.local_lr))
        fit["local_fit"] = fit_locally(runner, adapter, i, original, local)
    return fit or None


@contextmanager
def _converting(res: Residency, method: AnyMethod, adapter: Adapter, i: int) -> Iterator[None]:
    """Around the conversion of layer i (already inside `res.layer(i)`): the other layers it rewires
    (`method.rewires`, e.g. LISA's donor) in memory too, and every layer it touched marked converted on success, so
    an offloaded run writes them all back."""
    others = method.rewires(i)
    bad = [j for j in others if j == i or not 0 <= j < adapter.num_layers()]
    if bad:
        raise AttnslimError(f"internal: {method.name}.rewires({i}) names {bad}, not other decoder layers of the "
                            f"{adapter.num_layers()}")
    with ExitStack() as held:
        for j in others:
            held.enter_context(res.layer(j))
        yield
        for j in (i, *others):
            res.converted(j)


def _run_selecting(
    model: Any, adapter: Adapter, method: AnyMethod, layers: list[int], windows: Any, batch_size: int, progress: bool,
    res: Residency, context: StepContext,
) -> StepPlan[Any]:
    """Statistics of every candidate (current model), plan (selection), then convert the chosen layers."""
    if not isinstance(method, Selecting):
        raise AttnslimError(f"internal: {method.name} selects layers but does not mix in Selecting "
                            "(methods/selecting.py)")
    runner = LayerRunner(model, adapter, windows, batch_size, res)
    stats: dict[int, Any] = {}
    for i in tqdm(range(max(layers) + 1), desc=f"{method.name} stats", disable=not progress, leave=False):
        with res.layer(i):
            if i in layers:  # summarize: what the plan needs of layer i's weights, read while they are here
                stats[i] = method.summarize(adapter, i, _collect(runner, method, adapter, i, advance=True))
            else:
                runner.run_layer(i)
    if method.probe_windows():
        with res.streamed():
            probe_ids = windows[: method.probe_windows()]
            probe(model, adapter, method, layers, stats, probe_ids, batch_size, progress, res)
    plan = method.plan(adapter, layers, stats, context)
    chosen = sorted(plan.layers)
    if not chosen:
        return plan
    if not method.sequential:
        for i in chosen:
            _convert(res, method, adapter, i, plan.layers[i], stats[i], plan)
        return plan
    runner = LayerRunner(model, adapter, windows, batch_size, res)  # refit on the already-converted upstream
    for i in tqdm(range(max(chosen) + 1), desc=f"{method.name} fit", disable=not progress, leave=False):
        with res.layer(i):
            if i in chosen:
                fresh = _collect(runner, method, adapter, i, advance=False)
                with _converting(res, method, adapter, i):
                    plan.record(i, convert_and_fit(runner, method, adapter, i, plan.layers[i], fresh))
            runner.run_layer(i)
    return plan

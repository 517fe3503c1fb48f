"""Local fit: after a layer's attention is converted, its parameters are trained by gradient descent so that the
new attention's output matches the original attention's on the same calibration inputs.

    min_θ  Σ_windows ‖attn_θ(X) − attn_dense(X)‖² / ‖attn_dense(X)‖²       X: the layer's calibration inputs
                                                                       (the converted upstream's, sequential)

Adam on one calibration batch per step, each tensor's step size `lr` times its RMS at the start (Adam moves every
entry by about lr whatever its gradient, and the converted tensors' scales differ: q_proj against the latent
factors, one model against another), the batches drawn with a generator seeded by the layer index; the last
eighth of the batches (at least one) are held out and only score: the parameters kept are those of the best
held-out error seen (checked every eighth of the steps), so a fit that does not generalise leaves the layer as
it was converted, and the diagnostics say so (`nmse_before` = `nmse_after`).
Why: a conversion fits each part (mla: the rotary split, the latent) to a proxy of the attention's output in
closed form, and refit_o corrects the last linear map; the softmax couples them, and only a joint fit of every
part against the real output can trade one part's error against another's. It is layer-local (block-wise
reconstruction, as layer-wise post-training compression does), so it needs no teacher model and no labels,
and it runs where the statistics do (offloaded weights included: one layer in memory). Measured: BENCHMARKS.md,
section MLA (rows with `local`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from attnslim.adapters.base import Adapter
from attnslim.calib.hooks import beside_original
from attnslim.calib.runner import LayerRunner
from attnslim.errors import AttnslimError
from attnslim.plan import JSON

Call = tuple[tuple[Any, ...], dict[str, Any]]  # one attention call's positional and keyword arguments
CHECKS = 8  # held-out evaluations per fit


class LocalFit(NamedTuple):
    """What the pipeline trains (`OutputFits.local_steps`)."""

    module: nn.Module  # the converted attention; every floating-point parameter of it trains
    steps: int  # Adam steps, one calibration batch each
    lr: float


def relative_error(module: nn.Module, call: Call, target: torch.Tensor) -> torch.Tensor:
    """‖module(call) − target‖² / ‖target‖² over the whole batch (a scalar)."""
    got = module(*call[0], **call[1])
    got = got[0] if isinstance(got, tuple) else got  # (b, t, d)
    return ((got - target) ** 2).sum() / (target**2).sum().clamp_min(1e-30)


def fit_locally(runner: LayerRunner, adapter: Adapter, layer: int, original: nn.Module, target: LocalFit
                ) -> dict[str, JSON]:
    """Train `target.module` (layer `layer`'s converted attention, in place) towards `original` on the runner's
    current inputs of that layer; returns the held-out error before and after, and the step that was kept."""
    new = target.module
    if new is original:
        raise AttnslimError(f"layer {layer}: the local fit found the original attention still installed; "
                            "it runs after convert replaced it")
    calls: list[Call] = []
    targets: list[torch.Tensor] = []

    def record(args: tuple[Any, ...], kwargs: dict[str, Any], want: torch.Tensor) -> None:
        calls.append((tuple(a.detach() if torch.is_tensor(a) else a for a in args), dict(kwargs)))
        targets.append(want)  # (b, t, d)

    with torch.no_grad(), beside_original(new, original, record):
        runner.run_layer(layer, advance=False)
    if len(calls) < 2:
        raise AttnslimError(f"layer {layer}: the local fit holds out a batch to choose its result and needs at "
                            f"least 2 calibration batches, got {len(calls)}: raise the calibration's windows or "
                            "lower its batch size, or turn the local fit off (local_steps: 0)")
    held = max(1, len(calls) // 8)
    train, valid = list(range(len(calls) - held)), list(range(len(calls) - held, len(calls)))
    params = [p for p in new.parameters() if p.is_floating_point()]
    flags = [p.requires_grad for p in params]

    def held_out() -> float:
        with torch.no_grad():
            return sum(float(relative_error(new, calls[k], targets[k])) for k in valid) / len(valid)

    before = best = held_out()
    kept_step = 0
    kept = {k: v.detach().clone() for k, v in new.state_dict().items()}
    opt = torch.optim.Adam([{"params": [p], "lr": target.lr * float(p.detach().pow(2).mean().sqrt().clamp_min(1e-8))}
                            for p in params])
    order = torch.Generator().manual_seed(layer)
    every = max(1, target.steps // CHECKS)
    was_training = new.training
    try:
        for p in params:
            p.requires_grad_(True)
        new.train()
        with torch.enable_grad():
            for step in range(1, target.steps + 1):
                k = train[int(torch.randint(len(train), (1,), generator=order))]
                loss = relative_error(new, calls[k], targets[k])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if step % every == 0 or step == target.steps:
                    if (err := held_out()) < best:
                        best, kept_step = err, step
                        kept = {k2: v.detach().clone() for k2, v in new.state_dict().items()}
        new.load_state_dict(kept)
    finally:
        new.train(was_training)
        for p, f in zip(params, flags, strict=True):
            p.requires_grad_(f)
    return {"nmse_before": before, "nmse_after": best, "kept_step": kept_step, "steps": target.steps,
            "held_out_batches": held}

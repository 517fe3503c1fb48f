"""Output refit: after a layer's attention is converted, its output projection is refitted by least squares so
that the new attention's output matches the original attention's on the same calibration inputs.

    min_{W, b} Σ_tokens ‖y − W z − b‖² + δ‖W‖_F²      z (d_in,): the converted attention's input to its output
                                                      projection; y (d_out,): the original attention's output
                                                      on the same hidden states (mask, positions) as the new one

a ridge regression (linalg/cca.lmmse_map; b = 0 where the projection has no bias). The projection's old weights
are the fit's starting point and its comparison: what the fit gains is recorded as the normalised error of both.
Why: a conversion fits its parts (mla: the latent, the rotary split) to proxies of the attention's output; the
softmax and the product of the fitted parts leave an error that the last linear map, fitted on the real output,
partly cancels in closed form. In a sequential step the refit layer is the one the next layers' statistics see.
Measured: BENCHMARKS.md, section MLA (refit rows).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import nn

from attnslim.adapters.base import Adapter
from attnslim.calib.hooks import beside_original
from attnslim.calib.runner import LayerRunner
from attnslim.calib.tokens import MIN_TOKENS_PER_DIM, refit_tokens
from attnslim.errors import AttnslimError
from attnslim.linalg.cca import JointStats, linear_fit_nmse, lmmse_map
from attnslim.plan import JSON


class OutputRefit(NamedTuple):
    """What the pipeline refits (`OutputFits.refit_o`)."""

    linear: nn.Linear  # the converted attention's last linear, refit in place (its bias too, where it has one)
    ridge: float  # relative to the mean eigenvalue of its input covariance (linalg/cca.lmmse_map)


@contextmanager
def _paired_outputs(new: nn.Module, original: nn.Module, linear: nn.Linear, stats: JointStats) -> Iterator[None]:
    """While the block runs, every call of `new` adds (input of `linear`, original's output on the same call) to
    `stats`."""
    seen: list[torch.Tensor] = []

    def pre(module: nn.Module, args: tuple[Any, ...]) -> None:
        seen.append(args[0].detach())

    def pair(args: tuple[Any, ...], kwargs: dict[str, Any], want: torch.Tensor) -> None:
        if len(seen) != 1:
            raise AttnslimError(f"output refit: the converted attention called its output projection {len(seen)} "
                                "times in one forward; the refit needs exactly one call")
        stats.update(seen.pop(), want)

    handle = linear.register_forward_pre_hook(pre)
    try:
        with beside_original(new, original, pair):
            yield
    finally:
        handle.remove()


@torch.no_grad()
def refit_output(runner: LayerRunner, adapter: Adapter, layer: int, original: nn.Module, target: OutputRefit
                 ) -> dict[str, JSON]:
    """Refit `target.linear` (in place) of layer `layer`'s converted attention against `original` on the runner's
    current inputs of that layer; returns the normalised output error before and after (on those inputs)."""
    new, linear = adapter.attention(layer), target.linear
    if new is original:
        raise AttnslimError(f"layer {layer}: the output refit found the original attention still installed; "
                            "it runs after convert replaced it")
    tokens, need = runner.tokens(), refit_tokens(linear.in_features)
    if tokens < need:
        raise AttnslimError(f"layer {layer}: the output refit fits {linear.in_features + 1} numbers per output on "
                            f"{tokens} calibration tokens, which overfits; it needs at least {need} "
                            f"({MIN_TOKENS_PER_DIM} per input dimension): raise the calibration's windows x seq_len, "
                            "or turn the refit off (refit_o: false)")
    stats = JointStats.zeros(linear.in_features, linear.out_features, device=linear.weight.device)
    with _paired_outputs(new, original, linear, stats):
        runner.run_layer(layer, advance=False)
    old_bias = linear.bias if linear.bias is not None else linear.weight.new_zeros(linear.out_features)
    before = linear_fit_nmse(stats, linear.weight, old_bias)
    w, b, info = lmmse_map(stats, ridge=target.ridge, affine=linear.bias is not None, prior=linear.weight)
    linear.weight.copy_(w)
    if linear.bias is not None:
        linear.bias.copy_(b)
    return {"nmse_before": before, "nmse_after": info.nmse}

"""Statistics `mla` and `transmla` stream per layer: Gram sums at the attention input (q, k, v all read it) and, for
`mla` alloc=global, the layer's latent spectrum that `MLA.summarize` computes while the layer's weights are in
memory (so the plan reads no weights: with --offload every other layer is on disk when it runs)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnslim.errors import AttnslimError
from attnslim.linalg.stats import InputStats
from attnslim.methods.collect import Collector, GramCollector
from attnslim.methods.selecting import missing_summary

SITE = "attn_in"


@dataclass
class MLAStats:
    grams: dict[str, InputStats] = field(default_factory=dict)  # {attn_in: Σxxᵀ, Σx, n}; empty once `summarize`
    # kept only the spectrum (a sequential step refits on fresh statistics)
    spectrum: torch.Tensor | None = None  # alloc=global: the weighted singular values of the layer's [k_nope; v]


class MLACollector(Collector[MLAStats]):
    """GramCollector at the attention input, its sums wrapped as MLAStats."""

    def __init__(self) -> None:
        self.grams = GramCollector({SITE})
        self.sites = self.grams.sites

    def __call__(self, site: str, x: torch.Tensor) -> None:
        self.grams(site, x)

    def result(self) -> MLAStats:
        return MLAStats(self.grams.result())


def attn_in(stats: MLAStats | None, layer: int, where: str) -> InputStats:
    """The attention-input statistics of one layer, checked, or a refusal saying why they are missing."""
    gram = None if stats is None else stats.grams.get(SITE)
    if gram is None:
        if stats is not None and stats.spectrum is not None:
            raise AttnslimError(f"{where}: these statistics hold only the spectrum `summarize` kept for the plan; "
                                "convert needs the layer's fresh attn_in statistics (the pipeline's refit collects "
                                "them)")
        raise AttnslimError(f"{where}: no statistics at {SITE}; the calibration did not reach it")
    gram.check(f"layer {layer} {SITE}")
    return gram


def spectrum(stats: MLAStats | None, where: str) -> torch.Tensor:
    """alloc=global: the layer's latent spectrum `summarize` computed, or a refusal naming the fix."""
    if stats is None or stats.spectrum is None:
        raise missing_summary(where, "each layer's latent spectrum (alloc=global)")
    return stats.spectrum

"""Statistics `latentllm` streams per layer: Gram sums at the compressed linears' inputs and, for joint UD, a
seeded uniform reservoir sample of MLP-input tokens (never all activations)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnslim.errors import AttnslimError
from attnslim.linalg.stats import InputStats
from attnslim.methods.collect import Collector
from attnslim.methods.selecting import missing_summary


class Reservoir:
    """A seeded uniform sample of at most `cap` rows (tokens) of a stream (Algorithm R), float32 on the CPU."""

    def __init__(self, cap: int, seed: int) -> None:
        self.cap, self.seen = cap, 0
        self.buf: torch.Tensor | None = None  # (cap, d)
        self.gen = torch.Generator().manual_seed(seed)

    def add(self, x: torch.Tensor) -> None:
        rows = x.reshape(-1, x.shape[-1]).to("cpu", torch.float32)  # (N, d)
        if self.buf is None:
            self.buf = torch.empty(self.cap, rows.shape[1])
        fill = max(0, min(self.cap - self.seen, rows.shape[0]))
        self.buf[self.seen : self.seen + fill] = rows[:fill]
        rest = rows[fill:]
        if rest.shape[0]:
            pos = self.seen + fill + torch.arange(rest.shape[0], dtype=torch.float64)  # global indices
            slot = (torch.rand(rest.shape[0], generator=self.gen, dtype=torch.float64) * (pos + 1)).long()
            hit = torch.nonzero(slot < self.cap).flatten()
            if hit.numel():  # a slot hit twice keeps the later token, as the sequential algorithm would
                uniq, inv = torch.unique(slot[hit], return_inverse=True)
                last = torch.full((uniq.numel(),), -1, dtype=torch.long).scatter_reduce(0, inv, hit, "amax")
                self.buf[uniq] = rest[last]
        self.seen += rows.shape[0]

    def tokens(self) -> torch.Tensor:
        if self.buf is None:
            raise AttnslimError("latentllm joint_ud: no MLP-input tokens reached this layer; check the calibration")
        return self.buf[: min(self.seen, self.cap)]


@dataclass
class LayerStats:
    grams: dict[str, InputStats]
    tokens: torch.Tensor | None  # (N, d) MLP-input sample for joint_ud
    spectra: dict[str, torch.Tensor] | None = None  # alloc=global: linear name -> singular values of W P, computed
    # by LatentLLM.summarize while the layer's weights are in memory

    def site(self, site: str, layer: int) -> InputStats:
        """The checked Gram sums at `site`, or a refusal naming the site."""
        g = self.grams.get(site)
        if g is None:
            raise AttnslimError(f"latentllm: layer {layer}: no statistics at {site}; the calibration did not reach it")
        g.check(f"layer {layer} {site}")
        return g

    def spectra_of(self, layer: int) -> dict[str, torch.Tensor]:
        """alloc=global: the spectra `summarize` computed, or a refusal naming the fix."""
        if self.spectra is None:
            raise missing_summary(f"latentllm alloc=global: layer {layer}", "each compressed linear's spectrum")
        return self.spectra


class LatentCollector(Collector[LayerStats]):
    def __init__(self, gram_sites: set[str], ud_tokens: int, seed: int) -> None:
        self.gram_sites = set(gram_sites)
        self.sites = self.gram_sites | ({"mlp_in"} if ud_tokens else set())
        self.grams: dict[str, InputStats] = {}
        self.reservoir = Reservoir(ud_tokens, seed) if ud_tokens else None

    def __call__(self, site: str, x: torch.Tensor) -> None:
        if site in self.gram_sites:
            self.grams.setdefault(site, InputStats.empty(x.shape[-1])).update(x)
        if site == "mlp_in" and self.reservoir is not None:
            self.reservoir.add(x)

    def result(self) -> LayerStats:
        return LayerStats(self.grams, None if self.reservoir is None else self.reservoir.tokens())

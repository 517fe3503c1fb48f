"""What a method's `collector` returns: receives the activations of one layer's forward and gives the statistics S
the method plans and converts from (streamed: never the activations themselves)."""

from __future__ import annotations

from typing import Generic, TypeVar

import torch

from attnslim.linalg.stats import InputStats

S_co = TypeVar("S_co", covariant=True)


class Collector(Generic[S_co]):
    """Receives (site, activation) pairs during a layer's forward; `result()` gives the statistics."""

    sites: set[str] = set()

    def __call__(self, site: str, x: torch.Tensor) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def result(self) -> S_co:
        raise NotImplementedError


class GramCollector(Collector[dict[str, InputStats]]):
    """Input Gram statistics at each requested site: {site: InputStats}."""

    def __init__(self, sites: set[str]) -> None:
        self.sites = set(sites)
        self.stats: dict[str, InputStats] = {}

    def __call__(self, site: str, x: torch.Tensor) -> None:
        self.stats.setdefault(site, InputStats.empty(x.shape[-1])).update(x)

    def result(self) -> dict[str, InputStats]:
        return self.stats


class NoStats(Collector[None]):
    sites: set[str] = set()

    def __call__(self, site: str, x: torch.Tensor) -> None:
        pass

    def result(self) -> None:
        return None

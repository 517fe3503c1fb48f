"""Low-rank baselines every paper compares against, one factorisation per selected linear.

- `svd`    plain truncated SVD of W (weight-only; no statistics).
- `asvd`   ASVD: diagonal activation scaling S = diag(mean|x|)^alpha, svd_r(W S) S⁻¹ (Yuan et al. 2023).
- `svdllm` SVD-LLM: whitening by a square root of the input auto-correlation XXᵀ, svd_r(W L) L⁻¹.
  SVD-LLM uses the Cholesky factor L; any square root of XXᵀ gives the same optimal rank-r product, so
  this uses the symmetric root from one damped eigh (robust where Cholesky fails on near-singular XXᵀ).
Factors are dense (no junction): a rank-r d'×d linear stores r(d'+d) weights, so `ratio` (kept fraction of
the linear's weights) gives r = floor(ratio·d'·d/(d'+d)). Statistics: the input Gram of each linear.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from attnslim.adapters.base import Adapter
from attnslim.calib.hooks import SITE_OF
from attnslim.errors import AttnslimError
from attnslim.linalg.lowrank import factorize
from attnslim.linalg.precond import PrecondSpec
from attnslim.linalg.ranks import rank_for_ratio
from attnslim.linalg.stats import InputStats
from attnslim.methods.base import NO_CONTEXT, Fit, Method, StepContext, dense_linear, require
from attnslim.methods.collect import Collector, GramCollector, NoStats
from attnslim.modules.lowrank import LowRankLinear
from attnslim.plan import JSON, LayerEntry, StepPlan
from attnslim.registry import register_method

Grams = dict[str, InputStats] | None  # input statistics per site; None for the plain SVD (no statistics)


@dataclass(frozen=True)
class LinearRanks(LayerEntry):
    """The rank of each factorised linear of one layer; JSON: {linear: rank}."""

    ranks: dict[str, int]

    def to_json(self) -> dict[str, JSON]:
        return dict(self.ranks)

    @classmethod
    def from_json(cls, data: Mapping[str, JSON], where: str) -> LinearRanks:
        bad = {k: v for k, v in data.items() if k not in SITE_OF or isinstance(v, bool) or not isinstance(v, int)}
        if bad or not data:
            raise AttnslimError(f"{where}: the plan entry {dict(data)} is not {{linear: rank}} over {list(SITE_OF)}; "
                                "re-create the output with attnslim compress")
        return cls({k: int(v) for k, v in data.items()})  # type: ignore[arg-type]


@dataclass(frozen=True)
class LowRankBaseline(Method[LinearRanks, Grams]):
    entry_type = LinearRanks
    ratio: float | None = None  # kept fraction of each matrix's weights; 0.8 when neither ratio nor rank is given
    rank: int | None = None
    linears: tuple[str, ...] = ("q", "k", "v", "o")
    damp: float = 1e-2
    sequential: bool = False  # type: ignore[misc]
    precond: str = field(default="identity", init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "linears", tuple(self.linears))
        if self.ratio is None and self.rank is None:
            object.__setattr__(self, "ratio", 0.8)
        require((self.ratio is None) != (self.rank is None), self.name, "ratio/rank", (self.ratio, self.rank),
                "exactly one of ratio (kept fraction) or rank")
        if self.ratio is not None:
            require(0 < self.ratio <= 1, self.name, "ratio", self.ratio, "(0, 1]")
        if self.rank is not None:
            require(isinstance(self.rank, int) and not isinstance(self.rank, bool) and self.rank > 0, self.name,
                    "rank", self.rank, "an integer >= 1 (for a fraction use ratio)")
        bad = [n for n in self.linears if n not in SITE_OF]
        require(not bad and len(self.linears) > 0, self.name, "linears", list(self.linears),
                f"a non-empty subset of {list(SITE_OF)}")
        require(math.isfinite(self.damp) and self.damp >= 0, self.name, "damp", self.damp, "a finite number >= 0")

    def collector(self, adapter: Adapter, layer: int) -> Collector[Grams]:
        if self.precond == "identity":
            return NoStats()
        return GramCollector({SITE_OF[n] for n in self.linears})

    def _rank(self, adapter: Adapter, layer: int, name: str) -> int:
        w = dense_linear(adapter, layer, name, self.name).weight
        d_out, d_in = w.shape
        if self.rank is not None:
            if self.rank > min(d_out, d_in):
                raise AttnslimError(
                    f"layer {layer} {name}: rank={self.rank} exceeds min(d_out, d_in)={min(d_out, d_in)} "
                    f"of the {d_out}x{d_in} weight; use rank <= {min(d_out, d_in)} or a ratio"
                )
            return self.rank
        assert self.ratio is not None
        return rank_for_ratio(d_out, d_in, self.ratio)

    def plan(self, adapter: Adapter, layers: list[int], stats: Mapping[int, Grams],
             context: StepContext = NO_CONTEXT) -> StepPlan[LinearRanks]:
        return StepPlan({i: LinearRanks({n: self._rank(adapter, i, n) for n in self.linears}) for i in layers})

    def convert(self, adapter: Adapter, layer: int, entry: LinearRanks, stats: Grams) -> Fit:
        for name, rank in entry.ranks.items():
            lin = dense_linear(adapter, layer, name, self.name)
            if self.precond == "identity":
                d = lin.weight.shape[1]
                g = InputStats(torch.eye(d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64),
                               torch.ones(d, dtype=torch.float64), 1)
            else:
                site = SITE_OF[name]
                assert stats is not None, "an activation-aware baseline collects statistics"
                stats[site].check(f"layer {layer} {name} ({site})")
                g = stats[site]
            bias = None if lin.bias is None else lin.bias.detach()
            factors = factorize(
                lin.weight.detach(), bias, g, rank, precond=PrecondSpec(self.precond, self.damp, **self._extra()),
                junction="left", label=f"layer {layer} {name}",
            )
            adapter.replace_linear(layer, name, LowRankLinear.from_factors(factors, lin.weight.dtype))
        return None

    def _extra(self) -> dict[str, Any]:
        """PrecondSpec settings beyond kind and damp (ASVD's alpha)."""
        return {}

    def skeleton(self, adapter: Adapter, layer: int, entry: LinearRanks) -> None:
        for name, rank in entry.ranks.items():
            lin = dense_linear(adapter, layer, name, self.name)
            d_out, d_in = lin.weight.shape
            adapter.replace_linear(
                layer, name, LowRankLinear(d_in, d_out, rank, lin.bias is not None, False, lin.weight.dtype)
            )


@register_method("svd")
@dataclass(frozen=True)
class PlainSVD(LowRankBaseline):
    """Weight-only truncated SVD."""


@register_method("asvd")
@dataclass(frozen=True)
class ASVD(LowRankBaseline):
    alpha: float = 0.5
    precond: str = field(default="l1", init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 < self.alpha <= 2, self.name, "alpha", self.alpha, "(0, 2]")

    def _extra(self) -> dict[str, Any]:
        return {"alpha": self.alpha}


@register_method("svdllm")
@dataclass(frozen=True)
class SVDLLM(LowRankBaseline):
    precond: str = field(default="rootcov", init=False)

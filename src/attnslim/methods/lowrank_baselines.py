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
from dataclasses import dataclass, field
from typing import Any

import torch

from attnslim.adapters.base import Adapter
from attnslim.calib.stats import GramStats
from attnslim.errors import AttnslimError
from attnslim.linalg.lowrank import factorize
from attnslim.linalg.precond import InputStats
from attnslim.methods.base import Collector, GramCollector, Method, NoStats, dense_linear, require
from attnslim.modules.lowrank import LowRankLinear
from attnslim.registry import register_method

SITE_OF = {"q": "attn_in", "k": "attn_in", "v": "attn_in", "o": "o_in", "gate": "mlp_in", "up": "mlp_in",
           "down": "down_in"}


def rank_for_ratio(d_out: int, d_in: int, ratio: float, junction: str = "left") -> int:
    """Largest rank whose factor parameters are <= ratio·d_out·d_in (r(d'+d) or r(d'+d)−r²)."""
    budget = ratio * d_out * d_in
    if junction == "block_identity":
        # r(d'+d) − r² <= budget  -> smaller root of r² − (d'+d) r + budget = 0
        s = d_out + d_in
        r = int((s - (s * s - 4 * budget) ** 0.5) / 2) if s * s >= 4 * budget else min(d_out, d_in)
    else:
        r = int(budget // (d_out + d_in))
    return max(1, min(r, min(d_out, d_in)))


def to_input_stats(g: GramStats) -> InputStats:
    return InputStats(sxx=g.sxx, sx=g.sx, ax=g.ax, n=g.n)


@dataclass(frozen=True)
class LowRankBaseline(Method):
    ratio: float | None = 0.8
    rank: int | None = None
    linears: tuple[str, ...] = ("q", "k", "v", "o")
    damp: float = 1e-2
    sequential: bool = False  # type: ignore[misc]
    precond: str = field(default="identity", init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "linears", tuple(self.linears))
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

    def collector(self, adapter: Adapter, layer: int) -> Collector:
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

    def plan(self, adapter: Adapter, layers: list[int], stats: dict[int, Any]) -> dict[str, Any]:
        return {"layers": {str(i): {n: self._rank(adapter, i, n) for n in self.linears} for i in layers}}

    def convert(self, adapter: Adapter, layer: int, entry: dict[str, Any], stats: Any) -> None:
        for name, rank in entry.items():
            lin = dense_linear(adapter, layer, name, self.name)
            if self.precond == "identity":
                d = lin.weight.shape[1]
                g = InputStats(torch.eye(d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64),
                               torch.ones(d, dtype=torch.float64), 1)
            else:
                site = SITE_OF[name]
                stats[site].check(f"layer {layer} {name} ({site})")
                g = to_input_stats(stats[site])
            bias = None if lin.bias is None else lin.bias.detach()
            factors = factorize(
                lin.weight.detach(), bias, g, rank, precond=self.precond, junction="left", damp=self.damp,
                label=f"layer {layer} {name}", **self._extra(),
            )
            adapter.replace_linear(layer, name, LowRankLinear.from_factors(factors, lin.weight.dtype))

    def _extra(self) -> dict[str, Any]:
        return {}

    def skeleton(self, adapter: Adapter, layer: int, entry: dict[str, Any]) -> None:
        for name, rank in entry.items():
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

"""`nbl`: Neural Block Linearization (Erdogan, Tonin, Cevher 2025, arXiv 2505.21077; seed 003).

What is approximated: the attention sub-block output Y of m chosen layers, by one affine map Ŷ = W X + b fitted in
closed form (LMMSE: W (C_XX + δI) = C_YX, b = E[Y] − W E[X]; linalg/cca.lmmse_map). The layer then computes
h + W X + b: no Q/K/V, no softmax, no KV cache.
Statistics per candidate layer, streamed in float64 (linalg/cca.JointStats): E[X], E[Y], C_XX, C_YX, C_YY of the
fit pair (X, Y); the same of (h, Y) for the paper's CCA bound when X ≠ h; LLM-Drop's mean cos(h, h + Y).
Cost: a linearized layer holds d² + d parameters (instead of q/k/v/o) and 1 byte/token of cache (the position
marker), so KV bytes/token fall by about m/L; its decode work is one (d, d) matvec.
Selection (`criterion`, lower = linearize first): `cca` (the paper's bound Σ(1 − ρ²)), `nmse`, `resid` (fit error
relative to the stream), `similarity` (LLM-Drop's cosine; the default), `probe` (measured calibration-NLL increase
of each layer alone), `random`, `highest`, `given`.
Deviations from the paper and the reference implementation: `similarity` instead of `cca` by default (the bound is
dominated by the scale of h, not by whether Y is linear, and picks the layers where linearization hurts most);
input `normed` (the attention's own input: a map of raw h cannot represent the norm's 1/rms(h)); a relative ridge
instead of an explicit inverse; on models with a norm on the attention output, scores of what the stream receives;
`sequential=True` refits on the linearized upstream (the paper fits one-shot).
Where it lives: methods/nbl.py; linalg/cca.py; modules/linearized.py. Every criterion and each deviation's reason:
docs/methods/nbl.md. Measured: BENCHMARKS.md, section "NBL: linearized attention layers".
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from attnslim.adapters.base import Adapter
from attnslim.errors import AttnslimError
from attnslim.linalg.cca import JointStats, LmmseInfo, cca_bound, lmmse_map
from attnslim.methods.base import NO_CONTEXT, Fit, Method, StepContext, require
from attnslim.methods.collect import Collector
from attnslim.methods.selecting import Selecting
from attnslim.modules.linearized import INPUTS, LinearizedAttention
from attnslim.plan import JSON, LayerEntry, StepPlan
from attnslim.registry import register_method

SCORES = ("cca", "nmse", "resid", "similarity")  # computed for every candidate layer, recorded in the plan
MEASURED = "probe"  # measured on the calibration loss (pipeline/probe.py), not read from the statistics
CRITERIA = (*SCORES, MEASURED, "random", "highest", "given")
DEFAULT_CRITERION = "similarity"


@dataclass
class LayerFit:
    """One layer's LMMSE map and selection scores (all that is kept of its statistics)."""

    layer: int
    weight: torch.Tensor  # (d, d) in the layer's dtype
    bias: torch.Tensor  # (d,) in the layer's dtype
    scores: dict[str, float]
    info: LmmseInfo

    def summary(self) -> dict[str, JSON]:
        i = self.info
        return {"nmse": round(i.nmse, 6), "cond": float(f"{i.cond:.4g}"), "cond_ridged": float(f"{i.cond_ridged:.4g}"),
                "ridge_abs": float(f"{i.ridge_abs:.4g}"), "tokens": i.n_tokens}


@dataclass(frozen=True)
class NblEntry(LayerEntry):
    input: str  # what the installed map reads: "normed" (after the pre-attention norm) or "residual"


@dataclass
class RelativeMoments:
    """Token-weighted moments for the error relative to the residual stream, ω_t = 1 / ‖h_t + y_t‖².

    With xa = [x, 1]: s_xx = Σ ω xa xaᵀ (d+1, d+1), s_yx = Σ ω y xaᵀ (d, d+1), s_yy = Σ ω ‖y‖², n tokens.
    The next norm divides each token by its own rms, so what a linearization changes downstream is the
    per-token relative error — a ratio of means would be dominated by the few attention-sink tokens whose
    residual norm is a large multiple of the median (SmolLM2's deeper layers).
    """

    s_xx: torch.Tensor
    s_yx: torch.Tensor
    s_yy: float = 0.0
    n: int = 0

    @classmethod
    def zeros(cls, d: int, device: torch.device | str | None = None) -> RelativeMoments:
        f64 = torch.float64
        return cls(torch.zeros(d + 1, d + 1, dtype=f64, device=device), torch.zeros(d, d + 1, dtype=f64, device=device))

    def update(self, x: torch.Tensor, y: torch.Tensor, h_out: torch.Tensor, gain: torch.Tensor | None = None) -> None:
        """x, y, h_out (..., d): fit input, attention output, residual stream after the add; gain (...,): the
        per-token factor an output norm applies to y before the add (ω_t = gain_t² / ‖h_t + norm(y_t)‖²)."""
        d = y.shape[-1]
        dev = self.s_xx.device
        x2 = x.reshape(-1, x.shape[-1]).to(dev, torch.float64)  # (N, d)
        y2 = y.reshape(-1, d).to(dev, torch.float64)  # (N, d)
        root = h_out.reshape(-1, d).to(dev, torch.float64).norm(dim=-1).clamp_min(1e-30).reciprocal()  # (N,) √ω
        if gain is not None:
            root = root * gain.reshape(-1).to(dev, torch.float64)
        xa = torch.cat([x2, torch.ones_like(x2[:, :1])], dim=1) * root[:, None]  # (N, d+1)
        ya = y2 * root[:, None]  # (N, d)
        self.s_xx.addmm_(xa.T, xa)
        self.s_yx.addmm_(ya.T, xa)
        self.s_yy += float(ya.square().sum())
        self.n += int(x2.shape[0])

    def error(self, w: torch.Tensor, b: torch.Tensor) -> float:
        """Mean over tokens of ‖y − W x − b‖² / ‖h + y‖², in closed form from the moments."""
        wa = torch.cat([w, b[:, None]], dim=1).to(self.s_xx)  # (d, d+1)
        sse = self.s_yy - 2.0 * float((wa * self.s_yx).sum()) + float(((wa @ self.s_xx) * wa).sum())
        return max(sse, 0.0) / max(self.n, 1)


class LinearityCollector(Collector[LayerFit]):
    """Streams (X, Y) and (h, Y) statistics of one layer; `result()` fits the map and scores the layer."""

    def __init__(self, layer: int, input: str, ridge: float, out_norm: nn.Module | None = None) -> None:
        self.layer, self.input, self.ridge = layer, input, ridge
        self.out_norm = out_norm  # a norm the decoder layer applies to the attention output (Gemma-3), or None
        self.sites = {"resid_in", "attn_out"} | ({"attn_in"} if input == "normed" else set())
        self.h: torch.Tensor | None = None  # (b, t, d) residual stream of the running batch
        self.x: torch.Tensor | None = None  # (b, t, d) normed input of the running batch
        self.fit: JointStats | None = None  # (X, Y)
        self.res: JointStats | None = None  # (h, Y); the same object as `fit` when X = h
        self.rel: RelativeMoments | None = None
        self.cos_sum, self.seq_len = 0.0, 0
        self.dtype = torch.float32  # the layer's activations' dtype: the kept map's (see `result`)

    def __call__(self, site: str, x: torch.Tensor) -> None:
        if site == "resid_in":
            self.h = x
            return
        if site == "attn_in":
            self.x = x
            return
        assert self.h is not None, "resid_in must be seen before attn_out"
        h, y = self.h, x  # (b, t, d) each
        if self.fit is None:
            d = h.shape[-1]
            self.dtype = y.dtype
            self.res = JointStats.zeros(d, d, device=h.device)
            self.fit = self.res if self.input == "residual" else JointStats.zeros(d, d, device=h.device)
            self.rel = RelativeMoments.zeros(d, device=h.device)
        assert self.res is not None and self.rel is not None
        self.res.update(h, y)
        x_fit = h
        if self.fit is not self.res:
            assert self.x is not None, "attn_in must be seen before attn_out"
            x_fit = self.x
            self.fit.update(x_fit, y)
        h64 = h.to(torch.float64)
        if self.out_norm is None:
            h_out = h64 + y.to(torch.float64)  # (b, t, d) residual stream after the add
            self.rel.update(x_fit, y, h_out)
        else:  # the stream receives norm(y): score what is added, with the norm's per-token gain on the error
            added = self.out_norm(y).to(torch.float64)  # (b, t, d)
            h_out = h64 + added
            gain = added.norm(dim=-1) / y.to(torch.float64).norm(dim=-1).clamp_min(1e-30)  # (b, t)
            self.rel.update(x_fit, y, h_out, gain)
        self.cos_sum += float(F.cosine_similarity(h64, h_out, dim=-1).sum())
        self.seq_len = int(h.shape[1])
        self.h = self.x = None

    def _check(self) -> tuple[JointStats, JointStats]:
        fit, res = self.fit, self.res
        if fit is None or res is None:
            raise AttnslimError(f"layer {self.layer}: no calibration tokens reached the attention block")
        for name, stats in (("fit", fit), ("residual", res)):
            for key in ("sum_x", "sum_y", "sum_xx", "sum_yx", "sum_yy"):
                if not bool(torch.isfinite(getattr(stats, key)).all()):
                    raise AttnslimError(
                        f"layer {self.layer}: NaN/Inf in the NBL {name} statistics ({key}) after {stats.n} "
                        "tokens: the model's activations overflow here; compress in float32 and check the inputs"
                    )
        need = fit.d_x + 1
        if fit.n < need:
            windows = math.ceil(need / max(self.seq_len, 1))
            raise AttnslimError(
                f"layer {self.layer}: {fit.n} calibration tokens are too few for NBL's {fit.d_x}x{fit.d_x} "
                f"covariance: it needs at least {need} tokens (e.g. calibration.windows >= {windows} at "
                f"seq_len {self.seq_len}); raise calibration.windows or seq_len"
            )
        return fit, res

    def result(self) -> LayerFit:
        fit, res = self._check()
        try:
            w, b, info = lmmse_map(fit, ridge=self.ridge)
        except AttnslimError as e:  # add the layer to the solver's message
            raise AttnslimError(f"layer {self.layer}: {e}") from e
        mse = info.nmse * float(torch.trace(fit.cov_yy))  # E‖Y − Ŷ‖² (the error has zero mean)
        stream = float(torch.trace(res.sum_xx + res.sum_yx + res.sum_yx.T + res.sum_yy)) / res.n  # E‖h + Y‖²
        assert self.rel is not None
        scores = {
            "cca": cca_bound(res, residual=True),
            "nmse": info.nmse,
            "resid_mean": mse / stream,
            "resid": self.rel.error(w, b),
            "similarity": 1.0 - self.cos_sum / res.n,
        }
        # kept in the layer's dtype, after the float32 step set_map's cast took before: the installed weights are
        # the same, and a kept map per candidate layer costs half (4096² in bfloat16: 32 MB, 64 in float32)
        return LayerFit(self.layer, w.float().to(self.dtype), b.float().to(self.dtype), scores, info)


@register_method("nbl")
@dataclass(frozen=True)
class Nbl(Selecting[LayerFit], Method[NblEntry, LayerFit]):
    entry_type = NblEntry
    m: int | None = None
    fraction: float | None = None
    criterion: str = DEFAULT_CRITERION
    input: str = "normed"
    # An argument here, not a class constant: one-shot (dense statistics) or sequential refit. The pipeline
    # reads `method.sequential`; mypy objects to a field shadowing Method's ClassVar, which is intended here.
    sequential: bool = False  # type: ignore[misc]
    ridge: float = 1e-6
    seed: int = 0
    probe: int = 2  # calibration windows the "probe" criterion measures the loss on
    selects_layers = True

    def __post_init__(self) -> None:
        name = self.name
        require(self.criterion in CRITERIA, name, "criterion", self.criterion, " | ".join(CRITERIA))
        require(self.input in INPUTS, name, "input", self.input, " | ".join(INPUTS))
        require(isinstance(self.sequential, bool), name, "sequential", self.sequential, "true | false")
        require(isinstance(self.ridge, int | float) and math.isfinite(self.ridge) and self.ridge >= 0,
                name, "ridge", self.ridge, "a finite number >= 0 (relative to the mean eigenvalue of C_XX)")
        require(isinstance(self.seed, int), name, "seed", self.seed, "an integer")
        require(isinstance(self.probe, int) and not isinstance(self.probe, bool) and self.probe >= 1, name, "probe",
                self.probe, "an integer >= 1 (calibration windows for criterion 'probe')")
        if self.criterion == "given":
            require(self.m is None and self.fraction is None, name, "m/fraction", (self.m, self.fraction),
                    "unset with criterion 'given' (every candidate layer is linearized)")
            return
        require((self.m is None) != (self.fraction is None), name, "m/fraction", (self.m, self.fraction),
                "exactly one of m (a layer count) or fraction (of the candidate layers)")
        if self.m is not None:
            require(isinstance(self.m, int) and not isinstance(self.m, bool) and self.m >= 0, name, "m", self.m,
                    "an integer >= 0 (how many candidate layers to linearize)")
        else:
            frac = self.fraction
            require(isinstance(frac, int | float) and 0.0 <= frac <= 1.0,
                    name, "fraction", self.fraction, "a number in [0, 1] (of the candidate layers)")

    def count(self, candidates: int) -> int:
        """How many of `candidates` layers to linearize."""
        if self.criterion == "given":
            return candidates
        if self.m is not None:
            require(self.m <= candidates, self.name, "m", self.m, f"0..{candidates} (the candidate layers)")
            return self.m
        assert self.fraction is not None
        return round(self.fraction * candidates)

    def collector(self, adapter: Adapter, layer: int) -> Collector[LayerFit]:
        if self.m is not None and self.m > adapter.num_layers():  # fail before any statistics are collected
            self.count(adapter.num_layers())
        return LinearityCollector(layer, self.input, self.ridge, adapter.attention_output_norm(layer))

    def probe_windows(self) -> int:
        return self.probe if self.criterion == MEASURED else 0

    @contextmanager
    def trial(self, adapter: Adapter, layer: int, stats: LayerFit) -> Iterator[None]:
        """Layer `layer` linearized with its fit (and, for input="residual", its norm removed), then restored."""
        attention, norm = adapter.attention(layer), adapter.attention_norm(layer)
        self.convert(adapter, layer, NblEntry(self.input), stats)
        try:
            yield
        finally:
            adapter.replace_attention(layer, attention)
            adapter.replace_attention_norm(layer, norm)

    def select(self, scores: dict[int, dict[str, float]], count: int) -> list[int]:
        """The `count` layers to linearize under `criterion`, sorted; `scores` maps layer -> SCORES."""
        layers = sorted(scores)
        if self.criterion == "given":
            return layers
        if self.criterion == "random":
            perm = torch.randperm(len(layers), generator=torch.Generator().manual_seed(self.seed))
            return sorted(layers[int(j)] for j in perm[:count])
        key = "cca" if self.criterion == "highest" else self.criterion
        missing = [i for i in layers if key not in scores[i]]
        if missing:  # "probe" is measured by pipeline/probe.py during compress
            raise AttnslimError(f"nbl: criterion {self.criterion!r} has no score for layers {missing}; it is "
                                "measured by compress (attnslim.pipeline), not computed from the statistics alone")
        sign = -1.0 if self.criterion == "highest" else 1.0
        return sorted(sorted(layers, key=lambda i: sign * scores[i][key])[:count])

    def plan(self, adapter: Adapter, layers: list[int], stats: Mapping[int, LayerFit],
             context: StepContext = NO_CONTEXT) -> StepPlan[NblEntry]:
        count = self.count(len(layers))
        scores = {i: stats[i].scores for i in layers}
        measured = (MEASURED,) if self.probe_windows() else ()
        chosen = self.select(scores, count)
        return StepPlan({i: NblEntry(self.input) for i in chosen}, info={
            "criterion": self.criterion,
            "chosen": list(chosen),
            "scores": {s: {str(i): float(f"{scores[i][s]:.6g}") for i in layers} for s in SCORES + measured},
            "fit_dense": {str(i): stats[i].summary() for i in layers},
        })

    def convert(self, adapter: Adapter, layer: int, entry: NblEntry, stats: LayerFit) -> Fit:
        """Install the fitted map; returns the installed fit's diagnostics."""
        self._install(adapter, layer, entry).set_map(stats.weight, stats.bias)
        return stats.summary()

    def skeleton(self, adapter: Adapter, layer: int, entry: NblEntry) -> None:
        self._install(adapter, layer, entry)

    def _install(self, adapter: Adapter, layer: int, entry: NblEntry) -> LinearizedAttention:
        ref = next(iter(adapter.attention(layer).parameters()), None)
        if ref is None:
            ref = adapter.embed_tokens().get_parameter("weight")
        module = LinearizedAttention(layer, adapter.config.hidden_size, entry.input, ref.dtype, ref.device)
        adapter.replace_attention(layer, module)
        if entry.input == "residual":  # the map reads the raw residual stream h, as NBL's reference
            adapter.replace_attention_norm(layer, nn.Identity())
        return module

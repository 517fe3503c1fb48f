"""`mla` and `transmla`: attention as multi-head latent attention with decoupled RoPE (`MLAAttention`).

What is approximated: each layer's keys and values. Both methods cache, per token and layer, one latent c (rank r)
and one rotary key (d_rope dims) shared by every head; decode absorbs the key up-projection into the query and the
value up-projection into the output, so no cached key is decompressed. Per layer: a change of basis of each RoPE
frequency across the KV heads (`rope_dims`/2 components stay true rotary pairs, the rest join the non-rotary keys;
linalg/mla_rope.py), then one rank-r factorisation [k_nope; v] ≈ B (A x) (linalg/mla.py). q_proj and o_proj keep
their weights; biases are carried exactly.
`transmla`: the baseline, TransMLA (arXiv 2502.07864, RoRoPE + FreqFold + BKV-PCA), reimplemented from the paper.
`mla` (ours) adds LatentLLM's objective (root covariance, mean correction, Eq. 45) with output-side weights
(`kv_weight`), a logit-balanced choice of the rotary components (`rope_select=query`), FreqFold by default where
rotary pairs are fewer than frequencies (`rope_fold`), `alloc=global` ranks, and the optional `refit_o` (pipeline/
refit.py) and `local_steps` (pipeline/local_fit.py) for conversions without a heal.
Statistics: Σxxᵀ, Σx, n at the attention input (methods/mla_stats.py).
KV budget: `kv_ratio` (kept fraction of the dense cache, r = ⌊kv_ratio·2·n_kv·d_h⌋ − d_rope) or an explicit `rank`.
Parameters per layer: q_proj, o_proj as before; k_rope d·d_rope; latent r(D_n + n_kv·d_h + d) − r² (block-identity
A); query maps h·d_h·(d_rope + D_n), D_n = n_kv·d_h − d_rope. KV per token: r + d_rope (+ n_kv key scales with
QK-norm, taken from the latent's budget).
`layout=deepseek`: the form `attnslim export --to deepseek-v3` writes exactly and stock vLLM serves.
Where it lives: methods/mla.py (options, plan), mla_base.py (shared with transmla), mla_stats.py; linalg/mla.py,
mla_rope.py; modules/mla.py (the module). Every option, deviation and reason: docs/methods/mla.md. Measured:
BENCHMARKS.md, section "MLA: multi-head latent attention with decoupled RoPE beside TransMLA".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
from torch import nn

from attnslim.adapters.base import Adapter, AttentionSpec
from attnslim.errors import AttnslimError
from attnslim.linalg.mla import (
    MLAFactors,
    allocate_ranks,
    assemble,
    attention_weight,
    fit_latent,
    latent_spectrum,
)
from attnslim.linalg.mla_rope import SELECTS, RotarySplit
from attnslim.linalg.stats import InputStats
from attnslim.methods.base import NO_CONTEXT, StepContext, require
from attnslim.methods.mla_base import MLABase, MLAEntry, balance, fit_spec, stacked_kv
from attnslim.methods.mla_stats import MLAStats, attn_in, spectrum
from attnslim.methods.output_fits import OutputFits
from attnslim.methods.selecting import Selecting
from attnslim.modules.mla import MLAAttention
from attnslim.plan import StepPlan
from attnslim.registry import register_method

KV_WEIGHTS = ("attention", "rootcov", "svd")
ALLOCS = ("uniform", "global")
AUTO_FOLD = 4  # `mla`'s FreqFold where fewer rotary pairs than frequencies are kept (BENCHMARKS.md, MLA)
MAX_ROPE_SPAN = 1 << 20  # tokens, checked before loading: phase_mean holds a few float64 per distance (10^8: 2.6 GB)
ROW_FLOOR = 1e-3  # least weight of a key row whose query was shrunk to ~0 (keeps S invertible)


def folded_rope_dims(rotary_dims: int, elements: int | None) -> int:
    """`mla`'s d_rope when none is given: E/6 rounded to even (E cached elements per token), at least 8 and at
    most one head's rotary dims; the model's rotary dims with an explicit rank. With FreqFold a rotary slot holds
    more of the key than without, so fewer of them pay: fitted to rope_dims sweeps under rope_fold 4 on
    SmolLM2-135M at KV 0.5, 0.375 and 0.25 (BENCHMARKS.md, MLA). 0 without RoPE."""
    if rotary_dims == 0 or elements is None:
        return rotary_dims
    return max(min(8, rotary_dims), min(rotary_dims, 2 * round(elements / 12.0)))


@register_method("mla")
@dataclass(frozen=True)
class MLA(OutputFits, Selecting[MLAStats], MLABase):
    rope_select: str = "query"
    rope_span: int = 512  # tokens over which select=query averages the cost of dropping a rotation
    kv_weight: str = "attention"
    alloc: str = "uniform"  # or "global": the step's latent budget spread over its layers by spectrum
    center: bool = True  # fit on the centred covariance, the mean carried by o_proj's bias (layout free only)
    rope_fold: int | None = None  # FreqFold for either rope_select: neighbouring frequencies sharing one change of
    # basis; None: AUTO_FOLD where the layer keeps fewer rotary pairs than it has frequencies, else 1
    rope_spread: bool = False  # at most one rotary pair per frequency (always so in layout deepseek)
    refit_o: bool = False  # after each layer's conversion, refit o_proj to the dense attention's output (OutputFits)
    local_steps: int = 0  # then train the converted attention towards the dense one's output (pipeline/local_fit.py)
    local_lr: float = 3.0e-3  # relative to each tensor's RMS (pipeline/local_fit.py)
    later_args = ("refit_o", "local_steps", "local_lr", *MLABase.later_args)  # added after the MLA tables were measured

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.alloc in ALLOCS, self.name, "alloc", self.alloc, " | ".join(ALLOCS))
        require(self.rope_select in SELECTS, self.name, "rope_select", self.rope_select, " | ".join(SELECTS))
        require(self.kv_weight in KV_WEIGHTS, self.name, "kv_weight", self.kv_weight, " | ".join(KV_WEIGHTS))
        require(isinstance(self.rope_span, int) and not isinstance(self.rope_span, bool)
                and 1 <= self.rope_span <= MAX_ROPE_SPAN, self.name, "rope_span", self.rope_span,
                f"an integer in [1, {MAX_ROPE_SPAN}] (tokens)")
        require(isinstance(self.center, bool), self.name, "center", self.center, "true | false")
        require(self.rope_fold is None or (isinstance(self.rope_fold, int) and not isinstance(self.rope_fold, bool)
                                           and self.rope_fold >= 1),
                self.name, "rope_fold", self.rope_fold, "null (auto) or an integer >= 1 (1: no folding)")
        require(isinstance(self.rope_spread, bool), self.name, "rope_spread", self.rope_spread, "true | false")
        self.check_output_fits()

    def _default_rope(self, rotary_dims: int, elements: int | None, dense: int) -> int:
        return folded_rope_dims(rotary_dims, elements)

    def _rotary_choice(self, rope: int, rotary_dims: int) -> tuple[str, int, int, bool]:
        auto = AUTO_FOLD if rope < rotary_dims and not self.restricts_freqs() else 1  # those keep single frequencies
        fold = self.rope_fold if self.rope_fold is not None else auto
        return self.rope_select, self.rope_span, fold, self.layout == "deepseek" or self.rope_spread

    @property
    def selects_layers(self) -> bool:  # type: ignore[override]
        """alloc=global plans every layer's rank from statistics of all of them (then refits sequentially)."""
        return self.alloc == "global"

    def plan(self, adapter: Adapter, layers: list[int], stats: Mapping[int, MLAStats],
             context: StepContext = NO_CONTEXT) -> StepPlan[MLAEntry]:
        out = super().plan(adapter, layers, stats, context)
        if self.alloc != "global":
            return out
        spectra = {i: spectrum(stats.get(i), f"{self.name}: layer {i}") for i in layers}  # from `summarize`
        uniform = {i: out.layers[i].rank for i in layers}
        ranks = allocate_ranks(spectra, sum(uniform.values()), max(1, min(uniform.values()) // 4))
        for i in layers:
            old = out.layers[i]
            out.layers[i] = replace(old, rank=ranks[i], kv_elements=old.kv_elements - old.rank + ranks[i])
        return out

    def output_linear(self, adapter: Adapter, layer: int) -> nn.Linear:
        """The installed MLAAttention's o_proj (refit_o; methods/output_fits.py)."""
        return self._installed(adapter, layer).o_proj

    def refit_ridge(self) -> float:
        return self.damp  # the ridge of its latent fit

    def _installed(self, adapter: Adapter, layer: int) -> MLAAttention:
        module = adapter.attention(layer)
        if not isinstance(module, MLAAttention):
            raise AttnslimError(f"{self.name}: layer {layer} holds {type(module).__name__} after its conversion, "
                                "not MLAAttention")
        return module

    def summarize(self, adapter: Adapter, layer: int, stats: MLAStats) -> MLAStats:
        """alloc=global: the layer's latent spectrum under the uniform plan's d_rope, from the statistics of the
        model as it enters the step, computed while the layer's weights are in memory (with --offload the plan
        runs after every layer went back to disk). A sequential step refits every layer on fresh statistics, so
        its plan keeps only the spectrum, not the layer's Gram matrix."""
        if self.alloc != "global":
            return stats
        _, rope = self._sizes(adapter, layer)
        where = f"{self.name}: layer {layer}"
        st = attn_in(stats, layer, where)
        spec = fit_spec(self._folded(adapter.attention_spec(layer), st)[0], st)
        split = self._split(adapter, spec, st, rope, where)
        found = latent_spectrum(*self._objective(spec, split, st)[:3], self.damp, where)
        return MLAStats({} if self.sequential else stats.grams, found)

    def _objective(self, spec: AttentionSpec, split: RotarySplit, st: InputStats
                   ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor] | None, torch.Tensor | None]:
        """(W_kv, C, output-side weights, mean for the value correction) of the latent fit (`kv_weight`)."""
        w_kv = stacked_kv(spec, split)
        if self.kv_weight == "svd":
            return w_kv, torch.eye(spec.hidden_size, dtype=torch.float64), None, None
        # the mean correction lands in o_proj's bias, which layout deepseek does not have: the uncentred fit there
        centred = self.layout == "free" and self.center
        cov, mean = (st.centred_cov, st.mean) if centred else (st.corr, None)
        if self.kv_weight == "attention":
            w_k, w_v = attention_weight(spec.q, spec.q_bias, spec.v, spec.o, split, st, n_heads=spec.n_heads,
                                        n_kv_heads=spec.n_kv_heads, scaling=spec.scaling)
            return w_kv, cov, balance([w_k, w_v], w_kv, cov), mean
        rows = [torch.diag(split.nope_weight.clamp_min(ROW_FLOOR)), torch.eye(spec.v.shape[0], dtype=torch.float64)]
        return w_kv, cov, balance(rows, w_kv, cov), mean

    def _fit(self, spec: AttentionSpec, split: RotarySplit, st: InputStats, rank: int, where: str) -> MLAFactors:
        w_kv, cov, weights, mean = self._objective(spec, split, st)
        kv = fit_latent(w_kv, cov, rank, weights, self.damp, where)
        return assemble(spec.q, spec.k, spec.k_bias, spec.v, spec.v_bias, spec.o, spec.o_bias, split, kv, mean)

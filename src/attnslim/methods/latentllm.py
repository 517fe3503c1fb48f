"""`latentllm`: LatentLLM — attention-aware joint tensor compression (Koike-Akino et al., MERL 2025; seed 001).

Approximates, per layer, without training:
  q/k  qk=joint (default): the pre-softmax logits of every head by shared latents A_q x, A_k x and per-head
       decompressions (Tucker/HOSVD of the whitened per-head bilinear forms, Alg. 1; linalg/tucker.joint_qk),
       which turns MHA/GQA into multi-head latent attention (`LatentAttention`, latent key cache; the joint fits
       of q/k and v/o are in latentllm_attention).
       qk=split: each of W_q, W_k locally by activation-aware SVD (same module, same cache).
  v/o  vo=separate (default, the paper's final choice, Remark 11): local activation-aware SVD of each;
       vo=joint: the attention-agnostic joint V/O of App. G.0/G.1 (linalg/vo); vo=none keeps them dense.
  mlp  (latentllm_mlp) mlp=local: local SVD of gate/up/down; mlp=joint_ud: SparseLLM-style alternating up/down
       fit (§4.3, App. H; linalg/joint_ud). Exact for ReLU (OPT): the z', z updates are closed form. Gated MLPs
       (SwiGLU, GeGLU): z', z and all refits are exact, the gate pre-activation takes safeguarded
       Gauss-Newton steps (no closed form). Un-gated GELU and other activations are refused.
Statistics (streamed, float64): Σxxᵀ, Σx, Σ|x|, n at the attention input (q/k/v), the o input, the MLP and
down inputs (those that are compressed locally or ranked by spectrum); joint_ud holds a seeded reservoir
sample of `ud_tokens` MLP-input tokens (default 4096) and fits on that sample only.
Cost (weights; biases kept): each compressed d_out×d_in linear r(d_out + d_in) − r² with the block-identity
junction (default), r(d_out + d_in) with dense factors. KV cache per token and layer: r_k + r_v values
(cache=latent) instead of 2·n_kv·d_h; cache=dense stores rotated keys and values (dense-size cache, no
per-step key decompression); cache=values stores rotated keys and value latents, n_kv·d_h + r_v (kv_ratio then
cuts r_v only): the decode-speed-neutral choice with RoPE — see modules/latent.py for the cost of each.
Ranks (`latentllm_ranks`): `ratio` = kept fraction of each layer's attention (and MLP, or `mlp_ratio`) weights;
`total_ratio` = kept fraction of all model parameters, one fraction for every linear the step compresses
(solved for the step's layers in `begin_step`, so a subset of layers is compressed harder); `ranks` =
explicit ranks (refused, or capped with `cap_ranks`, where they would not save weights; no re-allocation).
alloc=uniform is the paper's rule: every matrix keeps the fraction. alloc=spectrum (default) keeps each layer's
group budget of the uniform rule but moves rank between the matrices greedily, by whitened spectrum energy lost
per weight (each matrix's energy normalised to 1). alloc=global runs that greedy across layers too: each group's
budget summed over the layers (so the kept fractions of attention and MLP hold model-wide, not per layer); it
needs the spectra of every layer first (a dense pass; `summarize` computes them while each layer is in memory, so
it runs with --offload and holds no Gram matrix per layer), then refits each layer on the compressed upstream.
Measured against each other (BENCHMARKS.md, section LatentLLM): global does not beat the per-layer rule, so it is
not the default.
kv_ratio bounds r_k + r_v by a kept fraction of the dense
KV cache, split between k and v by spectrum energy per cached value (q/o then share the rest of the budget).
Deviations from the paper, and why:
- alloc=spectrum by default: the uniform rule loses most of its perplexity in V, whose whitened spectrum is
  nearly flat; the spectrum allocation keeps V near full rank at the same parameter count (BENCHMARKS.md,
  section LatentLLM).
- A matrix allocated its full rank (r = min(d_out, d_in); alloc=spectrum often keeps V there) is installed as
  one dense nn.Linear holding B A: the same weight count as the block-identity factors, the same map, and no
  second matmul or index gather at decode. With a dense v_proj the module caches full values for that layer.
- RoPE models: decompress, then rotate (App. F.3) with RoPE-unaware HOSVD by default (rope_window=1);
  rope_window=w > 1 uses the RoPE-aware slices Θ_δ, δ = 0..−(w−1). The per-head junction J_i (d_h² per
  head) is not implemented: B_q, B_k stay dense (RoPE does not commute with a per-head junction anyway).
- GQA: ranks are per matrix (r_k from the k_proj shape), not r_q = r_k: the paper's rule assumes MHA.
  Joint QK refuses r_q or r_k below head_dim (the issue's rule), which rules out compressing MQA keys.
- joint QK with a pre-conditioner other than rootcov (Table 1 ablation) runs the same HOSVD with P in place
  of C^{1/2}; rootcov uses the bias-aware form (§3.7) when q and k have biases.
- Table 1/2 (pre-conditioners; benchmarks/latentllm.py, results/latentllm-table.json): root-cov minimises each
  matrix's activation loss (tested) but is not the best perplexity at mild compression; it is at strong
  compression with the spectrum allocation, so rootcov stays the default. Joint V/O against local V/O: Remark 11
  holds with the spectrum allocation (BENCHMARKS.md, section LatentLLM).
- joint_ud keeps the iterate with the lowest output error on its calibration sample (ud_keep_best, default
  true) instead of the last one: the alternating scheme does not guarantee improvement (App. H), and
  this way it is never worse than local compression on that sample. Its work dtype is float32.
- Statistics are collected sequentially (layer i sees compressed layers < i), one forward per layer with
  the original layer i (SparseLLM's order); q/k/v/o/MLP of a layer share that pass.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from attnslim.adapters.base import Adapter, AttentionSpec
from attnslim.calib.hooks import SITE_OF
from attnslim.calib.stats import InputStats
from attnslim.errors import AttnslimError
from attnslim.linalg.lowrank import JUNCTIONS, LowRankFactors, block_identity, factorize
from attnslim.linalg.precond import PRECOND_KINDS, preconditioner
from attnslim.methods import latentllm_ranks as rk
from attnslim.methods.base import NO_CONTEXT, Collector, Fit, Method, StepContext, require
from attnslim.methods.latentllm_attention import fit_joint_qk, fit_joint_vo
from attnslim.methods.latentllm_mlp import check_ud_activation, fit_joint_ud, fit_local
from attnslim.methods.latentllm_stats import LatentCollector, LayerStats
from attnslim.modules.latent import CACHE_MODES, LatentAttention
from attnslim.modules.lowrank import LowRankLinear, compact_linear, empty_compact_linear
from attnslim.plan import LayerEntry, StepPlan
from attnslim.registry import register_method

QK_MODES = ("joint", "split")
VO_MODES = ("separate", "joint", "none")
MLP_MODES = ("none", "local", "joint_ud")
ALLOCS = ("uniform", "spectrum", "global")


DEFAULT_RATIO = 0.8  # the kept fraction when no size is given
KAPPA = "kappa"  # begin_step's context: the kept fraction κ every linear of the step shares (total_ratio)


@dataclass(frozen=True)
class LatentEntry(LayerEntry):
    ranks: dict[str, int]  # linear name -> rank
    weights: dict[str, list[int]]  # group (attention, mlp) -> [dense weights, kept weights]


@register_method("latentllm")
@dataclass(frozen=True)
class LatentLLM(Method[LatentEntry, LayerStats]):
    ratio: float | None = None  # kept fraction of each attention matrix (and MLP matrix, unless mlp_ratio);
    # DEFAULT_RATIO when none of ratio, total_ratio and ranks is given
    mlp_ratio: float | None = None
    total_ratio: float | None = None  # kept fraction of all model parameters, one κ for every compressed linear
    ranks: dict[str, int] | None = None  # explicit ranks per linear name, the same in every layer
    cap_ranks: bool = False  # explicit ranks that would increase parameters: cap (warn) instead of refusing
    alloc: str = "spectrum"  # or "uniform" (the paper's rule): see the module docstring
    kv_ratio: float | None = None  # kept fraction of the KV cache: r_k + r_v per layer, split by spectrum
    qk: str = "joint"
    vo: str = "separate"
    mlp: str = "none"
    precond: str = "rootcov"
    junction: str = "block_identity"
    rope_window: int = 1
    cache: str = "latent"
    damp: float = 1e-2
    alpha: float = 0.5
    qk_iter: int = 8
    vo_iter: int = 8
    ud_iter: int = 4
    ud_tokens: int = 4096
    ud_keep_best: bool = True
    seed: int = 0
    sequential: bool = True  # type: ignore[misc]
    entry_type = LatentEntry

    def __post_init__(self) -> None:
        n = self.name
        if self.ratio is None and self.total_ratio is None and self.ranks is None:
            object.__setattr__(self, "ratio", DEFAULT_RATIO)
        given = [k for k in ("ratio", "total_ratio", "ranks") if getattr(self, k) is not None]
        require(len(given) == 1, n, "ratio/total_ratio/ranks", given, "exactly one of ratio, total_ratio or ranks")
        for key in ("ratio", "mlp_ratio", "total_ratio", "kv_ratio"):
            v = getattr(self, key)
            require(v is None or (isinstance(v, int | float) and 0 < v <= 1), n, key, v,
                    "(0, 1]: a kept fraction; above 1 the factors would hold more parameters than the dense layer")
        require(self.mlp_ratio is None or self.ratio is not None, n, "mlp_ratio", self.mlp_ratio, "only with ratio")
        require(self.kv_ratio is None or self.ranks is None, n, "kv_ratio", self.kv_ratio,
                "only with ratio or total_ratio (explicit ranks fix r_k and r_v; alloc does not apply to them)")
        require(self.ranks is None or isinstance(self.ranks, dict), n, "ranks", self.ranks,
                "a mapping like {q: 128, k: 64, v: 64, o: 128}")
        for key, valid in (("alloc", ALLOCS), ("qk", QK_MODES), ("vo", VO_MODES), ("mlp", MLP_MODES),
                           ("precond", PRECOND_KINDS), ("junction", JUNCTIONS), ("cache", CACHE_MODES)):
            require(getattr(self, key) in valid, n, key, getattr(self, key), " | ".join(valid))
        for key, low in (("rope_window", 1), ("qk_iter", 1), ("vo_iter", 1), ("ud_iter", 1), ("ud_tokens", 16)):
            v = getattr(self, key)
            require(isinstance(v, int) and not isinstance(v, bool) and v >= low, n, key, v, f"an integer >= {low}")
        require(isinstance(self.damp, int | float) and math.isfinite(self.damp) and self.damp >= 0, n, "damp",
                self.damp, ">= 0 (relative to mean(diag C); 1e-2 default)")
        require(0 < self.alpha <= 2, n, "alpha", self.alpha, "(0, 2]")
        require(self.alloc != "global" or (self.ranks is None and self.kv_ratio is None), n, "alloc", self.alloc,
                "uniform | spectrum with explicit ranks or kv_ratio (global moves rank across layers, which fixed "
                "ranks and a per-layer KV budget both rule out)")

    @property
    def selects_layers(self) -> bool:  # type: ignore[override]
        """alloc=global plans every layer from statistics of all of them (then refits sequentially)."""
        return self.alloc == "global"

    def summarize(self, adapter: Adapter, layer: int, stats: LayerStats) -> LayerStats:
        """alloc=global: each compressed linear's spectrum, computed while the layer's weights are in memory (with
        --offload the plan runs after every layer went back to disk). A sequential step refits every layer on fresh
        statistics, so its plan keeps only the spectra (not a Gram matrix per layer and site)."""
        if self.alloc != "global":
            return stats
        spectra = self._spectra(adapter, layer, list(self._shapes(adapter, layer)), stats)
        if self.sequential:
            return LayerStats({}, None, spectra)
        return LayerStats(stats.grams, stats.tokens, spectra)

    @property
    def block_identity(self) -> bool:
        return self.junction == "block_identity"

    # --- statistics and plan ----------------------------------------------------------------------
    def collector(self, adapter: Adapter, layer: int) -> Collector[LayerStats]:
        o_in = self.vo == "separate" or (self.vo == "joint" and self.alloc == "spectrum")
        sites = {"attn_in"} | ({"o_in"} if o_in else set())
        if self.mlp == "local" or (self.mlp != "none" and self.alloc in ("spectrum", "global")):
            sites |= {"mlp_in", "down_in"}
        return LatentCollector(sites, self.ud_tokens if self.mlp == "joint_ud" else 0, self.seed + layer)

    def _shapes(self, adapter: Adapter, layer: int) -> dict[str, tuple[int, int]]:
        spec = adapter.attention_spec(layer)
        names = ("q", "k") if self.vo == "none" else rk.ATTENTION
        shapes = {n: tuple(spec.weight(n).shape) for n in names}
        if self.mlp != "none":
            mspec = adapter.mlp_spec(layer)
            if self.mlp == "joint_ud":
                check_ud_activation(mspec, layer)
            shapes |= {n: tuple(w.shape) for n in rk.MLP if (w := getattr(mspec, n)) is not None}
        return shapes  # type: ignore[return-value]

    def begin_step(self, adapter: Adapter, layers: list[int]) -> StepContext:
        """total_ratio: solve one κ for the linears of the step's `layers`, on the model as it enters the step."""
        if self.total_ratio is None:
            return NO_CONTEXT
        return {KAPPA: rk.kappa_for_total([self._shapes(adapter, i) for i in layers],
                                          adapter.param_groups()["total"], self.total_ratio, self.junction)}

    def plan(self, adapter: Adapter, layers: list[int], stats: Mapping[int, LayerStats],
             context: StepContext = NO_CONTEXT) -> StepPlan[LatentEntry]:
        shapes = {i: self._shapes(adapter, i) for i in layers}
        ranks = {i: self._ranks(adapter, i, shapes[i], context) for i in layers}
        if self.alloc == "global":
            ranks = self._allocate_global(adapter, shapes, ranks, stats)
        elif self.ranks is None and (self.alloc == "spectrum" or self.kv_ratio is not None):
            ranks = {i: self._allocate(adapter, i, shapes[i], ranks[i], stats[i]) for i in layers}
        out = {}
        for i in layers:
            if self.qk == "joint":
                rk.check_joint_qk(ranks[i], adapter.attention_spec(i).head_dim, i)
            jn, sh = self.junction, shapes[i]
            weights = {g: [rk.dense_weights(s), rk.kept_weights(s, ranks[i], jn)] for g, s in rk.groups(sh).items()}
            out[i] = LatentEntry(ranks[i], weights)
        return StepPlan(out)

    def _allocate_global(self, adapter: Adapter, shapes: dict[int, dict[str, tuple[int, int]]],
                         ranks: dict[int, dict[str, int]], stats: Mapping[int, LayerStats]
                         ) -> dict[int, dict[str, int]]:
        """alloc=global: each group's (attention, MLP) budget of the uniform rule, summed over the layers, is
        re-spread over the matrices of every layer by whitened spectrum energy lost per weight — the greedy of
        alloc=spectrum, across layers (statistics of the model as it enters the step)."""
        out = {i: dict(r) for i, r in ranks.items()}
        for group in ("attention", "mlp"):
            keyed: dict[str, tuple[int, int]] = {}
            spectra: dict[str, torch.Tensor] = {}
            floors: dict[str, int] = {}
            budget = 0
            for i, sh in shapes.items():
                sub = rk.groups(sh).get(group)
                if not sub:
                    continue
                budget += rk.kept_weights(sub, ranks[i], self.junction)
                for n in sub:
                    keyed[f"{i}.{n}"], spectra[f"{i}.{n}"] = sub[n], stats[i].spectra_of(i)[n]
                    if self.qk == "joint" and n in ("q", "k"):
                        floors[f"{i}.{n}"] = adapter.attention_spec(i).head_dim
            if keyed:
                for key, r in rk.spectrum_ranks(spectra, keyed, budget, self.junction, floors).items():
                    layer, name = key.split(".")
                    out[int(layer)][name] = r
        return out

    def _ranks(self, adapter: Adapter, layer: int, shapes: dict[str, tuple[int, int]], context: StepContext
               ) -> dict[str, int]:
        if self.ranks is not None:
            return rk.check_explicit(self.ranks, shapes, self.junction, self.cap_ranks, layer)
        if self.total_ratio is not None:
            if KAPPA not in context:
                raise AttnslimError("latentllm total_ratio: pass plan the context begin_step(adapter, layers) "
                                    "returns (the pipeline does), so κ is solved for the step's layers")
            kappa = dict.fromkeys(shapes, context[KAPPA])
        else:
            assert self.ratio is not None
            mlp = self.ratio if self.mlp_ratio is None else self.mlp_ratio
            kappa = {n: mlp if n in rk.MLP else self.ratio for n in shapes}
        return rk.uniform_ranks(shapes, kappa, self.junction)

    def _allocate(self, adapter: Adapter, layer: int, shapes: dict[str, tuple[int, int]], ranks: dict[str, int],
                  stats: LayerStats) -> dict[str, int]:
        spec = adapter.attention_spec(layer)
        floors = {n: spec.head_dim for n in ("q", "k") if self.qk == "joint"}
        return rk.allocate(
            shapes, ranks, lambda names: self._spectra(adapter, layer, names, stats), alloc=self.alloc,
            kv_ratio=self.kv_ratio, kv_full=spec.n_kv_heads * spec.head_dim, junction=self.junction, floors=floors,
            dense_keys=self.cache == "values")

    def _spectra(self, adapter: Adapter, layer: int, names: list[str], stats: LayerStats
                 ) -> dict[str, torch.Tensor]:
        """Singular values of W P (the local activation-aware spectrum) of each named linear."""
        attn = adapter.attention_spec(layer)
        mlp = adapter.mlp_spec(layer) if any(n in rk.MLP for n in names) else None
        out = {}
        for n in names:
            spec = attn if n in rk.ATTENTION else mlp
            w, b = getattr(spec, n), getattr(spec, f"{n}_bias")
            center = b is not None and self.precond in ("rootcov", "cov")
            pc = preconditioner(stats.site(SITE_OF[n], layer), self.precond, damp=self.damp, alpha=self.alpha,
                                center=center, label=f"layer {layer} {n}")
            out[n] = torch.linalg.svdvals(pc.right(w.to(pc.p.device, torch.float64)))  # where the statistics are
        return out

    # --- conversion -----------------------------------------------------------------------------------
    def convert(self, adapter: Adapter, layer: int, entry: LatentEntry, stats: LayerStats) -> Fit:
        """Fit and install; returns the fit diagnostics (per QK, VO and MLP part)."""
        spec = adapter.attention_spec(layer)
        ranks, fit = entry.ranks, {}
        st = stats.site("attn_in", layer)
        fq, fk, fit["qk"] = self._qk(spec, st, ranks, layer)
        v, o, fit["vo"] = self._vo(adapter, spec, stats, ranks, layer)
        dtype, device = spec.q.dtype, spec.q.device
        q_mod, k_mod = compact_linear(fq, dtype), LowRankLinear.from_factors(fk, dtype)  # k: the key latent
        self._install(adapter, layer, spec, q_mod, k_mod, v, o).to(device)
        if self.mlp != "none":
            fit["mlp"] = self._mlp(adapter, layer, stats, ranks)
        return {k: val for k, val in fit.items() if val}

    def _qk(self, spec: AttentionSpec, st: InputStats, ranks: dict[str, int], layer: int
            ) -> tuple[LowRankFactors, LowRankFactors, dict[str, Any]]:
        if self.qk == "split":
            fq = self._local(spec.q, spec.q_bias, st, ranks["q"], f"layer {layer} q")
            return fq, self._local(spec.k, spec.k_bias, st, ranks["k"], f"layer {layer} k"), {}
        return fit_joint_qk(spec, st, ranks, layer, precond=self.precond, damp=self.damp, alpha=self.alpha,
                            rope_window=self.rope_window, n_iter=self.qk_iter, block_identity=self.block_identity)

    def _vo(self, adapter: Adapter, spec: AttentionSpec, stats: LayerStats, ranks: dict[str, int], layer: int
            ) -> tuple[nn.Module, nn.Module, dict[str, Any]]:
        if self.vo == "none":
            return adapter.linear(layer, "v"), adapter.linear(layer, "o"), {}
        st_v = stats.site("attn_in", layer)
        if self.vo == "separate":
            fv = self._local(spec.v, spec.v_bias, st_v, ranks["v"], f"layer {layer} v")
            fo = self._local(spec.o, spec.o_bias, stats.site("o_in", layer), ranks["o"], f"layer {layer} o")
            info: dict[str, Any] = {}
        else:
            fv, fo, info = fit_joint_vo(spec, st_v, ranks, layer, n_iter=self.vo_iter, damp=self.damp,
                                        gauge=self._gauge)
        dtype = spec.v.dtype
        return compact_linear(fv, dtype), compact_linear(fo, dtype), info

    def _local(self, w: torch.Tensor, b: torch.Tensor | None, st: InputStats, rank: int, label: str) -> LowRankFactors:
        """Local activation-aware factorisation with this step's pre-conditioner, junction and damping."""
        return factorize(w, b, st, rank, precond=self.precond, junction=self.junction, damp=self.damp,
                         alpha=self.alpha, label=label)

    def _gauge(self, b: torch.Tensor, a: torch.Tensor, bias: torch.Tensor | None) -> LowRankFactors:
        """Joint V/O factors in the module's form: the identity block (if any) in A's columns."""
        if not self.block_identity:
            return LowRankFactors(b, a, bias, None)
        b2, a2, perm = block_identity(b, a)
        return LowRankFactors(b2, a2, bias, perm)

    def _mlp(self, adapter: Adapter, layer: int, stats: LayerStats, ranks: dict[str, int]) -> dict[str, Any]:
        """Fit (latentllm_mlp) and install the MLP's factors; returns the fit diagnostics."""
        spec = adapter.mlp_spec(layer)
        info: dict[str, Any] = {}
        if self.mlp == "local":
            factors = fit_local(spec, stats, ranks, layer, self._local)
        else:
            factors, info = fit_joint_ud(
                spec, stats, ranks, layer, n_iter=self.ud_iter, damp=self.damp,
                junction="left" if self.block_identity else self.junction, keep_best=self.ud_keep_best,
                gauge=self._gauge if self.block_identity else None)
        for n, f in factors.items():
            adapter.replace_linear(layer, n, compact_linear(f, spec.up.dtype).to(spec.up.device))
        return info

    # --- modules ----------------------------------------------------------------------------------------
    def _install(self, adapter: Adapter, layer: int, spec: AttentionSpec, q: nn.Module, k: LowRankLinear, v: nn.Module,
                 o: nn.Module) -> LatentAttention:
        rotary = adapter.rotary_embedding(spec.rope.layer_type) if spec.rope is not None else None
        module = LatentAttention(
            layer, spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.scaling, q_proj=q, k_proj=k, v_proj=v,
            o_proj=o, q_norm=spec.q_norm, k_norm=spec.k_norm, rotary=rotary,
            layer_type=spec.rope.layer_type if spec.rope is not None else None,
            sliding_window=spec.sliding_window, softcap=spec.softcap, cache=self.cache,
        )
        adapter.replace_attention(layer, module)
        return module

    def skeleton(self, adapter: Adapter, layer: int, entry: LatentEntry) -> None:
        spec = adapter.attention_spec(layer)
        ranks, dtype, device = entry.ranks, spec.q.dtype, spec.q.device

        def empty(name: str, w: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
            d_out, d_in = w.shape
            return empty_compact_linear(d_in, d_out, ranks[name], bias is not None, self.block_identity, dtype)

        d_k = spec.k.shape
        k = LowRankLinear(d_k[1], d_k[0], ranks["k"], spec.k_bias is not None, self.block_identity, dtype)
        q = empty("q", spec.q, spec.q_bias)
        if self.vo == "none":
            v, o = adapter.linear(layer, "v"), adapter.linear(layer, "o")
        else:
            v, o = empty("v", spec.v, spec.v_bias), empty("o", spec.o, spec.o_bias)
        if self.mlp != "none":
            mspec = adapter.mlp_spec(layer)
            for n in rk.MLP:
                if (w := getattr(mspec, n)) is not None:
                    adapter.replace_linear(layer, n, empty(n, w, getattr(mspec, f"{n}_bias")).to(device))
        self._install(adapter, layer, spec, q, k, v, o).to(device)


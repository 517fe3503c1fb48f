"""`latentllm`: LatentLLM, attention-aware joint tensor compression (Koike-Akino et al., MERL 2025; seed 001).

What is approximated, per layer, without training: q/k jointly (`qk=joint`, default: the pre-softmax logits of every
head by shared latents A_q x, A_k x and per-head decompressions, Tucker/HOSVD of the whitened per-head bilinear
forms, Alg. 1; this turns MHA/GQA into multi-head latent attention, `LatentAttention` with a latent key cache) or
each alone (`qk=split`; ablations: `joint_qkv`, one A for q/k/v, App. C; `split_head`, App. D: latentllm_forms.py);
v and o by local activation-aware SVD (`vo=separate`, the paper's final choice, Remark 11) or jointly (`vo=joint`,
App. G); optionally the MLP (`mlp=local`, or `mlp=joint_ud`: SparseLLM-style alternating up/down fit, §4.3, App. H).
Statistics (streamed, float64): Σxxᵀ, Σx, Σ|x|, n at the inputs of the compressed linears, collected sequentially
(layer i sees the compressed layers < i); joint_ud fits on a seeded reservoir sample of MLP-input tokens.
Cost (weights; biases kept): each compressed d_out×d_in linear r(d_out + d_in) − r² with the block_identity (default),
left_block_identity or lu junction, r(d_out + d_in) with dense factors. KV per token and layer: r_k + r_v instead of
2·n_kv·d_h (`cache=latent`); `cache=values` n_kv·d_h + r_v (rotated keys, value latents); `cache=dense` 2·n_kv·d_h.
Ranks: `ratio` (kept fraction of each layer's attention weights), `total_ratio` (of all parameters), `kv_ratio`
(of the dense KV cache) or explicit `ranks`; `alloc=spectrum` (default) moves rank between a layer's matrices by
whitened spectrum energy, `alloc=uniform` is the paper's rule, `alloc=global` allocates across layers.
Deviations from the paper: the spectrum allocation by default (the uniform rule loses most in V, whose whitened
spectrum is flat); full-rank matrices installed dense; RoPE handled by decompress-then-rotate (App. F.3), no per-head
junction; per-matrix ranks under GQA; joint_ud keeps its best iterate (App. H does not guarantee improvement).
Where it lives: methods/latentllm.py (plan, convert), latentllm_attention.py, latentllm_ranks.py, latentllm_mlp.py;
linalg/tucker.py, vo.py, joint_ud.py, lowrank.py; modules/latent.py. Every option and each deviation's reason:
docs/methods/latentllm.md. Measured: BENCHMARKS.md, section LatentLLM.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from attnslim.adapters.base import Adapter, AttentionSpec
from attnslim.adapters.rotary import rotary_angles
from attnslim.calib.hooks import SITE_OF
from attnslim.errors import AttnslimError
from attnslim.linalg.lowrank import JUNCTIONS, LowRankFactors, factorize, regauge
from attnslim.linalg.precond import PRECOND_KINDS, PrecondSpec
from attnslim.linalg.ranks import saves_square
from attnslim.linalg.stats import InputStats
from attnslim.methods import latentllm_forms as forms
from attnslim.methods import latentllm_ranks as rk
from attnslim.methods.base import NO_CONTEXT, Fit, Method, StepContext, require
from attnslim.methods.collect import Collector
from attnslim.methods.latentllm_attention import fit_joint_qk, fit_joint_vo
from attnslim.methods.latentllm_mlp import check_ud_activation, fit_joint_ud, fit_local
from attnslim.methods.latentllm_stats import LatentCollector, LayerStats
from attnslim.methods.selecting import Selecting
from attnslim.modules.base import AttnShape
from attnslim.modules.latent import CACHE_MODES, LatentAttention
from attnslim.modules.lowrank import LowRankLinear, compact_linear, empty_compact_linear
from attnslim.plan import LayerEntry, StepPlan
from attnslim.registry import register_method

QK_MODES = ("joint", "split", forms.JOINT_QKV, forms.SPLIT_HEAD)
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
class LatentLLM(Selecting[LayerStats], Method[LatentEntry, LayerStats]):
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
        forms.check_form_options(self)

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

    @property
    def form(self) -> str:
        """The installed LowRankLinear form (modules/lowrank.FORMS): the junction when it saves r², else dense."""
        return self.junction if saves_square(self.junction) else "dense"

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
        if self.qk == forms.JOINT_QKV:  # one factor pair of the stacked q/k/v
            shapes = {"qkv": forms.qkv_shape(spec), "o": shapes["o"]}
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
                                          adapter.param_groups()["total"], self.total_ratio, self.junction,
                                          heads=self._heads(adapter, layers[0]))}

    def _heads(self, adapter: Adapter, layer: int) -> dict[str, int]:
        """qk=split_head: the head count of q and k (their weights and ranks count per head); else empty."""
        return forms.split_heads(self.qk, adapter.attention_spec(layer))

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
            jn, sh, hd = self.junction, shapes[i], self._heads(adapter, i)
            weights = {g: [rk.dense_weights(s), rk.kept_weights(s, ranks[i], jn, hd)] for g, s in rk.groups(sh).items()}
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
        heads = self._heads(adapter, layer)
        if self.ranks is not None:
            return rk.check_explicit(self.ranks, shapes, self.junction, self.cap_ranks, layer, heads)
        if self.total_ratio is not None:
            if KAPPA not in context:
                raise AttnslimError("latentllm total_ratio: pass plan the context begin_step(adapter, layers) "
                                    "returns (the pipeline does), so κ is solved for the step's layers")
            kappa = dict.fromkeys(shapes, context[KAPPA])
        else:
            assert self.ratio is not None
            mlp = self.ratio if self.mlp_ratio is None else self.mlp_ratio
            kappa = {n: mlp if n in rk.MLP else self.ratio for n in shapes}
        return rk.uniform_ranks(shapes, kappa, self.junction, heads)

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
            w, b = forms.stacked_qkv(attn) if n == "qkv" else (getattr(spec, n), getattr(spec, f"{n}_bias"))
            center = b is not None and self.precond in ("rootcov", "cov")
            site = SITE_OF["q" if n == "qkv" else n]  # the stacked q/k/v reads the attention input
            pc = self.precond_spec.build(stats.site(site, layer), center=center, label=f"layer {layer} {n}")
            out[n] = torch.linalg.svdvals(pc.right(w.to(pc.p.device, torch.float64)))  # where the statistics are
        return out

    # --- conversion -----------------------------------------------------------------------------------
    def convert(self, adapter: Adapter, layer: int, entry: LatentEntry, stats: LayerStats) -> Fit:
        """Fit and install; returns the fit diagnostics (per QK, VO and MLP part)."""
        spec = adapter.attention_spec(layer)
        ranks, fit = entry.ranks, {}
        st = stats.site("attn_in", layer)
        dtype, device = spec.q.dtype, spec.q.device
        if self.qk == forms.JOINT_QKV:
            fqkv = forms.fit_joint_qkv(spec, st, ranks["qkv"], layer, precond=self.precond_spec, junction=self.junction)
            fo = self._local(spec.o, spec.o_bias, stats.site("o_in", layer), ranks["o"], f"layer {layer} o")
            forms.install_joint_qkv(adapter, layer, spec, LowRankLinear.from_factors(fqkv, dtype),
                                    compact_linear(fo, dtype)).to(device)
        else:
            q_mod: nn.Module
            k_mod: LowRankLinear  # the key latent
            if self.qk == forms.SPLIT_HEAD:
                q_mod, k_mod = forms.fit_split_head(spec, st, ranks, layer, precond=self.precond_spec, dtype=dtype)
            else:
                fq, fk, fit["qk"] = self._qk(adapter, spec, st, ranks, layer)
                q_mod, k_mod = compact_linear(fq, dtype), LowRankLinear.from_factors(fk, dtype)
            v, o, fit["vo"] = self._vo(adapter, spec, stats, ranks, layer)
            self._install(adapter, layer, spec, q_mod, k_mod, v, o).to(device)
        if self.mlp != "none":
            fit["mlp"] = self._mlp(adapter, layer, stats, ranks)
        return {k: val for k, val in fit.items() if val}

    def _qk(self, adapter: Adapter, spec: AttentionSpec, st: InputStats, ranks: dict[str, int], layer: int
            ) -> tuple[LowRankFactors, LowRankFactors, dict[str, Any]]:
        if self.qk == "split":
            fq = self._local(spec.q, spec.q_bias, st, ranks["q"], f"layer {layer} q")
            return fq, self._local(spec.k, spec.k_bias, st, ranks["k"], f"layer {layer} k"), {}
        angles = rotary_angles(adapter, spec.rope.layer_type) if spec.rope is not None else None
        fq, fk, info = fit_joint_qk(spec, st, ranks, layer, precond=self.precond_spec, rope_window=self.rope_window,
                                    n_iter=self.qk_iter, block_identity=self.block_identity,
                                    rope_freqs=None if angles is None else angles[0])
        if self.form in ("left_block_identity", "lu"):  # the shared latents' J_q, J_k: B's rows hold the structure
            fq, fk = self._gauge(fq.B, fq.A, fq.bias), self._gauge(fk.B, fk.A, fk.bias)
        return fq, fk, info

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
        return factorize(w, b, st, rank, precond=self.precond_spec, junction=self.junction, label=label)

    @property
    def precond_spec(self) -> PrecondSpec:
        """This step's pre-conditioner: kind, damping and the l1 exponent."""
        return PrecondSpec(self.precond, self.damp, self.alpha)

    def _gauge(self, b: torch.Tensor, a: torch.Tensor, bias: torch.Tensor | None) -> LowRankFactors:
        """Joint factors (V/O, U/D, the LU-like or left-block Q/K) in the module's form: this step's junction when
        it saves r², else dense."""
        return regauge(b, a, bias, self.form if self.form != "dense" else "left")

    def _mlp(self, adapter: Adapter, layer: int, stats: LayerStats, ranks: dict[str, int]) -> dict[str, Any]:
        """Fit (latentllm_mlp) and install the MLP's factors; returns the fit diagnostics."""
        spec = adapter.mlp_spec(layer)
        info: dict[str, Any] = {}
        if self.mlp == "local":
            factors = fit_local(spec, stats, ranks, layer, self._local)
        else:
            factors, info = fit_joint_ud(
                spec, stats, ranks, layer, n_iter=self.ud_iter, damp=self.damp,
                junction="left" if self.form != "dense" else self.junction, keep_best=self.ud_keep_best,
                gauge=self._gauge if self.form != "dense" else None)
        for n, f in factors.items():
            adapter.replace_linear(layer, n, compact_linear(f, spec.up.dtype).to(spec.up.device))
        return info

    # --- modules ----------------------------------------------------------------------------------------
    def _install(self, adapter: Adapter, layer: int, spec: AttentionSpec, q: nn.Module, k: LowRankLinear, v: nn.Module,
                 o: nn.Module) -> LatentAttention:
        rotary = adapter.rotary_embedding(spec.rope.layer_type) if spec.rope is not None else None
        module = LatentAttention(
            AttnShape.of(spec), q_proj=q, k_proj=k, v_proj=v, o_proj=o, q_norm=spec.q_norm,
            k_norm=spec.k_norm, rotary=rotary, cache=self.cache,
        )
        adapter.replace_attention(layer, module)
        return module

    def skeleton(self, adapter: Adapter, layer: int, entry: LatentEntry) -> None:
        spec = adapter.attention_spec(layer)
        ranks, dtype, device = entry.ranks, spec.q.dtype, spec.q.device

        def empty(name: str, w: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
            d_out, d_in = w.shape
            return empty_compact_linear(d_in, d_out, ranks[name], bias is not None, self.block_identity, dtype,
                                        self.form)

        if self.mlp != "none":
            mspec = adapter.mlp_spec(layer)
            for n in rk.MLP:
                if (w := getattr(mspec, n)) is not None:
                    adapter.replace_linear(layer, n, empty(n, w, getattr(mspec, f"{n}_bias")).to(device))
        if self.qk == forms.JOINT_QKV:
            qkv = forms.empty_qkv(spec, ranks["qkv"], dtype, self.form)
            forms.install_joint_qkv(adapter, layer, spec, qkv, empty("o", spec.o, spec.o_bias)).to(device)
            return
        q: nn.Module
        k: LowRankLinear
        if self.qk == forms.SPLIT_HEAD:
            q, k = forms.empty_split_head(spec, ranks, dtype)
        else:
            d_k = spec.k.shape
            k = LowRankLinear(d_k[1], d_k[0], ranks["k"], spec.k_bias is not None, self.block_identity, dtype,
                              form=self.form)
            q = empty("q", spec.q, spec.q_bias)
        if self.vo == "none":
            v, o = adapter.linear(layer, "v"), adapter.linear(layer, "o")
        else:
            v, o = empty("v", spec.v, spec.v_bias), empty("o", spec.o, spec.o_bias)
        self._install(adapter, layer, spec, q, k, v, o).to(device)

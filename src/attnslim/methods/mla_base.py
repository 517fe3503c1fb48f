"""The shared part of `mla` and `transmla` (methods/mla.py, methods/transmla.py): the per-layer entry, the KV
budget and its refusals, the rotary split and the installed `MLAAttention`; the two differ in how they choose the
rotary directions (`_rotary_choice`) and fit the latent (`_fit`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import nn

from attnslim.adapters.base import Adapter, AttentionSpec
from attnslim.adapters.rotary import rotary_angles
from attnslim.errors import AttnslimError
from attnslim.linalg.bias_fold import RIDGE, constant_fit, fold_bias
from attnslim.linalg.mla import (
    MLAFactors,
    head_moments,
    mean_square,
    second_moment,
)
from attnslim.linalg.mla_rope import RotaryChoice, RotaryLayout, RotarySplit, split_rotary
from attnslim.linalg.stats import InputStats
from attnslim.methods.base import NO_CONTEXT, Fit, Method, StepContext, require
from attnslim.methods.collect import Collector
from attnslim.methods.mla_stats import MLACollector, MLAStats, attn_in
from attnslim.modules.base import AttnShape
from attnslim.modules.mla import MLAAttention, MLAShape
from attnslim.plan import LayerEntry, StepPlan

LAYOUTS = ("free", "deepseek")
BIASES = ("keep", "fold")
FOLDED = ("q", "k", "v")  # the projections whose biases `biases: fold` folds (o_proj's input has no common part)



@dataclass(frozen=True)
class MLAEntry(LayerEntry):
    rank: int  # latent rank r
    rope_dims: int  # d_rope: the rotary key's width
    kv_elements: int  # r + d_rope, cached per token
    dense_kv_elements: int  # 2·n_kv·d_h, what the dense layer caches


@dataclass(frozen=True)
class MLABase(Method[MLAEntry, MLAStats]):
    kv_ratio: float | None = None  # kept fraction of the dense KV cache, r + d_rope per token and layer; 0.5 when
    # neither kv_ratio nor rank is given
    rank: int | None = None  # explicit latent rank r instead
    rope_dims: int | None = None  # d_rope, even; default: `default_rope_dims`
    damp: float = 1e-2
    layout: str = "free"  # "deepseek": the form `attnslim export --to deepseek-v3` writes exactly (see below)
    # keep rotary pairs only at every rope_stride-th frequency, or only at the rope_fastest fastest (indices below
    # it): on 128-dim heads, 2 or 32 give the 64-dim DeepSeek-V3 rotary key vLLM serves (export --kv-lora-rank
    # auto; linalg/mla_rope.py); either needs rope_fold 1 (the default then). rope_fastest 32 costs nothing
    # measurable where rope_stride 2 is ruinous (docs/serving.md, "Served widths")
    rope_stride: int = 1
    rope_fastest: int | None = None
    # "fold" (layout deepseek only): the q and v biases and the rotary key's bias folded into their weights by least
    # squares on the layer's calibration input (linalg/bias_fold.py), so that a Qwen-family model takes the bias-free
    # DeepSeek-V3 form vLLM loads; the non-rotary key bias is dropped exactly, as always (softmax ignores it).
    # Approximate: what it costs is in docs/serving.md, "Biased models"; use it with the servable key (rope_fastest:
    # 32 on 128-dim heads): a bias on slow rotary frequencies neither folds nor drops. "keep": every bias carried
    # exactly (layout free); layout deepseek then refuses a biased model
    biases: str = "keep"
    # the fold's ridge λ, relative to the mean diagonal of E[xxᵀ] (null: linalg/bias_fold.RIDGE); biases: fold only
    fold_ridge: float | None = None
    entry_type = MLAEntry
    # added after the MLA tables were measured (Method.args)
    later_args: ClassVar[tuple[str, ...]] = ("biases", "fold_ridge")

    def __post_init__(self) -> None:
        n = self.name
        if self.kv_ratio is None and self.rank is None:
            object.__setattr__(self, "kv_ratio", 0.5)
        require(self.layout in LAYOUTS, n, "layout", self.layout, " | ".join(LAYOUTS))
        require((self.kv_ratio is None) != (self.rank is None), n, "kv_ratio/rank", (self.kv_ratio, self.rank),
                "exactly one of kv_ratio (a kept fraction of the dense KV cache) or rank")
        require(self.kv_ratio is None or (isinstance(self.kv_ratio, int | float) and 0 < self.kv_ratio <= 1), n,
                "kv_ratio", self.kv_ratio, "(0, 1]: a kept fraction of the dense KV cache")
        for key in ("rank", "rope_dims"):
            v = getattr(self, key)
            require(v is None or (isinstance(v, int) and not isinstance(v, bool)), n, key, v, "an integer")
        require(self.rank is None or self.rank >= 1, n, "rank", self.rank,
                "an integer >= 1 (the latent rank; or leave rank out and give kv_ratio)")
        require(self.rope_dims is None or (self.rope_dims >= 0 and self.rope_dims % 2 == 0), n, "rope_dims",
                self.rope_dims, "an even number >= 0 (rotary dims come in frequency pairs)")
        require(isinstance(self.rope_stride, int) and not isinstance(self.rope_stride, bool) and self.rope_stride >= 1,
                n, "rope_stride", self.rope_stride, "an integer >= 1 (2: the even frequencies only)")
        require(self.rope_fastest is None or (isinstance(self.rope_fastest, int) and not isinstance(
            self.rope_fastest, bool) and self.rope_fastest >= 1), n, "rope_fastest", self.rope_fastest,
            "null or an integer >= 1 (frequencies kept rotary: the fastest this many)")
        require(isinstance(self.damp, int | float) and math.isfinite(self.damp) and self.damp > 0, n, "damp",
                self.damp, "> 0 (relative to the mean diagonal; 1e-2 default)")
        require(self.biases in BIASES, n, "biases", self.biases, " | ".join(BIASES))
        require(self.biases == "keep" or self.layout == "deepseek", n, "biases", self.biases,
                "keep with layout: free, which carries every bias exactly (fold is for layout: deepseek)")
        require(self.fold_ridge is None or (isinstance(self.fold_ridge, int | float) and not isinstance(
            self.fold_ridge, bool) and math.isfinite(self.fold_ridge) and self.fold_ridge > 0), n, "fold_ridge",
            self.fold_ridge, f"null or a number > 0 (relative to the mean diagonal; default {RIDGE:g})")
        require(self.fold_ridge is None or self.biases == "fold", n, "fold_ridge", self.fold_ridge,
                "null unless biases: fold (the ridge of the fold's least squares)")

    # --- decisions --------------------------------------------------------------------------------------
    def collector(self, adapter: Adapter, layer: int) -> Collector[MLAStats]:
        return MLACollector()

    def begin_step(self, adapter: Adapter, layers: list[int]) -> StepContext:
        """Refuse every layer's bad input before any statistics are collected or any layer converted."""
        for i in layers:
            self._sizes(adapter, i)
        return NO_CONTEXT

    def plan(self, adapter: Adapter, layers: list[int], stats: Mapping[int, MLAStats],
             context: StepContext = NO_CONTEXT) -> StepPlan[MLAEntry]:
        out = {}
        for i in layers:
            spec = adapter.attention_spec(i)
            rank, rope = self._sizes(adapter, i)
            out[i] = MLAEntry(rank, rope, rank + rope + key_scales(spec), 2 * spec.n_kv_heads * spec.head_dim)
        return StepPlan(out)

    def _sizes(self, adapter: Adapter, layer: int) -> tuple[int, int]:
        """(r, d_rope) of one layer, or a refusal naming the layer, the value and the fix."""
        spec = adapter.attention_spec(layer)
        where = f"{self.name}: layer {layer}"
        if spec.k_norm is not None:
            _check_key_norm(spec, self.layout, where)
        d_rot = 0 if spec.rope is None else spec.rope.rotary_dims
        if spec.rope is not None:
            _rotary_info(adapter, spec, where)  # checks that the adapter knows the rotary width
        if self.layout == "deepseek":
            biased = [name for name in ("q", "k", "v", "o") if spec.bias(name) is not None]
            refused = [name for name in biased if self.biases == "keep" or name not in FOLDED]
            if refused:
                projections = ", ".join(f"{n}_proj" for n in refused)
                fix = ("biases: fold folds q, k and v biases into their weights, not an o_proj bias; use layout: "
                       "free" if self.biases == "fold" else "Fold them into the weights with biases: fold (q, k and "
                       "v; least squares, approximate), or use layout: free")
                raise AttnslimError(f"{where} has {'/'.join(refused)} biases ({projections}); layout: deepseek writes "
                                    "the DeepSeek-V3 form vLLM serves, whose attention has no biases (vLLM 0.32 builds "
                                    "q_proj, kv_a_proj_with_mqa and o_proj without them), and dropping them is no "
                                    f"rounding (docs/serving.md, 'Biased models'). {fix}, which transformers serves "
                                    "through attnslim.load")
        dense = 2 * spec.n_kv_heads * spec.head_dim
        rope = self.rope_dims if self.rope_dims is not None else self._default_rope(
            d_rot, None if self.kv_ratio is None else int(self.kv_ratio * dense), dense)
        full_rot = self._rope_cap(spec.n_kv_heads, d_rot, rope)
        if rope > full_rot:
            fix = "use rope_dims: 0 (this layer has no RoPE)" if d_rot == 0 else f"use an even rope_dims <= {full_rot}"
            raise AttnslimError(f"{where}: rope_dims = {rope} exceeds the {full_rot} rotary dims this method can "
                                f"keep ({spec.n_kv_heads} KV heads x {d_rot} rotary dims); {fix}")
        scales = key_scales(spec)  # QK-norm: each KV head's key scale is cached too
        rank = self.rank if self.kv_ratio is None else int(self.kv_ratio * dense) - rope - scales
        assert rank is not None
        max_rank = min(spec.n_kv_heads * spec.head_dim * 2 - rope, spec.hidden_size)
        if rank < 1:
            budget = f"kv_ratio = {self.kv_ratio} keeps {rank + rope + scales} of {dense} values" \
                if self.kv_ratio else f"rank = {rank}"
            beside = f"the {rope}-dim rotary key" + (f" and {scales} key scales (QK-norm)" if scales else "")
            raise AttnslimError(f"{where}: {budget}, which leaves no latent beside {beside}; "
                                f"raise kv_ratio above {(rope + scales + 1) / dense:.3f} or lower rope_dims")
        if rank > max_rank:
            raise AttnslimError(f"{where}: kv rank = {rank} exceeds {max_rank}, the most this layer allows "
                                f"(min(2·n_kv·d_h − d_rope, hidden)); lower rank or kv_ratio")
        return rank, rope

    def _default_rope(self, rotary_dims: int, elements: int | None, dense: int) -> int:
        return default_rope_dims(rotary_dims, elements, dense)

    def _rotary_choice(self, rope: int, rotary_dims: int) -> tuple[str, int, int, bool]:
        """(select, span, fold, one pair per frequency) of linalg/mla_rope.split_rotary for a layer keeping
        `rope` of its `rotary_dims` (one head's) rotary dims."""
        raise NotImplementedError

    def _rope_cap(self, n_kv_heads: int, rotary_dims: int, rope: int) -> int:
        """The most rotary dims one layer can keep: every rotary component of every KV head, or one rotary
        head's worth when every frequency has one slot (FreqFold, one pair per frequency, layout deepseek)."""
        _, _, fold, one_per_freq = self._rotary_choice(rope, rotary_dims)
        allowed = self.allowed_freqs(rotary_dims)
        if allowed is not None:
            return 2 * len(allowed) * (1 if one_per_freq else n_kv_heads)
        return rotary_dims if fold > 1 or one_per_freq else n_kv_heads * rotary_dims

    def restricts_freqs(self) -> bool:
        return self.rope_stride > 1 or self.rope_fastest is not None

    def allowed_freqs(self, rotary_dims: int) -> list[int] | None:
        """The frequency indices a rotary pair may keep (rope_stride, rope_fastest), or None: any."""
        if not self.restricts_freqs():
            return None
        top = rotary_dims // 2 if self.rope_fastest is None else min(self.rope_fastest, rotary_dims // 2)
        return list(range(0, top, self.rope_stride))

    # --- conversion ---------------------------------------------------------------------------------------
    def convert(self, adapter: Adapter, layer: int, entry: MLAEntry, stats: MLAStats) -> Fit:
        spec = adapter.attention_spec(layer)
        where = f"{self.name}: layer {layer}"
        st = attn_in(stats, layer, where)
        folded, a, rho = self._folded(spec, st)
        linear = fit_spec(folded, st)
        split = self._split(adapter, linear, st, entry.rope_dims, where)
        factors = self._fit(linear, split, st, entry.rank, where)
        if a is not None and factors.k_rope_bias is not None:  # the rotary key's bias: folded like q's and v's
            factors = replace(factors, k_rope=fold_bias(factors.k_rope, factors.k_rope_bias, a), k_rope_bias=None)
        module = self._install(adapter, layer, spec, entry, q_weight=folded.q)
        _load(module, factors, spec)
        if module.key_norm is not None:  # the scales are the model's own: its pre-norm key projection
            with torch.no_grad():
                module.key_norm.weight.copy_(spec.k)
        return {"rope_freq": [int(f) for f in factors.freq], **({} if a is None else {"bias_fold_rho": rho})}

    def _folded(self, spec: AttentionSpec, st: InputStats) -> tuple[AttentionSpec, torch.Tensor | None, float]:
        """(spec, a, ρ): with `biases: fold` and any q/k/v bias, the spec on the statistics' device with the q and v
        biases folded into their weights by a, the least-squares aᵀx ≈ 1 (ρ = μᵀa; linalg/bias_fold.py); the key
        keeps its bias, whose non-rotary part the fit drops exactly and whose rotary part `convert` folds. Else
        (spec, None, 1.0)."""
        if self.biases != "fold" or all(spec.bias(name) is None for name in FOLDED):
            return spec, None, 1.0
        spec = spec.to(st.sxx.device)
        a, rho = constant_fit(st.corr, st.mean, RIDGE if self.fold_ridge is None else self.fold_ridge)
        q = spec.q if spec.q_bias is None else fold_bias(spec.q, spec.q_bias, a)
        v = spec.v if spec.v_bias is None else fold_bias(spec.v, spec.v_bias, a)
        return replace(spec, q=q, q_bias=None, v=v, v_bias=None), a, rho

    def _split(self, adapter: Adapter, spec: AttentionSpec, st: InputStats, rope: int, where: str) -> RotarySplit:
        d_rot = 0 if spec.rope is None else spec.rope.rotary_dims
        select, span, fold, one_per_freq = self._rotary_choice(rope, d_rot)
        choice = RotaryChoice(rope // 2, select, span, fold, one_per_freq, self.allowed_freqs(d_rot))
        return _split_common(adapter, spec, st, choice, where)

    def _fit(self, spec: AttentionSpec, split: RotarySplit, st: InputStats, rank: int, where: str) -> MLAFactors:
        raise NotImplementedError

    def _install(self, adapter: Adapter, layer: int, spec: AttentionSpec, entry: MLAEntry,
                 q_weight: torch.Tensor | None = None) -> MLAAttention:
        """Installs the MLA module of `entry` at `layer`. q_proj is the model's own; with `biases: fold` and a q bias,
        a bias-free Linear instead, holding q_weight (the folded weight; None: a skeleton, whose weights load)."""
        dtype = spec.q.dtype
        o_proj = nn.Linear(spec.o.shape[1], spec.o.shape[0], bias=self.layout == "free", dtype=dtype)
        rotary = adapter.rotary_embedding(spec.rope.layer_type) if spec.rope is not None else None
        mla = MLAShape(entry.rank, entry.rope_dims, k_rope_bias=spec.k_bias is not None and self.biases == "keep",
                       key_norm_eps=None if spec.k_norm_rms is None else spec.k_norm_rms.eps)
        q_proj = adapter.linear(layer, "q")
        if self.biases == "fold" and spec.q_bias is not None:
            q_proj = nn.Linear(spec.q.shape[1], spec.q.shape[0], bias=False, dtype=dtype, device=spec.q.device)
            if q_weight is not None:
                with torch.no_grad():
                    q_proj.weight.copy_(q_weight)
        module = MLAAttention(AttnShape.of(spec), mla, q_proj=q_proj, o_proj=o_proj,
                              q_norm=spec.q_norm, rotary=rotary, dtype=dtype)
        adapter.replace_attention(layer, module)
        return module.to(spec.q.device)

    def skeleton(self, adapter: Adapter, layer: int, entry: MLAEntry) -> None:
        self._install(adapter, layer, adapter.attention_spec(layer), entry)


def key_scales(spec: AttentionSpec) -> int:
    """Values a QK-norm layer caches per token beside the latent and the rotary key: one key scale per KV head
    (0 without a key norm)."""
    return spec.n_kv_heads if spec.k_norm is not None else 0


def fit_spec(spec: AttentionSpec, st: InputStats) -> AttentionSpec:
    """The spec the split and the latent fit. With a per-head RMS key norm k = g_k ⊙ u / rms(u):
      keys     the linear part g_k ⊙ u = diag(g_k) W_k x, the gain folded into W_k (rms(u), one positive number per
               token and KV head, is computed by MLAAttention from the model's own W_k and cached: exact);
      queries  they only weight the fit (the query-weighted rotary choice, key error against value error), so they
               are put in the units the softmax sees: with a query norm g_q ⊙ q / rms(q), and divided by the key's
               rms(u) too, each rms at its calibration mean (a key error e moves a logit by about q_n · e / rms(u)).
    The spec as it is without a key norm. Either way on the statistics' device (CPU), whatever device the model's
    layer is on: the fit computes there, as latentllm's does."""
    spec = spec.to(st.sxx.device)
    if spec.k_norm_rms is None:
        return spec
    k_gain = spec.k_norm_rms.gain.to(spec.k.dtype).repeat(spec.n_kv_heads)  # (n_kv·d_h,)
    scale = torch.full((spec.q.shape[0],), mean_square(spec.k, spec.k_bias, st) ** -0.5, dtype=torch.float64)
    if spec.q_norm_rms is not None:
        q_gain = spec.q_norm_rms.gain.to(torch.float64).repeat(spec.n_heads)  # (h·d_h,)
        scale = scale * q_gain * mean_square(spec.q, spec.q_bias, st) ** -0.5
    scale = scale.to(spec.q.dtype)
    return replace(spec, k=k_gain[:, None] * spec.k, q=scale[:, None] * spec.q,
                   q_bias=None if spec.q_bias is None else scale * spec.q_bias)


def _check_key_norm(spec: AttentionSpec, layout: str, where: str) -> None:
    """Refusals for QK-norm layers, each naming the fix."""
    norm = type(spec.k_norm).__name__
    if spec.k_norm_rms is None:
        raise AttnslimError(f"{where} normalises each head's key with {norm}, which its adapter does not describe "
                            "as a per-head RMS norm (AttentionSpec.k_norm_rms): MLA can rebuild only an RMS key "
                            "norm exactly; leave this layer out of the step's `layers`, or describe the norm in "
                            "the adapter")
    if spec.k_bias is not None:
        raise AttnslimError(f"{where} has a key bias under its key norm ({norm}); MLA drops the non-rotary key "
                            "bias (softmax ignores it), which the norm does not: leave this layer out of `layers`")
    if layout == "deepseek":
        raise AttnslimError(f"{where} normalises each head's key ({norm}); layout: deepseek writes DeepSeek-V3's "
                            "form, which has no key norm (vLLM would serve other logits); use layout: free")


def default_rope_dims(rotary_dims: int, elements: int | None, dense: int) -> int:
    """d_rope when none is given: E²/(1.5·D) rounded to even (E cached elements per token, D = 2·n_kv·d_h the
    dense cache), at least 8 and at most one head's rotary dims; the model's rotary dims with an explicit rank.
    Fitted to a rope_dims sweep on SmolLM2-135M at KV 0.5, 0.375 and 0.25 (BENCHMARKS.md, MLA): the tighter the
    budget, the more the latent is worth against the rotary key. 0 without RoPE."""
    if rotary_dims == 0 or elements is None:
        return rotary_dims
    return max(min(8, rotary_dims), min(rotary_dims, 2 * round(elements * elements / (3.0 * dense))))


def _load(module: MLAAttention, f: MLAFactors, spec: AttentionSpec) -> None:
    """Copy the fitted tensors into the installed module (cast to its dtype)."""
    with torch.no_grad():
        for name, value in (("q_rope", f.q_rope), ("q_nope", f.q_nope), ("rope_freq", f.freq)):
            target = getattr(module, name)
            if target is not None:
                target.copy_(value)
        module.kv.b.copy_(f.kv.B)
        if module.kv.block_identity:
            assert f.kv.perm is not None  # fit_latent always returns the block-identity form
            module.kv.a.copy_(f.kv.a2)
            module.kv.perm.copy_(f.kv.perm)
        else:  # full rank: A = J⁻¹ M as one dense matrix (the identity columns included)
            module.kv.a.copy_(f.kv.A)
        module.o_proj.weight.copy_(spec.o)
        if module.o_proj.bias is not None:
            module.o_proj.bias.copy_(f.o_bias)
        elif f.o_bias.abs().max() > 0:  # layout deepseek refuses biases and fits without the mean correction
            raise AttnslimError(f"layer {module.layer_idx}: the fit gave an output bias but o_proj has none")
        if module.k_rope is not None:
            module.k_rope.weight.copy_(f.k_rope)
            if f.k_rope_bias is not None and module.k_rope.bias is not None:
                module.k_rope.bias.copy_(f.k_rope_bias)


def _rotary_info(adapter: Adapter, spec: AttentionSpec, where: str) -> tuple[torch.Tensor, float]:
    """(θ_j (d_rot/2,) radians per token, RoPE's attention scale) read from the model's own rotary tables."""
    assert spec.rope is not None
    info = rotary_angles(adapter, spec.rope.layer_type)
    if info is None:
        raise AttnslimError(f"{where}: the adapter gives no rotary module for a RoPE layer")
    if 2 * info[0].numel() != spec.rope.rotary_dims:
        raise AttnslimError(f"{where}: the model rotates {2 * info[0].numel()} dims per head but the adapter says "
                            f"{spec.rope.rotary_dims}; MLA needs the true rotary width (fix the adapter's RopeSpec)")
    return info


def _split_common(adapter: Adapter, spec: AttentionSpec, st: InputStats, choice: RotaryChoice, where: str
                  ) -> RotarySplit:
    d_rot, angles, scale = 0, None, 1.0
    if spec.rope is not None:
        d_rot = spec.rope.rotary_dims
        angles, scale = _rotary_info(adapter, spec, where)
        angles = angles.to(st.sxx.device)
    q_mom = head_moments(spec.q, spec.q_bias, st, spec.n_heads) if choice.select == "query" else None
    layout = RotaryLayout(spec.n_heads, spec.n_kv_heads, spec.head_dim, d_rot)
    return split_rotary(second_moment(spec.k, spec.k_bias, st), q_mom, layout, choice, angles=angles, scale=scale,
                        label=where)


def stacked_kv(spec: AttentionSpec, split: RotarySplit) -> torch.Tensor:
    """(D_n + n_kv·d_h, d) the weights of [k_nope; v]."""
    return torch.cat([split.nope_key @ spec.k.to(torch.float64), spec.v.to(torch.float64)])


def balance(weights: list[torch.Tensor], w_kv: torch.Tensor, cov: torch.Tensor) -> list[torch.Tensor]:
    """The key block's weight (D_n, D_n) rescaled so the weighted key energy tr(W_k C W_kᵀ S_k²) equals the
    values' (TransMLA's balance α², here under any within-block weights); [keys, values] as given otherwise."""
    w_k, w_v = weights
    d_n = w_k.shape[0]
    rows_k, rows_v = w_kv[:d_n], w_kv[d_n:]  # (D_n, d), (n_kv·d_h, d)
    e_k = float(torch.trace(w_k @ rows_k @ cov @ rows_k.T)) if d_n else 0.0
    e_v = float(torch.trace(w_v @ rows_v @ cov @ rows_v.T))
    return [w_k * (e_v / e_k) if e_k > 0 else w_k, w_v]

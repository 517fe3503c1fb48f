"""Cross-layer attention sharing (LISA, arXiv 2408.01890): `SharedAttention`, `DonorAttention`.

A receiver layer n reuses the *unmasked pre-softmax* scores A_{n-1} (b, h, q, t) of layer n-1. They travel
through a `ScoreLink` (modules/score_link.py), a small object that exactly two modules hold (no global
state): the donor `put`s its scores during its forward, the receiver `take`s them later in the same
forward. A standard donor is rebuilt as `DonorAttention` from its `AttentionSpec` (same weights, same
output, plus the export); a receiver that is itself a donor (chains n-1 -> n -> n+1) exports its own
integrated scores A_n.

SharedAttention computes (shapes per head h, KV head g, head dim d, rank r)
    A_delta = Q_LR K_LR^T / sqrt(r)             Q_LR = x W_q_lr (b, h, q, r), K_LR = x W_k_lr (b, g, t, r)
    A_n     = FFN([A_{n-1}; A_delta])           "fusion": the aligner mixes 2h head channels per (i, j)
            | FFN(A_{n-1}) + A_delta            "add"
            | A_{n-1} (+ A_delta)               no aligner (direct sharing; "+Diff." ablation)
    out     = softmax(mask(A_n)) V W_o          V, W_o the layer's own (frozen) weights
The causal / padding / sliding mask is applied only right before the softmax, so the aligner never sees the
masked fill value (finfo.min would overflow the FFN to inf/NaN).

Cache (any HF cache, via _compat): a receiver with a compensator stores K_LR (b, g, t, r) as keys and
V (b, g, t, d) as values (DynamicLayer concatenates keys and values separately, so the last dims may differ);
without a compensator it stores V and a position marker as keys (one value per KV head and token). NF mode
(`nf_min_len`) keeps the original W_q/W_k: a prefill of >= nf_min_len tokens into an empty cache runs the
original attention and writes K_LR/V, later tokens run LISA against that cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from attnslim import _compat
from attnslim._compat import AttentionCall
from attnslim.errors import AttnslimError
from attnslim.linalg.attention import sliding_keep
from attnslim.linalg.rope import apply_rope
from attnslim.linalg.scores import attend, heads, qk_scores
from attnslim.modules.aligner import Aligner
from attnslim.modules.base import AttnShape, ReplacementAttention
from attnslim.modules.score_link import ScoreLink
from attnslim.registry import register_module

if TYPE_CHECKING:
    from attnslim.adapters.base import AttentionSpec

INTEGRATE = ("fusion", "add")
ScoreSink = Callable[[int, torch.Tensor], None]


def _linear_from(w: torch.Tensor, b: torch.Tensor | None) -> nn.Linear:
    """nn.Linear whose parameters share storage with w (out, in) and b (no copy, no random init)."""
    lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta")
    lin.weight = nn.Parameter(w)
    if b is not None:
        lin.bias = nn.Parameter(b)
    return lin


def _clone_norm(norm: nn.Module | None) -> nn.Module | None:
    import copy

    return None if norm is None else copy.deepcopy(norm)


class _OriginalQK(nn.Module):
    """The layer's own q/k projections (+ QK-norm), for DonorAttention and NF prefill."""

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__()
        self.q_proj = _linear_from(spec.q, spec.q_bias)
        self.k_proj = _linear_from(spec.k, spec.k_bias)
        self.q_norm, self.k_norm = _clone_norm(spec.q_norm), _clone_norm(spec.k_norm)


def _qk(owner: Any, x: torch.Tensor, position_embeddings: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Original q (b, h, l, d), k (b, g, l, d) of `owner` (which holds q_proj/k_proj/q_norm/k_norm)."""
    s: AttnShape = owner.shape
    q, k = heads(owner.q_proj(x), s.head_dim), heads(owner.k_proj(x), s.head_dim)
    if owner.q_norm is not None:
        q = owner.q_norm(q)
    if owner.k_norm is not None:
        k = owner.k_norm(k)
    if s.rope:
        if position_embeddings is None:
            raise AttnslimError(f"layer {s.layer}: RoPE layer called without position_embeddings (cos, sin)")
        q, k = apply_rope(q, *position_embeddings), apply_rope(k, *position_embeddings)
    return q, k


def _keep(s: AttnShape, attention_mask: Any, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    return sliding_keep(_compat.keep_mask(attention_mask, q_len, kv_len, device), s.sliding_window)


@register_module
class DonorAttention(ReplacementAttention):
    """Standard attention rebuilt from a layer's spec (same weights and output) that exports its scores.

    Parameter names follow HF (q_proj, k_proj, v_proj, o_proj, q_norm, k_norm), so adapters still read its
    spec and state-dict keys keep their meaning.
    """

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__()
        self.shape = AttnShape.of(spec)
        self.layer_idx = spec.layer
        qk = _OriginalQK(spec)
        self.q_proj, self.k_proj, self.q_norm, self.k_norm = qk.q_proj, qk.k_proj, qk.q_norm, qk.k_norm
        self.v_proj = _linear_from(spec.v, spec.v_bias)
        self.o_proj = _linear_from(spec.o, spec.o_bias)
        self.export: ScoreLink | None = None

    def attend(self, call: AttentionCall) -> torch.Tensor:
        hidden_states, position_embeddings, attention_mask, past_key_values = call
        x = hidden_states  # (b, l, hidden)
        q, k = _qk(self, x, position_embeddings)
        v = heads(self.v_proj(x), self.shape.head_dim)  # (b, g, l, d)
        k, v = _compat.cache_update(past_key_values, self.layer_idx, k, v)  # (b, g, t, d)
        scores = qk_scores(q, k, self.shape.scaling, self.shape.softcap)  # (b, h, l, t)
        if self.export is not None:
            self.export.put(scores)
        keep = _keep(self.shape, attention_mask, x.shape[1], k.shape[-2], x.device)
        return self.o_proj(attend(scores, v, keep))

    def kv_cache_bytes_per_token(self) -> int:
        return 2 * self.shape.n_kv_heads * self.shape.head_dim * next(self.v_proj.parameters()).element_size()

    def describe(self) -> dict[str, Any]:
        return {"kind": "DonorAttention", "exports_to": None if self.export is None else self.export.receiver}

    def extra_repr(self) -> str:
        s = self.shape
        to = f", exports scores to layer {self.export.receiver}" if self.export is not None else ""
        return f"layer={s.layer}, heads={s.n_heads}/{s.n_kv_heads}x{s.head_dim} (standard attention{to})"


@dataclass(frozen=True)
class SharingConfig:
    """How a receiver builds its scores; all plain data (goes into the plan and back into skeletons)."""

    rank: int = 0  # per-head rank r of the low-rank Q/K compensator (0: none)
    align_hidden: int | None = None  # aligner FFN width (None: no aligner; 0: single linear)
    integrate: str = "fusion"  # fusion: FFN([A_prev; A_delta]); add: FFN(A_prev) + A_delta
    rope_lr: bool = False  # RoPE on Q_LR/K_LR (r-dim, frequencies taken from the layer's own table)
    nf_min_len: int | None = None  # NF: a prefill of >= this many tokens runs the original attention
    uniform: bool = False  # analysis only ("AVG"): uniform causal attention, no donor

    def __post_init__(self) -> None:
        if self.integrate not in INTEGRATE:
            raise AttnslimError(f"integrate={self.integrate!r} is invalid; valid: {' | '.join(INTEGRATE)}")
        if self.rank < 0 or (self.align_hidden is not None and self.align_hidden < 0):
            raise AttnslimError(f"rank={self.rank} / align_hidden={self.align_hidden} must be >= 0")
        if self.rope_lr and self.rank % 2:
            raise AttnslimError(f"rope_lr needs an even rank, got rank={self.rank}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _lr_cos_sin(cos_sin: tuple[torch.Tensor, torch.Tensor], r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) (b, t, d_rot) of the layer -> (b, t, r) of an r-dim RoPE with the same theta.

    Frequency i of an r-dim RoPE is theta^(-2i/r) = frequency i*d_rot/r of the d_rot table (exact when r
    divides d_rot, nearest otherwise); half-split convention: the table is [f, f].
    """
    cos, sin = cos_sin
    half = cos.shape[-1] // 2
    idx = torch.tensor([min(half - 1, round(i * half / (r // 2))) for i in range(r // 2)], device=cos.device)
    pick = torch.cat([idx, idx + half])
    return cos.index_select(-1, pick), sin.index_select(-1, pick)


@register_module
class SharedAttention(ReplacementAttention):
    """Attention whose scores come from the previous layer (aligned + compensated); own V and W_o."""

    def __init__(self, spec: AttentionSpec, cfg: SharingConfig) -> None:
        super().__init__()
        self.shape, self.cfg, self.layer_idx = AttnShape.of(spec), cfg, spec.layer
        s, dtype = self.shape, spec.v.dtype
        if cfg.rank >= s.head_dim:
            raise AttnslimError(f"layer {s.layer}: rank={cfg.rank} must be in 1..{s.head_dim - 1} (< head_dim)")
        self.v_proj = _linear_from(spec.v, spec.v_bias)
        self.o_proj = _linear_from(spec.o, spec.o_bias)
        self.q_lr = nn.Linear(s.hidden_size, s.n_heads * cfg.rank, bias=False, dtype=dtype) if cfg.rank else None
        self.k_lr = nn.Linear(s.hidden_size, s.n_kv_heads * cfg.rank, bias=False, dtype=dtype) if cfg.rank else None
        c_in = 2 * s.n_heads if cfg.rank and cfg.integrate == "fusion" else s.n_heads
        self.align = None if cfg.align_hidden is None else Aligner(c_in, s.n_heads, cfg.align_hidden, dtype)
        self.q_proj = self.k_proj = self.q_norm = self.k_norm = None
        if cfg.nf_min_len is not None:  # NF keeps the original W_q / W_k for the prompt
            qk = _OriginalQK(spec)
            self.q_proj, self.k_proj, self.q_norm, self.k_norm = qk.q_proj, qk.k_proj, qk.q_norm, qk.k_norm
        self.link: ScoreLink | None = None  # from the donor (layer - 1)
        self.export: ScoreLink | None = None  # to the receiver (layer + 1), if any
        self.score_sink: ScoreSink | None = None  # training / analysis: receives A_n (set inside `with` blocks)
        self.detach_donor = False  # training option: no gradient into the donor's scores

    def trainable(self) -> list[nn.Parameter]:
        """The new LISA parameters (q_lr, k_lr, align); V/W_o and NF's q/k stay frozen."""
        mods = [m for m in (self.q_lr, self.k_lr, self.align) if m is not None]
        return [p for m in mods for p in m.parameters()]

    @torch.no_grad()
    def init_weights(self, init: str, seed: int = 0) -> None:
        """Seeded init of the new weights (PyTorch's Linear bounds, a generator per layer, so conversion is
        reproducible). "ds" then makes the layer start as exact direct sharing (identity aligner on A_{n-1},
        silent A_delta); "default" keeps the random init everywhere."""
        gen = torch.Generator().manual_seed(seed * 100_003 + self.layer_idx)
        new = [m for m in (self.q_lr, self.k_lr, self.align) if m is not None]
        for lin in (m for module in new for m in module.modules() if isinstance(m, nn.Linear)):
            bound = 1.0 / math.sqrt(lin.in_features)
            for p in (lin.weight, lin.bias):
                if p is not None:
                    p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=gen))
        if init == "default":
            return
        if self.align is not None:
            self.align.identity_init()
        if self.q_lr is not None and (self.align is None or self.cfg.integrate == "add"):
            self.q_lr.weight.zero_()  # A_delta = 0 at the start; k_lr keeps its init so q_lr gets gradient

    # --- forward ---------------------------------------------------------------------------------
    def attend(self, call: AttentionCall) -> torch.Tensor:
        hidden_states, position_embeddings, attention_mask, past_key_values = call
        x, s, cfg = hidden_states, self.shape, self.cfg  # x (b, l, hidden)
        b, l, _ = x.shape
        past = _compat.cache_seq_length(past_key_values, self.layer_idx)
        v = heads(self.v_proj(x), s.head_dim)  # (b, g, l, d)
        k_lr = self._k_lr(x, position_embeddings) if self.k_lr is not None else None  # (b, g, l, r)
        k_lr, v = self._cache(past_key_values, x, k_lr, v)  # every token so far: (b, g, t, r), (b, g, t, d)
        t = v.shape[-2]
        if cfg.nf_min_len is not None and past == 0 and l >= cfg.nf_min_len:
            if self.link is not None:
                self.link.take((b, s.n_heads, l, t))  # consumed unused: the prompt runs the original attention
            q, k = _qk(self, x, position_embeddings)
            scores = qk_scores(q, k, s.scaling, s.softcap)  # (b, h, l, t)
        elif cfg.uniform:
            scores = x.new_zeros(b, s.n_heads, l, t)  # softmax of zeros = uniform over the visible keys
        else:
            if self.link is None:
                raise AttnslimError(f"layer {s.layer}: SharedAttention has no donor link; install it with lisa/ds")
            prev = self.link.take((b, s.n_heads, l, t))
            scores = self._integrate(prev.detach() if self.detach_donor else prev, x, k_lr, position_embeddings)
        if self.export is not None:
            self.export.put(scores)
        if self.score_sink is not None:
            self.score_sink(self.layer_idx, scores)
        keep = _keep(s, attention_mask, l, t, x.device)
        return self.o_proj(attend(scores, v, keep))

    def _k_lr(self, x: torch.Tensor, position_embeddings: Any) -> torch.Tensor:
        assert self.k_lr is not None
        k = heads(self.k_lr(x), self.cfg.rank)  # (b, g, l, r)
        return apply_rope(k, *_lr_cos_sin(position_embeddings, self.cfg.rank)) if self.cfg.rope_lr else k

    def _cache(
        self, cache: Any, x: torch.Tensor, k_lr: torch.Tensor | None, v: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        if cache is None:
            return k_lr, v
        if k_lr is not None:
            return _compat.cache_update(cache, self.layer_idx, k_lr, v)
        # V-only layer: a position marker as keys (HF counts a layer's tokens there), one value per KV head in V's
        # dtype: a static cache allocates both slots with the first update's heads and dtype
        _, v = _compat.cache_update(cache, self.layer_idx, v.new_zeros(*v.shape[:-1], 1), v)
        return None, v

    def _integrate(
        self, prev: torch.Tensor, x: torch.Tensor, k_lr: torch.Tensor | None, position_embeddings: Any
    ) -> torch.Tensor:
        """A_{n-1} (b, h, l, t) -> A_n (b, h, l, t)."""
        delta = None
        if k_lr is not None and self.q_lr is not None:
            q = heads(self.q_lr(x), self.cfg.rank)  # (b, h, l, r)
            if self.cfg.rope_lr:
                q = apply_rope(q, *_lr_cos_sin(position_embeddings, self.cfg.rank))
            delta = qk_scores(q, k_lr, 1.0 / math.sqrt(self.cfg.rank))  # (b, h, l, t)
        if self.align is None:
            return prev if delta is None else prev + delta
        if delta is None or self.cfg.integrate == "add":
            aligned = self.align(prev)
            return aligned if delta is None else aligned + delta
        return self.align(torch.cat([prev, delta], dim=1))  # (b, 2h, l, t) -> (b, h, l, t)

    # --- reporting -------------------------------------------------------------------------------
    def attention_flops(self, context: int) -> float:
        """Per generated token over `context` keys: low-rank scores 2·h·r·T, the aligner on each of the h·T
        entries' head vectors (T·its per-entry FLOPs), the add (h·T) and the weighted values 2·h·d·T; the donor's
        scores are free. q_lr/k_lr/v/o are counted with the linear weights."""
        s, r, t = self.shape, self.cfg.rank, context
        flops = 2.0 * s.n_heads * s.head_dim * t  # probs @ V
        flops += 2.0 * s.n_heads * r * t if self.q_lr is not None else 0.0
        flops += float(t * self.align.flops_per_entry()) if self.align is not None else 0.0
        return flops + (float(s.n_heads * t) if self.q_lr is not None else 0.0)

    def kv_cache_bytes_per_token(self) -> int:
        s, size = self.shape, next(self.v_proj.parameters()).element_size()
        keys = s.n_kv_heads * (self.cfg.rank or 1) * size  # K_LR, or the position marker (V-only layer)
        return keys + s.n_kv_heads * s.head_dim * size

    def kind(self) -> str:
        if self.cfg.uniform:
            return "avg"
        if not self.cfg.rank and self.align is None:
            return "ds"
        return "lisa"

    def describe(self) -> dict[str, Any]:
        return {"kind": "SharedAttention", "mode": self.kind(), **self.cfg.to_json(),
                "donor": self.shape.layer - 1, "kv_bytes_per_token": self.kv_cache_bytes_per_token(),
                "params": sum(p.numel() for p in self.trainable())}

    def extra_repr(self) -> str:
        c, s = self.cfg, self.shape
        align = "none" if c.align_hidden is None else ("single" if c.align_hidden == 0 else f"{c.align_hidden}")
        nf = f", nf_min_len={c.nf_min_len}" if c.nf_min_len is not None else ""
        return (f"layer={s.layer} <- {s.layer - 1}, mode={self.kind()}, rank={c.rank}/{s.head_dim}, "
                f"align_hidden={align}, integrate={c.integrate}{nf} ({self.kv_cache_bytes_per_token()} B/token)")

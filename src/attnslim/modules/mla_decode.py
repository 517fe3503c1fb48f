"""`MLADecode`: the decode engine of `MLAAttention` (modules/mla.py), which keeps the algebra.

It owns what makes a decode step cheap without changing its values:
  - the fused weights (`fused`, built by modules/mla_fused.py's pure functions) and their staleness: built on first
    use, checked against the parameters when a sequence starts (`_forget_stale`), dropped for offloaded runs
    (`release_derived`);
  - the kernel choice for the absorbed core (`_splits`, pinned by `decode_kernel`: DECODE_KERNELS): the cache split
    over threads through torch's fused flash kernel (linalg/split_attention.py) or the grouped GEMMs
    (linalg/attention.grouped_attention); same values, chosen for the machine, never for the values;
  - the straight step (`_decode_step`): one new token of a sequence under way in a layer appending in place, with
    nothing but the absorbed path's operators; every other call takes the module's general path.
  - the bytes a decode step reads (`decode_weight_bytes`), which depend on whether it runs fused.
A mixin, not a separate object: the engine reads the module's parameters and is switched by the module's
attributes (`path`, `decode_kernel`, `linear_kernel`), which tests and benchmarks set on the module.
What one step dispatches: benchmarks/decode_ops.py (BENCHMARKS "What one decode step dispatches").
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from attnslim import _compat
from attnslim.errors import AttnslimError
from attnslim.linalg import split_attention
from attnslim.linalg.attention import grouped_attention
from attnslim.linalg.scores import heads
from attnslim.modules.cpu_linear import linear
from attnslim.modules.lowrank import LowRankLinear
from attnslim.modules.mla_fused import (
    FusedDecode,
    RotaryParts,
    fuse_decode_weights,
    fused_weight_count,
    rotate_in_place,
    source_key,
)

# the absorbed core for few queries: "auto" splits the cache where `split_attention.split_count` advises,
# "split" always (at least two pieces: tests), "grouped" never (benchmarks compare the two). QK-norm layers decode
# on `grouped_attention` with the cached key scales multiplying the logits, whatever the kernel says
DECODE_KERNELS = ("auto", "split", "grouped")


class MLADecode:
    """The decode engine mixed into `MLAAttention`; what it reads of the module is declared here."""

    layer_idx: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rank: int
    rope_dims: int
    scaling: float
    softcap: float | None
    sliding_window: int | None
    path: str
    linear_kernel: str
    q_proj: nn.Module
    o_proj: nn.Linear
    q_norm: nn.Module | None
    q_rope: nn.Parameter | None
    k_rope: nn.Linear | None
    key_norm: nn.Linear | None
    kv: LowRankLinear
    _absorbed: tuple[tuple[int, ...], torch.Tensor] | None

    def _init_decode(self) -> None:
        self.decode_kernel = "auto"  # see DECODE_KERNELS
        self._fused: tuple[tuple[tuple[int, int], ...], FusedDecode] | None = None

    # what the engine uses of the module's algebra (modules/mla.py)
    def absorbed_query(self) -> torch.Tensor:
        raise NotImplementedError

    def _value_map(self) -> torch.Tensor:
        raise NotImplementedError

    def _cos_sin(self, start: int, end: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _key_scales(self, u: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _decode_step(self, x: torch.Tensor, cache: Any) -> torch.Tensor | None:
        """x (b, 1, d), one new token of a sequence under way -> the layer's output (b, 1, d), on the fused weights
        with nothing but the absorbed path's operators; None where this step is not the plain case (a cache layer
        that is not appending in place, autograd, a key norm, a softcap or a sliding window): `attend`'s general
        path then runs, with the same values (tested). At a small model's decode the Python around each operator
        counts: the general path's checks and wrappers cost SmolLM2 a few % of its decode speed at 512 tokens
        (BENCHMARKS "What one decode step dispatches" and "MLA: decode against dense at 512 tokens ...")."""
        if self._fused is None or self.path != "auto" or self.key_norm is not None or self.softcap is not None \
                or self.sliding_window is not None:  # a window over a cache that keeps every row needs a mask
            return None
        layer = _compat.filled_reserved_layer(cache, self.layer_idx)
        if layer is None or torch.is_grad_enabled():
            return None
        fused = self._fused[1]
        new, q_cat = self._decode_inputs(x, fused, _compat.cache_seq_length(cache, self.layer_idx))
        store = layer.update(new, new[..., :0])[0]  # (b, 1, T, r + d_rope)
        b, r, n_kv = x.shape[0], self.rank, self.n_kv_heads
        if (splits := self._splits(q_cat, store.shape[-2])) > 1:
            lat = split_attention.split_attention(q_cat, store, None, 1.0, splits)[..., :r]  # (b, h, 1, r)
        else:
            lat = grouped_attention(q_cat, store, store[..., :r], None, 1.0)  # `scaling` is in the fused maps
        out = lat.reshape(b, n_kv, self.n_heads // n_kv, r) @ fused.value_t  # (b, n_kv, g, d_h)
        return self.o_proj(out.view(b, 1, self.n_heads * self.head_dim))

    def _decode_inputs(self, x: torch.Tensor, fused: FusedDecode, past: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x (b, t, d) -> new cache rows [c, RoPE(k_r) (, key scales)] (b, 1, t, r + d_rope (+ n_kv)) and
        q_cat (b, h, t, r + d_rope) = [absorbed query; RoPE(rotary query)], views of fresh GEMM outputs (the rows
        of a QK-norm layer are one small concatenation: its scales are not linear in x)."""
        t = x.shape[1]
        r, d_r, hd = self.rank, self.rope_dims, self.n_heads * self.head_dim
        e = r + d_r
        y = linear(x, fused.w_in, fused.b_in, self.linear_kernel)  # (b, t, hd + r + 2·d_rope (+ n_kv·d_h))
        # views, one operator: q (hd), c (r), k_r, P k_r (d_rope each), the pre-norm key u (n_kv·d_h, or none)
        q_rows, _, k_r, p_k_r, u = y.split_with_sizes([hd, r, d_r, d_r, y.shape[-1] - hd - e - d_r], dim=-1)
        q = heads(q_rows, self.head_dim)  # (b, h, t, d_h)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q_cat = q @ fused.maps  # (b, h, t, r + 2·d_rope): [absorbed query, q_r, P q_r]
        if d_r:
            cos, sin = self._cos_sin(past, past + t, x)  # (1, t, d_rope): broadcasts over batch and heads
            _, q_r, p_q_r = q_cat.split_with_sizes([r, d_r, d_r], dim=-1)
            rotate_in_place(q_r, p_q_r, cos, sin)
            rotate_in_place(k_r, p_k_r, cos, sin)
        new = y[:, None, :, hd : hd + e]
        if self.key_norm is not None:
            new = torch.cat([new, self._key_scales(u[:, None])], dim=-1)
        return new, q_cat[..., :e]

    def _splits(self, q: torch.Tensor, rows: int) -> int:
        """Pieces of the cache for `split_attention` (1: `grouped_attention`), as `decode_kernel` says."""
        if self.decode_kernel not in DECODE_KERNELS:
            raise AttnslimError(f"layer {self.layer_idx}: MLAAttention decode_kernel = {self.decode_kernel!r}; "
                                f"valid: {DECODE_KERNELS}")
        if self.decode_kernel == "grouped":
            return 1
        advised = split_attention.split_count(q, rows)
        if self.decode_kernel == "auto":
            return advised
        if not split_attention.runs_on(q):
            raise AttnslimError(f"layer {self.layer_idx}: MLAAttention decode_kernel = 'split' needs torch's CPU "
                                f"flash kernel, which cannot run on {q.device.type} {q.dtype}; use 'auto'")
        return max(2, advised)

    def fused(self) -> FusedDecode | None:
        """Derived weights for decode outside autograd (modules/mla_fused.py), or None where q_proj is not a plain
        Linear (e.g. factorised by another step; `_fusable`): the unfused path then runs, with the same values.
        Built on first use and checked against the parameters when a sequence starts (`attend` at an empty cache,
        or without one: `_forget_stale`), not at every decode step: reading every
        source tensor's version and address in every layer showed in profiles of a small model's decode step. So
        parameters changed in the middle of a cached sequence are seen from the next sequence on; the sequence's
        cached rows were computed with the old weights anyway."""
        if not self._fusable():
            return None
        assert isinstance(self.q_proj, nn.Linear)
        if self._fused is not None:
            return self._fused[1]
        rotary = None
        if self.k_rope is not None and self.q_rope is not None:
            rotary = RotaryParts(self.k_rope.weight, self.k_rope.bias, self.q_rope)
        with torch.no_grad():
            value = fuse_decode_weights(self.q_proj, self.kv.dense_latent(), self.absorbed_query(),
                                        self._value_map(), self.scaling, rotary,
                                        None if self.key_norm is None else self.key_norm.weight)
        assert value.maps.shape[-1] == self.rank + 2 * self.rope_dims
        self._fused = (self._source_key(), value)
        return value

    def _fusable(self) -> bool:
        """Whether decode runs on `fused` weights: where q_proj is a plain Linear (a key norm's W_k joins the
        fused input rows)."""
        return isinstance(self.q_proj, nn.Linear)

    def _source_key(self) -> tuple[tuple[int, int], ...]:
        """The state of every tensor `fused` derives from (mla_fused.source_key)."""
        return source_key((self.q_proj, self.kv, self.k_rope, self.key_norm, cast(nn.Module, self)))

    def _forget_stale(self) -> None:
        """Drop the derived decode weights if a tensor they derive from changed since they were built."""
        if self._fused is not None and self._fused[0] != self._source_key():
            self._fused = None

    def release_derived(self) -> None:
        """Forget the weights derived from the parameters (offloaded runs take the parameters away after each
        forward: keeping their derivatives would hold every layer's copy in memory)."""
        self._fused = self._absorbed = None

    def decode_weight_bytes(self) -> int:
        """Bytes of weights one decode step reads (bench.flops.decode_bytes_per_token), counted from the shapes:
        where decode is fused (`_fusable`), the tensors `fused` derives (input rows [W_q; A written out; W_kr;
        P W_kr (; the key norm's W_k)], the query maps [B_kᵀ N_q,i; R_q,i; P R_q,i] per head, B_vᵀ per KV head),
        else the unfused path's (q_proj, A, W_kr, B_kᵀ N_q,i and R_q,i per head, B_vᵀ per KV head, W_k); o_proj
        and the q-norm either way.
        Not the parameter count: decode never reads B, and reads the absorbed products instead."""
        h, d_h, r, e, n_kv = self.n_heads, self.head_dim, self.rank, self.rope_dims, self.n_kv_heads
        if self._fusable():
            has_bias = self.q_proj.bias is not None or (self.k_rope is not None and self.k_rope.bias is not None)
            count = fused_weight_count(h, d_h, r, e, self.kv.in_features, n_kv, has_bias, self.key_norm is not None)
        else:
            k_rope = 0 if self.k_rope is None else sum(p.numel() for p in self.k_rope.parameters())
            key_norm = 0 if self.key_norm is None else self.key_norm.weight.numel()
            count = sum(p.numel() for p in self.q_proj.parameters()) + self.kv.a.numel() + k_rope + key_norm \
                + h * d_h * (r + e) + n_kv * r * d_h
        rest = [m for m in (self.o_proj, self.q_norm) if m is not None]
        count += sum(p.numel() for m in rest for p in m.parameters())
        return count * self.kv.b.element_size()

"""`PrincipalKeyAttention`: ATP's layer (Niu, Prakash, Avestimehr, seed 004) — every query attends to r principal keys.

Per sequence the layer input X (L, d) is decomposed as X ≈ U X′ (linalg/pca.principal_components: uncentred
truncated SVD, exact or the paper's Alg. 1, canonical signs Σ_l U_li > 0), and attention runs over the r rows of
X′ instead of the L tokens (paper Eq. 6–8; the softmax reading of Fig. 2 and Table 1):

    Q  = U·(X′W_q) + b_q                    (query="lowrank", paper)   or  X W_q + b_q (query="full")
    K′ = Uᵀ·RoPE(U·(X′W_k) + b_k)           (key_path="cheap")  or  Uᵀ·RoPE(X W_k + b_k) ("full")
    V′ = X′W_v + (Uᵀ1)·b_v  (= UᵀV)
    out = softmax(Q K′ᵀ · scaling) V′       (b, H, L, r): no L×L tensor, O(L·r·d′)      (kernel="softmax")
    out = (1U + s) V′ / (L + s (1U)ᵀ)        the paper's Eq. 8 as written, first-order Taylor (kernel="taylor")

RoPE does not commute with U, so keys are rotated at their token positions *before* the projection onto the
principal subspace (K′ = Uᵀ·RoPE(K), the paper's "project the key matrix with U"); values need no rotation.

This layer is NOT causal: every principal key mixes all L tokens, so position i sees tokens after i. Use it
where the paper does — prompt-level scoring read at the last position (eval/choice.py) — and never for
teacher-forced next-token losses or generation. It refuses to decode with a KV cache; the leak-free serving
form is `PrincipalCacheAttention` (modules/principal_serving.py, method `atp` with form="serving").

U is detached (the SVD backward is unstable with repeated or zero σ; the paper is silent); X′ = UᵀX keeps the
gradient to X.
Padding: real tokens are read from the attention mask; pad rows are zeroed before the SVD, r = ⌈f·L_b⌉ uses
each sample's real length and the batch uses R = max r_b with the extra components masked.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from attnslim import _compat
from attnslim._compat import AttentionCall
from attnslim.adapters.base import AttentionSpec
from attnslim.errors import AttnslimError
from attnslim.linalg.attention import repeat_kv, softmax_attention, taylor_attention
from attnslim.linalg.pca import component_mask, principal_components, resolve_rank
from attnslim.linalg.rope import apply_rope
from attnslim.linalg.scores import heads
from attnslim.modules.base import ReplacementAttention
from attnslim.registry import register_module

SvdMethod = Literal["exact", "approx"]
QUERY_MODES = ("lowrank", "full")
KEY_PATHS = ("cheap", "full")
VALUE_SCALES = ("none", "inv_sqrt_len")
KERNELS = ("softmax", "taylor")


def check_rank(rank: int | float, where: str) -> None:
    """r ≥ 1 as an int, or a fraction in (0, 1]; AttnslimError naming `where` otherwise."""
    if isinstance(rank, bool) or not isinstance(rank, int | float):
        raise AttnslimError(f"{where}: rank must be an int ≥ 1 or a fraction in (0, 1], got {rank!r}")
    if isinstance(rank, int) and rank < 1:
        raise AttnslimError(f"{where}: rank={rank} is invalid; an int rank must be ≥ 1 (or give a fraction in (0, 1])")
    if isinstance(rank, float) and not 0.0 < rank <= 1.0:
        raise AttnslimError(f"{where}: rank fraction {rank} is outside (0, 1]; use e.g. 0.5 for r = L/2")


def layer_rank(length: int, rank: int | float, layer: int) -> int:
    """resolve_rank with the layer named in the error (r > L, sequences shorter than r)."""
    try:
        return resolve_rank(length, rank)
    except AttnslimError as err:
        raise AttnslimError(f"layer {layer}: {err}; use a smaller rank or a fraction of L") from None


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """SVDs run in float32 for float32/16-bit activations (no information beyond float32), float64 for float64."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def real_tokens(attention_mask: Any, length: int, batch: int, device: torch.device) -> torch.Tensor:
    """(b, L) bool, True = real token: the keys the last query may see (HF masks only mask keys for padding).
    Without a mask (SDPA's causal fast path) every token is real; no L×L mask is built for that."""
    if attention_mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    keep = _compat.keep_mask(attention_mask[..., -1:, :], 1, length, device)  # (b|1, 1, 1, L): the last row only
    return keep[:, 0, -1, :].expand(batch, length)


def weight_only(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """linear(x) without its bias (works on peft-wrapped linears: LoRA deltas are bias-free)."""
    y = linear(x)
    bias = getattr(getattr(linear, "base_layer", linear), "bias", None)
    return y - bias if bias is not None else y


class SpecAttention(ReplacementAttention):
    """q/k/v/o linears (+ QK-norm) built from an AttentionSpec; parameter names match HF (`q_proj`, ...)."""

    q_proj: nn.Module  # nn.Linear, or a peft LoRA wrapper around it after `train/lora.py`
    k_proj: nn.Module
    v_proj: nn.Module
    o_proj: nn.Module

    def __init__(self, spec: AttentionSpec, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if spec.sliding_window is not None or spec.softcap is not None:
            raise AttnslimError(
                f"layer {spec.layer}: ATP needs full attention without logit soft-capping (this layer has "
                f"sliding_window={spec.sliding_window}, softcap={spec.softcap}); select only full-attention layers"
            )
        self.layer_idx, self.n_heads, self.n_kv_heads = spec.layer, spec.n_heads, spec.n_kv_heads
        self.head_dim, self.scaling, self.has_rope = spec.head_dim, spec.scaling, spec.rope is not None
        dtype = dtype or spec.q.dtype
        for name in ("q", "k", "v", "o"):
            w, b = spec.weight(name), spec.bias(name)
            lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, dtype=dtype, device=w.device)
            with torch.no_grad():
                lin.weight.copy_(w)
                if b is not None:
                    lin.bias.copy_(b)
            setattr(self, f"{name}_proj", lin)
        self.q_norm, self.k_norm = spec.q_norm, spec.k_norm

    def heads(self, y: torch.Tensor) -> torch.Tensor:
        """(b, t, h*hd) -> (b, h, t, hd)."""
        return heads(y, self.head_dim)

    def qk_post(self, q: torch.Tensor | None, k: torch.Tensor | None, cos_sin: Any) -> list[torch.Tensor | None]:
        """QK-norm then RoPE on (b, h, t, hd) queries/keys (either may be None)."""
        if self.has_rope and cos_sin is None:
            raise AttnslimError(f"layer {self.layer_idx}: RoPE layer called without position_embeddings (cos, sin)")
        out: list[torch.Tensor | None] = []
        for t, norm in ((q, self.q_norm), (k, self.k_norm)):
            if t is not None and norm is not None:
                t = norm(t)
            if t is not None and self.has_rope:
                t = apply_rope(t, *cos_sin)
            out.append(t)
        return out

    def merge(self, out: torch.Tensor) -> torch.Tensor:
        """(b, H, t, hd) -> o_proj -> (b, t, hidden)."""
        return self.o_proj(out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1))


@register_module
class PrincipalKeyAttention(SpecAttention):
    """ATP's non-causal principal-key attention (prompt-level scoring only; see the module docstring)."""

    causal = False  # eval/causal.py: perplexity and lm-eval tasks refuse models with this layer

    def __init__(
        self, spec: AttentionSpec, rank: int | float = 0.5, svd: SvdMethod = "exact", iters: int = 2,
        query: str = "lowrank", key_path: str = "cheap", value_scale: str = "none", dtype: torch.dtype | None = None,
        kernel: str = "softmax",
    ) -> None:
        check_rank(rank, f"layer {spec.layer}")
        if (svd not in ("exact", "approx") or query not in QUERY_MODES or key_path not in KEY_PATHS or iters < 1
                or value_scale not in VALUE_SCALES or kernel not in KERNELS):
            raise AttnslimError(
                f"layer {spec.layer}: svd={svd!r} query={query!r} key_path={key_path!r} iters={iters} "
                f"value_scale={value_scale!r} kernel={kernel!r} invalid; valid: svd exact|approx, query "
                f"{'|'.join(QUERY_MODES)}, key_path {'|'.join(KEY_PATHS)}, iters ≥ 1, value_scale "
                f"{'|'.join(VALUE_SCALES)}, kernel {'|'.join(KERNELS)}"
            )
        if kernel == "taylor" and value_scale != "none":
            raise AttnslimError(
                f"layer {spec.layer}: kernel='taylor' with value_scale={value_scale!r}: the first-order form is "
                "normalised by L + s·(1U)ᵀ, and V′/√L would shrink its output by √L; use value_scale='none'"
            )
        super().__init__(spec, dtype)
        self.rank, self.svd, self.iters, self.query, self.key_path = rank, svd, iters, query, key_path
        self.value_scale, self.kernel = value_scale, kernel

    def decompose(self, x: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """U (b, L, R) detached, X′ = UᵀX (b, R, d) differentiable, component mask (b, R)."""
        lengths = [int(n) for n in real.sum(-1)]
        ranks = [layer_rank(n, self.rank, self.layer_idx) for n in lengths]
        big = max(ranks)
        u, xp = principal_components(
            x, big, self.svd, self.iters, mask=real, compute_dtype=compute_dtype(x)
        )  # (b, L, R), (b, R, d)
        within = torch.arange(big, device=x.device)[None] < torch.tensor(ranks, device=x.device)[:, None]  # (b, R)
        valid = component_mask(xp) & within
        u = u * valid[:, None, :].to(u.dtype)
        return u, u.mT @ x, valid  # pad rows of U are zero, so X′ ignores them

    def principal_attention(
        self, x: torch.Tensor, u: torch.Tensor, xp: torch.Tensor, valid: torch.Tensor, cos_sin: Any,
        lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of all L queries over the R principal keys given a decomposition; (b, L, hidden).

        lengths (b,): real tokens per sequence (value_scale); default L.
        """
        if self.query == "lowrank":
            q = self.heads(u @ weight_only(self.q_proj, xp) + _bias(self.q_proj))  # (b, H, L, hd)
        else:
            q = self.heads(self.q_proj(x))
        if self.key_path == "cheap":
            k = self.heads(u @ weight_only(self.k_proj, xp) + _bias(self.k_proj))  # (b, n_kv, L, hd), rank r
        else:
            k = self.heads(self.k_proj(x))
        q_rot, k_rot = self.qk_post(q, k, cos_sin)
        assert q_rot is not None and k_rot is not None
        q, k = q_rot, k_rot
        kp = torch.einsum("blr,bhld->bhrd", u, k)  # K′ = Uᵀ RoPE(K): (b, n_kv, R, hd)
        colsum = u.sum(dim=1)  # (b, R) = Uᵀ1, carries the value bias
        vp = weight_only(self.v_proj, xp) + colsum[..., None] * _bias(self.v_proj)  # (b, R, n_kv*hd) = UᵀV
        if self.value_scale == "inv_sqrt_len":  # not in the paper: v′_1 ≈ √L·mean(v) inflates the output by ~√L
            n = lengths if lengths is not None else torch.full((x.shape[0],), x.shape[1], device=x.device)
            vp = vp / n.to(vp.dtype).clamp_min(1).sqrt()[:, None, None]
        vp = self.heads(vp)
        groups = self.n_heads // self.n_kv_heads
        kp, vp = repeat_kv(kp, groups), repeat_kv(vp, groups)  # (b, H, R, hd)
        if self.kernel == "taylor":  # masked components have zero keys and zero column sums: no weight
            n = lengths if lengths is not None else torch.full((x.shape[0],), x.shape[1], device=x.device)
            scores = (q @ kp.transpose(-1, -2)) * self.scaling  # (b, H, L, R)
            out = taylor_attention(scores, vp, colsum[:, None, None, :].to(q.dtype),
                                   n.to(q.dtype)[:, None, None, None])
            return self.merge(out)
        keep = valid[:, None, None, :]  # (b, 1, 1, R): every query sees every real component (non-causal)
        out = softmax_attention(q, kp, vp, keep, self.scaling)  # (b, H, L, hd)
        return self.merge(out)

    def attend(self, call: AttentionCall) -> torch.Tensor:
        hidden_states, position_embeddings, attention_mask, past_key_values = call
        b, length = hidden_states.shape[:2]
        if _compat.cache_seq_length(past_key_values, self.layer_idx) > 0:
            raise AttnslimError(
                f"layer {self.layer_idx}: PrincipalKeyAttention is ATP's non-causal prompt-level layer and cannot "
                "decode with a KV cache (principal keys mix every prompt token). For generation use the serving "
                "form: method atp with form='serving' (PrincipalCacheAttention)"
            )
        _compat.cache_mark_tokens(past_key_values, self.layer_idx, hidden_states)
        real = real_tokens(attention_mask, length, b, hidden_states.device)
        u, xp, valid = self.decompose(hidden_states, real)
        return self.principal_attention(hidden_states, u, xp, valid, position_embeddings, real.sum(-1))

    def kv_cache_bytes_per_token(self) -> int:
        return 1  # the position marker only: this layer cannot decode

    def attention_flops(self, context: int) -> float:
        """FLOPs per prompt token of a `context`-token prompt (this layer never generates), 2 per MAC: scores and
        weighted values over r principal keys, X′ = UᵀX, K′ = Uᵀ·RoPE(K), and the U·(X′W) expansions of the
        queries (query="lowrank") and keys (key_path="cheap"); the SVD itself (O(L·r·d) per prompt) is not
        counted."""
        r = layer_rank(context, self.rank, self.layer_idx)
        q_linear: Any = getattr(self.q_proj, "base_layer", self.q_proj)  # peft-wrapped during recovery
        hidden = int(q_linear.in_features)
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        per_key = (2 * q_width + hidden + kv_width + q_width * (self.query == "lowrank")
                   + kv_width * (self.key_path == "cheap"))
        return 2.0 * r * per_key

    def describe(self) -> dict[str, Any]:
        return {"kind": "PrincipalKeyAttention", "rank": self.rank, "svd": self.svd, "query": self.query,
                "key_path": self.key_path, "value_scale": self.value_scale, "kernel": self.kernel, "causal": False}

    def extra_repr(self) -> str:
        r = f"r={self.rank}·L" if isinstance(self.rank, float) else f"r={self.rank}"
        return (f"layer={self.layer_idx}, {r}, svd={self.svd}, query={self.query}, key_path={self.key_path}, "
                f"kernel={self.kernel} (non-causal; prompt-level scoring only)")


def _bias(linear: nn.Module) -> torch.Tensor | float:
    """The (peft-unwrapped) bias of a linear, or 0."""
    bias = getattr(getattr(linear, "base_layer", linear), "bias", None)
    return bias if bias is not None else 0.0


"""`PrincipalCacheAttention`: ATP's leak-free serving form — exact causal prefill, then a compressed prompt cache.

Prefill (the prompt, P tokens) is ordinary exact causal attention. At the compression point P the prompt's
post-RoPE keys/values of this layer are split into a compressible prefix [0, n), n = P − window, and an exact
recent window [n, P). The prefix is replaced by at most r entries (r = ⌈f·P⌉ or a fixed int; nothing is
compressed when r ≥ n), and every later token attends to [r compressed entries ; exact window ; tokens
generated so far] with one softmax. The cache holds r + window + generated entries instead of P + generated.
How the prefix is compressed (`compress`): "principal" (ATP's top-r principal subspace of the prefix's input,
written in its interpolative basis: the exact keys/values of the tokens that span it, `pivot_tokens`), "hybrid"
(the default: half of the budget to the most recent prefix tokens, half to principal picks among the older ones),
"principal-mix" (the paper's literal Uᵀ·RoPE(K), UᵀV; an ablation), and the equal-budget baselines "recent" and
"sink"; all but "recent" keep the first `sinks` tokens exactly, and with `mass` each dropped token's softmax mass
is credited to its most similar kept key as a logit bias.
Keys are compressed after RoPE, so stored entries keep their absolute positions and the cache reports the true
token count: HF derives positions and masks as for a dense cache. Cache mechanism: after prefill the layer's
`DynamicCache` entry becomes a `PrincipalCacheLayer` (_compat) holding keys/values (b, n_kv, r + tail, hd), the
compressed entries' logit bias (b, n_kv, r) and the token count; `cache.update` appends to the exact tail, so
generate(), beam reordering and batch selection work unchanged; crop() is refused.
Uncached reference: `with compression_point(model, P): model(ids)` runs the whole sequence in one pass with the
same compression at P; it equals prefill-then-decode with a cache and is how continuation perplexity is measured.
The reasons behind each choice (why interpolative, why sinks, why hybrid is the default): docs/methods/atp.md,
"The serving form's compressed cache". Measured: BENCHMARKS.md, section "ATP: attention on principal keys".
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attnslim import _compat
from attnslim._compat import AttentionCall, PrincipalCacheLayer
from attnslim.adapters.base import AttentionSpec
from attnslim.errors import AttnslimError
from attnslim.linalg.attention import repeat_kv, softmax_attention
from attnslim.linalg.pca import component_mask, principal_components
from attnslim.modules.principal import SpecAttention, SvdMethod, check_rank, compute_dtype, layer_rank
from attnslim.registry import register_module

COMPRESSORS = ("principal", "hybrid", "principal-mix", "recent", "sink")
MASKED = torch.finfo(torch.float32).min  # additive bias of a masked entry (finite: never NaN)


def pivot_tokens(u: torch.Tensor, avail: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy column-pivoted QR on uᵀ: r token indices (b, r) whose rows of u (b, n, m) best span its columns.

    avail (b, n) bool marks selectable tokens. Once the residual is numerically zero (r > rank), the most
    recent available token is taken. Returns (indices, valid); valid is False for a pick made when no
    selectable token was left (fewer real tokens than r).
    Each step keeps the picked directions Q (orthonormalised twice, CGS2) instead of rewriting every row's
    residual: a new direction q ⊥ Q gives residual·q = u·q, so the squared residual norms are downdated by
    (u q)² — one (n, m) matvec per pick, no (n, m) residual rewritten (timed by benchmarks/kernels.py,
    results/kernels.txt).
    """
    b, n, m = u.shape
    u64 = u.to(torch.float64)
    norms = u64.square().sum(-1)  # (b, n) squared norms of the residual rows
    tol = norms.amax(-1, keepdim=True).clamp_min(1e-300) * 1e-10  # (b, 1) squared-norm floor
    pos = torch.arange(n, device=u.device, dtype=torch.float64).expand(b, n)
    avail = avail.clone()
    rows = torch.arange(b, device=u.device)
    q = u64.new_zeros(b, r, m)  # (b, r, m) directions of the spanning picks (zero rows for the others)
    picks, valid = [], []
    for t in range(r):
        score = torch.where(avail, norms, torch.full_like(norms, -1.0))
        best, arg = score.max(-1)  # (b,)
        spanning = best > tol[:, 0]
        recent = torch.where(avail, pos, torch.full_like(pos, -1.0)).argmax(-1)
        pick = torch.where(spanning, arg, recent)  # (b,)
        valid.append(avail[rows, pick])
        row = u64[rows, pick]  # (b, m)
        for _ in range(2):  # the residual of the picked row against Q (twice: classical Gram-Schmidt is unstable)
            row = row - ((q[:, :t] @ row[..., None]).transpose(1, 2) @ q[:, :t])[:, 0]
        qv = row / row.norm(dim=-1, keepdim=True).clamp_min(1e-300) * spanning[:, None].to(row.dtype)
        q[:, t] = qv
        norms = (norms - (u64 @ qv[..., None])[..., 0].square()).clamp_min(0.0)  # (b, n)
        avail[rows, pick] = False
        picks.append(pick)
    return torch.stack(picks, -1), torch.stack(valid, -1)


def priority_tokens(real: torch.Tensor, r: int, sinks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `sinks` real tokens, then the most recent ones: r indices (b, r) and their validity."""
    b, n = real.shape
    pos = torch.arange(n, device=real.device, dtype=torch.float64).expand(b, n)
    score = pos + 2.0 * n * sink_tokens(real, sinks).to(pos.dtype)
    score = torch.where(real, score, torch.full_like(score, -1.0))
    top = score.topk(r, dim=-1).indices  # (b, r)
    return top, real.gather(-1, top)


def sink_tokens(real: torch.Tensor, sinks: int) -> torch.Tensor:
    """(b, n) bool: the first `sinks` real tokens of each row."""
    return real & (real.cumsum(-1) <= sinks)


def _gather(k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens idx (b, r) of k, v (b, n_kv, n, hd) -> (b, n_kv, r, hd)."""
    index = idx[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[-1])
    return k.gather(2, index), v.gather(2, index)


def keep_bias(keep: torch.Tensor, n_kv: int) -> torch.Tensor:
    """(b, r) bool -> (b, n_kv, r) float32 additive logit bias: 0 = attend, MASKED = never."""
    bias = torch.zeros(keep.shape, dtype=torch.float32, device=keep.device).masked_fill(~keep, MASKED)
    return bias[:, None, :].expand(-1, n_kv, -1).contiguous()


def merged_mass(
    k: torch.Tensor, kp: torch.Tensor, idx: torch.Tensor, dropped: torch.Tensor
) -> torch.Tensor:
    """log(1 + tokens merged into each kept entry): (b, n_kv, r) from keys k (b, n_kv, n, hd), kept kp (.., r, hd).

    Each dropped token's softmax mass goes to the kept entry whose key is most similar (cosine, per KV head),
    so the compressed prompt keeps its share of the softmax denominator.
    """
    sim = F.normalize(k.float(), dim=-1) @ F.normalize(kp.float(), dim=-1).mT  # (b, n_kv, n, r)
    nearest = sim.argmax(-1)  # (b, n_kv, n)
    count = torch.ones(*kp.shape[:3], dtype=torch.float32, device=k.device)
    count.scatter_add_(2, nearest, dropped[:, None, :].expand_as(nearest).to(torch.float32))
    return count.log()


def compress_prefix(
    x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor, r: int, compress: str = "hybrid",
    sinks: int = 4, mass: bool = True, svd: SvdMethod = "exact", iters: int = 2,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compress n prefix tokens to at most r entries.

    x (b, n, d) layer input, k/v (b, n_kv, n, hd) post-RoPE keys / values, real (b, n) bool.
    Returns keys, values (b, n_kv, r', hd) and an additive logit bias (b, n_kv, r') float32 (0, MASKED, or the
    merged log-mass), r' = min(r, n); r ≥ n returns the input unchanged (bias 0 on real tokens).
    Every compressor but "recent" first keeps the first min(sinks, r) real tokens exactly (attention sinks).
    """
    n, n_kv = x.shape[1], k.shape[1]
    if r >= n:
        return k, v, keep_bias(real, n_kv)
    if compress not in COMPRESSORS:
        raise AttnslimError(f"compress={compress!r} is invalid; valid: {' | '.join(COMPRESSORS)}")
    if compress in ("recent", "sink"):
        idx, keep = priority_tokens(real, r, sinks if compress == "sink" else 0)
        idx, order = idx.sort(dim=-1)  # positional order (cosmetic: softmax is order-free)
        return (*_gather(k, v, idx), keep_bias(keep.gather(-1, order), n_kv))
    s = min(sinks, r)
    sink_idx, sink_keep = priority_tokens(real, s, s)  # (b, s)
    ks, vs = _gather(k, v, sink_idx)
    if s == r:
        return ks, vs, keep_bias(sink_keep, n_kv)
    rest = real & ~sink_tokens(real, s)  # (b, n) tokens the compressed part describes
    n_recent = (r - s) // 2 if compress == "hybrid" else 0
    older = rest
    if n_recent:  # the most recent prefix tokens, kept exactly; the principal picks come from the older ones
        rec_idx, rec_keep = priority_tokens(rest, n_recent, 0)  # (b, n_recent)
        older = rest & ~torch.zeros_like(rest).scatter(1, rec_idx, rec_keep)
    u, xp = principal_components(x, r - s - n_recent, svd, iters, mask=older, compute_dtype=compute_dtype(x))
    if compress == "principal-mix":
        u = u.to(k.dtype)
        kp, vp = torch.einsum("bnr,bhnd->bhrd", u, k), torch.einsum("bnr,bhnd->bhrd", u, v)
        keep = torch.cat((sink_keep, component_mask(xp)), -1)
        return torch.cat((ks, kp), 2), torch.cat((vs, vp), 2), keep_bias(keep, n_kv)
    idx, keep = pivot_tokens(u, older, r - s - n_recent)  # (b, r - s - n_recent)
    if n_recent:
        idx, keep = torch.cat((rec_idx, idx), -1), torch.cat((rec_keep, keep), -1)
    idx, order = idx.sort(dim=-1)
    keep = keep.gather(-1, order)
    kp, vp = _gather(k, v, idx)
    bias = keep_bias(torch.cat((sink_keep, keep), -1), n_kv)
    if mass:
        dropped = rest.clone()
        dropped.scatter_(1, idx, False)  # (b, n) real non-sink tokens not kept
        bias[..., s:] += merged_mass(k, kp, idx, dropped)
    return torch.cat((ks, kp), 2), torch.cat((vs, vp), 2), bias


@register_module
class PrincipalCacheAttention(SpecAttention):
    """Exact causal prefill; generated tokens attend to r compressed prompt entries + an exact recent window."""

    def __init__(
        self, spec: AttentionSpec, rank: int | float = 0.25, window: int = 32, compress: str = "hybrid",
        sinks: int = 4, mass: bool = True, svd: SvdMethod = "exact", iters: int = 2,
        dtype: torch.dtype | None = None,
    ) -> None:
        check_rank(rank, f"layer {spec.layer}")
        if compress not in COMPRESSORS or window < 0 or sinks < 0 or svd not in ("exact", "approx") or iters < 1:
            raise AttnslimError(
                f"layer {spec.layer}: compress={compress!r} window={window} sinks={sinks} svd={svd!r} iters={iters} "
                f"invalid; valid: compress {'|'.join(COMPRESSORS)}, window ≥ 0, sinks ≥ 0, svd exact|approx, iters ≥ 1"
            )
        super().__init__(spec, dtype)
        self.rank, self.window, self.compress, self.sinks, self.mass = rank, window, compress, sinks, mass
        self.svd, self.iters = svd, iters
        self.compress_at: int | None = None  # set only inside `compression_point`

    def cache_entries(self, prompt: int) -> int:
        """Entries this layer's cache holds right after a prefill of `prompt` tokens (dense: `prompt`)."""
        n = max(prompt - self.window, 0)
        return min(layer_rank(prompt, self.rank, self.layer_idx), n) + prompt - n

    def attention_flops(self, context: int) -> float:
        """FLOPs of the attention core (scores + weighted values) for one generated token after a prompt of
        `context` tokens: over the cache_entries(context) entries left after compression, not `context`."""
        return 4.0 * self.cache_entries(context) * self.n_heads * self.head_dim

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Exact softmax attention; keep (b, 1, t, kv) bool."""
        groups = self.n_heads // self.n_kv_heads
        return softmax_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), keep, self.scaling)

    def _attend_compressed(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comp_bias: torch.Tensor, tail_keep: torch.Tensor
    ) -> torch.Tensor:
        """Queries (b, H, t, hd) over [compressed (bias (b, n_kv, r)) ; exact tail (keep (b, 1, t, tail))]."""
        groups = self.n_heads // self.n_kv_heads
        b, _, t, _ = q.shape
        low = torch.finfo(q.dtype).min  # masked entries in the compute dtype (finite: never NaN, no overflow)
        comp = comp_bias.clamp_min(low).to(q.dtype).repeat_interleave(groups, dim=1)[:, :, None, :].expand(b, -1, t, -1)
        tail = torch.zeros(tail_keep.shape, dtype=q.dtype, device=q.device).masked_fill(~tail_keep, low)
        bias = torch.cat((comp, tail.expand(b, self.n_heads, t, -1)), dim=-1)  # (b, H, t, r + tail)
        return F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=bias,
                                              scale=self.scaling)

    def attend(self, call: AttentionCall) -> torch.Tensor:
        hidden_states, position_embeddings, attention_mask, past_key_values = call
        x = hidden_states  # (b, t, hidden)
        q, k = self.qk_post(self.heads(self.q_proj(x)), self.heads(self.k_proj(x)), position_embeddings)
        assert q is not None and k is not None
        v = self.heads(self.v_proj(x))  # q (b, H, t, hd); k, v (b, n_kv, t, hd)
        layer = _compat.cache_layer(past_key_values, self.layer_idx)
        if isinstance(layer, PrincipalCacheLayer):
            return self.merge(self._decode(q, k, v, layer, attention_mask))
        if _compat.cache_seq_length(past_key_values, self.layer_idx) > 0:
            raise AttnslimError(
                f"layer {self.layer_idx}: the KV cache already holds uncompressed entries; PrincipalCacheAttention "
                "must see the whole prompt in its first cached forward (use a fresh cache)"
            )
        return self.merge(self._prefill(x, q, k, v, attention_mask, past_key_values))

    def _decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: PrincipalCacheLayer, attention_mask: Any
    ) -> torch.Tensor:
        b, _, t, _ = q.shape
        keys, values = layer.update(k, v)  # (b, n_kv, n_comp + tail, hd)
        tail = keys.shape[2] - layer.n_comp
        hf_keep = _compat.keep_mask(attention_mask, t, layer.seen, q.device)[..., -tail:]  # (b|1, 1, t, tail)
        return self._attend_compressed(q, keys, values, layer.comp_bias, hf_keep)

    def _prefill(
        self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: Any, cache: Any
    ) -> torch.Tensor:
        b, _, t, _ = q.shape
        keep = _compat.keep_mask(attention_mask, t, t, q.device).expand(b, 1, t, t)  # (b, 1, t, t)
        point = self.compress_at if self.compress_at is not None else (t if cache is not None else None)
        if point is None or (point >= t and cache is None):
            return self._attend(q, k, v, keep)  # no compression inside this pass: exact causal attention
        if point > t:
            raise AttnslimError(
                f"layer {self.layer_idx}: compression point {point} is beyond the {t} prefilled tokens; with a KV "
                f"cache prefill at least {point} tokens in the first forward"
            )
        n = max(point - self.window, 0)  # compressible prefix [0, n)
        r = layer_rank(point, self.rank, self.layer_idx)
        real = keep[:, 0, point - 1, :n]  # (b, n) real prefix tokens, as the last prompt query sees them
        kc, vc, bias = compress_prefix(
            x[:, :n], k[:, :, :n], v[:, :, :n], real, r, self.compress, self.sinks, self.mass, self.svd, self.iters
        )
        out = self._attend(q[:, :, :point], k[:, :, :point], v[:, :, :point], keep[..., :point, :point])
        keys, values = torch.cat((kc, k[:, :, n:]), dim=2), torch.cat((vc, v[:, :, n:]), dim=2)  # [r' ; tail]
        if point < t:
            after = self._attend_compressed(q[:, :, point:], keys, values, bias, keep[:, :, point:, n:])
            out = torch.cat((out, after), dim=2)
        if cache is not None:
            _compat.install_cache_layer(cache, self.layer_idx, PrincipalCacheLayer(keys, values, bias, t))
        return out

    def kv_cache_bytes_per_token(self) -> int:
        """Bytes per exact (window / generated) entry; the compressed prompt adds r entries once."""
        return 2 * self.n_kv_heads * self.head_dim * next(self.o_proj.parameters()).element_size()

    def describe(self) -> dict[str, Any]:
        return {"kind": "PrincipalCacheAttention", "rank": self.rank, "window": self.window,
                "compress": self.compress, "sinks": self.sinks, "mass": self.mass, "svd": self.svd}

    def extra_repr(self) -> str:
        r = f"r={self.rank}·P" if isinstance(self.rank, float) else f"r={self.rank}"
        extra = "" if self.compress == "recent" else f", sinks={self.sinks}"
        extra += f", mass={self.mass}" if self.compress == "principal" else ""
        return f"layer={self.layer_idx}, {r}, window={self.window}, compress={self.compress}{extra}, svd={self.svd}"


@contextmanager
def compression_point(model: nn.Module, position: int) -> Iterator[None]:
    """Inside the block, uncached forwards compress every serving layer's prompt at `position` (see docstring)."""
    if isinstance(position, bool) or not isinstance(position, int) or position < 1:
        raise AttnslimError(f"compression point must be an int ≥ 1 (the prompt length), got {position!r}")
    layers = [m for m in model.modules() if isinstance(m, PrincipalCacheAttention)]
    if not layers:
        raise AttnslimError("the model has no PrincipalCacheAttention layers; compress it with atp, form=serving")
    old = [m.compress_at for m in layers]
    try:
        for m in layers:
            m.compress_at = position
        yield
    finally:
        for m, value in zip(layers, old, strict=True):
            m.compress_at = value


@torch.no_grad()
def continuation_nll(model: nn.Module, ids: torch.Tensor, context: int) -> tuple[float, int]:
    """Sum of NLL over tokens [context, T) of ids (b, T) and their count, the prompt compressed at `context`.

    Works for any model: serving layers compress at `context`, dense layers stay exact (the full-cache baseline).
    """
    if not 1 <= context < ids.shape[1]:
        raise AttnslimError(f"context={context} must be in [1, {ids.shape[1] - 1}] for sequences of {ids.shape[1]}")
    serving = any(isinstance(m, PrincipalCacheAttention) for m in model.modules())
    with compression_point(model, context) if serving else _nothing():
        logits = model(input_ids=ids, use_cache=False).logits  # (b, T, vocab)
    pred, target = logits[:, context - 1 : -1].float(), ids[:, context:]
    nll = F.cross_entropy(pred.reshape(-1, pred.shape[-1]), target.reshape(-1), reduction="sum")
    return float(nll), target.numel()


@contextmanager
def _nothing() -> Iterator[None]:
    yield

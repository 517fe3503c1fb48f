"""`latentllm`'s ablation forms of q/k (App. C and D): the option checks, the fits and the modules they install.

  qk=joint_qkv   one shared A for q, k and v (Eq. 50, linalg/joint_qkv.py): a plan rank "qkv" for the stacked
                 (d_q + 2 d_kv) × d matrix instead of q, k, v; installs `JointQKVAttention` (dense KV cache);
                 o by the local fit (vo=separate).
  qk=split_head  q and k each by a per-head activation-aware SVD (Eq. 53-54, linalg/split_head.py): rank r/h per
                 head, B block-diagonal, stored as its h blocks (`BlockLowRankLinear`; k's head count is n_kv);
                 v and o as `vo` says. Ranks are multiples of the head count; the uniform rule only.
Both are the paper's ablations beside joint QK (Remark 8: joint QKV is worse; Fig. 9: split-head is "terrible");
measured in BENCHMARKS.md, section "What the papers claim, and what we measure" (rows Joint QKV and Split-head).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from attnslim.adapters.base import Adapter, AttentionSpec
from attnslim.errors import AttnslimError
from attnslim.linalg.joint_qkv import joint_qkv_factorize, stack_qkv
from attnslim.linalg.lowrank import LowRankFactors
from attnslim.linalg.precond import PrecondSpec
from attnslim.linalg.split_head import split_head_factorize
from attnslim.linalg.stats import InputStats
from attnslim.modules.base import AttnShape
from attnslim.modules.block_lowrank import BlockLowRankLinear
from attnslim.modules.joint_qkv import JointQKVAttention
from attnslim.modules.lowrank import LowRankLinear

if TYPE_CHECKING:
    from attnslim.methods.latentllm import LatentLLM

JOINT_QKV, SPLIT_HEAD = "joint_qkv", "split_head"


def check_form_options(m: LatentLLM) -> None:
    """Refuse what the ablation forms cannot do, naming the option and the fix (called by __post_init__)."""
    qk = m.qk
    if qk not in (JOINT_QKV, SPLIT_HEAD):
        return
    why: list[str] = []
    if m.rope_window != 1:
        why.append(f"rope_window={m.rope_window} shapes only the joint QK fit (qk: joint); set rope_window: 1")
    if m.kv_ratio is not None:
        why.append(f"kv_ratio={m.kv_ratio} budgets latent key/value caches by r_k + r_v, which qk={qk} does not "
                   "have; use ratio, total_ratio or ranks")
    if qk == JOINT_QKV:
        if m.cache != "dense":
            why.append(f"cache={m.cache!r}: qk=joint_qkv keeps rotated keys and values in the cache (a cache of "
                       "the shared latent A x is not implemented); set cache: dense")
        if m.vo != "separate":
            why.append(f"vo={m.vo!r}: qk=joint_qkv compresses v with q and k; o is fitted locally, so set vo: "
                       "separate")
    elif m.ranks is None and m.alloc != "uniform":
        why.append(f"alloc={m.alloc!r} ranks by the whole matrix's whitened spectrum and counts dense-B weights, "
                   "neither of which is split-head's; set alloc: uniform")
    if why:
        raise AttnslimError(f"latentllm qk={qk}: " + "; ".join(why))


def split_heads(qk: str, spec: AttentionSpec) -> dict[str, int]:
    """The split-head linears' head counts (q: h, k: n_kv), empty for every other qk mode."""
    return {"q": spec.n_heads, "k": spec.n_kv_heads} if qk == SPLIT_HEAD else {}


def qkv_shape(spec: AttentionSpec) -> tuple[int, int]:
    """(d_q + 2 d_kv, d) of the stacked q/k/v."""
    return (spec.q.shape[0] + spec.k.shape[0] + spec.v.shape[0], spec.q.shape[1])


def stacked_qkv(spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[W_q; W_k; W_v] (d_q + 2 d_kv, d) and the stacked bias (None without biases)."""
    return stack_qkv((spec.q, spec.k, spec.v), (spec.q_bias, spec.k_bias, spec.v_bias))


def fit_joint_qkv(spec: AttentionSpec, st: InputStats, rank: int, layer: int, *, precond: PrecondSpec,
                  junction: str) -> LowRankFactors:
    return joint_qkv_factorize((spec.q, spec.k, spec.v), (spec.q_bias, spec.k_bias, spec.v_bias), st, rank,
                               precond=precond, junction=junction, label=f"layer {layer}")


def fit_split_head(spec: AttentionSpec, st: InputStats, ranks: dict[str, int], layer: int, *,
                   precond: PrecondSpec, dtype: torch.dtype) -> tuple[BlockLowRankLinear, BlockLowRankLinear]:
    """q and k as split-head modules (h and n_kv blocks)."""
    out = []
    for name, n in split_heads(SPLIT_HEAD, spec).items():
        f = split_head_factorize(spec.weight(name), getattr(spec, f"{name}_bias"), st, ranks[name], n,
                                 precond=precond, label=f"layer {layer} {name}")
        out.append(BlockLowRankLinear.from_block_factors(f, n, dtype))
    return out[0], out[1]


def empty_split_head(spec: AttentionSpec, ranks: dict[str, int], dtype: torch.dtype
                     ) -> tuple[BlockLowRankLinear, BlockLowRankLinear]:
    """The modules fit_split_head builds, empty (for loading)."""
    q, k = (BlockLowRankLinear(spec.q.shape[1], spec.weight(n).shape[0], ranks[n], h,
                               getattr(spec, f"{n}_bias") is not None, dtype)
            for n, h in split_heads(SPLIT_HEAD, spec).items())
    return q, k


def empty_qkv(spec: AttentionSpec, rank: int, dtype: torch.dtype, form: str) -> LowRankLinear:
    """The shared-A module fit_joint_qkv's factors fill, empty (for loading); form as LowRankLinear's."""
    (d_qkv, d), bias = qkv_shape(spec), any(b is not None for b in (spec.q_bias, spec.k_bias, spec.v_bias))
    return LowRankLinear(d, d_qkv, rank, bias, form == "block_identity", dtype, form=form)


def install_joint_qkv(adapter: Adapter, layer: int, spec: AttentionSpec, qkv: LowRankLinear, o: nn.Module
                      ) -> JointQKVAttention:
    rotary = adapter.rotary_embedding(spec.rope.layer_type) if spec.rope is not None else None
    module = JointQKVAttention(AttnShape.of(spec), qkv=qkv, o_proj=o, q_norm=spec.q_norm, k_norm=spec.k_norm,
                               rotary=rotary)
    adapter.replace_attention(layer, module)
    return module


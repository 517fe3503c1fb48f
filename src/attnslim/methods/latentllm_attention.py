"""`latentllm`'s joint attention fits, as the method's conversion uses them: the factors, not the modules.

  joint QK  Tucker/HOSVD of the whitened per-head bilinear forms (Alg. 1; linalg/tucker.joint_qk): shared
            latents A_q x, A_k x and per-head decompressions; RoPE-aware slices when rope_window > 1; another
            pre-conditioner than rootcov runs the same HOSVD in its coordinates (the Table-1 ablation).
  joint VO  the attention-agnostic joint V/O of App. G.0/G.1 (linalg/vo.joint_vo), re-gauged into the module's
            factor form by the caller's `gauge`.
The local (split / separate) fits are one activation-aware SVD per linear and stay in the method.
"""

from __future__ import annotations

from typing import Any

import torch

from attnslim.adapters.base import AttentionSpec
from attnslim.errors import AttnslimError
from attnslim.linalg.lowrank import FitOptions, Gauge, LowRankFactors
from attnslim.linalg.precond import PrecondSpec
from attnslim.linalg.stats import InputStats
from attnslim.linalg.tucker import QKWeights, causal_offsets, joint_qk, rope_rotations
from attnslim.linalg.vo import VOWeights, joint_vo


def fit_joint_qk(spec: AttentionSpec, st: InputStats, ranks: dict[str, int], layer: int, *, precond: PrecondSpec,
                 rope_window: int, n_iter: int, block_identity: bool,
                 rope_freqs: torch.Tensor | None = None) -> tuple[LowRankFactors, LowRankFactors, dict[str, Any]]:
    """q and k factors (B per head flattened to (h·d_h, r)) and the HOSVD loss before and after the iterations.
    `precond`: the step's pre-conditioner (its damp also damps the HOSVD's own root covariance).
    `rope_freqs` (d_rot/2,): the model's own RoPE frequencies (`adapters.rotary.rotary_angles`), needed when
    rope_window > 1 on a RoPE layer: scaled RoPE (llama3, yarn) is not theta's."""
    rope = None
    if spec.rope is not None and rope_window > 1:
        if rope_freqs is None:
            raise AttnslimError(f"layer {layer}: rope_window = {rope_window} needs the model's RoPE frequencies, "
                                "and the adapter gives no rotary module; set rope_window: 1")
        rope = rope_rotations(spec.head_dim, causal_offsets(rope_window), spec.rope.theta, spec.rope.rotary_dims,
                              freqs=rope_freqs.cpu())
    whiten, bias_aware = None, None
    if precond.kind != "rootcov":  # Table-1 ablation: the HOSVD in P-coordinates of another P
        center = precond.kind == "cov" and spec.q_bias is not None
        pc = precond.build(st, center=center, label=f"layer {layer} q/k")
        whiten, bias_aware = (pc.matrix(), pc.inv_matrix()), False
    qk = QKWeights(spec.q, spec.k, spec.n_heads, spec.n_kv_heads, spec.q_bias, spec.k_bias)
    options = FitOptions(n_iter, precond.damp, "block_identity" if block_identity else "none", f"layer {layer} q/k")
    f = joint_qk(qk, st, ranks["q"], ranks["k"], options=options, bias_aware=bias_aware, rope=rope, whiten=whiten)
    fq = LowRankFactors(f.b_q.flatten(0, 1), f.a_q, f.bias_q, f.perm_q)
    fk = LowRankFactors(f.b_k.flatten(0, 1), f.a_k, f.bias_k, f.perm_k)
    return fq, fk, {"hosvd_loss": [f.loss_history[0], f.loss_history[-1]]}


def fit_joint_vo(spec: AttentionSpec, st: InputStats, ranks: dict[str, int], layer: int, *, n_iter: int,
                 damp: float, gauge: Gauge) -> tuple[LowRankFactors, LowRankFactors, dict[str, Any]]:
    """v and o factors in the module's form and the joint loss before and after the iterations."""
    vo = VOWeights(spec.v, spec.o, spec.n_heads, spec.n_kv_heads, spec.v_bias, spec.o_bias)
    f = joint_vo(vo, st, ranks["v"], ranks["o"], options=FitOptions(n_iter, damp, "none", f"layer {layer} v/o"))
    a_o = f.a_o.permute(1, 0, 2).reshape(ranks["o"], -1)  # (r_o, h·d_h): Ŵ_o = B_o A_o
    fv, fo = gauge(f.b_v.flatten(0, 1), f.a_v, f.bias_v), gauge(f.b_o, a_o, f.bias_o)
    return fv, fo, {"vo_loss": [f.loss_history[0], f.loss_history[-1]]}

"""Joint V/O compression, attention-agnostic variant (LatentLLM §4.2, App. G.0-G.1).

Approximated: each head's value-output path W_{o,i} W_{v,i} by (B_o A_{o,i})(B_{v,i} A_v) with a shared
A_v (r_v, d), per-KV-head B_v (d_h, r_v), per-query-head A_o (r_o, d_h) and a shared B_o (d_out, r_o),
minimising Σ_i ‖(W_{o,i} W_{v,i} − Ŵ_{o,i} Ŵ_{v,i}) C^{1/2}‖² under the attention-agnostic assumption
E[X σ σᵀ Xᵀ] = C (softmax weights ignored). The paper found this no better than split V/O (Remark 11):
an ablation, not the LatentLLM default.
Statistics: InputStats of the v_proj input. Cost (weights): r_v (d + n_kv d_h) + r_o (h d_h + d_out)
(minus r_v² + r_o² with block-identity A_v / B_o).
Deviations: Eq. 188 omits C^{1/2} in B_{v,i}; here B_{v,i} = W_{v,i} C^{1/2} A'_vᵀ, which the derivation before
it implies. J_i = I.
GQA: query head (i, j) = index i * group + j reads KV head i (HF repeat_kv order).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnslim.errors import AttnslimError
from attnslim.linalg.lowrank import JOINT_FIT, FitOptions, block_identity
from attnslim.linalg.precond import damped_eigh
from attnslim.linalg.ranks import check_rank
from attnslim.linalg.stats import InputStats

_F64 = torch.float64


@dataclass(frozen=True)
class VOWeights:
    """The value and output projections of one attention layer, what joint_vo approximates.

    w_v: (n_kv·d_h, d);  w_o: (d_out, h·d_h);  b_v: (n_kv·d_h,) or None;  b_o: (d_out,) or None;
    n_heads h, n_kv_heads n_kv (GQA: query head i·g + j reads KV head i, HF repeat_kv order)."""

    w_v: torch.Tensor
    w_o: torch.Tensor
    n_heads: int
    n_kv_heads: int
    b_v: torch.Tensor | None = None
    b_o: torch.Tensor | None = None


@dataclass(frozen=True)
class JointVOFactors:
    """a_v: (r_v, d);  b_v: (n_kv, d_h, r_v);  a_o: (h, r_o, d_h);  b_o: (d_out, r_o);
    bias_v: (n_kv·d_h,) | None (unchanged: softmax rows sum to 1, so it is absorbed by bias_o);
    bias_o: (d_out,) | None;  perm_v / perm_o: block-identity pivots of A_v columns / B_o rows."""

    a_v: torch.Tensor
    b_v: torch.Tensor
    a_o: torch.Tensor
    b_o: torch.Tensor
    bias_v: torch.Tensor | None = None
    bias_o: torch.Tensor | None = None
    perm_v: torch.Tensor | None = None
    perm_o: torch.Tensor | None = None
    loss_history: list[float] = field(default_factory=list)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(Ŵ_v (n_kv·d_h, d), Ŵ_o (d_out, h·d_h))."""
        h, r_o, d_h = self.a_o.shape
        a_o_all = self.a_o.permute(1, 0, 2).reshape(r_o, h * d_h)  # (r_o, h·d_h)
        return self.b_v.flatten(0, 1) @ self.a_v, self.b_o @ a_o_all


def _top_cols(m: torch.Tensor, r: int) -> torch.Tensor:
    """Top-r eigenvectors of a symmetric PSD (n, n) matrix as columns (n, r)."""
    _, q = torch.linalg.eigh(0.5 * (m + m.T))
    return q[:, -r:].flip(1).contiguous()


def _split_o(w_o: torch.Tensor, n_kv: int, g: int, d_h: int) -> torch.Tensor:
    """(d_out, h·d_h) -> (n_kv, g, d_out, d_h): W_{o,(i,j)} column blocks per query head."""
    return w_o.to(_F64).reshape(w_o.shape[0], n_kv, g, d_h).permute(1, 2, 0, 3)


def joint_vo(
    vo: VOWeights, stats: InputStats, r_v: int, r_o: int, *, options: FitOptions = JOINT_FIT,
    center: bool | None = None,
) -> JointVOFactors:
    """Alternating eigen-updates of G.0 (Eq. 184-188), block form:
    B_o ← top-r_o cols of Σ_ij W_{o,ij} (V_i V_iᵀ) W_{o,ij}ᵀ,  V_i = W̃_{v,i} A'_vᵀ;
    A'_v ← top-r_v rows of Σ_ij W̃_{v,i}ᵀ (W_{o,ij}ᵀ B_o B_oᵀ W_{o,ij}) W̃_{v,i},  W̃_v = W_v P.
    center (default: b_o given): P from the centred C0 and b̂_o = b_o + W_o v̄ − Ŵ_o v̂̄ (G.1).
    options: n_iter, damp, junction ("none" | "block_identity"), label (FitOptions).
    """
    w_v, w_o, b_v, b_o, n_heads, n_kv_heads = vo.w_v, vo.w_o, vo.b_v, vo.b_o, vo.n_heads, vo.n_kv_heads
    n_iter, damp, junction, label = options.n_iter, options.damp, options.junction, options.label
    d = stats.dim
    d_h = w_v.shape[0] // n_kv_heads
    d_out = w_o.shape[0]
    if n_heads % n_kv_heads or w_v.shape != (n_kv_heads * d_h, d) or w_o.shape[1] != n_heads * d_h:
        raise AttnslimError(
            f"{label}: w_v {tuple(w_v.shape)} / w_o {tuple(w_o.shape)} do not fit n_heads={n_heads}, "
            f"n_kv_heads={n_kv_heads}, d={d}"
        )
    check_rank(r_v, min(d, n_kv_heads * d_h), "r_v", label)
    check_rank(r_o, min(d_out, n_heads * d_h), "r_o", label)
    if n_iter < 1:
        raise AttnslimError(f"{label}: n_iter = {n_iter} must be >= 1")
    if junction not in ("none", "block_identity"):
        raise AttnslimError(f"{label}: junction = {junction!r} is not one of ('none', 'block_identity')")
    center = b_o is not None if center is None else center
    if center and b_o is None:
        raise AttnslimError(f"{label}: center=True needs b_o (pass zeros(d_out) to add an output bias)")
    g = n_heads // n_kv_heads
    dev = stats.sxx.device  # all math runs where the statistics live
    w_v, w_o = w_v.to(dev, _F64), w_o.to(dev, _F64)
    b_v = None if b_v is None else b_v.to(dev, _F64)
    b_o = None if b_o is None else b_o.to(dev, _F64)
    e, qv, _ = damped_eigh(stats.centred_cov if center else stats.corr, damp, label=label, n=stats.n)
    p, p_inv = (qv * e.sqrt()) @ qv.T, (qv * e.rsqrt()) @ qv.T  # (d, d)
    wv_t = (w_v @ p).reshape(n_kv_heads, d_h, d)  # W̃_v
    wo = _split_o(w_o, n_kv_heads, g, d_h)  # (n_kv, g, d_out, d_h)
    gv = wv_t @ wv_t.transpose(-1, -2)  # (n_kv, d_h, d_h)
    go = wo.transpose(-1, -2) @ wo  # (n_kv, g, d_h, d_h) W_oᵀ W_o
    full = float(torch.einsum("igab,iba->", go, gv))
    vv = gv  # V Vᵀ with A'_v = I (initialisation)
    history: list[float] = []
    for _ in range(n_iter):
        wov = wo @ vv[:, None]  # (n_kv, g, d_out, d_h) W_o (V Vᵀ)
        bo = _top_cols(wov.transpose(0, 2).reshape(d_out, -1) @ wo.transpose(0, 2).reshape(d_out, -1).T, r_o)
        ob = bo.T @ wo  # (n_kv, g, r_o, d_h) B_oᵀ W_o
        oo = (ob.transpose(-1, -2) @ ob).sum(1)  # (n_kv, d_h, d_h) Σ_j W_oᵀ B_o B_oᵀ W_o
        av = _top_cols(wv_t.reshape(-1, d).T @ (oo @ wv_t).reshape(-1, d), r_v).T  # (r_v, d)
        v = wv_t @ av.T  # (n_kv, d_h, r_v)
        vv = v @ v.transpose(-1, -2)
        history.append(full - float(torch.einsum("iab,iba->", oo, vv)))
    b_v_all = (wv_t @ av.T).reshape(n_kv_heads * d_h, r_v)
    a_v = av @ p_inv
    a_o_all = (bo.T @ wo).permute(2, 0, 1, 3).reshape(r_o, n_heads * d_h)  # (r_o, h·d_h)
    perm_v = perm_o = None
    if junction == "block_identity":
        b_v_all, a_v, perm_v = block_identity(b_v_all, a_v)
        a_o_t, bo_t, perm_o = block_identity(a_o_all.T, bo.T)  # B_o gets an identity block in its rows
        a_o_all, bo = a_o_t.T, bo_t.T
    out = JointVOFactors(
        a_v, b_v_all.reshape(n_kv_heads, d_h, r_v), a_o_all.reshape(r_o, n_heads, d_h).permute(1, 0, 2).contiguous(),
        bo, b_v, None, perm_v, perm_o, history,
    )
    if b_o is None:
        return out
    mu = stats.mean
    bv = torch.zeros(n_kv_heads * d_h, dtype=_F64, device=dev) if b_v is None else b_v
    wv_hat, wo_hat = out.weights()
    v_mean = (w_v @ mu + bv).reshape(n_kv_heads, 1, d_h).expand(n_kv_heads, g, d_h).flatten()
    v_mean_hat = (wv_hat @ mu + bv).reshape(n_kv_heads, 1, d_h).expand(n_kv_heads, g, d_h).flatten()
    bias_o = b_o + w_o @ v_mean - wo_hat @ v_mean_hat  # (d_out,)
    return JointVOFactors(out.a_v, out.b_v, out.a_o, out.b_o, out.bias_v, bias_o, perm_v, perm_o, history)


def vo_loss(
    vo: VOWeights, approx: JointVOFactors, stats: InputStats, *, center: bool = False, damp: float = 0.0,
) -> float:
    """Σ_heads ‖(W_{o,i} W_{v,i} − Ŵ_{o,i} Ŵ_{v,i}) P‖², P = (C + λI)^{1/2} (C0 when `center`).

    Evaluated with (d_h, d_h) Gram matrices only. damp = 0 and center = False: the per-token
    attention-agnostic output error Σ_i E‖(W_{o,i}W_{v,i} − Ŵ_{o,i}Ŵ_{v,i}) x‖². The biases of `vo` play no part.
    """
    w_v, w_o, n_heads, n_kv_heads = vo.w_v, vo.w_o, vo.n_heads, vo.n_kv_heads
    d = stats.dim
    d_h = w_v.shape[0] // n_kv_heads
    g = n_heads // n_kv_heads
    dev = stats.sxx.device
    c = (stats.centred_cov if center else stats.corr).to(dev)
    e, qv = torch.linalg.eigh(c)
    e = e.clamp_min(0.0) + damp * float(torch.diagonal(c).mean())
    p = (qv * e.sqrt()) @ qv.T
    wv_hat, wo_hat = approx.weights()
    ys = [(w.to(dev, _F64) @ p).reshape(n_kv_heads, d_h, d) for w in (w_v, wv_hat)]  # W_v P per KV head
    xs = [_split_o(w.to(dev), n_kv_heads, g, d_h) for w in (w_o, wo_hat)]  # (n_kv, g, d_out, d_h)
    total = 0.0
    for s, sign_s in ((0, 1.0), (1, -1.0)):
        for t, sign_t in ((0, 1.0), (1, -1.0)):
            xx = xs[s].transpose(-1, -2) @ xs[t]  # (n_kv, g, d_h, d_h) X_sᵀ X_t
            yy = ys[t] @ ys[s].transpose(-1, -2)  # (n_kv, d_h, d_h) Y_t Y_sᵀ
            total += sign_s * sign_t * float(torch.einsum("igab,iba->", xx, yy))
    return total

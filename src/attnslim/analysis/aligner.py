"""LISA property 19 (paper §5.1, Fig. 5; docs/paper-properties.md): is a trained head aligner permutation-like?

The aligner (modules/aligner.Aligner) maps the channels [A_{n-1}; A_delta] (c_in = 2h with fusion, h without) to
the h heads of layer n, position-wise. Its A_{n-1} block says which of layer n-1's heads each output head reads:
  single linear (LISA_SL, hidden = 0): the block is W[:, :h] (h, h) itself;
  two layers (hidden F > 0): there is no explicit h x h block, so the head-to-head mass is the summed absolute
    weight of every path source head b -> hidden unit k -> output head a: M[a, b] = sum_k |W2[a, k]| |W1[k, b]|,
    i.e. |W2| @ |W1[:, :h]|. This bounds how much of head b can reach head a through any ReLU pattern, and equals
    2 x the permutation for the identity-style init [P; -P], [I, -I] (both ReLU branches carry it).
A row a of M is concentrated when its top entry holds most of the row's mass; its argmax is the source head the
aligner learned for output head a, compared with the global (dataset-level) most-similar head of similarity_report
(`head_matching.global_match`: per adjacent pair, head a of layer n -> best head of layer n-1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from attnslim.modules.aligner import Aligner


def head_mass(aligner: Aligner) -> torch.Tensor:
    """(h, h) non-negative mass M[a, b] from source head b of A_{n-1} to output head a (see the module doc)."""
    h = aligner.n_heads
    w1 = aligner.l1.weight.detach().float()  # (hidden or h, c_in)
    if aligner.l2 is None:
        return w1[:, :h].abs()  # (h, h)
    w2 = aligner.l2.weight.detach().float()  # (h, hidden)
    return w2.abs() @ w1[:, :h].abs()  # (h, hidden) @ (hidden, h) -> (h, h)


@dataclass(frozen=True)
class PermutationLikeness:
    concentration: float  # mean over output heads of (top-1 mass / row mass), in [1/h, 1]
    agreement: float  # fraction of output heads whose argmax source head is the reference matching's head
    chance: float  # 1/h: the agreement of a random assignment
    argmax: list[int]  # per output head a: the source head of its largest mass


def permutation_likeness(mass: torch.Tensor, matching: Sequence[int]) -> PermutationLikeness:
    """Concentration of `mass` (h, h) per row, and how often its row argmax equals `matching[a]` (h,)."""
    h = mass.shape[0]
    if mass.shape != (h, h) or len(matching) != h:
        raise ValueError(f"mass must be (h, h) and matching length h; got {tuple(mass.shape)}, {len(matching)}")
    rows = mass.abs().double()  # (h, h)
    share = rows.max(dim=1).values / rows.sum(dim=1).clamp_min(1e-30)  # (h,)
    top = rows.argmax(dim=1)  # (h,)
    agree = top == torch.as_tensor(list(matching), dtype=top.dtype)  # (h,)
    return PermutationLikeness(float(share.mean()), float(agree.double().mean()), 1.0 / h, top.tolist())

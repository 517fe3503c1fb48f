"""`transmla`: the TransMLA baseline (arXiv 2502.07864) in the MLA form of methods/mla_base.py; methods/mla.py
describes both and what `mla` adds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnslim.adapters.base import AttentionSpec
from attnslim.linalg.mla import (
    MLAFactors,
    assemble,
    fit_latent,
)
from attnslim.linalg.mla_rope import RotarySplit
from attnslim.linalg.stats import InputStats
from attnslim.methods.base import require
from attnslim.methods.mla_base import MLABase, balance, stacked_kv
from attnslim.registry import register_method


@register_method("transmla")
@dataclass(frozen=True)
class TransMLA(MLABase):
    freq_fold: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        require(isinstance(self.freq_fold, int) and self.freq_fold >= 1, self.name, "freq_fold", self.freq_fold,
                "an integer >= 1 (1: no folding)")

    def _rotary_choice(self, rope: int, rotary_dims: int) -> tuple[str, int, int, bool]:
        return "pca", 1, self.freq_fold, self.layout == "deepseek"

    def _fit(self, spec: AttentionSpec, split: RotarySplit, st: InputStats, rank: int, where: str) -> MLAFactors:
        w_kv = stacked_kv(spec, split)
        eye = [torch.eye(split.nope_key.shape[0], dtype=torch.float64), torch.eye(spec.v.shape[0], dtype=torch.float64)]
        kv = fit_latent(w_kv, st.corr, rank, balance(eye, w_kv, st.corr), self.damp, where)
        return assemble(spec.q, spec.k, spec.k_bias, spec.v, spec.v_bias, spec.o, spec.o_bias, split, kv, None)

"""The LM head step (recipe `head:`): the output head W (V, d) factored as B·A after every layer step.

Paper: LatentLLM (seed 001) §3.2-3.3; its Table 3 counts every linear, lm_head included, at κ·d'd (notes §11.3).
Approximated: logits W h by B (A h), minimising E‖(W − BA) h‖² over the head's inputs h: the final norm's outputs on
the calibration text once every layer step ran (the compressed model's own hidden states), by the method's local
activation-aware fit (linalg.lowrank.factorize with its pre-conditioner and junction).
Statistics: InputStats of h (Σhhᵀ, Σh, n), streamed by calib.runner.head_inputs.
Cost: r(V + d) − r² weights with a block-identity junction, r(V + d) with dense factors. A head tied to the token
embedding is untied (`untie: true`, refused otherwise): the embedding stays dense and the model gains the head's
kept weights (`params_delta`); an untied head saves V·d minus them.
Why a recipe section and not a step argument, and what it measures: docs/methods/latentllm.md, "LM head".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import torch

from attnslim import _compat
from attnslim.adapters.base import Adapter
from attnslim.errors import AttnslimError
from attnslim.linalg.lowrank import LowRankFactors, factorize
from attnslim.linalg.precond import PrecondSpec
from attnslim.linalg.ranks import factor_weights, rank_for_ratio
from attnslim.linalg.stats import InputStats
from attnslim.methods.latentllm import LatentLLM
from attnslim.methods.latentllm_ranks import Shapes, dense_weights, kept_weights, uniform_ranks
from attnslim.modules.lowrank import compact_linear, empty_compact_linear
from attnslim.settings import HeadConfig


@dataclass(frozen=True)
class HeadFit:
    """What a method contributes to the head's fit: its pre-conditioner and junction, and the module form."""

    precond: PrecondSpec
    junction: str
    form: str  # modules/lowrank.FORMS: the junction when it saves r², else "dense"


class HeadShape(NamedTuple):
    """An LM head's shape for counting: (vocab, hidden), and whether it is tied to the token embedding."""

    vocab: int
    hidden: int
    tied: bool


LATENTLLM_HEAD_ARGS = ("precond", "junction", "damp", "alpha")


def _latentllm(args: Mapping[str, Any]) -> HeadFit:
    """latentllm's local fit (notes §2): its arguments validated by the method itself."""
    if unknown := sorted(set(args) - set(LATENTLLM_HEAD_ARGS)):
        raise AttnslimError(f"head.args has unknown key(s) {unknown} for method latentllm; valid: "
                            f"{', '.join(LATENTLLM_HEAD_ARGS)} (the head's kept fraction is head.ratio)")
    method = LatentLLM.from_args(dict(args))
    assert isinstance(method, LatentLLM)
    return HeadFit(method.precond_spec, method.junction, method.form)


HEAD_FITS: dict[str, Callable[[Mapping[str, Any]], HeadFit]] = {"latentllm": _latentllm}  # methods that fit a head


def head_fit(config: HeadConfig) -> HeadFit:
    """The fit `config` names, or an error naming the methods that can compress the head."""
    if config.method not in HEAD_FITS:
        raise AttnslimError(f"head.method={config.method!r} cannot compress the LM head (its conversion is per "
                            f"decoder layer); valid: {', '.join(sorted(HEAD_FITS))}")
    try:
        return HEAD_FITS[config.method](config.args or {})
    except AttnslimError as err:
        raise AttnslimError(f"head: {err}") from err


@dataclass(frozen=True)
class HeadEntry:
    """The head's plan: its shape, rank and form, whether it was tied, and its weights before and after."""

    vocab: int
    hidden: int
    rank: int
    form: str
    bias: bool
    tied: bool  # tied to the token embedding before the step (then untied by it)
    dense: int  # V·d
    kept: int  # weights of the factors

    @property
    def params_delta(self) -> int:
        """Parameters the model gains (> 0) or loses (< 0): a tied head's weights were the embedding's, so all the
        kept weights are new; an untied head frees its dense V·d."""
        return self.kept - (0 if self.tied else self.dense)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any, where: str) -> HeadEntry:
        try:
            return cls(**data)
        except TypeError as err:
            raise AttnslimError(f"{where}: the head plan {data!r} is not valid ({err}); re-create the output with "
                                "attnslim compress") from None


def check_head(adapter: Adapter, config: HeadConfig) -> HeadFit:
    """Refuse, before any work, what the head step cannot do: an unsupported method, a tied head without `untie`, a
    head that is not a dense linear (an earlier compression replaced it)."""
    fit = head_fit(config)
    head = dense_head(adapter)
    if adapter.head_tied() and not config.untie:
        vocab, hidden = head.weight.shape
        kept = factor_weights(vocab, hidden, rank_for_ratio(vocab, hidden, config.ratio, fit.junction), fit.junction)
        raise AttnslimError(
            f"head: this model's LM head is tied to its token embedding ({vocab}×{hidden}); compressing it unties "
            f"it: the embedding stays dense and the head's {kept:,} factor weights at ratio {config.ratio} are "
            "added (the model grows). Set head.untie: true to accept that, or remove the head: section")
    return fit


def dense_head(adapter: Adapter) -> torch.nn.Linear:
    """The model's output head as the dense Linear the step starts from (and a reload's skeleton replaces)."""
    head = adapter.output_head()
    if not isinstance(head, torch.nn.Linear):
        raise AttnslimError(f"head: the output head is a {type(head).__name__}, not a dense Linear (already "
                            "compressed?); remove the recipe's head: section")
    return head


def plan_head(adapter: Adapter, config: HeadConfig, fit: HeadFit) -> HeadEntry:
    """Rank of the head at `config.ratio` of its weights under the fit's junction (linalg/ranks.py)."""
    head = dense_head(adapter)
    vocab, hidden = head.weight.shape  # (V, d)
    rank = rank_for_ratio(vocab, hidden, config.ratio, fit.junction)
    return HeadEntry(int(vocab), int(hidden), rank, fit.form, head.bias is not None, adapter.head_tied(),
                     int(vocab * hidden), factor_weights(vocab, hidden, rank, fit.junction))


def head_factors(w: torch.Tensor, b: torch.Tensor | None, stats: InputStats, entry: HeadEntry, fit: HeadFit
                 ) -> LowRankFactors:
    """w (V, d), b (V,) or None, stats of the head's input (d) -> the rank-`entry.rank` factors (float64)."""
    return factorize(w, b, stats, entry.rank, precond=fit.precond, junction=fit.junction, label="lm_head")


def activation_loss(w: torch.Tensor, f: LowRankFactors, stats: InputStats) -> float:
    """E‖(W − BA) h‖² / E‖W h‖² over the head's inputs (uncentred): the fraction of logit energy the fit loses."""
    c = stats.corr  # (d, d) E[h hᵀ]
    w64 = w.to(c.device, torch.float64)
    err = w64 - f.weight()  # (V, d)
    return float(((err @ c) * err).sum() / ((w64 @ c) * w64).sum())


def install_head(adapter: Adapter, f: LowRankFactors) -> None:
    """The factors as the model's (untied) output head, in the old head's dtype and on its device."""
    weight = dense_head(adapter).weight
    _compat.install_output_head(adapter.model, compact_linear(f, weight.dtype).to(weight.device))


def head_skeleton(adapter: Adapter, entry: HeadEntry) -> None:
    """The empty head module `install_head` builds for `entry` (for loading)."""
    weight = dense_head(adapter).weight
    empty = empty_compact_linear(entry.hidden, entry.vocab, entry.rank, entry.bias, entry.form == "block_identity",
                                 weight.dtype, entry.form)
    _compat.install_output_head(adapter.model, empty.to(weight.device))


def uniform_total(total_before: int, per_layer: Sequence[Shapes], kappa: float, junction: str,
                  head: HeadShape | None = None) -> int:
    """Parameters after every linear of `per_layer` (name -> (d_out, d_in) per decoder layer) keeps κ of its weights
    under the uniform rule (latentllm_ranks.uniform_ranks, integer ranks), and with `head` its LM head too: the
    arithmetic of the paper's Table 3 (notes §11.3), which holds only with the head."""
    saved = 0
    for shapes in per_layer:
        ranks = uniform_ranks(shapes, dict.fromkeys(shapes, kappa), junction)
        saved += dense_weights(shapes) - kept_weights(shapes, ranks, junction)
    if head is None:
        return total_before - saved
    kept = factor_weights(head.vocab, head.hidden, rank_for_ratio(head.vocab, head.hidden, kappa, junction), junction)
    return total_before - saved + kept - (0 if head.tied else head.vocab * head.hidden)

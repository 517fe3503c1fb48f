"""The planner's quality cost: KL(p_dense ‖ p_model) per scored token, on calibration windows, never evaluation text.

Unlike analysis/conversion.py (the last position only, because ATP's paper layer is not causal), every planner
candidate is causal, so each window is scored teacher-forced at its second half of positions (the first half gives
each scored token at least half a window of context, where attention compression shows): many more scored tokens
per forward than one per window. Only the scored positions reach the LM head (`logits_to_keep`).

`kl_from(start, hidden)`: with every layer below `start` dense, their output on the scored windows is the dense
model's, recorded once by a layer runner; the forward then runs from layer `start` only (the layers below stand
aside for the call), which is what makes measuring every candidate of every layer affordable.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from attnslim import _compat
from attnslim.adapters.base import Adapter
from attnslim.data import calib_windows
from attnslim.errors import AttnslimError


@dataclass(frozen=True)
class ScoreSet:
    """Windows (n, t), the positions scored in each, and the dense model's log-probabilities there (n, p, vocab)
    with their probabilities (exp'd once: every candidate's KL reads them)."""

    ids: torch.Tensor
    positions: torch.Tensor
    reference: torch.Tensor
    description: str
    probs: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "probs", self.reference.exp())

    @property
    def tokens(self) -> int:
        return int(self.ids.shape[0] * self.positions.numel())


def score_set(model: Any, tokenizer: Any, source: str, windows: int, seq_len: int, seed: int) -> ScoreSet:
    """`windows` calibration windows of `source` drawn with `seed` (the planner draws its scoring and held-out
    windows with other seeds than the fit's), scored at their second half."""
    drawn = calib_windows(source, tokenizer, windows, seq_len, seed, model=model)
    positions = torch.arange(seq_len // 2, seq_len)
    return ScoreSet(drawn.ids, positions, log_probs(model, drawn.ids, positions), drawn.description)


@torch.no_grad()
def log_probs(model: Any, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(n, p, vocab) next-token log-probabilities at `positions` of each window, in float32 on the CPU."""
    device = _compat.input_device(model)
    out = model(input_ids=ids.to(device), use_cache=False, logits_to_keep=positions.to(device))
    return out.logits.float().log_softmax(-1).cpu()


def kl(model: Any, scores: ScoreSet) -> float:
    """Mean KL(dense ‖ model) per scored token, the model as it is now."""
    got = log_probs(model, scores.ids, scores.positions)
    return float((scores.reference - got).mul_(scores.probs).sum()) / scores.tokens  # Σ p (log p − log q)


class _Aside(nn.Module):
    """A decoder layer standing aside: it returns its input (the recorded hidden states replace it above)."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states


@contextmanager
def starting_at(adapter: Adapter, start: int, hidden: torch.Tensor) -> Iterator[None]:
    """A forward of the model inside runs decoder layers start.. only, layer `start` reading `hidden` (b, t, d)."""
    layers = adapter.decoder_layers()
    below = [layers[j] for j in range(start)]

    def feed(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        given = args[0] if args else kwargs["hidden_states"]
        if not isinstance(given, torch.Tensor) or given.shape != hidden.shape:  # the layers below must pass it on
            raise AttnslimError(f"internal: decoder layer {start} received {type(given).__name__} "
                                f"{getattr(given, 'shape', '')} instead of hidden states {tuple(hidden.shape)}; this "
                                "transformers version's decoder loop is not what the planner's scoring expects")
        if args:
            return (hidden.to(given.device), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden.to(given.device)}

    handle = layers[start].register_forward_pre_hook(feed, with_kwargs=True)
    try:
        for j in range(start):
            layers[j] = _Aside()
        yield
    finally:
        handle.remove()
        for j, layer in enumerate(below):
            layers[j] = layer


def kl_from(model: Any, adapter: Adapter, scores: ScoreSet, start: int, hidden: torch.Tensor) -> float:
    """`kl` where layers below `start` are dense and `hidden` is their output on `scores.ids`."""
    if start == 0:
        return kl(model, scores)
    with starting_at(adapter, start, hidden):
        return kl(model, scores)

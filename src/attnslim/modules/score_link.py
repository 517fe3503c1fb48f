"""`ScoreLink`: hands one layer's pre-softmax scores to the next layer inside one forward pass (LISA)."""

from __future__ import annotations

import torch
from torch import nn

from attnslim.errors import AttnslimError


class ScoreLink:
    """Carries one donor layer's unmasked scores (b, h, q, t) to its receiver within one forward pass.

    Not a Module: it holds no weights and is not saved; convert/skeleton create it. A receiver that finds
    no fresh scores, or scores the donor overwrote before they were read, raises instead of reusing stale
    ones: layers run one at a time (calibration of a later recipe step) or re-run in backward (HF gradient
    checkpointing) break the one-forward order sharing needs.
    """

    def __init__(self, donor: int, receiver: int) -> None:
        self.donor, self.receiver = donor, receiver
        self._scores: torch.Tensor | None = None
        self._overrun = False

    def put(self, scores: torch.Tensor) -> None:
        self._overrun = self._scores is not None
        self._scores = scores

    def take(self, shape: tuple[int, int, int, int]) -> torch.Tensor:
        scores, overrun = self._scores, self._overrun
        self.clear()
        where = f"layer {self.receiver} (reads the scores of layer {self.donor})"
        if scores is None:
            raise AttnslimError(
                f"{where}: layer {self.donor} produced no scores in this forward pass; shared layers must run "
                "inside one model forward (no HF gradient checkpointing, no layer-by-layer runs)"
            )
        if overrun:
            raise AttnslimError(
                f"{where}: layer {self.donor} ran twice before its scores were read (layer-by-layer calibration "
                "or an interrupted forward); put sharing steps last in a recipe, or call "
                "attnslim.modules.score_link.reset_links(model)"
            )
        if tuple(scores.shape) != tuple(shape):
            raise AttnslimError(
                f"{where}: got scores {tuple(scores.shape)}, expected (batch, heads, queries, keys) = {tuple(shape)}"
                "; donor and receiver must have the same number of query heads and the same cache length"
            )
        return scores

    def clear(self) -> None:
        self._scores, self._overrun = None, False


def reset_links(model: nn.Module) -> None:
    """Drop scores left in every ScoreLink of `model` (after a forward pass that raised midway)."""
    for module in model.modules():
        for name in ("link", "export"):
            link = getattr(module, name, None)
            if isinstance(link, ScoreLink):
                link.clear()

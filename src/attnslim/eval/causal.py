"""Teacher-forced scores (perplexity, lm-eval log-likelihoods) are only honest for causal models.

A module that lets position t see tokens after t (ATP's paper layer, `causal = False` on the class) reads the
very tokens such a score predicts, so its perplexity or task accuracy would be silently optimistic. These
scores refuse such models; the leak-free evaluation is eval/choice.py (the answer read at the last position).
"""

from __future__ import annotations

from typing import Any

from attnslim.errors import AttnslimError


def noncausal_layers(model: Any) -> list[int]:
    """Layer indices of the modules in `model` that declare `causal = False`."""
    return sorted({getattr(m, "layer_idx", -1) for m in model.modules() if getattr(m, "causal", True) is False})


def require_causal(model: Any, what: str) -> None:
    """Raise if `model` has non-causal layers: `what` (a teacher-forced score) would read its own targets."""
    if layers := noncausal_layers(model):
        raise AttnslimError(
            f"{what}: layers {layers} are non-causal (ATP's paper layer: every position sees later tokens), so a "
            "teacher-forced score would read the tokens it predicts. Score prompts at the last position instead "
            "(`attnslim eval MODEL --choice 100`, eval/choice.py), or compress with atp form: serving (causal)"
        )

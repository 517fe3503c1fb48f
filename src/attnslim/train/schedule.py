"""Learning-rate schedule shared by the training loops."""

from __future__ import annotations

import math


def warmup_cosine(lr: float, warmup: float, steps: int, step: int) -> float:
    """Linear warm-up over round(warmup · steps) steps (at least 1), then cosine decay to 0 at `steps`."""
    warm = max(1, round(warmup * steps))
    if step < warm:
        return lr * (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm)
    return lr * 0.5 * (1.0 + math.cos(math.pi * progress))

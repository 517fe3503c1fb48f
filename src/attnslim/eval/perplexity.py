"""Perplexity on fixed non-overlapping windows: mean NLL over every predicted token, exp'd."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from attnslim import _compat
from attnslim.adapters import get_adapter
from attnslim.data import TokenWindows
from attnslim.errors import AttnslimError
from attnslim.eval.causal import require_causal


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood (nats per predicted token)
    predicted_tokens: int
    windows: int
    seq_len: int
    description: str


@torch.no_grad()
def window_nll(model: Any, ids: torch.Tensor) -> tuple[float, int]:
    """Sum of NLL and number of predicted tokens for a batch of windows ids (b, t)."""
    logits = model(input_ids=ids, use_cache=False).logits  # (b, t, vocab)
    nll = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1), reduction="sum"
    )
    return float(nll), ids[:, 1:].numel()


def perplexity(
    model: Any, windows: TokenWindows, batch_size: int = 1, progress: bool = True, label: str = ""
) -> PerplexityResult:
    """Perplexity of `model` on `windows` (the same windows must be used for every compared model); refuses
    models with non-causal layers (eval/causal.py)."""
    require_causal(model, "perplexity")
    device = _compat.input_device(model)
    total, count = 0.0, 0
    ids = windows.ids
    batches = range(0, ids.shape[0], batch_size)
    for start in tqdm(batches, desc=f"ppl {label or windows.source}", disable=not progress, leave=False):
        nll, n = window_nll(model, ids[start : start + batch_size].to(device))
        total, count = total + nll, count + n
    mean = total / count
    if not math.isfinite(mean):
        raise AttnslimError(f"perplexity on {label or windows.source} is not finite: {nonfinite_site(model, ids[:1])}"
                            "; the weights are damaged or the compression diverged, so no number is reported")
    return PerplexityResult(
        ppl=math.exp(mean), nll=mean, predicted_tokens=count, windows=ids.shape[0], seq_len=ids.shape[1],
        description=windows.description,
    )


@torch.no_grad()
def nonfinite_site(model: Any, ids: torch.Tensor) -> str:
    """Where NaN/Inf first appears: a parameter that holds it, else the first decoder layer whose output has it."""
    for name, param in model.named_parameters():
        if not torch.isfinite(param).all():
            return f"parameter {name} holds NaN/Inf"
    layers = get_adapter(model).decoder_layers()
    found: list[int] = []

    def hook(index: int) -> Any:
        def check(module: Any, args: Any, output: Any) -> None:
            out = output[0] if isinstance(output, tuple) else output
            if not found and not torch.isfinite(out).all():
                found.append(index)
        return check

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        model(input_ids=ids.to(_compat.input_device(model)))
    finally:
        for handle in handles:
            handle.remove()
    return f"decoder layer {found[0]} produced NaN/Inf" if found else "the final norm or head produced NaN/Inf"

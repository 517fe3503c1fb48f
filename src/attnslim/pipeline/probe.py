"""The probe of a layer-selecting step (methods/selecting.py: `probe_windows` > 0, NBL's criterion=probe): each
candidate converted alone, its cost measured as the increase of the calibration loss."""

from __future__ import annotations

from typing import Any

import torch
from tqdm import tqdm

from attnslim.adapters.base import Adapter
from attnslim.calib.residency import Residency
from attnslim.eval.perplexity import window_nll
from attnslim.methods.selecting import Selecting


def mean_nll(model: Any, ids: torch.Tensor, batch_size: int) -> float:
    """Mean next-token NLL of the windows ids (n, t) under the model as it is now."""
    device = next(model.parameters()).device
    parts = [window_nll(model, ids[s : s + batch_size].to(device)) for s in range(0, ids.shape[0], batch_size)]
    return sum(nll for nll, _ in parts) / sum(n for _, n in parts)


def probe(model: Any, adapter: Adapter, method: Selecting[Any], layers: list[int], stats: dict[int, Any],
          ids: torch.Tensor, batch_size: int, progress: bool, res: Residency) -> None:
    """A selection measured on the loss: each candidate converted alone (method.trial), the increase of the
    mean NLL over the probe windows recorded as stats[i].scores["probe"]. Runs inside `res.streamed()`, each
    trial inside `res.layer_in_stream(i)` (offloaded weights: the candidate is read in for its trial)."""
    base = mean_nll(model, ids, batch_size)
    for i in tqdm(layers, desc=f"{method.name} probe", disable=not progress, leave=False):
        with res.layer_in_stream(i), method.trial(adapter, i, stats[i]):
            stats[i].scores["probe"] = mean_nll(model, ids, batch_size) - base

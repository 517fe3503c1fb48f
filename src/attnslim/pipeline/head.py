"""The recipe's `head:` step, run by api.compress after every layer step (and before a heal): statistics of the
output head's input on the calibration windows (calib.runner.head_inputs into the pipeline's GramCollector), the
fit (methods/head.py), the untied factored head installed. Returns what compression.json records under "head"."""

from __future__ import annotations

from typing import Any

import torch

from attnslim.adapters.base import Adapter
from attnslim.calib.residency import Residency
from attnslim.calib.runner import HEAD_SITE, head_inputs
from attnslim.errors import AttnslimError
from attnslim.methods.collect import GramCollector
from attnslim.methods.head import (
    activation_loss,
    check_head,
    dense_head,
    head_factors,
    head_fit,
    install_head,
    plan_head,
)
from attnslim.settings import HeadConfig


def prepare_head(adapter: Adapter, head: dict[str, Any] | None, residency: Residency) -> HeadConfig | None:
    """The recipe's head section checked against the model before any work (None when the recipe has none)."""
    if head is None:
        return None
    if residency.offloaded:
        raise AttnslimError("head: the LM head is fitted in memory (--offload never loads it); compress without "
                            "--offload, or remove the recipe's head: section")
    config = HeadConfig.from_dict(head)
    check_head(adapter, config)
    return config


@torch.no_grad()
def run_head(model: Any, adapter: Adapter, config: HeadConfig, windows: torch.Tensor, batch_size: int,
             residency: Residency) -> dict[str, Any]:
    """Fit and install the head; the record: settings, plan (HeadEntry) and the fit's diagnostics."""
    fit = check_head(adapter, config)
    entry = plan_head(adapter, config, fit)
    collector = GramCollector({HEAD_SITE})
    tokens = head_inputs(model, adapter.output_head(), windows, batch_size, collector, residency)
    stats = collector.result()[HEAD_SITE]
    head = dense_head(adapter)
    weight, bias = head.weight.detach(), None if head.bias is None else head.bias.detach()
    factors = head_factors(weight, bias, stats, entry, fit)  # float64, where the statistics are
    loss = activation_loss(weight, factors, stats)
    install_head(adapter, factors)
    return {**config.to_dict(), "plan": entry.to_json(),
            "fit": {"tokens": tokens, "activation_loss": round(loss, 8), "params_delta": entry.params_delta}}



def check_head_section(head: dict[str, Any] | None) -> None:
    """The recipe's head section without the model (api.check_recipe): its settings and method, before loading."""
    if head is not None:
        head_fit(HeadConfig.from_dict(head))

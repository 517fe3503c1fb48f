"""Which layers tolerate a conversion: each candidate converted alone, measured without reading future tokens.

For every layer i the method's module replaces layer i's attention (nothing else changes), and the cost is

    KL_i = mean over windows w of KL( p_dense(· | w) ‖ p_i(· | w) )      at the last position of w only

— the next-token distribution the prompt-level evaluation reads (eval/choice.py). The last position, not a
teacher-forced loss over the window, because a non-causal replacement (ATP's paper layer) would see the
targets of every other position. The windows come from the calibration split, so a selection made from the
ranking never looks at evaluation text.

Lone costs do not add up (ATP's paper layer on SmolLM2: the sum of the lone costs is well below the cost of all
layers converted together), and converting the k cheapest layers keeps more accuracy than the last k, not all of
it. The figures and their commands: docs/methods/atp.md, "Which layers tolerate the conversion", and the archived
section "ATP: recovery of the paper's layer on all 30 layers (losses compared) and on the cheapest layers"
(docs/benchmarks-archive.md).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from attnslim import _compat
from attnslim.adapters import get_adapter
from attnslim.adapters.base import Adapter
from attnslim.data import check_draw, sequence_start, sequences_ending_at, token_ids
from attnslim.errors import AttnslimError
from attnslim.methods.base import Method
from attnslim.plan import LayerEntry


def calibration_prompts(tokenizer: Any, source: str, n: int, context: int, seed: int = 0) -> torch.Tensor:
    """(n, context) sequences at seeded random offsets of the calibration split of `source` (each starts with the
    tokenizer's BOS where it adds one, like the windows)."""
    ids = token_ids(source, "calib", tokenizer)
    if ids.numel() < context + 1:
        raise AttnslimError(f"the {source!r} calibration split has {ids.numel()} tokens; need > context={context}")
    check_draw(source, tokenizer, n, context, f"windows={n}")
    ends = torch.randint(0, ids.numel() - context, (n,), generator=torch.Generator().manual_seed(seed)) + context
    return sequences_ending_at(ids, ends.tolist(), context, sequence_start(tokenizer))


@torch.no_grad()
def last_log_probs(model: Any, prompts: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
    """(n, vocab) next-token log-probabilities at the last position of each prompt."""
    device = _compat.input_device(model)
    parts = [model(input_ids=prompts[s : s + batch_size].to(device), use_cache=False).logits[:, -1].float()
             for s in range(0, prompts.shape[0], batch_size)]
    return torch.cat(parts).log_softmax(-1).cpu()


def _checked_entries(adapter: Adapter, method: Method[Any, None], layers: list[int]) -> dict[int, LayerEntry]:
    """The method's plan entries for `layers` (its own checks apply, e.g. atp refuses sliding layers)."""
    if method.collector(adapter, layers[0]).sites:
        raise AttnslimError(f"conversion costs: method {method.name!r} needs calibration statistics to convert a "
                            "layer; this analysis supports statistics-free methods (e.g. atp)")
    return dict(method.plan(adapter, layers, {}).layers)


def _cost(model: Any, method: Method[Any, None], entries: dict[int, LayerEntry], group: list[int],
          prompts: torch.Tensor, reference: torch.Tensor, batch_size: int) -> float:
    """Last-position KL to `reference` with the layers of `group` converted together, then restored."""
    adapter = get_adapter(model)
    originals = {i: adapter.attention(i) for i in group}
    try:
        for i in group:
            method.convert(adapter, i, entries[i], None)
        got = last_log_probs(model, prompts, batch_size)
    finally:
        for i, module in originals.items():
            adapter.replace_attention(i, module)
    return float(F.kl_div(got, reference, log_target=True, reduction="batchmean"))


@torch.no_grad()
def conversion_costs(
    model: Any, method: Method, prompts: torch.Tensor, layers: list[int] | None = None, batch_size: int = 8,
    progress: bool = True,
) -> dict[int, float]:
    """{layer: KL_i} for each of `layers` (default all), each converted alone by `method` and then restored.

    `method` must build its modules without calibration statistics (atp does); one that collects statistics
    is refused with the reason.
    """
    adapter = get_adapter(model)
    layers = list(range(adapter.num_layers())) if layers is None else layers
    entries = _checked_entries(adapter, method, layers)
    reference = last_log_probs(model, prompts, batch_size)
    return {i: _cost(model, method, entries, [i], prompts, reference, batch_size)
            for i in tqdm(layers, desc=f"{method.name} cost per layer", disable=not progress, leave=False)}


@torch.no_grad()
def joint_cost(model: Any, method: Method, prompts: torch.Tensor, layers: list[int], batch_size: int = 8) -> float:
    """The same KL with all of `layers` converted at once (lone costs do not add up: compare their sum)."""
    entries = _checked_entries(get_adapter(model), method, layers)
    reference = last_log_probs(model, prompts, batch_size)
    return _cost(model, method, entries, layers, prompts, reference, batch_size)


def cheapest_layers(costs: dict[int, float], count: int) -> list[int]:
    """The `count` layers of lowest lone cost, sorted by index (a recipe's `layers:` list)."""
    if not 0 <= count <= len(costs):
        raise AttnslimError(f"count={count}: need 0..{len(costs)} (the layers measured)")
    return sorted(sorted(costs, key=lambda i: (costs[i], i))[:count])


def conversion_report(
    model: Any, tokenizer: Any, method: Method, source: str = "wiki", n: int = 32, context: int = 256,
    progress: bool = True, layers: list[int] | None = None,
) -> dict[str, Any]:
    """The per-layer costs of `method` on `n` calibration windows of `source` for `layers` (default all), with
    the ranking and the cost of all of them converted together."""
    prompts = calibration_prompts(tokenizer, source, n, context)
    costs = conversion_costs(model, method, prompts, layers=layers, progress=progress)
    return {"method": method.name, "args": method.args(), "source": source, "windows": n, "context": context,
            "costs": {str(i): c for i, c in costs.items()}, "order": sorted(costs, key=lambda i: (costs[i], i)),
            "all_layers": joint_cost(model, method, prompts, sorted(costs))}


def format_conversion(report: dict[str, Any]) -> str:
    """Text: cost per layer, then the cheapest 1/4, 1/3 and 1/2 of the layers as recipe selectors."""
    costs = {int(k): v for k, v in report["costs"].items()}
    lines = [f"{report['method']} {report['args']}: KL at the last position when one layer is converted alone "
             f"({report['windows']} × {report['context']}-token {report['source']} calibration windows)",
             "layer  KL (nats)"]
    lines += [f"{i:>5}  {costs[i]:.4f}" for i in sorted(costs)]
    n = len(costs)
    lines.append(f"all {n} measured layers converted together: {report['all_layers']:.4f} (the lone costs sum to "
                 f"{sum(costs.values()):.4f})")
    for label, k in (("1/4", n // 4), ("1/3", n // 3), ("1/2", n // 2)):
        lines.append(f"cheapest {label} ({k} layers): layers: {cheapest_layers(costs, k)}")
    return "\n".join(lines)

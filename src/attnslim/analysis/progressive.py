"""Progressive conversion: convert a few layers, recover with LoRA, re-rank the rest on the recovered model, repeat.

Converting every layer at once compounds the per-layer errors (analysis/conversion.py: the lone costs sum to far
less than all layers' together), and a short LoRA run cannot undo that much at once. Stages split the work: stage s
converts the layers of lowest *current* conversion cost until `counts[s]` layers are converted (the costs are
measured on the model as recovered by the earlier stages, since they change), then trains LoRA (train/lora.py)
against the original model (`teacher`), merged in place before the next stage.

Measured (benchmarks/atp.py --choice-progressive; the archived section "ATP: recovery of the paper's layer on all
30 layers (losses compared) and on the cheapest layers", rows "progressive"): on its budget the stages do not beat
converting every layer at once; docs/methods/atp.md, "Which layers tolerate the conversion", has the figures.

Resumable: stage s checkpoints to `out_dir/stage-{s}`; a rerun replays finished stages from their checkpoints
(zero training steps, the same merged weights) and continues the unfinished one. The ranking is deterministic
(fixed calibration windows), so a replay converts the same layers.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from attnslim.adapters import get_adapter
from attnslim.analysis.conversion import calibration_prompts, cheapest_layers, conversion_costs
from attnslim.errors import AttnslimError
from attnslim.methods.base import Method
from attnslim.train.lora import LoraRecipe, recover_with_lora


def check_counts(counts: list[int], num_layers: int) -> None:
    """Stage counts must grow strictly within 1..num_layers (each stage converts at least one more layer)."""
    if not counts or any(b <= a for a, b in zip(counts, counts[1:], strict=False)) or counts[0] < 1 \
            or counts[-1] > num_layers:
        raise AttnslimError(f"progressive stages {counts}: need strictly increasing layer counts in 1..{num_layers} "
                            f"(e.g. [15, 22, {num_layers}])")


def progressive_recovery(
    model: Any, tokenizer: Any, method: Method, counts: list[int], recipe: LoraRecipe, teacher: Any,
    out_dir: str | Path, windows: int = 32, progress: bool = True,
    after_stage: Callable[[int, dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Convert `model` in stages of `counts` converted layers, each followed by `recipe`'s LoRA recovery against
    `teacher` (the original model); the model is changed in place. Returns one log per stage: the layers it
    converted, the lone costs they were ranked by (none when a stage takes every remaining layer) and the LoRA
    log. `after_stage(s, log)` runs after each stage (e.g. an evaluation)."""
    adapter = get_adapter(model)
    check_counts(counts, adapter.num_layers())
    dense_type = type(get_adapter(teacher).attention(0))
    if any(type(adapter.attention(i)) is not dense_type for i in range(adapter.num_layers())):
        raise AttnslimError("progressive_recovery: the model already has converted layers; start from the original")
    prompts = calibration_prompts(tokenizer, recipe.source, n=windows, context=recipe.context)
    converted: list[int] = []
    logs: list[dict[str, Any]] = []
    for s, count in enumerate(counts):
        remaining = [i for i in range(adapter.num_layers()) if i not in converted]
        if count == adapter.num_layers():  # every remaining layer is taken: no ranking needed
            costs, new = {}, remaining
        else:
            costs = conversion_costs(model, method, prompts, layers=remaining, progress=progress)
            new = cheapest_layers(costs, count - len(converted))
        entries = method.plan(adapter, new, {}).layers
        for i in new:
            method.convert(adapter, i, entries[i], None)
        converted = sorted(converted + new)
        _, lora = recover_with_lora(model, tokenizer, recipe, Path(out_dir) / f"stage-{s}", progress=progress,
                                    teacher=teacher, converted=converted)
        log = {"stage": s, "new_layers": new, "layers": converted,
               "costs": {str(i): costs[i] for i in new if i in costs}, "lora": lora}
        logs.append(log)
        if after_stage is not None:
            after_stage(s, log)
    return logs

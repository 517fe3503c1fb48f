"""How much memory a compression needs, and what memory decides: `--offload` when the model would not fit, a lean
heal (bfloat16 teacher, activation checkpointing) when only that fits. Sizes come from a meta-device skeleton, so
nothing here reads weights."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from attnslim.methods import Method
from attnslim.recipe import Recipe
from attnslim.settings import HealConfig


def offload_reason(size: int, recipe: Recipe, methods: list[Method], dtype: torch.dtype) -> str | None:
    """Why a model of `size` bytes (its parameters in `dtype`, counted on a meta-device skeleton: no weights read)
    should be compressed with --offload (it would not fit in memory), or None. A recipe that trains (`methods`:
    its checked steps) also holds a teacher copy (half a copy for a heal with a bfloat16 teacher)."""
    from attnslim.offload import memory_available

    need, free = int(size * _copies(recipe, methods) * 1.2), memory_available()
    if need <= free:
        return None
    return (f"the model needs about {need / 2**30:.1f} GiB in {str(dtype).removeprefix('torch.')} and "
            f"{free / 2**30:.1f} GiB of memory is available: compressing with --offload (one decoder layer in "
            "memory at a time, weights read from disk)")


def lean_heal(size: int, recipe: Recipe, methods: list[Method]) -> tuple[Recipe, str] | None:
    """(the recipe with its heal's memory settings on, the reason) when the heal of a model of `size` bytes would
    not fit in memory with a float32 teacher but fits with a bfloat16 teacher and activation checkpointing
    (train/heal.py), else None.

    Decision: as with --offload, memory picks the setting and says so, rather than refusing (an offloaded
    compression cannot heal at all). Only a heal left at the float32 defaults is changed; the settings used are
    the recipe compression.json records."""
    from attnslim.offload import memory_available

    if recipe.heal is None or HealConfig.from_dict(recipe.heal) != HealConfig.from_dict(
            {**recipe.heal, "teacher_dtype": "float32", "checkpoint": False}):
        return None
    free = memory_available()
    lean = replace(recipe, heal={**recipe.heal, "teacher_dtype": "bfloat16", "checkpoint": True})
    full, need = int(size * _copies(recipe, methods) * 1.2), int(size * _copies(lean, methods) * 1.2)
    if full <= free or need > free:
        return None
    return lean, (f"the heal needs about {full / 2**30:.1f} GiB with a float32 teacher and {free / 2**30:.1f} GiB "
                  f"is available: healing with a bfloat16 teacher and activation checkpointing (about "
                  f"{need / 2**30:.1f} GiB; heal.teacher_dtype, heal.checkpoint)")


def _copies(recipe: Recipe, methods: list[Method]) -> float:
    """Model copies a compression holds: the model, plus a teacher when a step trains (float32) or the recipe heals
    (half a copy with a bfloat16 teacher)."""
    if any(m.trains for m in methods):
        return 2.0
    if recipe.heal is None:
        return 1.0
    return 1.5 if HealConfig.from_dict(recipe.heal).teacher_dtype == "bfloat16" else 2.0


def model_bytes(model: Any) -> int:
    """Bytes of the model's parameters (tied ones once) in their dtype; works on a meta-device skeleton."""
    return sum(p.numel() * p.element_size() for p in model.parameters())

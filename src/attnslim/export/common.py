"""What the exporters share: a module's weight as an independent copy, a short list of layers for an error, and
the safetensors writer (huggingface_hub's, sharded at 5 GB as transformers writes checkpoints)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from attnslim.errors import AttnslimError


def span(items: list[int] | list[str], unit: str = "layers", limit: int = 8) -> str:
    """The first `limit` items, comma-separated, and how many there are when that is not all."""
    shown = ", ".join(map(str, items[:limit]))
    return shown if len(items) <= limit else f"{shown}, ... ({len(items)} {unit})"


def weight(module: nn.Module, name: str = "weight") -> torch.Tensor:
    """A detached copy of module.<name> (no storage shared with the source or another entry)."""
    tensor = getattr(module, name, None)
    if not isinstance(tensor, torch.Tensor):
        raise AttnslimError(f"{type(module).__name__} has no {name} tensor to export")
    return tensor.detach().clone()


def write_weights(state: dict[str, torch.Tensor], directory: Path) -> None:
    from huggingface_hub import save_torch_state_dict

    save_torch_state_dict({k: v.contiguous() for k, v in state.items()}, directory, max_shard_size="5GB")

"""Architecture adapters, one per family, chosen by `config.model_type`."""

from __future__ import annotations

from torch import nn

from attnslim.adapters import gemma3, llama, opt, qwen3  # noqa: F401  (importing registers each adapter)
from attnslim.adapters.base import Adapter, AttentionSpec, MLPSpec, RopeSpec
from attnslim.errors import AttnslimError
from attnslim.registry import ADAPTERS


def get_adapter(model: nn.Module) -> Adapter:
    model_type = getattr(model.config, "model_type", None)
    cls = ADAPTERS.get(str(model_type))
    if cls is None:
        raise AttnslimError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(ADAPTERS))}. "
            "Add an adapter in attnslim/adapters/ to support a new family."
        )
    return cls(model)


__all__ = ["Adapter", "AttentionSpec", "MLPSpec", "RopeSpec", "get_adapter"]

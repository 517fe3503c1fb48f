"""Architecture adapters, one per family, chosen by `config.model_type`."""

from __future__ import annotations

from torch import nn

from attnslim.adapters import gemma3, llama, opt, phi3, qwen3  # noqa: F401  (importing registers each adapter)
from attnslim.adapters.base import Adapter, AttentionSpec, MLPSpec, RopeSpec
from attnslim.errors import AttnslimError
from attnslim.registry import ADAPTERS

# names under which Hugging Face families fuse projections into one linear (GPT-NeoX, GPT-2, MPT; Phi-3's adapter
# splits its own: adapters/phi3.py)
_FUSED_LINEARS = ("qkv_proj", "gate_up_proj", "query_key_value", "c_attn", "Wqkv")


def get_adapter(model: nn.Module) -> Adapter:
    model_type = getattr(model.config, "model_type", None)
    cls = ADAPTERS.get(str(model_type))
    if cls is None:
        fused = sorted({name.rpartition(".")[2] for name, _ in model.named_modules()} & set(_FUSED_LINEARS))
        why = (f" Its layers fuse projections into one linear ({', '.join(fused)}), and the adapter contract has "
               "separate q/k/v/o and gate/up/down linears: such a family's adapter splits its fused linears into "
               "those (adapters/fused.py's SplitLinear, as adapters/phi3.py does)." if fused else "")
        raise AttnslimError(
            f"unsupported model_type {model_type!r} ({type(model).__name__}); supported: "
            f"{', '.join(sorted(ADAPTERS))}.{why} To add a family, follow docs/DESIGN.md, 'Checklist: add a model "
            "family' (an adapter in attnslim/adapters/, a tiny config in tests/conftest.py, rows in "
            "tests/test_matrix.py)."
        )
    return cls(model)


__all__ = ["Adapter", "AttentionSpec", "MLPSpec", "RopeSpec", "get_adapter"]

"""`SplitLinear`: a family's fused projection (Phi-3's `qkv_proj`, `gate_up_proj`) held as its canonical linears.

Why split at all: every method addresses canonical linears (`adapter.linear(i, "q")`, "gate", ...), replaces them one
at a time (`replace_linear`) and hooks each one's input. A fused linear has no such parts; splitting it into
children named by their canonical names (q, k, v / gate, up) gives each a place without teaching any method about
fusion. The forward concatenates the children's outputs in the fused row order, so the module the family's own
forward calls (`self.qkv_proj(x)`, then sliced) computes what the fused linear did: no replacement of HF's
attention or MLP forward is needed.

Fused back on save: the state dict of a SplitLinear whose children are all plain `nn.Linear` holds the fused
`weight` (and `bias`) exactly as the family's checkpoint names them, so `save_pretrained` of a split but
otherwise unreplaced model is a stock checkpoint plain transformers loads, and attnslim's own save writes the fused
tensor for every projection no method replaced. Loading splits a fused `weight` back into the children
(a load_state_dict pre-hook); a child a method replaced (LowRankLinear, ...) keeps the split keys both ways.
Cost: one concatenation of the parts' outputs per call, instead of one GEMM writing them in place.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from attnslim.errors import AttnslimError
from attnslim.registry import register_module

_FUSED_KEYS = ("weight", "bias")


@register_module
class SplitLinear(nn.Module):
    """y = cat([part(x) for part in parts], -1): the fused linear's rows, part by part, in order."""

    def __init__(self, parts: dict[str, nn.Module]) -> None:
        super().__init__()
        for name, part in parts.items():
            self.add_module(name, part)
        self.register_state_dict_post_hook(_fuse_state)
        self.register_load_state_dict_pre_hook(_split_state)

    @classmethod
    def of(cls, fused: nn.Linear, widths: dict[str, int]) -> SplitLinear:
        """`fused` (out = sum(widths), in) split by rows into one nn.Linear per name, in the order of `widths`.
        Copies: the parts own their storage (safetensors refuses tensors that share it), on fused's device/dtype."""
        cls.check(fused, widths)
        parts: dict[str, nn.Module] = {}
        start = 0
        for name, width in widths.items():
            part = nn.Linear(fused.in_features, width, bias=fused.bias is not None, device=fused.weight.device,
                             dtype=fused.weight.dtype)
            with torch.no_grad():
                part.weight = nn.Parameter(fused.weight[start:start + width].clone(), fused.weight.requires_grad)
                if fused.bias is not None:
                    part.bias = nn.Parameter(fused.bias[start:start + width].clone(), fused.bias.requires_grad)
            parts[name] = part
            start += width
        return cls(parts)

    @staticmethod
    def check(fused: nn.Linear, widths: dict[str, int]) -> None:
        """Refuse a fused linear whose rows are not the parts' widths (from the config) before anything is split."""
        if sum(widths.values()) != fused.out_features:
            raise AttnslimError(f"the fused linear has {fused.out_features} rows but config.json's sizes give {widths} "
                                f"(sum {sum(widths.values())}); the checkpoint does not match its config")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.children()], dim=-1)  # (..., sum of the parts' widths)

    def fusable(self) -> bool:
        """Every part a plain linear with the same bias-ness: the state dict then holds the fused tensors."""
        parts = list(self.children())
        return (all(isinstance(p, nn.Linear) for p in parts)
                and len({getattr(p, "bias", None) is None for p in parts}) == 1)

    def widths(self) -> dict[str, int]:
        """Rows of each plain-linear part, in order (all parts when `fusable()`)."""
        return {name: part.out_features for name, part in self.named_children() if isinstance(part, nn.Linear)}


def _fuse_state(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: dict[str, Any]) -> None:
    """state_dict post-hook: the parts' `NAME.weight`/`NAME.bias` replaced by the fused `weight`/`bias`."""
    assert isinstance(module, SplitLinear)
    if not module.fusable():
        return
    names = [name for name, _ in module.named_children()]
    for key in _FUSED_KEYS:
        keys = [f"{prefix}{name}.{key}" for name in names]
        if all(k in state for k in keys):
            with torch.no_grad():
                state[f"{prefix}{key}"] = torch.cat([state.pop(k) for k in keys], dim=0)  # (sum out, in) / (sum out,)


def _split_state(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
                 strict: bool, missing: list[str], unexpected: list[str], errors: list[str]) -> None:
    """load_state_dict pre-hook: a fused `weight`/`bias` (a stock checkpoint's) split into the parts' keys. A fused
    tensor of the wrong height, or one meeting a replaced part, is left for load_state_dict to report."""
    assert isinstance(module, SplitLinear)
    widths = module.widths() if module.fusable() else {}
    for key in _FUSED_KEYS:
        fused = state.get(f"{prefix}{key}")
        if fused is None or not widths or fused.shape[0] != sum(widths.values()):
            continue
        del state[f"{prefix}{key}"]
        for (name, _), piece in zip(widths.items(), fused.split(list(widths.values()), dim=0), strict=True):
            state[f"{prefix}{name}.{key}"] = piece

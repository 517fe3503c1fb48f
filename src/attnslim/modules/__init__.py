"""Replacement nn.Modules (registered by class name: the load allowlist)."""

from attnslim.modules.dropped import DroppedAttention
from attnslim.modules.lowrank import LowRankLinear

__all__ = ["DroppedAttention", "LowRankLinear"]

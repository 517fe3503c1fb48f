"""Replacement nn.Modules (registered by class name: the load allowlist)."""

from attnslim.modules import principal, principal_serving  # noqa: F401
from attnslim.modules.block_lowrank import BlockLowRankLinear
from attnslim.modules.dropped import DroppedAttention
from attnslim.modules.joint_qkv import JointQKVAttention
from attnslim.modules.latent import LatentAttention
from attnslim.modules.linearized import LinearizedAttention
from attnslim.modules.lowrank import LowRankLinear
from attnslim.modules.mla import MLAAttention
from attnslim.modules.shared import DonorAttention, SharedAttention
from attnslim.registry import MODULES

__all__ = [
    "BlockLowRankLinear", "DonorAttention", "DroppedAttention", "JointQKVAttention", "LatentAttention",
    "LinearizedAttention", "LowRankLinear", "MLAAttention",
    "SharedAttention", "MODULES",
]

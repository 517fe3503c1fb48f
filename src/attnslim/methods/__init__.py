"""Compression methods (registered by name on import; the list below is explicit)."""

from attnslim.methods import drop, lowrank_baselines  # noqa: F401

"""Compression methods (registered by name on import; the list below is explicit)."""

from attnslim.methods import atp, drop, latentllm, lisa, lowrank_baselines, mla, nbl  # noqa: F401

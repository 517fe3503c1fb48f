"""Compression methods (registered by name on import; the list below is explicit)."""

from attnslim.methods import atp, drop, latentllm, lisa, lowrank_baselines, mla, nbl, transmla  # noqa: F401
from attnslim.methods.base import Method
from attnslim.registry import METHODS, lookup


def lookup_method(name: str) -> type[Method]:
    """The method class registered as `name` (every method module is imported above), or a clear error."""
    cls: type[Method] = lookup(METHODS, "method", name)
    return cls


__all__ = ["METHODS", "Method", "lookup_method"]

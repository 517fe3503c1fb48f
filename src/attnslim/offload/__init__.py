"""Compression of models larger than memory: weights stay in safetensors files, one decoder layer at a time."""

from attnslim.offload.compute import check_free_disk, memory_available, resolve_device
from attnslim.offload.shards import record_shards, verify_shards
from attnslim.offload.source import WeightSource
from attnslim.offload.store import OffloadedLayers

__all__ = ["OffloadedLayers", "WeightSource", "check_free_disk", "memory_available", "record_shards",
           "resolve_device", "verify_shards"]

"""Speed, memory and cache measurements, always as ratios against the dense model in one run."""

from attnslim.bench.kv import kv_bytes_per_token

__all__ = ["kv_bytes_per_token"]

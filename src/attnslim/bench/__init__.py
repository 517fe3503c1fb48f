"""Speed, memory and cache measurements, always as ratios against the dense model in one run."""

from attnslim.bench.kv import kv_bytes_per_token
from attnslim.bench.speed import interleaved, time_prefill_decode

__all__ = ["interleaved", "kv_bytes_per_token", "time_prefill_decode"]

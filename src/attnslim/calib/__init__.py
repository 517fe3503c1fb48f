"""Calibration: hooks (context managers), the layer-by-layer runner, streaming statistics."""

from attnslim.calib.hooks import SITES, capture_sites
from attnslim.calib.runner import LayerRunner
from attnslim.calib.stats import InputStats, flatten_tokens

__all__ = ["SITES", "InputStats", "LayerRunner", "capture_sites", "flatten_tokens"]

"""Calibration: hooks (context managers), the layer-by-layer runner. The statistics they fill (InputStats) are
plain tensor math and live in linalg/stats.py, below calibration."""

from attnslim.calib.hooks import SITES, capture_sites
from attnslim.calib.runner import LayerRunner

__all__ = ["SITES", "LayerRunner", "capture_sites"]

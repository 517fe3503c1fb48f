"""Analyses of a model's attention (cross-layer similarity, sensitivity), reported as dicts + text."""

from attnslim.analysis.similarity import (
    format_sensitivity,
    format_similarity,
    sensitivity_report,
    similarity_report,
)

__all__ = ["format_sensitivity", "format_similarity", "sensitivity_report", "similarity_report"]

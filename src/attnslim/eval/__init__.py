"""Evaluation: perplexity (and, later, zero-shot tasks)."""

from attnslim.eval.perplexity import PerplexityResult, perplexity, window_nll

__all__ = ["PerplexityResult", "perplexity", "window_nll"]

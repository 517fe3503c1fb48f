"""How many calibration tokens a least-squares fit of a linear needs (the pipeline's output refit, pipeline/refit.py).

Here, below methods/, so that a method can state its calibration need (`Method.calibration_need`, mla's refit_o)
from the same rule the refit enforces.
"""

from __future__ import annotations

# calibration tokens the refit needs per input dimension of the refitted linear (its weight row plus the bias).
# With too few the fit overfits: its in-sample error falls while held-out perplexity rises above the unrefitted
# model's (seen in exploratory runs on SmolLM2-135M with a quarter and a half of the recipes' calibration; the
# recipes' 32 windows of 512 tokens give 28 per dimension of its o_proj). The real test in tests/test_output_refit.py
# checks the gain at the recipes' calibration.
MIN_TOKENS_PER_DIM = 24


def refit_tokens(in_features: int) -> int:
    """The fewest calibration tokens a refit of a linear with `in_features` inputs (plus its bias) needs."""
    return MIN_TOKENS_PER_DIM * (in_features + 1)

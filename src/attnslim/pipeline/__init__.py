"""The pipeline: runs one method step over a model (run.py), with its stages: the output refit (refit.py) and the
local fit (local_fit.py) after each conversion, and the probe of a selection measured on the loss (probe.py)."""

from attnslim.pipeline.local_fit import fit_locally
from attnslim.pipeline.refit import refit_output
from attnslim.pipeline.run import AnyMethod, convert_and_fit, run_step

__all__ = ["AnyMethod", "convert_and_fit", "fit_locally", "refit_output", "run_step"]

"""The pipeline's fits after each conversion, as options of any method whose conversion installs a module with an
output linear (`OutputFits`, a mixin of the method's dataclass).

    refit_o: bool       after a layer's conversion, the pipeline refits `output_linear` by least squares to the
                        original attention's output on the same calibration inputs (pipeline/refit.py)
    local_steps: int    then trains every parameter of the installed attention towards that output for this many
                        Adam steps, keeping the best held-out iterate (pipeline/local_fit.py); 0: off
    local_lr: float     its step size, relative to each tensor's RMS

Why a capability and not method code: both fits match the converted attention to the original one on the layer's
calibration inputs whatever the conversion was, so the pipeline owns them (sequential steps only: they need the
layer's inputs) and a method only says which linear is its output projection. A mixer declares the three fields
itself (so its dataclass keeps its field order and `later_args`), calls `check_output_fits` in `__post_init__`,
and names its output linear and the refit's ridge. Today `mla` mixes it in. A method that installs a new attention
module can; latentllm and the low-rank baselines replace linears inside the original attention module, so the
fits' reference (the module before `convert`) would be the converted one: they would need the pipeline to keep a
dense copy of the layer's attention first, and a factorised o_proj (LowRankLinear) is no nn.Linear to refit.
"""

from __future__ import annotations

from torch import nn

from attnslim.adapters.base import Adapter
from attnslim.calib.tokens import MIN_TOKENS_PER_DIM, refit_tokens
from attnslim.methods.base import CalibrationNeed, require


class OutputFits:
    """Mixin for a `Method` dataclass that declares `refit_o`, `local_steps` and `local_lr` (see the module)."""

    name: str
    refit_o: bool
    local_steps: int
    local_lr: float

    def output_linear(self, adapter: Adapter, layer: int) -> nn.Linear:
        """After `convert(layer)`: the installed attention's output projection (what the refit fits)."""
        raise NotImplementedError

    def refit_ridge(self) -> float:
        """The refit's ridge, relative to the mean eigenvalue of its input covariance (linalg/cca.lmmse_map)."""
        raise NotImplementedError

    def check_output_fits(self) -> None:
        require(isinstance(self.refit_o, bool), self.name, "refit_o", self.refit_o, "true | false")
        require(self.local_steps >= 0, self.name, "local_steps", self.local_steps, "an integer >= 0 (0: no local fit)")
        require(self.local_lr > 0, self.name, "local_lr", self.local_lr, "a number > 0")

    def calibration_need(self, adapter: Adapter) -> CalibrationNeed | None:
        """refit_o: the refit's token rule on the widest dense o_proj input (an output linear that keeps the dense
        one's n_heads x head_dim inputs, as mla's: 36,888 tokens on a hidden size of 1536 against 13,848 on SmolLM2's
        576)."""
        linears = [adapter.linear(i, "o") for i in range(adapter.num_layers())]
        widths = [m.in_features for m in linears if isinstance(m, nn.Linear)]  # else the refit's own guard decides
        if not self.refit_o or not widths:
            return None
        width = max(widths)
        return CalibrationNeed(refit_tokens(width), f"its output refit of o_proj ({MIN_TOKENS_PER_DIM} tokens per "
                                                    f"input dimension, {width} + 1 inputs)")

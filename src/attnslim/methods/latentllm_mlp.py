"""`latentllm`'s MLP step (mlp=local | joint_ud): the factors of gate/up/down, fitted, not installed.

  local     each linear by activation-aware SVD on its own input statistics (gate/up: the MLP input, down: the
            down input), with the step's pre-conditioner and junction (the `local` callable).
  joint_ud  SparseLLM-style alternating up/down fit on a token sample of the MLP input (§4.3, App. H;
            linalg/joint_ud). Exact for ReLU; gated MLPs (SwiGLU, GeGLU) take safeguarded Gauss-Newton steps for
            the gate pre-activation. Un-gated activations other than ReLU are refused (no closed-form z update).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from attnslim.adapters.base import MLPSpec
from attnslim.errors import AttnslimError
from attnslim.linalg.joint_ud import MLPWeights, UDOptions, joint_ud
from attnslim.linalg.lowrank import FitOptions, Gauge, LowRankFactors
from attnslim.linalg.stats import InputStats
from attnslim.methods.latentllm_ranks import MLP
from attnslim.methods.latentllm_stats import LayerStats

SITE = {"gate": "mlp_in", "up": "mlp_in", "down": "down_in"}  # the statistics each linear is fitted on
# HF activation name -> joint_ud's name; un-gated MLPs need ReLU (closed-form z update)
UD_ACTIVATIONS = {"relu": "relu", "silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                  "gelu_new": "gelu_tanh"}

Local = Callable[[torch.Tensor, torch.Tensor | None, InputStats, int, str], LowRankFactors]  # (w, b, stats, r, label)


def check_ud_activation(spec: MLPSpec, layer: int) -> None:
    """Refuse, before any work, an activation joint_ud has no update for."""
    act, gated = UD_ACTIVATIONS.get(spec.activation), spec.gate is not None
    if act is None or (not gated and act != "relu"):
        valid = sorted(UD_ACTIVATIONS) if gated else ["relu"]
        raise AttnslimError(
            f"latentllm: layer {layer}: mlp=joint_ud does not support the {'gated' if gated else 'un-gated'} "
            f"activation {spec.activation!r} (valid: {valid}); it has no closed-form update. Use mlp: local"
        )


def fit_local(spec: MLPSpec, stats: LayerStats, ranks: dict[str, int], layer: int, local: Local
              ) -> dict[str, LowRankFactors]:
    """mlp=local: each present linear on its own input statistics."""
    return {n: local(w, getattr(spec, f"{n}_bias"), stats.site(SITE[n], layer), ranks[n], f"layer {layer} {n}")
            for n in MLP if (w := getattr(spec, n)) is not None}


def fit_joint_ud(spec: MLPSpec, stats: LayerStats, ranks: dict[str, int], layer: int, *, n_iter: int, damp: float,
                 junction: str, keep_best: bool, gauge: Gauge | None) -> tuple[dict[str, LowRankFactors],
                                                                              dict[str, Any]]:
    """mlp=joint_ud on the layer's MLP-input token sample; returns the factors (re-gauged by `gauge` when given:
    the junction only re-gauges B A, so it pivots once, on the factors kept, not on every iterate) and the fit
    diagnostics."""
    if stats.tokens is None:
        raise AttnslimError(f"latentllm: layer {layer}: mlp=joint_ud has no MLP-input token sample (the "
                            "collector keeps one when ud_tokens > 0); set ud_tokens >= 1")
    mlp = MLPWeights(spec.up, spec.down, spec.up_bias, spec.down_bias, spec.gate, spec.gate_bias,
                     UD_ACTIVATIONS[spec.activation])
    res = joint_ud(stats.tokens, mlp, ranks["up"], ranks["down"], ranks.get("gate"),
                   options=FitOptions(n_iter, damp, junction, f"layer {layer} mlp"),
                   ud=UDOptions(keep_best=keep_best, dtype=torch.float32))
    chosen = {"up": res.up, "down": res.down, **({"gate": res.gate} if res.gate is not None else {})}
    factors = {n: gauge(f.B, f.A, f.bias) if gauge is not None else f for n, f in chosen.items()}
    info = {"ud_tokens": int(stats.tokens.shape[0]), "ud_output_error": [round(e, 6) for e in res.output_error]}
    return factors, info

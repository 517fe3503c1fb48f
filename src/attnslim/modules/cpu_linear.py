"""Float32 linear layers through torch's bundled oneDNN on the CPU (`set_cpu_linear(model, "onednn")`).

Why: torch's x86 wheels run float32 GEMMs on MKL, which picks its vectorised kernels by CPU vendor: on AMD CPUs it
runs generic code, so the weight GEMMs that dominate a decode step run slower than the CPU allows
(docs/cpu-speed.md, "CPU speed"; benchmarks/with_mkl_intel_paths.sh shows the cause). oneDNN, bundled in the same wheel,
picks its kernels by the instruction sets the CPU reports. This switches the weight GEMMs of inference to it:
  - every plain `nn.Linear` of the model (attention projections, MLP, lm_head), by swapping its class for
    `OneDNNLinear` (same parameters, same state dict, hooks kept);
  - attnslim modules that apply their own weights (`LowRankLinear`, MLA's fused decode projection), through their
    `linear_kernel` attribute.
Values are F.linear's up to float rounding (another summation order; tested). A call that needs a gradient, a
dtype other than float32 (left to torch's own dispatch), another device or a strided weight (oneDNN would reorder
it at every call) goes through F.linear: the kernel is chosen per call, the values are the same.
Dense and compressed models gain alike, so speed comparisons switch both (`attnslim bench --cpu-linear`,
benchmarks/mla.py --cpu-linear). Measured: BENCHMARKS "MLA: whole-model decode with every linear layer on oneDNN"
beside "MLA: whole-model decode with the split and the grouped decode core" (stock, the same hour).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from attnslim import host
from attnslim.errors import AttnslimError

KERNELS = ("torch", "onednn")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str) -> torch.Tensor:
    """F.linear(x, weight, bias) (x (..., d_in), weight (d_out, d_in)) on `kernel` where it applies (see the module
    docstring), else on F.linear."""
    if kernel == "onednn" and _applies(x, weight, bias):
        return host.onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False  # inference only: training keeps autograd's own linear
    return (x.device.type == "cpu" and all(t.dtype == torch.float32 and t.device == x.device for t in tensors)
            and weight.is_contiguous() and (bias is None or bias.is_contiguous()))


class OneDNNLinear(nn.Linear):
    """nn.Linear whose inference forward runs on oneDNN (`set_cpu_linear` swaps classes; no other state)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, "onednn")


def set_cpu_linear(model: nn.Module, kernel: str) -> int:
    """Run the model's linear layers on `kernel` ("onednn", or "torch": back to F.linear); returns how many modules
    were switched. Refused where oneDNN cannot run: a torch build without it, or a model not on the CPU."""
    if kernel not in KERNELS:
        raise AttnslimError(f"cpu linear kernel {kernel!r} is unknown; valid: {', '.join(KERNELS)}")
    if kernel == "onednn":
        if not host.onednn_linear_available():
            raise AttnslimError("cpu linear kernel 'onednn': this torch build has no oneDNN linear op "
                                "(torch.ops.mkldnn._linear_pointwise); use 'torch'")
        devices = {p.device.type for p in model.parameters()}
        if devices - {"cpu"}:
            raise AttnslimError(f"cpu linear kernel 'onednn' runs on the CPU; the model has weights on "
                                f"{', '.join(sorted(devices))}: move it to the CPU or use 'torch'")
    switched = 0
    for module in model.modules():
        if type(module) in (nn.Linear, OneDNNLinear):
            module.__class__ = OneDNNLinear if kernel == "onednn" else nn.Linear
            switched += 1
        elif isinstance(getattr(module, "linear_kernel", None), str):
            cast(Any, module).linear_kernel = kernel  # a plain attribute (LowRankLinear, MLAAttention)
            switched += 1
    return switched


def cpu_linear_of(model: nn.Module) -> str:
    """The kernel `set_cpu_linear` last gave the model's plain linear layers ("torch" where it has none)."""
    return "onednn" if any(type(m) is OneDNNLinear for m in model.modules()) else "torch"

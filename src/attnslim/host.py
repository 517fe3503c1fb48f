"""What this torch build and this host offer the kernels: the BLAS torch calls, the CPU's vendor, and oneDNN's linear
(the one private torch op attnslim calls). Imports torch only, so linalg/ and modules/ choose their kernels for the
machine without importing transformers (_compat.py is the transformers-version layer).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

# torch's bundled oneDNN linear: a private op of torch's oneDNN integration, schema (input, weight, bias, attr,
# scalars, algorithm); absent from builds without oneDNN
_ONEDNN_LINEAR = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN's linear op (modules/cpu_linear.py)."""
    return _ONEDNN_LINEAR is not None and torch.backends.mkldnn.is_available()


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) through oneDNN: x (..., d_in), weight (d_out, d_in) contiguous -> (..., d_out)."""
    assert _ONEDNN_LINEAR is not None, "check onednn_linear_available() first"
    return _ONEDNN_LINEAR(x, weight, bias, "none", [], "")


def native_bf16(device: torch.device) -> bool:
    """Whether `device` multiplies bfloat16 matrices natively: a CUDA GPU that supports it, or a CPU with AVX512-BF16
    or AMX (oneDNN's bfloat16 GEMMs); elsewhere bfloat16 is emulated and slower than float32."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return torch.backends.mkldnn.is_available() and (
            torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return False


def blas_name() -> str:
    """The BLAS this torch build calls for float32 GEMMs (its BLAS_INFO: "mkl" in the x86 wheels), or "unknown"."""
    return next((part.split("=", 1)[1] for part in torch.__config__.show().replace(",", " ").split()
                 if part.startswith("BLAS_INFO=")), "unknown")


def cpu_info(field: str) -> str:
    """A field of /proc/cpuinfo's first processor ("vendor_id", "model name"; '' where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.lru_cache(maxsize=1)
def mkl_runs_generic_code() -> bool:
    """Whether torch's float32 GEMMs run MKL's generic code: MKL picks its vectorised kernels by CPU vendor, so on
    an x86 CPU that is not Intel's (AMD) it runs generic ones (BENCHMARKS "MLA: decode core kernels", beside the
    same host with MKL's Intel paths forced by benchmarks/with_mkl_intel_paths.sh)."""
    vendor = cpu_info("vendor_id")
    return blas_name() == "mkl" and bool(vendor) and vendor != "GenuineIntel"

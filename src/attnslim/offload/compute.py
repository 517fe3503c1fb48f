"""Compute device and dtype of a compression, and the memory and disk checks made before any work."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from attnslim.errors import AttnslimError, first_line

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise AttnslimError(f"--dtype {name!r} is not supported; valid: {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_device(name: str) -> torch.device:
    """`cpu`, `cuda` or `cuda:N`, checked against what this machine has."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise AttnslimError(f"--device {name!r} is not a device; valid: cpu, cuda, cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise AttnslimError(f"--device {name!r}: only cpu and cuda are supported")
    if not torch.cuda.is_available():
        raise AttnslimError(f"--device {name}: no CUDA GPU is available here (torch {torch.__version__} sees none); "
                            "use --device cpu")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise AttnslimError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def check_dtype(device: torch.device, dtype: torch.dtype) -> None:
    """A dtype the device cannot compute in is an error now, not a crash in the middle of layer 17."""
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise AttnslimError(f"--dtype bfloat16: {torch.cuda.get_device_name(device)} cannot compute in bfloat16; "
                            "use --dtype float16 or float32")
    try:
        a = torch.ones(8, 8, dtype=dtype, device=device)
        torch.nn.functional.linear(a, a).sum().item()
    except RuntimeError as err:
        raise AttnslimError(f"--dtype {str(dtype).removeprefix('torch.')} cannot run on {device} "
                            f"({first_line(err, 200)}); use --dtype float32") from err


def compute_target(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """The (device, dtype) of --device and --dtype, each checked, and checked to compute together."""
    placed, torch_dtype = resolve_device(device), parse_dtype(dtype)
    check_dtype(placed, torch_dtype)
    return placed, torch_dtype


def memory_available() -> int:
    """Bytes of memory this process could still use without swapping (MemAvailable on Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def check_free_disk(target: Path, need: int) -> None:
    """Refuse before any work when the disk under `target` lacks `need` bytes for the output."""
    parent = target
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    free = shutil.disk_usage(parent).free
    if free < need:
        raise AttnslimError(f"{target}: the output needs up to {need / 2**30:.1f} GiB and the disk holding {parent} "
                            f"has {free / 2**30:.1f} GiB free; free space or choose another --out")

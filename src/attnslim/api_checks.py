"""The public API's boundary: its arguments checked where they enter, and `save` / `load` / `load_model` as the
package exports them.

A wrong type is a TypeError naming the function, the argument, what it got and what to pass; a wrong value (a
device this machine does not have, a report `load` would refuse) is an AttnslimError. Without these checks such
arguments failed deep inside (an AttributeError in the middle of `compress`), or worse, silently: `load(...,
device="cuda")` ignored the device and `save(..., {})` wrote a directory `load` refuses (reliability round 3,
p05-p07, p19-p25, p28, p31, p39). The CLI and the internal callers pass checked values and call attnslim.io and
attnslim.models directly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from attnslim.disk_format import COMPRESSION_JSON
from attnslim.errors import AttnslimError

if TYPE_CHECKING:
    from attnslim.recipe import Calibration


def check_model(where: str, model: object) -> None:
    """A model the public API can work on: a torch module with a Hugging Face config."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"{where}: model must be a Hugging Face causal LM (a torch.nn.Module with a .config), got "
                        f"{type(model).__name__} {model!r:.80}; load one with attnslim.load_model(NAME_OR_DIR)")


def check_tokenizer(where: str, tokenizer: object, saving: bool = False) -> None:
    """A tokenizer that can encode text (and, for `save`, write its files)."""
    need = "save_pretrained" if saving else "__call__"
    if tokenizer is None or not hasattr(tokenizer, need):
        raise TypeError(f"{where}: tokenizer must be the model's tokenizer (with {need}), got "
                        f"{type(tokenizer).__name__} {tokenizer!r:.80}; attnslim.load_model returns (model, tokenizer)")


def refuse_compressed(source: str | os.PathLike[str] | torch.nn.Module) -> None:
    """The one "already compressed?" check of every compress entry (compress, compress_to, `compress --kv`, plan,
    demo): `source` is a model name or directory, checked before anything is loaded (its compression.json), or a
    model in memory (the attnslim modules it holds). Compressing again would record only the new steps, so the
    saved result could not load (and --out on the input would destroy it)."""
    if isinstance(source, torch.nn.Module):
        from attnslim.modules import MODULES

        # an adapter's own modules (adapters/fused.py's SplitLinear: a fused linear held as its parts) compute what
        # the original did, so they are no compression
        held = sorted({type(m).__name__ for m in source.modules() if type(m).__name__ in MODULES
                       and not type(m).__module__.startswith("attnslim.adapters.")})
        what, evidence = "the model", f"it already holds attnslim modules {', '.join(held)}" if held else ""
    else:
        found = (Path(source).expanduser() / COMPRESSION_JSON).is_file()
        what, evidence = str(source), f"it has the {COMPRESSION_JSON} attnslim writes" if found else ""
    if evidence:
        raise AttnslimError(f"{what} is already compressed by attnslim ({evidence}); compress the original model "
                            "with one recipe that holds all the steps you want (a recipe may have several steps)")


def check_device(where: str, device: object) -> torch.device | None:
    """`device` (None, a name or a torch.device) checked against this machine: a device that is not here is an
    error, never silently ignored."""
    from attnslim.offload.compute import resolve_device

    if device is None:
        return None
    if not isinstance(device, str | torch.device):
        raise TypeError(f"{where}: device must be a str or torch.device such as 'cpu' or 'cuda:0', got "
                        f"{type(device).__name__} {device!r}")
    try:
        return resolve_device(str(device))
    except AttnslimError as err:
        raise AttnslimError(f"{where}: {err}".replace("--device ", "device=")) from None


def check_drawn(windows: object, cal: Calibration) -> None:
    """`compress(windows=)`: token windows drawn under the recipe's calibration `cal`, as a plan's are
    (`PlanResult.windows` beside `PlanResult.recipe`); others would calibrate on text the recipe does not name."""
    from attnslim.data import TokenWindows

    if not isinstance(windows, TokenWindows):
        raise TypeError(f"compress: windows must be the attnslim TokenWindows a plan drew (PlanResult.windows), got "
                        f"{type(windows).__name__}; or leave it out and compress draws the recipe's calibration")
    drawn = (windows.source, windows.split, tuple(windows.ids.shape))
    if drawn != (cal.source, "calib", (cal.windows, cal.seq_len)):
        raise AttnslimError(f"compress: windows= holds {drawn[2][0]} x {drawn[2][1]} tokens of {drawn[0]!r} "
                            f"({drawn[1]} split), but the recipe calibrates on {cal.windows} x {cal.seq_len} of "
                            f"{cal.source!r}: pass the windows of the plan that wrote this recipe, or none")


def _check_path(where: str, name: str, value: object) -> Path:
    if not isinstance(value, str | os.PathLike) or (isinstance(value, str) and not value.strip()):
        raise TypeError(f"{where}: {name} must be a directory path (str or pathlib.Path), got "
                        f"{type(value).__name__} {value!r:.80}")
    return Path(value)


def _check_dtype(where: str, dtype: object) -> None:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{where}: dtype must be a torch.dtype such as torch.float32, got {type(dtype).__name__} "
                        f"{dtype!r}")


def _check_flag(where: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{where}: {name} must be True or False, got {type(value).__name__} {value!r}")


def check_report(where: str, report: object) -> dict[str, Any]:
    """The report `save` records: `compress(...).to_json()` (or the CompressionReport itself). A mapping without
    the recipe and the steps would be written and then refused by `load`, so it is refused here."""
    to_json = getattr(report, "to_json", None)
    data = to_json() if callable(to_json) else report
    if not isinstance(data, dict):
        raise TypeError(f"{where}: report must be compress(...).to_json(), got {type(report).__name__} "
                        f"{report!r:.80}")
    missing = [k for k, kind in (("recipe", dict), ("steps", list)) if not isinstance(data.get(k), kind)]
    if missing:
        raise AttnslimError(f"{where}: report has no valid {' and '.join(repr(k) for k in missing)} (got keys "
                            f"{sorted(map(str, data))[:8]}), so attnslim.load could not rebuild the model; pass "
                            "the report compress returned: save(model, tokenizer, DIR, report.to_json())")
    return data


def save(model: Any, tokenizer: Any, directory: str | Path, report: Any, overwrite: bool = False) -> Path:
    """`attnslim.save`: attnslim.io.save with its arguments checked first (nothing is written on a bad one)."""
    from attnslim import io

    where = "attnslim.save"
    check_model(where, model)
    check_tokenizer(where, tokenizer, saving=True)
    path = _check_path(where, "directory", directory)
    _check_flag(where, "overwrite", overwrite)
    return io.save(model, tokenizer, path, check_report(where, report), overwrite=overwrite)


def load(directory: str | Path, dtype: torch.dtype = torch.float32, offload: bool = False,
         device: torch.device | str | None = None) -> tuple[Any, Any]:
    """`attnslim.load`: attnslim.io.load with its arguments checked, and `device` honoured: the layers run there
    with `offload`, and without it the whole model is moved there."""
    from attnslim import io

    where = "attnslim.load"
    path = _check_path(where, "directory", directory)
    _check_dtype(where, dtype)
    _check_flag(where, "offload", offload)
    placed = check_device(where, device)
    model, tokenizer = io.load(path, dtype, offload, placed)
    return (model if placed is None or offload else model.to(placed)), tokenizer


def load_model(name_or_path: str, dtype: torch.dtype = torch.float32, offload: bool = False,
               device: torch.device | str | None = None) -> tuple[Any, Any]:
    """`attnslim.load_model`: attnslim.models.load_model with its arguments checked and `device` honoured as in
    `load`."""
    from attnslim import models

    where = "attnslim.load_model"
    if not isinstance(name_or_path, str | os.PathLike):
        raise TypeError(f"{where}: name_or_path must be a model name or a directory (str), got "
                        f"{type(name_or_path).__name__} {name_or_path!r:.80}")
    _check_dtype(where, dtype)
    _check_flag(where, "offload", offload)
    placed = check_device(where, device)
    model, tokenizer = models.load_model(str(name_or_path), dtype, offload, placed)
    return (model if placed is None or offload else model.to(placed)), tokenizer

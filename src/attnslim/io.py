"""Save / load compressed models: safetensors weights + compression.json, rebuild-then-load (no pickle).

A saved directory holds model.safetensors, config.json (the base architecture + an auto_map entry),
tokenizer files, compression.json and attnslim_hf.py, a 10-line module that lets
`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` load it through attnslim.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from attnslim.errors import AttnslimError

FORMAT_VERSION = 1
COMPRESSION_JSON = "compression.json"
WEIGHTS = "model.safetensors"
HF_ENTRY = "attnslim_hf.py"
_ENTRY_SOURCE = Path(__file__).parent / "hf_entry" / "attnslim_hf.py"


def save(model: Any, tokenizer: Any, directory: str | Path, report: dict[str, Any], overwrite: bool = False) -> Path:
    """Write the compressed model to `directory` atomically (temp dir, then rename)."""
    from safetensors.torch import save_model

    target = Path(directory)
    check_output(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        save_model(model, str(tmp / WEIGHTS), metadata={"format": "pt"})
        config = model.config.to_dict()
        config["auto_map"] = {"AutoModelForCausalLM": "attnslim_hf.AttnslimForCausalLM"}
        (tmp / "config.json").write_text(json.dumps(config, indent=1, default=str))
        tokenizer.save_pretrained(tmp)
        shutil.copy(_ENTRY_SOURCE, tmp / HF_ENTRY)
        (tmp / COMPRESSION_JSON).write_text(json.dumps({"format_version": FORMAT_VERSION, **report}, indent=1))
        if target.exists():
            shutil.rmtree(target)
        tmp.replace(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def check_output(target: Path, overwrite: bool) -> None:
    """A new `target` is fine; an existing one needs `overwrite`, and is replaced only when it is an earlier
    attnslim output (or an empty directory): never a file, the working directory or one of its parents, or a
    directory of other data. The CLI calls this before compressing, `save` again before writing."""
    if not target.exists():
        return
    if not overwrite:
        raise AttnslimError(f"output directory {target} exists; choose another --out or pass --overwrite")
    resolved, here = target.resolve(), Path.cwd().resolve()
    if not target.is_dir():
        raise AttnslimError(f"--overwrite: {target} is not a directory; choose another --out")
    if resolved == here or resolved in here.parents:
        raise AttnslimError(f"--overwrite: {target} is the working directory or one of its parents; "
                            "choose a new --out directory")
    if any(target.iterdir()) and not (target / COMPRESSION_JSON).is_file():
        raise AttnslimError(f"--overwrite: {target} is not a model saved by attnslim (no {COMPRESSION_JSON}) "
                            "and not empty, so it is not replaced; choose another --out or remove it yourself")


def read_compression_json(directory: Path) -> dict[str, Any]:
    path = directory / COMPRESSION_JSON
    if not path.exists():
        raise AttnslimError(f"{directory} is not a compressed model (no {COMPRESSION_JSON}); run attnslim compress")
    try:
        info = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise AttnslimError(f"{path} is damaged ({err}); re-create the directory with attnslim compress") from None
    version = info.get("format_version") if isinstance(info, dict) else None
    if version != FORMAT_VERSION:
        raise AttnslimError(
            f"{path}: format_version {version!r} is not supported by this attnslim (expects {FORMAT_VERSION}); "
            "re-create the directory with this version"
        )
    return info


def load(directory: str | Path, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """Rebuild the base architecture, re-create each step's modules (skeleton), load weights strictly."""
    from safetensors.torch import load_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from attnslim.api import apply_skeletons
    from attnslim.registry import MODULES, lookup

    directory = Path(directory)
    info = read_compression_json(directory)
    config = AutoConfig.from_pretrained(directory)
    del config.auto_map
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    apply_skeletons(model, info["steps"])
    for module in model.modules():
        kind = type(module)
        if kind.__module__.startswith("attnslim.") and kind.__name__ not in MODULES:
            lookup(MODULES, "module", kind.__name__)  # raises naming the unknown module
    load_model(model, str(directory / WEIGHTS), strict=True)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return model.eval(), tokenizer


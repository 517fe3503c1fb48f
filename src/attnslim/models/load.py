"""`load_model(name_or_path)`: zoo names, local HF directories, compressed directories, hub ids."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from attnslim.errors import AttnslimError
from attnslim.models.zoo import ZOO, ZooEntry, cache_root, gguf_path, sha256_file

CACHE_FORMAT = 1
WEIGHTS = "model.safetensors"
MANIFEST = "attnslim-cache.json"


def load_model(name_or_path: str, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """Return (model in eval mode, tokenizer) for a zoo name, a local directory or a hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(name_or_path).expanduser()
    if name_or_path in ZOO:
        directory = ensure_cached(ZOO[name_or_path])
    elif path.is_dir():
        if (path / "compression.json").exists():
            from attnslim.io import load

            return load(path, dtype)
        if not (path / "config.json").is_file():
            raise AttnslimError(f"{path} is not a model directory (no config.json, no compression.json); pass a "
                                f"Hugging Face model directory, one saved by attnslim compress, or a name "
                                f"({', '.join(sorted(ZOO))})")
        directory = path
    elif "/" in name_or_path and not path.exists() and not name_or_path.startswith((".", "/")):
        return _load_hub(name_or_path, dtype)
    else:
        raise AttnslimError(
            f"unknown model {name_or_path!r}: not a known name ({', '.join(sorted(ZOO))}), "
            "not a local directory, and not a hub id of the form org/name"
        )
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return model.eval(), tokenizer


def _load_hub(repo_id: str, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(repo_id, dtype=dtype, attn_implementation="sdpa")
        tokenizer = AutoTokenizer.from_pretrained(repo_id)
    except OSError as err:
        raise AttnslimError(
            f"could not load {repo_id!r} from the Hugging Face hub ({err.__class__.__name__}): the hub is not "
            f"reachable or the id is wrong. Use a local directory or a packaged name ({', '.join(sorted(ZOO))})."
        ) from err
    return model.eval(), tokenizer


def ensure_cached(entry: ZooEntry) -> Path:
    """The float32 safetensors copy of a zoo model, converting from GGUF once (atomically, checksummed)."""
    directory = cache_root() / "models" / entry.name
    problem = _cache_problem(directory)
    if problem is None:
        return directory
    if directory.exists():
        print(f"attnslim: cache entry {directory} is unusable ({problem}); rebuilding it", flush=True)
    _convert(entry, directory)
    return directory


def _cache_problem(directory: Path) -> str | None:
    """None when the cache entry is complete and its weights match the recorded size and checksum."""
    manifest_path = directory / MANIFEST
    if not manifest_path.exists():
        return "no manifest" if directory.exists() else "missing"
    try:
        manifest = json.loads(manifest_path.read_text())
        weights = directory / WEIGHTS
        if manifest.get("format") != CACHE_FORMAT:
            return f"cache format {manifest.get('format')} != {CACHE_FORMAT}"
        if not weights.exists() or weights.stat().st_size != manifest["size"]:
            return "weights missing or truncated"
        if _quick_digest(weights) != manifest["quick_sha256"]:
            return "weights checksum mismatch"
    except (OSError, ValueError, KeyError) as err:
        return f"unreadable manifest: {err}"
    return None


def _quick_digest(path: Path, block: int = 1 << 20) -> str:
    """sha256 over the first and last MiB and the size: catches truncation and header damage in ~1 ms.

    The full sha256 is recorded too (`attnslim.models.load.verify_full` checks it) but costs ~1 s.
    """
    import hashlib

    h = hashlib.sha256(str(path.stat().st_size).encode())
    with open(path, "rb") as f:
        h.update(f.read(block))
        f.seek(max(0, path.stat().st_size - block))
        h.update(f.read(block))
    return h.hexdigest()


def verify_full(directory: Path) -> bool:
    manifest = json.loads((directory / MANIFEST).read_text())
    return bool(sha256_file(directory / WEIGHTS) == manifest["sha256"])


def _convert(entry: ZooEntry, directory: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path(entry)
    if entry.sha256 is not None and sha256_file(source) != entry.sha256:
        raise AttnslimError(f"{source} does not match its published sha256; reinstall with: {entry.install}")
    print(f"attnslim: converting {entry.name} from GGUF to float32 safetensors (once, ~30 s)", flush=True)
    start = time.time()
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None  # type: ignore[assignment]
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=directory.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        weights = tmp / WEIGHTS
        manifest = {
            "format": CACHE_FORMAT,
            "source": str(source),
            "size": weights.stat().st_size,
            "sha256": sha256_file(weights),
            "quick_sha256": _quick_digest(weights),
            "seconds": round(time.time() - start, 1),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if directory.exists():
            shutil.rmtree(directory)
        tmp.replace(directory)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)

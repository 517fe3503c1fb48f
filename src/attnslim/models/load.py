"""`load_model(name_or_path)`: zoo names, local HF directories, compressed directories, hub ids."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from attnslim import _compat
from attnslim.checksum import sha256_file
from attnslim.config_bounds import check_config_sizes, hf_weight_files
from attnslim.disk_format import COMPRESSION_JSON, WEIGHTS
from attnslim.errors import AttnslimError, first_line
from attnslim.io import load_tokenizer
from attnslim.models.zoo import ZOO, ZooEntry, cache_root, gguf_path
from attnslim.outdir import check_writable_parent, describe_copies, staged_output
from attnslim.safe_files import read_json, refuse_special_files
from attnslim.verify import matches_sha256

if TYPE_CHECKING:
    from transformers import PretrainedConfig

CACHE_FORMAT = 1
MANIFEST = "attnslim-cache.json"


def load_model(name_or_path: str, dtype: torch.dtype = torch.float32, offload: bool = False,
               device: torch.device | None = None) -> tuple[Any, Any]:
    """Return (model in eval mode, tokenizer) for a zoo name, a local directory or a hub id.

    offload=True keeps each decoder layer's weights in the directory's safetensors files, read while the layer
    runs on `device` (attnslim.offload.dispatch): a model larger than memory can be evaluated. Local models only."""
    path = Path(name_or_path).expanduser()
    if not name_or_path.strip():
        raise AttnslimError(f"the model name is empty; give a name ({', '.join(sorted(ZOO))}) or a directory")
    if name_or_path in ZOO:
        directory = ensure_cached(ZOO[name_or_path])
    elif path.is_dir():
        if (path / COMPRESSION_JSON).exists():
            from attnslim.io import load

            return load(path, dtype, offload, device)
        if not (path / "config.json").is_file():
            raise AttnslimError(f"{path} is not a model directory (no config.json, no {COMPRESSION_JSON}); pass a "
                                f"Hugging Face model directory, one saved by attnslim compress, or a name "
                                f"({', '.join(sorted(ZOO))})" + describe_copies(path))
        directory = path
    elif path.exists() or _looks_local(name_or_path):
        raise AttnslimError(f"{name_or_path} is not a model: {_local_problem(path)}")
    elif "/" in name_or_path:
        if offload:
            raise AttnslimError(f"--offload reads local safetensors files; download {name_or_path} first (e.g. "
                                "huggingface-cli download) and pass its directory")
        return _load_hub(name_or_path, dtype)
    else:
        raise AttnslimError(
            f"unknown model {name_or_path!r}: not a known name ({', '.join(sorted(ZOO))}), "
            "not a local directory, and not a hub id of the form org/name"
        )
    _check_tokenizer_files(directory)
    checkpoint = read_checkpoint(directory)
    if offload:
        from attnslim.adapters import get_adapter
        from attnslim.offload.dispatch import dispatch_layers

        model = skeleton(checkpoint, dtype)
        adapter = get_adapter(model)
        adapter.refuse_offload()  # a family whose module names are not its checkpoint's
        dispatch_layers(model, adapter.decoder_layers(), directory, device or torch.device("cpu"), dtype)
        return model, checkpoint.tokenizer
    return load_weights(checkpoint, dtype), checkpoint.tokenizer


@dataclass(frozen=True)
class Checkpoint:
    """A local Hugging Face checkpoint directory with its config.json read once (`read_checkpoint`) and its
    tokenizer: what `skeleton`, `load_weights` and `attnslim compress` (api.compress_to) build from, so one command
    reads the file once."""

    directory: Path
    config: PretrainedConfig
    tokenizer: Any


def read_checkpoint(directory: Path) -> Checkpoint:
    """`directory`'s config and tokenizer, without its weights. config.json is read once, bounded, with its sizes
    checked against the weights' shapes before anything is built (`check_directory`); the config is built from
    that dict (_compat.checkpoint_config) and handed to the tokenizer, which would otherwise read the file again.
    An unreadable directory is an AttnslimError."""
    values = check_directory(directory)  # its own errors name the file and the fix
    try:
        if values is None:
            raise AttnslimError(f"no config.json in {directory}")
        config = _compat.checkpoint_config(values, str(directory))
    except AttnslimError as err:
        raise AttnslimError(f"{directory} could not be loaded as a Hugging Face model: it could not be read as a "
                            f"config and tokenizer ({first_line(err)}); check that it holds config.json and the "
                            "tokenizer files of one model") from err
    return Checkpoint(directory, config, load_tokenizer(directory, config=config))


def load_weights(checkpoint: Checkpoint, dtype: torch.dtype = torch.float32) -> Any:
    """The checkpoint's model in memory, in eval mode; transformers is given the config already read."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(checkpoint.directory, config=checkpoint.config, dtype=dtype,
                                                     attn_implementation="sdpa", **_compat.SAFE_LOADING)
    except (OSError, ValueError, SafetensorError) as err:
        detail = first_line(err) or type(err).__name__
        raise AttnslimError(f"{checkpoint.directory} could not be loaded as a Hugging Face model ({detail}); check "
                            "that it holds config.json, the weights and the tokenizer files of one model") from err
    return model.eval()


def check_directory(directory: Path) -> dict[str, Any] | None:
    """config.json's values (None when there is none), read before anything else of a Hugging Face directory: no
    device, FIFO or socket among its files, and config.json's sizes backed by the weights' shapes
    (attnslim.config_bounds), so a hostile config cannot make the model build allocate without bound. A missing
    directory or config.json is left to the caller's message."""
    if not (directory / "config.json").exists():
        return None
    refuse_special_files(directory)
    config = read_json(directory / "config.json", "config.json", fix="restore the model's own config.json")
    if not isinstance(config, dict):
        raise AttnslimError(f"{directory / 'config.json'} is not a JSON object; restore the model's own config.json")
    check_config_sizes(config, hf_weight_files(directory), directory / "config.json")
    return config


def checkpoint_directory(name_or_path: str) -> Path:
    """The local safetensors directory of a packaged name or a Hugging Face directory (what --offload reads)."""
    if name_or_path in ZOO:
        return ensure_cached(ZOO[name_or_path])
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file() and not (path / COMPRESSION_JSON).exists():
        _check_tokenizer_files(path)
        return path
    raise AttnslimError(f"--offload reads a packaged model ({', '.join(sorted(ZOO))}) or a local Hugging Face "
                        f"directory of safetensors weights; {name_or_path!r} is neither (download a hub model "
                        "first, e.g. `hf download ORG/NAME --local-dir DIR`)")


def load_skeleton(directory: Path, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """(model with every parameter on the meta device, tokenizer) of a checkpoint directory: built from its
    config.json under accelerate's `init_empty_weights`, so it costs no memory; attnslim.offload fills it one
    decoder layer at a time. Buffers (rotary tables) are real, tied parameters are tied as from_pretrained ties."""
    checkpoint = read_checkpoint(directory)
    return skeleton(checkpoint, dtype), checkpoint.tokenizer


def skeleton(checkpoint: Checkpoint, dtype: torch.dtype = torch.float32) -> Any:
    """The checkpoint's model with every parameter on the meta device (`load_skeleton`)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(checkpoint.config, dtype=dtype, attn_implementation="sdpa")
    model.tie_weights()
    return model.eval()


def load_random(directory: Path, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[Any, Any]:
    """(model with seeded random weights, tokenizer) from a directory holding only config.json and the tokenizer
    files: what a machine can build when the weights cannot travel to it (benchmarks/gpu.py on a GPU lease).
    Speed and the modules' algebra do not depend on the weights' values; quality does, so such a model is never
    scored for perplexity."""
    from transformers import AutoModelForCausalLM

    checkpoint = read_checkpoint(directory)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(checkpoint.config, dtype=dtype, attn_implementation="sdpa")
    return model.eval(), checkpoint.tokenizer


def _looks_local(text: str) -> bool:
    """A path rather than a hub id: starts like a path, has more than one slash, or its first part exists here."""
    first = text.split("/", 1)[0]
    return text.startswith((".", "/", "~")) or text.count("/") > 1 or ("/" in text and Path(first).exists())


def _local_problem(path: Path) -> str:
    if path.exists():
        return "it is a file, not a directory"
    parent = path
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return f"the local path does not exist ({parent} exists, {path.relative_to(parent)} does not in it)"


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _check_tokenizer_files(directory: Path) -> None:
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        raise AttnslimError(f"{directory} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}); copy the "
                            "tokenizer of the model into it")


def _load_hub(repo_id: str, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(repo_id, dtype=dtype, attn_implementation="sdpa",
                                                     **_compat.SAFE_LOADING)
        tokenizer = AutoTokenizer.from_pretrained(repo_id, **_compat.SAFE_LOADING)
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
    check_writable_parent(directory)  # a read-only cache fails now, not after the conversion
    _convert(entry, directory)
    return directory


def _cache_problem(directory: Path) -> str | None:
    """None when the cache entry is complete and its weights match the recorded size and sha256.

    The full sha256 (about 1 s for 540 MB) is skipped only when a stamp in the cache vouches for the unchanged file
    (attnslim.verify: device, inode, size, mtime and ctime, at most STAMP_DAYS days old; ATTNSLIM_VERIFY=1 forces
    it), so damage written in place with the mtime restored is still found."""
    manifest_path = directory / MANIFEST
    if not manifest_path.exists():
        return "no manifest" if directory.exists() else "missing"
    try:
        manifest = read_json(manifest_path, "cache manifest", limit=1 << 16)
        if not isinstance(manifest, dict):
            return "unreadable manifest: not a JSON object"
        weights = directory / WEIGHTS
        if manifest.get("format") != CACHE_FORMAT:
            return f"cache format {manifest.get('format')} != {CACHE_FORMAT}"
        if not weights.is_file() or weights.stat().st_size != manifest["size"]:
            return "weights missing or truncated"
        if not matches_sha256(weights, str(manifest["sha256"])):
            return "weights checksum mismatch"
    except (OSError, ValueError, KeyError, TypeError) as err:  # AttnslimError is a ValueError
        return f"unreadable manifest: {first_line(err)}"
    return None


def _convert(entry: ZooEntry, directory: Path) -> None:
    source = gguf_path(entry)
    try:
        _convert_gguf(entry, source, directory)
    finally:
        if entry.split is not None:  # joined only to convert (models/parts.py): 1.1 GB not kept beside the cache
            source.unlink(missing_ok=True)


def _convert_gguf(entry: ZooEntry, source: Path, directory: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if entry.split is None and entry.sha256 is not None and sha256_file(source) != entry.sha256:
        raise AttnslimError(f"{source} does not match its published sha256; reinstall with: {entry.install}")
    print(f"attnslim: converting {entry.name} from GGUF to float32 safetensors (once: ~30 s for SmolLM2, "
          "minutes for qwen2.5-1.5b)", flush=True)
    start = time.time()
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32,
                                                 **_compat.SAFE_LOADING)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name, **_compat.SAFE_LOADING)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None  # type: ignore[assignment]
    with staged_output(directory, overwrite=True, check=False) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        weights = tmp / WEIGHTS
        manifest = {
            "format": CACHE_FORMAT,
            "source": str(source),
            "size": weights.stat().st_size,
            "sha256": sha256_file(weights),
            "seconds": round(time.time() - start, 1),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))

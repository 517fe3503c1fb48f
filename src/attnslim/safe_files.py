"""Reading and writing the files of directories attnslim did not write: regular files only, bounded reads, and
writes that never follow a link.

A model directory may come from anyone. Its files may be symbolic links to a user's own files, to /dev/zero or to a
FIFO, and its JSON may be huge or nested without end. Every read of such a file goes through `regular_file` (after
resolving links the path must be a regular file, so nothing hangs on a device or a pipe) and `read_json` (a size cap
checked before reading, nesting errors reported as damage). Every write into such a directory goes through
`write_text_atomic`: a temp file beside the target, then `os.replace`, so a link at the target is never followed, and a
failed write (a full disk) leaves the old file as it was. Only stdlib and `errors`: vLLM's process imports this too.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path

from attnslim.errors import AttnslimError, first_line

JSON_LIMIT = 64 << 20  # bytes: a compression.json of a 1,000-layer plan is a few MB; config.json a few KB
DAMAGED_FIX = "re-create the directory with attnslim compress"


def regular_file(path: Path, what: str) -> Path:
    """`path` resolved; an AttnslimError unless it is an existing regular file (not a device, FIFO or directory).

    Checked by `stat` after resolving links, so a link to /dev/zero or a pipe is refused before any read."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise AttnslimError(f"{what} {path} does not exist") from None
    except OSError as err:
        raise AttnslimError(f"{what} {path} cannot be read ({first_line(err)})") from None
    if not stat.S_ISREG(mode):
        kind = "directory" if stat.S_ISDIR(mode) else "device, FIFO or socket"
        raise AttnslimError(f"{what} {path} is a {kind}, not a regular file; replace it with the real file")
    return path


def read_json(path: Path, what: str, limit: int = JSON_LIMIT, fix: str = DAMAGED_FIX) -> object:
    """The JSON value in `path`, a regular file of at most `limit` bytes; damage, excess size and excess nesting are
    AttnslimErrors naming the file and `fix`."""
    regular_file(path, what)
    with open(path, "rb") as f:
        raw = f.read(limit + 1)  # bounded even if the file grows between stat and read
    if len(raw) > limit:
        raise AttnslimError(f"{what} {path} is larger than {limit >> 20} MiB, more than any real one; {fix}")
    try:
        return json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise AttnslimError(f"{what} {path} is damaged ({first_line(err)}); {fix}") from None
    except RecursionError:
        raise AttnslimError(f"{what} {path} is damaged (nested too deeply to read); {fix}") from None


def check_write_target(path: Path) -> None:
    """An AttnslimError unless `path` is absent or a regular file (not a link, directory or special file)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        kind = "symbolic link" if stat.S_ISLNK(mode) else "directory" if stat.S_ISDIR(mode) else "special file"
        raise AttnslimError(f"{path} is a {kind}, not a regular file; attnslim will not write through it. Remove it "
                            "(or move it away) and run the command again")


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temp file in the same directory and `os.replace`.

    The target, if it exists, must be a regular file and not a link: a link is refused, never followed (writing
    through it would replace whatever it points at). The old file stays whole until the new one is complete."""
    check_write_target(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        raise AttnslimError(f"could not write {path}: cannot create a file in {path.parent} ({first_line(err)}); "
                            "make the directory writable or copy it somewhere writable") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise AttnslimError(f"could not write {path} ({first_line(err)}); the file that was there is unchanged. "
                            "Free disk space or choose a writable location") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def refuse_special_files(directory: Path) -> None:
    """An AttnslimError naming the first entry of `directory` that is, after resolving links, a device, FIFO or
    socket: transformers opens the directory's files by name (tokenizer, generation config, weights), and such a file
    would hang a read or never end. Checked before anything in the directory is read."""
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        try:
            mode = os.stat(entry.path).st_mode
        except OSError:
            continue  # a dangling link: whatever opens it by name fails with a clear "no such file"
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise AttnslimError(f"{directory}: {entry.name} is a device, FIFO or socket, not a regular file; replace "
                                "it with the real file (or remove it)")

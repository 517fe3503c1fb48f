"""Output directories that never lose data.

Every output (a compressed model, a cache entry) is written into a hidden temp directory beside its target and
then installed by rename:
- without overwrite, the target is claimed with `os.mkdir` (fails if anything is there) and the temp directory is
  renamed onto that empty claim (fails if anything was written into it meanwhile): what appears at the target while
  we write is never replaced;
- with overwrite, the old directory is renamed aside, the new one renamed in, then the old one deleted; a kill at
  any point leaves both copies on disk, never neither.
`check_output` runs before any work (a bad --out is found in seconds, not after a 10-minute compress) and again
just before a swap. SIGTERM is turned into SystemExit by `terminate_as_exit`, so `finally` blocks remove temp
directories as they do on Ctrl-C; what a SIGKILL leaves is reported by the next write to the same target, and by
the next read of it (`interrupted_copies`, quoted by io.load's "not a compressed model" error).
Every temp directory (new output or old one set aside) is marked by a file beside it, DIR.attnslim-temp, created
before the directory itself and holding the writer's pid: only marked directories are ever named as leftovers (with
the `rm -rf` that removes them), never a user's own `.OUT-something` directory. The mark is beside the directory,
not in it, because the old output is renamed onto an empty directory and the new one must hold only the output.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from attnslim.disk_format import COMPRESSION_JSON, EXPORT_MARKER
from attnslim.errors import AttnslimError

TEMP_MARK = ".attnslim-temp"  # beside each temp directory attnslim makes (DIR + TEMP_MARK): the writer's pid


def check_output(target: Path, overwrite: bool, inputs: Sequence[Path] = ()) -> None:
    """Refuse, before any work, an output that could not be written or would replace something it must not.

    A new `target` needs a writable directory (or a creatable path) above it; an existing one needs `overwrite`,
    and is replaced only when it is an earlier attnslim output or an empty directory: never a file, a symbolic
    link, the working directory or one of its parents, one of `inputs`, or a directory of other data."""
    if target.is_symlink():
        raise AttnslimError(f"output {target} is a symbolic link (to {os.readlink(target)}); give the real path "
                            "as --out, or choose another --out")
    for source in inputs:
        if target.exists() and source.exists() and target.resolve() == source.resolve():
            raise AttnslimError(f"output {target} is the input model; choose another --out")
    if target.exists():
        _check_replaceable(target, overwrite)
    check_writable_parent(target)


def _check_replaceable(target: Path, overwrite: bool) -> None:
    if not overwrite:
        raise AttnslimError(f"output directory {target} exists; choose another --out or pass --overwrite")
    resolved, here = target.resolve(), Path.cwd().resolve()
    if not target.is_dir():
        raise AttnslimError(f"--overwrite: {target} is not a directory; choose another --out")
    if resolved == here or resolved in here.parents:
        raise AttnslimError(f"--overwrite: {target} is the working directory or one of its parents; "
                            "choose a new --out directory")
    if any(target.iterdir()) and not any((target / m).is_file() for m in (COMPRESSION_JSON, EXPORT_MARKER)):
        raise AttnslimError(f"--overwrite: {target} is not a model saved by attnslim (no {COMPRESSION_JSON}) "
                            "and not empty, so it is not replaced; choose another --out or remove it yourself")


def check_writable_parent(target: Path) -> None:
    """The nearest existing ancestor of `target` must be a directory we can create entries in (probed)."""
    parent = target.absolute().parent
    while not parent.exists() and not parent.is_symlink():
        parent = parent.parent
    if not parent.is_dir():
        raise AttnslimError(f"output {target}: {parent} is not a directory; choose another --out")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".attnslim-probe-", dir=parent))
    except OSError as err:
        raise AttnslimError(f"output {target}: cannot write in {parent} ({err.strerror}); "
                            "choose a writable location for --out") from None


@contextmanager
def staged_output(target: Path, overwrite: bool, check: bool = True) -> Iterator[Path]:
    """Yield an empty temp directory beside `target`; when the block ends normally, install it at `target`.

    On an error inside the block the temp directory is removed and nothing at `target` is touched. If the install
    itself finds the target taken, the new output is kept in the temp directory and the error names it.
    `check=False` skips the attnslim-output test (for cache entries, which the caller owns)."""
    if check:
        check_output(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    report_stale(target)
    tmp = make_temp_dir(target.parent, f".{target.name}-")
    keep = False
    try:
        yield tmp
        _publish_permissions(tmp)
        keep = True  # from here on a failure leaves the finished output in tmp and says so
        try:
            if overwrite:
                if check:
                    check_output(target, overwrite)  # again: the target may have changed while we wrote
                swap_in(tmp, target)
            else:
                install_new(tmp, target)
        except AttnslimError as err:
            if str(tmp) in str(err):
                raise
            raise AttnslimError(f"{err}. The new output is kept in {tmp}: move it yourself or rerun with another "
                                "--out") from None
        keep = False
    finally:
        if not keep:
            remove_temp_dir(tmp)


def make_temp_dir(parent: Path, prefix: str) -> Path:
    """An empty new directory `parent/prefix*`, marked as attnslim's by `TEMP_MARK` beside it (written first)."""
    for _ in range(100):
        fd, mark = tempfile.mkstemp(prefix=prefix, suffix=TEMP_MARK, dir=parent)
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        directory = Path(mark[: -len(TEMP_MARK)])
        try:
            os.mkdir(directory, 0o700)
            return directory
        except FileExistsError:  # someone else's directory of that name: never take it over
            os.unlink(mark)
    raise AttnslimError(f"could not create a temporary directory in {parent}; remove old .{prefix}* entries")


def remove_temp_dir(directory: Path) -> None:
    """Delete a temp directory made by `make_temp_dir` (if still there) and its mark."""
    shutil.rmtree(directory, ignore_errors=True)
    _mark(directory).unlink(missing_ok=True)


def _mark(directory: Path) -> Path:
    return directory.with_name(directory.name + TEMP_MARK)


def install_new(tmp: Path, target: Path) -> None:
    """Rename `tmp` to `target`, which must not exist: claim it with mkdir, then rename onto the empty claim."""
    try:
        os.mkdir(target)
    except FileExistsError:
        raise AttnslimError(f"{target} appeared while the output was being written, so it was not replaced; "
                            f"the new output is kept in {tmp}: move it yourself or rerun with another --out") from None
    try:
        os.rename(tmp, target)
    except OSError:
        if not any(target.iterdir()):
            os.rmdir(target)
        raise AttnslimError(f"something was written into {target} while the output was being saved, so it was not "
                            f"replaced; the new output is kept in {tmp}") from None
    _mark(tmp).unlink(missing_ok=True)


def swap_in(tmp: Path, target: Path) -> None:
    """Replace `target` by `tmp`: rename the old one aside, rename the new one in, then delete the old one."""
    aside = None
    if target.exists():
        aside = make_temp_dir(target.parent, f".{target.name}-old-")
        os.rename(target, aside)  # onto the empty directory make_temp_dir made
    try:
        install_new(tmp, target)
    except BaseException:  # also SIGTERM's SystemExit: put the old output back; the new one stays in tmp
        if aside is not None and not target.exists():
            os.rename(aside, target)
            _mark(aside).unlink(missing_ok=True)
        raise
    if aside is not None:
        remove_temp_dir(aside)


def report_stale(target: Path) -> list[Path]:
    """Temp directories of earlier writes to `target` whose writer is gone (a SIGKILL, a power cut): print them
    with the command that removes them. They are never deleted here: one may hold the only copy of a model."""
    stale = interrupted_copies(target)
    if stale:
        size = sum(f.stat().st_size for p in stale for f in p.rglob("*") if f.is_file()) / 2**20
        names = " ".join(str(p) for p in stale)
        print(f"attnslim: warning: {len(stale)} temporary director{'y' if len(stale) == 1 else 'ies'} "
              f"({size:.0f} MB) left by an interrupted write to {target}: {names}; check them, then remove them "
              f"with: rm -rf {names}", file=sys.stderr, flush=True)
    return stale


def interrupted_copies(target: Path) -> list[Path]:
    """attnslim's own temp directories beside `target` (marked by `TEMP_MARK`) whose writer is no longer running."""
    return [p for p in sorted(target.parent.glob(f".{target.name}-*"))
            if p.is_dir() and not p.is_symlink() and _mark(p).is_file() and not _writer_alive(p)]


def describe_copies(target: Path) -> str:
    """A sentence naming what an interrupted write to `target` left ("" when nothing): for errors on reading it."""
    copies = interrupted_copies(target)
    if not copies:
        return ""
    old = [str(p) for p in copies if p.name.startswith(f".{target.name}-old-")]
    new = [str(p) for p in copies if str(p) not in old]
    parts = ([f"the new output in {', '.join(new)}"] if new else []) + (
        [f"the previous one in {', '.join(old)}"] if old else [])
    return (f"; an interrupted write to it (killed during --overwrite) left {' and '.join(parts)}: move the one you "
            f"want to {target}")


def _writer_alive(directory: Path) -> bool:
    try:
        pid = int(_mark(directory).read_text())
    except (OSError, ValueError):
        return False
    if pid == os.getpid():
        return False  # our own leftover from an earlier failed install in this process
    try:
        os.kill(pid, 0)  # PermissionError: alive, owned by another user
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _publish_permissions(directory: Path) -> None:
    """mkdtemp creates 0700; give the output the modes the user's umask would (0755/0644 by default)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [directory, *directory.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


@contextmanager
def terminate_as_exit() -> Iterator[None]:
    """Inside the block SIGTERM (timeout, Slurm, docker stop) raises SystemExit(143), so `finally` blocks and
    context managers clean up as they do on Ctrl-C. The previous handler is restored afterwards."""

    def _raise(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, _raise)
    except ValueError:  # not the main thread: signals cannot be handled here
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)

"""safe_files: reads refuse what is not a regular file or too large; writes never follow a link."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from attnslim.errors import AttnslimError
from attnslim.safe_files import read_json, regular_file, write_text_atomic


def test_regular_file_refuses_devices_fifos_and_directories(tmp_path: Path) -> None:
    (tmp_path / "zero").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(AttnslimError, match="device, FIFO or socket"):
        regular_file(tmp_path / "zero", "weights")
    with pytest.raises(AttnslimError, match="device, FIFO or socket"):
        regular_file(tmp_path / "fifo", "weights")
    with pytest.raises(AttnslimError, match="directory"):
        regular_file(tmp_path, "weights")
    with pytest.raises(AttnslimError, match="does not exist"):
        regular_file(tmp_path / "missing", "weights")


def test_read_json_caps_size_and_nesting(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"a": [1, 2]}))
    assert read_json(path, "config") == {"a": [1, 2]}
    with pytest.raises(AttnslimError, match="larger than"):
        read_json(path, "config", limit=4)
    path.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(AttnslimError, match="nested too deeply"):
        read_json(path, "config")
    path.write_text("{broken")
    with pytest.raises(AttnslimError, match="damaged"):
        read_json(path, "config")


def test_write_text_atomic_never_follows_a_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim_rc"  # a stand-in for a user's shell rc file
    victim.write_text("# my rc\n")
    (tmp_path / "out").mkdir()
    link = tmp_path / "out" / "report.md"
    link.symlink_to(victim)
    with pytest.raises(AttnslimError, match="symbolic link"):
        write_text_atomic(link, "$(touch pwned)")
    assert victim.read_text() == "# my rc\n"
    target = tmp_path / "out" / "plain.md"
    target.write_text("old")
    write_text_atomic(target, "new")
    assert target.read_text() == "new"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["plain.md", "report.md"]  # no temp left


def test_write_text_atomic_keeps_the_old_file_when_the_write_fails(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "report.html"
    target.write_text("old report")

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(AttnslimError, match="No space left.*unchanged"):
        write_text_atomic(target, "new report")
    assert target.read_text() == "old report"
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]

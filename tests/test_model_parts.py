"""A GGUF split over several wheels (models/parts.py, the qwen2.5-1.5b entry): joined in order with every part and
the whole checked; a missing, truncated or damaged part is named with the command that reinstalls it, and nothing is
left behind. Fake part packages on sys.path stand in for the 22 wheels."""

from __future__ import annotations

import hashlib
import importlib

import pytest

from attnslim.errors import AttnslimError
from attnslim.models import load as load_mod
from attnslim.models import zoo
from attnslim.models.parts import SplitFile, join_parts

PARTS = [b"GGUF" + bytes(range(200)) * 3, bytes(range(255, 0, -1)) * 2, b"tail-of-the-file"]
INSTALL = "make fakemodel"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def split(tmp_path, monkeypatch) -> SplitFile:
    """Three fake part packages `fakepart1..3` holding data/partNN.bin, importable from tmp_path."""
    for i, data in enumerate(PARTS, start=1):
        package = tmp_path / "site" / f"fakepart{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    return SplitFile(package="fakepart{i}", file="data/part{i:02d}.bin", sizes=tuple(len(p) for p in PARTS),
                     sha256s=tuple(_sha(p) for p in PARTS), install=INSTALL)


def _part(tmp_path, i: int):
    return tmp_path / "site" / f"fakepart{i}" / "data" / f"part{i:02d}.bin"


def test_parts_join_in_order_into_the_published_file(split, tmp_path):
    whole = b"".join(PARTS)
    out = join_parts(split, tmp_path / "cache" / "m.gguf", _sha(whole))
    assert out.read_bytes() == whole
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.gguf"]  # no temporary file left


@pytest.mark.parametrize("damage,fragment", [
    ("missing_package", r"part 2 of 3 \(fakepart2\) is not installed"),
    ("missing_file", "part 2 of 3: .* is missing from its package"),
    ("truncated", r"part 2 of 3: .* is 500 bytes, the published part is 510 \(truncated\)"),
    ("damaged", r"part 2 of 3: .* does not match its published sha256 \(damaged\)"),
])
def test_a_bad_part_is_named_with_the_fix_and_nothing_is_written(split, tmp_path, damage, fragment):
    part = _part(tmp_path, 2)
    if damage == "missing_package":
        for f in part.parent.parent.rglob("*"):
            if f.is_file():
                f.unlink()
        (part.parent).rmdir()
        part.parent.parent.rmdir()
        importlib.invalidate_caches()
    elif damage == "missing_file":
        part.unlink()
    elif damage == "truncated":
        part.write_bytes(PARTS[1][:500])
    else:  # same size, one byte changed
        part.write_bytes(b"\x00" + PARTS[1][1:])
    target = tmp_path / "cache" / "m.gguf"
    with pytest.raises(AttnslimError, match=fragment) as err:
        join_parts(split, target, _sha(b"".join(PARTS)))
    assert INSTALL in str(err.value)
    assert list((tmp_path / "cache").glob("*")) == []  # neither the target nor a temporary file


def test_a_wrong_whole_checksum_is_refused_and_nothing_is_written(split, tmp_path):
    target = tmp_path / "cache" / "m.gguf"
    with pytest.raises(AttnslimError, match="joined file does not match its published sha256"):
        join_parts(split, target, _sha(b"something else"))
    assert list((tmp_path / "cache").iterdir()) == []


def test_the_qwen_entry_converts_from_the_joined_file_and_removes_it(split, tmp_path, monkeypatch):
    """ensure_cached on a split entry joins the parts into the cache, converts, and deletes the joined GGUF (the
    float32 cache is what stays); a bad part stops it before any conversion, naming the part."""
    monkeypatch.setenv("ATTNSLIM_CACHE", str(tmp_path / "cache"))
    entry = zoo.ZooEntry(name="fake", package="fakepart1", install=INSTALL, gguf_file="fake.gguf",
                         sha256=_sha(b"".join(PARTS)), split=split)
    seen = []
    monkeypatch.setattr(load_mod, "_convert_gguf", lambda e, source, d: seen.append(source.read_bytes()))
    load_mod._convert(entry, tmp_path / "cache" / "models" / "fake")
    assert seen == [b"".join(PARTS)]
    assert not (tmp_path / "cache" / "gguf" / "fake.gguf").exists()
    _part(tmp_path, 3).write_bytes(b"short")
    with pytest.raises(AttnslimError, match="part 3 of 3"):
        load_mod._convert(entry, tmp_path / "cache" / "models" / "fake")
    assert len(seen) == 1


def test_the_packaged_qwen_entry_names_22_parts_of_the_published_size():
    split = zoo.ZOO["qwen2.5-1.5b"].split
    assert split is not None and split.count == 22
    assert split.total_bytes == 1_117_320_768
    assert "make qwen15" in zoo.ZOO["qwen2.5-1.5b"].install

"""gpuhook.sys.files: atomic replacement, exact modes, nothing left behind on failure."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuhook.sys import files


def _names(directory: Path) -> list[str]:
    """The directory's entries, temporary files included."""
    return sorted(os.listdir(directory))


def test_new_file_gets_the_exact_mode(tmp_path: Path) -> None:
    """The mode is the one asked for, whatever the umask."""
    old = os.umask(0o077)
    try:
        files.replace_file(tmp_path / "a.json", b"{}", mode=0o644)
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").read_bytes() == b"{}"
    assert (tmp_path / "a.json").stat().st_mode & 0o7777 == 0o644
    assert _names(tmp_path) == ["a.json"]


def test_replacing_swaps_the_file_whole(tmp_path: Path) -> None:
    """A reader holding the old file still reads all of it; the path shows all of the new one."""
    target = tmp_path / "spec.json"
    target.write_bytes(b"old contents")
    with open(target, "rb") as reader:
        files.replace_file(target, b"new" * 100_000, mode=0o600)
        assert reader.read() == b"old contents"
    assert target.read_bytes() == b"new" * 100_000
    assert target.stat().st_mode & 0o7777 == 0o600
    assert _names(tmp_path) == ["spec.json"]


def test_failure_leaves_the_old_state_and_no_temporary(tmp_path: Path) -> None:
    """A rename that fails (a directory is in the way) raises OSError and removes its temporary file."""
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep").write_text("x")
    with pytest.raises(IsADirectoryError):
        files.replace_file(tmp_path / "busy", b"data", mode=0o644)
    assert _names(tmp_path) == ["busy"]
    assert (tmp_path / "busy" / "keep").read_text() == "x"
    with pytest.raises(FileNotFoundError):
        files.replace_file(tmp_path / "missing" / "x", b"data", mode=0o644)


def test_replace_at_writes_the_directory_it_holds(tmp_path: Path) -> None:
    """Relative to a directory fd, a rename of the directory's path after opening cannot redirect the write."""
    (tmp_path / "cache").mkdir()
    dir_fd = os.open(tmp_path / "cache", os.O_PATH | os.O_DIRECTORY)
    try:
        (tmp_path / "cache").rename(tmp_path / "moved")
        (tmp_path / "cache").mkdir()
        files.replace_at(dir_fd, "data", b"payload", mode=0o644)
    finally:
        os.close(dir_fd)
    assert (tmp_path / "moved" / "data").read_bytes() == b"payload"
    assert _names(tmp_path / "cache") == []

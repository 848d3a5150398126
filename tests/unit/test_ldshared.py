"""gpuhookd's table of what its processes read of libraries (apply/ldshared.py): by inode and times, shared
across forks, a torn or changed entry never taken."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from gpuhook.apply import ldelf, ldshared
from gpuhook.apply.ldelf import UNKNOWN, LibraryInfo, sample_library

INFO = LibraryInfo(ldelf.FLAG_X8664_LIB64 | ldelf.FLAG_ELF_LIBC6, b"libfoo.so.1", 2)


def _library(path: Path, soname: bytes = b"libfoo.so.1") -> os.stat_result:
    path.write_bytes(sample_library(soname))
    return os.stat(path)


def test_an_answer_is_found_again_and_a_changed_file_is_not(tmp_path: Path) -> None:
    table = ldshared.Shared()
    st = _library(tmp_path / "libfoo.so.1.0")
    assert table.get(st) is UNKNOWN
    table.put(st, INFO)
    assert table.get(st) == INFO
    other = _library(tmp_path / "libnot.so.1")
    table.put(other, None)  # not a library: that is an answer too
    assert table.get(other) is None
    (tmp_path / "libfoo.so.1.0").write_bytes(sample_library(b"libbar.so.2"))  # same inode, new times
    assert table.get(os.stat(tmp_path / "libfoo.so.1.0")) is UNKNOWN


def test_a_file_of_an_overlayfs_lower_layer_is_known_in_every_mount_of_it(tmp_path: Path) -> None:
    """Each container's overlayfs mount shows the image's file under its own st_dev, with the file's inode
    number and times: one file for the table."""
    lower = tmp_path / "lower"
    lower.mkdir()
    st = _library(lower / "libfoo.so.1.0")
    table = ldshared.Shared()
    table.put(st, INFO)
    mounts = []
    try:
        for n in range(2):  # two containers of the image, running at once
            upper, work, merged = (tmp_path / f"{part}{n}" for part in ("upper", "work", "merged"))
            for d in (upper, work, merged):
                d.mkdir()
            subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                            f"lowerdir={lower},upperdir={upper},workdir={work}", str(merged)], check=True)
            mounts.append(merged)
        seen = [(shown.st_dev, table.get(shown)) for shown in (os.stat(m / "libfoo.so.1.0") for m in mounts)]
    finally:
        for merged in mounts:
            subprocess.run(["umount", str(merged)], check=True)
    assert len({st.st_dev, seen[0][0], seen[1][0]}) == 3
    assert [answer for _, answer in seen] == [INFO, INFO]


def test_a_torn_slot_is_read_as_unknown(tmp_path: Path) -> None:
    table = ldshared.Shared()
    st = _library(tmp_path / "libfoo.so.1.0")
    table.put(st, INFO)
    region = table._region  # a byte of the slot flipped, as a concurrent writer's would be
    start = next(s for s in range(0, len(region), ldshared.SLOT) if region[s:s + 4] != bytes(4))
    region[start + ldshared.SLOT - 1] ^= 0xFF
    assert table.get(st) is UNKNOWN


def test_a_soname_too_long_for_a_slot_is_not_kept(tmp_path: Path) -> None:
    table = ldshared.Shared()
    st = _library(tmp_path / "libfoo.so.1.0")
    table.put(st, LibraryInfo(INFO.flags, b"lib" + b"x" * ldshared.SLOT + b".so.1", 0))
    assert table.get(st) is UNKNOWN
    table.put(st, LibraryInfo(INFO.flags, None, 0))  # no SONAME at all: kept
    assert table.get(st) == LibraryInfo(INFO.flags, None, 0)


def test_what_a_forked_process_keeps_its_parent_and_siblings_find(tmp_path: Path) -> None:
    table = ldshared.Shared()
    paths = [tmp_path / f"lib{n}.so.1" for n in range(200)]
    stats = [_library(p, p.name.encode()) for p in paths]
    pid = os.fork()
    if pid == 0:  # the child: an apply child reading the image
        try:
            for st, path in zip(stats, paths, strict=True):
                table.put(st, LibraryInfo(INFO.flags, path.name.encode(), 0))
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    found = [table.get(st) for st in stats]
    # two slots a key: at most a few of 200 files collide out of the 8192 slots
    assert sum(f is UNKNOWN for f in found) <= 3
    assert all(f == LibraryInfo(INFO.flags, p.name.encode(), 0) for f, p in zip(found, paths, strict=True)
               if f is not UNKNOWN)

"""The sealed copy of the host ldconfig, made per start or once ahead (gpuhookd)."""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

import pytest

from gpuhook.apply import ldconfig
from gpuhook.errors import ApplyError

HOST_LDCONFIG = Path("/sbin/ldconfig")
ALL_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def contents(fd: int) -> bytes:
    """Everything in *fd*, read from offset 0."""
    return os.pread(fd, os.fstat(fd).st_size + 1, 0)


@pytest.fixture(autouse=True)
def _nothing_sealed_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ldconfig, "_SEALED", {})


def test_copy_is_sealed_and_identical() -> None:
    """What runs is a copy nothing can change, byte for byte the host binary."""
    fd = ldconfig.open_ldconfig(HOST_LDCONFIG)
    try:
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & ALL_SEALS == ALL_SEALS
        assert contents(fd) == HOST_LDCONFIG.read_bytes()
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
    finally:
        os.close(fd)


def test_dynamic_or_foreign_binary_is_refused(tmp_path: Path) -> None:
    """A dynamically linked ldconfig would load the container's libc after chroot."""
    with pytest.raises(ApplyError, match="dynamically linked"):
        ldconfig.open_ldconfig(Path("/bin/true"))
    script = tmp_path / "ldconfig"
    script.write_text("#!/bin/sh\n" + "#" * 64)
    with pytest.raises(ApplyError, match=f"^open ldconfig {script}: is not a 64-bit ELF executable$"):
        ldconfig.open_ldconfig(script)


def test_copy_made_ahead_is_reused_until_the_binary_changes(tmp_path: Path) -> None:
    """gpuhookd seals once; each start gets that copy while the binary's identity holds, a fresh
    copy of the new binary once it is rewritten."""
    binary = tmp_path / "ldconfig"
    shutil.copy2(HOST_LDCONFIG, binary)
    ldconfig.seal_ahead(binary)
    [ahead] = ldconfig._SEALED.values()
    first = ldconfig.open_ldconfig(binary)
    try:
        assert os.fstat(first).st_ino == os.fstat(ahead).st_ino  # the same memfd, duplicated
    finally:
        os.close(first)
    binary.write_bytes(HOST_LDCONFIG.read_bytes() + b"\0" * 16)  # an upgrade rewrites it
    second = ldconfig.open_ldconfig(binary)
    try:
        assert os.fstat(second).st_ino != os.fstat(ahead).st_ino
        assert contents(second) == binary.read_bytes()
    finally:
        os.close(second)

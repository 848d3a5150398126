"""gpuhook.sys.pathrs: openat2 and its O_PATH walker fallback agree on a hostile root."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from gpuhook.sys import pathrs

IN_ROOT = pathrs.RESOLVE_IN_ROOT | pathrs.RESOLVE_NO_MAGICLINKS


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """security.md §3.2's hostile root, next to a host secret."""
    base = tmp_path_factory.mktemp("hostile")
    (base / "HOSTSECRET").write_text("secret")
    root = base / "root"
    for d in ("etc", "usr/lib64", "usr/lib", "dir/sub"):
        (root / d).mkdir(parents=True)
    (root / "etc/shadow").write_text("container shadow")
    (root / "usr/lib/x86_64-linux-gnu").symlink_to("/etc")
    (root / "evil_rel").symlink_to("../../../../../../../../..")
    (root / "dev").mkdir()
    (root / "dev/nvidia0").symlink_to("/etc/shadow")
    (root / "loopa").symlink_to("loopb")
    (root / "loopb").symlink_to("loopa")
    (root / "lib64").symlink_to("usr/lib64")
    (root / "file").write_text("x")
    for i in range(41):
        (root / f"chain{i}").symlink_to(f"chain{i + 1}" if i < 40 else "etc")
    return root


CASES = [
    ("usr/lib/x86_64-linux-gnu", os.O_PATH | os.O_DIRECTORY, IN_ROOT),
    ("usr/lib/x86_64-linux-gnu/shadow", os.O_PATH, IN_ROOT),
    ("evil_rel/HOSTSECRET", os.O_PATH, IN_ROOT),
    ("../../HOSTSECRET", os.O_PATH, IN_ROOT),
    ("dir/sub/../../../etc", os.O_PATH | os.O_DIRECTORY, IN_ROOT),
    ("dev/nvidia0", os.O_PATH | os.O_NOFOLLOW, IN_ROOT),
    ("dev/nvidia0", os.O_PATH, IN_ROOT),
    ("dev/nvidia0", os.O_RDONLY, IN_ROOT),
    ("loopa", os.O_PATH, IN_ROOT),
    ("lib64", os.O_PATH | os.O_DIRECTORY, IN_ROOT),
    ("lib64", os.O_PATH | os.O_DIRECTORY, IN_ROOT | pathrs.RESOLVE_NO_SYMLINKS),
    ("chain1", os.O_PATH, IN_ROOT),
    ("chain0", os.O_PATH, IN_ROOT),
    ("file/x", os.O_PATH, IN_ROOT),
    ("file", os.O_PATH | os.O_DIRECTORY, IN_ROOT),
    ("etc/shadow", os.O_RDONLY, IN_ROOT),
    ("", os.O_PATH | os.O_DIRECTORY, IN_ROOT),
]


def _outcome(opener, root: Path, path: str, flags: int, resolve: int) -> str:  # type: ignore[no-untyped-def]
    """'-> <path relative to root>' or the errno name."""
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        fd = opener(root_fd, path, flags, resolve)
    except OSError as err:
        return errno.errorcode[err.errno or 0]
    finally:
        os.close(root_fd)
    try:
        return "-> " + os.path.relpath(pathrs.fd_path(fd), root)
    finally:
        os.close(fd)


@pytest.mark.parametrize(("path", "flags", "resolve"), CASES, ids=[f"{c[0] or '.'}-{c[1]:o}-{c[2]}" for c in CASES])
def test_walker_agrees_with_openat2(hostile: Path, path: str, flags: int, resolve: int) -> None:
    """Every hostile lookup gives the same object (or the same errno) from the kernel and the walker."""
    kernel = _outcome(pathrs.openat2, hostile, path, flags, resolve)
    walker = _outcome(pathrs.walk_in_root, hostile, path, flags, resolve)
    assert walker == kernel
    assert "HOSTSECRET" not in kernel and not kernel.startswith("-> ..")


def test_confinement_results(hostile: Path) -> None:
    """The headline answers: absolute links stay inside, loops and 41 links are ELOOP, 40 work."""
    assert _outcome(pathrs.walk_in_root, hostile, "usr/lib/x86_64-linux-gnu", os.O_PATH, IN_ROOT) == "-> etc"
    assert _outcome(pathrs.walk_in_root, hostile, "loopa", os.O_PATH, IN_ROOT) == "ELOOP"
    assert _outcome(pathrs.walk_in_root, hostile, "chain0", os.O_PATH, IN_ROOT) == "ELOOP"
    assert _outcome(pathrs.walk_in_root, hostile, "chain1", os.O_PATH, IN_ROOT) == "-> etc"


def test_nul_bytes_are_refused(hostile: Path) -> None:
    """A raw C call would stop at the NUL and open etc/shadow; both paths refuse instead."""
    root_fd = os.open(hostile, os.O_PATH | os.O_DIRECTORY)
    try:
        for opener in (pathrs.openat2, pathrs.walk_in_root):
            with pytest.raises(ValueError, match="NUL"):
                opener(root_fd, "etc/shadow\0../../HOSTSECRET", os.O_PATH, IN_ROOT)
    finally:
        os.close(root_fd)


def test_same_namespace() -> None:
    """Our own mount namespace file is ours; it is not our network namespace."""
    fd = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    try:
        assert pathrs.same_namespace(fd, "mnt")
        assert not pathrs.same_namespace(fd, "net")
    finally:
        os.close(fd)

"""Where the benchmark's container rootfs copies live: a journaled ext4 of their own.

An engine gives each container a fresh upper layer on its storage filesystem, usually ext4 or
xfs with a journal. This VM's root filesystem is ext4 *without* a journal, where the inode
allocator skips every inode freed in the last ~35 s (``recently_deleted``, nojournal mode only),
reading its inode-table block each time: with a rootfs copied and removed per run, each file
created (runc's mount targets, the hook's, the ld.so.cache) took ~200 µs instead of ~10 µs, a
cost no journaled host has. So the copies go to a small ext4 made with mkfs's defaults (journal
included), on a loop device backed by tmpfs; where loop devices are unavailable, to a tmpfs.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

IMAGE_SIZE = "256M"


@contextlib.contextmanager
def scratch_filesystem(mountpoint: Path, image: Path) -> Iterator[str]:
    """Mount a fresh journaled ext4 (its image file *image*, on tmpfs) at *mountpoint*, else a tmpfs; yields
    which one it is, in words; unmounted and removed on exit."""
    unmount(mountpoint)  # one a killed run left
    mountpoint.mkdir(parents=True, exist_ok=True)
    what = _mount_ext4(mountpoint, image)
    if what is None:
        _mount_tmpfs(mountpoint)
        what = "tmpfs (no loop device for an ext4)"
    try:
        yield what
    finally:
        unmount(mountpoint)
        image.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            mountpoint.rmdir()


@contextlib.contextmanager
def tmpfs(mountpoint: Path) -> Iterator[None]:
    """A fresh tmpfs at *mountpoint*, as a real host's /run is one (this VM's is not); unmounted on exit."""
    unmount(mountpoint)  # one a killed run left
    mountpoint.mkdir(parents=True, exist_ok=True)
    _mount_tmpfs(mountpoint)
    try:
        yield
    finally:
        unmount(mountpoint)
        with contextlib.suppress(OSError):
            mountpoint.rmdir()


def _mount_tmpfs(mountpoint: Path) -> None:
    _run("mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", str(mountpoint))


def unmount(mountpoint: Path) -> None:
    """Detach whatever is mounted at *mountpoint* (nothing: nothing happens); its loop device goes with it."""
    subprocess.run(["umount", "--lazy", str(mountpoint)], check=False, capture_output=True)


def _mount_ext4(mountpoint: Path, image: Path) -> str | None:
    """The ext4 on a loop device, mounted; None where that cannot be made here."""
    if shutil.which("mkfs.ext4") is None or not Path("/dev/loop-control").exists():
        return None
    image.unlink(missing_ok=True)
    try:
        _run("truncate", "-s", IMAGE_SIZE, str(image))
        _run("mkfs.ext4", "-q", "-F", str(image))
        _run("mount", "-o", "loop", str(image), str(mountpoint))
    except subprocess.CalledProcessError:
        image.unlink(missing_ok=True)
        return None
    return f"ext4 with a journal, {IMAGE_SIZE} on a loop device"


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)

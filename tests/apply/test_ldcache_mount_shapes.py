"""The cache gpuhook writes under the mounts engines really add, from the rootfs's own disk (issue #31).

A plain-directory rootfs (a runc bundle, containerd's native snapshotter, docker's or podman's vfs
driver) sits on the host's disk, and so do the files the engine binds into it: kubelet's
``/dev/termination-log``, ``/etc/hosts``, ``/etc/resolv.conf``, ``/etc/hostname``, a ``/dev/shm``
directory, and the driver libraries gpuhook itself mounts. What is under the rootfs's ``/proc``,
``/sys`` and ``/dev`` must read as absent (the sandboxed ldconfig covers those three), and nothing else:
the cache must equal what the host's real ldconfig writes for the image as built, with the driver's
libraries in it. Real mounts, in a private mount namespace.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from gpuhook.apply.ldelf import sample_library
from gpuhook.apply.ldprofile import ask
from gpuhook.apply.ldwrite import LdconfigProfile, hidden_devices, write_ldcache
from gpuhook.apply.rootfs import RootFs
from gpuhook.ldcache import parse_ldcache

from .nsutil import in_private_mount_ns

LDCONFIG = Path("/sbin/ldconfig")
LIBS = "usr/lib/x86_64-linux-gnu"
#: the driver's libraries, bound from the host's disk as the plan mounts them
DRIVER = {"libcuda.so.550.54.15": b"libcuda.so.1", "libnvidia-ml.so.550.54.15": b"libnvidia-ml.so.1"}
#: the image's own libraries
IMAGE = {f"{LIBS}/libfoo.so.2.0": b"libfoo.so.2", f"{LIBS}/libbar.so.1": b"libbar.so.1",
         "usr/local/lib/libloc.so.3.1": b"libloc.so.3"}
#: files the engine binds over the image's, from the host's disk
ETC_BINDS = ("etc/hosts", "etc/resolv.conf", "etc/hostname")
#: a volume from the host's disk (a hostPath, an emptyDir) holding libraries, named in the image's configuration
VOLUME = "opt/volume/lib"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts, and ldconfig -r chroots: needs root")


@pytest.fixture(scope="module")
def profile() -> LdconfigProfile:
    answer = ask(LDCONFIG)
    assert answer.profile is not None, answer.why_not
    return answer.profile


def _put(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _image(root: Path) -> None:
    """A Debian-like image; its configuration also names a directory under /dev and links a library there."""
    _put(root / "etc/ld.so.conf", b"include /etc/ld.so.conf.d/*.conf\n")
    _put(root / "etc/ld.so.conf.d/libc.conf", f"/usr/local/lib\n/{VOLUME}\n".encode())
    _put(root / "etc/ld.so.conf.d/x86_64-linux-gnu.conf", f"/{LIBS}\n/dev/shm/lib\n".encode())
    for rel, soname in IMAGE.items():
        _put(root / rel, sample_library(soname))
    (root / LIBS / "libvia.so.1").symlink_to("/dev/shm/lib/libplanted.so.1")
    for rel in ETC_BINDS:
        _put(root / rel, b"the image's own\n")
    for top in ("proc", "sys", "dev", VOLUME):
        (root / top).mkdir(parents=True)


def _host(host: Path) -> None:
    """The host's side, on the same disk as a plain-directory rootfs: kubelet's and the engine's files,
    a /dev/shm directory holding a library, the driver."""
    _put(host / "termination-log", b"")
    for rel in ETC_BINDS:
        _put(host / os.path.basename(rel), b"from the host\n")
    _put(host / "shm/lib/libplanted.so.1", sample_library(b"libplanted.so.1"))
    _put(host / "volume/libvol.so.1", sample_library(b"libvol.so.1"))
    for name, soname in DRIVER.items():
        _put(host / "driver" / name, sample_library(soname))


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


def _engine_mounts(rootfs: Path, host: Path) -> None:
    """What runc (rootless: /sys bound) and kubelet mount, then the driver libraries as gpuhook mounts them."""
    _mount("-t", "proc", "proc", str(rootfs / "proc"))
    _mount("--rbind", "/sys", str(rootfs / "sys"))
    _mount("-t", "tmpfs", "-o", "mode=755", "tmpfs", str(rootfs / "dev"))
    (rootfs / "dev/shm").mkdir()
    _mount("--bind", str(host / "shm"), str(rootfs / "dev/shm"))
    (rootfs / "dev/termination-log").touch()
    _mount("--bind", str(host / "termination-log"), str(rootfs / "dev/termination-log"))
    for rel in ETC_BINDS:
        _mount("--bind", str(host / os.path.basename(rel)), str(rootfs / rel))
    _mount("--bind", str(host / "volume"), str(rootfs / VOLUME))
    for name in DRIVER:
        (rootfs / LIBS / name).touch()
        _mount("--bind", "-o", "ro", str(host / "driver" / name), str(rootfs / LIBS / name))


Outcome = tuple[bytes, dict[str, str], dict[str, bool]]


def _write_under_mounts(rootfs: Path, host: Path, profile: LdconfigProfile) -> Outcome:
    """In the private namespace: the engine's mounts, gpuhook's cache; the cache, the links in the
    libraries' directory, and for each driver library whether its SONAME's entry leads to the host's file."""
    _engine_mounts(rootfs, host)
    fs = RootFs(os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
    write_ldcache(fs, (f"/{LIBS}",), profile, hidden_devices(fs), deadline=time.monotonic() + 60)
    cache = (rootfs / "etc/ld.so.cache").read_bytes()
    by_key = {e.key: e.value for e in parse_ldcache(cache)}
    resolves = {}
    for name, soname in DRIVER.items():
        value = by_key.get(soname.decode())
        driver = os.stat(host / "driver" / name)
        resolves[name] = value is not None and os.path.samestat(os.stat(rootfs / value.lstrip("/")), driver)
    return cache, _links(rootfs / LIBS), resolves


def _links(directory: Path) -> dict[str, str]:
    return {e.name: os.readlink(e.path) for e in os.scandir(directory) if e.is_symlink()}


def _ldconfigs_cache(tmp_path: Path) -> tuple[bytes, dict[str, str]]:
    """The host's real ldconfig over a copy of the image with the driver's files and the volume's at their
    container paths, and nothing under /proc, /sys and /dev."""
    twin = tmp_path / "twin"
    _image(twin)
    shutil.copytree(tmp_path / "host/volume", twin / VOLUME, dirs_exist_ok=True)
    for name in DRIVER:
        shutil.copy(tmp_path / "host/driver" / name, twin / LIBS / name)
    subprocess.run([str(LDCONFIG), "-r", str(twin), "-f", "/etc/ld.so.conf", "-C", "/etc/ld.so.cache", f"/{LIBS}"],
                   check=True, env={"LC_ALL": "C"}, capture_output=True, timeout=60)
    return (twin / "etc/ld.so.cache").read_bytes(), _links(twin / LIBS)


def _plain_directory(tmp_path: Path) -> Path:
    rootfs = tmp_path / "rootfs"
    _image(rootfs)
    return rootfs


def _overlayfs(tmp_path: Path) -> Path:
    """The image as a lower layer under overlayfs, as a snapshotter mounts it (mounted in the test's namespace:
    the child that writes the cache mounts it itself)."""
    _image(tmp_path / "image")
    for name in ("rootfs", "upper", "work"):
        (tmp_path / name).mkdir()
    return tmp_path / "rootfs"


@pytest.mark.parametrize("shape", ["plain-directory", "overlayfs"])
def test_the_engines_binds_from_the_rootfs_disk_leave_the_cache_whole(shape: str, tmp_path: Path,
                                                                      profile: LdconfigProfile) -> None:
    """Binds under /dev, /proc and /sys from the disk the rootfs (or the driver) is on hide nothing but
    what lies under those three: the cache and links equal the host ldconfig's over the image as built,
    and each driver library's SONAME leads to the host's file."""
    _host(tmp_path / "host")
    rootfs = _plain_directory(tmp_path) if shape == "plain-directory" else _overlayfs(tmp_path)

    def scenario() -> Outcome:
        if shape == "overlayfs":
            _mount("-t", "overlay", "overlay", "-o", f"lowerdir={tmp_path / 'image'},upperdir={tmp_path / 'upper'},"
                   f"workdir={tmp_path / 'work'}", str(rootfs))
        return _write_under_mounts(rootfs, tmp_path / "host", profile)

    ours, our_links, resolves = in_private_mount_ns(scenario)
    theirs, their_links = _ldconfigs_cache(tmp_path)
    cached = {e.key for e in parse_ldcache(ours)}
    assert resolves == dict.fromkeys(DRIVER, True), cached
    assert {*(s.decode() for s in IMAGE.values()), "libvol.so.1"} <= cached
    assert "libplanted.so.1" not in cached and "libvia.so.1" not in cached  # under /dev: absent, as the sandbox hid it
    assert ours == theirs
    assert our_links == their_links

"""Build a minimal busybox + glibc container root filesystem for real-engine tests.

The rootfs looks like a small Debian image (or, with ``debian=False``, a non-Debian one): busybox
applets in ``/bin``, the host's own glibc in the multiarch directories (real directories, not the
usr-merged symlinks of the host, so that a hook sees the classic layout), an ``/etc/ld.so.cache``
made by the host's ldconfig, and two probe programs:

* ``/usr/local/bin/dltest NAME...``: ``dlopen(NAME, RTLD_NOW)`` each name, print ``OK``/``FAIL``.
* ``/usr/local/bin/devopen PATH...``: ``open(PATH, O_RDWR)`` each path, print ``OK`` or the errno name.

``build_rootfs`` builds once per content hash of every input (host binaries, C sources, this
module) into ``cache_dir`` and publishes with an atomic ``rename``; containers get their own
writable copy from ``copy_rootfs`` so a hook's mount targets never leak into the cache.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from integration.engines import MissingTool, install_hint, require_tool

__all__ = [
    "BUSYBOX_APPLETS_REQUIRED",
    "DEBIAN_VERSION",
    "MULTIARCH",
    "build_rootfs",
    "copy_rootfs",
    "mount_image",
]

MULTIARCH = "x86_64-linux-gnu"
DEBIAN_VERSION = "12.7"
LOADER = "ld-linux-x86-64.so.2"

# Applets the tests rely on; checked after install so a busybox without them fails loudly.
BUSYBOX_APPLETS_REQUIRED = ("sh", "ls", "cat", "echo", "mknod", "stat", "readlink", "test", "mount")

_HERE = Path(__file__).resolve().parent
_TESTPROGS = _HERE / "testprogs"
_BUSYBOX = Path("/bin/busybox")
_LDCONFIG = Path("/sbin/ldconfig")
_HOST_LIBDIR = Path("/lib") / MULTIARCH
# glibc runtime pieces a dynamically linked test program or fake driver library may need.
# libdl/libpthread/librt are stubs since glibc 2.34, but old-style binaries still list them.
_GLIBC_LIBS = ("libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1")
# Stale temp build dirs of killed builders are removed after this long.
_STALE_TMP_S = 3600.0

_DIRS = (
    "bin",
    "sbin",
    "dev",
    "etc",
    "etc/ld.so.conf.d",
    f"lib/{MULTIARCH}",
    "lib64",
    "proc",
    "root",
    "run",
    "sys",
    "tmp",
    "usr/bin",
    "usr/sbin",
    f"usr/lib/{MULTIARCH}",
    "usr/local/bin",
    f"usr/local/lib/{MULTIARCH}",
    "var/tmp",
)

_PASSWD = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
_GROUP = "root:x:0:\ntty:x:5:\nvideo:x:44:\nnogroup:x:65534:\n"
# Same directory list as Debian 12's /etc/ld.so.conf.d/x86_64-linux-gnu.conf.
_MULTIARCH_CONF = (
    "# Multiarch support\n"
    f"/usr/local/lib/{MULTIARCH}\n"
    f"/lib/{MULTIARCH}\n"
    f"/usr/lib/{MULTIARCH}\n"
)


@dataclass(frozen=True, slots=True)
class _Inputs:
    """Everything a rootfs is built from; its digest names the cache entry."""

    debian: bool
    busybox: Path
    ldconfig: Path
    glibc: tuple[Path, ...]
    sources: tuple[Path, ...]

    def digest(self) -> str:
        """Content hash of all input files plus the layout variant."""
        h = hashlib.sha256(f"gpuhook-rootfs v1 debian={self.debian}\n".encode())
        # Names, not paths: two checkouts of the same sources share a cache entry.
        for path in (self.busybox, self.ldconfig, *self.glibc, *self.sources):
            h.update(f"{path.name}\0".encode())
            h.update(hashlib.sha256(path.read_bytes()).digest())
        return h.hexdigest()[:16]


# --- public API -------------------------------------------------------------------------------


def build_rootfs(cache_dir: Path, *, debian: bool = True) -> Path:
    """Return a cached rootfs under ``cache_dir``, building it first if needed (race-safe)."""
    inputs = _collect_inputs(debian)
    final = Path(cache_dir) / f"rootfs-{'debian' if debian else 'generic'}-{inputs.digest()}"
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(final.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        _populate(tmp, inputs)
        # rename(2) of a directory is atomic, and fails with ENOTEMPTY/EEXIST when a racing
        # builder published first; its tree is equivalent (same digest), so keep it.
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def copy_rootfs(src: Path, dst: Path) -> Path:
    """Copy a rootfs for one container, preserving symlinks, modes and times; ``dst`` must be new or empty."""
    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(f"copy_rootfs: destination {dst} is not empty")
    _copy_tree(Path(src), dst)
    return dst


def mount_image(image: Path, bundle: Path) -> Path:
    """*image* as the rootfs of *bundle*, on overlayfs with a new upper layer (as engines mount an image, so
    that its files are the image's own inodes in every container); ``umount`` it after the run."""
    for name in ("rootfs", "upper", "work"):
        (bundle / name).mkdir(parents=True)
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                    f"lowerdir={image},upperdir={bundle / 'upper'},workdir={bundle / 'work'}", str(bundle / "rootfs")],
                   check=True, capture_output=True)
    return bundle / "rootfs"


def _copy_tree(src: Path, dst: Path) -> None:
    """Recursive copy: files are copied, symlinks hard-linked, directory metadata set last."""
    dst.mkdir(parents=True, exist_ok=True)
    with os.scandir(src) as entries:
        for entry in entries:
            target = dst / entry.name
            if entry.is_symlink():
                _link_symlink(Path(entry.path), target)
            elif entry.is_dir():
                _copy_tree(Path(entry.path), target)
            else:
                # Real copies, so a container (or a buggy hook) writing a file never edits the cache.
                shutil.copy2(entry.path, target, follow_symlinks=False)
    shutil.copystat(src, dst)


def _link_symlink(src: Path, dst: Path) -> None:
    """Hard-link the symlink inode itself, or recreate the symlink across filesystems."""
    # Creating an inode costs ~0.3 ms on these VMs' ext4, so 270 busybox applet symlinks took
    # 65 ms; a hard link to the symlink (linkat without AT_SYMLINK_FOLLOW) takes ~5 us. Safe to
    # share: a symlink cannot be changed in place, only replaced, which breaks the link.
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EMLINK):  # other filesystem; ext4's 65000-link cap
            raise
        dst.symlink_to(os.readlink(src))
        shutil.copystat(src, dst, follow_symlinks=False)


# --- inputs -----------------------------------------------------------------------------------


def _collect_inputs(debian: bool) -> _Inputs:
    """Locate the host files the rootfs is made of, failing loudly when one is missing."""
    busybox = _require_file(_BUSYBOX, "busybox")
    if not _is_static_elf(busybox):
        # A dynamic busybox (Debian's "busybox" package) would need the host's loader paths.
        raise MissingTool(f"{busybox} is not statically linked; fix: {install_hint('busybox')}")
    glibc = tuple(_require_file(_HOST_LIBDIR / name, "libc6") for name in (LOADER, *_GLIBC_LIBS))
    sources = (Path(__file__).resolve(), _TESTPROGS / "dltest.c", _TESTPROGS / "devopen.c")
    return _Inputs(
        debian=debian,
        busybox=busybox,
        ldconfig=_require_file(_LDCONFIG, "ldconfig"),
        glibc=glibc,
        sources=sources,
    )


def _require_file(path: Path, tool: str) -> Path:
    """Return ``path`` if it exists, else raise MissingTool with the install command for ``tool``."""
    if not path.exists():
        raise MissingTool(f"{path} is missing; fix: {install_hint(tool)}")
    return path


def _is_static_elf(path: Path) -> bool:
    """True if the ELF64 file has no PT_INTERP program header (no dynamic loader needed)."""
    with path.open("rb") as f:
        ehdr = f.read(64)
        if ehdr[:4] != b"\x7fELF" or ehdr[4] != 2:
            return False
        phoff, = struct.unpack_from("<Q", ehdr, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", ehdr, 0x36)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    pt_interp = 3
    return all(struct.unpack_from("<I", table, i * phentsize)[0] != pt_interp for i in range(phnum))


def _remove_stale_tmp(parent: Path) -> None:
    """Delete temp build dirs left by builders that were killed long ago."""
    now = time.time()
    for entry in parent.glob(".tmp-rootfs-*"):
        try:
            if now - entry.lstat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(entry, ignore_errors=True)
        except FileNotFoundError:
            pass


# --- build steps ------------------------------------------------------------------------------


def _populate(root: Path, inputs: _Inputs) -> None:
    """Fill the empty directory ``root`` with the complete rootfs."""
    root.chmod(0o755)
    for rel in _DIRS:
        (root / rel).mkdir(mode=0o755, parents=True, exist_ok=True)
    if not inputs.debian:
        (root / "usr/lib64").mkdir(mode=0o755)
    (root / "tmp").chmod(0o1777)
    (root / "var/tmp").chmod(0o1777)
    (root / "var/run").symlink_to("../run")
    _install_busybox(root, inputs.busybox)
    _install_glibc(root, inputs.glibc)
    _install_etc(root, inputs.debian)
    _compile_testprogs(root)
    # The container's own ldconfig, as in real Debian images (hooks must not rely on it).
    shutil.copy2(inputs.ldconfig, root / "sbin/ldconfig")
    _run_ldconfig(root, inputs.ldconfig)


def _install_busybox(root: Path, busybox: Path) -> None:
    """Copy the static busybox and symlink every applet it provides into /bin."""
    shutil.copy2(busybox, root / "bin/busybox")
    (root / "bin/busybox").chmod(0o755)
    applets = _check_output([str(busybox), "--list"]).split()
    missing = sorted(set(BUSYBOX_APPLETS_REQUIRED) - set(applets))
    if missing:
        raise MissingTool(f"{busybox} lacks applets {missing}; fix: {install_hint('busybox')}")
    for applet in applets:
        if applet != "busybox" and "/" not in applet:
            (root / "bin" / applet).symlink_to("busybox")


def _install_glibc(root: Path, libs: Iterable[Path]) -> None:
    """Copy the host glibc into /lib/<multiarch>, with Debian's absolute /lib64 loader link."""
    libdir = root / "lib" / MULTIARCH
    for lib in libs:
        shutil.copy2(lib.resolve(), libdir / lib.name)
    # Debian ships /lib64/ld-linux-x86-64.so.2 as an absolute symlink; keep it so that hooks
    # meet the absolute-symlink-inside-rootfs case they must resolve within the root.
    (root / "lib64" / LOADER).symlink_to(f"/lib/{MULTIARCH}/{LOADER}")


def _install_etc(root: Path, debian: bool) -> None:
    """Write the small /etc: release marker, ld.so.conf(.d), passwd and group."""
    etc = root / "etc"
    if debian:
        (etc / "debian_version").write_text(DEBIAN_VERSION + "\n")
    (etc / "ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
    (etc / "ld.so.conf.d" / f"{MULTIARCH}.conf").write_text(_MULTIARCH_CONF)
    if not debian:
        # Non-Debian distributions keep 64-bit libraries in /usr/lib64.
        (etc / "ld.so.conf.d" / "lib64.conf").write_text("/usr/lib64\n")
    (etc / "passwd").write_text(_PASSWD)
    (etc / "group").write_text(_GROUP)
    (etc / "hostname").write_text("rig\n")


def _compile_testprogs(root: Path) -> None:
    """Compile dltest (dynamic, against the copied glibc) and devopen (static) into /usr/local/bin."""
    gcc = require_tool("gcc")
    bindir = root / "usr/local/bin"
    cflags = ["-O2", "-Wall", "-Wextra", "-Werror", "-std=gnu11"]
    # The host glibc is the one copied in, so a host-linked binary runs unchanged in the rootfs.
    _check_output([gcc, *cflags, "-o", str(bindir / "dltest"), str(_TESTPROGS / "dltest.c")])
    _check_output([gcc, *cflags, "-static", "-o", str(bindir / "devopen"), str(_TESTPROGS / "devopen.c")])
    _check_deps_copied(root, bindir / "dltest")


def _check_deps_copied(root: Path, binary: Path) -> None:
    """Fail if ``binary`` needs a shared library that is not in the rootfs's glibc directory."""
    listing = _check_output([str(_HOST_LIBDIR / LOADER), "--list", str(binary)])
    for name in _needed_names(listing):
        if not (root / "lib" / MULTIARCH / name).exists():
            raise RuntimeError(f"{binary.name} needs {name}, which the rootfs builder does not copy")


def _needed_names(ld_list_output: str) -> Iterator[str]:
    """Yield the library file names from ``ld.so --list`` output (skipping the vDSO and loader)."""
    for line in ld_list_output.splitlines():
        left, sep, _ = line.strip().partition(" => ")
        if sep and not left.startswith("linux-vdso"):
            yield left


def _run_ldconfig(root: Path, ldconfig: Path) -> None:
    """Generate /etc/ld.so.cache (and SONAME links) with the host ldconfig chrooted into ``root``."""
    _check_output([str(ldconfig), "-r", str(root)])
    if not (root / "etc/ld.so.cache").is_file():
        raise RuntimeError(f"{ldconfig} -r {root} did not write etc/ld.so.cache")


def _check_output(argv: list[str]) -> str:
    """Run ``argv`` and return stdout, raising with stderr included when it fails."""
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout

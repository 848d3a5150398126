"""What the sandboxed ldconfig would open that is not a regular file, found before it runs.

glibc's ldconfig (elf/ldconfig.c) ``fopen``s its configuration file and every match of its
``include`` globs, ``open``s every *symlink* in the directories it scans (plain entries only
when ``d_type`` says DT_REG: a FIFO itself is skipped, one named through a symlink is not) and
creates ``/etc/ld.so.cache~`` and ``/var/cache/ldconfig/aux-cache~``. A FIFO at any of those
paths blocks it in ``open`` for as long as nobody writes to it. Device nodes are made harmless
by a nodev mount (``ldconfig._sandbox``); this module finds the rest, so that the sandbox can
mount an empty read-only file over each, in ldconfig's own mount namespace only.

It runs in the sandbox child after its chroot into the rootfs (so paths resolve exactly as
they will for ldconfig, symlinks confined to the rootfs, /proc /sys /dev hidden) and only
``stat``s and lists: nothing but regular files is opened, and those with O_NONBLOCK. The scan
over-approximates: a directory or file ldconfig would not open costs a listing, never a
refusal; anything it misses (an image changed from outside between this scan and ldconfig's
open) still meets ldconfig's deadline.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable, Sequence
from typing import Final

#: ldconfig's trusted directories on any architecture (and the triplet directories found in them)
_SYSTEM_DIRS: Final = ("/lib", "/usr/lib", "/lib64", "/usr/lib64", "/lib32", "/usr/lib32", "/libx32", "/usr/libx32")
_TRIPLET: Final = re.compile(r"[^/.]+-linux-[^/]+")
#: what ldconfig writes through open(O_WRONLY|O_CREAT|O_TRUNC): a FIFO there blocks it too
_WRITTEN: Final = ("/etc/ld.so.cache~", "/var/cache/ldconfig/aux-cache~")
#: is_hwcap_platform()'s names (glibc <= 2.36 descends into them) on x86, POWER, s390, Arm:
#: a superset, since an extra name only costs a listing
_HWCAP_DIRS: Final = frozenset((
    "tls", "x86_64", "i386", "i486", "i586", "i686", "haswell", "xeon_phi", "sse2", "avx512_1",
    "power4", "power5", "power5+", "power6", "power6x", "power7", "power8", "power9", "power10", "ppc970",
    "ppc-cell-be", "altivec", "vsx", "ppc405", "ppc440", "ppc464", "ppc476", "ppce300c3", "ppce500mc",
    "ppce5500", "ppce6500", "z900", "z990", "z9-109", "z10", "z196", "zEC12", "z13", "z14", "z15", "z16",
    "esan3", "zarch", "high_gprs", "v5l", "v6l", "v7l", "v8l", "vfp", "neon", "iwmmxt", "crunch", "aarch64",
))
_GLIBC_HWCAPS: Final = "glibc-hwcaps"
_BLANK: Final = re.compile(r"[ \t]")
_MAGIC: Final = re.compile(r"[*?\[\\]")
#: glob(3) features fnmatch does not share ([^...], classes, escapes): such a component matches anything
_LOOSE: Final = re.compile(r"\\|\[\^|\[:|\[\[")
#: more conf files than any image has (ldconfig's own include depth is bounded by its open files)
_MAX_CONFS: Final = 4096


def blocking_paths(conf: str, dirs: Sequence[str]) -> list[str]:
    """The paths (in the chroot we are in) that ldconfig run with ``-f conf`` over *dirs* would
    open and that are neither regular files nor directories: FIFOs, sockets, device nodes."""
    scan = _Scan()
    scan.conf(conf)
    for path in _WRITTEN:
        scan.special(path)
    for directory in (*dirs, *scan.dirs, *_SYSTEM_DIRS):
        scan.directory(_dir_path(directory), hwcaps=True)
    return scan.found


class _Scan:
    """One scan's state: the directories the configuration names, what was seen, what was found."""

    def __init__(self) -> None:
        self.dirs: list[str] = []
        self.found: list[str] = []
        self._confs: set[str] = set()
        self._scanned: set[tuple[int, int]] = set()

    def special(self, path: str) -> os.stat_result | None:
        """stat *path* (following symlinks); note it if it is neither a file nor a directory."""
        try:
            st = os.stat(path)
        except (OSError, ValueError):
            return None
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            self.found.append(path)
        return st

    def conf(self, path: str) -> None:
        """Parse a configuration file as parse_conf() does: includes, directories, comments. Each file once,
        however deep its include chain (a list of the files to read, not a recursion: a chain may be as
        deep as ldconfig's open files, past Python's recursion limit)."""
        pending = [path]
        while pending and len(self._confs) < _MAX_CONFS:
            path = pending.pop()
            if path in self._confs:
                continue
            self._confs.add(path)
            st = self.special(path)
            if st is None or not stat.S_ISREG(st.st_mode):
                continue
            for raw in _read(path, self.found).split(b"\n"):
                line = raw.split(b"#", 1)[0].lstrip(b" \t\n\v\f\r").decode("utf-8", "surrogateescape")
                if not line:
                    continue
                if line.startswith("include") and line[7:8] in (" ", "\t"):
                    pending += [m for pattern in _BLANK.split(line[8:]) if pattern for m in _include(path, pattern)]
                elif not (line[:5].lower() == "hwcap" and line[5:6] in (" ", "\t")):
                    self.dirs.append(line)

    def directory(self, path: str, *, hwcaps: bool) -> None:
        """Check a directory as search_dir() reads it, with its glibc-hwcaps and hwcap subdirectories."""
        try:
            st = os.stat(path)
            if not stat.S_ISDIR(st.st_mode) or (st.st_dev, st.st_ino) in self._scanned:
                return
            self._scanned.add((st.st_dev, st.st_ino))
            with os.scandir(path) as entries:
                listed = list(entries)
        except (OSError, ValueError):
            return  # ldconfig cannot list it either
        prefix = path.rstrip("/") + "/"
        # The hot loop of a start: d_type answers for all but the symlinks, which ldconfig stats
        # then opens unless they name a directory. A plain FIFO or node is skipped by ldconfig.
        for entry in listed:
            if entry.is_symlink():
                target = self.special(prefix + entry.name)
                if target is None or not stat.S_ISDIR(target.st_mode):
                    continue
            elif not hwcaps or not entry.is_dir(follow_symlinks=False):
                continue
            if not hwcaps:
                continue
            name = entry.name
            if name == _GLIBC_HWCAPS:
                for sub in _subdirs(prefix + name):
                    self.directory(sub, hwcaps=False)
            elif name in _HWCAP_DIRS or _TRIPLET.fullmatch(name):
                self.directory(prefix + name, hwcaps=True)


def _include(conf: str, pattern: str) -> list[str]:
    """The files an include of *pattern* in *conf* names (relative to *conf*'s directory unless absolute)."""
    if not pattern.startswith("/") and "/" in conf:
        pattern = f"{os.path.dirname(conf)}/{pattern}"
    return _glob(pattern)


def _dir_path(line: str) -> str:
    """add_dir_1(): the path before any ``=TYPE``, without trailing blanks or slashes."""
    path = line.split("=", 1)[0]
    while len(path) > 1 and (path[-1].isspace() or path[-1] == "/"):
        path = path[:-1]
    return path


def _read(path: str, found: list[str]) -> bytes:
    """A regular file's contents, opened without blocking (it may have been swapped for a FIFO)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return b""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            found.append(path)
            return b""
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _subdirs(path: str) -> Iterable[str]:
    try:
        with os.scandir(path) as entries:
            return [f"{path}/{e.name}" for e in entries if e.is_dir()]
    except OSError:
        return []


def _glob(pattern: str) -> list[str]:
    """glob(3) of *pattern*, or more: a component fnmatch cannot read like glob(3) matches every name."""
    from fnmatch import fnmatchcase

    absolute = pattern.startswith("/")
    paths = ["/" if absolute else ""]
    for part in (p for p in pattern.split("/") if p):
        if _MAGIC.search(part) is None:
            paths = [f"{base.rstrip('/')}/{part}" if base else part for base in paths]
            continue
        loose = _LOOSE.search(part) is not None
        matched = []
        for base in paths:
            try:
                with os.scandir(base or ".") as entries:
                    names = [e.name for e in entries]
            except OSError:
                continue
            matched += [f"{base.rstrip('/')}/{n}" if base else n for n in names if loose or fnmatchcase(n, part)]
        paths = matched
    return [p for p in paths if p not in ("", "/")]

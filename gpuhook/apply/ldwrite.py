"""The container's ld.so.cache written by gpuhook, equal to what the host's ldconfig writes.

Running ldconfig costs a start a fork, a mount namespace, a chroot and an exec (about 13 ms of
a GPU start, ``make bench``). This module does ldconfig's work itself, the way glibc 2.36's
elf/ldconfig.c does it when run as ``ldconfig -f /etc/ld.so.conf -C /etc/ld.so.cache DIR...``
chrooted in the rootfs (``ldconfig.run_ldconfig``):

* the directories: the command line's, then ``/etc/ld.so.conf`` with its ``include`` globs (in
  C-locale order), then the host ldconfig's built-in system directories (``LdconfigProfile``,
  read from the binary by ``ldprofile``); each counted once by device and inode, with its
  ``glibc-hwcaps/*`` subdirectories and, found while scanning, its legacy hwcap subdirectories
  (``x86_64``, ``haswell``, ``tls``, ...);
* per directory, one library per SONAME (a file before a link, else the newer name), the SONAME
  links it makes and the stale ``*.so.*`` links it removes, each change journalled in the
  ``RootFs`` so that an undo puts the image back (ldconfig itself could not);
* the cache, byte for byte (``ldcache.encode_ldcache``), through ``/etc/ld.so.cache~``
  renamed over ``/etc/ld.so.cache``. ldconfig's fsync is left out: the cache belongs to a
  container that a host crash ends anyway, and it costs a start milliseconds on a busy disk.
  So is its auxiliary cache (``/var/cache/ldconfig/aux-cache``), which only speeds up the next
  ldconfig run in the image.

What the sandbox gave ldconfig, this keeps: every path is resolved inside the rootfs (openat2
``RESOLVE_IN_ROOT``, no magic links), the rootfs's ``/proc``, ``/sys`` and ``/dev`` and every
kernel pseudo filesystem read as absent (the sandbox mounted empty tmpfs over the first three),
nothing but a regular file is opened for reading (a FIFO cannot block, a device node is never
opened), and nothing in the image is executed. ``ldprofile`` checks this reading against the
host's real ldconfig on a sample tree before a host uses it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final

from gpuhook.apply.ldelf import (FLAG_ELF, FLAG_ELF_LIBC5, FLAG_ELF_LIBC6, FLAG_LIBC4, UNKNOWN, LibraryInfo,
                                 implicit_soname, keep, known, read_library)
from gpuhook.apply.ldconfig import OPEN_FILES, STANDARD_FILES
from gpuhook.apply.rootfs import RootFs
from gpuhook.ldcache import CacheRecord, encode_ldcache, libcmp
from gpuhook.errors import ApplyError
from gpuhook.sys import pathrs

_IN_ROOT: Final = pathrs.RESOLVE_IN_ROOT | pathrs.RESOLVE_NO_MAGICLINKS
_FLAG_ANY: Final = -1
_LIB_TYPES: Final = {b"libc4": FLAG_LIBC4, b"libc5": FLAG_ELF_LIBC5, b"libc6": FLAG_ELF_LIBC6,
                     b"glibc2": FLAG_ELF_LIBC6}
_CONF: Final = b"/etc/ld.so.conf"
_CACHE_DIR: Final = "/etc"
_CACHE: Final = "ld.so.cache"
_GLIBC_HWCAPS: Final = b"glibc-hwcaps"
#: x86's _dl_x86_hwcap_flags (bits 0-2, all "important" to ldconfig) and _dl_x86_platforms (from bit 48)
_HWCAP_BITS: Final = {b"sse2": 0, b"x86_64": 1, b"avx512_1": 2, b"i586": 48, b"i686": 49, b"haswell": 50,
                      b"xeon_phi": 51, b"tls": 63}
#: Debian's ldconfig never repoints an existing link to a dynamic loader (local-ldconfig-ignore-ld.so.diff;
#: its list lacks two commas, so three riscv/x32 names run together into one that matches nothing)
_LOADER_SONAMES: Final = frozenset((
    b"ld-kfreebsd-x86-64.so.1", b"ld-linux-aarch64.so.1", b"ld-linux-aarch64_be.so.1", b"ld-linux-armhf.so.3",
    b"ld-linux-ia64.so.2", b"ld-linux-mipsn8.so.1",
    b"ld-linux-riscv64-lp64.so.1ld-linux-riscv64-lp64d.so.1ld-linux-x32.so.2",
    b"ld-linux-x86-64.so.2", b"ld-linux.so.2", b"ld-linux.so.3", b"ld.so.1", b"ld64.so.1", b"ld64.so.2",
))
#: what the sandbox's fresh namespace would not have shown: kernel filesystems
_PSEUDO_FS: Final = frozenset(("proc", "sysfs", "devpts", "mqueue", "cgroup", "cgroup2", "debugfs", "tracefs",
                               "securityfs", "bpf", "configfs", "fusectl", "pstore", "efivarfs", "binfmt_misc",
                               "devtmpfs", "hugetlbfs", "nsfs", "autofs"))
_HIDDEN_TOPS: Final = ("proc", "sys", "dev")
#: how many files of an include chain are read: glibc's parse_conf recurses without a limit of its own,
#: holding each file open, so the chain ends where the sandboxed ldconfig has no fd left to open the next
_MAX_CONF_CHAIN: Final = OPEN_FILES - STANDARD_FILES
_SPACE: Final = b" \t\n\v\f\r"
_MAX_CONF: Final = 16 << 20
_PRELINK: Final = re.compile(rb".*\.#prelink#(\.......)?\Z", re.DOTALL)
#: Past this many library names in the directories to scan, the sandboxed ldconfig is the cheaper
#: writer: it costs a start ~13 ms whatever the image, this module ~80 µs a library it has not read
#: before (both measured on the 2-core VM; break-even near 150, and the driver's libraries, read by
#: the idle gpuhookd worker, cost almost nothing), so an image with hundreds of its own runs ldconfig.
MOST_LIBRARIES: Final = 300


@dataclass(frozen=True, slots=True)
class LdconfigProfile:
    """What a host's ldconfig does that no tree shows: its built-in directories, its name."""

    #: add_system_dir()'s directories, in the order it adds them
    system_dirs: tuple[bytes, ...]
    #: the generator string it writes into each cache
    generator: bytes


@dataclass(slots=True)
class _Dir:
    """One directory to scan (ldconfig's struct dir_entry); *flag* changes when it is named again."""

    path: bytes
    flag: int
    ident: tuple[int, int]
    hwcaps: bytes | None = None


@dataclass(slots=True)
class _Lib:
    """One SONAME's chosen file in a directory (struct dlib_entry)."""

    name: bytes
    soname: bytes
    flag: int
    is_link: bool
    isa_level: int


@dataclass(slots=True)
class _Scan:
    """One run's state: the directories, the cache records, the glibc-hwcaps names met."""

    dirs: list[_Dir] = field(default_factory=list)
    records: list[CacheRecord] = field(default_factory=list)
    hwcaps_seen: set[bytes] = field(default_factory=set)


def write_ldcache(fs: RootFs, dirs: tuple[str, ...], profile: LdconfigProfile, hidden: frozenset[int], *,
                  deadline: float) -> int:
    """Do what ``ldconfig -f /etc/ld.so.conf -C /etc/ld.so.cache *dirs*`` does in the rootfs of *fs*;
    returns the number of libraries cached (``CacheWriter``, whatever the image's size, its listings
    made first, as a start makes them)."""
    writer = CacheWriter(fs, dirs, profile, hidden, deadline=deadline)
    writer.library_names()
    return writer.write()


class CacheWriter:
    """One start's cache: its directories found first (nothing changed yet), then written.

    *hidden*: the filesystems read as absent (``hidden_devices``; what lies under the rootfs's /proc,
    /sys and /dev reads as absent whatever its filesystem); *deadline*: a ``time.monotonic()``
    past which it gives up (an image too large to scan in time, or changed from outside meanwhile).
    """

    def __init__(self, fs: RootFs, dirs: tuple[str, ...], profile: LdconfigProfile, hidden: frozenset[int], *,
                 deadline: float) -> None:
        self._tree = _Tree(fs, hidden, deadline)
        self._generator = profile.generator
        self._scan = _Scan()
        self._listed: list[bytes] = []  # the directories library_names listed
        for directory in dirs:
            self._tree.add_dir(self._scan, os.fsencode(directory))
        self._tree.parse_conf(self._scan, _CONF)
        for system_dir in profile.system_dirs:
            self._tree.add_dir(self._scan, system_dir)

    def library_names(self, most: int = MOST_LIBRARIES) -> int:
        """About how many libraries ``write`` would look at, counted up to just past *most*: names in
        the directories and their hwcap subdirectories (listed once: ``write`` reuses the listings)."""
        queue = self._listed = [d.path for d in self._scan.dirs]
        seen, count, index = set(queue), 0, 0
        while index < len(queue) and count <= most:
            for item in self._tree.remember_listing(queue[index]) or ():
                name = item.name
                if _is_dso(name) and (item.is_symlink() or item.is_file(follow_symlinks=False)):
                    count += 1
                elif name in _HWCAP_BITS and (sub := queue[index] + b"/" + name) not in seen:
                    seen.add(sub)
                    queue.append(sub)
            index += 1
        return count

    @property
    def libraries_read(self) -> int:
        """How many library files this writer read so far (the rest were known from a read before)."""
        return self._tree.read

    def read_libraries(self) -> int:
        """After ``library_names``: read the regular files among the names it counted, changing nothing, so that
        ``ldelf.known`` answers for them (a head start on an image's own libraries, taken before the start's
        plan is known); how many were read (the others were known)."""
        for directory in self._listed:
            opened = self._tree.open_listing(directory)
            if opened is None:
                continue
            dir_fd, listing = opened
            try:
                for item in listing:
                    self._tree.check_time(directory)
                    if _is_dso(item.name) and item.is_file(follow_symlinks=False):
                        with contextlib.suppress(OSError):
                            found = os.stat(item.name, dir_fd=dir_fd, follow_symlinks=False)
                            self._tree.library(item.name, item.name, dir_fd, found)
            finally:
                os.close(dir_fd)
        return self._tree.read

    def write(self) -> int:
        """Scan, make the links, write the cache; the number of libraries cached. Raises ApplyError where
        ldconfig would fail (no /etc to write into)."""
        scan, index = self._scan, 0
        while index < len(scan.dirs):  # scanning appends hwcap subdirectories, scanned in turn
            self._tree.search_dir(scan, scan.dirs[index])
            index += 1
        self._tree.save(encode_ldcache(scan.records, scan.hwcaps_seen, self._generator))
        return len(scan.records)


def hidden_devices(fs: RootFs) -> frozenset[int]:
    """The st_dev of the filesystems whose every file reads as absent: kernel filesystems, and those
    mounted nowhere but at or under the rootfs's /proc, /sys and /dev (the sandboxed ldconfig covered
    those three with tmpfs). A filesystem also mounted elsewhere (the rootfs's own disk, where kubelet's
    /dev/termination-log comes from) is not hidden: ``_Tree`` hides what lies under the three by path."""
    tops = _hidden_tops(fs)
    kernel, under_tops, elsewhere = set(), set(), set()
    for mount in fs.mounts():
        major, _, minor = mount.device.partition(":")
        device = os.makedev(int(major), int(minor))
        if mount.fs_type in _PSEUDO_FS:
            kernel.add(device)
        elif _under(mount.mount_point, tops):
            under_tops.add(device)
        else:
            elsewhere.add(device)
    return frozenset(kernel | (under_tops - elsewhere))


def _hidden_tops(fs: RootFs) -> tuple[str, ...]:
    """The rootfs's /proc, /sys and /dev, as this namespace's paths (mountinfo's, /proc/self/fd's) name them."""
    root = pathrs.fd_path(fs.root_fd).rstrip("/")
    return tuple(f"{root}/{top}" for top in _HIDDEN_TOPS)


def _under(path: str, tops: tuple[str, ...]) -> bool:
    return any(path == top or path.startswith(top + "/") for top in tops)


class _Tree:
    """The rootfs as the chrooted ldconfig sees it."""

    def __init__(self, fs: RootFs, hidden: frozenset[int], deadline: float) -> None:
        self.fs = fs
        self.root_fd = fs.root_fd
        self.hidden = hidden
        self.hidden_tops = _hidden_tops(fs)
        self.deadline = deadline
        #: listings made before the scan changed anything (``CacheWriter.library_names``), by path
        self._listed: dict[bytes, list[_BytesEntry] | None] = {}
        #: libraries read (not known from a read before: ``ldelf.known``)
        self.read = 0
        #: the directory being scanned: what its names lead to (``stat_in``), as its loop found them
        self._seen: dict[bytes, os.stat_result | None] = {}
        #: the bytes of the configuration files being read (``parse_conf``)
        self._conf_held = 0

    def check_time(self, path: bytes) -> None:
        if time.monotonic() > self.deadline:
            raise ApplyError("ldconfig", os.fsdecode(path), detail=(
                "timed out scanning the image's libraries (it takes milliseconds): the image has too "
                "many, or its directories changed while they were read"))

    # -- looking -----------------------------------------------------------------------------------

    def _open(self, path: bytes, flags: int) -> int | None:
        """*path* opened inside the root (following symlinks there), or None: absent, unreachable, on a
        hidden filesystem, or where it leads under the rootfs's /proc, /sys or /dev (whatever is mounted
        there, and from wherever: a bind from the rootfs's own disk hides no more than its mount point).
        An entry of a directory opened here lies under them only if it is one of them (the root's "dev":
        never a library's name), so entries need no such check."""
        if not path:
            return None
        try:
            fd = pathrs.openat2(self.root_fd, os.fsdecode(path), flags, _IN_ROOT)
        except (OSError, ValueError):
            return None
        if os.fstat(fd).st_dev in self.hidden or _under(pathrs.fd_path(fd), self.hidden_tops):
            os.close(fd)
            return None
        return fd

    def stat(self, path: bytes) -> os.stat_result | None:
        """stat(2) in the chroot."""
        fd = self._open(path, os.O_PATH)
        if fd is None:
            return None
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)

    def stat_in(self, dir_fd: int, path: bytes, name: bytes) -> os.stat_result | None:
        """``stat`` of *path*/*name*, *name* an entry of the directory *dir_fd* (*path*): one or two
        syscalls where it is no symlink, or a symlink to a plain name beside it (a library's usual
        links); any other symlink is followed from the root."""
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(name, dir_fd=dir_fd)
                if b"/" in target or target in (b"", b".", b".."):
                    return self.stat(path + b"/" + name)
                st = os.stat(target, dir_fd=dir_fd, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    return self.stat(path + b"/" + name)
        except OSError:
            return None  # absent (a dangling link), or changed meanwhile: as a failed stat(2)
        return None if st.st_dev in self.hidden else st

    def listing(self, path: bytes) -> list[_BytesEntry] | None:
        """opendir + readdir, in the directory's own order (ldconfig's order matters), or None."""
        if path in self._listed:
            return self._listed[path]
        opened = self.open_listing(path)
        if opened is None:
            return None
        os.close(opened[0])
        return opened[1]

    def remember_listing(self, path: bytes) -> list[_BytesEntry] | None:
        """``listing``, kept for ``open_listing`` (while nothing has changed the tree yet)."""
        listed = self._listed[path] = self.listing(path)
        return listed

    def open_listing(self, path: bytes) -> tuple[int, list[_BytesEntry]] | None:
        """The directory's fd (O_RDONLY, the caller closes it) and its listing (the one kept, if any), or None."""
        fd = self._open(path, os.O_RDONLY | os.O_DIRECTORY)
        if fd is None:
            return None
        if (kept := self._listed.pop(path, None)) is not None:
            return fd, kept
        try:
            with os.scandir(fd) as entries:
                return fd, [_BytesEntry(e) for e in entries]
        except OSError:
            os.close(fd)
            return None

    def _regular(self, path: bytes, dir_fd: int | None) -> tuple[int, os.stat_result] | None:
        """An O_PATH fd of *path* and its stat, if it is a regular file (nothing is opened for reading
        yet: a FIFO cannot block, a device node is not opened). With *dir_fd*, *path* is a name in that
        directory that must not be a symlink (what its listing said)."""
        if dir_fd is None:
            fd = self._open(path, os.O_PATH)
            if fd is None:
                return None
        else:
            try:
                fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            except OSError:
                return None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            return None
        return fd, st

    def read_regular(self, path: bytes) -> tuple[int, int] | None:
        """(an fd open for reading, its size) if *path* is a regular file, else None."""
        found = self._regular(path, None)
        if found is None:
            return None
        try:
            return _reopen(found[0]), found[1].st_size
        except OSError:
            return None
        finally:
            os.close(found[0])

    def library(self, path: bytes, name: bytes, dir_fd: int | None,
                st: os.stat_result | None = None) -> LibraryInfo | None:
        """``read_library`` of the regular file *path* (``_regular``), None for anything else; a file
        read before (``ldelf.remember``: the same inode, unchanged) is not read again. *st*: what
        ``stat_in`` found there, enough to answer for a file read before."""
        if st is not None:
            if not stat.S_ISREG(st.st_mode):
                return None
            if (answer := known(st)) is not UNKNOWN:
                return answer  # type: ignore[return-value]
        found = self._regular(path, dir_fd)
        if found is None:
            return None
        fd, st = found
        try:
            if (answer := known(st)) is not UNKNOWN:
                return answer  # type: ignore[return-value]
            readable = _reopen(fd)
        except OSError:
            return None
        finally:
            os.close(fd)
        self.read += 1
        try:
            info = read_library(readable, st.st_size, name)
        finally:
            os.close(readable)
        keep(st, info)  # the same file met again (another name, or the start after a head start) is not read again
        return info

    # -- the configuration -------------------------------------------------------------------------

    def parse_conf(self, scan: _Scan, filename: bytes) -> None:
        """parse_conf(): one directory per line, ``include`` globs, ``#`` comments, ``hwcap`` ignored. Each
        included file is read where its include line is, depth first (glibc's recursion, here a stack of the
        files being read), up to ``_MAX_CONF_CHAIN`` files deep."""
        reading = [self._conf_lines(filename)]
        while reading:
            conf, line = next(reading[-1], (b"", b""))
            if not conf:
                reading.pop()
            elif line.startswith(b"include") and line[7:8] in (b" ", b"\t"):
                if len(reading) < _MAX_CONF_CHAIN:
                    matches = [m for p in re.split(rb"[ \t]", line[8:]) if p for m in self._include(conf, p)]
                    reading.append(itertools.chain.from_iterable(map(self._conf_lines, matches)))
            elif not (line[:5].lower() == b"hwcap" and line[5:6] in (b" ", b"\t")):
                self.add_dir(scan, line)

    def _conf_lines(self, filename: bytes) -> Iterator[tuple[bytes, bytes]]:
        """The lines of a configuration file that say something, each with the file's name; none where it is
        absent, unreadable or not a file (ldconfig reads no line of it either)."""
        self.check_time(filename)
        opened = self.read_regular(filename)
        if opened is None:
            return
        fd, size = opened
        if size + self._conf_held > _MAX_CONF:  # each file of a chain is held while the next is read
            os.close(fd)
            raise ApplyError("ldconfig", os.fsdecode(filename), detail=(
                f"is {size} bytes, the files including it {self._conf_held}; a linker configuration over "
                f"{_MAX_CONF >> 20} MiB is not read. Fix the image"))
        try:
            chunks = []
            while chunk := os.read(fd, 1 << 16):
                chunks.append(chunk)
        finally:
            os.close(fd)
        data = b"".join(chunks)
        self._conf_held += len(data)
        try:
            for raw in data.split(b"\n")[:-1] if data.endswith(b"\n") else data.split(b"\n"):
                line = raw.split(b"\0", 1)[0].split(b"#", 1)[0].lstrip(_SPACE)
                if line:
                    yield filename, line
        finally:
            self._conf_held -= len(data)

    def _include(self, conf: bytes, pattern: bytes) -> list[bytes]:
        """parse_conf_include(): the files *pattern* names, relative to *conf*'s directory unless absolute."""
        if not pattern.startswith(b"/") and b"/" in conf:
            pattern = os.path.dirname(conf) + b"/" + pattern
        return self.glob(pattern)

    def glob(self, pattern: bytes) -> list[bytes]:
        """glob(3) with no flags, in the C locale: the sorted matches; a pattern without wildcards
        is itself when something (even a dangling link) is there."""
        parts = [p for p in pattern.split(b"/") if p]
        found = [b"/" if pattern.startswith(b"/") else b""]
        for part in parts:
            if not _has_magic(part):
                found = [_join(base, _unescape(part)) for base in found]
                continue
            matches = _fnmatch(part)
            matched = []
            for base in found:
                names = [e.name for e in self.listing(base or b".") or ()]
                if part.startswith(b"."):
                    names += [b".", b".."]
                matched += [_join(base, n) for n in names if matches(n)]
            found = matched
        if parts and not _has_magic(parts[-1]):
            found = [f for f in found if self._lexists(f)]
        return sorted(f for f in found if f not in (b"", b"/"))

    def _lexists(self, path: bytes) -> bool:
        fd = self._open(path, os.O_PATH | os.O_NOFOLLOW)
        if fd is None:
            return False
        os.close(fd)
        return True

    # -- the directories ---------------------------------------------------------------------------

    def add_dir(self, scan: _Scan, line: bytes) -> None:
        """add_dir_1(): ``PATH[=TYPE]``, trailing blanks and slashes dropped, counted once per inode."""
        path, equal, kind = line.partition(b"=")
        flag = _LIB_TYPES.get(kind, _FLAG_ANY) if equal else _FLAG_ANY
        path = path.rstrip(_SPACE).rstrip(b"/")
        if not path:
            return
        st = self.stat(path)
        if st is None:
            return
        entry = _Dir(path, flag, (st.st_dev, st.st_ino))
        if _add_single(scan, entry):
            self._add_glibc_hwcaps(scan, entry)

    def _add_glibc_hwcaps(self, scan: _Scan, entry: _Dir) -> None:
        """add_glibc_hwcaps_subdirectories(): each directory under PATH/glibc-hwcaps, not nested."""
        base = entry.path + b"/" + _GLIBC_HWCAPS
        for sub in self.listing(base) or ():
            name = sub.name
            if name.startswith(b".") or sub.is_file(follow_symlinks=False) or b":" in name:
                continue
            st = self.stat(base + b"/" + name)
            if st is None or not stat.S_ISDIR(st.st_mode):
                continue
            scan.hwcaps_seen.add(name)
            _add_single(scan, _Dir(base + b"/" + name, entry.flag, (st.st_dev, st.st_ino), hwcaps=name))

    def search_dir(self, scan: _Scan, entry: _Dir) -> None:
        """search_dir(): choose each SONAME's library, make its link, record it for the cache."""
        hwcap = _path_hwcap(entry.path) if entry.hwcaps is None else 0
        opened = self.open_listing(entry.path)
        if opened is None:
            return
        dir_fd, listing = opened
        self._seen.clear()
        try:
            dlibs: dict[bytes, _Lib] = {}  # by SONAME, in the order found
            for item in listing:
                self.check_time(entry.path)
                self._consider(scan, entry, dir_fd, item, dlibs)
            for lib in reversed(dlibs.values()):  # ldconfig adds at the head of its list and walks from there
                if entry.hwcaps is None:
                    if not lib.is_link:
                        self._create_links(dir_fd, entry.path, lib.name, lib.soname)
                    filename = lib.soname
                else:
                    filename = lib.name
                scan.records.append(CacheRecord(lib.soname, entry.path + b"/" + filename, lib.flag, hwcap,
                                                entry.hwcaps, lib.isa_level))
        finally:
            os.close(dir_fd)

    def _consider(self, scan: _Scan, entry: _Dir, dir_fd: int,  # noqa: PLR0911, PLR0912 - search_dir's loop body
                  item: _BytesEntry, dlibs: dict[bytes, _Lib]) -> None:
        """One directory entry, as search_dir's loop body."""
        name = item.name
        is_link = item.is_symlink()
        is_reg = not is_link and item.is_file(follow_symlinks=False)
        is_dir = not is_link and item.is_dir(follow_symlinks=False)
        if not (is_link or is_reg or is_dir):
            return  # FIFOs, sockets, device nodes
        if not _is_dso(name) and (is_reg or (entry.hwcaps is None and name not in _HWCAP_BITS)):
            return
        if _PRELINK.match(name):
            return
        file_name = entry.path + b"/" + name
        target: os.stat_result | None = None
        if is_link:
            target = self._seen[name] = self.stat_in(dir_fd, entry.path, name)
            if target is None:
                if b".so." in name:
                    self._remove_stale(dir_fd, entry.path, name)
                return
            is_dir = stat.S_ISDIR(target.st_mode)
        if entry.hwcaps is None and is_dir and name in _HWCAP_BITS:
            st = target if target is not None else self.stat(file_name)
            if st is not None:
                _add_single(scan, _Dir(file_name, entry.flag, (st.st_dev, st.st_ino)))
            return
        if not is_reg and not is_link:
            return
        if is_link:
            info = self.library(file_name, name, None, target)
        else:
            try:
                found = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except OSError:
                return
            self._seen[name] = None if found.st_dev in self.hidden else found
            info = self.library(name, name, dir_fd, found)
        if info is None:
            return
        flag = info.flags
        soname = info.soname if info.soname is not None else implicit_soname(name, flag)
        if is_link and name != soname and not (len(name) >= 3 and name.endswith(b".so") and soname.startswith(name)):
            is_link = False
        if is_link:
            soname = name
        if flag == FLAG_ELF and entry.flag in (FLAG_ELF_LIBC5, FLAG_ELF_LIBC6):
            flag = entry.flag
        lib = dlibs.get(soname)
        if lib is not None:
            if (not is_link and lib.is_link) or (is_link == lib.is_link and libcmp(lib.name, name) < 0):
                # ldconfig keeps the first one's type, except between plain ELF and libc5/libc6
                # (either way round); other mismatches it only reports
                if (lib.flag == FLAG_ELF and flag in (FLAG_ELF_LIBC5, FLAG_ELF_LIBC6)) or (
                        lib.flag in (FLAG_ELF_LIBC5, FLAG_ELF_LIBC6) and flag == FLAG_ELF):
                    lib.flag = flag
                lib.name, lib.is_link, lib.isa_level = name, is_link, info.isa_level
            return
        dlibs[soname] = _Lib(name, soname, flag, is_link, info.isa_level)

    # -- the image's links -------------------------------------------------------------------------

    def _create_links(self, dir_fd: int, path: bytes, libname: bytes, soname: bytes) -> None:
        """create_links(): make SONAME a link to the library unless it already leads there (or is
        a file, or Debian's ldconfig keeps it: a loader's name). A SONAME with a slash puts its link
        where that name leads from *path*, inside the root as ldconfig's chroot keeps it."""
        place = self._link_place(dir_fd, path, soname)
        if place is None:
            return
        link_dir, link = place
        try:
            self._make_link(dir_fd, link_dir, path, libname, soname, link)
        finally:
            if link_dir != dir_fd:
                os.close(link_dir)
                self._listed.clear()  # a directory listed before may have changed: each is listed again
                self._seen.clear()  # this one too

    def _link_place(self, dir_fd: int, path: bytes, soname: bytes) -> tuple[int, bytes] | None:
        """The directory (*dir_fd*, or one opened in the root) and name of SONAME's link; None where there is none."""
        parent, _, link = (path + b"/" + soname).rpartition(b"/")
        if link in (b"", b".", b".."):
            return None  # a directory, never a link: ldconfig leaves it too
        if b"/" not in soname:
            return dir_fd, soname
        opened = self._open(parent or b"/", os.O_PATH | os.O_DIRECTORY)
        return None if opened is None else (opened, link)

    def _make_link(self, dir_fd: int, link_dir: int, path: bytes, libname: bytes, soname: bytes,
                   link: bytes) -> None:
        """``_create_links`` once the link's place is found (*link* in *link_dir*)."""
        so_st = self._stat_seen(dir_fd, path, soname) if link_dir == dir_fd else self.stat(path + b"/" + soname)
        do_remove = True
        if so_st is not None:
            lib_st = self._stat_seen(dir_fd, path, libname)
            if lib_st is None:
                return
            if soname in _LOADER_SONAMES or (lib_st.st_dev, lib_st.st_ino) == (so_st.st_dev, so_st.st_ino):
                return
            if not _is_link(link_dir, link):
                return  # "is not a symbolic link": left as it is
        elif not _is_link(link_dir, link):
            do_remove = False
        shown = os.fsdecode(path + b"/" + soname)
        self._seen.pop(link, None)
        with contextlib.suppress(OSError):  # ldconfig: "Can't link ..." and goes on
            if do_remove:
                self.fs.remove_link(link_dir, os.fsdecode(link), shown)
            self.fs.make_link(link_dir, os.fsdecode(link), os.fsdecode(libname), shown)

    def _stat_seen(self, dir_fd: int, path: bytes, name: bytes) -> os.stat_result | None:
        """``stat_in``, answered from this directory's scan where it stat'ed *name* already (the one change
        since, a link made here, drops its name)."""
        if name in self._seen:
            return self._seen[name]
        return self.stat_in(dir_fd, path, name)

    def _remove_stale(self, dir_fd: int, path: bytes, name: bytes) -> None:
        """A ``*.so.*`` link that leads nowhere goes (ldconfig removes stale links)."""
        with contextlib.suppress(OSError):
            self.fs.remove_link(dir_fd, os.fsdecode(name), os.fsdecode(path + b"/" + name))

    # -- the cache ---------------------------------------------------------------------------------

    def save(self, data: bytes) -> None:
        """save_cache(): /etc/ld.so.cache~ (0600, then 0644) renamed over /etc/ld.so.cache."""
        temp = _CACHE + "~"
        try:
            dir_fd = pathrs.openat2(self.root_fd, _CACHE_DIR, os.O_PATH | os.O_DIRECTORY, _IN_ROOT)
        except OSError as err:
            raise ApplyError("write", f"{_CACHE_DIR}/{temp}", errno_=err.errno,
                             detail="ldconfig cannot create its temporary cache file either") from err
        try:
            # Whatever the image has at the temporary name (a FIFO or a device node would block or act
            # on open) was set aside before this step; it goes, and the file is created afresh.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp, dir_fd=dir_fd)
            fd = os.open(temp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dir_fd)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fchmod(fd, 0o644)
            finally:
                os.close(fd)
            os.rename(temp, _CACHE, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError as err:
            raise ApplyError("write", f"{_CACHE_DIR}/{_CACHE}", errno_=err.errno) from err
        finally:
            os.close(dir_fd)


def _reopen(fd: int) -> int:
    """The O_PATH *fd*'s file opened for reading: that inode, whatever its path now leads to."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)


class _BytesEntry:
    """A str DirEntry seen as ldconfig sees names: bytes."""

    __slots__ = ("_entry", "name")

    def __init__(self, entry: os.DirEntry[str]) -> None:
        self._entry = entry
        self.name = os.fsencode(entry.name)

    def is_symlink(self) -> bool:
        return self._entry.is_symlink()

    def is_file(self, *, follow_symlinks: bool = True) -> bool:
        return self._entry.is_file(follow_symlinks=follow_symlinks)

    def is_dir(self, *, follow_symlinks: bool = True) -> bool:
        return self._entry.is_dir(follow_symlinks=follow_symlinks)


def _add_single(scan: _Scan, entry: _Dir) -> bool:
    """add_single_dir(): False (and the first one takes the newer type) if the inode is listed already."""
    for seen in scan.dirs:
        if seen.ident == entry.ident:
            seen.flag = entry.flag
            return False
    scan.dirs.append(entry)
    return True


def _is_link(dir_fd: int, name: bytes) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _is_dso(name: bytes) -> bool:
    """_dl_is_dso(): lib*.so*, ld-*.so*, ld.so.*, ld64.so.*."""
    return ((name.startswith((b"lib", b"ld-")) and b".so" in name)
            or name.startswith((b"ld.so.", b"ld64.so.")))


def _path_hwcap(path: bytes) -> int:
    """path_hwcap(): the hwcap bits of the trailing hwcap components of *path*."""
    hwcap = 0
    parts = path.split(b"/")
    while len(parts) > 1:
        bit = _HWCAP_BITS.get(parts[-1])
        if bit is None:
            break
        hwcap += 1 << bit
        parts.pop()
    return hwcap


def _join(base: bytes, name: bytes) -> bytes:
    if not base:
        return name
    return base + name if base.endswith(b"/") else base + b"/" + name


def _has_magic(part: bytes) -> bool:
    return any(c in part for c in (b"*", b"?", b"["))


def _unescape(part: bytes) -> bytes:
    return re.sub(rb"\\(.)", rb"\1", part)


def _fnmatch(pattern: bytes) -> _Matcher:
    """fnmatch(3) with FNM_PERIOD (glob's flags): a leading dot only matches a literal one."""
    regex = re.compile(_translate(pattern), re.DOTALL)
    literal_dot = pattern.startswith(b".") or pattern.startswith(b"\\.")
    return _Matcher(regex, literal_dot)


@dataclass(frozen=True, slots=True)
class _Matcher:
    regex: re.Pattern[bytes]
    literal_dot: bool

    def __call__(self, name: bytes) -> bool:
        if name.startswith(b".") and not self.literal_dot:
            return False
        return self.regex.fullmatch(name) is not None


def _translate(pattern: bytes) -> bytes:
    """A glob component as a regular expression: ``*``, ``?``, ``[...]`` (``!``/``^`` negate), ``\\x``."""
    out = []
    i = 0
    while i < len(pattern):
        c = pattern[i:i + 1]
        i += 1
        if c == b"*":
            out.append(b".*")
        elif c == b"?":
            out.append(b".")
        elif c == b"\\" and i < len(pattern):
            out.append(re.escape(pattern[i:i + 1]))
            i += 1
        elif c == b"[":
            j = i
            if j < len(pattern) and pattern[j:j + 1] in (b"!", b"^"):
                j += 1
            if j < len(pattern) and pattern[j:j + 1] == b"]":
                j += 1
            while j < len(pattern) and pattern[j:j + 1] != b"]":
                j += 1
            if j >= len(pattern):
                out.append(re.escape(c))  # no closing bracket: a literal [
                continue
            body = pattern[i:j]
            i = j + 1
            negate = body[:1] in (b"!", b"^")
            if negate:
                body = body[1:]
            items = body.replace(b"\\", b"\\\\").replace(b"]", b"\\]").replace(b"[", b"\\[")
            out.append(b"[" + (b"^" if negate else b"") + items + b"]")
        else:
            out.append(re.escape(c))
    return b"".join(out)



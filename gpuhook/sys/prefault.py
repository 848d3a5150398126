"""Pages a forked process will write, copied in before it needs them (``MADV_POPULATE_WRITE``).

A process forked from a large one shares every page with it, copy-on-write: its first write to
each costs a fault and a page copy. A gpuhookd worker's GPU start writes a thousand-odd pages
its fork shares with the daemon (reference counts, dicts, caches), which measured ~6 ms of a
~30 ms start, and its apply child some hundreds more. Which pages those are is learned from a
process that did the work (``written_pages``: the pages the kernel reports as that process's
alone), kept in a small region every process of the pool shares (``Learned``), and the next
process of the same kind copies them in while it waits (``populate``), off the start's path; the
addresses stay valid because all of them are forked from the same daemon. Copying all of a
worker's writable memory instead cost ~25 ms of CPU per worker, which a burst of starts then
waits for.

Needs /proc/self/pagemap's "exclusively mapped" bit (Linux 4.2) and MADV_POPULATE_WRITE (5.14);
on older kernels ``written_pages`` finds nothing and ``populate`` copies nothing.
"""

from __future__ import annotations

import ctypes
import enum
import errno
import mmap
import os
import struct
import zlib
from typing import Final

from gpuhook.sys._libc import libc

MADV_POPULATE_WRITE: Final = 23
PAGE: Final = os.sysconf("SC_PAGE_SIZE")
_PRESENT, _EXCLUSIVE = 1 << 63, 1 << 56
#: the kernel's own areas: not this process's data
_SPECIAL: Final = frozenset({"[stack]", "[vvar]", "[vvar_vclock]", "[vdso]", "[vsyscall]"})

Ranges = tuple[tuple[int, int], ...]

libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
libc.madvise.restype = ctypes.c_int


def writable_mappings() -> Ranges:
    """(start, end) of this process's private writable mappings (its heap, arenas and data sections)."""
    found = []
    with open("/proc/self/maps", "rb") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if fields[1] != b"rw-p" or (len(fields) == 6 and fields[5].strip().decode() in _SPECIAL):
                continue
            start, _, end = fields[0].partition(b"-")
            found.append((int(start, 16), int(end, 16)))
    return tuple(found)


def written_pages() -> Ranges:
    """The pages of the private writable mappings that are this process's alone now, as (start, end)
    runs: what it wrote (or allocated) since its fork. Empty where pagemap says nothing (or there is
    no /proc to ask: a view without one)."""
    try:
        return _own_pages()
    except OSError:
        return ()


def _own_pages() -> Ranges:
    runs: list[tuple[int, int]] = []
    fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    try:
        for start, end in writable_mappings():
            entries = os.pread(fd, (end - start) // PAGE * 8, start // PAGE * 8)
            run_start = None
            for index, (entry,) in enumerate(struct.iter_unpack("<Q", entries)):
                own = entry & _PRESENT and entry & _EXCLUSIVE
                if own and run_start is None:
                    run_start = start + index * PAGE
                elif not own and run_start is not None:
                    runs.append((run_start, start + index * PAGE))
                    run_start = None
            if run_start is not None:
                runs.append((run_start, start + len(entries) // 8 * PAGE))
    finally:
        os.close(fd)
    return tuple(runs)


def populate(ranges: Ranges) -> int:
    """Write-fault the pages of *ranges* (sorted, apart) that lie in this process's private writable
    mappings now, so that later writes to them cost nothing; the bytes asked for (0 where the kernel
    lacks the call, or no /proc says what is mapped)."""
    if not ranges:
        return 0
    try:
        mapped = writable_mappings()
    except OSError:
        return 0
    done, index = 0, 0
    for start, end in ranges:
        while index < len(mapped) and mapped[index][1] <= start:
            index += 1
        for map_start, map_end in mapped[index:]:
            if map_start >= end:
                break
            low, high = max(start, map_start), min(end, map_end)
            if libc.madvise(low, high - low, MADV_POPULATE_WRITE) == 0:
                done += high - low
            elif ctypes.get_errno() == errno.EINVAL:  # before Linux 5.14: nothing more to try
                return done
    return done


def size(ranges: Ranges) -> int:
    """The bytes *ranges* cover."""
    return sum(end - start for start, end in ranges)


def encode(ranges: Ranges) -> bytes:
    """*ranges* as bytes, to pass between processes."""
    return b"".join(struct.pack("<QQ", start, end) for start, end in ranges)


def decode(data: bytes) -> Ranges:
    """``encode``'s ranges back (a torn tail is dropped)."""
    usable = len(data) - len(data) % 16
    return tuple(struct.iter_unpack("<QQ", data[:usable]))


class Role(enum.IntEnum):
    """The kinds of process whose pages are learned apart (each writes its own)."""

    WORKER = 0
    APPLY_CHILD = 1


class Learned:
    """The newest page set of each role, in a MAP_SHARED region made before the pool forks: every
    process forked after reads and writes the same bytes. A set is stored with its length and CRC,
    so one read while another process stores is seen as torn and not used (nothing is copied in)."""

    SLOT: Final = 64 << 10  # a few thousand ranges per role
    #: the most memory a set may name: the sets grow towards the union of what every kind of start writes
    #: (~7 MiB for a worker's 8-GPU start); a larger one is not taken
    MOST: Final = 12 << 20
    _HEAD: Final = struct.Struct("<II")

    def __init__(self) -> None:
        self._region = mmap.mmap(-1, self.SLOT * len(Role), flags=mmap.MAP_SHARED)

    def store(self, role: Role, ranges: Ranges) -> None:
        """Keep *ranges* as *role*'s newest set (unless they name more than ``MOST`` bytes)."""
        data = encode(ranges)
        if size(ranges) > self.MOST or self._HEAD.size + len(data) > self.SLOT:
            return
        start = role * self.SLOT
        self._region[start:start + self._HEAD.size + len(data)] = self._HEAD.pack(len(data), zlib.crc32(data)) + data

    def load(self, role: Role) -> Ranges:
        """*role*'s newest set (none yet, or torn: empty)."""
        start = role * self.SLOT
        length, crc = self._HEAD.unpack_from(self._region, start)
        if length > self.SLOT - self._HEAD.size:
            return ()
        data = self._region[start + self._HEAD.size:start + self._HEAD.size + length]
        return decode(data) if zlib.crc32(data) == crc else ()

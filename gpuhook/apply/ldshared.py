"""What ``ldelf.read_library`` said of a file, kept for every gpuhookd process: starts of one image read it once.

An image's libraries are the same inodes in every container made from it (overlayfs shows a
lower layer's file with that file's inode number, size and times, only under the st_dev of
each container's own mount), so a library file is known here by its inode number, size, mtime
and ctime, without st_dev. A file changed since has another mtime and ctime (ctime no one can
set), so it is read again. The table lives in a MAP_SHARED region the daemon makes before it
forks its workers (``Shared``), so what an apply child reads the next start finds, whichever
worker serves it.

Each slot holds one answer with a CRC of it: a slot read while another process writes it is seen
as torn, and the file is read again (the same rule as ``sys.prefault.Learned``). A new answer
takes one of two slots per key (where both hold others, the second is replaced): it is a cache,
never a record. A wrong answer would take a file with another's inode number, size, mtime and
ctime to the nanosecond (ctime is the kernel's clock at the file's last change, which no one
sets), and could only misname a library in a container's ``ld.so.cache``: nothing the host runs
or trusts depends on the table.
"""

from __future__ import annotations

import mmap
import os
import struct
import zlib
from typing import Final

from gpuhook.apply.ldelf import UNKNOWN, LibraryInfo

#: slots of SLOT bytes: 1 MiB, of which a start touches one page per library it looks up
SLOTS: Final = 8192
SLOT: Final = 128
#: crc, inode, size, mtime_ns, ctime_ns, flags (-1: not a library), ISA level, SONAME length (255: none)
_ENTRY: Final = struct.Struct("<IQqqqiIB")
_KEY: Final = struct.Struct("<Qqqq")
_NO_SONAME: Final = 255
_LONGEST_SONAME: Final = SLOT - _ENTRY.size
_NOT_A_LIBRARY: Final = -1


class Shared:
    """The table (module docstring); made before the forks, every process forked after shares its bytes."""

    def __init__(self) -> None:
        self._region = mmap.mmap(-1, SLOTS * SLOT, flags=mmap.MAP_SHARED)

    def get(self, st: os.stat_result) -> LibraryInfo | object | None:
        """What was read of the file *st* is (None: not a library), or UNKNOWN."""
        key = _key(st)
        for start in _slots(key):
            slot = self._region[start:start + SLOT]
            if slot[4:4 + _KEY.size] != key or _ENTRY.unpack_from(slot)[0] != zlib.crc32(slot[4:]):
                continue
            flags, isa_level, length = _ENTRY.unpack_from(slot)[5:]
            if flags == _NOT_A_LIBRARY:
                return None
            return LibraryInfo(flags, None if length == _NO_SONAME else slot[_ENTRY.size:_ENTRY.size + length],
                               isa_level)
        return UNKNOWN

    def put(self, st: os.stat_result, info: LibraryInfo | None) -> None:
        """Keep what was read of the file *st* is (a SONAME too long for a slot is not kept)."""
        soname = info.soname if info is not None else None
        if soname is not None and len(soname) > _LONGEST_SONAME:
            return
        key = _key(st)
        first, second = _slots(key)
        free = (key, bytes(_KEY.size))  # this key's slot, or one never written
        start = first if self._region[first + 4:first + 4 + _KEY.size] in free else second
        flags, isa_level = (_NOT_A_LIBRARY, 0) if info is None else (info.flags, info.isa_level)
        body = (key + _ENTRY.pack(0, 0, 0, 0, 0, flags, isa_level, _NO_SONAME if soname is None else len(soname))
                [4 + _KEY.size:] + (soname or b"")).ljust(SLOT - 4, b"\0")
        self._region[start:start + SLOT] = struct.pack("<I", zlib.crc32(body)) + body


def _key(st: os.stat_result) -> bytes:
    """A file's key: its inode number, size, mtime and ctime (not st_dev: the module docstring)."""
    return _KEY.pack(st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _slots(key: bytes) -> tuple[int, int]:
    """The two slots (byte offsets) a key may be in."""
    index = zlib.crc32(key) % SLOTS & ~1
    return index * SLOT, (index + 1) * SLOT

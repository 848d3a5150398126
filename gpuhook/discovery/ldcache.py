"""Decode glibc's binary ld.so.cache (the "glibc-ld.so.cache1.1" layout).

glibc ≥ 2.32 writes only the new format; older ldconfigs wrote the libc5
"ld.so-1.7.0" table first and the new one after it, aligned to 8 bytes
(elf/cache.c). String offsets in the new format are relative to the new
header. Layouts (little-endian on the platforms we support)::

    cache_file_new:  magic[17] version[3] u32 nlibs u32 len_strings
                     u8 flags u8 pad[3] u32 extension_offset u32 unused[3]   (48 bytes)
    file_entry_new:  i32 flags u32 key u32 value u32 osversion u64 hwcap      (24 bytes)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

from gpuhook.errors import LdCacheFormatError

OLD_MAGIC: Final = b"ld.so-1.7.0"
NEW_MAGIC: Final = b"glibc-ld.so.cache1.1"
_OLD_HEADER: Final = struct.Struct("<11sxI")  # magic, pad to 4, nlibs
_OLD_ENTRY_SIZE: Final = 12
_NEW_HEADER: Final = struct.Struct("<20sIIB3xI12x")
_NEW_ENTRY: Final = struct.Struct("<iIIIQ")

FLAG_TYPE_MASK: Final = 0x00FF
FLAG_ELF_LIBC6: Final = 0x0003
FLAG_ARCH_MASK: Final = 0xFF00
#: elf/cache.c flag values for the ELF libc6 architectures we care about.
ARCH_FLAGS: Final = {0x0300: "x86_64", 0x0A00: "aarch64", 0x0000: "i386", 0x0900: "armhf", 0x0500: "ppc64le"}


@dataclass(frozen=True, slots=True)
class LdCacheEntry:
    """One cache entry: a SONAME (or library name) and the path it resolves to."""

    key: str
    value: str
    flags: int

    @property
    def arch(self) -> str | None:
        """The ELF libc6 architecture of the entry, or None for other kinds."""
        if self.flags & FLAG_TYPE_MASK != FLAG_ELF_LIBC6:
            return None
        return ARCH_FLAGS.get(self.flags & FLAG_ARCH_MASK)


def parse_ldcache(data: bytes) -> tuple[LdCacheEntry, ...]:
    """All entries of an ld.so.cache image, in file order."""
    start = _new_header_offset(data)
    if len(data) < start + _NEW_HEADER.size:
        raise LdCacheFormatError(f"ld.so.cache truncated: no room for the header at offset {start}")
    magic, nlibs, _len_strings, _flags, _ext = _NEW_HEADER.unpack_from(data, start)
    if magic != NEW_MAGIC:
        raise LdCacheFormatError(f"ld.so.cache: bad magic {magic!r} at offset {start}; expected {NEW_MAGIC!r}")
    entries_end = start + _NEW_HEADER.size + nlibs * _NEW_ENTRY.size
    if entries_end > len(data):
        raise LdCacheFormatError(f"ld.so.cache: {nlibs} entries do not fit in {len(data)} bytes")
    out = []
    for i in range(nlibs):
        flags, key, value, _os, _hwcap = _NEW_ENTRY.unpack_from(data, start + _NEW_HEADER.size + i * _NEW_ENTRY.size)
        out.append(LdCacheEntry(_string(data, start, key), _string(data, start, value), flags))
    return tuple(out)


def _new_header_offset(data: bytes) -> int:
    """Where the new-format header starts (after an old-format table, if any)."""
    if data.startswith(NEW_MAGIC):
        return 0
    if not data.startswith(OLD_MAGIC):
        raise LdCacheFormatError(f"ld.so.cache: unknown magic {data[:20]!r}")
    if len(data) < _OLD_HEADER.size:
        raise LdCacheFormatError("ld.so.cache truncated in the old-format header")
    nlibs: int = _OLD_HEADER.unpack_from(data, 0)[1]
    end = _OLD_HEADER.size + nlibs * _OLD_ENTRY_SIZE
    return (end + 7) & ~7  # ALIGN_CACHE: the new table is 8-byte aligned


def _string(data: bytes, base: int, offset: int) -> str:
    """The NUL-terminated string at *base* + *offset*."""
    pos = base + offset
    end = data.find(b"\0", pos)
    if offset == 0 or pos >= len(data) or end < 0:
        raise LdCacheFormatError(f"ld.so.cache: string offset {offset} is out of bounds")
    return data[pos:end].decode("utf-8", "surrogateescape")

"""glibc's binary ld.so.cache (the "glibc-ld.so.cache1.1" layout): decoded, and written as ldconfig writes it.

glibc ≥ 2.32 writes only the new format; older ldconfigs wrote the libc5
"ld.so-1.7.0" table first and the new one after it, aligned to 8 bytes
(elf/cache.c). String offsets in the new format are relative to the new
header. Layouts (little-endian on the platforms we support)::

    cache_file_new:  magic[17] version[3] u32 nlibs u32 len_strings
                     u8 flags u8 pad[3] u32 extension_offset u32 unused[3]   (48 bytes)
    file_entry_new:  i32 flags u32 key u32 value u32 osversion u64 hwcap      (24 bytes)
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable, Sequence
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
    #: legacy hwcap bits, or a glibc-hwcaps entry's HWCAP_EXTENSION mark, ISA level and subdirectory index
    hwcap: int = 0

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
        flags, key, value, _os, hwcap = _NEW_ENTRY.unpack_from(data, start + _NEW_HEADER.size + i * _NEW_ENTRY.size)
        out.append(LdCacheEntry(_string(data, start, key), _string(data, start, value), flags, hwcap))
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


# -- writing ---------------------------------------------------------------------------------------
#
# What glibc 2.36's ldconfig writes (elf/cache.c save_cache, elf/stringtable.c), byte for byte, so
# that gpuhook can make a container's cache without running ldconfig: only the new format, entries
# in add_to_cache's order, one string table with equal strings merged and each string that ends
# another stored inside it, then the extension directory (generator, glibc-hwcaps names).

_NEW_HEADER_W: Final = struct.Struct("<17s3sIIB3xI12x")
_EXTENSION_MAGIC: Final = 0xEAA42174
_EXTENSION_TAG_GENERATOR: Final = 0
_EXTENSION_TAG_GLIBC_HWCAPS: Final = 1
#: sizeof (struct cache_extension) with room for every tag glibc 2.36 knows (two)
_EXTENSION_SIZE: Final = 8 + 2 * 16
_ENDIAN_LITTLE: Final = 2
HWCAP_EXTENSION: Final = 1 << 62


@dataclass(frozen=True, slots=True)
class CacheRecord:
    """One library as ldconfig's add_to_cache receives it."""

    soname: bytes
    path: bytes
    flags: int
    #: the hwcap bits of a legacy hwcap directory (x86_64/, tls/, ...); 0 for a glibc-hwcaps one
    hwcap: int
    #: the glibc-hwcaps subdirectory name (x86-64-v3, ...), or None
    hwcaps: bytes | None = None
    #: the x86 ISA level from the library's GNU property note (glibc-hwcaps entries only)
    isa_level: int = 0


#: C's int is 32 bits: glibc's digit arithmetic wraps modulo 2**32 (two's complement on x86-64)
_INT_MODULUS: Final = 1 << 32
_INT_MAX: Final = (1 << 31) - 1
#: 10**32 is a multiple of 2**32: a run's last 32 digits give its value modulo 2**32
_INT_DIGITS: Final = 32


def _c_int(value: int) -> int:
    """*value* as a C int holds it: wrapped modulo 2**32 into [-2**31, 2**31)."""
    return (value + (1 << 31)) % _INT_MODULUS - (1 << 31)


def _c_number(digits: bytes) -> int:
    """``val = val * 10 + *p++ - '0'`` over a run of digits, in C ints (without reading thousands of digits)."""
    return _c_int(int(digits[-_INT_DIGITS:]))


#: a run of digits, found at C speed: a SONAME may hold thousands
_DIGIT_RUN: Final = re.compile(rb"[0-9]*")


def _run_end(name: bytes, start: int) -> int:
    """Where the run of digits at *start* ends."""
    run = _DIGIT_RUN.match(name, start)
    return run.end() if run else start


def _c_char(byte: int) -> int:
    """A byte as x86-64's (signed) ``char``: 0x80-0xff are negative, below NUL."""
    return byte - 256 if byte >= 0x80 else byte


def _is_digit(byte: int) -> bool:
    return 0x30 <= byte <= 0x39  # b'0' <= byte <= b'9': a negative (high) char never is one


def libcmp(left: bytes, right: bytes) -> int:
    """glibc's _dl_cache_libcmp as x86-64 compiles it: runs of digits compare as numbers held in C ints (so
    a run of 2**31 or more wraps, and so does the difference returned), other bytes as signed chars (a byte
    over 0x7f sorts below NUL). Only the sign of the answer counts, as for ldconfig and ld.so."""
    i = j = 0
    while i < len(left):
        a = left[i]
        b = right[j] if j < len(right) else 0
        if _is_digit(a):
            if not _is_digit(b):
                return 1
            start, i = i, _run_end(left, i)
            value_a = _c_number(left[start:i])
            start, j = j, _run_end(right, j)
            value_b = _c_number(right[start:j])
            if value_a != value_b:
                return _c_int(value_a - value_b)
        elif _is_digit(b):
            return -1
        elif a != b:
            return _c_char(a) - _c_char(b)
        else:
            i += 1
            j += 1
    return -_c_char(right[j]) if j < len(right) else 0


_DIGITS: Final = re.compile(rb"[0-9]+|[^0-9]")
#: where the name ends: NUL, above every high (negative) byte, below every other byte and digit run
_END: Final = (0, 0)


def libcmp_key(name: bytes) -> list[tuple[int, int]] | None:
    """A sort key in ``libcmp``'s order (for names without NUL, as every file name and SONAME is): each run
    of digits one number, each other byte itself as a signed char, and a digit after any other byte. None
    where a run of digits reaches 2**31: there C's wrapping makes libcmp no order at all (a < b < c < a can
    hold), and only ldconfig's own insertions give its order (``_sorted``)."""
    key = []
    for token in _DIGITS.findall(name):
        if not _is_digit(token[0]):
            key.append((0, _c_char(token[0])))
        elif len(digits := token.lstrip(b"0")) > len(str(_INT_MAX)) or int(digits or b"0") > _INT_MAX:
            return None
        else:
            key.append((1, int(digits or b"0")))
    key.append(_END)
    return key


def _compare(e1: CacheRecord, e2: CacheRecord) -> int:
    """elf/cache.c compare(): > 0 where *e1* goes after *e2* (names descending by libcmp, then flags
    descending, glibc-hwcaps entries first by name, then the most specific legacy hwcap)."""
    if res := libcmp(e2.soname, e1.soname):
        return res
    if e1.flags != e2.flags:
        return 1 if e1.flags < e2.flags else -1
    if (e1.hwcaps is None) != (e2.hwcaps is None):
        return 1 if e1.hwcaps is None else -1
    if e1.hwcaps is not None and e2.hwcaps is not None and e1.hwcaps != e2.hwcaps:
        return 1 if e1.hwcaps > e2.hwcaps else -1  # strcmp: unsigned bytes
    for mine, theirs in ((e1.hwcap.bit_count(), e2.hwcap.bit_count()), (e1.hwcap, e2.hwcap)):
        if mine != theirs:
            return 1 if theirs > mine else -1
    return 0


def _sorted(records: Sequence[CacheRecord]) -> list[CacheRecord]:
    """add_to_cache()'s list: each record inserted before the first one ``_compare`` puts after it.

    Where libcmp is an order (no run of digits reaches 2**31) that is a stable sort, done here by the later
    rules first, then by name (a stable sort keeps their order among equal names). Otherwise ldconfig's
    insertions are replayed one by one: with an order that is not transitive, no sort gives its list."""
    keys = {r.soname: libcmp_key(r.soname) for r in records}
    if None in keys.values():
        entries: list[CacheRecord] = []
        for record in records:
            index = next((i for i, e in enumerate(entries) if _compare(e, record) > 0), len(entries))
            entries.insert(index, record)
        return entries
    entries = sorted(records, key=lambda r: (-r.flags, r.hwcaps is None, r.hwcaps or b"", -r.hwcap.bit_count(),
                                             -r.hwcap))
    entries.sort(key=lambda r: keys[r.soname] or [], reverse=True)
    return entries


def _string_table(strings: set[bytes]) -> tuple[bytes, dict[bytes, int]]:
    """stringtable_finalize(): sorted by their reversed bytes, descending, so that a string that
    ends the one before it is stored inside it (tail merging)."""
    if not strings:
        return b"", {}
    order = sorted(strings, key=lambda s: s[::-1], reverse=True)
    offsets = {order[0]: 0}
    previous = order[0]
    end = len(previous) + 1
    for current in order[1:]:
        if len(previous) >= len(current) and previous.endswith(current):
            offsets[current] = offsets[previous] + len(previous) - len(current)
        else:
            offsets[current] = end
            end += len(current) + 1
        previous = current
    table = bytearray(end)
    for string, offset in offsets.items():
        table[offset:offset + len(string)] = string
    return bytes(table), offsets


def encode_ldcache(records: Sequence[CacheRecord], hwcaps_seen: Iterable[bytes], generator: bytes) -> bytes:
    """The ld.so.cache glibc 2.36's ldconfig writes for *records* (in the order ldconfig added them).

    *hwcaps_seen*: every glibc-hwcaps subdirectory name ldconfig came across (each is interned in
    its string table even when it holds no library); *generator*: the ldconfig's own
    "ldconfig (...) release version X" string, as its extension section carries it.
    """
    entries = _sorted(records)
    strings = {r.soname for r in entries} | {r.path for r in entries} | set(hwcaps_seen)
    table, offsets = _string_table(strings)
    used = sorted({r.hwcaps for r in entries if r.hwcaps is not None})
    index = {name: i for i, name in enumerate(used)}
    base = _NEW_HEADER.size + len(entries) * _NEW_ENTRY.size  # string offsets count from the header
    extension_offset = (base + len(table) + 3) & ~3
    out = bytearray(_NEW_HEADER_W.pack(b"glibc-ld.so.cache", b"1.1", len(entries), len(table), _ENDIAN_LITTLE,
                                       extension_offset))
    for r in entries:
        hwcap = r.hwcap if r.hwcaps is None else HWCAP_EXTENSION | (r.isa_level << 32) | index[r.hwcaps]
        out += _NEW_ENTRY.pack(r.flags, base + offsets[r.soname], base + offsets[r.path], 0, hwcap)
    out += table
    out += bytes(extension_offset - len(out))
    hwcaps_offset = extension_offset + _EXTENSION_SIZE
    sections = [(_EXTENSION_TAG_GENERATOR, 0,
                 hwcaps_offset + 4 * len(used) if used else hwcaps_offset - 16, len(generator))]
    if used:
        sections.append((_EXTENSION_TAG_GLIBC_HWCAPS, 0, hwcaps_offset, 4 * len(used)))
    out += struct.pack("<II", _EXTENSION_MAGIC, len(sections))
    for section in sections:
        out += struct.pack("<IIII", *section)
    for name in used:
        out += struct.pack("<I", base + offsets[name])
    out += generator
    return bytes(out)


def generator_of(data: bytes) -> bytes | None:
    """The generator string of a new-format cache (which ldconfig wrote it), or None."""
    try:
        start = _new_header_offset(data)
        magic, _nlibs, _len, _flags, ext = _NEW_HEADER.unpack_from(data, start)
        if magic != NEW_MAGIC or ext == 0:
            return None
        ext_magic, count = struct.unpack_from("<II", data, start + ext)
        if ext_magic != _EXTENSION_MAGIC:
            return None
        for i in range(count):
            tag, _f, offset, size = struct.unpack_from("<IIII", data, start + ext + 8 + 16 * i)
            if tag == _EXTENSION_TAG_GENERATOR and start + offset + size <= len(data):
                return data[start + offset:start + offset + size]
    except (struct.error, LdCacheFormatError):
        return None
    return None

"""What glibc 2.36's ldconfig reads from a library file, read the same way (x86-64 ldconfig).

elf/readlib.c process_file and elf/readelflib.c process_elf_file with the x86 front-end
(sysdeps/unix/sysv/linux/x86/readelflib.c): the kind of library (its flags), its SONAME and,
from a GNU property note, the x86 ISA level it needs. Every offset the file gives is checked
against its size before it is read (ldconfig's check_ptr), so an image's file can make a
library unreadable, never make us read outside it. Only ``pread`` is used: nothing is mapped.

``sample_library`` writes the smallest such files, for checking a host's ldconfig against
gpuhook's reading of the same tree (``ldprofile``).
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpuhook.apply.ldshared import Shared

FLAG_LIBC4: Final = 0x0000
FLAG_ELF: Final = 0x0001
FLAG_ELF_LIBC5: Final = 0x0002
FLAG_ELF_LIBC6: Final = 0x0003
FLAG_X8664_LIB64: Final = 0x0300
FLAG_X8664_LIBX32: Final = 0x0800

_EM_386: Final = 3
_EM_X86_64: Final = 62
_ET_DYN: Final = 3
_PT_LOAD: Final = 1
_PT_DYNAMIC: Final = 2
_PT_INTERP: Final = 3
_PT_GNU_PROPERTY: Final = 0x6474E553
_DT_NEEDED: Final = 1
_DT_STRTAB: Final = 5
_DT_SONAME: Final = 14
_NT_GNU_PROPERTY_TYPE_0: Final = 5
_ISA_1_NEEDED: Final = 0xC0008002
_ZMAGIC: Final = 0o413
_QMAGIC: Final = 0o314
#: sizeof (struct exec) and sizeof (Elf64_Ehdr): anything smaller is not looked at
_MIN_SIZE: Final = 64
_INTERPRETERS: Final = (b"/lib/ld-linux-x86-64.so.2", b"/lib/ld-linux.so.2", b"/libx32/ld-linux-x32.so.2",
                        b"/lib64/ld-linux-x86-64.so.2")
_LIBC6_NEEDED: Final = (b"libc.so.6", b"libm.so.6")
#: a string read in one go; longer ones take more reads
_CHUNK: Final = 256


@dataclass(frozen=True, slots=True)
class _Layout:
    """Field positions of one ELF class."""

    phoff: struct.Struct
    phnum: int  # offset of e_phnum
    phdr: struct.Struct  # p_type, p_offset, p_vaddr, p_filesz, p_align in that order after unpacking
    dyn: struct.Struct
    word: int


_ELF64: Final = _Layout(struct.Struct("<Q"), 56, struct.Struct("<IIQQQQQQ"), struct.Struct("<qQ"), 8)
_ELF32: Final = _Layout(struct.Struct("<I"), 44, struct.Struct("<IIIIIIII"), struct.Struct("<iI"), 4)


@dataclass(frozen=True, slots=True)
class LibraryInfo:
    """What ldconfig learns from one library file."""

    flags: int
    soname: bytes | None
    isa_level: int


Identity = tuple[int, int, int, int, int]
#: Libraries read before, by file identity (``identity``): a driver library bind-mounted into a
#: container is the host's very inode, so a gpuhookd worker reads the driver's libraries while it
#: is idle (``remember``) and its start finds them here. a.out libraries, whose SONAME comes from
#: their name, are never kept.
_KNOWN: dict[Identity, LibraryInfo | None] = {}
#: what ``known`` answers for a file never read
UNKNOWN: Final = object()
#: gpuhookd's table of what any process of its pool read (``share``)
_shared: Shared | None = None


def identity(st: os.stat_result) -> Identity:
    """A file's identity: the same inode, unchanged since (size, mtime and ctime)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def known(st: os.stat_result) -> LibraryInfo | object | None:
    """What ``read_library`` said of this very file before (in this process, or in gpuhookd's pool:
    ``share``), or UNKNOWN."""
    answer = _KNOWN.get(identity(st), UNKNOWN)
    if answer is UNKNOWN and _shared is not None:
        answer = _shared.get(st)
        if answer is not UNKNOWN:
            _KNOWN[identity(st)] = answer  # type: ignore[assignment]
    return answer


def share(table: Shared | None) -> None:
    """Have ``known`` and ``keep`` use *table* too (gpuhookd, before it forks its workers); None: stop."""
    global _shared  # noqa: PLW0603 - one per process, set once by the daemon, inherited by its forks
    _shared = table


def remember(paths: Iterable[Path]) -> None:
    """Read the host files *paths* now (skipping any that cannot be), for ``known`` to answer later."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and known(st) is UNKNOWN:
                keep(st, read_library(fd, st.st_size, os.fsencode(path.name)))
        except OSError:
            pass
        finally:
            os.close(fd)


def keep(st: os.stat_result, info: LibraryInfo | None) -> None:
    """Remember what ``read_library`` said of the file *st* is, for ``known`` (not of an a.out library, whose
    SONAME comes from the name it was read under)."""
    if info is None or info.flags != FLAG_LIBC4:
        _KNOWN[identity(st)] = info
        if _shared is not None:
            _shared.put(st, info)


class _TruncatedError(Exception):
    """An offset in the file points past its end (ldconfig: "file ... is truncated")."""


class _File:
    """Bounds-checked reads of one open file, a 4 KiB page per ``pread``: a library's headers,
    dynamic section and names take a few reads, not one per field."""

    _PAGE = 4096

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        self._pages: dict[int, bytes] = {}

    def _page(self, index: int) -> bytes:
        page = self._pages.get(index)
        if page is None:
            page = self._pages[index] = os.pread(self.fd, self._PAGE, index * self._PAGE)
        return page

    def check(self, offset: int) -> None:
        """ldconfig's check_ptr: *offset* must lie inside the file."""
        if offset < 0 or offset >= self.size:
            raise _TruncatedError

    def read(self, offset: int, length: int) -> bytes:
        """Up to *length* bytes at *offset*, which must lie inside the file (fewer at its end)."""
        if offset < 0 or offset >= self.size:
            raise _TruncatedError
        first, last = offset // self._PAGE, (min(offset + length, self.size) - 1) // self._PAGE
        start = offset - first * self._PAGE
        if first == last:
            return self._page(first)[start:start + length]
        if last - first > 16:  # a large block (a dynamic section, say) is read in one go
            return os.pread(self.fd, length, offset)
        return b"".join(self._page(i) for i in range(first, last + 1))[start:start + length]

    def block(self, offset: int, count: int, layout: struct.Struct) -> list[tuple[int, ...]]:
        """*count* structs from *offset*; the file's end ends the list (a struct it cuts reads as
        zeros there). Raises _TruncatedError if the first one starts outside the file."""
        data = self.read(offset, count * layout.size)
        whole, rest = divmod(len(data), layout.size)
        if rest and whole < count:
            data = data[:whole * layout.size] + data[whole * layout.size:].ljust(layout.size, b"\0")
            whole += 1
        return list(layout.iter_unpack(data[:whole * layout.size]))

    def string(self, offset: int) -> bytes:
        """The NUL-terminated string at *offset* (the file's end ends it, as the mapping's zeros do)."""
        out = b""
        while offset + len(out) < self.size:
            chunk = self.read(offset + len(out), _CHUNK)
            end = chunk.find(b"\0")
            if end >= 0:
                return out + chunk[:end]
            out += chunk
        return out


def read_library(fd: int, size: int, name: bytes) -> LibraryInfo | None:  # noqa: PLR0911 - process_file's exits
    """process_file() on the regular file open at *fd* (*size* bytes) named *name*; None where ldconfig
    skips it (not a library, for another machine, or malformed)."""
    if size < _MIN_SIZE:
        return None
    file = _File(fd, size)
    header = file.read(0, 64)
    if len(header) < 64:
        return None
    a_info, = struct.unpack_from("<I", header, 0)
    if a_info & 0xFFFF in (_ZMAGIC, _QMAGIC):
        return LibraryInfo(FLAG_LIBC4, _aout_soname(name), 0)
    if header[:4] != b"\x7fELF":
        return None
    e_type, e_machine = struct.unpack_from("<HH", header, 16)
    if e_type != _ET_DYN:
        return None
    elf_class = header[4]
    if e_machine == _EM_X86_64:
        file_flag = FLAG_X8664_LIB64 | FLAG_ELF_LIBC6 if elf_class == 2 else FLAG_X8664_LIBX32 | FLAG_ELF_LIBC6
    elif e_machine == _EM_386 and elf_class == 1:
        file_flag = 0
    else:
        return None
    if elf_class not in (1, 2):
        return None
    try:
        info = _read_elf(file, header, _ELF64 if elf_class == 2 else _ELF32)
    except _TruncatedError:
        return None
    if info is None:
        return None
    return LibraryInfo(file_flag, info.soname, info.isa_level) if file_flag else info


def _aout_soname(name: bytes) -> bytes:
    """An a.out library's implied SONAME: its name up to the major version."""
    major = name.find(b".so.")
    if major < 0:
        return name
    dot = name.find(b".", major + 4)
    return name if dot < 0 else name[:dot]


def implicit_soname(name: bytes, flags: int) -> bytes:
    """implicit_soname(): a library without a SONAME is known by its file name (libc4: up to the major)."""
    return _aout_soname(name) if flags & 0xFF == FLAG_LIBC4 else name


def _read_elf(file: _File, header: bytes, layout: _Layout) -> LibraryInfo | None:  # noqa: PLR0912 - as readelflib.c
    phoff, = layout.phoff.unpack_from(header, 32 if layout is _ELF64 else 28)
    phnum, = struct.unpack_from("<H", header, layout.phnum)
    file.check(phoff)  # check_ptr (elf_pheader)
    flags, isa_level = FLAG_ELF, 0
    dynamic_addr = dynamic_size = 0
    segments = []
    table = file.block(phoff, phnum, layout.phdr) if phnum else []
    if len(table) < phnum:
        return None  # check_ptr (segment): the table runs past the file's end
    for fields in table:
        if layout is _ELF64:
            p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz, _memsz, p_align = fields
        else:
            p_type, p_offset, p_vaddr, _paddr, p_filesz, _memsz, _flags, p_align = fields
        segments.append((p_type, p_offset, p_vaddr, p_filesz))
        if p_type == _PT_DYNAMIC:
            dynamic_addr, dynamic_size = p_offset & 0xFFFFFFFF, p_filesz  # ldconfig keeps it in an unsigned int
        elif p_type == _PT_INTERP:
            if file.string(p_offset) in _INTERPRETERS:
                flags = FLAG_ELF_LIBC6
        elif p_type == _PT_GNU_PROPERTY and p_align == layout.word:
            isa_level = _isa_level(file, p_offset, p_filesz, p_align, layout.word) or isa_level
    if dynamic_size == 0:
        return None
    file.check(dynamic_addr)  # check_ptr (dyn_entry)
    dynamic = _dynamic(file, dynamic_addr, layout)
    strings = _strtab(dynamic, segments)
    if strings is None:
        return None
    file.check(strings)  # check_ptr (dynamic_strings)
    soname = None
    for tag, value in dynamic:
        if tag in (_DT_NEEDED, _DT_SONAME):
            file.check(strings + value)  # check_ptr (name)
            text = file.string(strings + value)
            if tag == _DT_NEEDED:
                if flags == FLAG_ELF and text in _LIBC6_NEEDED:
                    flags = FLAG_ELF_LIBC6
            else:
                soname = text
            if soname is not None and flags != FLAG_ELF:
                break
    return LibraryInfo(flags, soname, isa_level)


def _dynamic(file: _File, offset: int, layout: _Layout) -> list[tuple[int, int]]:
    """The dynamic section's (tag, value) pairs from *offset* up to DT_NULL or the file's end."""
    found: list[tuple[int, int]] = []
    while offset < file.size:
        entries = file.block(offset, 64, layout.dyn)
        for entry in entries:
            if entry[0] == 0:
                return found
            found.append(entry)  # type: ignore[arg-type]
        offset += len(entries) * layout.dyn.size
    return found


def _strtab(dynamic: list[tuple[int, int]], segments: list[tuple[int, int, int, int]]) -> int | None:
    """The file offset of the dynamic string table (DT_STRTAB mapped through its PT_LOAD), or None."""
    for tag, value in dynamic:
        if tag == _DT_STRTAB:
            for p_type, p_offset, p_vaddr, p_filesz in segments:
                if p_type == _PT_LOAD and p_vaddr <= value < p_vaddr + p_filesz:
                    return value - (p_vaddr - p_offset)
            return value
    return None


def _isa_level(file: _File, offset: int, size: int, align: int, word: int) -> int | None:
    """GNU_PROPERTY_X86_ISA_1_NEEDED's highest bit from the NT_GNU_PROPERTY_TYPE_0 note, if any (a
    note running past the file's end ends the search: ldconfig reads past it, we do not)."""
    try:
        return _isa_note(file, offset, size, align, word)
    except _TruncatedError:
        return None


def _isa_note(file: _File, offset: int, size: int, align: int,  # noqa: PLR0911 - each "goto done" of readelflib.c
              word: int) -> int | None:
    position = 0
    while position + 12 < size:
        namesz, descsz, n_type = struct.unpack("<III", file.read(offset + position, 12).ljust(12, b"\0"))
        if namesz == 4 and n_type == _NT_GNU_PROPERTY_TYPE_0 and file.read(offset + position + 12, 4) == b"GNU\0":
            if descsz < 8 or descsz % word:
                return None
            desc = file.read(offset + position + 16, descsz)
            ptr, last_type = 0, 0
            while True:
                if ptr + 8 > len(desc):
                    return None
                prop_type, datasz = struct.unpack_from("<II", desc, ptr)
                if prop_type < last_type:
                    return None
                ptr += 8
                if ptr + datasz > descsz:
                    return None
                last_type = prop_type
                if prop_type > _ISA_1_NEEDED:
                    return None
                if prop_type == _ISA_1_NEEDED:
                    if datasz == 4:
                        needed, = struct.unpack_from("<I", desc, ptr)
                        return needed.bit_length() - 1 if needed else None
                    return None
                ptr += (datasz + word - 1) & ~(word - 1)
                if descsz - ptr < 8:
                    return None
        position = _next_note(position, namesz, descsz, align)
    return None


def _next_note(position: int, namesz: int, descsz: int, align: int) -> int:
    """ELF_NOTE_NEXT_OFFSET: the next note after the one at *position*."""
    return position + ((((12 + namesz + align - 1) & ~(align - 1)) + descsz + align - 1) & ~(align - 1))


# -- sample files ------------------------------------------------------------------------------------


def sample_library(soname: bytes | None, *, needed: tuple[bytes, ...] = (), bits: int = 64,
                   isa_needed: int = 0) -> bytes:
    """The bytes of a minimal x86-64 (or, with *bits* 32, i386) shared object: one PT_LOAD over the
    whole file, its dynamic section with DT_NEEDED *needed* and DT_SONAME *soname*, and with
    *isa_needed* a GNU property note saying which x86 ISA levels it needs."""
    wide = bits == 64
    ehdr, phdr, dyn = (64, 56, 16) if wide else (52, 32, 8)
    names = [*needed, *([soname] if soname is not None else [])]
    strtab = b"\0" + b"".join(n + b"\0" for n in names)
    name_offsets = []
    position = 1
    for n in names:
        name_offsets.append(position)
        position += len(n) + 1
    word = 8 if wide else 4
    note = b""
    if isa_needed:
        desc = struct.pack("<III", _ISA_1_NEEDED, 4, isa_needed).ljust(8 + word, b"\0")
        note = struct.pack("<III", 4, len(desc), _NT_GNU_PROPERTY_TYPE_0) + b"GNU\0" + desc
    phnum = 3 if note else 2
    note_at = ehdr + phnum * phdr
    dyn_at = (note_at + len(note) + 7) & ~7
    tags = [(_DT_NEEDED, o) for o in name_offsets[:len(needed)]]
    if soname is not None:
        tags.append((_DT_SONAME, name_offsets[-1]))
    strtab_at = dyn_at + (len(tags) + 2) * dyn
    tags += [(_DT_STRTAB, strtab_at), (0, 0)]
    total = strtab_at + len(strtab)
    dyn_format = "<qQ" if wide else "<iI"
    dynamic = b"".join(struct.pack(dyn_format, t, v) for t, v in tags)
    if wide:
        head = struct.pack("<4sBBBB8xHHIQQQIHHHHHH", b"\x7fELF", 2, 1, 1, 0, _ET_DYN, _EM_X86_64, 1, 0, ehdr, 0, 0,
                           ehdr, phdr, phnum, 64, 0, 0)
        segs = [struct.pack("<IIQQQQQQ", _PT_LOAD, 5, 0, 0, 0, total, total, 0x1000),
                struct.pack("<IIQQQQQQ", _PT_DYNAMIC, 6, dyn_at, dyn_at, dyn_at, len(dynamic), len(dynamic), 8)]
        if note:
            segs.append(struct.pack("<IIQQQQQQ", _PT_GNU_PROPERTY, 4, note_at, note_at, note_at, len(note),
                                    len(note), 8))
    else:
        head = struct.pack("<4sBBBB8xHHIIIIIHHHHHH", b"\x7fELF", 1, 1, 1, 0, _ET_DYN, _EM_386, 1, 0, ehdr, 0, 0,
                           ehdr, phdr, phnum, 40, 0, 0)
        segs = [struct.pack("<IIIIIIII", _PT_LOAD, 0, 0, 0, total, total, 5, 0x1000),
                struct.pack("<IIIIIIII", _PT_DYNAMIC, dyn_at, dyn_at, dyn_at, len(dynamic), len(dynamic), 6, 4)]
        if note:
            segs.append(struct.pack("<IIIIIIII", _PT_GNU_PROPERTY, note_at, note_at, note_at, len(note),
                                    len(note), 4, 4))
    body = head + b"".join(segs) + note
    return body.ljust(dyn_at, b"\0") + dynamic + strtab

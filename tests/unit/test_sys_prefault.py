"""sys.prefault: the pages a forked process wrote, learned, and copied in ahead by the next fork."""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Callable

import pytest

from gpuhook.sys import prefault

PAGES = 64


def _buffer() -> tuple[bytearray, int]:
    """A page-aligned run of PAGES pages inside a private anonymous buffer, written (so resident)."""
    data = bytearray((PAGES + 1) * prefault.PAGE)
    base = ctypes.addressof((ctypes.c_char * len(data)).from_buffer(data))
    offset = -base % prefault.PAGE
    for page in range(PAGES + 1):
        data[page * prefault.PAGE] = 1
    return data, base + offset


def _exclusive(start: int, count: int) -> list[bool]:
    fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        entries = os.pread(fd, 8 * count, start // prefault.PAGE * 8)
    finally:
        os.close(fd)
    return [bool(e >> 63 & 1 and e >> 56 & 1) for (e,) in struct.iter_unpack("<Q", entries)]


def _in_child(work: Callable[[], bytes]) -> bytes:
    """Run *work* in a forked child; what it wrote to the pipe."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.write(write_fd, work())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        out = pipe.read()
    os.waitpid(pid, 0)
    return out


def test_a_fork_learns_the_pages_it_wrote_and_the_next_fork_copies_them_in_ahead() -> None:
    data, start = _buffer()
    offset = start - ctypes.addressof((ctypes.c_char * len(data)).from_buffer(data))
    written = [3, 4, 5, 20, 40]

    def write_some() -> bytes:
        assert not any(_exclusive(start, PAGES)), "a fresh fork shares every page"
        for page in written:
            data[offset + page * prefault.PAGE] = 2
        return prefault.encode(prefault.written_pages())

    learned = prefault.decode(_in_child(write_some))
    pages = {(address - start) // prefault.PAGE for low, high in learned for address in range(low, high, prefault.PAGE)
             if start <= address < start + PAGES * prefault.PAGE}
    assert pages == set(written)

    def copy_in() -> bytes:
        asked = prefault.populate(learned)
        return bytes(_exclusive(start, PAGES)) + struct.pack("<Q", asked)

    out = _in_child(copy_in)
    own, asked = [bool(b) for b in out[:PAGES]], struct.unpack("<Q", out[PAGES:])[0]
    if asked == 0:
        pytest.fail("MADV_POPULATE_WRITE copied nothing: this kernel is older than Linux 5.14")
    assert [page for page, mine in enumerate(own) if mine] == written  # copied before any write, nothing else


def test_ranges_survive_their_encoding_and_a_torn_tail_is_dropped() -> None:
    ranges = ((0x1000, 0x3000), (0x7F0000000000, 0x7F0000004000))
    encoded = prefault.encode(ranges)
    assert prefault.decode(encoded) == ranges
    assert prefault.decode(encoded[:-3]) == ranges[:1]
    assert prefault.populate(()) == 0


def test_learned_sets_are_shared_with_every_later_fork_and_a_torn_one_is_not_used() -> None:
    learned = prefault.Learned()
    worker, child = ((0x1000, 0x5000),), ((0x9000, 0xA000), (0xC000, 0xD000))

    def store() -> bytes:
        learned.store(prefault.Role.WORKER, worker)
        learned.store(prefault.Role.APPLY_CHILD, child)
        return b""

    _in_child(store)  # a process forked after the region was made writes it; its parent reads it
    assert (learned.load(prefault.Role.WORKER), learned.load(prefault.Role.APPLY_CHILD)) == (worker, child)
    assert _in_child(lambda: prefault.encode(learned.load(prefault.Role.APPLY_CHILD))) == prefault.encode(child)
    too_much = ((0, prefault.Learned.MOST + prefault.PAGE),)
    learned.store(prefault.Role.WORKER, too_much)  # not taken: the older set stays
    assert learned.load(prefault.Role.WORKER) == worker
    learned._region[prefault.Learned.SLOT + 12] ^= 0xFF  # a byte of the child's set, as a racing store leaves it
    assert learned.load(prefault.Role.APPLY_CHILD) == ()

"""The lease ledger on disk: ``leases.json`` in state_dir, changed only under ``leases.lock``.

Every change is a compare-and-swap: take the lock (flock, so a holder that dies releases it),
read the ledger, let a pure function decide the next one, write it atomically (a private
temporary file renamed over the old), unlock. Readers that only look (the poststop fast path)
read without the lock: a rename is atomic, so they see the old ledger or the new one.

state_dir is created root-only (0700) and must stay so: whoever can write it can grant or
steal GPUs. A writer killed between its temporary file and the rename leaves that file; the
next writer, holding the lock, removes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from gpuhook.errors import StateError
from gpuhook.hookcall import LEDGER_NAME, ledger_may_name
from gpuhook.sharing.ledger import Ledger, from_object, to_object
from gpuhook.sys.files import replace_at

LEDGER = LEDGER_NAME  # the poststop fast path (hookcall.lease_may_exist) looks for it too
LOCK = "leases.lock"
#: The most a ledger may be (some thousands of leases); a larger file is not gpuhook's.
LIMIT = 4 << 20
_TEMP_PREFIX = f".{LEDGER}."

T = TypeVar("T")


def update(state_dir: Path, change: Callable[[Ledger], tuple[Ledger, T]]) -> T:
    """Under the lock: the ledger, *change*'s next ledger written (if it differs), *change*'s result."""
    dir_fd = open_state_dir(state_dir)
    try:
        lock = _open(dir_fd, LOCK, os.O_RDWR | os.O_CREAT, state_dir)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            _remove_torn(dir_fd)
            ledger = _read(dir_fd, state_dir)
            after, result = change(ledger)
            if after != ledger:
                # json's default separators write `"container_id": "ID"`, the bytes hookcall.lease_may_exist
                # looks for; without indent its C encoder writes them (an indent takes the pure-Python one)
                try:
                    replace_at(dir_fd, LEDGER, json.dumps(to_object(after)).encode() + b"\n", mode=0o600)
                except OSError as err:
                    raise StateError(f"cannot write {state_dir / LEDGER}: {err.strerror or err}") from err
            return result
        finally:
            os.close(lock)  # releases the flock
    finally:
        os.close(dir_fd)


@contextlib.contextmanager
def gpu_lock(state_dir: Path, gpu_uuid: str, what: str = "mig") -> Iterator[None]:
    """Held while a GPU's MIG instances (*what* ``mig``) or its MPS daemon (``mps``) are changed
    (``<what>-<uuid>.lock``); taken before the ledger's lock, never after, so two starts never wait on each
    other in opposite orders."""
    name = f"{what}-" + "".join(c for c in gpu_uuid if c.isascii() and (c.isalnum() or c == "-")) + ".lock"
    dir_fd = open_state_dir(state_dir)
    try:
        lock = _open(dir_fd, name, os.O_RDWR | os.O_CREAT, state_dir)
    finally:
        os.close(dir_fd)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
    finally:
        os.close(lock)


def read(state_dir: Path) -> Ledger:
    """The ledger as it is now, without the lock (empty if state_dir or the file does not exist)."""
    try:
        dir_fd = os.open(state_dir, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return Ledger()
    except OSError as err:
        raise StateError(f"cannot open state_dir {state_dir}: {err.strerror or err}") from err
    try:
        _check_private(dir_fd, state_dir)
        return _read(dir_fd, state_dir)
    finally:
        os.close(dir_fd)


def may_name(state_dir: Path, container_id: str) -> bool:
    """False only when the ledger certainly holds no lease of *container_id*: its bytes, read without the
    lock (a change replaces the file whole, by rename), do not name it, or there is none. What cannot be
    read is left to the locked path (True), which says why."""
    try:
        fd = os.open(state_dir / LEDGER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    data = _read_whole(fd)
    return len(data) > LIMIT or ledger_may_name(data, container_id)  # too large: the locked path refuses it


def open_state_dir(state_dir: Path) -> int:
    """A directory fd of *state_dir*, created 0700 (with its parents) if absent; refused unless root-only."""
    try:
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        # O_RDONLY, not O_PATH: the torn-file sweep lists it
        dir_fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        raise StateError(f"cannot create or open state_dir {state_dir}: {err.strerror or err}. Fix: set state_dir "
                         "to a directory root can create (default /run/gpuhook)") from err
    try:
        _check_private(dir_fd, state_dir)
    except BaseException:
        os.close(dir_fd)
        raise
    return dir_fd


def _check_private(dir_fd: int, state_dir: Path) -> None:
    st = os.fstat(dir_fd)
    if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
        raise StateError(f"state_dir {state_dir} must be owned by root and writable only by it (it is "
                         f"mode {stat.S_IMODE(st.st_mode):o}, uid {st.st_uid}): whoever writes it grants GPUs. "
                         f"Fix: chown root {state_dir} && chmod 0700 {state_dir}")


def _open(dir_fd: int, name: str, flags: int, state_dir: Path) -> int:
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    except OSError as err:
        raise StateError(f"cannot open {state_dir / name}: {err.strerror or err}") from err
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise StateError(f"{state_dir / name} is not a regular file; remove it")
    return fd


def _read(dir_fd: int, state_dir: Path) -> Ledger:
    try:
        fd = _open(dir_fd, LEDGER, os.O_RDONLY | os.O_NONBLOCK, state_dir)
    except StateError as err:
        if isinstance(err.__cause__, FileNotFoundError):
            return Ledger()
        raise
    data = _read_whole(fd)
    source = str(state_dir / LEDGER)
    if len(data) > LIMIT:
        raise StateError(f"{source} is over {LIMIT} bytes; it is not gpuhook's ledger (remove it)")
    try:
        return from_object(json.loads(data), source=source)
    except ValueError as err:
        raise StateError(f"{source} is not JSON ({err}); remove it to start afresh "
                         "(leases of running containers are then forgotten)") from None


def _read_whole(fd: int) -> bytes:
    """The file *fd* holds, at most LIMIT + 1 bytes (more says: too large), then closed. Its size first: a
    ``read(LIMIT + 1)`` would allocate the 4 MiB every time (a fifth of a small ledger's read)."""
    try:
        want = min(os.fstat(fd).st_size, LIMIT) + 1  # the one byte more: EOF, or a file that grew
        chunks, got = [], 0
        while got < want and (chunk := os.read(fd, want - got)):
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _remove_torn(dir_fd: int) -> None:
    """Temporary files of writers that died before their rename (the lock is held: none is being written)."""
    for name in os.listdir(dir_fd):
        if name.startswith(_TEMP_PREFIX) and name.endswith(".tmp"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dir_fd)

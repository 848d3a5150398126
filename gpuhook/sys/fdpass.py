"""The bytes that travel beside a unix-socket message: SCM_RIGHTS fd lists and SO_PEERCRED credentials.

Pure byte packing (the socket calls stay with the caller), importing only the standard
library's ``sys``: the hook's side of gpuhookd's wire runs on every GPU container start,
and gpuhookd's children forked ahead receive their fds the same way.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

#: struct ucred {pid_t pid; uid_t uid; gid_t gid;}
UCRED_SIZE = 12


def pack_fds(fds: Sequence[int]) -> bytes:
    """An SCM_RIGHTS payload: the fds as C ints."""
    return b"".join(fd.to_bytes(4, sys.byteorder) for fd in fds)


def unpack_fds(data: bytes) -> list[int]:
    """The fds of an SCM_RIGHTS payload (a truncated trailing int is dropped)."""
    return [int.from_bytes(data[i : i + 4], sys.byteorder) for i in range(0, len(data) - len(data) % 4, 4)]


def ucred_uid(creds: bytes) -> int:
    """The uid in a struct ucred read with getsockopt(SO_PEERCRED, UCRED_SIZE)."""
    return int.from_bytes(creds[4:8], sys.byteorder)

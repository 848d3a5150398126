"""gpuhook.sys.fdpass: fd lists and peer credentials, over a real unix socket."""

from __future__ import annotations

import os
import socket

from hypothesis import given
from hypothesis import strategies as st

from gpuhook.sys import fdpass


@given(st.lists(st.integers(0, 2**31 - 1), max_size=16))
def test_fd_lists_round_trip(fds: list[int]) -> None:
    """Whatever is packed unpacks unchanged; a truncated trailing int is dropped."""
    data = fdpass.pack_fds(fds)
    assert fdpass.unpack_fds(data) == fds
    assert fdpass.unpack_fds(data + b"\1\2") == fds


def test_scm_rights_and_peer_credentials() -> None:
    """An fd sent with pack_fds arrives as the same file; SO_PEERCRED names our own uid."""
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    read_fd, write_fd = os.pipe()
    try:
        left.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fdpass.pack_fds([read_fd]))])
        _, ancillary, _, _ = right.recvmsg(1, socket.CMSG_SPACE(4))
        (got,) = [fd for level, kind, raw in ancillary if (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS)
                  for fd in fdpass.unpack_fds(raw)]
        try:
            assert (os.fstat(got).st_dev, os.fstat(got).st_ino) == (os.fstat(read_fd).st_dev, os.fstat(read_fd).st_ino)
        finally:
            os.close(got)
        creds = right.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, fdpass.UCRED_SIZE)
        assert fdpass.ucred_uid(creds) == os.getuid()
    finally:
        left.close()
        right.close()
        os.close(read_fd)
        os.close(write_fd)

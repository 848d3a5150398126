"""The hook's side of gpuhookd: hand a GPU request to the warm daemon, or learn that it must be done here.

Import-light on purpose (it runs on every GPU container start before anything heavy):
``_socket``, ``os``, ``struct`` and ``time``, no ``socket`` module (it imports ``enum``, ~3 ms).
Every wait is bounded: connect ``CONNECT_TIMEOUT``, send ``SEND_TIMEOUT``, reply ``REPLY_TIMEOUT``
(gpuhook-relay uses the same three, checked by its tests).

Falling back is safe only while the daemon cannot have started the work: a missing socket,
a refused connection, a backlog that stayed full, a server that is not root, a send that failed, or a ``declined``
reply. Once the request is sent, anything but a reply (the daemon died, the answer was cut
off) is an error: the work may be half done and rolled back, and doing it again here could
meet its leftovers.
"""

from __future__ import annotations

import os
import struct
import time

import _socket

from gpuhook import __version__
from gpuhook.daemon import wire
from gpuhook.sys import fdpass

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

#: The hook's view of the host, passed as fds so the daemon's worker sees exactly it: the mount
#: and cgroup namespaces it enters, the pid and user namespaces it must already share, the root.
NAMESPACES = ("mnt", "cgroup", "pid", "user")
#: Longer than the daemon's own per-request limit, so the daemon gives up (and rolls back) first.
REPLY_TIMEOUT = 150.0
#: A backlog full this long is a daemon not serving: nothing was sent, the hook works alone.
CONNECT_TIMEOUT = 1.0
#: gpuhookd reads a whole request within its READ_TIMEOUT; sending it gets the same bound.
SEND_TIMEOUT = 5.0


class NotServed(Exception):  # noqa: N818 - an outcome, not a failure: the hook does the work itself
    """The daemon did not take the request (no side effects); the message says why."""


def call_daemon(path: str, *, config: str | None, debug: bool, env: Mapping[str, str], state: bytes,
                spec: bytes) -> tuple[int, str]:
    """(exit status, message for stderr) of the request as the daemon ran it; raises NotServed."""
    parts = wire.hook_parts(__version__, config, debug, env, state, spec)
    verdict, status, message = exchange(path, wire.encode_request(b"hook", parts))
    if verdict != b"done":
        raise NotServed(f"gpuhookd declined: {message}")
    return status, message


def ping(path: str) -> str:
    """The version of the daemon serving *path*; raises NotServed."""
    verdict, _, message = exchange(path, wire.encode_request(b"ping", [__version__.encode()]))
    if verdict != b"pong":
        raise NotServed(f"gpuhookd answered a ping with {verdict.decode()}: {message}")
    return message


def exchange(path: str, request: bytes) -> tuple[bytes, int, str]:
    """Send *request* with our namespaces attached and return the decoded reply."""
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    try:
        # A unix connect() waits while the listener's backlog is full, bounded only by SO_SNDTIMEO
        # (a non-blocking one fails at once): EAGAIN after CONNECT_TIMEOUT.
        sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_SNDTIMEO, struct.pack("@ll", int(CONNECT_TIMEOUT), 0))
        try:
            sock.connect(path)
        except OSError as err:  # ENOENT, ECONNREFUSED (stale socket), EACCES, ENOTSOCK, EAGAIN (backlog full), ...
            why = (f"its backlog stayed full for {CONNECT_TIMEOUT:g} s" if isinstance(err, BlockingIOError)
                   else err.strerror)
            raise NotServed(f"no gpuhookd at {path} ({why})") from None
        uid = fdpass.ucred_uid(sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, fdpass.UCRED_SIZE))
        if uid != 0:
            # /run is root's, but a --daemon-socket elsewhere could be anyone's: never hand our
            # namespaces to a process that is not root.
            raise NotServed(f"{path} is served by uid {uid}, not root; not using it")
        _send(sock, request)
        sock.settimeout(REPLY_TIMEOUT)
        return _receive_reply(sock, path)
    finally:
        sock.close()


def _send(sock: _socket.socket, request: bytes) -> None:
    """The request and, with its first byte, fds of our namespaces and root (SCM_RIGHTS)."""
    fds = [os.open(f"/proc/self/ns/{name}", os.O_RDONLY | os.O_CLOEXEC) for name in NAMESPACES]
    try:
        fds.append(os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
        deadline = time.monotonic() + SEND_TIMEOUT  # for the whole request, not per call
        sock.settimeout(SEND_TIMEOUT)
        view = memoryview(request)
        sent = sock.sendmsg([view], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, fdpass.pack_fds(fds))])
        while sent < len(view):
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sent += sock.send(view[sent:])
    except OSError as err:
        # The daemon starts work only on a whole request, so a failed send changed nothing.
        raise NotServed(f"sending to gpuhookd failed ({err.strerror or err})") from None
    finally:
        for fd in fds:
            os.close(fd)


def _receive_reply(sock: _socket.socket, path: str) -> tuple[bytes, int, str]:
    """The whole reply; anything else is an error the hook reports (the work may have started)."""
    chunks: list[bytes] = []
    size = 0
    try:
        while size <= wire.REPLY_LIMIT:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return wire.decode_reply(b"".join(chunks))
    except (OSError, wire.WireError) as err:
        from gpuhook.errors import DaemonError

        why = "timed out" if isinstance(err, TimeoutError) else str(err)
        # Word for word what gpuhook-relay says in the same case (relay/gpuhook-relay.c).
        raise DaemonError(f"gpuhookd {path}: no complete answer ({why}); see gpuhookd's journal "
                          "(journalctl -u gpuhookd) and the hook log") from None

"""A bounded HTTP server for one page: the metrics endpoint's front (issue #31).

Any local user can connect to the metrics port, so no connection may hold more than a slot of a fixed
table for a bounded time: one thread serves them all (a selector loop); at most MAX_CONNECTIONS are
open, and a new one evicts the oldest still sending its request (a scraper sends its request at once,
so only idle or slow ones are evicted); a request must arrive whole within DEADLINE_S of the accept
and its answer be taken within DEADLINE_S of being ready, else the connection is dropped (an idle or
slow-loris connection ends there, whatever it trickles); one request per connection, its head at
most HEAD_LIMIT bytes. The page is made one scrape at a time, in the loop itself.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, NoReturn

MAX_CONNECTIONS: Final = 32
DEADLINE_S: Final = 5.0
HEAD_LIMIT: Final = 8192
_END_OF_HEAD: Final = b"\r\n\r\n"


@dataclass(frozen=True, slots=True)
class Page:
    """What the server serves: the path, its content type, and how to make the body (at each request)."""

    path: str
    content_type: str
    make: Callable[[], bytes]


@dataclass(slots=True)
class _Connection:
    sock: socket.socket
    deadline: float
    received: bytearray = field(default_factory=bytearray)
    #: the answer's bytes not yet sent; None while the request is still arriving
    unsent: memoryview | None = None


class _Server:
    def __init__(self, listener: socket.socket, page: Page) -> None:
        self.listener, self.page = listener, page
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ)
        #: in accept order, so the first one still reading is the one to evict
        self.open: dict[int, _Connection] = {}

    def run(self) -> NoReturn:
        while True:
            now = time.monotonic()
            for late in [c for c in self.open.values() if c.deadline <= now]:
                self._close(late)
            wait = min((c.deadline for c in self.open.values()), default=now + 3600.0) - now
            for key, _ in self.selector.select(max(wait, 0.0)):
                conn = self.open.get(key.fd)
                if key.fileobj is self.listener:
                    self._accept()
                elif conn is not None and conn.unsent is None:
                    self._read(conn)
                elif conn is not None:
                    self._write(conn)

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:  # gone before its accept, or none after all
            return
        if len(self.open) >= MAX_CONNECTIONS:
            reading = next((c for c in self.open.values() if c.unsent is None), None)
            if reading is None:  # every slot is answering: the newcomer waits for none of them
                sock.close()
                return
            self._close(reading)
        sock.setblocking(False)
        conn = _Connection(sock, time.monotonic() + DEADLINE_S)
        self.open[sock.fileno()] = conn
        self.selector.register(sock, selectors.EVENT_READ)

    def _read(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        conn.received += data
        if _END_OF_HEAD in conn.received:
            self._answer(conn, *self._respond(bytes(conn.received).split(b"\r\n", 1)[0]))
        elif len(conn.received) > HEAD_LIMIT:
            self._answer(conn, "431 Request Header Fields Too Large", f"over {HEAD_LIMIT} bytes\n".encode())

    def _respond(self, request_line: bytes) -> tuple[str, bytes, str]:
        parts = request_line.decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return "400 Bad Request", b"not an HTTP/1.x request\n", "text/plain"
        if parts[0] != "GET":
            return "405 Method Not Allowed", b"only GET\n", "text/plain"
        if parts[1].split("?", 1)[0] != self.page.path:
            return "404 Not Found", f"see {self.page.path}\n".encode(), "text/plain"
        try:
            return "200 OK", self.page.make(), self.page.content_type
        except Exception as err:  # noqa: BLE001  (a scrape that failed is answered, and the next may succeed)
            return "500 Internal Server Error", f"{err}\n".encode(), "text/plain"

    def _answer(self, conn: _Connection, status: str, body: bytes, content_type: str = "text/plain") -> None:
        head = (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n").encode("latin-1")
        conn.unsent = memoryview(head + body)
        conn.deadline = time.monotonic() + DEADLINE_S  # the page took its time; the reader gets its own
        self.selector.modify(conn.sock, selectors.EVENT_WRITE)

    def _write(self, conn: _Connection) -> None:
        assert conn.unsent is not None
        try:
            sent = conn.sock.send(conn.unsent)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            sent = len(conn.unsent)  # the reader is gone: nothing more to send
        conn.unsent = conn.unsent[sent:]
        if not conn.unsent:
            self._close(conn)

    def _close(self, conn: _Connection) -> None:
        del self.open[conn.sock.fileno()]
        self.selector.unregister(conn.sock)
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_RDWR)
        conn.sock.close()


def serve(listener: socket.socket, page: Page) -> NoReturn:
    """Serve *page* on *listener* (a bound, listening socket) forever."""
    listener.setblocking(False)
    _Server(listener, page).run()

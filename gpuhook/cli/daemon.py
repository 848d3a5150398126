"""``gpuhook daemon``: run gpuhookd in the foreground (systemd's gpuhookd.service does this)."""

from __future__ import annotations

import os

from gpuhook import __version__, service
from gpuhook.daemon import server
from gpuhook.errors import ConfigError

#: An hour: far beyond any runtime's hook timeout, and small enough for alarm(2) and a deadline.
MAX_REQUEST_TIMEOUT = 3600.0

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import MutableMapping


def run_daemon(socket_path: str, *, request_timeout: float, env: MutableMapping[str, str]) -> int:
    """Listen (on systemd's socket, else on *socket_path*), preload the GPU path, serve forever."""
    if os.geteuid() != 0:
        raise ConfigError("gpuhookd enters containers' namespaces and must run as root")
    if not 0 < request_timeout <= MAX_REQUEST_TIMEOUT:  # also refuses nan
        raise ConfigError(f"--request-timeout must be a number of seconds in (0, {MAX_REQUEST_TIMEOUT:g}], "
                          f"got {request_timeout:g}")
    listener = server.systemd_socket(env)
    where = "the socket systemd passed" if listener is not None else socket_path
    server.preload()
    note = service.prepare_daemon(env)
    if note:
        server.say(note)
    if listener is None:
        # Bound once ready: until then a hook finds no socket and does the work itself at once,
        # instead of waiting in the backlog for the imports (systemd's socket queues them).
        listener = server.bind_socket(socket_path)
    os.chdir("/")
    server.say(f"serving on {where} (gpuhook {__version__}, pid {os.getpid()})")
    server.serve(listener, request_timeout=request_timeout)

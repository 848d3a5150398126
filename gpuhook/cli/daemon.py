"""``gpuhook daemon``: run gpuhookd in the foreground (systemd's gpuhookd.service does this)."""

from __future__ import annotations

import math
import os

from gpuhook import __version__, service
from gpuhook.config import ENV_VAR, Config
from gpuhook.daemon import pool, server
from gpuhook.errors import ConfigError

#: An hour: far beyond any runtime's hook timeout, and small enough for alarm(2) and a deadline.
MAX_REQUEST_TIMEOUT = 3600.0

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import MutableMapping


def run_daemon(socket_path: str, *, request_timeout: float, env: MutableMapping[str, str],
               config: str | None = None) -> int:
    """Listen (on systemd's socket, else on *socket_path*), preload the GPU path, serve forever.

    *config* (``gpuhook --config FILE daemon``), else ``$GPUHOOK_CONFIG``, else the default: the
    one config file gpuhookd serves (a hook naming another one does the work itself).
    """
    if os.geteuid() != 0:
        raise ConfigError("gpuhookd enters containers' namespaces and must run as root")
    if not (math.isfinite(request_timeout) and 0 < request_timeout <= MAX_REQUEST_TIMEOUT):
        raise ConfigError(f"--request-timeout must be a number of seconds in (0, {MAX_REQUEST_TIMEOUT:g}], "
                          f"got {request_timeout:g}")
    own = server.OwnConfig.resolve(config, env)
    listener = server.systemd_socket(env)
    where = "the socket systemd passed" if listener is not None else socket_path
    server.preload()
    note = service.prepare_daemon({ENV_VAR: own.path} if own.required else {})
    if note:
        server.say(note)
    if listener is None:
        # Bound once ready: until then a hook finds no socket and does the work itself at once,
        # instead of waiting in the backlog for the imports (systemd's socket queues them).
        listener = server.bind_socket(socket_path)
    os.chdir("/")
    settings = own.load(False)
    if settings.metrics_listen is not None:
        pid = _fork_metrics(settings, listener.fileno())
        server.say(f"metrics on http://{settings.metrics_listen}/metrics (process {pid})")
    server.say(f"serving on {where} (gpuhook {__version__}, pid {os.getpid()}, config {own.path})")
    pool.serve(listener, request_timeout=request_timeout, config=own)


def _fork_metrics(config: Config, listener_fd: int) -> int:
    """The metrics process: serves the endpoint until gpuhookd ends (it dies with it), unprivileged, with a root
    child that reads what it serves (metrics.serve). No start waits on it, so it being slow, stopped or dead
    costs a start nothing; it is not restarted (the journal says it died)."""
    import signal

    from gpuhook.daemon import metrics
    from gpuhook.sys import process

    pid = os.fork()
    if pid:
        return pid
    try:
        process.prctl(process.PR_SET_PDEATHSIG, signal.SIGTERM)
        os.close(listener_fd)  # the hooks' socket is the workers'
        metrics.serve(config)
    except BaseException as err:  # noqa: BLE001  (the child's end: say why, never return into the parent's code)
        server.say(f"the metrics endpoint on {config.metrics_listen} stopped: {err}")
    os._exit(1)

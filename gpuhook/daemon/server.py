"""gpuhookd: the GPU path, imported once, forked per request.

The parent imports the GPU path, then only forks workers; it never touches a connection. Two
workers are kept waiting in accept(), each prepared at the lowest priority before a request
arrives (a worker's replacement is forked once it has answered, so preparing it takes no CPU
from the request): its apply child, with that child's ldconfig child, is already forked
(``gpuhook.apply.ahead``). A worker answers connections until one asks for GPUs, serves that
one and exits:

1. reads one bounded request, with a deadline, and the fds the hook attached;
2. checks the peer is root (SO_PEERCRED; the socket is also 0600 in a 0700 directory);
3. for gpuhook-relay's raw hook calls, does what the hook does first (argv, environment
   tripwire, state, config.json through the hook's root, the no-GPU check) and answers a
   container that asks for no GPU at once, staying ready for the next connection;
4. declines (the hook then does the work itself) unless the hook runs the same gpuhook version
   and shares the daemon's pid and user namespaces, since the OCI state's pid and the
   container's ids are numbers in those;
5. enters the hook's mount and cgroup namespaces and its root, so every path (bundle, rootfs,
   driver root, config, log, cache) and the container's cgroup resolve exactly as they would
   in the hook process (a runtime in a private mount namespace works unchanged);
6. runs the same ``inject`` as the in-process hook and replies with its exit status and message.

A worker that outlives ``request_timeout`` is killed by SIGALRM; its own children die with it
(PDEATHSIG), and the hook, seeing no reply, refuses the container.
"""

from __future__ import annotations

import gc
import importlib
import os
import pkgutil
import select
import signal
import socket
import stat
import sys
import time
import traceback
from dataclasses import dataclass

from gpuhook import __version__, hookcall, service
from gpuhook.daemon import wire
from gpuhook.errors import ConfigError, GpuHookError, report_failure
from gpuhook.sys import fdpass, process

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import MutableMapping, Sequence
    from typing import NoReturn

    from gpuhook.service import ChildAhead

#: Loaded once in the parent besides every gpuhook module: NVML's binding for a cache miss and
#: PyYAML for a config outside the flat subset. A worker may sit in another mount namespace,
#: where this package's files need not exist, so a request must import nothing (a test checks).
PRELOAD = ("pynvml", "yaml", "json", "pickle", "traceback")
READ_TIMEOUT = 5.0
#: Workers kept forked and waiting in accept(); more absorb a burst of container starts.
SPARE_WORKERS = 2
IDLE_NICE = 19
_FDS = 5  # the client's mnt, cgroup, pid and user namespaces, and its root


def preload() -> None:
    """Import the GPU path (all of gpuhook) now, so that no request pays for it."""
    import gpuhook

    for name in PRELOAD:
        importlib.import_module(name)
    for module in pkgutil.walk_packages(gpuhook.__path__, "gpuhook."):
        if not module.name.endswith(".__main__"):  # that one runs the CLI
            importlib.import_module(module.name)
    # Keep the collector off the preloaded objects: a collection in a worker would touch (and so
    # copy-on-write) every page of them; workers are short-lived and run without it (_fork_worker).
    gc.collect()
    gc.freeze()


def serve(listener: socket.socket, *, request_timeout: float, spares: int = SPARE_WORKERS) -> NoReturn:
    """Keep *spares* forked workers waiting in accept(); fork a new one whenever one has answered.

    Forking the warm daemon takes milliseconds (its page tables are copied), so it happens
    before a request arrives, not while a container waits. Each worker serves one connection.
    """
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the workers
    # Forking and preparing spares happens while other workers serve containers: at the lowest
    # priority (nice 19, never starved as SCHED_IDLE could be), so it does not slow them down.
    # A prepared worker (and each child it forked ahead) takes the daemon's own priority back.
    normal = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, 0, IDLE_NICE)
    waiting: dict[int, int] = {}  # read end of a worker's pipe -> its pid
    while True:
        while len(waiting) < spares:
            try:
                read_fd, pid = _fork_worker(listener, request_timeout, normal)
            except OSError as err:  # EAGAIN, ENOMEM: say so, retry soon
                say(f"fork failed: {err}")
                time.sleep(0.1)
                break
            waiting[read_fd] = pid
        if not waiting:
            continue
        # A byte (or EOF, if it died) on a worker's pipe: it has answered its request; replace it.
        for read_fd in select.select(list(waiting), [], [])[0]:
            os.close(read_fd)
            del waiting[read_fd]


def _fork_worker(listener: socket.socket, request_timeout: float, priority: int) -> tuple[int, int]:
    """Fork one worker that waits for a connection; (read end of its answered pipe, pid)."""
    read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
    daemon = os.getpid()
    pid = os.fork()
    if pid != 0:
        os.close(write_fd)
        return read_fd, pid
    os.close(read_fd)  # pragma: no cover - the worker; exercised through real runc in tests/e2e
    code = 0
    try:
        gc.disable()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the worker waits for its own children
        # Idle workers go with the daemon; one serving a request finishes it (PDEATHSIG off again).
        process.prctl(process.PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != daemon:  # it died before the prctl
            os._exit(0)
        # Before a request waits for it: the apply child's fork. Not when a connection already
        # waits (a burst of container starts): serve it now.
        apply_child = None
        if not select.select([listener], [], [], 0)[0]:
            apply_child = service.fork_apply_ahead(close=(listener.fileno(), write_fd), priority=priority)
        os.setpriority(os.PRIO_PROCESS, 0, priority)  # prepared: wake for a request at full priority
        conn, request = _answer_until_gpu_request(listener, daemon, request_timeout)
        listener.close()
        try:
            serve_gpu_request(conn, request, apply_child)
        finally:
            # Now the daemon forks a replacement: preparing it while this request ran would take
            # CPU from it. A burst meanwhile goes to the other spare, or queues briefly.
            os.write(write_fd, b"!")
            os.close(write_fd)
            if apply_child is not None:
                apply_child.cancel()  # unless the request started it
    except BaseException:  # noqa: BLE001 - a worker never unwinds into the daemon's loop
        say(f"request failed:\n{traceback.format_exc()}")
        code = 1
    os._exit(code)


#: Requests a worker answers without entering a hook's view (no GPU asked, pings, declines) before
#: it retires anyway: it runs with the collector off, so whatever cycles a request leaves stay.
ANSWERS_PER_WORKER = 256


def _answer_until_gpu_request(listener: socket.socket, daemon: int,
                              request_timeout: float) -> tuple[socket.socket, HookWork]:
    """Accept connections and answer those that need no GPU work; return the first that does.

    A container that asks for no GPU (gpuhook-relay leaves that check to the daemon) changes
    nothing in the worker, so the same prepared worker waits for the next connection: most
    container starts on a hooks.d ``always`` host cost the daemon no fork at all.
    """
    for _ in range(ANSWERS_PER_WORKER):
        conn = _accept(listener)
        process.prctl(process.PR_SET_PDEATHSIG, 0)  # the daemon's end no longer ends this request
        request = handle(conn, request_timeout=request_timeout)
        if request is not None:
            return conn, request
        conn.close()
        process.prctl(process.PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != daemon:
            os._exit(0)
    os._exit(0)  # retired: the daemon sees the pipe's EOF and forks a fresh one


def _accept(listener: socket.socket) -> socket.socket:
    """The next connection; transient errors (EMFILE, ENOBUFS, ...) are reported and retried."""
    while True:
        try:
            return listener.accept()[0]
        except OSError as err:
            say(f"accept failed: {err}")
            time.sleep(0.1)


@dataclass(frozen=True, slots=True)
class HookWork:
    """A request that needs GPU work in the hook's view: the hook's inputs, decoded, and the fds of that view."""

    fds: list[int]  # the hook's mnt, cgroup, pid and user namespaces, and its root
    call: hookcall.HookCall


Reply = tuple[bytes, int, str]


def handle(conn: socket.socket, *, request_timeout: float) -> HookWork | None:
    """Answer *conn* unless its request needs GPU work in the hook's view; then return that work.

    Runs in the worker, in the daemon's own view: nothing here enters a namespace or changes
    the worker, so after an answer it can take the next connection.
    """
    signal.alarm(max(1, int(request_timeout)))
    conn.settimeout(READ_TIMEOUT)
    # The whole request is read before any reply, even one refusing it: closing a unix socket with
    # unread data resets the connection, and the peer would lose the reply.
    try:
        kind, parts, fds = _receive(conn)
    except (OSError, wire.WireError) as err:  # nothing was done: the hook may do it itself
        _answer(conn, (b"declined", 0, f"unreadable request: {err}"))
        return None
    try:
        uid = _peer_uid(conn)
        # The socket is 0600 in a 0700 directory; this is the check that does not depend on it.
        reply = _triage(kind, parts, fds) if uid == 0 else (b"declined", 0, f"peer uid {uid} is not root")
    except BaseException:
        _close_all(fds)
        raise
    if isinstance(reply, HookWork):
        return reply  # it owns the fds now
    _close_all(fds)
    _answer(conn, reply)
    return None


def _answer(conn: socket.socket, reply: Reply) -> None:
    """Send *reply*; the request is over (its alarm too)."""
    _send_quietly(conn, wire.encode_reply(*reply))
    signal.alarm(0)


def _triage(kind: bytes, parts: list[bytes], fds: list[int]) -> Reply | HookWork:  # noqa: PLR0911 - one per outcome
    """The reply to a request that needs no GPU work, or the decoded GPU work.

    A ``hook`` request comes from the Python hook, which read config.json and saw a GPU asked
    for. A ``relay`` request is gpuhook-relay's raw hook call (argv, environment, stdin): it is
    read as the in-process hook reads it (``hookcall``), config.json through the hook's root.
    """
    if kind == b"ping":
        return b"pong", 0, __version__
    try:
        if kind == b"hook":
            version, config, debug, env, state_bytes, spec_bytes = wire.decode_hook_parts(parts)
            args = hookcall.HookArgs("prestart", config, debug, None)
        else:
            version, argv, env, state_bytes = wire.decode_relay_parts(parts)
            spec_bytes = None
            relayed = hookcall.relayed_hook_args(argv)
            if relayed is None:  # --help, another command, a mistake: gpuhook's own CLI answers those
                return b"declined", 0, f"not a hook call: {' '.join(argv)[:200]}"
            args = relayed
    except wire.WireError as err:
        return b"declined", 0, f"unreadable request: {err}"
    if version != __version__:
        return (b"declined", 0,
                f"gpuhookd runs gpuhook {__version__}, the hook {version} (restart gpuhookd after an upgrade)")
    try:
        call = hookcall.read_hook_call(args, env, state_bytes, spec_bytes=spec_bytes, root_fd=fds[4])
        if args.action == hookcall.STOP:
            service.stop(None, call.state)
    except GpuHookError as err:
        return b"done", 1, report_failure(err) + "\n"
    if args.action != hookcall.START or not call.asks_gpu:
        return b"done", 0, ""
    return HookWork(fds, call)


def serve_gpu_request(conn: socket.socket, work: HookWork, apply_child: ChildAhead | None) -> None:
    """Enter the hook's view, run the start as the in-process hook would, answer."""
    try:
        reason = service.enter_hook_view(work.fds)
        if reason:
            _send_quietly(conn, wire.encode_reply(b"declined", 0, reason))
            return
        # The apply child was forked in the daemon's view: it takes the hook's mount namespace and root.
        ahead = (service.ChildForkedAhead(apply_child, mount_ns_fd=work.fds[0], root_fd=work.fds[4])
                 if apply_child else None)
        status, message = run_start(work.call, ahead)
    finally:
        _close_all(work.fds)
    _send_quietly(conn, wire.encode_reply(b"done", status, message))


def run_start(call: hookcall.HookCall, ahead: service.ChildForkedAhead | None = None) -> tuple[int, str]:
    """What the in-process hook would do with this call: (exit status, stderr text)."""
    before = set(sys.modules)
    try:
        config = service.load_settings(call.args.config, call.args.debug, call.env)
        service.start_hook(config, call.state, call.spec, served_by="gpuhookd", ahead=ahead)
    except GpuHookError as err:
        return 1, report_failure(err) + "\n"
    except Exception:  # noqa: BLE001 - a bug: the hook shows the traceback, as it would in-process
        return 1, f"gpuhook: internal error in gpuhookd:\n{traceback.format_exc()}"
    finally:
        _log_imports(sorted(set(sys.modules) - before))
    return 0, ""


def _send_quietly(conn: socket.socket, data: bytes) -> None:
    """Send a reply; a hook that has gone (killed by its runtime, a probe) costs only its connection."""
    try:
        conn.sendall(data)
    except OSError as err:
        say(f"the hook left before its answer ({err.strerror or err})")


def _log_imports(modules: Sequence[str]) -> None:
    """A debug event naming modules a request had to import (PRELOAD should leave none)."""
    from gpuhook import log

    if log.is_configured():
        log.get_logger().debug("request_imports", modules=list(modules))


def _peer_uid(conn: socket.socket) -> int:
    """The connecting process's uid, from the kernel (SO_PEERCRED)."""
    return fdpass.ucred_uid(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, fdpass.UCRED_SIZE))


def _receive(conn: socket.socket) -> tuple[bytes, list[bytes], list[int]]:
    """(kind, parts, fds) of one request; raises WireError or OSError (timeout included)."""
    data, ancillary, _, _ = conn.recvmsg(65536, socket.CMSG_SPACE(_FDS * 4), socket.MSG_CMSG_CLOEXEC)
    fds: list[int] = []
    for level, cmsg_type, payload in ancillary:
        if level == socket.SOL_SOCKET and cmsg_type == socket.SCM_RIGHTS:
            fds += fdpass.unpack_fds(payload)
    try:
        line, newline, body = data.partition(b"\n")
        while not newline:
            if len(line) > wire.HEADER_LIMIT:
                raise wire.WireError("request header too long")
            chunk = conn.recv(4096)
            if not chunk:
                raise wire.WireError("request ended inside its header")
            line, newline, body = (line + chunk).partition(b"\n")
        kind, sizes = wire.parse_header(line)
        chunks, size, total = [body], len(body), sum(sizes)
        while size < total:
            chunk = conn.recv(min(1 << 20, total - size))
            if not chunk:
                raise wire.WireError(f"request ended after {size} of {total} bytes")
            chunks.append(chunk)
            size += len(chunk)
        body = b"".join(chunks)
        if size != total:
            raise wire.WireError(f"request has {size - total} bytes past its end")
        if kind != b"ping" and len(fds) != _FDS:
            raise wire.WireError(f"a {kind.decode()} request carries {_FDS} fds, this one {len(fds)}")
    except BaseException:
        _close_all(fds)
        raise
    return kind, wire.split_parts(body, sizes), fds


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        os.close(fd)


def say(message: str) -> None:
    """One line for the daemon's journal."""
    print(f"gpuhookd: {message}", file=sys.stderr, flush=True)


# --- the listening socket -----------------------------------------------------------------------


def systemd_socket(env: MutableMapping[str, str]) -> socket.socket | None:
    """The socket systemd passed (socket activation, sd_listen_fds(3)), if any."""
    if env.get("LISTEN_PID") != str(os.getpid()) or env.get("LISTEN_FDS") != "1":
        return None
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        env.pop(name, None)
    listener = socket.socket(fileno=3)
    if listener.family != socket.AF_UNIX or listener.type != socket.SOCK_STREAM:
        raise ConfigError("the socket systemd passed is not a unix stream socket; use ListenStream= with a path")
    os.set_inheritable(3, False)
    return listener


def bind_socket(path: str) -> socket.socket:
    """Listen on *path*: mode 0600 in a root-only directory; a stale socket file is replaced."""
    if not path.startswith("/"):
        raise ConfigError(f"the daemon socket {path!r} must be an absolute path")
    try:
        return _bind(path)
    except OSError as err:
        raise ConfigError(f"cannot listen on {path}: {err.strerror or err}") from err


def _bind(path: str) -> socket.socket:
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise ConfigError(f"{directory} must be a directory owned by root and writable only by it "
                          f"(it is mode {stat.S_IMODE(st.st_mode):o}, uid {st.st_uid})")
    _remove_stale(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    old = os.umask(0o177)
    try:
        listener.bind(path)
    finally:
        os.umask(old)
    listener.listen(128)
    return listener


def _remove_stale(path: str) -> None:
    """Unlink a socket nobody listens on; refuse to replace a live daemon or a non-socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"{path} exists and is not a socket; remove it or choose another --socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)
        return
    finally:
        probe.close()
    raise ConfigError(f"another gpuhookd already serves {path}")

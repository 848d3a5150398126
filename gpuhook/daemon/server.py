"""gpuhookd's requests: one connection read, checked, answered or taken into the hook's view.

The parent imports the GPU path, then only forks workers (``pool``: how many, when); it never
touches a connection. A worker answers connections until one asks for GPUs, serves that one
and exits:

1. reads one bounded request (``READ_TIMEOUT`` for the whole of it, however slowly it comes)
   and the fds the hook attached;
2. checks the caller (``trust``): root, pinned by a pidfd, in the daemon's user and pid
   namespaces, with the capabilities the work uses, and the fds it sent are its own view;
3. for gpuhook-relay's raw hook calls, does what the hook does first (argv, environment
   tripwire, state, config.json through the hook's root, the no-GPU check) and answers a
   container that asks for no GPU at once, staying ready for the next connection;
4. declines (the hook then does the work itself) unless the hook runs the same gpuhook version
   and would read the daemon's own config file;
5. loads that config in the daemon's own view (so the log file and roots are the daemon's),
   then enters the hook's mount and cgroup namespaces and its root, so the bundle, the rootfs
   and the container's cgroup resolve exactly as in the hook process (a runtime in a private
   mount namespace works unchanged);
6. runs the same start as the in-process hook and replies with its exit status and message.

A worker that outlives ``request_timeout`` is killed by SIGALRM; its own children die with it
(PDEATHSIG), and the hook, seeing no reply, refuses the container.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import itertools
import os
import pkgutil
import resource
import signal
import socket
import stat
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from gpuhook import __version__, hookcall, service
from gpuhook.config import resolve_config_path
from gpuhook.daemon import trust, wire
from gpuhook.errors import ConfigError, GpuHookError, SpecError, UsageError, report_failure
from gpuhook.log import get_logger
from gpuhook.request import nvcli, runtimecall
from gpuhook.sys import fdpass

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import MutableMapping, Sequence

    from gpuhook.config import Config
    from gpuhook.service import ChildAhead

#: Loaded once in the parent besides every gpuhook module: NVML's binding for a cache miss and
#: PyYAML for a config outside the flat subset. A worker may sit in another mount namespace,
#: where this package's files need not exist, so a request must import nothing (a test checks).
PRELOAD = ("pynvml", "yaml", "json", "pickle", "traceback", "argparse")
#: The whole request, from its first byte to its last: a slow client costs only its own connection.
READ_TIMEOUT = 5.0
#: Sending the reply (at most wire.REPLY_LIMIT bytes, which a socket buffer holds): a hook that
#: does not read it costs no more than this.
SEND_TIMEOUT = 5.0
_FDS = 5  # the client's mnt, cgroup, pid and user namespaces, and its root
_NO_REQUEST = "connect and close, nothing sent"
#: How much of a decline's reason goes into the journal.
_JOURNAL_LIMIT = 300


class NoRequest(wire.WireError):
    """A connection closed before a byte of request: a probe, with no one left to answer."""


@dataclass(frozen=True, slots=True)
class OwnConfig:
    """The daemon's own config file (``--config``, else ``$GPUHOOK_CONFIG``, else the default) and
    whether it must exist: the only one it serves."""

    path: str
    required: bool

    @classmethod
    def resolve(cls, explicit: str | None, env: MutableMapping[str, str]) -> OwnConfig:
        """Looked up as every front-end looks up its config."""
        path, required = resolve_config_path(explicit, env)
        return cls(str(path), required)

    def load(self, debug: bool) -> Config:
        """Load it and set up logging, in the daemon's own view (never the caller's)."""
        return service.load_settings(self.path if self.required else None, debug, {})


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


@dataclass(frozen=True, slots=True)
class RuntimeEdit:
    """The runtime wrapper's spec edit of a GPU ``create``, relayed (relay/gpuhook-runtime.c, gpuhook-relay)."""

    bundle: Path  # absolute, in the caller's root
    relay: PurePosixPath | None  # the relay that sent it, to register as the hooks
    config_arg: str | None  # its $GPUHOOK_CONFIG, which the hooks are given
    socket: str | None  # its $GPUHOOK_DAEMON_SOCKET, likewise


@dataclass(frozen=True, slots=True)
class HookWork:
    """A request that needs GPU work in the hook's view: the hook's inputs, decoded, and the fds of that view."""

    fds: list[int]  # the hook's mnt, cgroup, pid and user namespaces, and its root
    #: a hook's call, nvidia-container-cli's ``configure`` (ctr run --gpus) or the runtime wrapper's spec edit
    call: hookcall.HookCall | nvcli.Configure | RuntimeEdit
    debug: bool
    #: when its first byte was awaited and when it was decoded and checked (time.monotonic)
    received: float = 0.0
    triaged: float = 0.0
    #: the worker's page faults by then (each a copy of a page the daemon shares: ``sys.prefault``)
    faults: int = 0


Reply = tuple[bytes, int, str]


def handle(conn: socket.socket, *, request_timeout: float, config: OwnConfig) -> HookWork | None:
    """Answer *conn* unless its request needs GPU work in the hook's view; then return that work.

    Runs in the worker, in the daemon's own view: nothing here enters a namespace or changes
    the worker, so after an answer it can take the next connection.
    """
    signal.alarm(max(1, int(request_timeout)))
    received, faults = time.monotonic(), _page_faults()
    # The whole request is read before any reply, even one refusing it: closing a unix socket with
    # unread data resets the connection, and the peer would lose the reply.
    try:
        kind, parts, fds = _receive(conn, time.monotonic() + READ_TIMEOUT)
    except (OSError, wire.WireError) as err:  # nothing was done: the hook may do it itself
        if isinstance(err, NoRequest):  # a probe (a second gpuhookd looking for a stale socket)
            say(f"a connection closed without a request ({_NO_REQUEST})")
            signal.alarm(0)
            return None
        why = f"did not arrive whole within {READ_TIMEOUT:g} s" if isinstance(err, TimeoutError) else str(err)
        _answer(conn, (b"declined", 0, f"unreadable request: {why}"))
        return None
    if kind == wire.NO_GPU:  # answered by the relay already: no reply, only the log (and so the metrics)
        _close_all(fds)
        _note_no_gpu(conn, parts[0])
        signal.alarm(0)
        _log_answered(config)
        return None
    try:
        reply = _checked(conn, kind, parts, fds, config)
    except BaseException:
        _close_all(fds)
        raise
    if isinstance(reply, HookWork):
        # the work owns the fds now
        return dataclasses.replace(reply, received=received, triaged=time.monotonic(), faults=faults)
    _close_all(fds)
    _answer(conn, reply)
    _log_answered(config)
    return None


#: The ids of the no-GPU starts answered and not yet logged: each is logged once its answer is sent (the
#: metrics count them from the log), so that the start never waits for the log.
_answered_no_gpu: list[str] = []


#: A `no-gpu` notice's bytes at most, as gpuhook-relay sends it (relay/answers.h MAX_ID): a longer one is read
#: the usual way.
_NOTICE_LIMIT = 64 + 256


def take_notice(conn: socket.socket, config: OwnConfig) -> bool:
    """Log a relay's `no-gpu` notice that is in *conn* whole already (the relay sends it in one write, at once),
    with no request machinery: it needs no wait, no timeout and no word to the pool. False, with nothing read,
    for anything else (and for a notice not yet whole), which ``handle`` then reads."""
    try:
        data = conn.recv(_NOTICE_LIMIT + 1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:
        return False
    line, newline, body = data.partition(b"\n")
    if not newline or not line.startswith(b"%s %s " % (wire.MAGIC, wire.NO_GPU)):
        return False
    try:
        _, sizes = wire.parse_header(line)
    except wire.WireError:
        return False
    if len(data) > _NOTICE_LIMIT or len(body) != sizes[0]:
        return False
    _note_no_gpu(conn, body)
    _log_answered(config)
    return True


def _note_no_gpu(conn: socket.socket, container_id: bytes) -> None:
    """gpuhook-relay's notice of a no-GPU start it answered itself (relay/answers.h): logged as one answered
    here, when a root process sent it (anyone else could only forge counts; root could write the log)."""
    uid = _peer_uid(conn)
    if uid != 0:
        say(f"a no-gpu notice from uid {uid} ignored: only root's are logged")
        return
    _answered_no_gpu.append(container_id.decode("utf-8", "replace"))


def _log_answered(config: OwnConfig) -> None:
    """Log the no-GPU starts just answered (the start has its answer already)."""
    while _answered_no_gpu:
        container_id = _answered_no_gpu.pop()
        try:
            config.load(False)
        except GpuHookError:
            _answered_no_gpu.clear()
            return
        get_logger().info("no_gpu_requested", container_id=container_id, served_by="gpuhookd")


def _checked(conn: socket.socket, kind: bytes, parts: list[bytes], fds: list[int],
             config: OwnConfig) -> Reply | HookWork:
    """The caller checked (``trust``), then the request triaged."""
    if kind == b"ping":
        uid = _peer_uid(conn)  # a ping sends no view: root is enough to learn the version
        return (b"pong", 0, __version__) if uid == 0 else (b"declined", 0, f"peer uid {uid} is not root")
    try:
        peer = trust.peer_of(conn)
    except OSError as err:
        return b"declined", 0, f"the peer cannot be identified: {err.strerror or err}"
    try:
        reason = trust.check_caller(peer, fds)
    finally:
        if peer.pidfd >= 0:
            os.close(peer.pidfd)
    return (b"declined", 0, reason) if reason else _triage(kind, parts, fds, config)


def _answer(conn: socket.socket, reply: Reply) -> None:
    """Send *reply* (a decline also goes into the journal, one line); the request is over (its alarm too)."""
    if reply[0] == b"declined":
        say(f"declined: {reply[2][:_JOURNAL_LIMIT]}")
    _send_quietly(conn, wire.encode_reply(*reply))
    signal.alarm(0)


def _triage(kind: bytes, parts: list[bytes], fds: list[int],  # noqa: PLR0911, PLR0912 - one return per outcome
            config: OwnConfig) -> Reply | HookWork:
    """The reply to a request that needs no GPU work, or the decoded GPU work.

    A ``hook`` request comes from the Python hook, which read config.json and saw a GPU asked
    for. A ``relay`` request is gpuhook-relay's raw hook call (argv, environment, stdin): it is
    read as the in-process hook reads it (``hookcall``), config.json through the hook's root.
    """
    try:
        if kind == b"hook":
            version, config_arg, debug, env, state_bytes, spec_bytes = wire.decode_hook_parts(parts)
            args = hookcall.HookArgs("prestart", config_arg, debug, None)
        else:
            version, argv, env, state_bytes = wire.decode_relay_parts(parts)
            if argv[:1] == [nvcli.PROG]:
                return _triage_cli(version, argv[1:], env, fds, config)
            if argv[:1] == [runtimecall.RELAYED]:
                return _triage_runtime(version, argv[1:], env, fds, config)
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
    except GpuHookError as err:
        return b"done", 1, report_failure(err) + "\n"
    if args.action == hookcall.START and not call.asks_gpu:
        _answered_no_gpu.append(str(call.state.get("id", "")))
        return b"done", 0, ""
    if args.action == hookcall.NOTHING:
        return b"done", 0, ""
    # The GPU work (and a stop's ledger) reads settings, the log file and the roots from a config: the daemon's.
    theirs = str(resolve_config_path(args.config, env)[0])
    reason = trust.check_config(theirs, config.path)
    if reason:
        return b"declined", 0, reason  # the hook then works with its own config, and its own power
    if args.action == hookcall.STOP:  # the ledger is the daemon's own: no need to enter the hook's view
        container_id = call.state.get("id")
        if isinstance(container_id, str) and not hookcall.lease_may_exist(config.path, {}, container_id):
            return b"done", 0, ""  # no lease names it (most poststops): the Python hook's own fast path
        try:
            service.stop(config.load(args.debug), call.state, served_by="gpuhookd")
        except GpuHookError as err:
            return b"done", 1, report_failure(err) + "\n"
        return b"done", 0, ""
    # A caller that passed the checks could act on any process itself: a state naming a host process
    # is refused here, as the in-process start refuses it, not handed back (nothing is gained by that).
    reason = trust.check_container(call.state.get("pid"), fds[0])
    return (b"done", 1, report_failure(SpecError(reason)) + "\n") if reason else HookWork(fds, call, args.debug)


def _triage_runtime(version: str, argv: list[str], env: dict[str, str], fds: list[int],
                    config: OwnConfig) -> Reply | HookWork:
    """A relayed runtime wrapper's ``create``/``run`` of a container that may ask for a GPU (argv: the relay's
    path, then the runtime's argv): its spec edit is GPU work, on this daemon's config; anything the
    Python wrapper would refuse or report is declined to it, which does the work and says why."""
    if version != __version__:
        return (b"declined", 0,
                f"gpuhookd runs gpuhook {__version__}, the runtime {version} (restart gpuhookd after an upgrade)")
    relay, runtime_argv = (argv[0], argv[1:]) if argv else ("", [])
    given = runtimecall.bundle_arg(runtime_argv)
    if given is None or not given.startswith("/"):
        return b"declined", 0, f"not a create or run with an absolute --bundle: {' '.join(runtime_argv)[:200]}"
    try:
        hookcall.check_environment(runtimecall.engine_environment(env), fix=runtimecall.ENGINE_ENV_FIX)
    except GpuHookError as err:
        return b"declined", 0, str(err)
    reason = trust.check_config(str(resolve_config_path(None, env)[0]), config.path)
    if reason:
        return b"declined", 0, reason
    edit = RuntimeEdit(Path(given), PurePosixPath(relay) if relay.startswith("/") else None, env.get("GPUHOOK_CONFIG"),
                       runtimecall.daemon_socket(env))
    return HookWork(fds, edit, debug=False)


def _triage_cli(version: str, argv: list[str], env: dict[str, str], fds: list[int],
                config: OwnConfig) -> Reply | HookWork:
    """A relayed ``nvidia-container-cli`` (ctr run --gpus's hook): its ``configure`` is GPU work, checked as
    the in-process CLI checks it; anything else (info, list, --version) is the Python CLI's to answer."""
    if version != __version__:
        return (b"declined", 0,
                f"gpuhookd runs gpuhook {__version__}, the hook {version} (restart gpuhookd after an upgrade)")
    try:
        options, rest = nvcli.parse_globals(argv)
        if rest[0] != "configure":
            return b"declined", 0, f"not a configure call: {' '.join(rest)[:200]}"
        call = nvcli.translate_configure(rest[1:])
        nvcli.check_ctr_environment(env)
    except UsageError as err:
        return b"done", 2, f"{nvcli.PROG}: {err}\n{nvcli.USAGE}\n"
    except GpuHookError as err:
        return b"done", 1, report_failure(err) + "\n"
    reason = trust.check_config(str(resolve_config_path(None, env)[0]), config.path)
    if reason:
        return b"declined", 0, reason
    reason = trust.check_container(call.pid, fds[0])
    return (b"done", 1, report_failure(SpecError(reason)) + "\n") if reason else HookWork(fds, call, options.debug)


def serve_gpu_request(conn: socket.socket, work: HookWork, apply_child: ChildAhead | None,
                      own: OwnConfig) -> None:
    """Load the daemon's config, enter the hook's view, run the start as the in-process hook would, answer;
    logging where the request's time went (``request_served``: the profile `make bench` prints)."""
    serving = time.monotonic()
    try:
        try:
            config = own.load(work.debug)  # here, in the daemon's view: its log file, its roots
        except GpuHookError as err:
            _send_quietly(conn, wire.encode_reply(b"done", 1, report_failure(err) + "\n"))
            return
        if isinstance(work.call, RuntimeEdit):  # files only, through the caller's root: no namespace to enter
            starting = time.monotonic()
            status, message = run_runtime_edit(work.call, config, work.fds[4])
        else:
            reason = service.enter_hook_view(work.fds)
            if reason:
                say(f"declined: {reason[:_JOURNAL_LIMIT]}")
                _send_quietly(conn, wire.encode_reply(b"declined", 0, reason))
                return
            # The apply child was forked in the daemon's view: it takes the hook's mount namespace and root.
            ahead = (service.ChildForkedAhead(apply_child, mount_ns_fd=work.fds[0], root_fd=work.fds[4])
                     if apply_child else None)
            starting = time.monotonic()
            status, message = run_start(work.call, config, ahead)
    finally:
        _close_all(work.fds)
    # Logged before the reply (a tenth of a millisecond), so the event never lands after the hook's exit.
    marks = {"receive": work.received, "triage": work.triaged, "handover": serving, "view": starting,
             "start": time.monotonic()}
    steps = {b: round((tb - ta) * 1000, 2) for (_, ta), (b, tb) in itertools.pairwise(marks.items())}
    get_logger().info("request_served", ms=round((marks["start"] - work.received) * 1000, 2), steps_ms=steps,
                      page_faults=_page_faults() - work.faults)
    _send_quietly(conn, wire.encode_reply(b"done", status, message))


def run_runtime_edit(edit: RuntimeEdit, config: Config, root_fd: int) -> tuple[int, str]:
    """The runtime wrapper's spec edit under *config*, the bundle resolved in the caller's root: (status, stderr)."""
    try:
        edited = service.edit_runtime_bundle(lambda: config, edit.config_arg, edit.bundle, edit.relay,
                                             socket=edit.socket, root_fd=root_fd)
    except GpuHookError as err:
        return 1, report_failure(err) + "\n"
    except Exception:  # noqa: BLE001 - a bug: the wrapper falls back and reports for itself
        return 1, f"gpuhook: internal error in gpuhookd:\n{traceback.format_exc()}"
    get_logger().info("runtime_spec_edited" if edited else "runtime_no_gpu_requested", bundle=str(edit.bundle),
                      served_by="gpuhookd")
    return 0, ""


def run_start(call: hookcall.HookCall | nvcli.Configure, config: Config,
              ahead: service.ChildForkedAhead | None = None) -> tuple[int, str]:
    """What the in-process hook (or CLI) would do with this call, under *config*: (exit status, stderr text)."""
    before = set(sys.modules)
    try:
        if isinstance(call, nvcli.Configure):
            service.start_configure(config, call, served_by="gpuhookd", ahead=ahead)
        else:
            service.start_hook(config, call.state, call.spec, served_by="gpuhookd", ahead=ahead)
    except GpuHookError as err:
        return 1, report_failure(err) + "\n"
    except Exception:  # noqa: BLE001 - a bug: the hook shows the traceback, as it would in-process
        return 1, f"gpuhook: internal error in gpuhookd:\n{traceback.format_exc()}"
    finally:
        _log_imports(sorted(set(sys.modules) - before))
    return 0, ""


def _page_faults() -> int:
    """This process's page faults so far (the minor ones: no I/O, mostly copy-on-write after its fork)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _send_quietly(conn: socket.socket, data: bytes) -> None:
    """Send a reply, the connection's last word, and its end: a hook reads to EOF, and goes on before the
    worker has logged or tidied up. A hook that has gone (killed by its runtime, a probe) costs only its
    connection."""
    try:
        conn.settimeout(SEND_TIMEOUT)
        conn.sendall(data)
        conn.shutdown(socket.SHUT_WR)
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


def _receive(conn: socket.socket, deadline: float) -> tuple[bytes, list[bytes], list[int]]:
    """(kind, parts, fds) of one request, all of it before *deadline*; raises WireError or OSError
    (TimeoutError once the deadline has passed: it bounds the whole request, not each recv)."""
    _until(conn, deadline)
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
            _until(conn, deadline)
            chunk = conn.recv(4096)
            if not chunk:
                raise wire.WireError("request ended inside its header") if data else NoRequest(_NO_REQUEST)
            line, newline, body = (line + chunk).partition(b"\n")
        kind, sizes = wire.parse_header(line)
        chunks, size, total = [body], len(body), sum(sizes)
        while size < total:
            _until(conn, deadline)
            chunk = conn.recv(min(1 << 20, total - size))
            if not chunk:
                raise wire.WireError(f"request ended after {size} of {total} bytes")
            chunks.append(chunk)
            size += len(chunk)
        body = b"".join(chunks)
        if size != total:
            raise wire.WireError(f"request has {size - total} bytes past its end")
        if kind in wire.WITH_VIEW and len(fds) != _FDS:
            raise wire.WireError(f"a {kind.decode()} request carries {_FDS} fds, this one {len(fds)}")
    except BaseException:
        _close_all(fds)
        raise
    return kind, wire.split_parts(body, sizes), fds


def _until(conn: socket.socket, deadline: float) -> None:
    """Let the next recv wait only until *deadline*; raises TimeoutError once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    conn.settimeout(left)


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

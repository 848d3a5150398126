"""gpuhook-relay (relay/gpuhook-relay.c): the hook's start in C, forwarding bytes to gpuhookd.

Real processes throughout: the relay is built with relay/build.sh, a fake gpuhookd speaks the wire
on a unix socket in tmp_path, and the fallback beside the relay is a script recording what
it was given (argv, environment, stdin, what fd 0 is, its signal mask) and exiting 7. Its
environment is the relay's allow-list, so it finds where to record in the file ``record-to``
beside it, which run_relay writes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import gpuhook
from gpuhook.hookcall import UNSAFE_NAMES, check_environment
from gpuhook.daemon import client, wire
from gpuhook.sys import fdpass
from gpuhook.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
STATE_LIMIT = 1 << 20
FALLBACK_STATUS = 7
# Python, not sh: dash clears its signal mask at startup, and the mask it was given is checked.
FALLBACK = f"""#!{sys.executable} -I
import os, sys
out = open(os.path.join(os.path.dirname(sys.argv[0]), "record-to")).read()
for name, data in (("argv", open("/proc/self/cmdline", "rb").read()), ("env", open("/proc/self/environ", "rb").read()),
                   ("fd0", os.readlink("/proc/self/fd/0").encode()), ("stdin", sys.stdin.buffer.read()),
                   ("sigblk", [line for line in open("/proc/self/status", "rb") if line.startswith(b"SigBlk:")][0])):
    with open(f"{{out}}.{{name}}", "wb") as f:
        f.write(data)
sys.exit(7)
"""
NS_NAMES = ("mnt", "cgroup", "pid", "user")

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    StartDaemon = Callable[[bytes], "FakeDaemon"]



@pytest.fixture(autouse=True)
def _need_root_and_gcc() -> None:
    """The relay is built with gcc and talks to root-only sockets: missing either is a set-up error
    (make test installs gcc and runs as root), not a reason to skip."""
    if os.geteuid() != 0 or shutil.which("gcc") is None:
        pytest.fail("tests/unit/test_relay.py builds the relay with gcc and must run as root (make test does)")


@pytest.fixture(scope="module")
def relay_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The relay, built, and the fake Python hook beside it (in a bin directory, as installed)."""
    where = Path(os.path.realpath(tmp_path_factory.mktemp("relay"))) / "bin"
    where.mkdir()
    subprocess.run([str(ROOT / "relay" / "build.sh"), str(where / "gpuhook-relay")], check=True)
    (where / "gpuhook").write_text(FALLBACK)
    (where / "gpuhook").chmod(0o755)
    return where


@dataclass
class Request:
    """What the fake daemon received: the header's kind, the parts, and where each fd pointed."""

    kind: bytes
    parts: list[bytes]
    fd_links: list[str]
    fd_stats: list[os.stat_result]
    fd_flags: list[int]


@dataclass
class FakeDaemon:
    """gpuhookd's side of one connection at a time: read a whole request, send *reply*, close."""

    path: Path
    reply: bytes
    requests: list[Request] = field(default_factory=list)
    connections: int = 0

    def __post_init__(self) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.path))
        self.listener.listen(8)
        self.listener.settimeout(0.05)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.listener.close()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            self.connections += 1
            with conn:
                conn.settimeout(10)
                self.requests.append(self._receive(conn))
                with contextlib.suppress(OSError):  # a relay that stopped reading a reply too long
                    conn.sendall(self.reply)

    @staticmethod
    def _receive(conn: socket.socket) -> Request:
        data, ancillary, _, _ = conn.recvmsg(65536, socket.CMSG_SPACE(5 * 4))
        fds = [fd for level, kind, payload in ancillary
               if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS for fd in fdpass.unpack_fds(payload)]
        try:
            links = [os.readlink(f"/proc/self/fd/{fd}") for fd in fds]
            stats = [os.fstat(fd) for fd in fds]
            flags = [fcntl.fcntl(fd, fcntl.F_GETFL) for fd in fds]
        finally:
            for fd in fds:
                os.close(fd)
        while b"\n" not in data:
            chunk = conn.recv(4096)
            assert chunk, "request ended inside its header"
            data += chunk
        line, _, body = data.partition(b"\n")
        kind, sizes = _parse_header(line)
        while len(body) < sum(sizes):
            chunk = conn.recv(1 << 20)
            assert chunk, "request ended early"
            body += chunk
        assert len(body) == sum(sizes)
        return Request(kind, wire.split_parts(body, sizes), links, stats, flags)


def _parse_header(line: bytes) -> tuple[bytes, list[int]]:
    """A relay request header: wire.parse_header once wire knows the kind, by hand until then."""
    if b"relay" in wire.KINDS:
        return wire.parse_header(line)
    words = line.split(b" ")
    assert words[:2] == [wire.MAGIC, b"relay"]
    assert len(words) == 6
    assert all(w.isdigit() for w in words[2:])
    return b"relay", [int(w) for w in words[2:]]


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[StartDaemon]:
    """Start fake daemons at tmp_path/gpuhookd.sock; stopped after the test."""
    started: list[FakeDaemon] = []

    def start(reply: bytes) -> FakeDaemon:
        started.append(FakeDaemon(tmp_path / "gpuhookd.sock", reply))
        return started[-1]

    yield start
    for daemon in started:
        daemon.close()


@dataclass
class Run:
    """One run of the relay and what the fallback recorded (None: it did not run)."""

    status: int
    stderr: bytes
    elapsed: float
    fallback_argv: list[bytes] | None
    fallback_env: list[bytes] | None
    fallback_stdin: bytes | None
    fallback_fd0: str | None
    fallback_sigblk: bytes | None


def run_relay(relay_dir: Path, tmp_path: Path, args: list[str], *, stdin: bytes | int = b"{}",
              env: dict[str, str] | None = None, preexec_fn: Callable[[], None] | None = None,
              program: Path | None = None) -> Run:
    """Run the relay (or a copy of it, *program*); stdin is bytes (through a file) or an fd."""
    out = tmp_path / "fallback"
    (relay_dir / "record-to").write_text(str(out))
    env = _env() if env is None else env
    if isinstance(stdin, bytes):
        (tmp_path / "stdin").write_bytes(stdin)
        stdin = os.open(tmp_path / "stdin", os.O_RDONLY)
    start = time.monotonic()
    try:
        proc = subprocess.run([str(program or relay_dir / "gpuhook-relay"), *args], stdin=stdin, stderr=subprocess.PIPE,
                              env=env, timeout=20, check=False, preexec_fn=preexec_fn)
    finally:
        os.close(stdin)
    elapsed = time.monotonic() - start

    def recorded(suffix: str) -> bytes | None:
        path = Path(f"{out}.{suffix}")
        return path.read_bytes() if path.exists() else None

    argv, environ, fd0 = recorded("argv"), recorded("env"), recorded("fd0")
    return Run(proc.returncode, proc.stderr, elapsed,
               None if argv is None else argv.split(b"\0")[2:-1],  # without "python -I" and the trailing NUL
               None if environ is None else environ.split(b"\0")[:-1],
               recorded("stdin"), None if fd0 is None else fd0.decode().strip(), recorded("sigblk"))


def _env(**extra: str) -> dict[str, str]:
    """The hook's environment: PATH and, for the fallback's allow-list to drop, what a shell would add."""
    return {"PATH": "/usr/bin:/bin", "HOME": "/root", "NOTIFY_SOCKET": "/run/notify", **extra}


#: The relay's fallback environment, modelled: what passes, and the locales LANG/LC_ALL may name.
PASSED, LOCALES = ("GPUHOOK_CONFIG",), ("C", "C.UTF-8", "POSIX")


def _allowed(env: dict[str, str]) -> list[bytes]:
    """What the fallback should get from *env* (test_fallback_environment_is_an_allow_list pins it)."""
    kept = {"PATH": env.get("PATH") or "/usr/sbin:/usr/bin:/sbin:/bin"}
    kept |= {k: env[k] for k in PASSED if k in env}
    kept |= {k: env[k] for k in ("LANG", "LC_ALL") if env.get(k) in LOCALES}
    return _entries(kept)


def _entries(env: dict[str, str]) -> list[bytes]:
    return [f"{key}={value}".encode() for key, value in env.items()]


# --- the daemon answers ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "status", "stderr"),
    [
        pytest.param(wire.encode_reply(b"done", 0, ""), 0, b"", id="done-0"),
        pytest.param(wire.encode_reply(b"done", 1, "gpuhook: no such GPU\n"), 1, b"gpuhook: no such GPU\n",
                     id="done-1"),
        pytest.param(b"gpuhookd/1 done 3 6\na\0\xffb\nc", 3, b"a\0\xffb\nc", id="verbatim-bytes"),
        pytest.param(b"gpuhookd/1 done 300 0\n", 255, b"", id="clamped-high"),
        pytest.param(b"gpuhookd/1 done -2 0\n", 1, b"", id="negative"),
    ],
)
def test_done_passes_status_and_message_through(relay_dir: Path, tmp_path: Path, daemon_factory: StartDaemon,
                                                reply: bytes, status: int, stderr: bytes) -> None:
    """`done`: the daemon's message on stderr, byte for byte, and its status as ours; no fallback."""
    daemon = daemon_factory(reply)
    run = run_relay(relay_dir, tmp_path, ["--daemon-socket", str(daemon.path), "prestart"])
    assert (run.status, run.stderr, run.fallback_argv) == (status, stderr, None)
    assert len(daemon.requests) == 1


@pytest.mark.parametrize("extra", [pytest.param({"LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1", "EMPTY": "",
                                                 "ODD": "a=b c"}, id="env"),
                                   pytest.param(None, id="no-env")])
def test_request_carries_argv_env_state_and_our_view(relay_dir: Path, tmp_path: Path, daemon_factory: StartDaemon,
                                                     extra: dict[str, str] | None) -> None:
    """A `relay` request: version, argv (with argv[0]), environ, the state bytes, and 5 fds of our view."""
    daemon = daemon_factory(wire.encode_reply(b"done", 0, ""))
    env = {} if extra is None else _env(**extra)
    state = b'{"ociVersion": "1.0.2", "bundle": "/b"}\0\xff'
    args = ["--config", "/etc/g.yaml", "--debug", "--daemon-socket", str(daemon.path), "createRuntime"]
    run = run_relay(relay_dir, tmp_path, args, stdin=state, env=env)
    assert run.status == 0, run.stderr
    (request,) = daemon.requests
    assert request.kind == b"relay"
    version, argv, environ, got_state = request.parts
    assert version == gpuhook.__version__.encode()
    # argv[0] names the command the relay stands for (its file name without -relay), not the path
    assert argv.split(b"\0") == [b"gpuhook", *(a.encode() for a in args)]
    assert environ == b"\0".join(_entries(env))
    assert got_state == state
    # The relay runs in our namespaces: its fds name the same ones, and the same root.
    assert request.fd_links[:4] == [os.readlink(f"/proc/self/ns/{name}") for name in NS_NAMES]
    assert [link.split(":")[0] for link in request.fd_links[:4]] == list(NS_NAMES)
    assert [(st.st_dev, st.st_ino) for st in request.fd_stats[:4]] == [
        (st.st_dev, st.st_ino) for st in (os.stat(f"/proc/self/ns/{name}") for name in NS_NAMES)]
    assert request.fd_links[4] == "/"
    assert (request.fd_stats[4].st_dev, request.fd_stats[4].st_ino) == (os.stat("/").st_dev, os.stat("/").st_ino)
    assert request.fd_flags[4] & os.O_PATH
    assert len(request.fd_links) == 5


def test_a_few_fds_are_enough(relay_dir: Path, tmp_path: Path, daemon_factory: StartDaemon) -> None:
    """With RLIMIT_NOFILE 9 (stdio, the socket, 5 fds of our view) the request still goes through."""
    daemon = daemon_factory(wire.encode_reply(b"done", 0, ""))

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (9, 9))

    run = run_relay(relay_dir, tmp_path, ["--daemon-socket", str(daemon.path), "prestart"], preexec_fn=limit)
    assert run.status == 0, run.stderr
    assert len(daemon.requests[0].fd_links) == 5


def test_large_state_is_cut_one_byte_past_the_limit(relay_dir: Path, tmp_path: Path,
                                                     daemon_factory: StartDaemon) -> None:
    """More than 1 MiB on stdin: exactly STATE_LIMIT + 1 bytes go on, so the daemon can say it is too big."""
    daemon = daemon_factory(wire.encode_reply(b"done", 1, "too big\n"))
    state = os.urandom(STATE_LIMIT + 5000)
    run = run_relay(relay_dir, tmp_path, ["--daemon-socket", str(daemon.path), "prestart"], stdin=state)
    assert (run.status, run.stderr) == (1, b"too big\n")
    assert daemon.requests[0].parts[3] == state[: STATE_LIMIT + 1]


# --- the fallback: the daemon cannot have started anything --------------------------------------------


def _assert_fell_back(run: Run, relay_dir: Path, args: list[str], env: dict[str, str], state: bytes) -> None:
    assert run.status == FALLBACK_STATUS, run.stderr
    assert run.fallback_argv == [str(relay_dir / "gpuhook").encode(), *(a.encode() for a in args)]
    assert run.fallback_env == _allowed(env)
    assert run.fallback_stdin == state
    # SIGPIPE, blocked while the relay runs, is unblocked again in the hook (and all it runs).
    assert run.fallback_sigblk == b"SigBlk:\t0000000000000000\n"


def test_declined_runs_the_python_hook(relay_dir: Path, tmp_path: Path, daemon_factory: StartDaemon) -> None:
    """`declined`: the hook beside the relay runs with our argv and environment, and the state in a memfd."""
    daemon = daemon_factory(wire.encode_reply(b"declined", 0, "gpuhookd runs gpuhook 9.9"))
    args, env, state = ["--debug", "--daemon-socket", str(daemon.path), "prestart"], _env(), b'{"a": 1}\n'
    run = run_relay(relay_dir, tmp_path, args, stdin=state, env=env)
    _assert_fell_back(run, relay_dir, args, env, state)
    assert run.fallback_fd0 == "/memfd:gpuhook-state (deleted)"
    assert run.stderr == b""
    assert len(daemon.requests) == 1
    assert daemon.requests[0].parts[2] == b"\0".join(_entries(env))  # gpuhookd gets it all, the hook the allow-list


def test_a_copy_under_nvidias_name_stands_for_nvidias_hook(relay_dir: Path, tmp_path: Path,
                                                          daemon_factory: StartDaemon) -> None:
    """libexec/nvidia-container-runtime-hook (docker --gpus): the daemon is told that name (it decodes
    NVIDIA's flags), and the fallback is bin/nvidia-container-runtime-hook, not gpuhook."""
    libexec = relay_dir.parent / "libexec"
    libexec.mkdir(exist_ok=True)
    program = libexec / "nvidia-container-runtime-hook"
    shutil.copy2(relay_dir / "gpuhook-relay", program)
    python_hook = relay_dir / "nvidia-container-runtime-hook"
    python_hook.write_text(FALLBACK)
    python_hook.chmod(0o755)
    daemon = daemon_factory(wire.encode_reply(b"declined", 0, "not a hook call"))
    env = _env()
    args = ["-config", "/etc/g.toml", "--daemon-socket", str(daemon.path), "prestart"]
    run = run_relay(relay_dir, tmp_path, args, stdin=b"{}", env=env, program=program)
    assert daemon.requests[0].parts[1].split(b"\0")[0] == b"nvidia-container-runtime-hook"
    assert run.status == FALLBACK_STATUS, run.stderr
    assert run.fallback_argv == [str(python_hook).encode(), *(a.encode() for a in args)]


def test_no_daemon_runs_the_python_hook(relay_dir: Path, tmp_path: Path) -> None:
    """No socket file: fall back, with the state already read handed on exactly."""
    args, env, state = ["--daemon-socket", str(tmp_path / "absent.sock"), "prestart"], _env(), b"\0" * 70000
    run = run_relay(relay_dir, tmp_path, args, stdin=state, env=env)
    _assert_fell_back(run, relay_dir, args, env, state)
    assert run.fallback_fd0 == "/memfd:gpuhook-state (deleted)"


@pytest.mark.parametrize("args", [
    pytest.param(["--daemon-socket", "none", "prestart"], id="none"),
    # a relative path would resolve in the cwd (the bundle or the rootfs): left to the Python hook
    pytest.param(["--daemon-socket", "gpuhookd.sock", "prestart"], id="relative"),
    pytest.param(["prestart", "--daemon-socket"], id="no-value"),  # a usage error: the hook says so
])
def test_no_daemon_to_ask_leaves_stdin_alone(relay_dir: Path, tmp_path: Path, args: list[str]) -> None:
    """`--daemon-socket none`: the hook runs at once, reading the runtime's own stdin (a pipe, untouched)."""
    read_end, write_end = os.pipe()
    os.write(write_end, b'{"bundle": "/b"}')
    os.close(write_end)
    env = _env()
    run = run_relay(relay_dir, tmp_path, args, stdin=read_end, env=env)
    _assert_fell_back(run, relay_dir, args, env, b'{"bundle": "/b"}')
    assert run.fallback_fd0 is not None
    assert run.fallback_fd0.startswith("pipe:")


def test_socket_path_too_long_runs_the_python_hook(relay_dir: Path, tmp_path: Path) -> None:
    """A path longer than sun_path cannot be connected to: fall back (nothing was sent)."""
    args, env = ["--daemon-socket", "/run/" + "x" * 200, "prestart"], _env()
    run = run_relay(relay_dir, tmp_path, args, env=env)
    _assert_fell_back(run, relay_dir, args, env, b"{}")


def test_server_not_root_is_not_used(relay_dir: Path, tmp_path: Path) -> None:
    """A socket served by uid 65534: never sent our namespaces; fall back."""
    where = tempfile.mkdtemp(prefix="gpuhook-relay-")
    os.chown(where, 65534, 65534)
    path = f"{where}/gpuhookd.sock"
    ready_r, ready_w = os.pipe()
    report_r, report_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setresgid(65534, 65534, 65534)
            os.setgroups([])
            os.setresuid(65534, 65534, 65534)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(path)
            listener.listen(1)
            os.write(ready_w, b"!")
            listener.settimeout(15)
            conn, _ = listener.accept()
            conn.settimeout(15)
            data = b""
            while chunk := conn.recv(65536):
                data += chunk
            os.write(report_w, b"%d %d" % (os.getuid(), len(data)))
            code = 0
        finally:
            os._exit(code)
    os.close(ready_w)
    os.close(report_w)
    try:
        assert os.read(ready_r, 1) == b"!"
        args, env = ["--daemon-socket", path, "prestart"], _env()
        run = run_relay(relay_dir, tmp_path, args, env=env)
        _assert_fell_back(run, relay_dir, args, env, b"{}")
        assert os.read(report_r, 100) == b"65534 0"  # connected, then closed with nothing sent
    finally:
        os.waitpid(pid, 0)
        os.close(ready_r)
        os.close(report_r)
        shutil.rmtree(where)


def test_stderr_reader_gone_keeps_the_status(relay_dir: Path, tmp_path: Path, daemon_factory: StartDaemon) -> None:
    """A runtime that closed its end of stderr: the daemon's status still, not death by SIGPIPE."""
    daemon = daemon_factory(wire.encode_reply(b"done", 3, "lost\n"))
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([str(relay_dir / "gpuhook-relay"), "--daemon-socket", str(daemon.path), "prestart"],
                              input=b"{}", stderr=write_end, env=_env(), timeout=20, check=False)
    finally:
        os.close(write_end)
    assert proc.returncode == 3


# --- refusals ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        pytest.param({"LD_PRELOAD": "/x"}, "LD_PRELOAD", id="ld-preload"),
        pytest.param({"PYTHONPATH": "/x"}, "PYTHONPATH", id="pythonpath"),
        pytest.param({"PYTHONUNBUFFERED": "1", "PYTHONSTARTUP": "/x", "LD_LIBRARY_PATH": "/x", "LD_AUDIT": ""},
                     "LD_AUDIT, LD_LIBRARY_PATH, PYTHONSTARTUP", id="sorted"),
        # glibc's own: iconv modules, locale files, tunables, resolver files, message catalogs
        *(pytest.param({name: "/x"}, name, id=name) for name in UNSAFE_NAMES),
        pytest.param({"LOCPATH": "/x", "LC_ALL": "C", "GCONV_PATH": "/x"}, "GCONV_PATH, LOCPATH",
                     id="iconv-via-locale"),
    ],
)
def test_loader_and_interpreter_variables_are_refused(relay_dir: Path, tmp_path: Path, daemon_factory: StartDaemon,
                                                      extra: dict[str, str], names: str) -> None:
    """LD_*/PYTHON* (CVE-2025-23266): the hygiene message, exit 1; neither the daemon nor the hook runs."""
    daemon = daemon_factory(wire.encode_reply(b"done", 0, ""))
    run = run_relay(relay_dir, tmp_path, ["--daemon-socket", str(daemon.path), "prestart"],
                    env=_env(**extra))
    with pytest.raises(ConfigError) as python_hooks:  # the relay says what the Python hook says, word for word
        check_environment(extra)
    assert names in str(python_hooks.value)
    assert (run.status, run.stderr.decode(), run.fallback_argv) == (1, f"gpuhook: {python_hooks.value}\n", None)
    daemon.close()
    assert daemon.connections == 0


def test_names_that_only_look_unsafe_go_to_the_daemon(relay_dir: Path, tmp_path: Path,
                                                      daemon_factory: StartDaemon) -> None:
    """The tripwire matches whole names (and the LD_/PYTHON prefixes), as the Python hook's does."""
    extra = {"GCONV_PATHS": "/x", "XLOCPATH": "/x", "NLSPATH_": "/x", "LDX": "/x", "PYTHO": "/x", "LD": "/x"}
    check_environment(extra)  # the Python hook lets them through too
    daemon = daemon_factory(wire.encode_reply(b"done", 0, ""))
    run = run_relay(relay_dir, tmp_path, ["--daemon-socket", str(daemon.path), "prestart"], env=_env(**extra))
    assert (run.status, run.stderr) == (0, b"")
    assert len(daemon.requests) == 1


@pytest.mark.parametrize(
    ("reply", "why"),
    [
        pytest.param(b"", "connection closed", id="answerless"),
        pytest.param(b"gpuhookd/1 done 0 10\nabc", "malformed reply", id="truncated"),
        pytest.param(b"gpuhookd/1 done 0 1\nab", "malformed reply", id="too-much"),
        pytest.param(b"gpuhookd/1 done 0", "malformed reply", id="no-newline"),
        pytest.param(b"gpuhookd/1 done  0 0\n", "malformed reply", id="two-spaces"),
        pytest.param(b"gpuhookd/1 done x 0\n", "malformed reply", id="status-not-a-number"),
        pytest.param(wire.encode_reply(b"pong", 0, "0.1.0"), "malformed reply", id="pong"),
        pytest.param(b"gpuhookd/2 done 0 0\n", "malformed reply", id="magic"),
        pytest.param(b"gpuhookd/1 done 0 70000\n" + b"x" * 70000, "reply too long", id="too-long"),
    ],
)
def test_no_complete_answer_is_an_error_not_a_fallback(relay_dir: Path, tmp_path: Path, daemon_factory: StartDaemon,
                                                       reply: bytes, why: str) -> None:
    """Once sent, the work may have started: anything but a whole reply fails the hook (no fallback)."""
    daemon = daemon_factory(reply)
    run = run_relay(relay_dir, tmp_path, ["--daemon-socket", str(daemon.path), "prestart"])
    assert (run.status, run.fallback_argv) == (1, None)
    assert run.stderr.decode() == (
        f"gpuhook: gpuhookd {daemon.path}: no complete answer ({why}); see gpuhookd's journal "
        "(journalctl -u gpuhookd) and the hook log\n")
    assert len(daemon.requests) == 1


def test_stdin_never_closed_times_out(relay_dir: Path, tmp_path: Path) -> None:
    """A runtime that never closes stdin: the hook's message after 5 s, exit 1, nothing else runs."""
    read_end, write_end = os.pipe()
    os.write(write_end, b'{"partial": ')
    try:
        run = run_relay(relay_dir, tmp_path, ["--daemon-socket", str(tmp_path / "absent.sock"), "prestart"],
                        stdin=read_end)
    finally:
        os.close(write_end)
    assert (run.status, run.fallback_argv) == (1, None)
    assert run.stderr == b"gpuhook: the OCI state on stdin did not arrive within 5 s (is stdin closed?)\n"
    assert 4.5 < run.elapsed < 6.5


# --- the fallback's environment ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "passed"),
    [
        pytest.param({"PATH": "/opt/bin:/usr/bin", "GPUHOOK_CONFIG": "/etc/g.yaml", "LANG": "C.UTF-8",
                      "LC_ALL": "POSIX", "HOME": "/root", "TERM": "xterm", "NOTIFY_SOCKET": "/run/n",
                      "LC_CTYPE": "C", "LANGUAGE": "fr", "PYTHONUNBUFFERED": "1", "EMPTY": ""},
                     [b"PATH=/opt/bin:/usr/bin", b"GPUHOOK_CONFIG=/etc/g.yaml", b"LANG=C.UTF-8", b"LC_ALL=POSIX"],
                     id="kept"),
        pytest.param({"LANG": "en_US.UTF-8", "LC_ALL": "C.utf8", "GPUHOOK_CONFIG": ""},
                     [b"PATH=/usr/sbin:/usr/bin:/sbin:/bin", b"GPUHOOK_CONFIG="], id="locales-with-files"),
        pytest.param({"LANG": "C", "PATH": ""}, [b"PATH=/usr/sbin:/usr/bin:/sbin:/bin", b"LANG=C"], id="empty-path"),
        pytest.param({}, [b"PATH=/usr/sbin:/usr/bin:/sbin:/bin"], id="none"),
    ],
)
def test_fallback_environment_is_an_allow_list(relay_dir: Path, tmp_path: Path, env: dict[str, str],
                                               passed: list[bytes]) -> None:
    """The Python hook runs as root with PATH (or a default), GPUHOOK_CONFIG and a file-less LANG/LC_ALL."""
    run = run_relay(relay_dir, tmp_path, ["--daemon-socket", str(tmp_path / "absent.sock"), "prestart"], env=env)
    assert run.status == FALLBACK_STATUS, run.stderr
    assert run.fallback_env == passed == _allowed(env)


# --- never a loop, never a wait without a deadline ---------------------------------------------------


@pytest.mark.parametrize(("layout", "what"), [
    pytest.param("copy", "this relay itself", id="copied-under-its-commands-name"),
    pytest.param("hardlink", "this relay itself", id="hard-linked"),
    pytest.param("libexec", "a copy of this relay", id="a-copy-in-bin-too"),
])
@pytest.mark.parametrize("served", [pytest.param(True, id="declined"), pytest.param(False, id="no-daemon")])
def test_a_relay_never_falls_back_to_a_relay(relay_dir: Path, tmp_path: Path, daemon_factory: StartDaemon,
                                             layout: str, what: str, served: bool) -> None:
    """A relay installed as bin/gpuhook (a copy, not a symlink) would stand for itself: one clear
    refusal naming both paths, exit 1; the daemon is asked once, never again by a re-exec'd copy."""
    bin_dir = tmp_path / "prefix" / "bin"
    bin_dir.mkdir(parents=True)
    target = bin_dir / "gpuhook"
    if layout == "hardlink":
        os.link(relay_dir / "gpuhook-relay", target)
    else:
        shutil.copy2(relay_dir / "gpuhook-relay", target)
    program = target
    if layout == "libexec":
        program = tmp_path / "prefix" / "libexec" / "gpuhook"
        program.parent.mkdir()
        shutil.copy2(relay_dir / "gpuhook-relay", program)
    daemon = daemon_factory(wire.encode_reply(b"declined", 0, "not served")) if served else None
    socket_path = str(daemon.path) if daemon else str(tmp_path / "absent.sock")
    run = run_relay(relay_dir, tmp_path, ["--daemon-socket", socket_path, "prestart"], program=program)
    assert (run.status, run.fallback_argv) == (1, None)
    assert run.stderr.decode() == (
        f"gpuhook: gpuhook-relay {program} would fall back to {target} for calls gpuhookd does not serve, which is "
        f"{what}; put the Python hook `gpuhook` there, or make {program} a symlink to the installed relay instead "
        "of a copy\n")
    if daemon is not None:
        daemon.close()
        assert daemon.connections == 1


def _fill_backlog(path: Path) -> tuple[socket.socket, list[socket.socket]]:
    """A root listener at *path* that never accepts, its backlog full (a connect would wait)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(0)
    queued: list[socket.socket] = []
    for _ in range(64):  # Linux queues backlog + 1
        peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        peer.setblocking(False)
        try:
            peer.connect(str(path))
        except BlockingIOError:
            peer.close()
            return listener, queued
        queued.append(peer)
    pytest.fail(f"the backlog of {path} did not fill after {len(queued)} connections")


@pytest.mark.parametrize("queued_gone", [pytest.param(False, id="queued-waiting"),
                                         pytest.param(True, id="queued-gone")])
def test_a_full_backlog_falls_back_within_the_connect_deadline(relay_dir: Path, tmp_path: Path,
                                                               queued_gone: bool) -> None:
    """A daemon that does not accept (its backlog full, even of clients that left): connect gives up
    at its deadline and, nothing being sent, the Python hook runs (without one, run_relay times out)."""
    path = tmp_path / "full.sock"
    listener, queued = _fill_backlog(path)
    try:
        if queued_gone:
            for queued_client in queued:
                queued_client.close()
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:  # still full: not yet accepted
                probe.setblocking(False)
                with pytest.raises(BlockingIOError):
                    probe.connect(str(path))
        args, env = ["--daemon-socket", str(path), "prestart"], _env()
        run = run_relay(relay_dir, tmp_path, args, env=env)
        _assert_fell_back(run, relay_dir, args, env, b"{}")
        assert run.stderr == b""
    finally:
        for queued_client in queued:
            queued_client.close()
        listener.close()


def test_a_daemon_that_stops_reading_falls_back_at_the_send_deadline(relay_dir: Path, tmp_path: Path) -> None:
    """Connected, but the request is never read (a listener that never accepts, with room in its
    backlog): the send gives up at its deadline, and as a partial request is never run, the hook
    runs instead (the old per-call 150 s SO_SNDTIMEO made run_relay time out)."""
    path = tmp_path / "deaf.sock"
    state = os.urandom(STATE_LIMIT)  # more than the socket buffers hold
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen(1)
        args, env = ["--daemon-socket", str(path), "prestart"], _env()
        run = run_relay(relay_dir, tmp_path, args, stdin=state, env=env)
    _assert_fell_back(run, relay_dir, args, env, state)


def test_the_relays_deadlines_are_the_python_sides() -> None:
    """Every bound the relay waits by is the one the Python hook and gpuhookd use (the #defines, read)."""
    from gpuhook import hookcall
    from gpuhook.daemon import server

    source = (ROOT / "relay" / "gpuhook-relay.c").read_text()
    defined = {words[1]: int(words[2]) for line in source.splitlines()
               if len(words := line.split()) > 2 and words[0] == "#define" and words[2].isdigit()}
    assert defined["STDIN_TIMEOUT_MS"] == hookcall.STDIN_TIMEOUT * 1000
    assert defined["SEND_TIMEOUT_S"] == server.READ_TIMEOUT  # a longer send is one the daemon gave up reading
    assert defined["REPLY_TIMEOUT_S"] == client.REPLY_TIMEOUT
    assert 0 < defined["CONNECT_TIMEOUT_S"] < defined["SEND_TIMEOUT_S"]
    assert (defined["CONNECT_TIMEOUT_S"], defined["SEND_TIMEOUT_S"]) == (client.CONNECT_TIMEOUT, client.SEND_TIMEOUT)


def test_the_python_client_gives_up_on_a_full_backlog_as_the_relay_does(tmp_path: Path) -> None:
    """The Python hook's client meets the same full backlog: NotServed (nothing was sent), not a hang."""
    path = tmp_path / "full.sock"
    listener, queued = _fill_backlog(path)
    try:
        with pytest.raises(client.NotServed, match=r"backlog stayed full for 1 s"):
            client.call_daemon(str(path), config=None, debug=False, env={}, state=b"{}", spec=b"{}")
    finally:
        for queued_client in queued:
            queued_client.close()
        listener.close()

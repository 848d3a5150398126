"""gpuhookd's trust model and its bounded waits, against a real gpuhookd (and real runc where it fits).

A caller gets no power it did not already have (README, "gpuhookd's trust model"): a root
process without capabilities, fds that are not the caller's own view, a config that is not the
daemon's are each declined with one journal line, nothing on the host changes, and the same
daemon goes on serving. A slow or idle client costs only its own connection.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from gpuhook import __version__
from gpuhook.daemon import client, pool, wire
from gpuhook.sys import fdpass
from integration.engines import tree_snapshot
from integration.fakehost import FakeHost
from integration.gpuhookd import Gpuhookd

from .conftest import HOOK_ENV, MakeContainer, hook_entry, relay_entry
from .test_daemon import events_after, log_size

GPU = {"NVIDIA_VISIBLE_DEVICES": "1", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"}
#: A hook that hands its call to gpuhookd itself (as the Python hook would) and writes down the verdict.
CALLER = """\
import json, os, sys
from gpuhook.daemon import client
state = sys.stdin.buffer.read()
spec = open(os.path.join(json.loads(state)["bundle"], "config.json"), "rb").read()
try:
    status, message = client.call_daemon(sys.argv[1], config=sys.argv[2], debug=False, env={}, state=state, spec=spec)
    verdict = f"served {status} {message}"
except client.NotServed as why:
    verdict = str(why)
open(sys.argv[3], "w").write(verdict)
"""
NO_CAPS = ["setpriv", "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all"]


def new_events(host: FakeHost, offset: int) -> list[dict[str, object]]:
    """The host log's events past *offset* (none if nothing was ever logged)."""
    log = host.root / "gpuhook.log"
    return events_after(log, offset) if log.exists() else []


def journal_lines(daemon: Gpuhookd, word: str) -> list[str]:
    """The daemon's journal lines containing *word*."""
    return [line for line in daemon.journal.read_text().splitlines() if word in line]


def served_gpu_start(make_container: MakeContainer, host: FakeHost, daemon: Gpuhookd) -> None:
    """A GPU container through the daemon: it gets its GPU, and gpuhookd (not the hook) served it."""
    offset = log_size(host)
    hook = hook_entry(host.config_path, "--daemon-socket", daemon.socket, "prestart")
    result = make_container("devopen /dev/nvidia1", GPU, hook=hook).run()
    assert result.returncode == 0, result.stderr
    assert "/dev/nvidia1 ENXIO" in result.stdout
    assert {e["served_by"] for e in events_after(host.root / "gpuhook.log", offset)} == {"gpuhookd"}


def test_root_without_capabilities_is_declined(make_container: MakeContainer, host: FakeHost, daemon: Gpuhookd,
                                               tmp_path: Path) -> None:
    """uid 0 with no capabilities (a container's root with the socket reachable) asks gpuhookd for the
    GPU work on a real container: declined, naming what it lacks; no node, no mount, no ldconfig, no
    log event. The same daemon then serves a real hook."""
    verdict = tmp_path / "verdict"
    hook = {"path": "/usr/bin/setpriv",
            "args": [*NO_CAPS, sys.executable, "-I", "-c", CALLER, daemon.socket, str(host.config_path), str(verdict)],
            "env": HOOK_ENV}
    container = make_container("devopen /dev/nvidia1; ls /usr/lib/x86_64-linux-gnu /usr/lib64 2>/dev/null; true", GPU,
                               hook=hook)
    before = tree_snapshot(container.rootfs)
    offset = log_size(host)
    result = container.run()
    assert result.returncode == 0, result.stderr
    assert verdict.read_text().startswith("gpuhookd declined: the hook (pid "), verdict.read_text()
    assert "lacks CAP_DAC_OVERRIDE, CAP_SETPCAP, CAP_SYS_CHROOT, CAP_SYS_PTRACE, CAP_SYS_ADMIN, CAP_MKNOD" in (
        verdict.read_text())
    assert "/dev/nvidia1 ENOENT" in result.stdout and "libcuda" not in result.stdout
    assert tree_snapshot(container.rootfs) == before  # no node, mount point, symlink or ld.so.cache
    assert new_events(host, offset) == []
    assert len(journal_lines(daemon, "declined: the hook (pid")) == 1
    served_gpu_start(make_container, host, daemon)


def _raw_request(path: str, fds: list[int], spec: Mapping[str, object],
                 state: Mapping[str, object]) -> tuple[bytes, str]:
    """A ``hook`` request with *fds* attached as they are: (verdict, message)."""
    parts = wire.hook_parts(__version__, None, False, {}, json.dumps(state).encode(), json.dumps(spec).encode())
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(path)
        data = wire.encode_request(b"hook", parts)
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fdpass.pack_fds(fds))])
        verdict, _, message = client._receive_reply(sock, path)
    return verdict, message


@pytest.fixture
def other_process(tmp_path: Path) -> Iterator[int]:
    """A process in a mount, network and cgroup namespace of its own, with another root: not the caller."""
    root = tmp_path / "elsewhere"
    root.mkdir()
    proc = subprocess.Popen(["unshare", "--mount", "--net", "--cgroup", "--fork", "sleep", "60"])
    try:
        deadline = time.monotonic() + 60
        while not (kids := Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        yield int(kids[0])
    finally:
        proc.kill()
        proc.wait()


def _own_view() -> list[int]:
    """Our mnt, cgroup, pid and user namespace fds and root, as the client sends them."""
    fds = [os.open(f"/proc/self/ns/{name}", os.O_RDONLY | os.O_CLOEXEC) for name in client.NAMESPACES]
    return [*fds, os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)]


@pytest.mark.parametrize(("slot", "replacement", "message"), [
    (0, "file", "the mnt namespace fd the hook sent is not its own mnt namespace"),
    (0, "net", "the mnt namespace fd the hook sent is not its own mnt namespace"),
    (0, "other-mnt", "the mnt namespace fd the hook sent is not its own mnt namespace"),
    (1, "net", "the cgroup namespace fd the hook sent is not its own cgroup namespace"),
    (1, "other-cgroup", "the cgroup namespace fd the hook sent is not its own cgroup namespace"),
    (4, "other-root", "the root fd the hook sent is not its own root"),
])
def test_a_view_that_is_not_the_callers_is_declined(make_container: MakeContainer, host: FakeHost,
                                                    daemon: Gpuhookd, other_process: int, tmp_path: Path,
                                                    slot: int, replacement: str, message: str) -> None:
    """A caller with every capability sends fds that are not its own view (a regular file, a network
    namespace, another process's namespaces or root): one clean decline and one journal line, never
    a setns EINVAL that kills the worker; the same daemon then serves a real hook."""
    (tmp_path / "plain").write_text("")
    opened = {
        "file": lambda: os.open(tmp_path / "plain", os.O_RDONLY | os.O_CLOEXEC),
        "net": lambda: os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC),
        "other-mnt": lambda: os.open(f"/proc/{other_process}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC),
        "other-cgroup": lambda: os.open(f"/proc/{other_process}/ns/cgroup", os.O_RDONLY | os.O_CLOEXEC),
        "other-root": lambda: os.open(tmp_path / "elsewhere", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC),
    }
    fds = _own_view()
    os.close(fds[slot])
    fds[slot] = opened[replacement]()
    spec = {"ociVersion": "1.0.2", "root": {"path": "rootfs"}, "process": {"env": ["NVIDIA_VISIBLE_DEVICES=all"]}}
    try:
        verdict, reply = _raw_request(daemon.socket, fds, spec, {"bundle": str(tmp_path), "pid": other_process})
    finally:
        for fd in fds:
            os.close(fd)
    assert (verdict, reply) == (b"declined", f"{message} (pid {os.getpid()})")
    assert len(journal_lines(daemon, "declined: ")) == 1
    served_gpu_start(make_container, host, daemon)


def test_a_foreign_config_is_declined_and_the_hook_serves_itself(make_container: MakeContainer, host: FakeHost,
                                                                  daemon: Gpuhookd, relay: Path,
                                                                  tmp_path: Path) -> None:
    """A hook naming another config file (its log file, its roots) is declined: gpuhookd never takes a
    setting from its caller. The hook, a legitimate one, then does the work itself with that config."""
    other_log = tmp_path / "other.log"
    other = tmp_path / "other.yaml"
    other.write_text(host.config_path.read_text().replace(str(host.root / "gpuhook.log"), str(other_log)))
    assert str(other_log) in other.read_text()
    offset = log_size(host)
    for hook in (hook_entry(other, "--daemon-socket", daemon.socket, "prestart"),
                 relay_entry(relay, other, "--daemon-socket", daemon.socket, "prestart")):
        result = make_container("devopen /dev/nvidia1", GPU, hook=hook).run()
        assert result.returncode == 0, result.stderr
        assert "/dev/nvidia1 ENXIO" in result.stdout
    events = [json.loads(line) for line in other_log.read_text().splitlines()]
    assert {e["served_by"] for e in events} == {"hook"}
    notes = [e["daemon"] for e in events if e["event"] == "request_parsed"]
    assert len(notes) == 2 and all(
        f"the hook's config '{other}' is not gpuhookd's ('{host.config_path}')" in note for note in notes), notes
    # gpuhookd wrote nothing for them (its holder watch may release their leases, the ledger being the
    # host's whichever config took them: new_events leaves those out)
    assert new_events(host, offset) == []
    # The Python hook asked once; the relay asked, then its fallback (the Python hook) asked again.
    assert len(journal_lines(daemon, "declined: the hook's config")) == 3


def test_idle_and_slow_clients_cost_only_their_connections(make_container: MakeContainer, host: FakeHost,
                                                           daemon: Gpuhookd, relay: Path) -> None:
    """Six idle connections and two clients sending a byte a second hold eight workers: a no-GPU start
    and a GPU start queued behind them are each served at once by a fresh worker, and every slow
    client is declined within the whole-request deadline, not after each byte."""
    idle = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(6)]
    slow = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2)]
    for sock in idle + slow:
        sock.connect(daemon.socket)
        sock.settimeout(60)
    try:
        for sock in slow:
            sock.send(b"g")
        no_gpu = make_container("true", {}, hook=relay_entry(relay, host.config_path, "--daemon-socket",
                                                               daemon.socket, "prestart"))
        assert no_gpu.run().returncode == 0
        served_gpu_start(make_container, host, daemon)
        # Neither waited for a slow client: those are still unanswered (each holds its worker until
        # gpuhookd's READ_TIMEOUT, a fixed 5 s from their connect). An event, not a stopwatch; only
        # a machine so loaded that two starts take over 5 s could still fail it (see the report).
        assert select.select(slow, [], [], 0)[0] == [], "a slow client was answered before the starts ended"
        trickled = [_trickle(sock) for sock in slow]
        # Declined within the whole-request deadline: before the trickle (a byte a second, longer than
        # the deadline) was all sent; a per-byte deadline would let it run to its end and beyond.
        assert all(cut_short for _, cut_short in trickled), trickled
        replies = [wire.decode_reply(reply) for reply, _ in trickled]
        assert all(r[:2] == (b"declined", 0) and "did not arrive whole within 5 s" in r[2] for r in replies), replies
    finally:
        for sock in idle + slow:
            sock.close()


def _trickle(sock: socket.socket) -> tuple[bytes, bool]:
    """Send a request a byte a second until the daemon answers: (its whole answer, whether it came
    before the request was all sent)."""
    cut_short = False
    for byte in b"puhookd/1 hook 1 1 1 1 1 1\n":
        if select.select([sock], [], [], 1.0)[0]:
            cut_short = True
            break
        try:
            sock.send(bytes([byte]))
        except OSError:
            cut_short = True
            break
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks), cut_short


def test_probes_and_departing_clients_leave_the_workers_serving(make_container: MakeContainer, host: FakeHost,
                                                                daemon: Gpuhookd) -> None:
    """A connect-and-close probe, a second ``gpuhook daemon`` checking for a stale socket and a hook
    that leaves before its reply each cost one journal line and kill no worker: the pool settles back
    to its two spares (a worker is forked only while both were busy at once, and retires after), and
    the same daemon serves on."""
    for _ in range(3):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(daemon.socket)
    second = subprocess.run([sys.executable, "-I", "-m", "gpuhook", "daemon", "--socket", daemon.socket],
                            capture_output=True, text=True, timeout=60, check=False, cwd="/")
    assert second.stderr.strip() == f"gpuhook: another gpuhookd already serves {daemon.socket}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as leaver:  # a whole ping, gone before the pong
        leaver.connect(daemon.socket)
        leaver.sendall(wire.encode_request(b"ping", [__version__.encode()]))
    assert client.ping(daemon.socket) == __version__
    deadline = time.monotonic() + 60
    while len(workers_of(daemon)) != SPARES:
        assert time.monotonic() < deadline, workers_of(daemon)
        time.sleep(0.05)
    assert len(journal_lines(daemon, "a connection closed without a request")) == 4
    assert "request failed" not in daemon.journal.read_text()
    served_gpu_start(make_container, host, daemon)


SPARES = pool.SPARE_WORKERS


def workers_of(daemon: Gpuhookd) -> list[int]:
    """The daemon's workers: its direct children among the processes of its command line."""
    def parent(pid: int) -> int:
        try:
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return 0  # gone meanwhile
    return [pid for pid in daemon.processes() if parent(pid) == daemon.proc.pid]


@pytest.mark.parametrize("value", ["inf", "nan", "1e10", "0", "-1"])
def test_unusable_request_timeouts_are_refused(tmp_path: Path, value: str) -> None:
    """``--request-timeout`` must fit alarm(2) and a runtime's hook timeout: one line, exit status 1."""
    out = subprocess.run([sys.executable, "-I", "-m", "gpuhook", "daemon", "--socket", str(tmp_path / "s.sock"),
                          "--request-timeout", value], capture_output=True, text=True, timeout=60, check=False,
                         cwd="/")
    assert out.returncode == 1, out
    assert out.stderr.startswith("gpuhook: --request-timeout must be a number of seconds in (0, 3600], got ")
    assert "Traceback" not in out.stderr


#: A `no-gpu` notice (gpuhook-relay's, relay/answers.h) sent as whoever runs this, without waiting for anything.
NOTICE = """\
import socket, sys
from gpuhook.daemon import wire
with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
    sock.connect(sys.argv[1])
    sock.sendall(wire.encode_request(wire.NO_GPU, [sys.argv[2].encode()]))
"""


def test_a_no_gpu_notice_is_logged_only_from_root(host: FakeHost) -> None:
    """The relay's notice of a no-GPU start it answered is logged (the metrics count it) when root sent it; one
    from another user (the socket opened to it here) is ignored with a journal line, and logs nothing."""
    where = Path(tempfile.mkdtemp(prefix="gpuhook-notice-"))  # not under pytest's root-only tmp
    daemon = Gpuhookd(sys.executable, where / "gpuhookd", config=host.config_path)
    try:
        for path, mode in ((where, 0o755), (where / "gpuhookd", 0o755), (Path(daemon.socket), 0o666)):
            path.chmod(mode)
        offset = log_size(host)
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        for prefix, container_id in ((nobody, "forged-by-nobody"), ([], "told-by-root")):
            sent = subprocess.run([*prefix, sys.executable, "-I", "-c", NOTICE, daemon.socket, container_id],
                                  capture_output=True, text=True, timeout=60, check=False, cwd="/")
            assert sent.returncode == 0, sent.stderr
        deadline = time.monotonic() + 60
        while not new_events(host, offset) or not journal_lines(daemon, "no-gpu notice"):
            assert time.monotonic() < deadline, (new_events(host, offset), daemon.journal.read_text())
            time.sleep(0.02)
        assert [(e["event"], e["container_id"], e["served_by"]) for e in new_events(host, offset)] == [
            ("no_gpu_requested", "told-by-root", "gpuhookd")]
        assert [line.split(": ", 1)[-1] for line in journal_lines(daemon, "no-gpu notice")] == [
            "a no-gpu notice from uid 65534 ignored: only root's are logged"]
    finally:
        journal = daemon.stop()
        shutil.rmtree(where, ignore_errors=True)
    assert "request failed" not in journal and "Traceback" not in journal, journal

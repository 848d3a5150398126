"""gpuhookd: real runc/crun containers whose hook hands the GPU work to a running daemon."""

from __future__ import annotations

import ast
import concurrent.futures
import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpuhook import __version__
from gpuhook.daemon import client, wire
from gpuhook.errors import DaemonError
from integration.engines import tree_snapshot
from integration.fakehost import FakeHost
from integration.gpuhookd import Gpuhookd

from ..unit.test_fast_path import ALLOWED as NO_GPU_PATH
from integration.rootfs import copy_rootfs

from .conftest import MakeContainer, hook_entry, relay_entry
from .test_hook import PROBE, TWO_GPUS, lines


def open_up(path: Path) -> None:
    """Let uid 65534 reach *path* (pytest's directories are 0700)."""
    for directory in (path, *path.parents):
        if directory == Path("/tmp"):
            break
        directory.chmod(0o755)


def events_after(log: Path, offset: int) -> list[dict[str, Any]]:
    """The hook log's events written past *offset* by the calls a test makes: not the releases a
    gpuhookd's holder watch logs on its own schedule, for whichever earlier container exited
    (tests/e2e/test_leases.py checks those through the ledger)."""
    with log.open("rb") as handle:
        handle.seek(offset)
        events = [json.loads(line) for line in handle.read().splitlines()]
    return [e for e in events if e.get("why") != "holder exited"]


def log_size(host: FakeHost) -> int:
    """Where new events will start."""
    log = host.root / "gpuhook.log"
    return log.stat().st_size if log.exists() else 0


def test_spare_workers_wait_for_requests(make_container: MakeContainer, host: FakeHost, daemon: Gpuhookd) -> None:
    """Two forked workers wait in accept(). A request that needs no GPU work (a ping) leaves them as
    they are; a GPU request ends its worker, whose replacement forks its apply child (and, where
    ldconfig writes the caches, that child its ldconfig child) ahead, so no request waits for a fork.
    (A worker forked while a connection is already queued serves at once, unprepared: a burst.)"""
    before = daemon.settled()  # a busy machine: forks at nice 19 wait for CPU
    children = daemon.children_ahead()
    for _ in range(3):
        client.ping(daemon.socket)
    assert daemon.family() == before  # answered by a waiting worker, which still waits
    hook = hook_entry(host.config_path, "--daemon-socket", daemon.socket, "prestart")
    assert make_container("true", TWO_GPUS, hook=hook).run().returncode == 0
    deadline = time.monotonic() + 60
    while len(after := daemon.family()) != 2 or not after.keys() - before.keys() or any(
            len(after[new]) != children for new in after.keys() - before.keys()):
        assert time.monotonic() < deadline, (before, after)
        time.sleep(0.05)
    assert len(before.keys() - after.keys()) == 1  # the worker that served the GPUs exited
    assert len(after.keys() - before.keys()) == 1  # its replacement waits, its children ready


def test_the_next_workers_copy_in_the_pages_a_gpu_start_wrote(make_container: MakeContainer, host: FakeHost,
                                                              daemon: Gpuhookd) -> None:
    """A worker that served a GPU start, and its apply child, keep the pages they wrote where the whole
    pool sees them; the workers and children forked after copy those in while they wait (sys.prefault),
    so their start takes a fraction of the first one's page faults (each a page copied from the
    daemon's), as gpuhookd logs them."""
    hook = hook_entry(host.config_path, "--daemon-socket", daemon.socket, "prestart")
    faults = []
    for _ in range(4):
        daemon.settled()  # the next start is a prepared worker's (spares fork and copy at nice 19)
        offset = log_size(host)
        assert make_container("true", TWO_GPUS, hook=hook).run().returncode == 0
        events = events_after(host.root / "gpuhook.log", offset)
        served = next(e for e in events if e["event"] == "request_served")
        applied = next(e for e in events if e["event"] == "applied")
        faults.append((served["page_faults"], applied["apply_page_faults"]))
    # The first start is a worker's forked before any start; of the next three, at most one is (the other
    # spare forked then), the rest replacements.
    (worker, child), later = faults[0], faults[1:]
    assert min(w for w, _ in later) < worker / 2 and min(c for _, c in later) < child / 2, faults


def test_the_apply_child_reads_the_images_libraries_while_the_worker_plans(
        make_container: MakeContainer, host: FakeHost, tmp_path: Path) -> None:
    """Told the rootfs as the start begins, gpuhookd's apply child reads the image's own libraries while the
    worker finds the devices and plans (the driver's it inherited read): its cache writer reads none, where
    the in-process hook reads the image's; both caches name the driver's libcuda."""
    script = "grep -q libcuda.so.1 /etc/ld.so.cache && echo cached"

    def libraries_read(*via: str) -> int:
        offset = log_size(host)
        result = make_container(script, TWO_GPUS, hook=hook_entry(host.config_path, *via, "prestart")).run()
        assert (result.returncode, result.stdout.strip()) == (0, "cached"), result.stderr
        [applied] = [e for e in events_after(host.root / "gpuhook.log", offset) if e["event"] == "applied"]
        return int(applied["libraries_read"])

    in_process = libraries_read("--daemon-socket", "none")  # and the inventory cache is there for the workers
    running = Gpuhookd(sys.executable, tmp_path / "gpuhookd", config=host.config_path)
    try:
        running.settled()
        served = libraries_read("--daemon-socket", running.socket)
    finally:
        journal = running.stop()
    assert "request failed" not in journal, journal
    assert (served, in_process > 0) == (0, True), (served, in_process)


def test_the_starts_of_one_image_read_its_libraries_once(make_container: MakeContainer, host: FakeHost,
                                                         rootfs_src: Path, tmp_path: Path) -> None:
    """Two containers of one image (overlayfs, as engines mount images: the image's files are the same inodes
    in both), each served by its own worker: the first one's apply child reads the image's libraries in its
    head start, the second one's reads none (gpuhookd's processes share what they read: apply/ldshared.py);
    both caches name the driver's libcuda."""
    image = copy_rootfs(rootfs_src, tmp_path / "image")
    script = "grep -q libcuda.so.1 /etc/ld.so.cache && echo cached"
    # the inventory cache there before the workers are forked: each reads the driver's libraries while idle
    subprocess.run([sys.executable, "-I", "-m", "gpuhook", "--config", str(host.config_path), "info", "--refresh"],
                   check=True, capture_output=True, timeout=60)
    running = Gpuhookd(sys.executable, tmp_path / "gpuhookd", config=host.config_path)
    reads = []
    try:
        running.settled()
        hook = hook_entry(host.config_path, "--daemon-socket", running.socket, "prestart")
        for _ in range(2):
            offset = log_size(host)
            result = make_container(script, TWO_GPUS, hook=hook, image=image).run()
            assert (result.returncode, result.stdout.strip()) == (0, "cached"), result.stderr
            [applied] = [e for e in events_after(host.root / "gpuhook.log", offset) if e["event"] == "applied"]
            reads.append((applied["libraries_read_ahead"], applied["libraries_read"]))
    finally:
        journal = running.stop()
    assert "request failed" not in journal, journal
    (first_ahead, first_read), second = reads
    assert (first_ahead > 0, first_read, second) == (True, 0, (0, 0)), reads


def test_the_pool_follows_a_kernel_log_that_is_the_kernels(make_container: MakeContainer, host: FakeHost,
                                                           tmp_path: Path) -> None:
    """A dev root whose dev/kmsg is the kernel's own log (char 1:11, as on a real host): gpuhookd holds it open
    (the pool reads each record once, health.XidLog), and a GPU start served by a worker, which asks it,
    succeeds; the journal says nothing of the log."""
    kmsg = host.root / "dev" / "kmsg"
    simulated = kmsg.read_bytes()
    kmsg.unlink()
    os.mknod(kmsg, 0o600 | stat.S_IFCHR, os.makedev(1, 11))
    try:
        running = Gpuhookd(sys.executable, tmp_path / "gpuhookd", config=host.config_path)
        try:
            assert str(kmsg) in _open_files(running.proc.pid)
            hook = hook_entry(host.config_path, "--daemon-socket", running.socket, "prestart")
            result = make_container("true", TWO_GPUS, hook=hook).run()
            assert result.returncode == 0, result.stderr
        finally:
            journal = running.stop()
    finally:  # the host is the session's: its simulated log back
        kmsg.unlink()
        kmsg.write_bytes(simulated)
    assert "request failed" not in journal and "kernel log" not in journal, journal


def _open_files(pid: int) -> set[str]:
    fds = Path(f"/proc/{pid}/fd")
    return {os.readlink(fds / fd) for fd in os.listdir(fds)}


def test_the_ldconfig_child_waits_only_where_ldconfig_writes_the_caches(
        make_container: MakeContainer, host: FakeHost, tmp_path: Path) -> None:
    """Where gpuhook writes the containers' caches itself, an idle worker's apply child forks no
    ldconfig child (it would only exit again); with ``ldconfig_native: false`` it does. Either way the
    container's cache names the driver's libcuda and the journal shows no failure."""
    sandboxed = tmp_path / "sandboxed.yaml"
    sandboxed.write_text(host.config_path.read_text() + "\nldconfig_native: false\n")
    for config, children in ((host.config_path, 1), (sandboxed, 2)):
        running = Gpuhookd(sys.executable, tmp_path / f"gpuhookd-{children}", config=config)
        try:
            assert running.children_ahead() == children
            family = running.settled()
            assert sorted(len(kids) for kids in family.values()) == [children, children]
            hook = hook_entry(config, "--daemon-socket", running.socket, "prestart")
            container = make_container("grep -q libcuda.so.1 /etc/ld.so.cache && echo cached", TWO_GPUS, hook=hook)
            result = container.run()
            assert (result.returncode, result.stdout.strip()) == (0, "cached"), result.stderr
        finally:
            journal = running.stop()
        assert "request failed" not in journal and "Traceback" not in journal, journal


def _answers(path: str) -> bool:
    """Whether a gpuhookd answers a ping at *path*."""
    try:
        client.ping(path)
    except client.NotServed:
        return False
    return True


@pytest.mark.parametrize("engine", ["runc", "crun", "runc-cgroup2"])
@pytest.mark.parametrize("front", ["python-hook", "relay"])
def test_daemon_gives_the_same_gpus(make_container: MakeContainer, host: FakeHost, daemon: Gpuhookd, relay: Path,
                                    engine: str, front: str) -> None:
    """The worker does what the in-process hook does, in the hook's namespaces: crun and runc-cgroup2
    run in private mount namespaces (runc-cgroup2's cgroup2 mount exists only there), so the worker
    must enter them to find the bundle, the rootfs and the cgroup; for gpuhook-relay it also reads
    config.json through the hook's root."""
    offset = log_size(host)
    argv = ("--debug", "--daemon-socket", daemon.socket, "prestart")
    hook = relay_entry(relay, host.config_path, *argv) if front == "relay" else hook_entry(host.config_path, *argv)
    result = make_container(PROBE, TWO_GPUS, engine=engine, hook=hook).run()
    assert result.returncode == 0, result.stderr
    assert {
        "/dev/nvidia1 ENXIO", "/dev/nvidia3 ENXIO", "/dev/nvidiactl ENXIO", "/dev/nvidia0 ENOENT",
        "/tmp/gpu0 EPERM", "dlopen libcuda.so.1: OK", "dlopen libnvidia-ml.so.1: OK", "nvidia-smi OK",
    } <= lines(result.stdout)
    events = events_after(host.root / "gpuhook.log", offset)
    assert {e["served_by"] for e in events} == {"gpuhookd"}
    assert "applied" in {e["event"] for e in events}
    # Everything the request needed was imported before the fork: a worker may sit in a mount
    # namespace where this package's files do not exist.
    assert [e["modules"] for e in events if e["event"] == "request_imports"] == [[]]


@pytest.mark.parametrize("front", ["python-hook", "relay"])
def test_refusal_comes_back_and_leaves_nothing(make_container: MakeContainer, host: FakeHost, daemon: Gpuhookd,
                                               relay: Path, front: str) -> None:
    """A refused request: the runtime shows gpuhook's message (the relay's exit status and stderr are
    the daemon's); the rootfs is unchanged."""
    argv = ("--daemon-socket", daemon.socket, "prestart")
    hook = relay_entry(relay, host.config_path, *argv) if front == "relay" else hook_entry(host.config_path, *argv)
    container = make_container("true", {"NVIDIA_VISIBLE_DEVICES": "9"}, hook=hook)
    before = tree_snapshot(container.rootfs)
    offset = log_size(host)
    result = container.run()
    assert result.returncode != 0
    assert "gpuhook: " in result.stderr and "no GPU with index 9" in result.stderr
    assert tree_snapshot(container.rootfs) == before
    failed = [e for e in events_after(host.root / "gpuhook.log", offset) if e["event"] == "hook_failed"]
    assert [e["served_by"] for e in failed] == ["gpuhookd"]


def test_without_a_daemon_the_hook_does_the_work(make_container: MakeContainer, host: FakeHost,
                                                 tmp_path: Path) -> None:
    """No socket: the same container, served in-process, and the log says why."""
    absent = str(tmp_path / "absent" / "gpuhookd.sock")
    offset = log_size(host)
    hook = hook_entry(host.config_path, "--daemon-socket", absent, "prestart")
    result = make_container(PROBE, TWO_GPUS, hook=hook).run()
    assert result.returncode == 0, result.stderr
    assert {"/dev/nvidia1 ENXIO", "dlopen libcuda.so.1: OK"} <= lines(result.stdout)
    events = events_after(host.root / "gpuhook.log", offset)
    assert {e["served_by"] for e in events} == {"hook"}
    parsed = next(e for e in events if e["event"] == "request_parsed")
    assert parsed["daemon"] == f"no gpuhookd at {absent} (No such file or directory)"


def test_other_pid_namespace_is_declined(daemon: Gpuhookd) -> None:
    """A hook in another pid namespace names the container by a pid the daemon cannot use: declined,
    so that hook works in-process."""
    code = ("import sys\nfrom gpuhook.daemon import client\n"
            "state = b'{\"bundle\": \"/b\"}'\n"
            "try:\n    client.call_daemon(sys.argv[1], config=None, debug=False, env={}, state=state, spec=b'{}')\n"
            "except client.NotServed as why:\n    print(why)\n")
    out = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-I", "-c", code,
                          daemon.socket], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == ("gpuhookd declined: the hook runs in another pid namespace than gpuhookd; "
                                  "the OCI state's pid would name another process here")


def test_hook_of_another_version_is_declined(daemon: Gpuhookd) -> None:
    """After an upgrade the old daemon must not serve the new hook."""
    parts = wire.hook_parts("0.0.1", None, False, {}, b"{}", b"{}")
    verdict, _, message = client.exchange(daemon.socket, wire.encode_request(b"hook", parts))
    assert (verdict, message) == (b"declined", f"gpuhookd runs gpuhook {__version__}, the hook 0.0.1 "
                                               "(restart gpuhookd after an upgrade)")


def test_only_root_reaches_the_daemon(daemon: Gpuhookd) -> None:
    """The socket is 0600; opened up by mistake, the daemon still declines a non-root peer."""
    code = ("import sys\nfrom gpuhook.daemon import client, wire\n"
            "print(client.exchange(sys.argv[1], wire.encode_request(b'ping', [b'x']))[2])\n")
    nobody = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", sys.executable, "-I", "-c", code,
              daemon.socket]
    socket_dir = Path(daemon.socket).parent
    open_up(socket_dir.parent)
    out = subprocess.run(nobody, capture_output=True, text=True, check=False, cwd="/")
    assert "no gpuhookd at" in out.stderr and "Permission denied" in out.stderr  # the 0700 directory
    socket_dir.chmod(0o755)
    out = subprocess.run(nobody, capture_output=True, text=True, check=False, cwd="/")
    assert "no gpuhookd at" in out.stderr and "Permission denied" in out.stderr  # the 0600 socket
    Path(daemon.socket).chmod(0o666)
    out = subprocess.run(nobody, capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "peer uid 65534 is not root"


def test_client_never_talks_to_a_non_root_server(tmp_path: Path) -> None:
    """A socket served by another uid gets neither the request nor the hook's namespace fds."""
    open_up(tmp_path)
    tmp_path.chmod(0o777)
    path = tmp_path / "fake.sock"
    # It holds the connection until killed (stdin is never written): no sleep to outlast.
    code = ("import socket, sys\ns = socket.socket(socket.AF_UNIX)\ns.bind(sys.argv[1])\ns.listen()\n"
            "print('up', flush=True)\nc, _ = s.accept()\nsys.stdin.read()\n")
    server = subprocess.Popen(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", sys.executable,
                               "-I", "-c", code, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              cwd="/")
    try:
        assert server.stdout is not None and server.stdout.readline() == "up\n"
        with pytest.raises(client.NotServed, match=r"is served by uid 65534, not root"):
            client.ping(str(path))
    finally:
        server.kill()
        server.wait()


def test_an_answerless_daemon_fails_the_hook(tmp_path: Path) -> None:
    """Once the request is sent, a daemon that dies without answering may have done part of the work:
    the hook refuses the container instead of doing it again."""
    path = str(tmp_path / "mute.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the mute server
        conn, _ = listener.accept()
        conn.recv(1 << 16)
        os._exit(0)
    try:
        with pytest.raises(DaemonError, match="no complete answer"):
            client.call_daemon(path, config=None, debug=False, env={}, state=b"{}", spec=b"{}")
    finally:
        os.waitpid(pid, 0)
        listener.close()


@pytest.mark.parametrize(
    ("prepare", "user", "message"),
    [
        pytest.param(lambda d: None, ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"],
                     "gpuhookd enters containers' namespaces and must run as root", id="not-root"),
        pytest.param(lambda d: (d.mkdir(), d.chmod(0o777)), [],
                     "must be a directory owned by root and writable only by it", id="open-directory"),
        pytest.param(lambda d: (d.mkdir(mode=0o700), (d / "gpuhookd.sock").write_text("")), [],
                     "exists and is not a socket", id="not-a-socket"),
    ],
)
def test_daemon_refuses_unsafe_setups(tmp_path: Path, prepare: Any, user: list[str], message: str) -> None:
    """Each refusal is one line naming the problem, exit status 1, no traceback."""
    socket_dir = tmp_path / "run"
    prepare(socket_dir)
    open_up(tmp_path)
    out = subprocess.run([*user, sys.executable, "-I", "-m", "gpuhook", "daemon", "--socket",
                          str(socket_dir / "gpuhookd.sock")], capture_output=True, text=True, timeout=30,
                         check=False, cwd="/")
    assert out.returncode == 1, out
    assert message in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_second_daemon_refuses_a_live_socket(daemon: Gpuhookd) -> None:
    """Two daemons never share a socket; a stale socket file (nobody listening) is replaced."""
    second = subprocess.run([sys.executable, "-I", "-m", "gpuhook", "daemon", "--socket", daemon.socket],
                            capture_output=True, text=True, timeout=30, check=False, cwd="/")
    assert second.returncode == 1
    assert second.stderr.strip() == f"gpuhook: another gpuhookd already serves {daemon.socket}"
    daemon.stop()
    assert Path(daemon.socket).exists()  # left behind by the stopped daemon (systemd's socket unit removes it)
    Gpuhookd(sys.executable, Path(daemon.socket).parent).stop()


def test_a_burst_of_starts_is_served(make_container: MakeContainer, host: FakeHost, daemon: Gpuhookd) -> None:
    """More containers at once than spare workers: the rest wait for workers that skip their
    preparation, and every container gets its GPU from gpuhookd."""
    hook = hook_entry(host.config_path, "--daemon-socket", daemon.socket, "prestart")
    containers = [make_container("devopen /dev/nvidia2", {"NVIDIA_VISIBLE_DEVICES": "2"}, hook=hook) for _ in range(6)]
    offset = log_size(host)
    with concurrent.futures.ThreadPoolExecutor(len(containers)) as pool:
        results = list(pool.map(lambda c: c.run(), containers))
    for result in results:
        assert result.returncode == 0, result.stderr
        assert "/dev/nvidia2 ENXIO" in result.stdout
    applied = [e for e in events_after(host.root / "gpuhook.log", offset) if e["event"] == "applied"]
    assert [e["served_by"] for e in applied] == ["gpuhookd"] * len(containers)


def test_daemon_in_its_own_mount_and_cgroup_namespaces(make_container: MakeContainer, host: FakeHost,
                                                        tmp_path: Path) -> None:
    """gpuhookd run as the installer DaemonSet runs it (a privileged pod with hostPID: its own mount
    and cgroup namespaces): the worker still works in the hook's view of the host."""
    socket_dir = tmp_path / "run"
    socket_dir.mkdir(mode=0o700)
    path = str(socket_dir / "gpuhookd.sock")
    journal = tmp_path / "pod.journal"
    with journal.open("wb") as out:
        pod = subprocess.Popen(["unshare", "--mount", "--cgroup", "--propagation", "private", "--",
                                sys.executable, "-I", "-m", "gpuhook", "daemon", "--socket", path],
                               stdin=subprocess.DEVNULL, stdout=out, stderr=out, cwd="/",
                               env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "GPUHOOK_CONFIG": str(host.config_path)})
    try:
        # Wait for its answer, not its socket file: the file exists from bind(), before listen() and
        # before the workers are forked, and a hook connecting then would be served in-process.
        deadline = time.monotonic() + 60
        while not _answers(path):
            assert pod.poll() is None and time.monotonic() < deadline, journal.read_text()
            time.sleep(0.05)
        own_ns = os.stat("/proc/self/ns/mnt").st_ino
        assert os.stat(f"/proc/{pod.pid}/ns/mnt").st_ino != own_ns  # unshare exec'd the daemon in place
        offset = log_size(host)
        hook = hook_entry(host.config_path, "--daemon-socket", path, "prestart")
        result = make_container(PROBE, TWO_GPUS, hook=hook).run()
        assert result.returncode == 0, result.stderr
        assert {"/dev/nvidia1 ENXIO", "/dev/nvidia3 ENXIO", "/tmp/gpu0 EPERM", "dlopen libcuda.so.1: OK"} <= lines(
            result.stdout)
        assert {e["served_by"] for e in events_after(host.root / "gpuhook.log", offset)} == {"gpuhookd"}
    finally:
        pod.terminate()
        pod.wait(timeout=10)
    assert "request failed" not in journal.read_text()


def test_hook_side_of_a_served_request_imports_only_the_client(make_container: MakeContainer, host: FakeHost,
                                                               daemon: Gpuhookd) -> None:
    """With gpuhookd serving, a GPU start costs the hook the no-GPU path plus the client: nothing of the
    GPU path itself (measured as production imports: -S, no editable-install finder)."""
    repo = str(Path(__file__).parents[2])
    code = (f"import sys, os; before = set(sys.modules); sys.path.insert(0, {repo!r}); "
            "from gpuhook.cli import main; "
            f"rc = main(['--config', {str(host.config_path)!r}, '--daemon-socket', {daemon.socket!r}, 'prestart']); "
            "open(os.environ['OUT'], 'w').write(repr(sorted(set(sys.modules) - before)))")
    report = host.root.parent / "imports.txt"
    hook = {"path": sys.executable, "args": [sys.executable, "-I", "-S", "-c", code],
            "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin", f"OUT={report}"]}
    result = make_container("devopen /dev/nvidia1", {"NVIDIA_VISIBLE_DEVICES": "1"}, hook=hook).run()
    assert result.returncode == 0, result.stderr
    assert "/dev/nvidia1 ENXIO" in result.stdout
    client_side = {"gpuhook.daemon", "gpuhook.daemon.client", "gpuhook.daemon.wire", "gpuhook.sys",
                   "gpuhook.sys.fdpass", "_socket", "struct", "_struct"}
    assert set(ast.literal_eval(report.read_text())) <= NO_GPU_PATH | client_side

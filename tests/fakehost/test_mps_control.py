"""Tests of the simulated host's nvidia-cuda-mps-control (integration/fakehost/mpscontrol.c).

Real processes throughout: the daemon is started with ``-d`` and driven through
client mode, as gpuhook and NVIDIA's device plugin drive the real one.  Every
daemon lives in the test's own pipe and log directories (both variables are
always set, so the real /tmp/nvidia-mps is never touched), is waited on through
a pidfd (it is not our child), and is killed by the fixture's finalizer if the
test left it running.
"""

from __future__ import annotations

import os
import re
import select
import signal
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from integration.fakehost import FakeHost, create_host, native

# "[2026-12-01 12:00:00.123 Control  4242] message", as the real control.log has it.
LOG_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} Control +(\d+)\] (.*)$")
ALREADY = "An instance of this daemon is already running\n"
NO_DAEMON = "Cannot find MPS control daemon process\n"
WAIT_S = 10


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> FakeHost:
    """One host; only its nvidia-cuda-mps-control is used."""
    return create_host(tmp_path_factory.mktemp("mps") / "host", gpus=1)


class Mps:
    """One pipe/log directory pair and the daemons started on it."""

    def __init__(self, program: Path, base: Path) -> None:
        self.program = program
        self.pipe_dir = base / "pipe"
        self.log_dir = base / "log"
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir),
            "CUDA_VISIBLE_DEVICES": "0",
        }
        self.pidfds: dict[int, int] = {}

    @property
    def log(self) -> Path:
        return self.log_dir / "control.log"

    def log_lines(self) -> list[tuple[int, str]]:
        """control.log as (pid, message) pairs; every line must have the real format."""
        lines = []
        for line in self.log.read_text().splitlines():
            match = LOG_LINE.match(line)
            assert match, line
            lines.append((int(match[1]), match[2]))
        return lines

    def daemon(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Runs `nvidia-cuda-mps-control ARGS` (e.g. -d) to completion."""
        return subprocess.run([self.program, *args], env=self.env, capture_output=True, text=True,
                              timeout=WAIT_S, check=False)

    def start(self) -> int:
        """Starts a daemon with -d, which returns once it is ready; its pid."""
        result = self.daemon("-d")
        assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
        pid = int((self.pipe_dir / "nvidia-cuda-mps-control.pid").read_text())
        self.pidfds[pid] = os.pidfd_open(pid)
        return pid

    def send(self, text: str) -> subprocess.CompletedProcess[str]:
        """Pipes text into the client, as `echo CMD | nvidia-cuda-mps-control` does."""
        return subprocess.run([self.program], input=text, env=self.env, capture_output=True, text=True,
                              timeout=WAIT_S, check=False)

    def wait_gone(self, pid: int) -> None:
        """Waits (on its pidfd) for the daemon to exit."""
        poller = select.poll()
        poller.register(self.pidfds[pid], select.POLLIN)
        assert poller.poll(WAIT_S * 1000), f"daemon {pid} still running"

    def kill(self, pid: int) -> None:
        """SIGKILLs the daemon and waits for it to go."""
        signal.pidfd_send_signal(self.pidfds[pid], signal.SIGKILL)
        self.wait_gone(pid)

    def cleanup(self) -> None:
        """Kills whatever daemon is still running, then closes the pidfds."""
        pid_file = self.pipe_dir / "nvidia-cuda-mps-control.pid"
        if pid_file.exists():  # a daemon start() did not get to record
            pid = int(pid_file.read_text())
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                if pid not in self.pidfds and cmdline.startswith(os.fsencode(self.program)):
                    self.pidfds[pid] = os.pidfd_open(pid)
            except (FileNotFoundError, ProcessLookupError):
                pass
        for pid, fd in self.pidfds.items():
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
                self.wait_gone(pid)
            except ProcessLookupError:
                pass  # already gone
            os.close(fd)


@pytest.fixture
def mps(host: FakeHost, tmp_path: Path) -> Iterator[Mps]:
    """A pipe/log directory pair for the host's nvidia-cuda-mps-control; kills what the test started."""
    pair = Mps(host.root / native.MPS_CONTROL, tmp_path)
    try:
        yield pair
    finally:
        pair.cleanup()


def test_installed_in_the_driver_root(host: FakeHost) -> None:
    """The driver root's nvidia-cuda-mps-control is a compiled program, not a script."""
    program = host.root / "usr/bin/nvidia-cuda-mps-control"
    assert program.read_bytes()[:4] == b"\x7fELF" and os.access(program, os.X_OK)


def test_start_makes_the_pipe_directory_and_logs(mps: Mps) -> None:
    """-d returns once the daemon is ready: the real pipe directory entries and start lines exist."""
    pid = mps.start()
    modes = {entry.name: os.lstat(entry).st_mode for entry in mps.pipe_dir.iterdir()}
    assert set(modes) == {"control", "control_lock", "control_privileged", "log", "nvidia-cuda-mps-control.pid"}
    assert stat.S_ISSOCK(modes["control"]) and stat.S_IMODE(modes["control"]) == 0o666
    assert stat.S_ISSOCK(modes["control_privileged"]) and stat.S_IMODE(modes["control_privileged"]) == 0o755
    assert stat.S_ISFIFO(modes["log"]) and stat.S_IMODE(modes["log"]) == 0o777
    assert stat.S_ISREG(modes["control_lock"]) and stat.S_IMODE(modes["control_lock"]) == 0o666
    assert stat.S_IMODE(mps.pipe_dir.stat().st_mode) == 0o755
    assert mps.log_lines() == [
        (pid, f"Starting control daemon using socket {mps.pipe_dir}/control"),
        (pid, f"To connect CUDA applications to this daemon, set env CUDA_MPS_PIPE_DIRECTORY={mps.pipe_dir}"),
    ]
    # A daemon: a session of its own (setsid, then a second fork so that it never gets a terminal back),
    # stdio on /dev/null, the caller's CUDA_VISIBLE_DEVICES kept.
    assert os.getsid(pid) not in (pid, os.getsid(0))
    assert os.readlink(f"/proc/{pid}/fd/0") == "/dev/null"
    assert b"CUDA_VISIBLE_DEVICES=0" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


def test_commands_replies_and_log(mps: Mps) -> None:
    """Each command's reply as the real daemon prints it, and one logged connection per client."""
    pid = mps.start()
    before = len(mps.log_lines())
    result = mps.send(
        "get_default_active_thread_percentage\n"
        "set_default_active_thread_percentage 50\n"
        "get_default_active_thread_percentage\n"
        "set_default_device_pinned_mem_limit 0 40960M\n"
        "get_default_device_pinned_mem_limit 0\n"
        "set_default_device_pinned_mem_limit GPU-4f9c4d0e-1b1a-4b8e-9a3e-0c5e2b7d9a11 1500M\n"
        "get_default_device_pinned_mem_limit GPU-4f9c4d0e-1b1a-4b8e-9a3e-0c5e2b7d9a11\n"
        "get_default_device_pinned_mem_limit 1\n"
        "get_server_list\n"
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "100.0\n50.0\n50.0\n40G\n1500M\n", "")
    uuid = "GPU-4f9c4d0e-1b1a-4b8e-9a3e-0c5e2b7d9a11"
    assert [message for _, message in mps.log_lines()[before:]] == [
        "Accepting connection...",
        "NEW UI",
        "Cmd:get_default_active_thread_percentage",
        "100.0",
        "Cmd:set_default_active_thread_percentage 50",
        "50.0",
        "Cmd:get_default_active_thread_percentage",
        "50.0",
        "Cmd:set_default_device_pinned_mem_limit 0 40960M",
        "Cmd:get_default_device_pinned_mem_limit 0",
        "40G",
        f"Cmd:set_default_device_pinned_mem_limit {uuid} 1500M",
        f"Cmd:get_default_device_pinned_mem_limit {uuid}",
        "1500M",
        "Cmd:get_default_device_pinned_mem_limit 1",
        "Cmd:get_server_list",
        "UI closed",
    ]
    assert {line_pid for line_pid, _ in mps.log_lines()} == {pid}
    # The state outlives the client; a last line without its newline (the device plugin's way) is run too.
    assert mps.send("get_default_active_thread_percentage").stdout == "50.0\n"
    assert mps.send("get_default_device_pinned_mem_limit 0\n").stdout == "40G\n"


def test_rejected_commands_change_nothing(mps: Mps) -> None:
    """Unknown commands and bad values are logged, answered with nothing, and the daemon carries on."""
    mps.start()
    before = len(mps.log_lines())
    result = mps.send(
        "no_such_command\n"
        "set_default_active_thread_percentage 0\n"
        "set_default_active_thread_percentage 101\n"
        "set_default_device_pinned_mem_limit 0 40X\n"
        "set_default_device_pinned_mem_limit 0\n"
        "get_default_active_thread_percentage\n"
        "get_default_device_pinned_mem_limit 0\n"
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "100.0\n", "")
    logged = [message for _, message in mps.log_lines()[before:]]
    assert "Cmd:no_such_command" in logged and "Cmd:set_default_active_thread_percentage 101" in logged
    assert mps.send("get_server_list\n").returncode == 0


def test_second_daemon_on_the_pipe_directory_is_refused(mps: Mps) -> None:
    """A second -d finds the lock held: the real message, exit status 1, the first daemon unharmed."""
    pid = mps.start()
    second = mps.daemon("-d")
    assert (second.returncode, second.stdout, second.stderr) == (1, "", ALREADY)
    assert int((mps.pipe_dir / "nvidia-cuda-mps-control.pid").read_text()) == pid
    assert mps.send("get_default_active_thread_percentage\n").stdout == "100.0\n"
    assert [message for _, message in mps.log_lines()].count(
        f"Starting control daemon using socket {mps.pipe_dir}/control") == 1


def test_quit_stops_the_daemon_and_removes_its_entries(mps: Mps) -> None:
    """quit: the daemon exits, its sockets, lock, FIFO and pid file go, and clients then fail."""
    pid = mps.start()
    result = mps.send("quit\n")
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    mps.wait_gone(pid)
    assert list(mps.pipe_dir.iterdir()) == []
    assert mps.log_lines()[-2:] == [(pid, "Cmd:quit"), (pid, "UI closed")]
    after = mps.send("get_server_list\n")
    assert (after.returncode, after.stdout, after.stderr) == (1, "", NO_DAEMON)
    # The pipe directory is free again.
    mps.start()


def test_sigterm_stops_the_daemon_like_quit(mps: Mps) -> None:
    """SIGTERM: the daemon exits and cleans up as on quit."""
    pid = mps.start()
    signal.pidfd_send_signal(mps.pidfds[pid], signal.SIGTERM)
    mps.wait_gone(pid)
    assert list(mps.pipe_dir.iterdir()) == []


def test_concurrent_clients_each_get_their_own_reply(mps: Mps) -> None:
    """Eight clients connected at once, each talking in turn, each gets the reply to its own command."""
    mps.start()
    clients = [
        subprocess.Popen([mps.program], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=mps.env, text=True)
        for _ in range(8)
    ]
    try:
        # Each is held open until every one has had an answer, so all eight are connected at once.
        for round_ in range(2):
            for i, client in enumerate(clients):
                assert client.stdin and client.stdout
                client.stdin.write(f"set_default_active_thread_percentage {10 * i + round_ + 1}\n")
                client.stdin.flush()
            for i, client in enumerate(clients):
                assert client.stdout
                assert client.stdout.readline() == f"{10 * i + round_ + 1}.0\n"
        for client in clients:
            out, err = client.communicate(timeout=WAIT_S)
            assert (client.returncode, out, err) == (0, "", "")
    finally:
        for client in clients:
            if client.poll() is None:
                client.kill()
                client.wait()
    messages = [message for _, message in mps.log_lines()]
    assert messages.count("NEW UI") == 8 and messages.count("UI closed") == 8
    # One shared setting: whichever second-round command the daemon ran last.
    assert mps.send("get_default_active_thread_percentage\n").stdout in {f"{10 * i + 2}.0\n" for i in range(8)}


def test_sigkilled_daemon_leaves_control_and_a_new_one_starts(mps: Mps) -> None:
    """SIGKILL leaves the stale socket behind; clients fail, and the next -d recovers the directory."""
    first = mps.start()
    mps.send("set_default_active_thread_percentage 30\n")
    mps.kill(first)
    assert stat.S_ISSOCK(os.lstat(mps.pipe_dir / "control").st_mode)
    stale = mps.send("get_server_list\n")
    assert (stale.returncode, stale.stderr) == (1, NO_DAEMON)
    second = mps.start()
    assert second != first
    # A new daemon: fresh state.
    assert mps.send("get_default_active_thread_percentage\n").stdout == "100.0\n"
    starts = [pid for pid, message in mps.log_lines() if message.startswith("Starting control daemon")]
    assert starts == [first, second]


def test_client_without_a_daemon_fails(mps: Mps) -> None:
    """No daemon (no pipe directory, or one without a control socket): the real message, exit status 1."""
    result = mps.send("get_server_list\n")
    assert (result.returncode, result.stdout, result.stderr) == (1, "", NO_DAEMON)
    mps.pipe_dir.mkdir()
    result = mps.send("quit\n")
    assert (result.returncode, result.stdout, result.stderr) == (1, "", NO_DAEMON)
    assert not mps.log.exists()


def test_pipe_directory_longer_than_sun_path(mps: Mps, tmp_path: Path) -> None:
    """A pipe directory too long for sun_path still works (reached through /proc/self/fd)."""
    mps.pipe_dir = tmp_path / ("p" * 60) / ("q" * 60)
    mps.env["CUDA_MPS_PIPE_DIRECTORY"] = str(mps.pipe_dir)
    pid = mps.start()
    assert mps.send("set_default_active_thread_percentage 12.5\n").stdout == "12.5\n"
    mps.send("quit\n")
    mps.wait_gone(pid)
    assert list(mps.pipe_dir.iterdir()) == []


def test_a_client_that_reaches_only_control_can_ask_but_not_steer(mps: Mps, tmp_path: Path) -> None:
    """A pipe directory with the daemon's control socket alone (a hard link, as gpuhook gives containers):
    the client connects there; quit, set_default_* and start_server are logged, answered "Permission denied"
    and change nothing; the queries are answered; the daemon runs on."""
    pid = mps.start()
    assert mps.send("set_default_active_thread_percentage 50\n").stdout == "50.0\n"
    client_view = tmp_path / "client"
    client_view.mkdir()
    os.link(mps.pipe_dir / "control", client_view / "control")
    tenant = dict(mps.env, CUDA_MPS_PIPE_DIRECTORY=str(client_view))
    before = len(mps.log_lines())
    result = subprocess.run([mps.program], input="quit\nset_default_active_thread_percentage 100\n"
                            "set_default_device_pinned_mem_limit 0 80G\nstart_server -uid 0\n"
                            "get_default_active_thread_percentage\n", env=tenant, capture_output=True, text=True,
                            timeout=WAIT_S, check=False)
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == "Permission denied\n" * 4 + "50.0\n"
    logged = [message for _, message in mps.log_lines()[before:]]
    assert "Cmd:quit" in logged and logged.count("Permission denied") == 4
    assert mps.send("get_default_device_pinned_mem_limit 0\n").stdout == ""  # never set
    assert mps.send("get_default_active_thread_percentage\n").stdout == "50.0\n"
    assert int((mps.pipe_dir / "nvidia-cuda-mps-control.pid").read_text()) == pid
    assert Path(f"/proc/{pid}").exists()

"""Start and stop container daemons (dockerd) with private state, for real-engine tests.

Facts this module is built on (``/work/shared/reference/runtime-lab.md`` §4, docker.io 20.10.24):

* dockerd is ready in about 0.2 s and spawns its own containerd under ``--exec-root``; TERM stops
  both in about 1-3 s.
* ``--gpus`` needs an executable named ``nvidia-container-runtime-hook`` on dockerd's PATH *when it
  starts*; dockerd hands that hook its whole environment plus ``TMPDIR``.
* Every daemon here gets its own socket, pid file, data root, exec root, containerd namespace,
  cgroup parent and config file, so it never meets a system docker or another test's daemon.
  The one thing it makes outside its work dir is the empty plugin-discovery dir ``/run/docker/plugins``
  (a fixed path in 20.10).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from integration.engines import RunResult, require_tool

__all__ = ["Daemon", "DaemonError", "docker", "docker_client", "docker_run", "import_image", "start_dockerd"]

SYSTEM_PATH: Final = "/usr/sbin:/usr/bin:/sbin:/bin"
_READY_TIMEOUT_S: Final = 30.0
_TERM_GRACE_S: Final = 10.0
# Debian's client first: it matches the 20.10 daemon's API; a newer client also works (lab §4).
_CLIENTS: Final = (Path("/usr/bin/docker"), Path("/usr/local/bin/docker"))
_CGROUP_ROOT: Final = Path("/sys/fs/cgroup")
# 20.10's own dockerd flags; the rest of its settings come from the private config file.
_DOCKERD_FLAGS: Final = ("--iptables=false", "--ip6tables=false", "--bridge=none", "--storage-driver=overlay2")


class DaemonError(RuntimeError):
    """A daemon did not start or stop; the message carries its log."""


@dataclass(slots=True)
class Daemon:
    """A running daemon: its pid, its private work dir and how a client reaches it."""

    name: str
    pid: int
    workdir: Path
    socket: Path
    log: Path
    cgroup_parent: str
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def host(self) -> str:
        """The ``-H`` address for clients."""
        return f"unix://{self.socket}"

    def log_text(self) -> str:
        """The daemon's log so far (for error messages)."""
        try:
            return self.log.read_text(errors="replace")
        except OSError as err:
            return f"[no log: {err}]"

    def stop(self) -> None:
        """Stop it by pid (TERM, then KILL after 10 s), kill its leftovers and remove its state."""
        # Only while it runs: once reaped, its pid (and its children's) may belong to someone else.
        if _alive(self.pid, self.process):
            children = _descendants(self.pid)
            _terminate(self.pid, self.process)
            # dockerd normally takes its containerd down with it; a KILLed one does not.
            for pid in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        _umount_under(self.workdir)
        _remove_cgroups(self.cgroup_parent)
        shutil.rmtree(self.workdir, ignore_errors=True)
        if self.workdir.exists():
            raise DaemonError(f"{self.name}: could not remove {self.workdir}")


def docker_client() -> str:
    """The docker client binary (Debian's if installed)."""
    for client in _CLIENTS:
        if os.access(client, os.X_OK):
            return str(client)
    return require_tool("docker")


def start_dockerd(workdir: Path, *, path_dirs: Sequence[Path] = (), env: Mapping[str, str] | None = None,
                  runtimes: Mapping[str, Path] | None = None) -> Daemon:
    """Start dockerd with all its state under *workdir* and wait until ``docker info`` answers.

    Its environment is exactly PATH (*path_dirs*, then the system dirs) plus *env*: dockerd hands
    it on to ``--gpus`` hooks and runtimes, so nothing of the caller's may leak in. *runtimes*
    registers extra OCI runtimes (``docker run --runtime NAME``).
    """
    dockerd = require_tool("dockerd")
    workdir.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(4)
    cgroup_parent = f"/gpuhook-test-{token}"
    config = workdir / "daemon.json"
    # An explicit config file, so /etc/docker/daemon.json is never read. 20.10 has no flag for its
    # identity key, only this config key; without it dockerd writes /etc/docker/key.json.
    settings: dict[str, object] = {"cgroup-parent": cgroup_parent, "deprecated-key-path": str(workdir / "key.json")}
    if runtimes:
        settings["runtimes"] = {name: {"path": str(path)} for name, path in runtimes.items()}
    config.write_text(json.dumps(settings, indent=2) + "\n")
    socket, pidfile, log = workdir / "docker.sock", workdir / "docker.pid", workdir / "dockerd.log"
    argv = [
        dockerd, *_DOCKERD_FLAGS, "-H", f"unix://{socket}", "--pidfile", str(pidfile),
        "--data-root", str(workdir / "data"), "--exec-root", str(workdir / "exec"),
        "--containerd-namespace", f"gpuhook-{token}", "--containerd-plugins-namespace", f"gpuhook-{token}-plugins",
        "--config-file", str(config),
    ]
    daemon_env = {"PATH": os.pathsep.join([*(str(d) for d in path_dirs), SYSTEM_PATH]), **(env or {})}
    with log.open("wb") as out:
        # Its own session: a Ctrl-C on pytest must not reach it before stop() does.
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                   env=daemon_env, cwd=workdir, start_new_session=True)
    daemon = Daemon("dockerd", process.pid, workdir, socket, log, cgroup_parent, process)
    try:
        _wait_ready(daemon)
    except BaseException:
        daemon.stop()
        raise
    return daemon


def _wait_ready(daemon: Daemon) -> None:
    """Poll ``docker info`` until it succeeds; raise with the daemon's log on exit or timeout."""
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while True:
        if daemon.process is not None and daemon.process.poll() is not None:
            raise DaemonError(f"dockerd exited with status {daemon.process.returncode}:\n{daemon.log_text()}")
        # Cheap check first: the socket appears only once the API is about to listen.
        if daemon.socket.exists():
            probe = subprocess.run([docker_client(), "-H", daemon.host, "info", "--format", "{{.ServerVersion}}"],
                                   stdin=subprocess.DEVNULL, capture_output=True, timeout=_READY_TIMEOUT_S, check=False)
            if probe.returncode == 0:
                return
        if time.monotonic() > deadline:
            raise DaemonError(f"dockerd not ready after {_READY_TIMEOUT_S:g}s:\n{daemon.log_text()}")
        time.sleep(0.05)


def docker_run(daemon: Daemon, args: Sequence[str], timeout: float = 60) -> RunResult:
    """``docker run ARGS`` against *daemon*; the result of the client (rc 125: the daemon refused)."""
    return docker(daemon, ["run", *args], timeout=timeout)


def docker(daemon: Daemon, args: Sequence[str], *, timeout: float = 60, stdin: bytes | None = None) -> RunResult:
    """Any docker client command against *daemon*."""
    start = time.monotonic()
    try:
        proc = subprocess.run([docker_client(), "-H", daemon.host, *args], input=stdin,
                              stdin=None if stdin is not None else subprocess.DEVNULL,
                              capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as err:
        return RunResult(-1, (err.stdout or b"").decode(errors="replace"),
                         (err.stderr or b"").decode(errors="replace") + f"\n[docker killed after {timeout:g}s]",
                         time.monotonic() - start, timed_out=True)
    return RunResult(proc.returncode, proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace"),
                     time.monotonic() - start)


def import_image(daemon: Daemon, rootfs: Path, tag: str) -> None:
    """``tar -C ROOTFS -c . | docker import - TAG``; raise with the client's error if it fails."""
    tar = subprocess.run([require_tool("tar"), "-C", str(rootfs), "-c", "."], stdin=subprocess.DEVNULL,
                         capture_output=True, timeout=60, check=False)
    if tar.returncode != 0:
        raise DaemonError(f"tar -C {rootfs} failed: {tar.stderr.decode(errors='replace')}")
    result = docker(daemon, ["import", "-", tag], stdin=tar.stdout, timeout=60)
    if result.returncode != 0:
        raise DaemonError(f"docker import {tag} failed: {result.stderr}\n{daemon.log_text()}")


# --- stopping ---------------------------------------------------------------------------------


def _terminate(pid: int, process: subprocess.Popen[bytes] | None) -> None:
    """TERM *pid*, wait up to 10 s, then KILL it; reap it if it is our child."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + _TERM_GRACE_S
    while _alive(pid, process) and time.monotonic() < deadline:
        time.sleep(0.02)
    if _alive(pid, process):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        if process is not None:
            process.wait(timeout=_TERM_GRACE_S)


def _alive(pid: int, process: subprocess.Popen[bytes] | None) -> bool:
    """Whether *pid* still runs (reaping it when it is our child, so a zombie does not count)."""
    if process is not None:
        return process.poll() is None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _descendants(pid: int) -> list[int]:
    """Every process below *pid* (containerd, shims), deepest last, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat_line = (entry / "stat").read_text()
        except OSError:
            continue
        # The comm field may hold spaces and parentheses; the ppid is the second field after its ')'.
        ppid = int(stat_line.rpartition(")")[2].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _umount_under(workdir: Path) -> None:
    """Unmount whatever is still mounted below *workdir* (overlay layers, shm, netns), deepest first."""
    prefix = str(workdir.resolve()) + "/"
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        points = {line.split()[4] for line in f}
    # mountinfo escapes spaces as \040; the workdirs here have none, so a plain prefix test is exact.
    for point in sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-R", "-l", point], stdin=subprocess.DEVNULL, capture_output=True,
                       timeout=30, check=False)


def _remove_cgroups(parent: str) -> None:
    """rmdir the daemon's cgroup parent (and anything left in it) in every hierarchy."""
    name = parent.strip("/")
    for hierarchy in _CGROUP_ROOT.iterdir() if _CGROUP_ROOT.is_dir() else ():
        top = hierarchy / name
        if not top.is_dir():
            continue
        for dirpath, _, _ in sorted(os.walk(top), key=lambda w: len(w[0]), reverse=True):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)

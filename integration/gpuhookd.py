"""A ``gpuhook daemon`` for tests and the benchmark: started on a private socket, stopped with its workers."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

# Generous: on a busy machine the interpreter starts, imports and forks (the spares at nice 19) wait for CPU.
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 60.0
SETTLE_TIMEOUT_S = 60.0
#: The daemon keeps this many workers waiting (gpuhook.daemon.pool.SPARE_WORKERS), each with its apply
#: child forked ahead (and that child's ldconfig child, where ldconfig writes the containers' caches).
SPARE_WORKERS = 2


class DaemonError(RuntimeError):
    """gpuhookd did not start or stop as it should."""


class Gpuhookd:
    """``python -I -m gpuhook daemon --socket <dir>/gpuhookd.sock`` with its stderr (its journal) in a file.

    *config*: the config file it serves (``$GPUHOOK_CONFIG``); gpuhookd declines hooks that name another.
    """

    def __init__(self, python: Path | str, socket_dir: Path, config: Path | None = None) -> None:
        socket_dir.mkdir(mode=0o700, exist_ok=True)
        self.python = str(python)
        self.socket = str(socket_dir / "gpuhookd.sock")
        self.journal = socket_dir.parent / f"{socket_dir.name}.journal"
        self.config = config
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", **({"GPUHOOK_CONFIG": str(config)} if config else {})}
        with self.journal.open("wb") as out:
            self.proc = subprocess.Popen([self.python, "-I", "-m", "gpuhook", "daemon", "--socket", self.socket],
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=out, cwd="/", env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise DaemonError(f"gpuhookd did not start: {self.journal.read_text()}")
            time.sleep(0.05)

    def answers(self) -> bool:
        """Whether it answers a ping (asked from a fresh interpreter, as a hook would)."""
        ping = ("import sys\nfrom gpuhook.daemon import client\ntry:\n    client.ping(sys.argv[1])\n"
                "except client.NotServed:\n    sys.exit(1)\n")
        return subprocess.run([self.python, "-I", "-c", ping, self.socket], capture_output=True,
                              check=False).returncode == 0

    def processes(self) -> list[int]:
        """Pids running this daemon's command line: the daemon and its forked workers and children."""
        found = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and self.socket.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue  # exited meanwhile
        return found

    def family(self) -> dict[int, list[int]]:
        """Each worker (a child of the daemon) and its descendants."""
        parents = {pid: _ppid(pid) for pid in self.processes()}

        def descendants(pid: int) -> list[int]:
            kids = [c for c, p in parents.items() if p == pid]
            return kids + [d for kid in kids for d in descendants(kid)]

        return {pid: descendants(pid) for pid, p in parents.items() if p == self.proc.pid}

    def settled(self) -> dict[int, list[int]]:
        """Wait until the pool is at rest (its spare workers, each with its children forked ahead), so that
        counting processes compares like with like; that family."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        children = self.children_ahead()
        while len(family := self.family()) != SPARE_WORKERS or any(len(kids) != children for kids in family.values()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise DaemonError(f"gpuhookd's pool did not settle within {SETTLE_TIMEOUT_S:g} s "
                                  f"(workers and their children: {family}): {self.journal.read_text()}")
            time.sleep(0.05)
        return family

    def children_ahead(self) -> int:
        """How many children an idle worker forks ahead: its apply child, and that child's ldconfig child
        unless gpuhook writes the containers' caches itself (as the daemon finds, from its config)."""
        from gpuhook import service
        from gpuhook.config import load_config, resolve_config_path

        path, required = resolve_config_path(str(self.config) if self.config else None, {})
        return 1 if service.writes_ldcache_itself(load_config(path, required=required)) else 2

    def stop(self) -> str:
        """SIGTERM it and wait until its idle workers are gone too; its journal."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while left := self.processes():
            if time.monotonic() > deadline:
                raise DaemonError(f"gpuhookd's workers outlived it: {left}")
            time.sleep(0.05)
        return self.journal.read_text()


def _ppid(pid: int) -> int:
    """The parent of *pid* (0 if it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0

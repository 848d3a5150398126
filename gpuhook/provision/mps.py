"""The MPS control daemons gpuhook runs: one per ``sharing: mps`` GPU while containers hold it.

``ensure`` (at a start, under the GPU's lock) finds the GPU's daemon running or starts one: it is
recorded in the ledger *before* it is started (no pid yet), started as the driver root's
``nvidia-cuda-mps-control -d`` with a clean environment (``CUDA_VISIBLE_DEVICES`` = the GPU's
UUID, its own pipe and log directories under ``state_dir/mps/<uuid>``), in a mount namespace of
its own whose ``/dev/shm`` is ``state_dir/mps/<uuid>/shm`` (what its clients get as theirs, so
that the MPS server and its clients share memory), then given the policy's limits through its
control pipe and recorded with its pid. ``stop_idle`` tells each daemon whose GPU no lease holds
``quit`` (and kills it if it will not go), then forgets it. A crash between record and pid leaves
a record without one: ``stop_idle`` still sends that pipe directory ``quit``, so no daemon is left.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from gpuhook import catalog
from gpuhook.errors import ProvisionError
from gpuhook.inventory import Gpu
from gpuhook.provision import ledger_store
from gpuhook.provision.leases import alive
from gpuhook.sharing.ledger import Holder, MpsDaemon
from gpuhook.sys.procstat import start_ticks

#: How long a daemon gets to start, to answer, and to quit.
DAEMON_TIMEOUT_S = 10.0
_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """What each client may use: percent of the SMs, MiB of pinned device memory."""

    thread_percentage: float
    memory_limit_mib: int


def ensure(state_dir: Path, control: Path, gpu: Gpu, limits: Limits) -> MpsDaemon:
    """*gpu*'s MPS daemon, running with *limits* (started now if it is not); raises ProvisionError."""
    with ledger_store.gpu_lock(state_dir, gpu.uuid, "mps"):
        recorded = ledger_store.read(state_dir).daemon_for(gpu.uuid)
        if (recorded is not None and recorded.holder is not None and alive(recorded.holder)
                and (recorded.thread_percentage, recorded.memory_limit_mib)
                == (limits.thread_percentage, limits.memory_limit_mib)):
            return recorded
        if recorded is not None:  # dead (killed?), never started, or other limits: start it afresh
            _stop(control, recorded)
        base = state_dir / "mps" / gpu.uuid
        daemon = MpsDaemon(gpu=gpu.uuid, pipe_dir=str(base / "pipe"), log_dir=str(base / "log"),
                           shm_dir=str(base / "shm"), thread_percentage=limits.thread_percentage,
                           memory_limit_mib=limits.memory_limit_mib)
        _record(state_dir, daemon)
        started = replace(daemon, holder=_start(control, daemon))
        _record(state_dir, started)
        return started


def stop_idle(state_dir: Path, control: Path) -> tuple[MpsDaemon, ...]:
    """Stop every daemon whose GPU no lease holds any more; the ones stopped."""
    stopped = []
    for daemon in ledger_store.read(state_dir).idle_daemons():
        with ledger_store.gpu_lock(state_dir, daemon.gpu, "mps"):
            if daemon not in ledger_store.read(state_dir).idle_daemons():
                continue  # stopped by another, or a start took the GPU again meanwhile
            _stop(control, daemon)
            _forget(state_dir, daemon)
            stopped.append(daemon)
    return tuple(stopped)


def _forget(state_dir: Path, daemon: MpsDaemon) -> None:
    ledger_store.update(state_dir, lambda ledger: (ledger.without_daemon(daemon), None))


def _record(state_dir: Path, daemon: MpsDaemon) -> None:
    ledger_store.update(state_dir, lambda ledger: (ledger.with_daemon(daemon), None))


def _env(daemon: MpsDaemon) -> dict[str, str]:
    """The daemon's (and its clients' commands') whole environment: nothing of the caller's."""
    return {"PATH": _PATH, "CUDA_VISIBLE_DEVICES": daemon.gpu, "CUDA_MPS_PIPE_DIRECTORY": daemon.pipe_dir,
            "CUDA_MPS_LOG_DIRECTORY": daemon.log_dir}


def _start(control: Path, daemon: MpsDaemon) -> Holder:
    """Start the control daemon, give it its limits; its process."""
    for directory in (daemon.pipe_dir, daemon.log_dir, daemon.shm_dir):
        os.makedirs(directory, mode=0o755, exist_ok=True)
    os.chmod(daemon.shm_dir, 0o1777)  # /dev/shm's mode: clients of any uid make their segments there
    _run(control, ["-d"], daemon, what="start")
    pid = _daemon_pid(control, daemon)
    ticks = start_ticks(pid)
    if ticks is None:
        raise ProvisionError(f"the MPS control daemon for GPU {daemon.gpu} (pid {pid}) exited as it started; see "
                             f"{daemon.log_dir}/control.log")
    commands = (f"set_default_active_thread_percentage {_percent(daemon.thread_percentage)}\n"
                f"set_default_device_pinned_mem_limit 0 {daemon.memory_limit_mib}M\n")
    _run(control, [], daemon, stdin=commands, what="set the limits of")
    return Holder(pid=pid, start=ticks)


def _percent(value: float) -> str:
    return str(int(value)) if value == int(value) else f"{value:g}"


def _run(control: Path, args: list[str], daemon: MpsDaemon, *, what: str, stdin: str = "") -> str:
    """``nvidia-cuda-mps-control ARGS`` with *stdin*; its stdout; raises ProvisionError."""
    try:
        proc = subprocess.run([str(control), *args], input=stdin, env=_env(daemon), capture_output=True, text=True,
                              timeout=DAEMON_TIMEOUT_S, check=False, close_fds=True, cwd="/",
                              preexec_fn=_private_shm(daemon) if args == ["-d"] else None)
    except (OSError, subprocess.SubprocessError) as err:
        raise ProvisionError(f"cannot {what} the MPS control daemon for GPU {daemon.gpu} ({control}): {err}") from err
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout).strip()
        raise ProvisionError(f"cannot {what} the MPS control daemon for GPU {daemon.gpu}: {control} exited "
                             f"{proc.returncode}{': ' + said if said else ''}; see {daemon.log_dir}/control.log")
    return proc.stdout


def _private_shm(daemon: MpsDaemon) -> Callable[[], None]:
    """In the daemon's child before exec: a mount namespace of its own, /dev/shm = the daemon's shm dir."""
    from gpuhook.sys import syscalls

    def enter() -> None:
        syscalls.unshare(syscalls.CLONE_NEWNS)
        syscalls.make_mounts_private()
        tree = syscalls.open_tree(-100, daemon.shm_dir, syscalls.OPEN_TREE_CLONE | syscalls.OPEN_TREE_CLOEXEC)
        target = os.open("/dev/shm", os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        syscalls.move_mount(tree, target, what="/dev/shm")
        os.setsid()

    return enter


def _daemon_pid(control: Path, daemon: MpsDaemon) -> int:
    """The control daemon's pid, from the ``nvidia-cuda-mps-control.pid`` it writes in its pipe directory
    (``-d`` returns without saying it), checked to be that program."""
    pid_file = Path(daemon.pipe_dir) / f"{catalog.MPS_CONTROL}.pid"
    deadline = time.monotonic() + DAEMON_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            pid = int(pid_file.read_text(encoding="ascii").strip())
            if Path(f"/proc/{pid}/comm").read_text().strip() == control.name[:15]:
                return pid
        except (OSError, ValueError):
            pass
        time.sleep(0.01)
    raise ProvisionError(f"the MPS control daemon for GPU {daemon.gpu} did not come up within {DAEMON_TIMEOUT_S:g} s "
                         f"(no live {pid_file}); see {daemon.log_dir}/control.log")


def _stop(control: Path, daemon: MpsDaemon) -> None:
    """``quit``, then SIGKILL if the daemon will not go; its pipes and shared memory are removed."""
    with contextlib.suppress(ProvisionError):  # none there (killed, or never started): nothing to tell
        _run(control, [], daemon, stdin="quit\n", what="stop")
    holder = daemon.holder
    if holder is not None:
        try:
            pidfd = os.pidfd_open(holder.pid)
        except OSError:
            pidfd = None  # gone already
        if pidfd is not None:
            try:
                # the pidfd pins the process: if it is still the daemon now, the signal can reach no other
                if alive(holder) and not select.select([pidfd], [], [], DAEMON_TIMEOUT_S)[0] and alive(holder):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            finally:
                os.close(pidfd)
    for left in (daemon.pipe_dir, daemon.shm_dir):  # its log stays, for whoever asks why it stopped
        shutil.rmtree(left, ignore_errors=True)

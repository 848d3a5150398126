"""The MPS control daemons gpuhook runs: one per ``sharing: mps`` GPU while containers hold it.

Each daemon has ``state_dir/mps/<uuid>/``:

* ``pipe/``: its CUDA_MPS_PIPE_DIRECTORY (``control``, ``control_privileged``, ``control_lock``, ``log``, its
  pid file), on the host alone: whoever reaches ``control_privileged`` steers the daemon (quit, limits);
* ``client/``: what its containers get, read-only, as ``/tmp/nvidia-mps``: a hard link of the daemon's
  ``control`` socket (connect() needs only the socket's inode) and nothing else. Read-only, so a tenant can
  neither replace it nor make a socket of its own there for the other tenants to reach;
* ``shm/``: a tmpfs of the policy's size, its /dev/shm and its clients' (the server and its clients share
  memory through it): bounded, and on no filesystem gpuhook's ledger is on;
* ``log/``: its CUDA_MPS_LOG_DIRECTORY.

``ensure`` (at a start, under the GPU's lock) checks the recorded daemon is the one behind the pipes
(``check``: its pid and start time, the pid file, the containers' socket, the limits it reports), tells
it the policy's limits again, and starts it if it is not running: recorded in the ledger *before* it
is started (no pid yet), as the driver root's ``nvidia-cuda-mps-control -d`` with a clean environment
(``CUDA_VISIBLE_DEVICES`` = the GPU's UUID), in a mount namespace of its own whose ``/dev/shm`` is the
tmpfs. A daemon that died while containers hold the GPU is started again *in the same directories*
(the tmpfs stays mounted, the containers' socket link is replaced in place), so its holders, whose
mounts name those directories, reach the new one. ``stop_idle`` tells each daemon whose GPU no lease
holds ``quit`` (and kills it if it will not go), unmounts its tmpfs, removes its directories and
forgets it. A crash between record and pid leaves a record without one: ``stop_idle`` still sends that
pipe directory ``quit`` and unmounts the tmpfs, so nothing is left.
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
#: What a client needs of the pipe directory: the control daemon's socket (it hands the client on to its
#: server); ``control_privileged`` (quit, the limits) stays on the host.
CLIENT_ENTRIES = ("control",)
_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
_PID_FILE = f"{catalog.MPS_CONTROL}.pid"


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """What each client may use (percent of the SMs, MiB of pinned device memory), and the MiB of the
    /dev/shm tmpfs the daemon shares with its clients."""

    thread_percentage: float
    memory_limit_mib: int
    shm_size_mib: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Check:
    """Whether a recorded daemon is the one behind its pipes, with the limits it was told."""

    #: why it is not gpuhook's recorded daemon (not running, another pid, another socket); empty: it is
    identity: tuple[str, ...] = ()
    #: how the limits it reports differ from those recorded (someone told it others); empty: they match
    limits: tuple[str, ...] = ()

    @property
    def problems(self) -> tuple[str, ...]:
        """Everything wrong with it; empty: it is gpuhook's, as recorded."""
        return self.identity + self.limits


@dataclass(frozen=True, slots=True, kw_only=True)
class Ensured:
    """A start's daemon: the one running now, whether it was started now, what was wrong with the recorded one."""

    daemon: MpsDaemon
    started: bool
    found: Check
    #: waits for the limits being told to a daemon that was running (a process of their own, which works
    #: while the start goes on) and raises ProvisionError where they were not: called before the container runs
    told: Callable[[], object] = lambda: None


def client_dir(daemon: MpsDaemon) -> str:
    """The directory *daemon*'s containers get as their pipe directory (only the client socket in it)."""
    return str(Path(daemon.pipe_dir).parent / "client")


def ensure(state_dir: Path, control: Path, gpu: Gpu, limits: Limits) -> Ensured:
    """*gpu*'s MPS daemon, running with *limits* (started now if it is not); raises ProvisionError."""
    with ledger_store.gpu_lock(state_dir, gpu.uuid, "mps"):
        recorded = ledger_store.read(state_dir).daemon_for(gpu.uuid)
        # the daemon's identity only (no process to run): its limits are told again below whatever they are
        found = Check(identity=_identity(recorded)) if recorded is not None else Check()
        if recorded is not None and not found.identity:
            # gpuhook's own daemon: its limits told again at each start, whatever told it others since
            daemon = replace(recorded, thread_percentage=limits.thread_percentage,
                             memory_limit_mib=limits.memory_limit_mib)
            telling = _spawn(control, [], daemon, stdin=_limit_commands(daemon), what="set the limits of")
            if daemon != recorded:
                _record(state_dir, daemon)
            return Ensured(daemon=daemon, started=False, found=found,
                           told=lambda: _finish(telling, control, daemon, what="set the limits of"))
        if recorded is not None:  # dead (killed? quit?), never started, or not the one behind the pipes
            _stop(control, recorded)
        base = state_dir / "mps" / gpu.uuid
        daemon = MpsDaemon(gpu=gpu.uuid, pipe_dir=str(base / "pipe"), log_dir=str(base / "log"),
                           shm_dir=str(base / "shm"), thread_percentage=limits.thread_percentage,
                           memory_limit_mib=limits.memory_limit_mib)
        _record(state_dir, daemon)  # before the tmpfs and the process: a crash leaves them recorded
        _mount_shm(daemon, limits.shm_size_mib)
        started = replace(daemon, holder=_start(control, daemon))
        _link_client(started)
        _record(state_dir, started)
        return Ensured(daemon=started, started=True, found=found)


def check(control: Path, daemon: MpsDaemon) -> Check:
    """Whether *daemon* is the one behind its pipes (its process, pid file and client socket) and reports the
    limits recorded for it (asked through its own ``get_default_...`` commands). Changes nothing."""
    identity = _identity(daemon)
    if identity:
        return Check(identity=identity)
    try:
        threads, memory = _reported(control, daemon)
    except ProvisionError as err:
        return Check(identity=(str(err),))
    limits = []
    if threads != f"{daemon.thread_percentage:.1f}":
        limits.append(f"it reports {threads or 'no'}% of the SMs per client, not {daemon.thread_percentage:g}%")
    if memory != daemon.memory_limit_mib:
        limits.append(f"it reports {memory if memory is not None else 'no'} MiB of pinned memory per client, "
                      f"not {daemon.memory_limit_mib}")
    return Check(limits=tuple(limits))


def _identity(daemon: MpsDaemon) -> tuple[str, ...]:
    """Why *daemon* is not the one behind its pipes (its process, pid file, client socket); empty: it is.
    Reads files only, so that each start can afford it."""
    holder = daemon.holder
    if holder is None:
        return ("it was recorded but never started (gpuhook stopped while starting it)",)
    if not alive(holder):
        return (f"its control daemon (pid {holder.pid}) is not running",)
    pipe = Path(daemon.pipe_dir)
    try:
        named = (pipe / _PID_FILE).read_text(encoding="ascii").strip()
    except OSError as err:
        named = f"nothing ({err.strerror})"
    identity = []
    if named != str(holder.pid):
        identity.append(f"{pipe / _PID_FILE} names {named}, not gpuhook's pid {holder.pid}")
    if not _same_file(pipe / "control", Path(client_dir(daemon)) / "control"):
        identity.append(f"the containers' {client_dir(daemon)}/control is not the daemon's socket")
    return tuple(identity)


def stop_idle(state_dir: Path, control: Path) -> tuple[MpsDaemon, ...]:
    """Stop every daemon whose GPU no lease holds any more (its tmpfs and directories gone too); the ones stopped."""
    stopped = []
    for daemon in ledger_store.read(state_dir).idle_daemons():
        with ledger_store.gpu_lock(state_dir, daemon.gpu, "mps"):
            if daemon not in ledger_store.read(state_dir).idle_daemons():
                continue  # stopped by another, or a start took the GPU again meanwhile
            _stop(control, daemon)
            _remove(daemon)
            _forget(state_dir, daemon)
            stopped.append(daemon)
    return tuple(stopped)


def _forget(state_dir: Path, daemon: MpsDaemon) -> None:
    ledger_store.update(state_dir, lambda ledger: (ledger.without_daemon(daemon), None))


def _record(state_dir: Path, daemon: MpsDaemon) -> None:
    ledger_store.update(state_dir, lambda ledger: (ledger.with_daemon(daemon), None))


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samestat(os.stat(a, follow_symlinks=False), os.stat(b, follow_symlinks=False))
    except OSError:
        return False


def _env(daemon: MpsDaemon) -> dict[str, str]:
    """The daemon's (and its clients' commands') whole environment: nothing of the caller's."""
    return {"PATH": _PATH, "CUDA_VISIBLE_DEVICES": daemon.gpu, "CUDA_MPS_PIPE_DIRECTORY": daemon.pipe_dir,
            "CUDA_MPS_LOG_DIRECTORY": daemon.log_dir}


def _mount_shm(daemon: MpsDaemon, size_mib: int) -> None:
    """A tmpfs of *size_mib* at the daemon's shm dir (mode 1777, as /dev/shm: clients of any uid make their
    segments there), unless one is there already (a restart keeps its holders' /dev/shm)."""
    from gpuhook.sys import syscalls

    shm = Path(daemon.shm_dir)
    shm.mkdir(mode=0o755, parents=True, exist_ok=True)
    if os.stat(shm).st_dev != os.stat(shm.parent).st_dev:
        return
    attrs = syscalls.MOUNT_ATTR_NOSUID | syscalls.MOUNT_ATTR_NODEV | syscalls.MOUNT_ATTR_NOEXEC
    try:
        tmpfs = syscalls.fsmount_tmpfs({"size": f"{size_mib}m", "mode": "1777"}, attrs)
        try:
            target = os.open(shm, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                syscalls.move_mount(tmpfs, target, what=str(shm))
            finally:
                os.close(target)
        finally:
            os.close(tmpfs)
    except OSError as err:
        raise ProvisionError(f"cannot mount the /dev/shm tmpfs ({size_mib} MiB) of the MPS daemon for GPU "
                             f"{daemon.gpu} on {shm}: {err.strerror or err}") from err


def _link_client(daemon: MpsDaemon) -> None:
    """The daemon's client socket(s) into its client dir, each replaced in place (a rename): the read-only
    bind its holders have of that directory shows them the new socket at once."""
    client = Path(client_dir(daemon))
    client.mkdir(mode=0o755, exist_ok=True)
    for name in CLIENT_ENTRIES:
        source, target = Path(daemon.pipe_dir) / name, client / name
        if _same_file(source, target):
            continue
        fresh = client / f".{name}.new"
        with contextlib.suppress(FileNotFoundError):
            fresh.unlink()
        try:
            os.link(source, fresh, follow_symlinks=False)
            os.rename(fresh, target)
        except OSError as err:
            raise ProvisionError(f"cannot give the containers of GPU {daemon.gpu} its MPS daemon's {name} "
                                 f"({source} → {target}): {err.strerror or err}") from err


def _start(control: Path, daemon: MpsDaemon) -> Holder:
    """Start the control daemon, give it its limits; its process."""
    for directory in (daemon.pipe_dir, daemon.log_dir):
        os.makedirs(directory, mode=0o755, exist_ok=True)
    _run(control, ["-d"], daemon, what="start")
    pid = _daemon_pid(control, daemon)
    ticks = start_ticks(pid)
    if ticks is None:
        raise ProvisionError(f"the MPS control daemon for GPU {daemon.gpu} (pid {pid}) exited as it started; see "
                             f"{daemon.log_dir}/control.log")
    _set_limits(control, daemon)
    return Holder(pid=pid, start=ticks)


def _set_limits(control: Path, daemon: MpsDaemon) -> None:
    _run(control, [], daemon, stdin=_limit_commands(daemon), what="set the limits of")


def _limit_commands(daemon: MpsDaemon) -> str:
    return (f"set_default_active_thread_percentage {_percent(daemon.thread_percentage)}\n"
            f"set_default_device_pinned_mem_limit 0 {daemon.memory_limit_mib}M\n")


def _reported(control: Path, daemon: MpsDaemon) -> tuple[str, int | None]:
    """The limits the daemon reports: its percentage as it prints it, its pinned-memory limit in MiB (None: none)."""
    replies = _run(control, [], daemon, stdin="get_default_active_thread_percentage\n"
                   "get_default_device_pinned_mem_limit 0\n", what="ask").splitlines()
    said, memory = (line.strip() for line in [*replies, "", ""][:2])  # no memory line where none was set
    unit = {"M": 0, "G": 10, "T": 20}.get(memory[-1:])
    mib = int(memory[:-1]) << unit if unit is not None and memory[:-1].isdigit() else None
    return said, mib


def _percent(value: float) -> str:
    return str(int(value)) if value == int(value) else f"{value:g}"


def _run(control: Path, args: list[str], daemon: MpsDaemon, *, what: str, stdin: str = "") -> str:
    """``nvidia-cuda-mps-control ARGS`` with *stdin*; its stdout; raises ProvisionError."""
    return _finish(_spawn(control, args, daemon, stdin=stdin, what=what), control, daemon, what=what)


def _spawn(control: Path, args: list[str], daemon: MpsDaemon, *, stdin: str, what: str) -> subprocess.Popen[str]:
    """``nvidia-cuda-mps-control ARGS`` started, *stdin* (a few commands: within a pipe's buffer) written to it."""
    try:
        proc = subprocess.Popen([str(control), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=_env(daemon), close_fds=True, cwd="/",
                                # as subprocess.run took it before: the daemon's start only (its /dev/shm)
                                preexec_fn=_private_shm(daemon) if args == ["-d"] else None)  # noqa: PLW1509
        assert proc.stdin is not None
        with proc.stdin:
            proc.stdin.write(stdin)
        proc.stdin = None  # written and closed: communicate() has nothing more to send
    except (OSError, subprocess.SubprocessError) as err:
        raise ProvisionError(f"cannot {what} the MPS control daemon for GPU {daemon.gpu} ({control}): {err}") from err
    return proc


def _finish(proc: subprocess.Popen[str], control: Path, daemon: MpsDaemon, *, what: str) -> str:
    """*proc*'s stdout once it exits (killed after DAEMON_TIMEOUT_S); raises ProvisionError where it failed."""
    try:
        out, err = proc.communicate(timeout=DAEMON_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise ProvisionError(f"cannot {what} the MPS control daemon for GPU {daemon.gpu}: {control} did not answer "
                             f"in {DAEMON_TIMEOUT_S:g} s; see {daemon.log_dir}/control.log") from None
    if proc.returncode != 0:
        said = (err or out).strip()
        raise ProvisionError(f"cannot {what} the MPS control daemon for GPU {daemon.gpu}: {control} exited "
                             f"{proc.returncode}{': ' + said if said else ''}; see {daemon.log_dir}/control.log")
    return out


def _private_shm(daemon: MpsDaemon) -> Callable[[], None]:
    """In the daemon's child before exec: a mount namespace of its own, /dev/shm = the daemon's tmpfs."""
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
    pid_file = Path(daemon.pipe_dir) / _PID_FILE
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
    """``quit``, then SIGKILL if the daemon will not go. Its directories stay: a restart reuses them."""
    with contextlib.suppress(ProvisionError):  # none there (killed, or never started): nothing to tell
        _run(control, [], daemon, stdin="quit\n", what="stop")
    holder = daemon.holder
    if holder is None:
        return
    try:
        pidfd = os.pidfd_open(holder.pid)
    except OSError:
        return  # gone already
    try:
        # the pidfd pins the process: if it is still the daemon now, the signal can reach no other
        if alive(holder) and not select.select([pidfd], [], [], DAEMON_TIMEOUT_S)[0] and alive(holder):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    finally:
        os.close(pidfd)


def _remove(daemon: MpsDaemon) -> None:
    """A stopped daemon's tmpfs unmounted, its pipes and client dir removed; its log stays, for whoever asks
    why it stopped."""
    from gpuhook.sys import syscalls

    with contextlib.suppress(OSError):  # not mounted: a crash came before the mount
        syscalls.umount_detach(daemon.shm_dir)
    for left in (daemon.pipe_dir, client_dir(daemon), daemon.shm_dir):
        shutil.rmtree(left, ignore_errors=True)

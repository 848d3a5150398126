"""The one privileged step: apply a Plan to a live container.

Two steps, which ``gpuhook.service`` runs at once, the child's started first, on its undo stack
(each undone if the other fails, so a refused container leaves nothing behind):

1. in the hook process, on the host: the device-cgroup rules;
2. in a forked, single-threaded child (``setns`` into a mount namespace is
   refused to a process with other threads, and NVML may have started some):
   open every host mount source with ``open_tree`` while still in the host's
   namespace, enter the container's mount namespace through a pidfd, then
   create device nodes, attach the mounts, add the symlinks, mask
   /proc/driver/nvidia, and finally write the container's ld.so.cache: by gpuhook itself
   (``ldwrite``) where the host's ldconfig was found to write the same (``ldprofile``),
   else by running that ldconfig, sandboxed and chrooted in the rootfs.

The child reports back over a pipe as JSON; the parent turns a failure into
an ``ApplyError`` naming the step and path. A child that made its changes then holds them,
undoable, until the parent commits them (``RootfsChanges.commit``: one byte, and one back near
the deadline); if the parent dies first (a runtime's hook timeout, gpuhookd's request alarm,
SIGKILL), its end of their channel closes and the child undoes every change itself before it
exits: the child does not die with its parent, so a killed hook leaves the rootfs as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import signal
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import _socket

from gpuhook.apply import cgroups
from gpuhook.apply.children import wait_child
from gpuhook.apply.ldconfig import LDCONFIG_DEADLINE_S, open_ldconfig, run_ldconfig
from gpuhook.apply.ldwrite import MOST_LIBRARIES, CacheWriter, LdconfigProfile, hidden_devices
from gpuhook.apply.rootfs import RootFs
from gpuhook.errors import ApplyError, LdCacheFormatError, error_from_dict
from gpuhook.ldcache import parse_ldcache
from gpuhook.planning.plan import BindMount, CudaCompat, Plan, ProcDriverMount
from gpuhook.sys import process, syscalls

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpuhook.apply.ahead import ChildAhead
    from gpuhook.apply.cgroups import Undo
    from gpuhook.sys.prefault import Learned

_NO_PROC_DRIVER = "the container's /proc has no driver/nvidia (the NVIDIA kernel module is not loaded on this host)"


@dataclass(frozen=True, slots=True)
class HostLdconfig:
    """The host's ldconfig, and what it was found to do (``ldprofile``): with a profile, gpuhook
    writes the cache itself; without one, the binary runs sandboxed."""

    path: Path
    profile: LdconfigProfile | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ApplyReport:
    """What the privileged step did not do, and why (data, logged by the caller), and what each step took."""

    skipped: tuple[str, ...] = ()
    #: what was left as the image has it, which is no problem (an image's own link, its older compat
    #: libraries): logged at debug, since most starts have some
    notes: tuple[str, ...] = ()
    #: (step, milliseconds) in the child, in order: open (host sources, the container's root), nodes,
    #: mounts, symlinks, proc (/proc/driver/nvidia), ldconfig (the profile `make bench` prints)
    steps_ms: tuple[tuple[str, float], ...] = ()
    #: the child's page faults over its work (copies of pages it shared with its parent: ``sys.prefault``)
    page_faults: int = 0
    #: library files gpuhook's cache writer read in the rootfs (the others were read before: the driver's by
    #: the idle worker, the image's by the apply child's head start); None where ldconfig wrote the cache
    libraries_read: int | None = None
    #: library files that head start read (the others were known: an earlier start of the image read them,
    #: ``ldshared``); None where it was not taken
    libraries_read_ahead: int | None = None


@dataclass(frozen=True, slots=True)
class RootfsChanges:
    """The changes an apply child made and holds, undoable, until ``commit`` (or its channel closes)."""

    report: ApplyReport
    rootfs: str
    channel: _socket.socket
    deadline: float

    def commit(self) -> None:
        """Tell the child to keep its changes; raises ApplyError when it has undone them instead (it gave
        up waiting, or died). The child waits for the word until a deadline later than ours (it started
        after us, with the same timeout), and undoes nothing once it has it: with a second to spare
        the word alone settles it; closer to the deadline the child's own word that it kept them is
        waited for."""
        try:
            self.channel.settimeout(max(self.deadline - time.monotonic(), _COMMIT_GRACE_S))
            self.channel.send(_COMMIT)
            kept = time.monotonic() < self.deadline - _COMMIT_GRACE_S or self.channel.recv(1) == _KEPT
        except OSError:
            kept = False
        finally:
            self.channel.close()
        if not kept:
            raise ApplyError("commit", self.rootfs, detail="the apply child did not keep its changes (it undid them)")

    def abandon(self) -> None:
        """Let the child undo its changes (it sees its channel close); returns at once."""
        self.channel.close()


#: the parent's word that the start holds, and the child's that it kept its changes
_COMMIT, _KEPT = b"c", b"k"
#: what the commit may take at least, even with the start's time spent (the child only unlinks saved files),
#: and the time left under which the child's word that it kept the changes is waited for
_COMMIT_GRACE_S = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ContainerRef:
    """The container to change: its init pid and its rootfs (path and identity as the hook sees it)."""

    pid: int
    rootfs: Path
    rootfs_id: tuple[int, int]


@dataclass(frozen=True, slots=True)
class ChildForkedAhead:
    """gpuhookd's apply child, forked before the request, and the hook's view it must take first
    (the hook's mount namespace and root, as fds): the child was forked in the daemon's."""

    child: ChildAhead
    mount_ns_fd: int
    root_fd: int


def fork_apply_child(*, priority: int, close: Sequence[int] = (), ldconfig_ahead: bool = True,
                     learned: Learned | None = None) -> ChildAhead:
    """An apply child forked now, to get its plan later (an idle gpuhookd worker does this); it
    closes *close*, fds of the worker it must not hold, and waits at nice value *priority*.
    *ldconfig_ahead*: it forks its own ldconfig child ahead too (where gpuhook writes the cache
    itself, ldconfig runs only for a rare image with hundreds of libraries: forked then).
    *learned*: the pages earlier apply children wrote, copied in while it waits, and its own kept."""
    from gpuhook.apply.ahead import ChildAhead  # gpuhookd only: a hook forks at once
    from gpuhook.apply.ldconfig import fork_ldconfig_ahead
    from gpuhook.sys.prefault import Role

    return ChildAhead(_child_from_payload, priority=priority, close=close,
                      prepare=fork_ldconfig_ahead if ldconfig_ahead else None,
                      learned=(learned, Role.APPLY_CHILD) if learned is not None else None,
                      hint=_read_image_libraries)


def hint_rootfs(ahead: ChildForkedAhead, container: ContainerRef, dirs: tuple[str, ...], ldconfig: HostLdconfig,
                ) -> None:
    """gpuhookd, as a start begins: the apply child forked ahead is told the container's rootfs, to read the
    image's own libraries while the worker finds the devices and makes the plan (where gpuhook writes the
    cache: the start's cache writer then finds them read). Never fails the start."""
    if ldconfig.profile is None:
        return
    import pickle  # gpuhookd only (preloaded there)

    with contextlib.suppress(OSError):  # a child gone already: the start finds out, and says why
        ahead.child.hint(pickle.dumps((container, dirs, ldconfig.profile)), (ahead.mount_ns_fd, ahead.root_fd))


#: the most a head start on the image's libraries may take (the work waits for it): 300 of them take ~25 ms
_HINT_BUDGET_S = 0.1
#: what this apply child's head start read (``ApplyReport.libraries_read_ahead``)
_read_ahead: int | None = None


def _read_image_libraries(payload: bytes, fds: list[int]) -> None:
    """The apply child's head start (``hint_rootfs``): in the hook's view (*fds*: its mount namespace and root),
    the libraries the cache writer would look at in the rootfs read (``ldelf.known``: by inode, size and
    times; a file the container's view shows differently is just read again), nothing changed; an image with
    so many that ldconfig writes its cache is left alone."""
    import pickle

    global _read_ahead  # noqa: PLW0603 - this child's one head start, for its report
    container, dirs, profile = pickle.loads(payload)
    syscalls.enter_mount_view(*fds)
    root = _open_rootfs(container)  # the directory the hook checked, or ApplyError (the hint is dropped)
    try:
        writer = CacheWriter(RootFs(root), dirs, profile, frozenset(), deadline=time.monotonic() + _HINT_BUDGET_S)
        if writer.library_names() <= MOST_LIBRARIES:
            _read_ahead = writer.read_libraries()
    finally:
        os.close(root)


@contextmanager
def opened_container(pid: int) -> Iterator[int]:
    """A pidfd for the container's init *pid* (which must live in a mount namespace other than ours)
    for the duration of one start; every later step acts through it, never through the number."""
    pidfd = _open_container(pid)
    try:
        yield pidfd
    finally:
        os.close(pidfd)


def grant_device_access(plan: Plan, pid: int) -> Undo | None:
    """Step 1, in the caller's process on the host: the plan's device-cgroup rules; how to take them back."""
    if not plan.cgroup_rules:
        return None
    return cgroups.grant(cgroups.locate_device_cgroup(pid), plan.cgroup_rules)


def start_rootfs_changes(plan: Plan, pidfd: int, container: ContainerRef, *, ldconfig: HostLdconfig,
                         timeout: float, ahead: ChildForkedAhead | None = None) -> PendingChanges:
    """Step 2, started: the plan's nodes, mounts, symlinks, /proc mask and ldconfig, made in a child
    inside the container's mount namespace (*ahead*'s child if given, else a fresh one) while this
    process goes on (with step 1, on another CPU); ``held()`` waits for them. The child undoes its
    own changes when one fails, or when this process dies (or abandons them) before they are kept.
    Raises ApplyError."""
    return _start_child(plan, pidfd, container, ldconfig, timeout, ahead)


def _shared_namespaces(pid: int) -> int:
    """The CLONE_NEW* flags of the network, IPC and UTS namespaces the container shares with us
    (``--net=host`` and the like): ldconfig gets fresh ones of those, the container's own otherwise."""
    shared = 0
    for name, flag in (("net", syscalls.CLONE_NEWNET), ("ipc", syscalls.CLONE_NEWIPC), ("uts", syscalls.CLONE_NEWUTS)):
        try:
            if os.stat(f"/proc/{pid}/ns/{name}").st_ino == os.stat(f"/proc/self/ns/{name}").st_ino:
                shared |= flag
        except OSError:
            shared |= flag  # unreadable: assume the worst, a fresh one costs only time
    return shared


def _open_container(pid: int) -> int:
    """A pidfd for *pid*, which must live in a mount namespace other than ours."""
    try:
        pidfd = os.pidfd_open(pid)
        theirs = os.stat(f"/proc/{pid}/ns/mnt").st_ino
        # The pidfd pins the process we opened; if it died before /proc was read, the pid may now be
        # someone else's, and signalling the pidfd says ESRCH.
        signal.pidfd_send_signal(pidfd, 0)
    except OSError as err:
        raise ApplyError("open container process", f"pid {pid}", errno_=err.errno) from err
    if theirs == os.stat("/proc/self/ns/mnt").st_ino:
        os.close(pidfd)
        raise ApplyError(
            "open container process", f"pid {pid}",
            detail="shares the hook's mount namespace; run gpuhook as a prestart or createRuntime hook",
        )
    return pidfd


@dataclass(frozen=True, slots=True)
class PendingChanges:
    """An apply child at work on the rootfs: ``held()`` waits for its report, after which it holds
    its changes, undoable, until ``commit()`` (and undoes them if this process dies first, or no
    commit comes within the timeout); ``abandon()`` has it undo whatever it made."""

    child: int
    read_fd: int
    channel: _socket.socket
    container: ContainerRef
    timeout: float
    deadline: float

    def held(self) -> RootfsChanges:
        """The child's report, its changes held; raises its ApplyError (it has undone them then)."""
        try:
            report = _collect(self.child, self.read_fd, self.container, self.timeout)
        except BaseException:
            self.channel.close()  # nothing to keep: a child still holding changes undoes them
            raise
        return RootfsChanges(report, str(self.container.rootfs), self.channel, self.deadline)

    def abandon(self) -> None:
        """Have the child undo its changes (it sees its channel close once it has made them), and wait
        until it has exited: nothing of the start is left in the rootfs when this returns."""
        self.channel.close()
        wait_child(self.child, self.read_fd, self.timeout)


def _start_child(plan: Plan, pidfd: int, container: ContainerRef, ldconfig: HostLdconfig, timeout: float,
                 ahead: ChildForkedAhead | None) -> PendingChanges:
    """Fork (or hand the work to) the child that does the namespace work."""
    deadline = time.monotonic() + timeout
    channel: _socket.socket
    if ahead is not None:
        import pickle  # gpuhookd only (preloaded there)

        payload = pickle.dumps((plan, container, ldconfig, timeout))
        child, read_fd, channel = ahead.child.start(payload, (pidfd, ahead.mount_ns_fd, ahead.root_fd))
    else:
        # _socket: the socket module would cost an in-process start its enum and selectors imports
        channel, child_channel = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
        read_fd, write_fd = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - runs in the forked child; exercised by the runc tests
            os.close(read_fd)
            channel.close()
            os._exit(_child_main(plan, pidfd, container, ldconfig, timeout, write_fd, child_channel))
        os.close(write_fd)
        child_channel.close()
    return PendingChanges(child, read_fd, channel, container, timeout, deadline)


def _collect(child: int, read_fd: int, container: ContainerRef, timeout: float) -> ApplyReport:
    """The child's report (its last word before it waits for the commit); raises its ApplyError."""
    result = wait_child(child, read_fd, timeout, await_exit=False)
    if result.timed_out:
        raise ApplyError("apply", str(container.rootfs), detail=f"timed out after {timeout:g} s")
    raw = result.output
    rootfs = container.rootfs
    try:
        report = json.loads(raw) if raw else {"error": ApplyError("apply", str(rootfs), detail="no report").to_dict()}
    except ValueError:
        report = {"error": ApplyError("apply", str(rootfs), detail=f"garbled report {raw[:200]!r}").to_dict()}
    if "error" in report:
        raise error_from_dict(report["error"])
    faults, read, ahead = report.get("page_faults"), report.get("libraries_read"), report.get("libraries_read_ahead")
    return ApplyReport(skipped=tuple(report["skipped"]), notes=tuple(report.get("notes", ())),
                       steps_ms=tuple(report.get("steps_ms", {}).items()),
                       page_faults=faults if isinstance(faults, int) else 0,
                       libraries_read=read if isinstance(read, int) else None,
                       libraries_read_ahead=ahead if isinstance(ahead, int) else None)


def _child_from_payload(payload: bytes, fds: list[int], out_fd: int, ldconfig_ahead: ChildAhead | None,
                        channel: _socket.socket) -> int:
    """A child forked ahead, now given its work: (plan, container, ldconfig, timeout) pickled by the
    worker that forked it (same code, same trust), and fds: pidfd, the hook's mount namespace, root."""
    import pickle

    plan, container, ldconfig, timeout = pickle.loads(payload)
    pidfd, mount_ns_fd, root_fd = fds
    return _child_main(plan, pidfd, container, ldconfig, timeout, out_fd, channel, view=(mount_ns_fd, root_fd),
                       ldconfig_ahead=ldconfig_ahead)


def _child_main(
    plan: Plan, pidfd: int, container: ContainerRef, ldconfig: HostLdconfig, timeout: float, out_fd: int,
    channel: _socket.socket, view: tuple[int, int] | None = None, ldconfig_ahead: ChildAhead | None = None,
) -> int:
    """Body of the forked child; returns its exit status after writing the JSON report and either
    keeping its changes (the parent's commit on *channel*) or undoing them.

    *view*: the hook's mount namespace and root to enter first, and *ldconfig_ahead* the ldconfig
    child it forked ahead (a child forked ahead by gpuhookd).
    """
    deadline = time.monotonic() + timeout
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fs: RootFs | None = None
    try:
        process.prctl(process.PR_SET_DUMPABLE, 0)  # no ptrace or /proc/<pid>/mem access from the container
        # Never die with the parent (a child forked ahead was set to): a hook killed by its runtime
        # must not take along the only process that can undo what was done in the container.
        process.prctl(process.PR_SET_PDEATHSIG, 0)
        if view is not None:
            syscalls.enter_mount_view(*view)
            for fd in view:
                os.close(fd)
        steps: dict[str, float] = {}
        notes: list[str] = []
        fs, skipped, libraries_read = _apply_in_container(plan, pidfd, container, ldconfig, timeout, ldconfig_ahead,
                                                          channel.fileno(), steps, notes)
        report: dict[str, object] = {"skipped": skipped, "notes": notes, "steps_ms": steps,
                                     "page_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
                                     "libraries_read": libraries_read, "libraries_read_ahead": _read_ahead}
        status = 0
    except ApplyError as err:
        report = {"error": err.to_dict()}
        status = 1
    except BaseException as err:  # noqa: BLE001 - the child must always report, never unwind into the hook
        detail = f"{type(err).__name__}: {err}"
        report = {"error": ApplyError("apply", str(container.rootfs), detail=detail).to_dict()}
        status = 2
    with contextlib.suppress(OSError):  # EPIPE: the parent has gone, and the changes go below
        os.write(out_fd, json.dumps(report).encode())
    os.close(out_fd)  # our report's end: the parent goes on
    if ldconfig_ahead is not None:
        ldconfig_ahead.cancel()  # not needed after all (a no-op once started); reaped off the start's path
    if fs is not None and not _hold(fs, channel, deadline):
        status = 3
    channel.close()
    return status


def _hold(fs: RootFs, channel: _socket.socket, deadline: float) -> bool:
    """Wait for the parent's commit: keep the changes and say so (True), or undo them all when the
    channel closes first (the parent died) or the deadline passes (False)."""
    try:
        channel.settimeout(max(deadline - time.monotonic(), 0.0))
        committed = channel.recv(1) == _COMMIT
    except OSError:  # TimeoutError included
        committed = False
    if committed:
        # Kept from here on (nothing below undoes a change): the parent hears it first, and goes on while
        # the files set aside are dropped.
        with contextlib.suppress(OSError):
            channel.send(_KEPT)
        fs.commit()
        return True
    if leftovers := fs.rollback():
        # Nobody is left to report to but our stderr (the runtime's log, or gpuhookd's journal).
        with contextlib.suppress(OSError):
            os.write(2, f"gpuhook: abandoned start; could not undo: {'; '.join(leftovers)}\n".encode())
    return False


def _apply_in_container(
    plan: Plan, pidfd: int, container: ContainerRef, ldconfig: HostLdconfig, timeout: float,
    ldconfig_ahead: ChildAhead | None, abort_fd: int, steps: dict[str, float], notes: list[str],
) -> tuple[RootFs, list[str], int | None]:
    """Open host sources, enter the container, make every change; undo all on failure. *abort_fd*:
    the channel to the parent, whose closing stops a running ldconfig; *steps*: filled with each
    step's milliseconds; *notes*: filled with what was left as the image has it (no problem). Returns the
    rootfs, what was skipped and how many libraries gpuhook's cache writer read (None: it did not write)."""
    clock = [time.monotonic()]

    def done(step: str) -> None:
        now = time.monotonic()
        steps[step] = round((now - clock[0]) * 1000, 3)
        clock[0] = now

    os.umask(0)
    trees = [_host_tree(m) for m in plan.mounts]
    proc_binds = (*plan.proc_driver.gpu_dirs, *plan.proc_driver.cap_files) if plan.proc_driver else ()
    proc_trees = [_host_tree(BindMount(source=host_path, target="")) for host_path, _ in proc_binds]
    native = ldconfig.profile
    # Opened even where gpuhook writes the cache: an image with hundreds of libraries gets ldconfig.
    ldconfig_fd = open_ldconfig(ldconfig.path) if plan.ldconfig else None
    shared = _shared_namespaces(container.pid)  # read in the hook's view, before entering the container
    syscalls.setns(pidfd, syscalls.CLONE_NEWNS)
    fs = RootFs(_open_rootfs(container))
    skipped: list[str] = []
    done("open")
    try:
        for node in plan.devices:
            with _step("mknod", node.path):
                fs.mknod(node.path, node.major, node.minor, node.mode)
        done("nodes")
        for mount, tree in zip(plan.mounts, trees, strict=True):
            with _step("mount", mount.target):
                target = fs.directory(mount.target) if mount.directory else fs.mount_target(mount.target)
                fs.attach(tree, target, mount.target)
        done("mounts")
        for link in plan.symlinks:
            with _step("symlink", link.path):
                if not fs.symlink(link.path, link.target):
                    notes.append(f"{link.path}: already exists in the image")
        done("symlinks")
        if plan.proc_driver is not None:
            with _step("mount tmpfs", plan.proc_driver.target):
                if not _mask_proc_driver(fs, plan.proc_driver, proc_trees):
                    skipped.append(f"{plan.proc_driver.target}: {_NO_PROC_DRIVER}")
        done("proc")
        dirs = _compat_first(fs, plan, notes)
        # At most half the budget, so that a start stuck here (an image too large, or changed from outside
        # while it is read) fails inside this child, and rollback still runs.
        budget = min(timeout / 2, LDCONFIG_DEADLINE_S)
        writer = _cache_writer(fs, dirs, native, budget, notes) if dirs and native is not None else None
        writers: list[tuple[Callable[[], object], bool]] = [(writer.write, True)] if writer is not None else []
        if dirs and ldconfig_fd is not None:
            writers.append((lambda: run_ldconfig(
                ldconfig_fd, fs.root_fd, dirs, pidfd=pidfd, fresh=shared, timeout=budget, ahead=ldconfig_ahead,
                abort_fd=abort_fd), False))
        _write_checked_ldcache(fs, plan, writers, skipped)
        done("ldconfig")
    except BaseException as err:
        leftovers = fs.rollback()
        if leftovers and isinstance(err, ApplyError):
            err.detail = f"{err.detail or 'failed'}; could not undo: {'; '.join(leftovers)}"
        raise
    return fs, skipped, writer.libraries_read if writer is not None else None


def _cache_writer(fs: RootFs, dirs: tuple[str, ...], native: LdconfigProfile, budget: float,
                  notes: list[str]) -> CacheWriter | None:
    """gpuhook's writer of the container's cache, its directories found (nothing changed yet); None (and
    a note) where the image has so many libraries that the sandboxed ldconfig is the quicker writer."""
    with _step("ldconfig", LD_SO_CACHE):
        writer = CacheWriter(fs, dirs, native, hidden_devices(fs), deadline=time.monotonic() + budget)
        if writer.library_names() <= MOST_LIBRARIES:
            return writer
    notes.append(f"{LD_SO_CACHE}: over {MOST_LIBRARIES} libraries to scan: the sandboxed ldconfig wrote it")
    return None


def _write_checked_ldcache(fs: RootFs, plan: Plan, writers: Sequence[tuple[Callable[[], object], bool]],
                           skipped: list[str]) -> None:
    """The container's cache by the first of *writers* (each a writer and whether it is gpuhook's own) whose
    cache leads from a SONAME to each library the plan mounts where ldconfig looks; the next one where it
    does not (said in *skipped*). An ApplyError where even the last leaves one out: a start never reports
    success with a cache that cannot load the driver."""
    missing: list[str] = []
    for write, native in writers:
        _replace_ldcache(fs, plan, write, native=native)
        with _step("ldconfig", LD_SO_CACHE):
            missing = _uncached(fs, plan)
        if not missing:
            return
        if native and len(writers) > 1:
            skipped.append(f"{LD_SO_CACHE}: gpuhook's cache lacked {_some(missing)}; the sandboxed ldconfig "
                           "rewrote it")
    if missing:
        raise ApplyError("ldconfig", LD_SO_CACHE, detail=(
            f"lacks {_some(missing)} under its SONAME (libX.so.N) after ldconfig rebuilt it, so the container "
            "could not load the driver; something in the image is in the way: a file, not a symlink, at that "
            "SONAME (a stub copied into the image), a read-only library directory, or one that leads under "
            "/dev, /proc or /sys. Fix the image"))


def _some(paths: Sequence[str], most: int = 3) -> str:
    """The first *most* of *paths*, and how many more."""
    shown = ", ".join(paths[:most])
    return shown if len(paths) <= most else f"{shown} and {len(paths) - most} more"


def _uncached(fs: RootFs, plan: Plan) -> list[str]:
    """The libraries the plan mounts in ldconfig's directories that no entry of the written cache leads to
    from a SONAME of theirs (``libX.so.*``: the link ldconfig makes beside the library, or the library
    itself), as container paths."""
    wanted = _library_dirs(plan, plan.ldconfig.dirs if plan.ldconfig is not None else ())
    if not wanted:
        return []
    cached: dict[tuple[str, str], list[str]] = {}  # (directory, libX.so.): the names cached there
    try:
        for entry in parse_ldcache(_read_ldcache(fs)):
            directory, _, name = entry.value.rpartition("/")
            if name == entry.key and (directory or "/") in wanted and (m := _LIBRARY.fullmatch(name)) is not None:
                cached.setdefault((directory or "/", m[1]), []).append(name)
    except LdCacheFormatError:
        pass  # unreadable: it caches nothing
    missing = []
    for directory, libraries in wanted.items():
        dir_fd = fs.open(directory, os.O_PATH | os.O_DIRECTORY)
        try:
            missing += [f"{directory}/{library}" for library, prefix in libraries if not any(
                _leads_to(fs, dir_fd, directory, n, library) for n in cached.get((directory, prefix), ()))]
        finally:
            os.close(dir_fd)
    return missing


def _leads_to(fs: RootFs, dir_fd: int, directory: str, name: str, library: str) -> bool:
    """Whether *name* in *directory* (*dir_fd*) leads to the mounted *library* beside it: it is that library,
    or a symlink to its name (what ldconfig makes: one readlink), or another way there (resolved in the root)."""
    if name == library:
        return True
    try:
        if os.readlink(name, dir_fd=dir_fd) == library:
            return True
    except OSError:
        return False  # absent, or a file of the image's own: not the mounted library
    mounted = _identity(fs, f"{directory}/{library}")
    return mounted is not None and _identity(fs, f"{directory}/{name}") == mounted


def _read_ldcache(fs: RootFs) -> bytes:
    """The container's ld.so.cache as just written (a regular file; else no data)."""
    fd = fs.try_open(LD_SO_CACHE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if fd is None:
        return b""
    try:
        st = os.fstat(fd)
        return os.read(fd, min(st.st_size, _MAX_LDCACHE)) if stat.S_ISREG(st.st_mode) else b""
    finally:
        os.close(fd)


def _identity(fs: RootFs, path: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of what *path* leads to inside the root, None where nothing is there."""
    try:
        fd = fs.open(path)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        return st.st_dev, st.st_ino
    finally:
        os.close(fd)


def _replace_ldcache(fs: RootFs, plan: Plan, write: Callable[[], object], *, native: bool) -> None:
    """The container's ld.so.cache replaced by *write* (gpuhook's own, *native*, or the sandboxed
    ldconfig): an undo puts the image's cache and links back."""
    with _step("save", LD_SO_CACHE):
        # The cache is replaced through a temporary beside it: an undo puts the image's back.
        fs.save_aside(LD_SO_CACHE)
        fs.save_aside(LD_SO_CACHE + "~")
        if not native:  # ldwrite journals each link it changes; ldconfig's are found afterwards
            for directory, libraries in _library_dirs(plan).items():
                fs.watch_links(directory, tuple(sorted({prefix for _, prefix in libraries})))
    with _step("ldconfig", LD_SO_CACHE):
        write()


_LIBRARY = re.compile(r"(lib[^/]*\.so\.)[0-9][0-9.]*")


def _library_dirs(plan: Plan, only: Sequence[str] | None = None) -> dict[str, list[tuple[str, str]]]:
    """Where the plan mounts libraries (only in the directories *only*, if given), and each library's name and
    ``libX.so.`` prefix: ldconfig links their SONAMEs there."""
    found: dict[str, list[tuple[str, str]]] = {}
    for mount in plan.mounts:
        directory, _, name = mount.target.rpartition("/")
        if (m := _LIBRARY.fullmatch(name)) is not None and (only is None or (directory or "/") in only):
            found.setdefault(directory or "/", []).append((name, m[1]))
    return found


def _compat_first(fs: RootFs, plan: Plan, notes: list[str]) -> tuple[str, ...]:
    """ldconfig's directories: the image's compat directory first when it applies; when it does not,
    the configuration an earlier start wrote for it (before a host driver upgrade) is taken back.
    An image whose compat libraries are not newer than the host's is the usual case, a note."""
    dirs = plan.ldconfig.dirs if plan.ldconfig is not None else ()
    if plan.cuda_compat is not None:
        with _step("cuda compat", plan.cuda_compat.directory):
            use, note = _cuda_compat(fs, plan.cuda_compat)
        if use:
            return (plan.cuda_compat.directory, *dirs)
        if note:
            notes.append(note)
    with _step("cuda compat", COMPAT_CONF):
        fs.remove_if(COMPAT_CONF, _COMPAT_CONF_MAX, lambda text: _COMPAT_CONF_OURS.fullmatch(text) is not None)
    return dirs


@contextmanager
def _step(step: str, path: str) -> Iterator[None]:
    """Name the step and container path in any OS error (an image can make any call fail)."""
    try:
        yield
    except OSError as err:
        raise ApplyError(step, path, errno_=err.errno) from err


def _open_rootfs(container: ContainerRef) -> int:
    """The rootfs as the container's namespace shows it; it must be the directory the hook checked."""
    try:
        fd = os.open(container.rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise ApplyError("open rootfs", str(container.rootfs), errno_=err.errno) from err
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != container.rootfs_id:
        os.close(fd)
        raise ApplyError("open rootfs", str(container.rootfs),
                         detail="in the container's mount namespace this path is not the bundle's rootfs")
    return fd


_COMPAT_LIB = re.compile(r"libcuda\.so\.([0-9]{1,4})\.[0-9.]{1,20}")
COMPAT_CONF = "/etc/ld.so.conf.d/00-gpuhook-cuda-compat.conf"
LD_SO_CACHE = "/etc/ld.so.cache"
#: far past any image's cache (ldconfig writes some 100 bytes a library)
_MAX_LDCACHE = 64 << 20
#: what gpuhook writes at COMPAT_CONF: one compat directory (CUDA_COMPAT_DIR or a versioned one)
_COMPAT_CONF_OURS = re.compile(rb"/usr/local/cuda[A-Za-z0-9._-]{0,64}/compat\n?")
_COMPAT_CONF_MAX = 128


def _cuda_compat(fs: RootFs, compat: CudaCompat) -> tuple[bool, str]:
    """Put the image's compat directory first if it holds a libcuda newer than the host's; (used, note).

    Most images have no compat directory: that is no news, so no note (it was a warning on every start)."""
    fd = fs.try_open(compat.directory, os.O_RDONLY | os.O_DIRECTORY)
    if fd is None:
        return False, ""
    try:
        names = os.listdir(fd)  # names only: nothing in the image is read or loaded
    finally:
        os.close(fd)
    majors = [int(m[1]) for name in names if (m := _COMPAT_LIB.fullmatch(name))]
    if not majors or max(majors) <= compat.host_major:
        found = f"libcuda {max(majors)}.x" if majors else "no libcuda.so.<version>"
        return False, f"{compat.directory}: {found}, not newer than the host driver {compat.host_major}.x"
    fs.write_file(COMPAT_CONF, f"{compat.directory}\n".encode())
    return True, ""


def _host_tree(mount: BindMount) -> int:
    """A detached, read-only clone of a host file or directory (made in the host namespace)."""
    flags = syscalls.OPEN_TREE_CLONE | syscalls.OPEN_TREE_CLOEXEC | syscalls.AT_SYMLINK_NOFOLLOW
    try:
        fd = syscalls.open_tree(-100, mount.source, flags)  # AT_FDCWD
        attrs = (0 if mount.writable else syscalls.MOUNT_ATTR_RDONLY) | syscalls.MOUNT_ATTR_NOSUID \
            | syscalls.MOUNT_ATTR_NODEV
        syscalls.mount_setattr(fd, attrs | (syscalls.MOUNT_ATTR_NOEXEC if mount.noexec else 0), what=mount.source)
    except OSError as err:
        raise ApplyError("open host file", mount.source, errno_=err.errno) from err
    return fd


def _mask_proc_driver(fs: RootFs, proc: ProcDriverMount, trees: list[int]) -> bool:
    """Mount the filled, read-only tmpfs over /proc/driver/nvidia; False if there is no such dir.

    *trees* are the detached host trees for ``proc.gpu_dirs`` then ``proc.cap_files``, in order.
    """
    target = fs.try_open(proc.target, os.O_PATH | os.O_DIRECTORY)
    if target is None:
        return False
    attrs = syscalls.MOUNT_ATTR_NOSUID | syscalls.MOUNT_ATTR_NODEV | syscalls.MOUNT_ATTR_NOEXEC
    binds = [(f"gpus/{name}", True) for _, name in proc.gpu_dirs] + [(rel, False) for _, rel in proc.cap_files]
    try:
        tmp = syscalls.fsmount_tmpfs({"mode": "0555", "size": "1m"}, attrs)
        # Fill it while it is still detached: nothing in the container can see or race it.
        for name, text in proc.files:
            fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o444, dir_fd=tmp)
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
        os.mkdir("gpus", 0o555, dir_fd=tmp)
        for rel, is_dir in binds:  # mount points for the host's per-GPU dirs and MIG capability files
            _make_path(tmp, rel, is_dir)
        syscalls.mount_setattr(tmp, syscalls.MOUNT_ATTR_RDONLY | attrs, what=proc.target)
    except OSError as err:
        raise ApplyError("mount tmpfs", proc.target, errno_=err.errno) from err
    fs.attach(tmp, target, proc.target)
    for (rel, _), tree in zip(binds, trees, strict=True):
        path = f"{proc.target}/{rel}"
        fs.attach(tree, fs.open(path, os.O_PATH | os.O_NOFOLLOW), path)
    return True


def _make_path(dir_fd: int, rel: str, is_dir: bool) -> None:
    """Create *rel* (and its parents) under the detached tmpfs at *dir_fd*: a dir or an empty file."""
    parts = rel.split("/")
    for depth in range(1, len(parts)):
        with contextlib.suppress(FileExistsError):
            os.mkdir("/".join(parts[:depth]), 0o555, dir_fd=dir_fd)
    if is_dir:
        os.mkdir(rel, 0o555, dir_fd=dir_fd)
    else:
        os.close(os.open(rel, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o444, dir_fd=dir_fd))

"""Run real containers with runc and crun, and observe the host around them.

Facts this module is built on (``/work/shared/reference/runtime-lab.md``, measured on these hosts):

* runc 1.1.5 runs a bundle directly: ``runc run --bundle B ID`` (about 23 ms).
* crun 1.8.1 refuses this host's cgroup v1/v2 hybrid ("cgroups in hybrid mode not supported, drop
  all controllers from cgroupv2") because cgroup2 at ``/sys/fs/cgroup/unified`` carries hugetlb.
  It runs once ``/sys/fs/cgroup/unified`` is unmounted in a *private* mount namespace, which
  leaves the host untouched; ``crun delete`` needs the same view to find the cgroups again.
* Hooks get exactly ``hook.env`` (not even PATH) and the state JSON on stdin; a failing prestart
  hook aborts create. runc then puts the hook's stdout/stderr into its own error message; crun
  1.8.1 discards them unless the ``run.oci.hooks.std{out,err}`` annotations name a file.
* The container init runs in its own session (both engines call setsid), so killing the engine's
  process group does not reach it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

__all__ = [
    "CRUN_HOOK_OUTPUT_ANNOTATIONS",
    "DEFAULT_CAPABILITIES",
    "DEFAULT_PATH",
    "Engine",
    "MissingTool",
    "MountRow",
    "RunResult",
    "default_spec",
    "fs_relative",
    "gpuhook_could_have_made",
    "host_mounts",
    "install_hint",
    "leftover_cgroups",
    "read_mounts",
    "require_tool",
    "run_container",
    "tree_snapshot",
    "unique_id",
    "write_bundle",
]

#: "runc-cgroup2" is runc in cgroup v2 mode: cgroup2 mounted over /sys/fs/cgroup in a private mount
#: namespace (runtime-lab.md §1), so runc programs device access with eBPF instead of devices.allow.
Engine = Literal["runc", "crun", "runc-cgroup2"]

DEFAULT_PATH: Final = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# `runc spec`'s capability set; tests that mknod must add CAP_MKNOD explicitly.
DEFAULT_CAPABILITIES: Final = ("CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE")

# crun 1.8.1 runs hooks with stdout/stderr on /dev/null (runc folds them into its error message).
# These annotations (crun(1), "run.oci.hooks.stderr") make crun append them to its own stderr, so
# a failing hook explains itself under both engines; runc ignores them. Side effect: under crun a
# *successful* hook's output shows up in RunResult.stderr too.
CRUN_HOOK_OUTPUT_ANNOTATIONS: Final = {
    "run.oci.hooks.stdout": "/dev/stderr",
    "run.oci.hooks.stderr": "/dev/stderr",
}

# Where each engine keeps container state when run as root with its default --root.
_STATE_ROOT: Final[dict[str, Path]] = {
    "runc": Path("/run/runc"), "crun": Path("/run/crun"), "runc-cgroup2": Path("/run/runc"),
}
_INSTALL: Final = {
    "runc": "apt-get install -y runc",
    "crun": "apt-get install -y crun",
    "unshare": "apt-get install -y util-linux",
    "sh": "apt-get install -y dash",
    "gcc": "apt-get install -y gcc libc6-dev",
    "busybox": "apt-get install -y busybox-static",
    "ldconfig": "apt-get install -y libc-bin",
    "libc6": "apt-get install -y libc6",
}
# Root's PATH may lack the sbin dirs (runc lives in /usr/sbin); search them too.
_SEARCH_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Run "$@" with cgroup2 unmounted from a private mount ns: crun's hybrid-mode workaround.
_CRUN_WRAPPER: Final = 'umount /sys/fs/cgroup/unified 2>/dev/null; exec "$@"'
_CGROUP2_WRAPPER: Final = 'mount -t cgroup2 cgroup2 /sys/fs/cgroup && exec "$@"'
_DELETE_TIMEOUT_S: Final = 15.0
# How long a killed container's engine gets to notice, reap it and clean up by itself.
_GRACE_S: Final = 5.0
_CGROUP_ROOT: Final = Path("/sys/fs/cgroup")
# Engines put containers at most a few levels below the caller's cgroup (runc nests memory under
# it); bounding the walk keeps it cheap on hosts with large systemd trees.
_CGROUP_WALK_DEPTH: Final = 6
_ids = itertools.count()


class MissingTool(RuntimeError):  # noqa: N818 - read as "raise MissingTool(...)": the name says what happened
    """A host executable the rig needs is not installed; the message says how to install it."""


@dataclass(frozen=True, slots=True)
class RunResult:
    """Outcome of one foreground container run (the engine's exit status and its output)."""

    returncode: int
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool = False


# --- tools and ids ----------------------------------------------------------------------------


def require_tool(name: str) -> str:
    """Return the absolute path of executable ``name`` or raise MissingTool with an install hint."""
    found = shutil.which(name, path=os.environ.get("PATH", "") + os.pathsep + _SEARCH_PATH)
    if found is None:
        raise MissingTool(f"required tool {name!r} is not installed; fix: {install_hint(name)}")
    return found


def install_hint(tool: str) -> str:
    """The Debian command that installs ``tool`` (for error messages)."""
    return _INSTALL.get(tool, f"install the package that provides {tool!r}")


def unique_id(prefix: str = "rig") -> str:
    """Return a container id unique across calls and concurrent test processes."""
    return f"{prefix}-{os.getpid()}-{next(_ids)}-{secrets.token_hex(3)}"


# --- bundles ----------------------------------------------------------------------------------


def default_spec(
    rootfs: str,
    args: list[str],
    env: list[str],
    *,
    hooks: dict[str, Any] | None = None,
    readonly: bool = False,
    capabilities: list[str] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Return the config.json that ``runc spec`` writes, made non-terminal and parameterised.

    ``annotations`` defaults to ``CRUN_HOOK_OUTPUT_ANNOTATIONS``; pass ``{}`` to get crun's
    production behaviour of discarding hook output.
    """
    caps = list(DEFAULT_CAPABILITIES if capabilities is None else capabilities)
    if not any(e.startswith("PATH=") for e in env):
        env = [DEFAULT_PATH, *env]
    spec: dict[str, Any] = {
        "ociVersion": "1.0.2-dev",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": list(args),
            "env": list(env),
            "cwd": "/",
            "capabilities": {k: list(caps) for k in ("bounding", "effective", "permitted", "ambient")},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
            "noNewPrivileges": True,
        },
        "root": {"path": rootfs, "readonly": readonly},
        "hostname": "runc",
        "mounts": _default_mounts(),
        "linux": {
            # Deny-all as in `runc spec`; runc and crun then add their built-in defaults
            # (null, zero, full, tty, urandom, random, ptmx, pts, `c *:* m`, `b *:* m`).
            "resources": {"devices": [{"allow": False, "access": "rwm"}]},
            "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
            "maskedPaths": [
                "/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
                "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/sys/firmware", "/proc/scsi",
            ],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
        },
    }
    if hooks is not None:
        spec["hooks"] = hooks
    spec["annotations"] = dict(CRUN_HOOK_OUTPUT_ANNOTATIONS if annotations is None else annotations)
    return spec


def _default_mounts() -> list[dict[str, Any]]:
    """The mount list of ``runc spec`` (proc, /dev tmpfs, devpts, shm, mqueue, sysfs, cgroup)."""
    return [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
         "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs",
         "options": ["nosuid", "noexec", "nodev", "ro"]},
        {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
         "options": ["nosuid", "noexec", "nodev", "relatime", "ro"]},
    ]


def write_bundle(dir: Path, spec: dict[str, Any]) -> Path:
    """Write ``spec`` as ``dir/config.json`` (creating ``dir``) and return the bundle dir."""
    bundle = Path(dir)
    bundle.mkdir(parents=True, exist_ok=True)
    (bundle / "config.json").write_text(json.dumps(spec, indent=2) + "\n")
    return bundle


# --- running ----------------------------------------------------------------------------------


def run_container(engine: Engine, bundle: Path, container_id: str, *, timeout: float = 30,
                  wrapper: Path | None = None) -> RunResult:
    """Run the bundle in the foreground with ``engine``, then make sure nothing of it is left.

    *wrapper*: a runc wrapper (gpuhook-runtime) runs the container instead of runc itself (engine "runc" only).
    """
    if wrapper is not None and engine != "runc":
        raise ValueError(f"a runc wrapper runs with engine runc, not {engine!r}")
    argv = ([str(wrapper), "run", "--bundle", str(bundle), container_id] if wrapper is not None
            else _engine_argv(engine, "run", "--bundle", str(bundle), container_id))
    start = time.monotonic()
    # A new session lets a timeout kill the engine and anything it forked (wrapper, hooks).
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        out, err = _abort(engine, container_id, proc)
        err += f"\n[rig] {engine} killed after {timeout:g}s timeout\n".encode()
    except BaseException:
        _abort(engine, container_id, proc)
        raise
    finally:
        _cleanup(engine, container_id)
    return RunResult(proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"),
                     time.monotonic() - start, timed_out)


def _abort(engine: Engine, container_id: str, proc: subprocess.Popen[bytes]) -> tuple[bytes, bytes]:
    """Stop a hung run and collect its output: kill the container, else the engine's process group."""
    # `kill ID KILL` lets the foreground engine reap its container and tear it down itself; killing
    # the engine instead orphans the container init (it runs in its own session, out of reach of
    # killpg), leaving a zombie for PID 1 and state that only `delete -f` removes.
    killed = subprocess.run(_engine_argv(engine, "kill", container_id, "KILL"), stdin=subprocess.DEVNULL,
                            capture_output=True, timeout=_DELETE_TIMEOUT_S, check=False)
    if killed.returncode == 0:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return proc.communicate(timeout=_GRACE_S)
    # Not started yet (a hook hangs) or the engine is stuck: kill the engine and its hooks, then
    # `delete -f` whatever container exists so that it releases our stdout/stderr pipes.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    _cleanup(engine, container_id)
    try:
        return proc.communicate(timeout=_DELETE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return b"", b"[rig] output lost: a process outside the engine still held its pipes\n"


def _engine_argv(engine: Engine, *args: str) -> list[str]:
    """The argv that runs ``engine args...`` on this host (crun goes through its mount-ns wrapper)."""
    if engine == "runc":
        return [require_tool("runc"), *args]
    if engine == "crun":
        # unshare(1) makes the new mount ns private by default, so the umount stays in it.
        return [require_tool("unshare"), "--mount", "--propagation", "private", "--",
                require_tool("sh"), "-c", _CRUN_WRAPPER, "crun", require_tool("crun"), *args]
    if engine == "runc-cgroup2":
        return [require_tool("unshare"), "--mount", "--propagation", "private", "--",
                require_tool("sh"), "-c", _CGROUP2_WRAPPER, "runc", require_tool("runc"), *args]
    raise ValueError(f"unknown engine {engine!r}")


def _cleanup(engine: Engine, container_id: str) -> None:
    """Force-delete the container if the engine left state behind; raise if that fails."""
    # A foreground `run` that exits normally destroys its own container; only a killed or
    # crashed engine leaves state, so skip the extra engine start (~10 ms) in the common case.
    state = _STATE_ROOT[engine] / container_id
    if state.exists():
        proc = subprocess.run(_engine_argv(engine, "delete", "-f", container_id), stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=_DELETE_TIMEOUT_S, check=False)
        if state.exists():
            raise RuntimeError(f"{engine} delete -f {container_id} left {state}: {proc.stderr.strip()}")
    # An engine killed before its state was complete (e.g. while a prestart hook hung) leaves
    # cgroups that `delete` cannot find, possibly still holding its `init` child: kill their
    # tasks and rmdir them, deepest first, until the kernel lets go of the exiting tasks.
    deadline = time.monotonic() + _DELETE_TIMEOUT_S
    while left := leftover_cgroups(container_id):
        if time.monotonic() > deadline:
            raise RuntimeError(f"container {container_id} left cgroups behind: {[str(p) for p in left]}")
        for cgroup in sorted(left, key=lambda p: len(p.parts), reverse=True):
            _kill_tasks(cgroup)
            with contextlib.suppress(OSError):
                cgroup.rmdir()
        time.sleep(0.01)


def _kill_tasks(cgroup: Path) -> None:
    """SIGKILL every process listed in ``cgroup``'s cgroup.procs."""
    with contextlib.suppress(OSError):
        for pid in (cgroup / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


# --- host observation -------------------------------------------------------------------------

#: The superblock option every tmpfs gpuhook makes carries (fsmount with mode 0555: the
#: /proc/driver/nvidia mask, ldconfig's hidden dirs and covered files), and their sizes.
_GPUHOOK_TMPFS_MODE: Final = "mode=555"
_GPUHOOK_TMPFS_SIZES: Final = frozenset({"size=1024k", "size=4k"})


@dataclass(frozen=True, slots=True)
class MountRow:
    """One line of a mountinfo file, the fields the mount oracle reads (escapes undone)."""

    #: "major:minor" of the mounted filesystem
    device: str
    #: the directory of that filesystem the mount shows (a bind mount's source, relative to it)
    root: str
    point: str
    fstype: str
    source: str
    #: the superblock's options (``size=4k``, ``mode=555`` ...)
    options: frozenset[str]

    @property
    def line(self) -> str:
        """The row as the oracle compares it: ``"<mount point> <fstype> <source> <root>"`` (ids ignored)."""
        return f"{self.point} {self.fstype} {self.source} {self.root}"


def _unescape(field: str) -> str:
    """Undo mountinfo's octal escapes (``\\040`` for a space, ``\\134`` for a backslash ...)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def read_mounts(pid: int | str = "self") -> list[MountRow]:
    """The mount table of *pid*'s mount namespace (``/proc/<pid>/mountinfo``), in mount order."""
    rows = []
    with open(f"/proc/{pid}/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            fields, tail = pre.split(), post.split()
            rows.append(MountRow(device=fields[2], root=_unescape(fields[3]), point=_unescape(fields[4]),
                                 fstype=tail[0], source=_unescape(tail[1]),
                                 options=frozenset(tail[2].split(",")) if len(tail) > 2 else frozenset()))
    return rows


def _under(path: str, prefix: str) -> bool:
    """Whether *path* is *prefix* or lies below it."""
    return path == prefix or path.startswith(prefix.rstrip("/") + "/")


def fs_relative(path: Path, mounts: list[MountRow] | None = None) -> tuple[str, str]:
    """(filesystem "major:minor", *path* as a bind mount of it shows it in mountinfo's ``root`` field).

    That is the path relative to the root of the filesystem it lies on, through the topmost mount
    that holds it: ``/tmp/x`` on an ext4 root is ``/tmp/x``, on a tmpfs at ``/tmp`` it is ``/x``.
    """
    text = os.fspath(path)
    best: MountRow | None = None
    for row in read_mounts() if mounts is None else mounts:
        if _under(text, row.point) and (best is None or len(row.point) >= len(best.point)):
            best = row  # the longest point wins; among equal ones the last (topmost) one
    if best is None:
        raise ValueError(f"{text!r} is under no mount of this namespace; expected an absolute path")
    rest = text[len(best.point.rstrip("/")):]
    return best.device, (best.root.rstrip("/") + rest) or "/"


def gpuhook_could_have_made(row: MountRow, points: tuple[str, ...], roots: tuple[tuple[str, str], ...]) -> bool:
    """Whether *row* is a mount gpuhook could have made, given the test's owned *points* (absolute
    paths) and *roots* (the same paths as (device, fs-relative path), see fs_relative).

    gpuhook makes two kinds of mounts: bind mounts of host files (driver libraries, binaries,
    nodes, /proc/driver/nvidia entries, all under the simulated host's root, which the test owns),
    and tmpfs it makes with fsmount (source ``none``, ``mode=555``, 1m or 4k). Wherever it could
    have put one (in a container's rootfs under the test's paths, or anywhere through an escape),
    the bind's root lies under an owned path and the tmpfs has that shape; any other mount (an
    engine's overlay or shm, a netns file, another test run's own mounts) is not gpuhook's.
    """
    if any(_under(row.point, prefix) for prefix in points):
        return True
    if row.fstype == "tmpfs" and row.source == "none" and _GPUHOOK_TMPFS_MODE in row.options \
            and row.options & _GPUHOOK_TMPFS_SIZES:
        return True
    return any(row.device == device and _under(row.root, root) for device, root in roots)


def host_mounts(*owned: Path, pid: int | str = "self") -> frozenset[str]:
    """The mount oracle: the mounts of the host (*pid*'s mount namespace) that gpuhook could have made,
    as ``"<mount point> <fstype> <source> <root>"`` lines, to compare before and after a run.

    *owned* are the paths the test owns (its tmp dir, the simulated host's root, its rootfses): every
    mount at or under them counts, and elsewhere only a mount gpuhook could have made
    (gpuhook_could_have_made), so that what other processes on a busy host mount meanwhile (an
    engine's overlays and netns files, another ``make test`` beside this one) does not fail a test,
    while a mount gpuhook leaked does.
    """
    if not owned:
        raise ValueError("host_mounts() needs the paths the test owns (its tmp dir, the host's root); "
                         "comparing the whole mount table fails whenever another process mounts something")
    mounts = read_mounts(pid)
    real = tuple(os.path.realpath(p) for p in owned)
    roots = tuple(fs_relative(Path(p), mounts) for p in real)
    kept = [row.line for row in mounts if gpuhook_could_have_made(row, real, roots)]
    # Number repeats so that a second identical mount stacked on the first still shows up.
    seen: dict[str, int] = {}
    out: set[str] = set()
    for entry in kept:
        seen[entry] = seen.get(entry, 0) + 1
        out.add(entry if seen[entry] == 1 else f"{entry} #{seen[entry]}")
    return frozenset(out)


def leftover_cgroups(container_id: str, root: Path = _CGROUP_ROOT) -> list[Path]:
    """Cgroup directories under ``root`` whose name contains ``container_id`` (should be none after a run)."""
    found: list[Path] = []
    for dirpath, dirnames, _ in os.walk(root):
        depth = len(Path(dirpath).relative_to(root).parts)
        if depth >= _CGROUP_WALK_DEPTH:
            dirnames.clear()
        found.extend(Path(dirpath, d) for d in dirnames if container_id in d)
    return found


def tree_snapshot(path: Path) -> dict[str, tuple[str, int, int, str | None]]:
    """Map each path under ``path`` to (type, mode, size, symlink target or "major:minor")."""
    root = Path(path)
    snap: dict[str, tuple[str, int, int, str | None]] = {}
    stack = [root]
    while stack:
        current = stack.pop()
        with os.scandir(current) as it:
            for entry in it:
                st = entry.stat(follow_symlinks=False)
                rel = os.path.relpath(entry.path, root)
                snap[rel] = _describe(entry.path, st)
                if entry.is_dir(follow_symlinks=False):
                    stack.append(Path(entry.path))
    return snap


def _describe(path: str, st: os.stat_result) -> tuple[str, int, int, str | None]:
    """One snapshot row; directory sizes are zeroed because they grow without content changes."""
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        return ("l", mode, 0, os.readlink(path))
    if stat.S_ISDIR(st.st_mode):
        return ("d", mode, 0, None)
    if stat.S_ISREG(st.st_mode):
        return ("f", mode, st.st_size, None)
    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        kind = "c" if stat.S_ISCHR(st.st_mode) else "b"
        return (kind, mode, 0, f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}")
    return ("p" if stat.S_ISFIFO(st.st_mode) else "s", mode, 0, None)

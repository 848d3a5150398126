"""The attack rig: hostile bundles run under real runc with gpuhook as the prestart hook, and the oracles.

Every run goes through ``Rig.run``, which checks around it:

* (o2) the test's tmp tree outside every rootfs (host markers, configs, bundles) is identical
  after the run: same entries, types, modes, inode numbers, symlink targets and file hashes;
* (o3) the host mount table is unchanged: every mount under the test's paths (its tmp tree, the
  simulated host's root), and elsewhere every mount gpuhook could have made (``host_mounts``), so
  that what other processes mount meanwhile on a busy host does not count;
* (o4) the run finished under its timeout;
* no cgroup of the container is left (``run_container`` raises otherwise).

``Rig.check_gpu`` adds (o5) and the in-container half of (o3) for started GPU containers: the
container's own ``devices.list`` is runc's defaults plus exactly the expected ``c M:m rw`` rules,
and every mount gpuhook made is at the path it belongs at.
"""

from __future__ import annotations

import ast
import hashlib
import itertools
import json
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml

from integration.engines import (
    RunResult,
    default_spec,
    fs_relative,
    host_mounts,
    run_container,
    unique_id,
    write_bundle,
)
from integration.fakehost import FakeHost
from integration.gpuhookd import Gpuhookd
from integration.rootfs import copy_rootfs

HERE: Final = Path(__file__).resolve().parent
PYTHON: Final = sys.executable
HOOK_ENV: Final = ("PATH=/usr/sbin:/usr/bin:/sbin:/bin",)
LIBS_DIR: Final = "/usr/lib/x86_64-linux-gnu"
HOST_LIB_DIR: Final = "usr/lib/x86_64-linux-gnu"  # where the simulated host keeps its driver libraries
RUN_TIMEOUT_S: Final = 20.0
DEFAULT_CAPS: Final = ("compute", "utility")

# Section markers the container prints around what the oracles read.
_START, _DEVICES, _MOUNTS, _END = "@@start", "@@devices", "@@mounts", "@@end"
#: Probes every GPU node and the two libraries a CUDA program needs.
GPU_PROBE: Final = (
    "devopen /dev/nvidia0 /dev/nvidia1 /dev/nvidia2 /dev/nvidia3 /dev/nvidiactl /dev/nvidia-uvm; "
    "dltest libcuda.so.1 libnvidia-ml.so.1"
)
#: The request most cases make: GPU 0 with the default capabilities.
GPU0: Final = {"NVIDIA_VISIBLE_DEVICES": "0"}

Row = tuple[str, int, int, int, str | None]
_LOGRUS_MSG: Final = re.compile(r'msg="((?:[^"\\]|\\.)*)"')


# --- host observation -----------------------------------------------------------------------------


def _row(path: str, st: os.stat_result) -> Row:
    """(type, mode, inode, size, content hash / link target / rdev) of one entry."""
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        return ("l", mode, st.st_ino, 0, os.readlink(path))
    if stat.S_ISDIR(st.st_mode):
        return ("d", mode, st.st_ino, 0, None)
    if stat.S_ISREG(st.st_mode):
        with open(path, "rb") as handle:
            digest = hashlib.file_digest(handle, "sha256").hexdigest()
        return ("f", mode, st.st_ino, st.st_size, digest)
    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        kind = "c" if stat.S_ISCHR(st.st_mode) else "b"
        return (kind, mode, st.st_ino, 0, f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}")
    return ("p" if stat.S_ISFIFO(st.st_mode) else "s", mode, st.st_ino, 0, None)


def snapshot(root: Path, *, exclude: Iterable[Path] = ()) -> dict[str, Row]:
    """Every entry under *root* (and *root* itself), skipping the *exclude* trees, with content hashes."""
    skip = {os.fspath(p) for p in exclude}
    rows: dict[str, Row] = {".": _row(os.fspath(root), os.lstat(root))}
    stack = [os.fspath(root)]
    while stack:
        current = stack.pop()
        with os.scandir(current) as entries:
            for entry in entries:
                if entry.path in skip:
                    continue
                st = entry.stat(follow_symlinks=False)
                rows[os.path.relpath(entry.path, root)] = _row(entry.path, st)
                if stat.S_ISDIR(st.st_mode):
                    stack.append(entry.path)
    return rows


def diff(before: Mapping[str, Row], after: Mapping[str, Row]) -> list[str]:
    """Human-readable differences between two snapshots."""
    out = [f"new: {k} {after[k]}" for k in sorted(after.keys() - before.keys())]
    out += [f"gone: {k} {before[k]}" for k in sorted(before.keys() - after.keys())]
    out += [f"changed: {k} {before[k]} -> {after[k]}" for k in sorted(before.keys() & after.keys())
            if before[k] != after[k]]
    return out


def _unescape(field: str) -> str:
    """Undo mountinfo's octal escapes (\\040 for a space ...)."""
    return field.encode().decode("unicode_escape") if "\\" in field else field


# --- outcome ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    """One container run: what runc returned and what the container printed."""

    result: RunResult

    @property
    def started(self) -> bool:
        """Whether the container's process ran."""
        return _START in self.result.stdout.split()

    @property
    def stdout(self) -> set[str]:
        """The container's output lines (stripped), as a set."""
        return {line.strip() for line in self.result.stdout.splitlines() if line.strip()}

    def section(self, name: str) -> list[str]:
        """The lines the container printed between the *name* marker and the next marker."""
        lines = self.result.stdout.splitlines()
        if name not in lines:
            return []
        out = []
        for line in lines[lines.index(name) + 1:]:
            if line.startswith("@@"):
                break
            out.append(line)
        return out

    @property
    def hook_error(self) -> str:
        """Everything gpuhook wrote from its ``gpuhook:`` prefix on, as gpuhook wrote it.

        runc folds the hook's stderr into its logrus ``msg="..."``, Go-quoted; undo the quoting so
        that tests can look for values exactly as gpuhook printed them.
        """
        text = self.result.stderr
        for match in _LOGRUS_MSG.finditer(text):
            try:
                decoded = ast.literal_eval(f'"{match[1]}"')
            except (SyntaxError, ValueError):
                continue
            if (at := decoded.find("gpuhook: ")) >= 0:
                return str(decoded[at:])
        at = text.find("gpuhook: ")
        return text[at:] if at >= 0 else ""

    def assert_refused(self, *needles: str) -> None:
        """(o1) runc failed, the container never ran, and gpuhook's message contains every needle."""
        err = self.result.stderr
        assert self.result.returncode != 0, f"expected a refusal, the container ran:\n{self.result.stdout}"
        assert not self.started, self.result.stdout
        assert "Traceback" not in err, err
        assert self.hook_error, f"runc failed but not with a gpuhook message:\n{err}"
        for needle in needles:
            assert needle in self.hook_error, f"{needle!r} not in gpuhook's message:\n{err}"

    def assert_started(self) -> None:
        """The container ran to the end of its script."""
        assert self.result.returncode == 0 and self.started, self.result.stderr
        assert _END in self.result.stdout.split(), self.result.stdout


# --- containers -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Container:
    """One prepared bundle."""

    bundle: Path
    rootfs: Path
    spec: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Via:
    """How a rig's hooks reach gpuhook: the Python hook working in-process (socket ``none``), the
    Python hook handing GPU work to gpuhookd at *socket*, or gpuhook-relay (*relay*) handing the
    whole call to gpuhookd at *socket*."""

    socket: str = "none"
    relay: Path | None = None


IN_PROCESS: Final = Via()


def hook_command(config: Path, stage: str = "prestart", *, via: Via = IN_PROCESS) -> list[str]:
    """The argv that runs gpuhook: ``python -I -m gpuhook --config CONFIG --daemon-socket SOCKET STAGE``
    or ``gpuhook-relay --config CONFIG --daemon-socket SOCKET STAGE`` (see Via).

    ``GPUHOOK_ATTACK_SOURCE=<dir>`` runs the gpuhook package found in *dir* instead (for example an
    older revision from ``git archive``, in-process only), to show which attacks a given revision
    loses; add ``GPUHOOK_ATTACK_DROP_KEYS=key,...`` for config settings that revision does not know.
    """
    source = os.environ.get("GPUHOOK_ATTACK_SOURCE")
    if via.relay is not None:
        return [os.fspath(via.relay), "--config", os.fspath(config), "--daemon-socket", via.socket, stage]
    if not source:
        return [PYTHON, "-I", "-m", "gpuhook", "--config", os.fspath(config), "--daemon-socket", via.socket, stage]
    boot = ("import sys, runpy; "
            "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in getattr(f, '__module__', '')]; "
            f"sys.path.insert(0, {source!r}); runpy.run_module('gpuhook', run_name='__main__')")
    return [PYTHON, "-I", "-c", boot, "--config", os.fspath(config), stage]


def hook_entry(config: Path, *, env: Iterable[str] = HOOK_ENV, wrapper: Iterable[str] = (),
               via: Via = IN_PROCESS) -> dict[str, Any]:
    """gpuhook registered as it should be (absolute path, -I, explicit env), optionally behind *wrapper*."""
    hook = hook_command(config, via=via)
    if wrapper:
        return {"path": PYTHON, "args": [PYTHON, "-I", *wrapper, "--", *hook], "env": list(env)}
    return {"path": hook[0], "args": hook, "env": list(env)}


def _wrap(script: str) -> list[str]:
    """The container's argv: *script* between the markers, then the cgroup and mount listings."""
    body = (
        f"echo {_START}\n{script}\n"
        f"echo {_DEVICES}; cat /sys/fs/cgroup/devices/devices.list\n"
        f"echo {_MOUNTS}; cat /proc/self/mountinfo\n"
        f"echo {_END}\n"
    )
    return ["/bin/sh", "-c", body]


class Rig:
    """Builds hostile bundles in one test's tmp tree and runs them under the oracles."""

    def __init__(self, tmp: Path, host: FakeHost, rootfs_src: Path, default_rules: frozenset[str], *,
                 via: Via = IN_PROCESS) -> None:
        self.tmp = tmp
        #: how this rig's hooks reach gpuhook (in-process, through gpuhookd, through gpuhook-relay)
        self.via = via
        self.host = host
        self.rootfs_src = rootfs_src
        self.default_rules = default_rules
        self.rootfses: list[Path] = []
        self._bundle_ids = itertools.count()
        self._config_ids = itertools.count()
        #: gpuhookd serves only its own config: a case's own config gets a daemon of its own (Rig.config)
        self._daemons: dict[Path, Gpuhookd] = {}
        # Host markers: files and dirs outside every rootfs that an escape would touch.
        self.outside = tmp / "host"
        self.secret = self.outside / "secret"
        self.victim = self.outside / "victim"
        self.hostdev = self.outside / "hostdev"
        for d in (self.outside, self.victim, self.hostdev):
            d.mkdir()
        self.secret.write_text("host secret\n")
        self.secret.chmod(0o600)
        (self.victim / "marker").write_text("host marker\n")
        (self.hostdev / "ptmx").write_text("host ptmx\n")
        (self.hostdev / "nvidia0").write_text("host nvidia0\n")
        #: the config every hook gets unless a test passes another
        self.base_config = self.config() if os.environ.get("GPUHOOK_ATTACK_DROP_KEYS") else host.config_path

    # -- configuration ---------------------------------------------------------------------------

    def config(self, **settings: Any) -> Path:
        """A copy of the simulated host's gpuhook config with *settings* changed."""
        data = yaml.safe_load(self.host.config_path.read_text())
        for key in filter(None, os.environ.get("GPUHOOK_ATTACK_DROP_KEYS", "").split(",")):
            data.pop(key, None)  # settings an older revision (GPUHOOK_ATTACK_SOURCE) does not know
        data.update(settings)
        path = self.tmp / f"config{next(self._config_ids)}.yaml"
        path.write_text(yaml.safe_dump({k: os.fspath(v) if isinstance(v, Path) else v for k, v in data.items()}))
        if self.via.socket != "none":
            # Its socket and journal live outside the test's tmp tree, which the oracles watch.
            self._daemons[path] = Gpuhookd(PYTHON, Path(tempfile.mkdtemp(prefix="gpuhookd-")) / "run", config=path)
        return path

    def _via(self, config: Path) -> Via:
        """How a hook with *config* reaches gpuhook: through that config's own daemon, if it has one."""
        daemon = self._daemons.get(config)
        return self.via if daemon is None else Via(daemon.socket, self.via.relay)

    def stop_daemons(self) -> None:
        """Stop the daemons of this case's own configs; none of their requests may have crashed a worker."""
        for daemon in self._daemons.values():
            journal = daemon.stop()
            shutil.rmtree(Path(daemon.socket).parent.parent, ignore_errors=True)
            assert "request failed" not in journal, journal
        self._daemons.clear()

    # -- bundles -------------------------------------------------------------------------------------

    def container(
        self,
        env: Mapping[str, str] | None = None,
        script: str = "",
        *,
        prepare: Callable[[Path], object] | None = None,
        edit_spec: Callable[[dict[str, Any]], object] | None = None,
        hook: dict[str, Any] | None = None,
        config: Path | None = None,
        dev_tmpfs: bool = True,
        proc: bool = True,
        rootfs_src: Path | None = None,
        readonly: bool = False,
        privileged: bool = False,
        pre_hook: str | None = None,
    ) -> Container:
        """A bundle running *script* with *env*, gpuhook as its prestart hook.

        ``dev_tmpfs=False`` drops runc's /dev tmpfs so the image's own /dev is what the hook sees;
        ``proc=False`` drops the /proc mount likewise. ``pre_hook`` is a shell script run as an
        earlier prestart hook (``$R`` is the rootfs): it changes the rootfs after runc has set it up
        and before gpuhook runs, as a concurrent writer to a shared volume could.
        """
        bundle = self.tmp / f"bundle{next(self._bundle_ids)}"
        bundle.mkdir()
        rootfs = copy_rootfs(rootfs_src or self.rootfs_src, bundle / "rootfs")
        self.rootfses.append(rootfs)
        if prepare is not None:
            prepare(rootfs)
        caps = ["CAP_MKNOD", *(["CAP_SYS_ADMIN"] if privileged else [])]
        spec = default_spec(
            "rootfs", _wrap(script),
            ["PATH=/usr/local/bin:/usr/bin:/bin", *(f"{k}={v}" for k, v in (env or {}).items())],
            hooks={"prestart": [
                *([{"path": "/bin/sh", "args": ["sh", "-ec", pre_hook], "env": [*HOOK_ENV, f"R={rootfs}"]}]
                  if pre_hook else []),
                hook or hook_entry(config or self.base_config, via=self._via(config or self.base_config)),
            ]},
            capabilities=caps, readonly=readonly,
        )
        dropped = ({"/dev", "/dev/pts", "/dev/shm", "/dev/mqueue"} if not dev_tmpfs else set()) | (
            {"/proc"} if not proc else set())
        spec["mounts"] = [m for m in spec["mounts"] if m["destination"] not in dropped]
        if not proc:
            spec["linux"]["maskedPaths"] = []
            spec["linux"]["readonlyPaths"] = []
        if edit_spec is not None:
            edit_spec(spec)
        write_bundle(bundle, spec)
        return Container(bundle=bundle, rootfs=rootfs, spec=spec)

    # -- running -------------------------------------------------------------------------------------

    def host_state(self, watch: Iterable[Path] = ()) -> tuple[dict[str, Row], frozenset[str], list[dict[str, Row]]]:
        """(o2) and (o3) observations: the tmp tree outside every rootfs, host mounts, watched trees."""
        return (snapshot(self.tmp, exclude=self.rootfses), host_mounts(self.tmp, self.host.root),
                [snapshot(p) if p.is_dir() else {".": _row(os.fspath(p), os.lstat(p))} for p in watch])

    def assert_host_unchanged(self, before: tuple[dict[str, Row], frozenset[str], list[dict[str, Row]]],
                              watch: Iterable[Path] = ()) -> None:
        """(o2)+(o3): nothing outside the rootfses changed, and the host mount table is the same."""
        files, mounts, watched = self.host_state(watch)
        assert mounts == before[1], f"host mounts changed: +{sorted(mounts - before[1])} -{sorted(before[1] - mounts)}"
        assert files == before[0], "host files changed:\n" + "\n".join(diff(before[0], files))
        for old, new in zip(before[2], watched, strict=True):
            assert new == old, "watched host tree changed:\n" + "\n".join(diff(old, new))

    def run(self, container: Container, *, timeout: float = RUN_TIMEOUT_S, watch: Iterable[Path] = ()) -> Outcome:
        """Run *container* under runc with (o2), (o3) and (o4) checked around it."""
        watch = list(watch)
        before = self.host_state(watch)
        result = run_container("runc", container.bundle, unique_id("gpuhook-attack"), timeout=timeout)
        leaked = self.kill_leftovers()
        assert not result.timed_out and result.duration_s < timeout, (
            f"(o4) runc took {result.duration_s:.1f}s (limit {timeout:g}s):\n{result.stderr}")
        assert not leaked, f"(o4) processes outlived the run (killed now): {leaked}\n{result.stderr}"
        self.assert_host_unchanged(before, watch)
        return Outcome(result)

    def kill_leftovers(self) -> list[str]:
        """SIGKILL every process whose root or cwd is in this test's tmp tree (a helper the hook left behind)."""
        found = []
        inside = os.fspath(self.tmp) + "/"
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                where = {os.readlink(f"/proc/{pid}/root"), os.readlink(f"/proc/{pid}/cwd")}
                if not any((w + "/").startswith(inside) for w in where):
                    continue
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                os.kill(int(pid), signal.SIGKILL)
            except (PermissionError, FileNotFoundError, ProcessLookupError):
                continue  # gone, or a process we may not inspect (pid 1 here)
            found.append(f"{pid}: {cmdline.strip()}")
        return found

    # -- started GPU containers ----------------------------------------------------------------------

    def expected_rules(self, gpus: Iterable[int], caps: Iterable[str] = DEFAULT_CAPS) -> set[str]:
        """The exact device-cgroup rules gpuhook must add for *gpus* (by index) and *caps*."""
        caps = set(caps)
        rules = {"c 195:255 rw"}
        if "compute" in caps or "all" in caps:
            rules |= {f"c {self.host.uvm_major}:0 rw", f"c {self.host.uvm_major}:1 rw"}
        if "display" in caps or "all" in caps:
            rules.add("c 195:254 rw")
        by_index = {g.index: g for g in self.host.gpus}
        return rules | {f"c 195:{by_index[i].minor} rw" for i in gpus}

    def check_cgroup(self, outcome: Outcome, expected: set[str]) -> None:
        """(o5) the container's devices.list is runc's defaults plus exactly *expected*."""
        listing = [line.strip() for line in outcome.section(_DEVICES) if line.strip()]
        assert listing, f"the container printed no devices.list:\n{outcome.result.stdout}"
        assert len(listing) == len(set(listing)), listing
        added = set(listing) - self.default_rules
        assert self.default_rules <= set(listing), sorted(self.default_rules - set(listing))
        assert added == expected, f"gpuhook added {sorted(added)}, expected {sorted(expected)}"
        for rule in added:
            kind, numbers, access = rule.split()
            assert kind == "c" and "*" not in numbers and set(access) <= {"r", "w"}, rule

    def gpuhook_mounts(self, outcome: Outcome) -> list[tuple[str, str, str]]:
        """(host path, mount point, fstype) of every mount in the container that gpuhook made."""
        _, host_root = fs_relative(self.host.root)
        out = []
        for line in outcome.section(_MOUNTS):
            head, _, tail = line.partition(" - ")
            fields = head.split()
            if len(fields) < 5:
                continue
            root, mountpoint, fstype = _unescape(fields[3]), _unescape(fields[4]), tail.split()[0]
            if root.startswith(host_root + "/"):
                out.append((root[len(host_root) + 1:], mountpoint, fstype))
            elif mountpoint.startswith("/proc/driver/nvidia"):
                out.append(("", mountpoint, fstype))
        return out

    def check_mounts(self, outcome: Outcome, libs_dir: str = LIBS_DIR,
                     aliases: Mapping[str, str] | None = None) -> None:
        """(o3, container side) each gpuhook mount is at its expected path: libraries in *libs_dir*, others mirrored.

        *aliases* maps a path prefix to where the image's own symlinks lead it (merged /usr: /lib/ -> /usr/lib/).
        """
        def resolved(path: str) -> str:
            for prefix, target in (aliases or {}).items():
                if path.startswith(prefix):
                    return target + path[len(prefix):]
            return path

        mounts = self.gpuhook_mounts(outcome)
        assert any(m == f"{libs_dir}/libnvidia-ml.so.{self.host.driver_version}" for _, m, _ in mounts), mounts
        for rel, mountpoint, fstype in mounts:
            if rel == "":
                assert (mountpoint, fstype) == ("/proc/driver/nvidia", "tmpfs"), (mountpoint, fstype)
            elif rel.startswith(HOST_LIB_DIR + "/"):
                assert mountpoint == f"{libs_dir}/{rel.rsplit('/', 1)[1]}", (rel, mountpoint)
            else:
                assert mountpoint == resolved("/" + rel), (rel, mountpoint)

    def check_gpu(self, outcome: Outcome, gpus: Iterable[int], *, caps: Iterable[str] = DEFAULT_CAPS,
                  libs_dir: str = LIBS_DIR, probe: bool = True, aliases: Mapping[str, str] | None = None) -> None:
        """A started container got exactly GPUs *gpus* (o1), their cgroup rules (o5) and well-placed mounts (o3)."""
        outcome.assert_started()
        gpus = list(gpus)
        if probe:
            minors = {g.index: g.minor for g in self.host.gpus}
            expect = {f"/dev/nvidia{minors[i]} ENXIO" for i in gpus} | {
                f"/dev/nvidia{m} ENOENT" for i, m in minors.items() if i not in gpus}
            expect |= {"/dev/nvidiactl ENXIO", "dlopen libcuda.so.1: OK", "dlopen libnvidia-ml.so.1: OK"}
            assert expect <= outcome.stdout, sorted(expect - outcome.stdout)
        self.check_cgroup(outcome, self.expected_rules(gpus, caps))
        self.check_mounts(outcome, libs_dir, aliases)

    def check_no_gpu(self, outcome: Outcome) -> None:
        """A started container that got nothing: no nodes, no gpuhook mounts, runc's cgroup rules only."""
        outcome.assert_started()
        self.check_cgroup(outcome, set())
        assert self.gpuhook_mounts(outcome) == []
        assert not any(line.startswith("/dev/nvidia") and "ENOENT" not in line for line in outcome.stdout)


def plain_spec_rules(tmp: Path, rootfs_src: Path) -> frozenset[str]:
    """runc's default device rules: what a container without any hook sees in its devices.list."""
    bundle = tmp / "baseline"
    copy_rootfs(rootfs_src, bundle / "rootfs")
    spec = default_spec("rootfs", _wrap(""), [], capabilities=["CAP_MKNOD"])
    write_bundle(bundle, spec)
    result = run_container("runc", bundle, unique_id("gpuhook-attack"), timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    rules = frozenset(line.strip() for line in Outcome(result).section(_DEVICES) if line.strip())
    assert rules and not any(":" in r and r.split()[1].startswith("195:") for r in rules), rules
    shutil.rmtree(bundle)
    return rules


def state_json(**fields: Any) -> bytes:
    """An OCI state document."""
    return json.dumps({"ociVersion": "1.0.2", "status": "created", **fields}).encode()

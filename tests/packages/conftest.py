"""Fixtures for the package tests: the built .deb/.rpm, a cached Debian 12 root, a chroot runner.

The Debian root is made once by ``debootstrap --variant=minbase --include=python3.11,runc bookworm``
(about 40 s with deb.debian.org) and kept as ``.cache/debootstrap/bookworm-<key>.tar``; each test
that changes a root extracts its own copy (under a second). Every command in a root runs through
:class:`Chroot`: ``unshare --mount --propagation private``, the root bound onto itself, /proc, /sys,
/dev and the test's directories mounted in it, then ``pivot_root`` into it; all of these exist only
in that private namespace and vanish with it, and :func:`mounts_under` checks after every command
that none is left on the host.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest

from gpuhook.daemon import client
from integration.engines import default_spec, tree_snapshot, unique_id, write_bundle
from integration.fakehost import FakeHost
from integration.rootfs import build_rootfs, copy_rootfs

REPO = Path(__file__).parents[2]


def _load_build_packages() -> Any:
    """packaging/build_packages.py as a module (packaging/ is not a package; sys.path stays as it is)."""
    spec = importlib.util.spec_from_file_location("build_packages", REPO / "packaging" / "build_packages.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_packages = _load_build_packages()

SUITE = "bookworm"
MIRROR = os.environ.get("GPUHOOK_DEBIAN_MIRROR", "http://deb.debian.org/debian")
#: the base root: minbase, the package's dependency (so installing needs no network) and runc.
INCLUDE = ("python3.11", "runc")
CACHE = REPO / ".cache" / "debootstrap"
CHROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: packaging/man's hand-written pages, as the packages install them (gzip'd, by section)
HAND_PAGES = {"/usr/share/man/man1/gpuhook.1.gz": "gpuhook.1",
              "/usr/share/man/man5/gpuhook.yaml.5.gz": "gpuhook.yaml.5",
              "/usr/share/man/man8/gpuhookd.8.gz": "gpuhookd.8",
              "/usr/share/man/man1/gpuhook-runtime.1.gz": "gpuhook-runtime.1",
              "/usr/share/man/man1/nvidia-ctk.1.gz": "nvidia-ctk.1"}
#: every page the packages install: the hand-written ones and NVIDIA's command names' (from --help)
MAN_PAGES = (*HAND_PAGES, "/usr/share/man/man1/nvidia-container-runtime-hook.1.gz",
             "/usr/share/man/man1/nvidia-container-cli.1.gz")
TIMINGS: dict[str, float] = {}


def need(tool: str, package: str) -> str:
    """The tool's path; a missing tool is a set-up error (make test installs it), never a skip."""
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} is missing: apt-get install {package} (make test-packages installs it)")
    return path


@pytest.fixture(scope="session", autouse=True)
def _need_root() -> None:
    """chroot, mount namespaces and runc need root."""
    if os.geteuid() != 0:
        pytest.fail("the package tests chroot, mount and run runc: run them as root (make test does)")


@dataclass(frozen=True)
class Packages:
    """What packaging/build_packages.py built."""

    deb: Path
    rpm: Path
    version: str


@pytest.fixture(scope="session")
def packages(tmp_path_factory: pytest.TempPathFactory) -> Packages:
    """The .deb and .rpm built from this checkout by packaging/build_packages.py."""
    out = tmp_path_factory.mktemp("dist")
    for path in (out, *out.parents):  # apt reads ./gpuhook_*.deb as the _apt user
        if path == Path("/tmp"):
            break
        path.chmod(0o755)
    start = time.monotonic()
    deb, rpm = build_packages.build(out, ("deb", "rpm"), work=tmp_path_factory.mktemp("pkgbuild"))
    TIMINGS["build: venv + nfpm deb + rpm"] = time.monotonic() - start
    return Packages(deb=deb, rpm=rpm, version=build_packages.version())


def debootstrap_tarball(suite: str = SUITE, include: tuple[str, ...] = INCLUDE) -> Path:
    """The cached base root (or another suite's minbase root, with *include*) as a tarball, made by
    debootstrap on the first call."""
    key = hashlib.sha256(f"{suite} {MIRROR} minbase {','.join(include)} v1".encode()).hexdigest()[:12]
    tarball = CACHE / f"{suite}-{key}.tar"
    if tarball.exists():
        return tarball
    need("debootstrap", "debootstrap")
    CACHE.mkdir(parents=True, exist_ok=True)
    for stale in CACHE.glob(".tmp-*"):  # an interrupted run's (its mounts died with its namespace)
        pid = stale.name.removeprefix(".tmp-")
        if not (pid.isdigit() and Path(f"/proc/{pid}").exists()):
            shutil.rmtree(stale, ignore_errors=True)
    work = CACHE / f".tmp-{os.getpid()}"
    root = work / "root"
    start = time.monotonic()
    try:
        # debootstrap mounts /proc and /sys in the target: in a private namespace they cannot leak.
        proc = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "--", "debootstrap", "--variant=minbase",
             *([f"--include={','.join(include)}"] if include else []), suite, str(root), MIRROR],
            capture_output=True, text=True, check=False, timeout=1200)
        if proc.returncode != 0:
            pytest.fail(f"debootstrap failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        for deb in (root / "var/cache/apt/archives").glob("*.deb"):
            deb.unlink()
        subprocess.run(["tar", "-C", str(root), "--numeric-owner", "--xattrs", "-cf", str(work / "root.tar"), "."],
                       check=True)
        (work / "root.tar").rename(tarball)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    TIMINGS["debootstrap (cold cache)"] = time.monotonic() - start
    return tarball


@pytest.fixture(scope="session")
def base_tarball() -> Path:
    """The cached Debian 12 root."""
    return debootstrap_tarball()


def extract_root(tarball: Path, dest: Path) -> Path:
    """A fresh copy of the cached root in dest."""
    dest.mkdir(parents=True)
    start = time.monotonic()
    subprocess.run(["tar", "-C", str(dest), "--numeric-owner", "--xattrs", "-xpf", str(tarball)], check=True)
    TIMINGS["extract the cached root"] = time.monotonic() - start
    return dest


def mounts_under(path: Path) -> list[str]:
    """Host mount points at or below path (there should be none once a command is done)."""
    prefix = str(path)
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            point = line.split()[4].replace("\\040", " ")
            if point == prefix or point.startswith(prefix + "/"):
                found.append(point)
    return found


@dataclass
class Chroot:
    """Run shell scripts inside a root (pivot_root'ed), in a private mount namespace of their own."""

    root: Path
    binds: list[Path] = field(default_factory=list)  # host directories shown at the same path inside

    def bind(self, path: Path) -> None:
        """Show host directory path at the same path inside the root (mount point made now)."""
        (self.root / str(path).lstrip("/")).mkdir(parents=True, exist_ok=True)
        self.binds.append(path)

    def run(self, script: str, *, check: bool = True, timeout: float = 300,
            env: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
        """Run script with /bin/sh -e inside the root; fail the test with its output if check and it fails."""
        proc = subprocess.run(self._argv(script, env), capture_output=True, text=True, check=False,
                              timeout=timeout, stdin=subprocess.DEVNULL)
        assert not mounts_under(self.root), f"mounts left under {self.root}: {mounts_under(self.root)}"
        if check and proc.returncode != 0:
            pytest.fail(f"in the chroot, `{script}` failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    def spawn(self, script: str, *, output: IO[bytes], env: Sequence[str] = ()) -> subprocess.Popen[bytes]:
        """Start script inside the root in the background (stdout and stderr to output).

        unshare, the set-up shell, chroot and the inner shells all exec, so a script that ends by
        exec'ing a command gives that command the returned process's pid: killing it ends the
        command and, with its last process, the private mount namespace and its mounts.
        """
        return subprocess.Popen(self._argv(script, env), stdin=subprocess.DEVNULL, stdout=output, stderr=output)

    def _argv(self, script: str, env: Sequence[str]) -> list[str]:
        """The host command that runs script with /bin/sh -e inside the root, in a new mount namespace."""
        root = shlex.quote(str(self.root))
        setup = [
            f"mount --bind {root} {root}",  # pivot_root needs the new root to be a mount point
            f"mount -t proc proc {root}/proc",
            f"mount --rbind /sys {root}/sys",
            f"mount --rbind /dev {root}/dev",
            *(f"mount --bind {shlex.quote(str(b))} {root}{shlex.quote(str(b))}" for b in self.binds),
        ]
        inner = ["env", "-i", f"PATH={CHROOT_PATH}", "HOME=/root", "LANG=C.UTF-8", "DEBIAN_FRONTEND=noninteractive",
                 *env, "/bin/sh", "-ec", script]
        # pivot_root, not just chroot: the root must be the mount namespace's own root, because the
        # hook setns()es into the container's mount namespace and that resets its root to the
        # namespace's (with a plain chroot, the hook would resolve the bundle on the host's tree).
        # The old root is put on the root's empty /mnt and detached at once.
        pivot = ["/bin/sh", "-c", 'umount -l /mnt && exec "$@"', "sh", *inner]
        wrapper = " && ".join([*setup, f"cd {root}", "pivot_root . mnt"]) + " && exec chroot . " + shlex.join(pivot)
        return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-ec", wrapper]


def package_paths(names: Sequence[str]) -> set[str]:
    """Installed file paths normalised across formats: Debian 12 keeps systemd/udev files under /lib."""
    out = set()
    for name in names:
        path = "/" + name.removeprefix(".").lstrip("/").rstrip("/")
        out.add("/usr" + path if path.startswith(("/lib/systemd/", "/lib/udev/")) else path)
    return out


def deb_files(deb: Path) -> set[str]:
    """The .deb's non-directory entries."""
    listing = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True).stdout
    names = []
    for line in listing.splitlines():
        if line.startswith("d"):
            continue
        path = line.split(None, 5)[5].split(" -> ")[0]
        names.append(path)
    return package_paths(names)


def rpm_files(rpm: Path) -> set[str]:
    """The .rpm's non-directory entries (rpm -qpl, less the directories it owns)."""
    listing = subprocess.run(["rpm", "-qp", "--qf", "[%{FILEMODES:perms} %{FILENAMES}\\n]", str(rpm)],
                             capture_output=True, text=True, check=True).stdout
    return package_paths([line.split(" ", 1)[1] for line in listing.splitlines() if not line.startswith("d")])


def fake_config(shipped: str, host_root: Path) -> str:
    """The shipped /etc/gpuhook/config.yaml with the three roots pointed at the simulated host.

    log_file and cache_dir keep their defaults (/var/log/gpuhook.log, /run/gpuhook), so a purge has
    to remove what the hook wrote there.
    """
    lines = []
    for line in shipped.splitlines():
        key = line.split(":", 1)[0]
        lines.append(f"{key}: {host_root}" if key in ("driver_root", "dev_root", "proc_root") else line)
    text = "\n".join(lines) + "\n"
    assert text.count(str(host_root)) == 3, "the shipped config no longer sets driver_root/dev_root/proc_root"
    return text


@pytest.fixture(scope="session", autouse=True)
def _report_timings() -> Iterator[None]:
    """Print the timings at the end (pytest -s, or -rA shows them)."""
    yield
    if TIMINGS:
        print("\npackage test timings: " + ", ".join(f"{k} {v:.1f}s" for k, v in TIMINGS.items()))


@pytest.fixture(scope="session")
def rootfs_src() -> Path:
    """The cached busybox+glibc container rootfs (with dltest and devopen), as tests/e2e use."""
    return build_rootfs(REPO / ".cache" / "rootfs")


#: what a container given GPU 1 of the simulated host sees (as tests/e2e/test_hook.py checks).
GPU_PROBE = "devopen /dev/nvidia1 /dev/nvidiactl /dev/nvidia0; dltest libcuda.so.1 libnvidia-ml.so.1"
GPU_SEES = {"/dev/nvidia1 ENXIO", "/dev/nvidiactl ENXIO", "/dev/nvidia0 ENOENT", "dlopen libcuda.so.1: OK",
            "dlopen libnvidia-ml.so.1: OK"}


@dataclass
class InstalledRoot:
    """A Debian root with gpuhook installed, the simulated host and a bundle area shown inside."""

    chroot: Chroot
    host: FakeHost
    bundles: Path
    rootfs_src: Path
    before: dict[str, tuple[str, int, int, str | None]]  # the tree before the install
    install_output: str

    @property
    def root(self) -> Path:
        """The root directory."""
        return self.chroot.root

    def point_config_at_host(self) -> None:
        """Edit the installed conffile (as an admin would) so its roots are the simulated host."""
        config = self.root / "etc/gpuhook/config.yaml"
        config.write_text(fake_config(config.read_text(), self.host.root))

    def run_gpu_container(self, hook: dict[str, Any], name: str) -> subprocess.CompletedProcess[str]:
        """`runc run` inside the root of a busybox container asking for GPU 1, with hook as prestart."""
        bundle = self.bundles / name
        bundle.mkdir()
        copy_rootfs(self.rootfs_src, bundle / "rootfs")
        spec = default_spec("rootfs", ["/bin/sh", "-c", GPU_PROBE],
                            ["NVIDIA_VISIBLE_DEVICES=1", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"],
                            hooks={"prestart": [hook]}, capabilities=["CAP_MKNOD"], annotations={})
        write_bundle(bundle, spec)
        b = shlex.quote(str(bundle))
        proc = self.chroot.run(f"cd {b}; rc=0; runc run --bundle {b} {shlex.quote(name)} || rc=$?; "
                               "rmdir /run/runc 2>/dev/null || true; exit $rc", check=False, timeout=120)
        shutil.rmtree(bundle)
        return proc


def install_root(tmp_path_factory: pytest.TempPathFactory, tarball: Path, host: FakeHost, rootfs_src: Path,
                 name: str, shown: Sequence[Path]) -> tuple[Chroot, Path, dict[str, tuple[str, int, int, str | None]]]:
    """A fresh root with host, a bundle area and shown dirs bound in; its tree before anything is installed."""
    work = tmp_path_factory.mktemp(name)
    root = extract_root(tarball, work / "root")
    bundles = work / "bundles"
    bundles.mkdir()
    chroot = Chroot(root)
    for path in (host.root, bundles, *shown):
        chroot.bind(path)
    return chroot, bundles, tree_snapshot(root)


def changed(before: dict[str, Any], after: dict[str, Any], allowed: Sequence[str]) -> list[str]:
    """Paths added, removed or changed between two snapshots, less those under an allowed prefix."""
    diff = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    return [p for p in diff if not any(p == a or p.startswith(a + "/") for a in allowed)]


def check_commands(installed: InstalledRoot, version: str) -> None:
    """The installed commands start from the private venv, isolated from the system's Python."""
    out = installed.chroot.run(
        "gpuhook --version; nvidia-container-runtime-hook -version; nvidia-container-toolkit -version; "
        "nvidia-container-cli --version; nvidia-ctk --version; readlink /usr/lib/gpuhook/bin/python; "
        "head -n1 /usr/bin/gpuhook; "
        "/usr/lib/gpuhook/bin/python -I -c 'import sys, yaml, pynvml, gpuhook; "
        "print(sys.prefix, [p for p in sys.path if \"-packages\" in p], gpuhook.__file__, yaml.__file__)'").stdout
    assert f"gpuhook {version}" in out
    assert f"gpuhook {version} (nvidia-container-runtime-hook compatible)" in out
    assert out.count("nvidia-container-runtime-hook compatible") == 2  # the nvidia-container-toolkit link too
    assert f"cli-version: gpuhook {version}" in out
    assert f"nvidia-ctk (gpuhook {version})" in out
    assert "/usr/bin/python3.11\n" in out
    assert "#!/usr/lib/gpuhook/bin/python -I\n" in out
    site = "/usr/lib/gpuhook/lib/python3.11/site-packages"
    assert f"/usr/lib/gpuhook ['{site}'] {site}/gpuhook/__init__.py {site}/yaml/__init__.py" in out


def check_docs(installed: InstalledRoot) -> None:
    """The man pages are packaging/man's (not --help's) and render without a warning; the logrotate file
    is packaging/logrotate's, rotating the default log_file."""
    import gzip

    root = installed.root
    for path, source in HAND_PAGES.items():
        assert gzip.decompress((root / path.lstrip("/")).read_bytes()) == (REPO / "packaging/man" / source).read_bytes()
    for path in MAN_PAGES:
        proc = subprocess.run(["man", "--warnings=w", "-E", "UTF-8", "-l", str(root / path.lstrip("/"))],
                              capture_output=True, text=True, check=False, timeout=60,
                              env={**os.environ, "MANWIDTH": "80", "LC_ALL": "C.UTF-8"})
        assert (proc.returncode, proc.stderr) == (0, ""), f"{path}: {proc.stderr}"
    rotate = (root / "etc/logrotate.d/gpuhook").read_text()
    assert rotate == (REPO / "packaging/logrotate/gpuhook").read_text()
    assert "/var/log/gpuhook.log {" in rotate and "copytruncate" in rotate


def check_info(installed: InstalledRoot) -> None:
    """`gpuhook info` with the default config path, edited to the simulated host."""
    out = installed.chroot.run("gpuhook info").stdout
    host = installed.host
    assert f"NVRM version:   {host.driver_version}" in out
    assert f"CUDA version:   {host.cuda_version}" in out
    for gpu in host.gpus:
        assert gpu.uuid in out


def check_gpu_containers(installed: InstalledRoot) -> None:
    """Real `runc run`s with the hook as registered by the package (hooks.d JSON, docker's hook name);
    the package registers the same hook for poststop, in a hooks.d file of its own."""
    hooks_d = installed.root / "usr/share/containers/oci/hooks.d"
    registered = json.loads((hooks_d / "gpuhook.json").read_text())["hook"]
    poststop = json.loads((hooks_d / "gpuhook-poststop.json").read_text())
    assert (poststop["stages"], poststop["when"]) == (["poststop"], {"always": True})
    assert poststop["hook"] == {**registered, "args": [*registered["args"][:-1], "poststop"]}
    docker_style = {"path": "/usr/bin/nvidia-container-runtime-hook", "args": ["nvidia-container-runtime-hook",
                    "prestart"], "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]}
    for name, hook in (("hooksd", registered), ("nvidia", docker_style)):
        proc = installed.run_gpu_container(hook, unique_id(f"pkg-{name}"))
        assert proc.returncode == 0, f"{name}: {proc.stdout}\n{proc.stderr}"
        seen = {line.strip() for line in proc.stdout.splitlines()}
        assert seen >= GPU_SEES, f"{name}: {proc.stdout}"
    # The hook used the package's default log file and inventory cache: what a purge must remove.
    assert (installed.root / "var/log/gpuhook.log").is_file()
    assert any((installed.root / "run/gpuhook").glob("inventory-*.json"))


#: gpuhookd's systemd units as the repository has them (the packages must install them unchanged).
UNITS = {name: REPO / "packaging/systemd" / name for name in ("gpuhookd.socket", "gpuhookd.service")}


def check_units(installed: InstalledRoot) -> None:
    """gpuhookd's socket and service are installed (mode 0644) with the repository's content."""
    for name, source in UNITS.items():
        path = installed.root / "usr/lib/systemd/system" / name  # /lib is /usr/lib in the merged-/usr root
        assert path.read_bytes() == source.read_bytes(), name
        assert path.stat().st_mode & 0o7777 == 0o644, name


@contextmanager
def running_gpuhookd(installed: InstalledRoot, version: str) -> Iterator[str]:
    """The installed `gpuhook daemon` running inside the root, on a socket in a fresh 0700 directory.

    Yields the socket's path in the root, once the daemon answers a ping with the package's
    version; kills it at the end, whatever happened. It runs in a mount namespace of its own
    (each Chroot command gets one), not the one where runc and the hook run: its worker enters
    the hook's mount namespace and root from the fds the hook sends, as it would enter the
    private mount namespace of a runtime on a real host.
    """
    socket_dir = Path(tempfile.mkdtemp(prefix="gpuhookd-", dir=installed.root / "run"))  # mode 0700
    inside = f"/{socket_dir.relative_to(installed.root)}/gpuhookd.sock"
    host_path = str(socket_dir / "gpuhookd.sock")  # the same socket, reached from the test process
    journal = socket_dir.parent / f"{socket_dir.name}.journal"
    with journal.open("wb") as output:
        proc = installed.chroot.spawn(f"exec gpuhook daemon --socket {shlex.quote(inside)}", output=output)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                served = client.ping(host_path)
                break
            except client.NotServed:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the installed gpuhookd did not answer a ping:\n{journal.read_text()}")
                time.sleep(0.05)
        assert served == version
        yield inside
        assert "request failed" not in journal.read_text(), journal.read_text()
    finally:
        proc.kill()
        proc.wait(timeout=30)
        journal.unlink()
        shutil.rmtree(socket_dir)
    assert not mounts_under(installed.root), f"mounts left under {installed.root}: {mounts_under(installed.root)}"


def check_gpuhookd_container(installed: InstalledRoot, version: str) -> None:
    """Real `runc run`s whose hooks (the hooks.d registration, and docker's NVIDIA name: both gpuhook-relay;
    --daemon-socket) are served by the installed gpuhookd."""
    registered = json.loads((installed.root / "usr/share/containers/oci/hooks.d/gpuhook.json").read_text())["hook"]
    log = installed.root / "var/log/gpuhook.log"
    with running_gpuhookd(installed, version) as socket_path:
        nvidia = "/usr/bin/nvidia-container-runtime-hook"
        for label, path, argv0 in (("hooksd", registered["path"], registered["args"][0]),
                                   ("nvidia", nvidia, "nvidia-container-runtime-hook")):
            name = unique_id(f"pkg-gpuhookd-{label}")
            hook = {**registered, "path": path, "args": [argv0, "--daemon-socket", socket_path, "prestart"]}
            proc = installed.run_gpu_container(hook, name)
            assert proc.returncode == 0, f"{label}: {proc.stdout}\n{proc.stderr}"
            assert {line.strip() for line in proc.stdout.splitlines()} >= GPU_SEES, proc.stdout
            events = [e for e in map(json.loads, log.read_text().splitlines()) if e.get("container_id") == name]
            assert "applied" in {event["event"] for event in events}, events
            assert {event["served_by"] for event in events} == {"gpuhookd"}, (label, events)


@contextmanager
def systemd_running(root: Path) -> Iterator[Path]:
    """Make the maintainer scripts see a running systemd: /run/systemd/system and a systemctl that
    logs its arguments (it says every unit is enabled). Yields the log; removes all of it after.

    The fake is /usr/sbin/systemctl: on the PATH apt gives dpkg (DPkg::Path has no /usr/local) and
    rpm gives scriptlets, and not where deb-systemd-helper looks for a real one (/bin, /usr/bin),
    which would change what it does.
    """
    made = [d for d in (root / "run/systemd", root / "run/systemd/system") if not d.exists()]
    for directory in made:
        directory.mkdir()
    log = root / "run/systemctl.log"
    fake = root / "usr/sbin/systemctl"
    assert not fake.exists() and not (root / "usr/bin/systemctl").exists()  # the root has no systemd
    fake.write_text('#!/bin/sh\necho "$*" >> /run/systemctl.log\n')
    fake.chmod(0o755)
    try:
        yield log
    finally:
        fake.unlink()
        log.unlink(missing_ok=True)
        for directory in reversed(made):
            directory.rmdir()

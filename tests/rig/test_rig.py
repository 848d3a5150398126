"""The real-container rig: busybox+glibc rootfs, runc and crun runs, and host observation helpers.

Needs root, runc, crun, unshare, gcc and busybox-static; a missing tool fails the test with an
install hint (``engines.MissingTool``), it never skips.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from integration import engines, rootfs
from integration.engines import Engine, RunResult

ENGINES: tuple[Engine, ...] = ("runc", "crun")
HOOK_ENV = ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]


@pytest.fixture(scope="session")
def cached_rootfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's rootfs, built once into a fresh cache dir."""
    for tool in ("runc", "crun", "unshare", "gcc"):
        engines.require_tool(tool)
    return rootfs.build_rootfs(tmp_path_factory.mktemp("rootfs-cache"))


@dataclass(frozen=True, slots=True)
class Runner:
    """Runs one container per call in a fresh bundle and checks the host is left as it was."""

    base: Path
    rootfs: Path

    def bundle(self, name: str) -> Path:
        """A new bundle dir holding a private copy of the rootfs at ``<bundle>/rootfs``."""
        bundle = self.base / name
        rootfs.copy_rootfs(self.rootfs, bundle / "rootfs")
        return bundle

    def run(self, engine: Engine, args: list[str], *, timeout: float = 30, **spec_kw: Any) -> RunResult:
        """Run ``args`` under ``engine`` and assert no mount, state dir or cgroup outlives it."""
        bundle = self.bundle(engines.unique_id(engine))
        engines.write_bundle(bundle, engines.default_spec("rootfs", args, [], **spec_kw))
        return self.run_bundle(engine, bundle, timeout=timeout)

    def run_bundle(
        self, engine: Engine, bundle: Path, *, timeout: float = 30, container_id: str | None = None
    ) -> RunResult:
        """Run an existing bundle and check the host afterwards."""
        container_id = container_id or engines.unique_id(engine)
        # Only this test's paths and mounts gpuhook could have made: other processes mount meanwhile.
        before = engines.host_mounts(self.base)
        result = engines.run_container(engine, bundle, container_id, timeout=timeout)
        assert engines.host_mounts(self.base) == before
        assert not Path(f"/run/{engine}", container_id).exists()
        assert engines.leftover_cgroups(container_id) == []
        return result


@pytest.fixture
def runner(tmp_path: Path, cached_rootfs: Path) -> Runner:
    """A Runner whose bundles live in this test's tmp dir."""
    return Runner(tmp_path, cached_rootfs)


def write_hook(path: Path, body: str) -> Path:
    """Write an executable /bin/sh hook script."""
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


# --- containers -------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_hello(runner: Runner, engine: Engine) -> None:
    """A container prints hello and exits 0."""
    result = runner.run(engine, ["echo", "hello"])
    assert (result.returncode, result.stdout, result.timed_out) == (0, "hello\n", False)


@pytest.mark.parametrize("engine", ENGINES)
def test_exit_status_and_absolute_root(runner: Runner, engine: Engine) -> None:
    """The container's exit status comes back, and an absolute root.path works too."""
    bundle = runner.bundle("abs")
    engines.write_bundle(bundle, engines.default_spec(str(bundle / "rootfs"), ["sh", "-c", "exit 7"], []))
    assert runner.run_bundle(engine, bundle).returncode == 7


@pytest.mark.parametrize("engine", ENGINES)
def test_dltest(runner: Runner, engine: Engine) -> None:
    """glibc resolves through the container's ld.so.cache; libcuda is absent."""
    script = "dltest -p libc.so.6; echo rc=$?; dltest libcuda.so.1; echo rc=$?"
    result = runner.run(engine, ["sh", "-c", script])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:2] == ["dlopen libc.so.6: OK /lib/x86_64-linux-gnu/libc.so.6", "rc=0"]
    assert lines[2].startswith("dlopen libcuda.so.1: FAIL libcuda.so.1: cannot open shared object file")
    assert lines[3] == "rc=1"


@pytest.mark.parametrize("engine", ENGINES)
def test_devopen_and_device_cgroup(runner: Runner, engine: Engine) -> None:
    """devopen names errnos; a hand-made 195:0 node is refused by the default devices cgroup."""
    script = "devopen /dev/null /dev/nvidia0; mknod /tmp/n c 195 0 && devopen /tmp/n"
    caps = [*engines.DEFAULT_CAPABILITIES, "CAP_MKNOD"]
    result = runner.run(engine, ["sh", "-c", script], capabilities=caps)
    assert result.returncode == 0, result.stderr
    # EPERM (cgroup), not ENXIO (no driver): nothing allowed c 195:* in the deny-all default.
    assert result.stdout.splitlines() == ["/dev/null OK", "/dev/nvidia0 ENOENT", "/tmp/n EPERM"]


@pytest.mark.parametrize("engine", ENGINES)
def test_prestart_hook_gets_state(runner: Runner, engine: Engine, tmp_path: Path) -> None:
    """A prestart hook from the spec runs once with the OCI state (id, host pid, bundle) on stdin."""
    out = tmp_path / "state.jsonl"
    # The state JSON has no trailing newline; add one per call to count the calls.
    hook = write_hook(tmp_path / "hook.sh", f'cat >> {out}\necho >> {out}\necho "$0 $*" > {out}.argv\n')
    hook_entry = {"path": str(hook), "args": ["hook.sh", "prestart"], "env": HOOK_ENV, "timeout": 10}
    bundle = runner.bundle("hooked")
    spec = engines.default_spec("rootfs", ["echo", "hello"], [], hooks={"prestart": [hook_entry]})
    engines.write_bundle(bundle, spec)
    container_id = engines.unique_id(engine)
    result = runner.run_bundle(engine, bundle, container_id=container_id)
    assert (result.returncode, result.stdout) == (0, "hello\n"), result.stderr
    [line] = out.read_text().splitlines()
    state = json.loads(line)
    assert state["id"] == container_id
    assert isinstance(state["pid"], int)
    assert state["pid"] > 1
    assert state["bundle"] == str(bundle)
    # runc says "creating", crun "created" (runtime-lab.md section 1).
    assert state["status"] == {"runc": "creating", "crun": "created"}[engine]
    assert Path(f"{out}.argv").read_text() == f"{hook} prestart\n"


@pytest.mark.parametrize("engine", ENGINES)
def test_failing_hook_aborts_with_its_stderr(runner: Runner, engine: Engine, tmp_path: Path) -> None:
    """A prestart hook that fails stops the container, and its stderr reaches the result."""
    hook = write_hook(tmp_path / "fail.sh", "echo 'gpuhook-test: no GPU for you' >&2\nexit 3\n")
    hooks = {"prestart": [{"path": str(hook), "args": ["fail.sh"], "env": HOOK_ENV}]}
    result = runner.run(engine, ["echo", "hello"], hooks=hooks)
    assert result.returncode != 0
    assert "hello" not in result.stdout
    assert "gpuhook-test: no GPU for you" in result.stderr


def test_crun_discards_hook_stderr_without_annotations(runner: Runner, tmp_path: Path) -> None:
    """Why default_spec sets run.oci.hooks.stderr: crun 1.8.1 otherwise drops the hook's stderr."""
    hook = write_hook(tmp_path / "fail.sh", "echo 'gpuhook-test: lost' >&2\nexit 3\n")
    hooks = {"prestart": [{"path": str(hook), "args": ["fail.sh"], "env": HOOK_ENV}]}
    result = runner.run("crun", ["echo", "hello"], hooks=hooks, annotations={})
    assert result.returncode != 0
    assert "gpuhook-test: lost" not in result.stderr
    assert f"error executing hook `{hook}` (exit code: 3)" in result.stderr


@pytest.mark.parametrize("engine", ENGINES)
def test_readonly_root(runner: Runner, engine: Engine) -> None:
    """readonly=True gives a read-only root; the default root is writable."""
    script = "touch /probe 2>/dev/null && echo rw || echo ro"
    assert runner.run(engine, ["sh", "-c", script], readonly=True).stdout == "ro\n"
    assert runner.run(engine, ["sh", "-c", script]).stdout == "rw\n"


@pytest.mark.parametrize("engine", ENGINES)
def test_timeout_kills_and_cleans_up(runner: Runner, engine: Engine) -> None:
    """A container that outlives the timeout is killed and deleted, output pipes and all."""
    start = time.monotonic()
    result = runner.run(engine, ["sleep", "60"], timeout=0.25)
    assert result.timed_out
    assert result.returncode != 0
    assert "timeout" in result.stderr
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("engine", ENGINES)
def test_hung_hook_is_killed_and_cleaned_up(runner: Runner, engine: Engine, tmp_path: Path) -> None:
    """A prestart hook that hangs past the timeout: engine and hook die, no state or cgroup remains."""
    hook = write_hook(tmp_path / "hang.sh", "exec /bin/sleep 60\n")
    hooks = {"prestart": [{"path": str(hook), "args": ["hang.sh"], "env": HOOK_ENV}]}
    result = runner.run(engine, ["echo", "hello"], timeout=0.25, hooks=hooks)
    assert result.timed_out
    assert "hello" not in result.stdout


# --- rootfs -----------------------------------------------------------------------------------


def test_build_is_cached_and_race_safe(tmp_path: Path) -> None:
    """Two concurrent cold builds publish one tree; a warm call is fast and returns the same path."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        built = list(pool.map(lambda _: rootfs.build_rootfs(tmp_path), range(2)))
    assert built[0] == built[1]
    assert [p.name for p in tmp_path.iterdir()] == [built[0].name]  # no temp dirs left

    start = time.monotonic()
    again = rootfs.build_rootfs(tmp_path)
    assert again == built[0]
    assert time.monotonic() - start < 0.5


def test_build_loses_race_gracefully(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """If another builder publishes while we build, our rename fails and we return its tree."""
    winner = rootfs.build_rootfs(tmp_path / "first")
    final = tmp_path / "cache" / winner.name
    populate = rootfs._populate

    def populate_then_lose(root: Path, inputs: Any) -> None:
        populate(root, inputs)
        rootfs.copy_rootfs(winner, final)  # the other process's rename lands first

    monkeypatch.setattr(rootfs, "_populate", populate_then_lose)
    assert rootfs.build_rootfs(tmp_path / "cache") == final
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [final.name]


def test_debian_layout(cached_rootfs: Path) -> None:
    """The rootfs has Debian's non-usr-merged multiarch layout, config files and probe programs."""
    r = cached_rootfs
    for rel in ("lib/x86_64-linux-gnu", "lib64", "usr/lib/x86_64-linux-gnu", "usr/bin", "usr/local/bin",
                "etc/ld.so.conf.d", "proc", "dev", "sys", "tmp", "run"):
        assert (r / rel).is_dir(), rel
        assert not (r / rel).is_symlink(), rel
    assert list((r / "usr/lib/x86_64-linux-gnu").iterdir()) == []
    assert os.readlink(r / "var/run") == "../run"
    assert (r / "etc/debian_version").read_text() == "12.7\n"
    assert (r / "etc/ld.so.conf").read_text() == "include /etc/ld.so.conf.d/*.conf\n"
    assert "/usr/lib/x86_64-linux-gnu\n" in (r / "etc/ld.so.conf.d/x86_64-linux-gnu.conf").read_text()
    assert (r / "etc/ld.so.cache").stat().st_size > 0
    assert (r / "lib/x86_64-linux-gnu/libc.so.6").is_file()
    assert os.readlink(r / "lib64/ld-linux-x86-64.so.2") == "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
    for applet in rootfs.BUSYBOX_APPLETS_REQUIRED:
        assert os.readlink(r / "bin" / applet) == "busybox"
    assert not (r / "usr/lib64").exists()
    cache = subprocess.run(["/sbin/ldconfig", "-p", "-C", str(r / "etc/ld.so.cache")],
                           capture_output=True, text=True, check=True).stdout
    assert "libc.so.6 (libc6,x86-64) => /lib/x86_64-linux-gnu/libc.so.6" in cache


def test_generic_layout(tmp_path: Path, cached_rootfs: Path) -> None:
    """debian=False drops /etc/debian_version, adds /usr/lib64, and is cached separately."""
    r = rootfs.build_rootfs(tmp_path, debian=False)
    assert r.name != cached_rootfs.name
    assert not (r / "etc/debian_version").exists()
    assert (r / "usr/lib64").is_dir()
    assert not (r / "usr/lib64").is_symlink()
    assert (r / "usr/local/bin/dltest").is_file()


def test_devopen_is_static_and_dltest_dynamic(cached_rootfs: Path) -> None:
    """devopen needs no loader; dltest uses the rootfs's loader."""
    assert rootfs._is_static_elf(cached_rootfs / "usr/local/bin/devopen")
    assert not rootfs._is_static_elf(cached_rootfs / "usr/local/bin/dltest")


def test_copy_rootfs_is_faithful(tmp_path: Path, cached_rootfs: Path) -> None:
    """A copy has the same tree (symlinks, modes, sizes) and refuses a non-empty destination."""
    dst = rootfs.copy_rootfs(cached_rootfs, tmp_path / "copy")
    assert engines.tree_snapshot(dst) == engines.tree_snapshot(cached_rootfs)
    with pytest.raises(FileExistsError):
        rootfs.copy_rootfs(cached_rootfs, dst)


# --- helpers ----------------------------------------------------------------------------------


def test_tree_snapshot_sees_changes(tmp_path: Path) -> None:
    """New files, mode changes, symlinks and device nodes all show up in a snapshot."""
    (tmp_path / "d").mkdir()
    before = engines.tree_snapshot(tmp_path)
    (tmp_path / "d/f").write_text("x")
    os.symlink("/etc/passwd", tmp_path / "l")
    os.mknod(tmp_path / "n", 0o600 | stat.S_IFCHR, os.makedev(195, 255))
    (tmp_path / "d").chmod(0o700)
    after = engines.tree_snapshot(tmp_path)
    assert set(after) - set(before) == {"d/f", "l", "n"}
    assert (before["d"], after["d"]) == (("d", 0o777 & ~_umask(), 0, None), ("d", 0o700, 0, None))
    assert after["d/f"] == ("f", 0o644 & ~_umask(), 1, None)
    assert after["l"][0::3] == ("l", "/etc/passwd")
    assert after["n"] == ("c", 0o600, 0, "195:255")


def _umask() -> int:
    """The process umask (read without changing it for long)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_host_mounts_sees_a_new_mount_under_an_owned_path(tmp_path: Path) -> None:
    """host_mounts(owned) is sensitive: a tmpfs mounted under an owned path appears, and vanishes after umount."""
    target = tmp_path / "m"
    target.mkdir()
    before = engines.host_mounts(tmp_path)
    subprocess.run(["mount", "-t", "tmpfs", "rigtest", str(target)], check=True)
    try:
        added = engines.host_mounts(tmp_path) - before
    finally:
        subprocess.run(["umount", str(target)], check=True)
    assert added == {f"{target} tmpfs rigtest /"}
    assert engines.host_mounts(tmp_path) == before


def test_host_mounts_needs_owned_paths() -> None:
    """The whole mount table is never the oracle: another process's mount would fail the test."""
    with pytest.raises(ValueError, match="needs the paths the test owns"):
        engines.host_mounts()


#: Run in a private mount namespace (so that nothing here reaches the host, where another test run's
#: oracle would see it): report ready, wait for a line, make the mounts, report done, wait again.
_MOUNTER = """
set -e
echo ready; read go
for spec in "$@"; do
    eval "mount $spec"
done
echo done; read go
"""


def test_owned_host_mounts_keep_what_gpuhook_could_make(tmp_path: Path) -> None:
    """host_mounts(*owned) keeps any mount at or under an owned path, a bind whose root lies under one
    (a driver file of the simulated host, mounted anywhere), and a tmpfs of gpuhook's shape anywhere;
    it drops other processes' mounts: a named tmpfs, a source-less tmpfs of another shape, a bind of a
    foreign directory."""
    owned, foreign, elsewhere = tmp_path / "owned", tmp_path / "foreign", Path(tempfile.mkdtemp(prefix="rigtest-"))
    inside = owned / "point"
    points = {name: elsewhere / name for name in ("named", "anon", "gpuhook-tmpfs", "gpuhook-cover",
                                                   "bind-foreign", "bind-owned")}
    for path in (owned, foreign, inside, *points.values()):
        path.mkdir()
    (owned / "driver-file").write_text("x")
    mounts = [f"-t tmpfs engine-shm {points['named']}", f"-t tmpfs none {points['anon']}",
              f"-t tmpfs -o mode=0555,size=1m none {points['gpuhook-tmpfs']}",
              f"-t tmpfs -o mode=0555,size=4k none {points['gpuhook-cover']}",
              f"--bind {foreign} {points['bind-foreign']}", f"--bind {owned} {points['bind-owned']}",
              f"-t tmpfs other {inside}"]
    child = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", _MOUNTER, "sh", *mounts],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline() == "ready\n"
        before = engines.host_mounts(owned, pid=child.pid)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "done\n", "the mounts failed (see stderr)"
        added = engines.host_mounts(owned, pid=child.pid) - before
        everything = {row.point for row in engines.read_mounts(child.pid)}
    finally:
        child.kill()
        child.wait()
        shutil.rmtree(elsewhere)
    assert {str(p) for p in points.values()} | {str(inside)} <= everything  # every mount was made
    assert {line.split()[0] for line in added} == {
        str(points["gpuhook-tmpfs"]), str(points["gpuhook-cover"]), str(points["bind-owned"]), str(inside)}


def test_fs_relative_names_a_path_as_a_bind_mount_root_shows_it(tmp_path: Path) -> None:
    """On a tmpfs mounted at a test path, a file's fs-relative path drops the mount point."""
    (tmp_path / "fs").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "rigtest", str(tmp_path / "fs")], check=True)
    try:
        (tmp_path / "fs" / "sub").mkdir()
        device, rel = engines.fs_relative(tmp_path / "fs" / "sub")
        rows = [row for row in engines.read_mounts() if row.point == str(tmp_path / "fs")]
    finally:
        subprocess.run(["umount", str(tmp_path / "fs")], check=True)
    assert rel == "/sub" and [row.device for row in rows] == [device]


def test_require_tool() -> None:
    """A present tool resolves to an absolute path; a missing one fails loudly with an install hint."""
    assert engines.require_tool("runc").startswith("/")
    with pytest.raises(engines.MissingTool, match="'no-such-tool-xyz' is not installed; fix: install"):
        engines.require_tool("no-such-tool-xyz")


def test_unique_ids() -> None:
    """Ids never repeat within a process and are valid runc/crun container ids."""
    ids = {engines.unique_id("x") for _ in range(1000)}
    assert len(ids) == 1000
    assert all(i.replace("-", "").isalnum() for i in ids)


def test_default_spec_shape() -> None:
    """The spec is runc's default: non-terminal, deny-all devices, five namespaces, PATH added."""
    spec = engines.default_spec("rootfs", ["true"], ["A=1"], readonly=True)
    assert spec["process"]["terminal"] is False
    assert spec["process"]["env"] == [engines.DEFAULT_PATH, "A=1"]
    assert spec["root"] == {"path": "rootfs", "readonly": True}
    assert spec["linux"]["resources"]["devices"] == [{"allow": False, "access": "rwm"}]
    assert [n["type"] for n in spec["linux"]["namespaces"]] == ["pid", "network", "ipc", "uts", "mount"]
    assert "hooks" not in spec
    assert [m["destination"] for m in spec["mounts"]] == [
        "/proc", "/dev", "/dev/pts", "/dev/shm", "/dev/mqueue", "/sys", "/sys/fs/cgroup"]
    assert engines.default_spec("r", ["true"], ["PATH=/x"])["process"]["env"] == ["PATH=/x"]

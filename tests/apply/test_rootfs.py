"""RootFs on hostile root filesystems, with real syscalls in a private mount namespace."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuhook.apply import _host_tree, _mask_proc_driver
from gpuhook.apply.rootfs import RootFs
from gpuhook.errors import ApplyError
from gpuhook.planning.plan import BindMount, ProcDriverMount
from integration.engines import tree_snapshot
from integration.fakehost import FakeHost

from .nsutil import in_private_mount_ns

LIB = "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15"


@pytest.fixture
def rootfs(tmp_path: Path) -> Path:
    """An image-like tree: /usr/lib/x86_64-linux-gnu, /dev, /proc/driver/nvidia (plain dirs here)."""
    root = tmp_path / "rootfs"
    for d in ("usr/lib/x86_64-linux-gnu", "dev", "proc/driver/nvidia", "etc"):
        (root / d).mkdir(parents=True)
    return root


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A host directory with a marker file that nothing may touch."""
    path = tmp_path / "victim"
    path.mkdir()
    (path / "marker").write_text("host\n")
    return path


def _fs(root: Path) -> RootFs:
    """A RootFs over *root* (call inside the namespace)."""
    return RootFs(os.open(root, os.O_PATH | os.O_DIRECTORY))


def _outcome(action) -> str:  # type: ignore[no-untyped-def]
    """'ok' or the ApplyError text."""
    try:
        action()
    except ApplyError as err:
        return str(err)
    return "ok"


def _mounts_under(path: Path) -> list[str]:
    """Mount points at or below *path* in this namespace."""
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(str(path))]


def test_symlinked_library_target_is_refused(rootfs: Path, victim: Path) -> None:
    """A library path that is a symlink to a host file is never mounted over."""
    (rootfs / LIB.lstrip("/")).symlink_to(victim / "marker")
    message = in_private_mount_ns(lambda: _outcome(lambda: _fs(rootfs).mount_target(LIB)))
    assert "exists in the image and is not a regular file" in message
    assert (victim / "marker").read_text() == "host\n"


def test_dev_symlinks_are_refused(rootfs: Path, victim: Path) -> None:
    """/dev is runtime-owned: a symlinked /dev or a pre-planted node symlink refuses the mknod."""
    (rootfs / "dev").rmdir()
    (rootfs / "dev").symlink_to(victim)
    assert "Too many levels of symbolic links" in in_private_mount_ns(
        lambda: _outcome(lambda: _fs(rootfs).mknod("/dev/nvidia0", 195, 0, 0o666)))
    assert sorted(p.name for p in victim.iterdir()) == ["marker"]
    (rootfs / "dev").unlink()
    (rootfs / "dev").mkdir()
    (rootfs / "dev/nvidia0").symlink_to(victim / "marker")
    assert "exists and is not the character device 195:0" in in_private_mount_ns(
        lambda: _outcome(lambda: _fs(rootfs).mknod("/dev/nvidia0", 195, 0, 0o666)))


def test_escaping_symlink_chains_stay_in_the_root(rootfs: Path, victim: Path) -> None:
    """'..' chains and absolute links are resolved inside the rootfs; missing dirs are made there."""
    (rootfs / "usr/lib/x86_64-linux-gnu").rmdir()
    (rootfs / "usr/lib/x86_64-linux-gnu").symlink_to("../../../../../../../../" + str(victim).lstrip("/"))
    in_private_mount_ns(lambda: os.close(_fs(rootfs).mount_target(LIB)))
    assert sorted(p.name for p in victim.iterdir()) == ["marker"]
    assert (rootfs / str(victim).lstrip("/") / "libcuda.so.550.54.15").is_file()


def test_mount_is_verified_and_everything_rolls_back(rootfs: Path, host: FakeHost) -> None:
    """Attach a read-only host library, make a node, a dir and a symlink; rollback undoes all of it."""
    before = tree_snapshot(rootfs)
    source = host.lib_dir / f"libcuda.so.{host.driver_version}"

    def scenario() -> tuple[bytes, list[str], list[str], list[str]]:
        fs = _fs(rootfs)
        tree = _host_tree(BindMount(source=str(source), target=LIB))
        fs.attach(tree, fs.mount_target(LIB), LIB)
        fs.mknod("/dev/nvidia1", 195, 1, 0o666)
        fs.symlink("/usr/local/lib/deep/libcuda.so", "libcuda.so.1")
        content = (rootfs / LIB.lstrip("/")).read_bytes()[:4]
        mounted = _mounts_under(rootfs)
        leftovers = fs.rollback()
        return content, mounted, _mounts_under(rootfs), leftovers

    content, mounted, after, leftovers = in_private_mount_ns(scenario)
    assert content == b"\x7fELF"  # the host library shows through the mount
    assert mounted == [str(rootfs / LIB.lstrip("/"))] and after == [] and leftovers == []
    assert tree_snapshot(rootfs) == before


def test_proc_driver_is_masked_read_only(rootfs: Path, host: FakeHost) -> None:
    """/proc/driver/nvidia becomes a read-only tmpfs with ModifyDeviceFiles: 0 and the selected GPU dir."""
    gpu_dir = host.gpus[1].proc_bus_id
    proc = ProcDriverMount(
        target="/proc/driver/nvidia",
        files=(("params", "ModifyDeviceFiles: 0\n"), ("version", "NVRM version: test\n")),
        gpu_dirs=((str(host.root / "proc/driver/nvidia/gpus" / gpu_dir), gpu_dir),),
    )

    def scenario() -> tuple[bool, str, list[str], str, str]:
        trees = [_host_tree(BindMount(source=d, target="")) for d, _ in proc.gpu_dirs]
        masked = _mask_proc_driver(_fs(rootfs), proc, trees)
        base = rootfs / "proc/driver/nvidia"
        try:
            (base / "params").write_text("ModifyDeviceFiles: 1\n")
            write = "writable"
        except OSError as err:
            write = os.strerror(err.errno or 0)
        return masked, (base / "params").read_text(), sorted(os.listdir(base / "gpus")), \
            (base / "gpus" / gpu_dir / "information").read_text(), write

    masked, params, gpus, information, write = in_private_mount_ns(scenario)
    assert masked and params == "ModifyDeviceFiles: 0\n" and gpus == [gpu_dir]
    assert host.gpus[1].uuid in information
    assert write == "Read-only file system"


def test_proc_driver_is_skipped_without_a_driver(rootfs: Path) -> None:
    """No /proc/driver/nvidia in the container (no kernel module): nothing is mounted, False is returned."""
    (rootfs / "proc/driver/nvidia").rmdir()
    proc = ProcDriverMount(target="/proc/driver/nvidia", files=(), gpu_dirs=())
    assert in_private_mount_ns(lambda: _mask_proc_driver(_fs(rootfs), proc, [])) is False


def test_proc_driver_carries_the_mig_capability_files(rootfs: Path, tmp_path: Path) -> None:
    """A selected MIG device's capabilities/gpuN/mig/giG/.../access files are bound from the host, read-only."""
    from integration.fakehost import create_host

    mig_host = create_host(tmp_path / "mighost", gpus=1, mig={0: ("1g.10gb",)})
    mig = mig_host.mig_devices[0]
    rels = [f"capabilities/gpu0/mig/gi{mig.gi}/access", f"capabilities/gpu0/mig/gi{mig.gi}/ci{mig.ci}/access"]
    proc = ProcDriverMount(
        target="/proc/driver/nvidia", files=(("params", "ModifyDeviceFiles: 0\n"),), gpu_dirs=(),
        cap_files=tuple((str(mig_host.root / "proc/driver/nvidia" / rel), rel) for rel in rels),
    )

    def scenario() -> list[str]:
        trees = [_host_tree(BindMount(source=source, target="")) for source, _ in proc.cap_files]
        assert _mask_proc_driver(_fs(rootfs), proc, trees)
        return [(rootfs / "proc/driver/nvidia" / rel).read_text() for rel in rels]

    contents = in_private_mount_ns(scenario)
    assert contents[0].startswith(f"DeviceFileMinor: {mig.gi_cap_minor}\n")
    assert contents[1].startswith(f"DeviceFileMinor: {mig.ci_cap_minor}\n")

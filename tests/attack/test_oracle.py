"""The mount oracle (o3) on a busy host: a mount gpuhook leaked fails the run, another process's does not.

Each case mounts from an earlier prestart hook, which runc runs in the host's mount namespace while
the container is being created: exactly when and where a leak by gpuhook (or a concurrent engine's,
or another test run's, mount) would appear between the rig's two observations.
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from integration.engines import read_mounts

from .rig import HOST_LIB_DIR, Rig


@pytest.fixture
def elsewhere() -> Iterator[Path]:
    """A directory outside every path the test owns (as another process's mounts would be), unmounted after."""
    path = Path(tempfile.mkdtemp(prefix="gpuhook-oracle-"))
    yield path
    for row in sorted((r for r in read_mounts() if r.point.startswith(f"{path}/")), key=lambda r: -len(r.point)):
        subprocess.run(["umount", row.point], check=True)
    subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=True)


def test_a_leaked_driver_bind_outside_the_tests_paths_fails_the_run(hook_rig: Rig, elsewhere: Path) -> None:
    """A bind mount of a driver library of the simulated host, left on the host at a path the test does not
    own (as an escape through a symlink would put it), is reported with its mount point."""
    library = hook_rig.host.root / HOST_LIB_DIR / f"libcuda.so.{hook_rig.host.driver_version}"
    (elsewhere / "libcuda.so.1").touch()
    container = hook_rig.container(pre_hook=f"mount --bind {library} {elsewhere}/libcuda.so.1")
    with pytest.raises(AssertionError, match=rf"host mounts changed: \+\['{elsewhere}/libcuda.so.1 "):
        hook_rig.run(container)


def test_a_leaked_mount_in_a_rootfs_fails_the_run(hook_rig: Rig) -> None:
    """Any mount left on the host under the test's tmp tree counts, whatever its shape: here a plain
    tmpfs over a rootfs's /proc (another bundle's, so the container being run is undisturbed)."""
    target = hook_rig.container().rootfs / "proc"
    container = hook_rig.container(pre_hook=f"mount -t tmpfs none {target}")
    try:
        with pytest.raises(AssertionError, match=rf"host mounts changed: \+\['{target} tmpfs none /'\]"):
            hook_rig.run(container)
    finally:
        subprocess.run(["umount", str(target)], check=False)


def test_foreign_mounts_made_during_the_run_do_not_fail_it(hook_rig: Rig, elsewhere: Path) -> None:
    """What other processes mount elsewhere meanwhile (a source-less tmpfs as scripts make them, an engine's
    named shm tmpfs, a bind of another directory) is not gpuhook's: the run passes every oracle."""
    for name in ("anon", "shm", "bind", "source"):
        (elsewhere / name).mkdir()
    container = hook_rig.container(pre_hook=(
        f"mount -t tmpfs none {elsewhere}/anon; mount -t tmpfs shm {elsewhere}/shm; "
        f"mount --bind {elsewhere}/source {elsewhere}/bind"))
    outcome = hook_rig.run(container)
    hook_rig.check_no_gpu(outcome)
    # The mounts were made during the run and are still there: the oracle saw them and let them be.
    assert {f"{elsewhere}/{name}" for name in ("anon", "shm", "bind")} <= {row.point for row in read_mounts()}

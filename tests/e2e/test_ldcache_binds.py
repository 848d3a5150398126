"""The ld.so.cache of real runc containers (issue #31): whole on a plain-directory rootfs with kubelet's binds
from the host's disk (every kubelet pod has /dev/termination-log bound from the node's disk), and never
reported applied when it cannot load the driver."""

from __future__ import annotations

import json
import re
from pathlib import Path

from gpuhook.ldcache import parse_ldcache

from .conftest import MakeContainer

TWO_GPUS = {"NVIDIA_VISIBLE_DEVICES": "1,3", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"}


def _bind(source: Path, destination: str) -> dict[str, object]:
    return {"destination": destination, "type": "bind", "source": str(source), "options": ["rbind", "rprivate"]}


def test_kubelets_binds_from_the_rootfs_disk_leave_libcuda_in_the_cache(make_container: MakeContainer,
                                                                        tmp_path: Path) -> None:
    """/dev/termination-log, /etc/hosts and /etc/resolv.conf bound from the disk the bundle's rootfs is on:
    the container's cache lists libcuda.so.1 at its link in the libraries' directory, and the container loads it."""
    container = make_container("dltest libcuda.so.1 libnvidia-ml.so.1", TWO_GPUS)
    pod = tmp_path / "pod"  # kubelet's pod directory, on the disk the bundle is on
    pod.mkdir()
    assert pod.stat().st_dev == container.rootfs.stat().st_dev
    binds = {"/dev/termination-log": b"", "/etc/hosts": b"127.0.0.1 localhost\n", "/etc/resolv.conf": b""}
    for destination, content in binds.items():
        (pod / destination.rpartition("/")[2]).write_bytes(content)
    config = container.bundle / "config.json"
    spec = json.loads(config.read_text())
    spec["mounts"] += [_bind(pod / d.rpartition("/")[2], d) for d in binds]
    config.write_text(json.dumps(spec))

    result = container.run()
    assert result.returncode == 0, result.stderr
    assert {"dlopen libcuda.so.1: OK", "dlopen libnvidia-ml.so.1: OK"} <= set(result.stdout.split("\n")), result.stdout
    cached = {e.key: e.value for e in parse_ldcache((container.rootfs / "etc/ld.so.cache").read_bytes())}
    assert cached.get("libcuda.so.1", "").endswith("/libcuda.so.1"), cached
    assert "libc.so.6" in cached  # the image's own libraries too


def test_a_start_whose_cache_cannot_load_the_driver_is_refused(make_container: MakeContainer) -> None:
    """An image that bakes in a stub libcuda.so.1 (a file, not a link): ldconfig leaves it where the driver's
    SONAME link goes, so the cache's libcuda.so.1 is the stub, whichever writer wrote it. The start is refused in
    one line, and the image's cache and files are left as they were."""
    from gpuhook.apply.ldelf import sample_library

    def stub(rootfs: Path) -> None:
        (rootfs / "usr/lib/x86_64-linux-gnu/libcuda.so.1").write_bytes(sample_library(b"libcuda.so.1"))

    container = make_container("echo started", TWO_GPUS, prepare=stub)
    before = (container.rootfs / "etc/ld.so.cache").read_bytes()
    result = container.run()
    assert result.returncode != 0 and "started" not in result.stdout
    refusal = (r"ldconfig /etc/ld\.so\.cache: lacks /usr/lib/x86_64-linux-gnu/libcuda\.so\.[0-9.]+ under its SONAME "
               r"\(libX\.so\.N\) after ldconfig rebuilt it, .* Fix the image")
    assert re.search(refusal, result.stderr), result.stderr
    assert "Traceback" not in result.stderr
    assert (container.rootfs / "etc/ld.so.cache").read_bytes() == before
    assert sorted(p.name for p in (container.rootfs / "usr/lib/x86_64-linux-gnu").glob("libcuda*")) == ["libcuda.so.1"]

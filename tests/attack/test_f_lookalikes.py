"""Corpus F47: benign images that look like attacks must still get their GPU (false-positive guard)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from integration.rootfs import build_rootfs

from .conftest import REPO
from .rig import GPU0, GPU_PROBE, LIBS_DIR, Rig


def merged_usr(rootfs: Path) -> None:
    """Debian's merged /usr: /lib and /lib64 are relative symlinks into /usr."""
    for top in ("lib", "lib64"):
        dest = rootfs / "usr" / top
        dest.mkdir(exist_ok=True)
        for dirpath, dirnames, filenames in os.walk(rootfs / top):
            rel = Path(dirpath).relative_to(rootfs / top)
            for d in dirnames:
                (dest / rel / d).mkdir(exist_ok=True)
            for f in filenames:
                os.rename(Path(dirpath) / f, dest / rel / f)
        shutil.rmtree(rootfs / top)
        (rootfs / top).symlink_to(f"usr/{top}")


def cuda_alternatives(rootfs: Path) -> None:
    """``/usr/local/cuda -> /etc/alternatives/cuda -> /usr/local/cuda-12.4`` (absolute, libnvidia-container#117)."""
    (rootfs / "usr/local/cuda-12.4/lib64").mkdir(parents=True)
    (rootfs / "etc/alternatives").mkdir()
    (rootfs / "etc/alternatives/cuda").symlink_to("/usr/local/cuda-12.4")
    (rootfs / "usr/local/cuda").symlink_to("/etc/alternatives/cuda")
    (rootfs / "etc/ld.so.conf.d/000_cuda.conf").write_text("/usr/local/cuda/lib64\n")


def dangling_resolv_conf(rootfs: Path) -> None:
    """systemd-resolved's dangling ``/etc/resolv.conf`` link."""
    (rootfs / "etc/resolv.conf").symlink_to("../run/systemd/resolve/stub-resolv.conf")


def no_ldconfig(rootfs: Path) -> None:
    """An image without any ldconfig (distroless-style)."""
    (rootfs / "sbin/ldconfig").unlink()


def no_ld_so_cache(rootfs: Path) -> None:
    """An image without /etc/ld.so.cache (Alpine-style)."""
    (rootfs / "etc/ld.so.cache").unlink()


@pytest.fixture(scope="session")
def generic_rootfs_src() -> Path:
    """The non-Debian variant of the test rootfs (no /etc/debian_version; 64-bit libs in /usr/lib64)."""
    return build_rootfs(REPO / ".cache" / "rootfs", debian=False)


@pytest.mark.parametrize(
    ("prepare", "readonly"),
    [
        pytest.param(merged_usr, False, id="F47-merged-usr"),
        pytest.param(cuda_alternatives, False, id="F47-usr-local-cuda-absolute-alternatives"),
        pytest.param(dangling_resolv_conf, False, id="F47-dangling-resolv-conf"),
        pytest.param(None, True, id="F47-readonly-rootfs"),
        pytest.param(no_ldconfig, False, id="F47-no-ldconfig-in-image"),
        pytest.param(no_ld_so_cache, False, id="F47-no-ld-so-cache"),
    ],
)
def test_benign_debian_lookalike_gets_its_gpu(rig: Rig, prepare: Callable[[Path], None] | None, readonly: bool) -> None:
    """Legitimate layouts that resemble attacks get GPU 0: node, libraries that dlopen, exact cgroup rules."""
    outcome = rig.run(rig.container(GPU0, GPU_PROBE, prepare=prepare, readonly=readonly))
    aliases = {"/lib/": "/usr/lib/"} if prepare is merged_usr else None  # firmware lands where /lib leads
    rig.check_gpu(outcome, [0], libs_dir=LIBS_DIR, aliases=aliases)


def test_non_debian_layout_gets_its_gpu_in_usr_lib64(rig: Rig, generic_rootfs_src: Path) -> None:
    """A non-Debian image (no /etc/debian_version) gets its libraries in /usr/lib64, as NVIDIA does."""
    outcome = rig.run(rig.container(GPU0, GPU_PROBE, rootfs_src=generic_rootfs_src))
    rig.check_gpu(outcome, [0], libs_dir="/usr/lib64")

"""Corpus E: ldconfig and the binaries the hook runs (security.md §4 E40-E42)."""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from gpuhook.apply.ldelf import sample_library

from .conftest import Progs
from .rig import GPU0, GPU_PROBE, LIBS_DIR, Rig

HOST_LDCONFIG = Path("/sbin/ldconfig")


def test_container_ldconfig_is_never_executed(rig: Rig) -> None:
    """E40: every ldconfig the image ships is a script leaving markers; none runs, and the host's rebuilds the cache."""
    host_marker = rig.outside / "ldconfig-ran"
    script = f"#!/bin/sh\necho ran > {host_marker}\necho ran > /ldconfig-ran\nexit 0\n"

    def prepare(rootfs: Path) -> None:
        for rel in ("sbin/ldconfig", "sbin/ldconfig.real", "usr/sbin/ldconfig", "usr/bin/ldconfig"):
            (rootfs / rel).unlink(missing_ok=True)
            (rootfs / rel).write_text(script)
            (rootfs / rel).chmod(0o755)

    container = rig.container(GPU0, GPU_PROBE, prepare=prepare)
    outcome = rig.run(container)
    rig.check_gpu(outcome, [0])  # dlopen works: a real ldconfig rebuilt the container's cache
    assert not host_marker.exists() and not (container.rootfs / "ldconfig-ran").exists()


def test_host_ldconfig_is_unchanged_by_gpu_runs(rig: Rig) -> None:
    """E41: after GPU containers ran the host's ldconfig, the binary is byte-identical (same inode, mode, hash)."""
    configured = yaml.safe_load(rig.base_config.read_text()).get("ldconfig", str(HOST_LDCONFIG))
    assert configured == str(HOST_LDCONFIG), "the runs below must use the host's own ldconfig"
    for _ in range(2):
        outcome = rig.run(rig.container(GPU0, GPU_PROBE), watch=[HOST_LDCONFIG, HOST_LDCONFIG.resolve()])
        rig.check_gpu(outcome, [0])  # dlopen works: ldconfig ran


def test_ld_so_conf_poisoning_stays_in_the_rootfs(rig: Rig, progs: Progs) -> None:
    """E42: ld.so.conf(.d)/ld.so.cache symlinked to the host's and ``/proc/1/root/...`` entries change no host file."""
    # /proc/1 in the container's procfs is its init, whose root is still the host's / while prestart
    # hooks run (before pivot_root): an ldconfig that can see that procfs would scan, and write
    # SONAME links into, the host directory named below.
    libs = rig.outside / "libs"
    libs.mkdir()
    shutil.copy(progs.libmarker, libs / progs.libmarker.name)

    def prepare(rootfs: Path) -> None:
        etc = rootfs / "etc"
        shutil.rmtree(etc / "ld.so.conf.d")
        (etc / "ld.so.conf.d").symlink_to("/etc/ld.so.conf.d")
        (etc / "ld.so.cache").unlink()
        (etc / "ld.so.cache").symlink_to("/etc/ld.so.cache")
        (etc / "ld.so.conf").write_text(
            "include /proc/1/root/etc/ld.so.conf.d/*.conf\n"
            f"/proc/1/root{libs}\n"
            f"/proc/self/root{libs}\n"
            "include /etc/ld.so.conf.d/*.conf\n"
            "include /etc/ld.so.conf\n"
        )

    watch = [Path("/etc/ld.so.cache"), Path("/etc/ld.so.conf"), Path("/etc/ld.so.conf.d")]
    outcome = rig.run(rig.container(GPU0, GPU_PROBE, prepare=prepare), watch=watch, timeout=15)
    assert sorted(p.name for p in libs.iterdir()) == [progs.libmarker.name], "ldconfig wrote into a host dir"
    if outcome.started:
        rig.check_gpu(outcome, [0])
    else:
        outcome.assert_refused("ldconfig")


def _host_interfaces() -> set[str]:
    return {p.name for p in Path("/sys/class/net").iterdir()}


def test_ldconfig_runs_in_the_containers_network_namespace(rig: Rig, progs: Progs) -> None:
    """E40 (CVE-2024-0137 ran ldconfig in the host's network namespace): ldconfig sees only the
    container's loopback, never the host's interfaces. (Its host name cannot tell the UTS namespace:
    runc sets the container's only after the prestart hooks.)"""
    assert _host_interfaces() != {"lo"}, "the host needs an interface besides lo for this test to mean anything"
    outcome = rig.run(rig.container(GPU0, config=rig.config(ldconfig=progs.nsprobe)))
    outcome.assert_refused("ldconfig")  # nsprobe exits 1 after reporting
    assert "ifaces=lo,;" in outcome.hook_error, outcome.hook_error


def test_ldconfig_of_a_host_network_container_gets_a_fresh_network_namespace(rig: Rig, progs: Progs) -> None:
    """A container on the host's network (and UTS) namespace: ldconfig gets fresh ones, never the host's
    (where it would see eth0 and the rest)."""
    def host_namespaces(spec: dict[str, object]) -> None:
        linux = spec["linux"]
        assert isinstance(linux, dict)
        linux["namespaces"] = [ns for ns in linux["namespaces"] if ns["type"] not in ("network", "uts")]
        spec.pop("hostname", None)

    outcome = rig.run(rig.container(GPU0, config=rig.config(ldconfig=progs.nsprobe), edit_spec=host_namespaces))
    outcome.assert_refused("ldconfig")
    assert "ifaces=lo,;" in outcome.hook_error, outcome.hook_error


# --- E43: nothing in the image can block ldconfig --------------------------------------------------
# glibc's ldconfig fopen()s ld.so.conf and each include match, and open()s every symlink in the
# directories it scans (and creates ld.so.cache~ and aux-cache~): a FIFO there blocked it until its
# deadline, holding a gpuhookd worker; a node like a serial tty (c 4:64, which waits for carrier)
# blocked it in open likewise.


def _fifo(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def _node(path: Path, major: int, minor: int) -> None:
    path.unlink(missing_ok=True)
    os.mknod(path, 0o644 | stat.S_IFCHR, os.makedev(major, minor))


def _link(path: Path, target: str) -> None:
    path.unlink(missing_ok=True)
    path.symlink_to(target)


def _lib_link_to_fifo(rootfs: Path) -> None:
    _fifo(rootfs / "opt/fifo")
    (rootfs / LIBS_DIR.lstrip("/") / "libfifo.so.1").symlink_to("/opt/fifo")  # on ldconfig's command line
    (rootfs / "usr/lib/libfifo2.so").symlink_to("../../opt/fifo")  # a trusted directory
    (rootfs / "usr/lib/tls").symlink_to("/opt/fifo")  # a hwcap name: ldconfig opens it as a library


def _include(rootfs: Path) -> Path:
    (rootfs / "etc/ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
    return rootfs / "etc/ld.so.conf.d"


def _conf_link_to_fifo(rootfs: Path) -> None:
    _fifo(rootfs / "opt/conf")
    _link(rootfs / "etc/ld.so.conf", "/opt/conf")


def _relative_include_fifo(rootfs: Path) -> None:
    (rootfs / "etc/ld.so.conf").write_text("include sub/*.conf\n")  # relative to the including file's dir
    _fifo(rootfs / "etc/sub/a.conf")


_IMAGES: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "lib-symlink-to-fifo": (_lib_link_to_fifo, ("opt/fifo",)),
    "ld.so.conf-fifo": (lambda r: _fifo(r / "etc/ld.so.conf"), ("etc/ld.so.conf",)),
    "ld.so.conf-symlink-to-fifo": (_conf_link_to_fifo, ("opt/conf",)),
    "included-conf-fifo": (lambda r: _fifo(_include(r) / "x.conf"), ("etc/ld.so.conf.d/x.conf",)),
    "relative-include-fifo": (_relative_include_fifo, ("etc/sub/a.conf",)),
    "aux-cache-temp-fifo": (lambda r: _fifo(r / "var/cache/ldconfig/aux-cache~"), ("var/cache/ldconfig/aux-cache~",)),
    "ld.so.conf-null-device": (lambda r: _node(r / "etc/ld.so.conf", 1, 3), ("etc/ld.so.conf",)),
    "ld.so.conf-serial-tty": (lambda r: _node(r / "etc/ld.so.conf", 4, 64), ("etc/ld.so.conf",)),
}


@pytest.mark.parametrize("image", list(_IMAGES))
def test_nothing_in_the_image_blocks_ldconfig(rig: Rig, image: str) -> None:
    """E43: FIFOs and device nodes where ldconfig reads (its conf, includes, library symlinks, the
    files it writes) neither block it nor get opened: the container starts with its GPU, fast, and
    the special files are still there, untouched."""
    prepare, specials = _IMAGES[image]
    container = rig.container(GPU0, GPU_PROBE, prepare=prepare)
    before = {rel: os.lstat(container.rootfs / rel) for rel in specials}
    outcome = rig.run(container)
    rig.check_gpu(outcome, [0])
    for rel, old in before.items():
        new = os.lstat(container.rootfs / rel)
        assert (new.st_ino, new.st_mode, new.st_rdev) == (old.st_ino, old.st_mode, old.st_rdev), rel
    assert "timed out" not in outcome.result.stderr, outcome.result.stderr


def test_a_soname_climbing_out_of_the_rootfs_links_inside_it(rig: Rig) -> None:
    """E44: a library whose SONAME climbs out of the rootfs (``../`` past its root, to a host directory with a
    symlink in it) gets its link where ldconfig's chroot puts it, inside the rootfs: the host's symlink is not
    replaced and no link appears beside it (the oracle checks every host file outside the rootfs)."""
    victim_dir = rig.outside / "sonames"
    victim_dir.mkdir()
    (victim_dir / "libvictim.so.1").symlink_to("host-target.so.1")
    climb = "../" * (len(rig.tmp.parts) + 8)  # from LIBS_DIR, well past the root whatever the depth
    inner = f"{climb}{str(victim_dir).lstrip('/')}"

    def prepare(rootfs: Path) -> None:
        libs = rootfs / LIBS_DIR.lstrip("/")
        (libs / "libvictim.so.1.0").write_bytes(sample_library(f"{inner}/libvictim.so.1".encode()))
        (libs / "libnew.so.1.0").write_bytes(sample_library(f"{inner}/libnew.so.1".encode()))
        (rootfs / str(victim_dir).lstrip("/")).mkdir(parents=True)  # where the chroot leads them

    container = rig.container(GPU0, GPU_PROBE, prepare=prepare)
    rig.check_gpu(rig.run(container), [0])
    assert os.readlink(victim_dir / "libvictim.so.1") == "host-target.so.1"
    assert sorted(p.name for p in victim_dir.iterdir()) == ["libvictim.so.1"]
    inside = container.rootfs / str(victim_dir).lstrip("/")
    assert {p.name: os.readlink(p) for p in inside.iterdir()} == {"libvictim.so.1": "libvictim.so.1.0",
                                                                   "libnew.so.1": "libnew.so.1.0"}


def test_a_fifo_ldconfig_never_reads_does_not_matter(rig: Rig) -> None:
    """E43: FIFOs where ldconfig does not open them (a FIFO itself in a library directory, which it
    skips; a FIFO in a directory it never scans) are left alone: the container starts."""
    def prepare(rootfs: Path) -> None:
        _fifo(rootfs / LIBS_DIR.lstrip("/") / "libplain.so.1")
        _fifo(rootfs / "srv/libelsewhere.so.1")
        (rootfs / "srv/libelsewhere.so").symlink_to("libelsewhere.so.1")

    rig.check_gpu(rig.run(rig.container(GPU0, GPU_PROBE, prepare=prepare)), [0])

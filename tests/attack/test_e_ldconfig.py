"""Corpus E: ldconfig and the binaries the hook runs (security.md §4 E40-E42)."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from .conftest import Progs
from .rig import GPU0, GPU_PROBE, Rig

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

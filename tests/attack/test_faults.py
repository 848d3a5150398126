"""Fault injection: each privileged apply step fails in turn, and gpuhook leaves nothing behind."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from integration.engines import unique_id

from .conftest import Progs
from .rig import GPU0, GPU_PROBE, HERE, Outcome, Rig, hook_entry, snapshot

SYS_MKNODAT = 259
SYS_MOVE_MOUNT = 429
CGROUP_ROOT = Path("/sys/fs/cgroup")
EPERM = os.strerror(errno.EPERM)


def run_rolled_back(rig: Rig, **container_args: Any) -> Outcome:
    """Run a GPU 0 container that must be refused, and check the rootfs is exactly as before (same inodes too)."""
    container = rig.container(GPU0, GPU_PROBE, **container_args)
    before = snapshot(container.rootfs)
    outcome = rig.run(container)
    outcome.assert_refused()
    after = snapshot(container.rootfs)
    assert after == before, "the refused container's rootfs changed: " + "; ".join(
        f"{k}: {before.get(k)} -> {after.get(k)}" for k in sorted(before.keys() | after.keys())
        if before.get(k) != after.get(k))
    return outcome


@pytest.mark.parametrize(
    ("nr", "step", "path"),
    [
        pytest.param(SYS_MOVE_MOUNT, "mount", "/", id="move_mount-fails"),
        pytest.param(SYS_MKNODAT, "mknod", "/dev/nvidia", id="mknodat-fails"),
    ],
)
def test_failing_syscall_is_rolled_back(hook_rig: Rig, nr: int, step: str, path: str) -> None:
    """A mount or mknod refused by the kernel (seccomp EPERM): refused naming the step, every earlier change undone.

    In-process only: the seccomp filter is on the hook process, where gpuhookd's worker is not."""
    rig = hook_rig
    hook = hook_entry(rig.base_config, wrapper=[str(HERE / "seccomp_wrap.py"), str(nr)])
    outcome = run_rolled_back(rig, hook=hook)
    assert outcome.hook_error.startswith(f"gpuhook: {step} {path}"), outcome.hook_error
    assert EPERM in outcome.hook_error


@pytest.fixture
def gpu_denying_parent() -> Iterator[str]:
    """A devices cgroup that denies every 195:* device; containers placed below it cannot be granted a GPU."""
    name = unique_id("gpuhook-attack-parent")
    devices = CGROUP_ROOT / "devices" / name
    devices.mkdir()
    try:
        (devices / "devices.deny").write_text("c 195:* rw")
        yield name
    finally:
        for controller in CGROUP_ROOT.iterdir():  # runc creates the parent in every controller
            parent = controller / name
            if parent.is_dir():
                for leaf in parent.iterdir():
                    if leaf.is_dir():
                        leaf.rmdir()
                parent.rmdir()
        assert not any((c / name).exists() for c in CGROUP_ROOT.iterdir())


def test_cgroup_write_refused_is_rolled_back(rig: Rig, gpu_denying_parent: str) -> None:
    """The device-cgroup write fails (parent cgroup denies 195:*): refused naming the cgroup step, nothing left."""
    parent_rules = (CGROUP_ROOT / "devices" / gpu_denying_parent / "devices.list").read_text()

    def edit(spec: dict[str, Any]) -> None:
        spec["linux"]["cgroupsPath"] = f"/{gpu_denying_parent}/ctr"

    outcome = run_rolled_back(rig, edit_spec=edit)
    assert "cgroup" in outcome.hook_error and EPERM in outcome.hook_error, outcome.hook_error
    assert (CGROUP_ROOT / "devices" / gpu_denying_parent / "devices.list").read_text() == parent_rules
    assert not (CGROUP_ROOT / "devices" / gpu_denying_parent / "ctr").exists()


def test_a_start_failing_after_its_lease_went_active_gives_it_back(rig: Rig, progs: Progs,
                                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    """GPU 0 exclusive: the lease goes active once the device cgroup is granted, while the apply child works;
    the child's last step (ldconfig) then fails: refused, the rootfs as before, and no lease left."""
    state_dir = tmp_path_factory.mktemp("leases") / "state"  # outside the tree the rig's oracles watch
    config = rig.config(ldconfig=progs.exit1, state_dir=state_dir, gpus=[{"device": 0, "sharing": "exclusive"}])
    outcome = run_rolled_back(rig, config=config)
    assert outcome.hook_error.startswith("gpuhook: ldconfig"), outcome.hook_error
    assert json.loads((state_dir / "leases.json").read_text())["leases"] == []


def test_failing_ldconfig_is_rolled_back(rig: Rig, progs: Progs) -> None:
    """The last step, ldconfig, fails (a static binary exiting 1): refused naming ldconfig, mounts and nodes undone."""
    outcome = run_rolled_back(rig, config=rig.config(ldconfig=progs.exit1))
    assert outcome.hook_error.startswith("gpuhook: ldconfig"), outcome.hook_error
    assert "boom" in outcome.hook_error

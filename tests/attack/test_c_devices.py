"""Corpus C: device selection and the device cgroup (security.md §4 C22-C30)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from integration.fakehost import FakeHost, create_host

from .rig import GPU_PROBE, Outcome, Rig

NO_SUCH_UUID = "00000000-0000-0000-0000-000000000000"


def assert_names(outcome: Outcome, value: str) -> None:
    """Refused, and the message names *value* (verbatim or as its Python repr)."""
    outcome.assert_refused()
    assert value in outcome.hook_error or repr(value) in outcome.hook_error, (value, outcome.hook_error)


# --- C22: policy ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("privileged", [False, True], ids=["C22-unprivileged-gets-nothing", "C22-privileged-control"])
def test_envvar_refused_by_policy_when_unprivileged(rig: Rig, privileged: bool) -> None:
    """C22: with ``accept_envvar_when_unprivileged: false`` an unprivileged ``=all`` gets nothing (privileged: all)."""
    config = rig.config(accept_envvar_when_unprivileged=False)
    outcome = rig.run(rig.container({"NVIDIA_VISIBLE_DEVICES": "all"}, GPU_PROBE, config=config,
                                    privileged=privileged))
    if privileged:
        rig.check_gpu(outcome, [0, 1, 2, 3])
    else:
        rig.check_no_gpu(outcome)
        assert "/dev/nvidiactl ENOENT" in outcome.stdout


# --- C23-C25, C27, C29, C30: refused values ----------------------------------------------------------------

REFUSED_DEVICES = [
    # C23: values that would map to broad or foreign cgroup rules
    pytest.param("/dev/sda", id="C23-dev-sda"),
    pytest.param("nvidia.com/gpu=../../sda", id="C23-cdi-traversal-sda"),
    pytest.param("a", id="C23-a"),
    pytest.param("*", id="C23-star"),
    pytest.param("b 8:0", id="C23-block-rule"),
    pytest.param("c 1:1 rwm", id="C23-char-rule"),
    # C24: GPUs this host does not have (no partial grant)
    pytest.param("7", id="C24-index-7"),
    pytest.param("0,7", id="C24-0-and-7"),
    pytest.param(f"GPU-{NO_SUCH_UUID}", id="C24-unknown-uuid"),
    # C25: MIG devices that do not exist (MIG mode is off)
    pytest.param(f"MIG-{NO_SUCH_UUID}", id="C25-unknown-mig-uuid"),
    pytest.param("0:99", id="C25-mig-index-0:99"),
    # C27: malformed lists
    pytest.param("-1", id="C27-minus-1"),
    pytest.param("\uff10", id="C27-fullwidth-zero"),
    pytest.param("\u0663", id="C27-arabic-indic-three"),
    pytest.param("1_0", id="C27-underscore"),
    pytest.param("0x1", id="C27-hex"),
    pytest.param("+1", id="C27-plus"),
    pytest.param("1e3", id="C27-exponent"),
    pytest.param("0;rm -rf /", id="C27-shell-semicolon"),
    pytest.param("$(reboot)", id="C27-shell-subst"),
    pytest.param("`id`", id="C27-backticks"),
    pytest.param("0,--help", id="C27-option-entry"),
    pytest.param("--device=all", id="C27-option-value"),
    pytest.param("0\n1", id="C27-newline"),
    pytest.param("ALL", id="C27-uppercase-all"),
    # C30: CDI names with traversal
    pytest.param("nvidia.com/gpu=../../etc", id="C30-cdi-dotdot-etc"),
    pytest.param("vendor.com/../x=0", id="C30-cdi-dotdot-vendor"),
    pytest.param("cdi/../../x", id="C30-cdi-prefix-dotdot"),
]


@pytest.mark.parametrize("value", REFUSED_DEVICES)
def test_bad_device_value_is_refused(rig: Rig, value: str) -> None:
    """A NVIDIA_VISIBLE_DEVICES value outside the grammar, or naming no GPU here, is refused with the value named."""
    outcome = rig.run(rig.container({"NVIDIA_VISIBLE_DEVICES": value}))
    assert_names(outcome, value)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        pytest.param("NVIDIA_DRIVER_CAPABILITIES", "compute,../../x", id="C29-capability-traversal"),
        pytest.param("NVIDIA_DRIVER_CAPABILITIES", "all,display,evil", id="C29-unknown-capability-after-all"),
        pytest.param("NVIDIA_REQUIRE_CUDA", "cuda>=0 || $(x)", id="C29-require-shell"),
        # C25: MIG control from an unprivileged container is refused (NVIDIA's hook panics likewise).
        pytest.param("NVIDIA_MIG_CONFIG_DEVICES", "all", id="C25-mig-config-unprivileged"),
        pytest.param("NVIDIA_MIG_MONITOR_DEVICES", "all", id="C25-mig-monitor-unprivileged"),
    ],
)
def test_capability_and_require_injection_is_refused(rig: Rig, variable: str, value: str) -> None:
    """Unknown capabilities and require expressions outside the grammar are refused, naming the value."""
    outcome = rig.run(rig.container({"NVIDIA_VISIBLE_DEVICES": "0", variable: value}))
    assert_names(outcome, value)


# --- C25, C27: accepted values behave as NVIDIA's --------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "gpus"),
    [
        pytest.param({"NVIDIA_VISIBLE_DEVICES": " 0"}, [0], id="C27-leading-blank-trimmed"),
        pytest.param({"NVIDIA_VISIBLE_DEVICES": "0,0,0"}, [0], id="C27-duplicates-collapse"),
        pytest.param({"NVIDIA_VISIBLE_DEVICES": "all,0"}, [0, 1, 2, 3], id="C27-all-first-wins"),
        pytest.param({"NVIDIA_VISIBLE_DEVICES": "none,0"}, [], id="C27-none-first-wins"),
    ],
)
def test_accepted_values_grant_exactly(rig: Rig, env: dict[str, str], gpus: list[int]) -> None:
    """Accepted values grant exactly NVIDIA's devices: the listed GPUs, control nodes, no MIG extras."""
    outcome = rig.run(rig.container(env, GPU_PROBE + "; test -e /dev/nvidia-caps || echo no-mig-caps"))
    rig.check_gpu(outcome, gpus)
    assert "no-mig-caps" in outcome.stdout


@pytest.mark.parametrize("value", ["void", ""], ids=["C27-void", "C27-empty"])
def test_void_and_empty_leave_the_container_untouched(rig: Rig, value: str) -> None:
    """``void`` and the empty value mean no GPU request at all: nothing injected, no cgroup change."""
    outcome = rig.run(rig.container({"NVIDIA_VISIBLE_DEVICES": value}, GPU_PROBE))
    rig.check_no_gpu(outcome)
    assert "/dev/nvidiactl ENOENT" in outcome.stdout


# --- C26: the host's own nodes do not match ------------------------------------------------------------


def _tampered_host(parent: Path, tamper: str) -> FakeHost:
    """A 2-GPU simulated host whose /dev/nvidia1 or /dev/nvidia-uvm has the wrong numbers."""
    host = create_host(parent / tamper, gpus=2)
    node, (major, minor) = {
        "nvidia1-is-c195:7": ("nvidia1", (195, 7)),
        "nvidia1-is-dev-null": ("nvidia1", (1, 3)),
        "stale-uvm-major": ("nvidia-uvm", (host.uvm_major + 1, 0)),
    }[tamper]
    path = host.root / "dev" / node
    path.unlink()
    os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(major, minor))
    return host


@pytest.fixture(scope="module")
def tampered_hosts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, FakeHost]:
    """The three tampered hosts, built once for this module."""
    parent = tmp_path_factory.mktemp("tampered")
    return {t: _tampered_host(parent, t) for t in ("nvidia1-is-c195:7", "nvidia1-is-dev-null", "stale-uvm-major")}


@pytest.mark.parametrize("tamper", ["nvidia1-is-c195:7", "nvidia1-is-dev-null", "stale-uvm-major"])
def test_host_node_mismatch_is_refused(rig: Rig, tampered_hosts: dict[str, FakeHost], tamper: str) -> None:
    """C26: a host node whose rdev is not what the driver says (wrong minor, /dev/null, stale uvm major) is refused."""
    host = tampered_hosts[tamper]
    node = "nvidia-uvm" if tamper == "stale-uvm-major" else "nvidia1"
    outcome = rig.run(rig.container({"NVIDIA_VISIBLE_DEVICES": "1"}, config=host.config_path))
    outcome.assert_refused(f"/dev/{node}")

"""NVIDIA_VISIBLE_DEVICES, NVIDIA_DRIVER_CAPABILITIES and friends → GpuRequest."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuhook.errors import RequestError
from gpuhook.oci.spec import BundleSpec, MountSpec
from gpuhook.request.model import (
    ALL_CAPABILITIES, DEFAULT_CAPABILITIES, Capability, GpuIndex, GpuUuid, MigIndex, MigUuid,
)
from gpuhook.request.parse import parse_capabilities, parse_request, parse_visible_devices
from gpuhook.request.quick import asks_for_gpu
import contextlib

UUID = "GPU-1a2b3c4d-0000-1111-2222-333344445555"
MIG = "MIG-1a2b3c4d-0000-1111-2222-333344445555"


def spec(env: dict[str, str], *, privileged: bool = False, mounts: tuple[MountSpec, ...] = ()) -> BundleSpec:
    """A bundle spec with just what the parser reads."""
    return BundleSpec(env=env, rootfs=Path("/r"), privileged=privileged, mounts=mounts)


def raw(env: dict[str, str], mounts: tuple[MountSpec, ...] = ()) -> dict[str, object]:
    """The config.json object the fast path sees."""
    return {"process": {"env": [f"{k}={v}" for k, v in env.items()]},
            "mounts": [{"destination": m.destination, "source": m.source, "type": m.type} for m in mounts]}


def request(env: dict[str, str], **kw: bool):  # type: ignore[no-untyped-def]
    """parse_request with NVIDIA's default policy unless overridden."""
    policy = {"accept_envvar_when_unprivileged": True, "accept_volume_mounts": False} | kw
    return parse_request(spec(env, privileged=bool(kw.get("privileged"))), **{
        k: v for k, v in policy.items() if k != "privileged"})


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param("", None, id="empty-is-void"),
        pytest.param(" , ,", None, id="only-commas-is-void"),
        pytest.param("void", None, id="void"),
        pytest.param("0,void", None, id="void-anywhere-wins"),
        pytest.param("all", (True, ()), id="all"),
        pytest.param("none", (False, ()), id="none"),
        pytest.param("0,all", (True, ()), id="all-in-list"),
        pytest.param("none,all", (False, ()), id="first-of-all-none-wins"),
        pytest.param("1, 3", (False, (GpuIndex(1), GpuIndex(3))), id="indices-trimmed"),
        pytest.param("1,1", (False, (GpuIndex(1),)), id="duplicates-dropped"),
        pytest.param("GPU-" + UUID[4:].upper(), (False, (GpuUuid("GPU-" + UUID[4:].upper()),)), id="gpu-uuid"),
        pytest.param(MIG, (False, (MigUuid(MIG),)), id="mig-uuid"),
        pytest.param(f"MIG-{UUID}/1/0", (False, (MigUuid(f"MIG-{UUID}/1/0"),)), id="legacy-mig-uuid"),
        pytest.param("0:1", (False, (MigIndex(0, 1),)), id="mig-index"),
    ],
)
def test_visible_devices(raw: str, expected: object) -> None:
    """Every form of NVIDIA's contract (nvidia-toolkit.md §2.1)."""
    assert parse_visible_devices(raw) == expected


@pytest.mark.parametrize(
    "raw",
    ["٣", "1_0", "+3", "-1", "0x1", "GPU-1234", "gpu-" + UUID[4:], "00000", "0:", ":1", "all;rm", "nvidia0", "cdi/x=y"],
)
def test_malformed_devices_are_refused_by_name(raw: str) -> None:
    """Anything outside the grammar is refused with a message that names the value."""
    with pytest.raises(RequestError) as excinfo:
        parse_visible_devices(raw)
    assert repr(raw) in str(excinfo.value)


def test_capabilities() -> None:
    """Default utility,compute; all; none; legacy images get everything."""
    assert parse_capabilities(None) == DEFAULT_CAPABILITIES
    assert parse_capabilities("") == DEFAULT_CAPABILITIES
    assert parse_capabilities(None, legacy=True) == ALL_CAPABILITIES
    assert parse_capabilities("all") == ALL_CAPABILITIES
    assert parse_capabilities("none") == frozenset()
    assert parse_capabilities(" video , utility") == {Capability.VIDEO, Capability.UTILITY}


def test_unknown_capability_is_refused_with_the_list() -> None:
    """The message names the bad capability and lists the valid ones."""
    with pytest.raises(RequestError, match=r"unknown capability 'cuda'.*compat32, compute, display"):
        parse_capabilities("compute,cuda")
    with pytest.raises(RequestError, match=r"unknown capability 'evil'"):
        parse_capabilities("all,display,evil")


def test_unset_means_untouched() -> None:
    """No NVIDIA variables: no request, and the fast path says so too."""
    assert request({"PATH": "/bin"}) is None
    assert not asks_for_gpu(raw({"PATH": "/bin"}))


def test_legacy_image_gets_all_gpus_and_capabilities() -> None:
    """CUDA_VERSION without NVIDIA_REQUIRE_CUDA: all GPUs, all capabilities, cuda>= requirement."""
    req = request({"CUDA_VERSION": "11.0.3"})
    assert req is not None and req.all_devices and req.capabilities == ALL_CAPABILITIES
    assert [str(r) for r in req.requirements] == ["cuda>=11.0"]
    assert request({"CUDA_VERSION": "11.0", "NVIDIA_REQUIRE_CUDA": "cuda>=11.0"}) is None


def test_requirements_collected_and_disabled() -> None:
    """NVIDIA_REQUIRE_* are collected by name; NVIDIA_DISABLE_REQUIRE=true drops them."""
    env = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_REQUIRE_CUDA": "cuda>=12.0", "NVIDIA_REQUIRE_ARCH": "arch>=8.0"}
    req = request(env)
    assert req is not None and [str(r) for r in req.requirements] == ["arch>=8.0", "cuda>=12.0"]
    req = request(env | {"NVIDIA_DISABLE_REQUIRE": "true"})
    assert req is not None and req.requirements == ()


def test_unprivileged_env_request_can_be_refused() -> None:
    """With the NVIDIA policy switch off, only privileged containers may ask by env."""
    env = {"NVIDIA_VISIBLE_DEVICES": "all"}
    assert request(env, accept_envvar_when_unprivileged=False) is None
    assert request(env, accept_envvar_when_unprivileged=False, privileged=True) is not None


def test_volume_mount_list_takes_priority() -> None:
    """Device-plugin /dev/null mounts win over the env when accepted; imex entries are not GPUs."""
    mounts = (
        MountSpec(destination="/var/run/nvidia-container-devices/" + UUID, source="/dev/null", type="bind"),
        MountSpec(destination="/var/run/nvidia-container-devices/imex/3", source="/dev/null", type="bind"),
        MountSpec(destination="/var/run/nvidia-container-devices/1", source="/etc/passwd", type="bind"),
    )
    bundle = spec({"NVIDIA_VISIBLE_DEVICES": "all"}, mounts=mounts)
    req = parse_request(bundle, accept_envvar_when_unprivileged=False, accept_volume_mounts=True)
    assert req is not None and req.devices == (GpuUuid(UUID),) and not req.all_devices
    assert asks_for_gpu(raw({}, mounts=mounts))
    # Not accepted: the mounts are ignored and the (allowed) env decides.
    req = parse_request(bundle, accept_envvar_when_unprivileged=True, accept_volume_mounts=False)
    assert req is not None and req.all_devices


@given(st.text(max_size=60))
def test_any_device_string_parses_or_raises_our_error(raw: str) -> None:
    """Container input never produces another exception."""
    with contextlib.suppress(RequestError):
        parse_visible_devices(raw)


@given(st.text(max_size=60))
def test_any_capability_string_parses_or_raises_our_error(raw: str) -> None:
    """Container input never produces another exception."""
    with contextlib.suppress(RequestError):
        assert parse_capabilities(raw) <= ALL_CAPABILITIES


_ENV_KEYS = st.sampled_from(["NVIDIA_VISIBLE_DEVICES", "CUDA_VERSION", "NVIDIA_REQUIRE_CUDA",
                             "NVIDIA_DRIVER_CAPABILITIES",
                             "PATH"])
_ENV_VALUES = st.sampled_from(["", " ", "all", "none", "void", "0", "11.0", "cuda>=11.0", "compute"])
_MOUNTS = st.lists(st.builds(MountSpec, destination=st.sampled_from(
    ["/var/run/nvidia-container-devices/0", "/var/run/nvidia-container-devices/all", "/data", "/var/run/x"]),
    source=st.sampled_from(["/dev/null", "/src"]), type=st.just("bind")), max_size=2)


@given(st.dictionaries(_ENV_KEYS, _ENV_VALUES, max_size=4), _MOUNTS, st.booleans(), st.booleans())
def test_fast_path_never_skips_a_request(env: dict[str, str], mounts: list[MountSpec], unpriv: bool,
                                         volumes: bool) -> None:
    """Whenever the full parser would inject something, the fast path sends the container to it."""
    try:
        req = parse_request(spec(env, mounts=tuple(mounts)), accept_envvar_when_unprivileged=unpriv,
                            accept_volume_mounts=volumes)
    except RequestError:
        req = "refused"  # type: ignore[assignment]
    if req is not None:
        assert asks_for_gpu(raw(env, tuple(mounts)))


def test_imex_channels_and_gated_variables() -> None:
    """NVIDIA_IMEX_CHANNELS (decimal, 'all' ignored) and exactly-'enabled' gated variables."""
    req = request({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "3, 0,3", "NVIDIA_GDS": "enabled",
                   "NVIDIA_MOFED": "true"})
    assert req is not None and req.imex_channels == (3, 0) and req.gated == {"gds"}
    req = request({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "all"})
    assert req is not None and req.imex_channels == ()
    with pytest.raises(RequestError, match="'-1' is not a channel"):
        request({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "-1"})
    with pytest.raises(RequestError, match="below 1048576"):
        request({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "1048576"})
    unprivileged = request({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "1"},
                           accept_envvar_when_unprivileged=False, privileged=True)
    assert unprivileged is not None and unprivileged.imex_channels == (1,)


def test_mig_control_variables_need_privilege() -> None:
    """NVIDIA_MIG_CONFIG_DEVICES: refused unprivileged (NVIDIA's rule), only 'all' accepted."""
    env = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_MIG_CONFIG_DEVICES": "all"}
    with pytest.raises(RequestError, match="unprivileged container"):
        request(env)
    req = request(env, privileged=True)
    assert req is not None and req.mig_config and not req.mig_monitor
    with pytest.raises(RequestError, match="only 'all'"):
        request({**env, "NVIDIA_MIG_CONFIG_DEVICES": "0"}, privileged=True)


def test_cdi_annotations_take_priority_when_accepted() -> None:
    """cdi.k8s.io/* annotations naming nvidia.com/gpu=... decide the devices; other vendors are ignored."""
    bundle = BundleSpec(env={"NVIDIA_VISIBLE_DEVICES": "all"}, rootfs=Path("/r"), privileged=False, annotations=(
        ("cdi.k8s.io/gpu-plugin", "nvidia.com/gpu=1, nvidia.com/gpu=" + UUID),
        ("cdi.k8s.io/other", "vendor.com/fpga=0"),
        ("io.kubernetes.pod.name", "nvidia.com/gpu=3"),
    ))
    req = parse_request(bundle, accept_envvar_when_unprivileged=True, accept_volume_mounts=False,
                        accept_cdi_annotations=True)
    assert req is not None and req.devices == (GpuIndex(1), GpuUuid(UUID)) and req.source == "CDI annotations"
    assert asks_for_gpu({"process": {"env": []}, "annotations": dict(bundle.annotations)})
    ignored = parse_request(bundle, accept_envvar_when_unprivileged=True, accept_volume_mounts=False)
    assert ignored is not None and ignored.all_devices  # not accepted: the env decides

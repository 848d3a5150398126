"""Parse a container's GPU request, exactly as nvidia-toolkit.md §2 describes.

Sources, in NVIDIA's priority order (cuda_image.go ``VisibleDevices``):
1. device-plugin volume mounts under ``/var/run/nvidia-container-devices``
   (only when the config accepts them),
2. ``NVIDIA_VISIBLE_DEVICES`` (ignored in unprivileged containers when the
   config says so),
3. the legacy-image rule: ``CUDA_VERSION`` set and ``NVIDIA_REQUIRE_CUDA``
   unset means all GPUs and all capabilities.

This module finds the values and applies the container's policy (privilege,
the config's accept_* switches); the grammar of the values themselves (device
lists, IMEX channels, MIG control) is ``request.grammar``'s, shared with
``nvidia-container-cli``. It is strict: anything outside it is refused with a
message that names the value.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Final

from gpuhook.errors import RequestError
from gpuhook.oci.spec import BundleSpec
from gpuhook.request import quick
from gpuhook.request.grammar import decode_channels, decode_devices, decode_mig_control
from gpuhook.request.model import ALL_CAPABILITIES, DEFAULT_CAPABILITIES, Capability, GpuRequest, RequestSource
from gpuhook.request.quick import VISIBLE_DEVICES, is_legacy_image
from gpuhook.request.requirements import MAX_REQUIREMENTS, Requirement, parse_requirement

DRIVER_CAPABILITIES: Final = "NVIDIA_DRIVER_CAPABILITIES"
DISABLE_REQUIRE: Final = "NVIDIA_DISABLE_REQUIRE"
REQUIRE_PREFIX: Final = "NVIDIA_REQUIRE_"
DEVICE_LIST_DIR: Final = PurePosixPath(quick.DEVICE_LIST_DIR)

_TRUE: Final = frozenset({"1", "t", "T", "TRUE", "true", "True"})  # Go strconv.ParseBool
_BLANKS: Final = quick.BLANKS


def parse_request(
    spec: BundleSpec, *, accept_envvar_when_unprivileged: bool, accept_volume_mounts: bool,
    accept_cdi_annotations: bool = False, supported_capabilities: frozenset[Capability] = ALL_CAPABILITIES,
    disable_require: bool = False,
) -> GpuRequest | None:
    """The container's GPU request, or None when it asks for none ("void").

    *supported_capabilities* and *disable_require* are NVIDIA's supported-driver-capabilities and
    disable-require (the host's policy, not the image's).
    """
    env = spec.env
    legacy = is_legacy_image(env)
    raw, source = (_cdi_annotation_devices(spec) if accept_cdi_annotations else None), RequestSource.CDI_ANNOTATIONS
    if raw is None:
        raw, source = _device_source(spec, legacy, accept_envvar_when_unprivileged, accept_volume_mounts)
    if raw is None:
        return None
    devices = decode_devices(raw, source=source)
    if devices is None:
        return None
    return GpuRequest(
        all_devices=devices.all_devices,
        devices=devices.devices,
        count=devices.count,
        mig_asks=devices.mig_asks,
        capabilities=parse_capabilities(env.get(DRIVER_CAPABILITIES), legacy=legacy, supported=supported_capabilities),
        requirements=() if disable_require else parse_requirements(env, legacy=legacy),
        imex_channels=_imex_channels(env) if spec.privileged or accept_envvar_when_unprivileged else (),
        gated=frozenset(name for name in GATED if env.get(f"NVIDIA_{name.upper()}") == "enabled"),
        mig_config=_mig_control(env, MIG_CONFIG, privileged=spec.privileged),
        mig_monitor=_mig_control(env, MIG_MONITOR, privileged=spec.privileged),
        source=source,
        raw=raw,
    )


#: The feature-gated device families (nvidia-toolkit.md §2.5); the value must be exactly "enabled".
GATED: Final = ("gds", "mofed", "nvswitch", "gdrcopy")
IMEX_CHANNELS: Final = "NVIDIA_IMEX_CHANNELS"


MIG_CONFIG: Final = "NVIDIA_MIG_CONFIG_DEVICES"
MIG_MONITOR: Final = "NVIDIA_MIG_MONITOR_DEVICES"


def _mig_control(env: Mapping[str, str], name: str, *, privileged: bool) -> bool:
    """NVIDIA_MIG_CONFIG_DEVICES / _MONITOR_: only 'all', only in privileged containers (as NVIDIA)."""
    raw = env.get(name, "")
    value = raw.strip(_BLANKS)
    if value and not privileged:
        # Checked before the value: whatever it says, an unprivileged container may not have it.
        raise RequestError(
            f"{name}={value!r} in an unprivileged container: it grants control of every MIG instance of the GPUs; "
            "run the container privileged (CAP_SYS_ADMIN) or unset it"
        )
    return decode_mig_control(raw, source=name)


def _imex_channels(env: Mapping[str, str]) -> tuple[int, ...]:
    """NVIDIA_IMEX_CHANNELS: decimal channel ids below 2^20; "all" is ignored, as NVIDIA does."""
    decoded = decode_channels(env.get(IMEX_CHANNELS, ""), source=IMEX_CHANNELS)
    return () if decoded.all_channels else decoded.channels


def _cdi_annotation_devices(spec: BundleSpec) -> str | None:
    """The ``nvidia.com/gpu`` names in ``cdi.k8s.io/*`` annotations, as a device list (None if there are none).

    First in NVIDIA's priority order (cuda_image.go); names are the ones ``gpuhook cdi generate`` writes
    (index, UUID, MIG index or UUID, all), so the usual device grammar reads them.
    """
    names = [
        item.strip(_BLANKS).split("=", 1)[1]
        for key, value in spec.annotations if key.startswith(quick.CDI_ANNOTATION_PREFIX)
        for item in value.split(",") if item.strip(_BLANKS).startswith(quick.CDI_KIND + "=")
    ]
    return ",".join(dict.fromkeys(names)) or None


def _device_source(
    spec: BundleSpec, legacy: bool, accept_envvar_when_unprivileged: bool, accept_volume_mounts: bool
) -> tuple[str | None, RequestSource]:
    """The raw device list and where it came from (nvidia-toolkit.md §2.2)."""
    if accept_volume_mounts:
        listed = [_device_list_entry(m.destination) for m in spec.mounts if m.source == "/dev/null"]
        names = list(dict.fromkeys(n for n in listed if n is not None and not n.startswith("imex/")))
        if names:
            return ",".join(names), RequestSource.VOLUME_MOUNTS
    if not spec.privileged and not accept_envvar_when_unprivileged:
        return None, RequestSource.VISIBLE_DEVICES
    if VISIBLE_DEVICES in spec.env:
        return spec.env[VISIBLE_DEVICES], RequestSource.VISIBLE_DEVICES
    if legacy:
        return "all", RequestSource.LEGACY_IMAGE
    return None, RequestSource.VISIBLE_DEVICES


def _device_list_entry(destination: str) -> str | None:
    """The device name of a device-plugin mount destination, or None if it is not one."""
    path = PurePosixPath(destination)
    try:
        name = path.relative_to(DEVICE_LIST_DIR)
    except ValueError:
        return None
    return str(name) if str(name) != "." else None


def parse_capabilities(raw: str | None, *, legacy: bool = False,
                       supported: frozenset[Capability] = ALL_CAPABILITIES) -> frozenset[Capability]:
    """NVIDIA_DRIVER_CAPABILITIES, narrowed to the host's *supported* set (as NVIDIA's hook does).

    Unset or empty means utility,compute (all for legacy images); ``all`` means *supported*.
    """
    return _requested_capabilities(raw, legacy=legacy) & supported


def _requested_capabilities(raw: str | None, *, legacy: bool) -> frozenset[Capability]:
    """The capabilities NVIDIA_DRIVER_CAPABILITIES names (every one for ``all``)."""
    if raw is None:
        return ALL_CAPABILITIES if legacy else DEFAULT_CAPABILITIES
    names = [n.strip(_BLANKS) for n in raw.split(",")]
    names = [n for n in names if n]
    if not names:
        return DEFAULT_CAPABILITIES
    caps: set[Capability] = set()
    for name in names:
        if name in ("none", "all"):
            continue
        try:
            caps.add(Capability(name))
        except ValueError:
            known = ", ".join(sorted(c.value for c in Capability))
            raise RequestError(
                f"{DRIVER_CAPABILITIES}={raw!r}: unknown capability {name!r}; "
                f"expected a comma-separated list of {known}, or 'all'"
            ) from None
    return ALL_CAPABILITIES if "all" in names else frozenset(caps)


def parse_requirements(env: Mapping[str, str], *, legacy: bool) -> tuple[Requirement, ...]:
    """The NVIDIA_REQUIRE_* expressions (sorted by name), plus the legacy CUDA_VERSION rule."""
    if env.get(DISABLE_REQUIRE, "") in _TRUE:
        return ()
    named = sorted((name, value) for name, value in env.items()
                   if name.startswith(REQUIRE_PREFIX) and name != "NVIDIA_REQUIRE_JETPACK" and value.strip(_BLANKS))
    if len(named) > MAX_REQUIREMENTS:  # counted before any is parsed: parsing is the cost bounded
        raise RequestError(
            f"the image sets {len(named)} {REQUIRE_PREFIX}* variables ({named[0][0]}, ..., {named[-1][0]}); the "
            f"limit is {MAX_REQUIREMENTS}: set only the ones the image needs (factors joined by ',' in one "
            "variable must all hold), or NVIDIA_DISABLE_REQUIRE=true to skip the image's requirements"
        )
    found = [parse_requirement(name, value) for name, value in named]
    if legacy:
        match = re.fullmatch(r"([0-9]{1,4})\.([0-9]{1,4})(?:\.[0-9]{1,6})?", env["CUDA_VERSION"].strip(_BLANKS))
        if match is None:
            raise RequestError(
                f"CUDA_VERSION={env['CUDA_VERSION']!r}: expected a version like 12.4 or 12.4.1 "
                "(legacy images derive their cuda>= requirement from it)"
            )
        found.append(parse_requirement("CUDA_VERSION", f"cuda>={match[1]}.{match[2]}"))
    return tuple(found)

"""Parse a container's GPU request, exactly as nvidia-toolkit.md §2 describes.

Sources, in NVIDIA's priority order (cuda_image.go ``VisibleDevices``):
1. device-plugin volume mounts under ``/var/run/nvidia-container-devices``
   (only when the config accepts them),
2. ``NVIDIA_VISIBLE_DEVICES`` (ignored in unprivileged containers when the
   config says so),
3. the legacy-image rule: ``CUDA_VERSION`` set and ``NVIDIA_REQUIRE_CUDA``
   unset means all GPUs and all capabilities.

The grammar is strict: every entry is an index, a ``GPU-``/``MIG-`` UUID, a
``G:M`` MIG index or one of ``all``/``none``/``void``; anything else is
refused with a message that names the value. Digits are ASCII only, because
Python's ``int()`` also accepts "٣", "1_0" and " +3 " (security.md §3.4).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Final

from gpuhook.errors import RequestError
from gpuhook.oci.spec import BundleSpec
from gpuhook.request import quick
from gpuhook.request.quick import VISIBLE_DEVICES, is_legacy_image
from gpuhook.request.model import (
    ALL_CAPABILITIES,
    DEFAULT_CAPABILITIES,
    Capability,
    DeviceId,
    GpuIndex,
    GpuRequest,
    GpuUuid,
    MigIndex,
    MigUuid,
)
from gpuhook.request.requirements import Requirement, parse_requirement

DRIVER_CAPABILITIES: Final = "NVIDIA_DRIVER_CAPABILITIES"
DISABLE_REQUIRE: Final = "NVIDIA_DISABLE_REQUIRE"
REQUIRE_PREFIX: Final = "NVIDIA_REQUIRE_"
DEVICE_LIST_DIR: Final = PurePosixPath(quick.DEVICE_LIST_DIR)

_UUID: Final = r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
_INDEX_RE: Final = re.compile(r"[0-9]{1,4}")
_CHANNEL_RE: Final = re.compile(r"[0-9]{1,7}")
_GPU_UUID_RE: Final = re.compile(rf"GPU-{_UUID}")
_MIG_UUID_RE: Final = re.compile(rf"MIG-{_UUID}|MIG-GPU-{_UUID}/[0-9]{{1,4}}/[0-9]{{1,4}}")
_MIG_INDEX_RE: Final = re.compile(r"([0-9]{1,4}):([0-9]{1,4})")
_TRUE: Final = frozenset({"1", "t", "T", "TRUE", "true", "True"})  # Go strconv.ParseBool
_BLANKS: Final = quick.BLANKS

ACCEPTED_FORMS: Final = (
    "'all', 'none', 'void', or a comma-separated list of GPU indices (0,1), "
    "GPU UUIDs (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx), MIG UUIDs (MIG-…) or MIG indices (0:1)"
)


def parse_request(
    spec: BundleSpec, *, accept_envvar_when_unprivileged: bool, accept_volume_mounts: bool,
    accept_cdi_annotations: bool = False,
) -> GpuRequest | None:
    """The container's GPU request, or None when it asks for none ("void")."""
    env = spec.env
    legacy = is_legacy_image(env)
    raw, source = (_cdi_annotation_devices(spec) if accept_cdi_annotations else None), "CDI annotations"
    if raw is None:
        raw, source = _device_source(spec, legacy, accept_envvar_when_unprivileged, accept_volume_mounts)
    if raw is None:
        return None
    devices = parse_visible_devices(raw, source=source)
    if devices is None:
        return None
    all_devices, ids = devices
    return GpuRequest(
        all_devices=all_devices,
        devices=ids,
        capabilities=parse_capabilities(env.get(DRIVER_CAPABILITIES), legacy=legacy),
        requirements=parse_requirements(env, legacy=legacy),
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
_MAX_IMEX_CHANNEL: Final = 1 << 20


MIG_CONFIG: Final = "NVIDIA_MIG_CONFIG_DEVICES"
MIG_MONITOR: Final = "NVIDIA_MIG_MONITOR_DEVICES"


def _mig_control(env: Mapping[str, str], name: str, *, privileged: bool) -> bool:
    """NVIDIA_MIG_CONFIG_DEVICES / _MONITOR_: only 'all', only in privileged containers (as NVIDIA)."""
    value = env.get(name, "").strip(_BLANKS)
    if not value:
        return False
    if not privileged:
        raise RequestError(
            f"{name}={value!r} in an unprivileged container: it grants control of every MIG instance of the GPUs; "
            "run the container privileged (CAP_SYS_ADMIN) or unset it"
        )
    if value != "all":
        raise RequestError(f"{name}={value!r}: only 'all' is supported")
    return True


def _imex_channels(env: Mapping[str, str]) -> tuple[int, ...]:
    """NVIDIA_IMEX_CHANNELS: decimal channel ids below 2^20; "all" is ignored, as NVIDIA does."""
    raw = env.get(IMEX_CHANNELS, "")
    entries = [e.strip(_BLANKS) for e in raw.split(",") if e.strip(_BLANKS)]
    if not entries or "all" in entries:
        return ()
    channels = []
    for entry in entries:
        if not _CHANNEL_RE.fullmatch(entry) or int(entry) >= _MAX_IMEX_CHANNEL:
            raise RequestError(
                f"{IMEX_CHANNELS}={raw!r}: {entry!r} is not a channel; expected comma-separated decimal ids "
                f"below {_MAX_IMEX_CHANNEL}"
            )
        channels.append(int(entry))
    return tuple(dict.fromkeys(channels))


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
) -> tuple[str | None, str]:
    """The raw device list and where it came from (nvidia-toolkit.md §2.2)."""
    if accept_volume_mounts:
        listed = [_device_list_entry(m.destination) for m in spec.mounts if m.source == "/dev/null"]
        names = list(dict.fromkeys(n for n in listed if n is not None and not n.startswith("imex/")))
        if names:
            return ",".join(names), f"volume mounts under {DEVICE_LIST_DIR}"
    if not spec.privileged and not accept_envvar_when_unprivileged:
        return None, VISIBLE_DEVICES
    if VISIBLE_DEVICES in spec.env:
        return spec.env[VISIBLE_DEVICES], VISIBLE_DEVICES
    if legacy:
        return "all", "the legacy CUDA_VERSION image rule"
    return None, VISIBLE_DEVICES


def _device_list_entry(destination: str) -> str | None:
    """The device name of a device-plugin mount destination, or None if it is not one."""
    path = PurePosixPath(destination)
    try:
        name = path.relative_to(DEVICE_LIST_DIR)
    except ValueError:
        return None
    return str(name) if str(name) != "." else None


def parse_visible_devices(raw: str, *, source: str = VISIBLE_DEVICES) -> tuple[bool, tuple[DeviceId, ...]] | None:
    """``(all, ids)`` for a device list, or None for void (unset-equivalent)."""
    entries = [e.strip(_BLANKS) for e in raw.split(",")]
    entries = [e for e in entries if e]
    if not entries or "void" in entries:
        return None
    for entry in entries:
        if entry in ("all", "none"):
            # NVIDIA: the first of all/none encountered decides.
            return (True, ()) if entry == "all" else (False, ())
    return False, tuple(dict.fromkeys(_parse_device_id(e, raw, source) for e in entries))


def _parse_device_id(entry: str, raw: str, source: str) -> DeviceId:
    """One entry of a device list."""
    if _INDEX_RE.fullmatch(entry):
        return GpuIndex(int(entry))
    if _GPU_UUID_RE.fullmatch(entry):
        return GpuUuid(entry)
    if _MIG_UUID_RE.fullmatch(entry):
        return MigUuid(entry)
    if match := _MIG_INDEX_RE.fullmatch(entry):
        return MigIndex(int(match[1]), int(match[2]))
    if entry.startswith("cdi/") or "=" in entry:
        raise RequestError(
            f"{source}={raw!r}: {entry!r} is a CDI device name; gpuhook's hook takes indices or UUIDs. "
            "Fix: request the GPU by index or UUID, or let a CDI-aware engine apply the CDI spec"
        )
    raise RequestError(f"{source}={raw!r}: {entry!r} is not a device; expected {ACCEPTED_FORMS}")


def parse_capabilities(raw: str | None, *, legacy: bool = False) -> frozenset[Capability]:
    """NVIDIA_DRIVER_CAPABILITIES; unset or empty means utility,compute (all for legacy images)."""
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
    found = [
        parse_requirement(name, value)
        for name, value in sorted(env.items())
        if name.startswith(REQUIRE_PREFIX) and name != "NVIDIA_REQUIRE_JETPACK" and value.strip(_BLANKS)
    ]
    if legacy:
        match = re.fullmatch(r"([0-9]{1,4})\.([0-9]{1,4})(?:\.[0-9]{1,6})?", env["CUDA_VERSION"].strip(_BLANKS))
        if match is None:
            raise RequestError(
                f"CUDA_VERSION={env['CUDA_VERSION']!r}: expected a version like 12.4 or 12.4.1 "
                "(legacy images derive their cuda>= requirement from it)"
            )
        found.append(parse_requirement("CUDA_VERSION", f"cuda>={match[1]}.{match[2]}"))
    return tuple(found)

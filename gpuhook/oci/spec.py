"""The parts of a bundle's config.json that decide GPU injection."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from gpuhook.errors import SpecError
from gpuhook.oci import strictjson

SPEC_LIMIT: Final = strictjson.SPEC_LIMIT


@dataclass(frozen=True, slots=True, kw_only=True)
class MountSpec:
    """One entry of config.json ``mounts``."""

    destination: str
    source: str
    type: str


@dataclass(frozen=True, slots=True, kw_only=True)
class BundleSpec:
    """The container's environment, root filesystem, privilege and mounts."""

    env: Mapping[str, str]
    rootfs: Path
    privileged: bool
    mounts: tuple[MountSpec, ...] = ()
    #: (major, minor) of character devices the runtime itself creates and allows rw
    runtime_devices: frozenset[tuple[int, int]] = frozenset()
    #: config.json ``annotations`` (the device plugin's cdi-annotations strategy writes its choice here)
    annotations: tuple[tuple[str, str], ...] = ()


def parse_spec(data: bytes, bundle: Path) -> BundleSpec:
    """Decode config.json; a relative root.path is taken relative to *bundle*."""
    return spec_from_object(strictjson.loads_object(data, what=f"{bundle}/config.json", limit=SPEC_LIMIT), bundle)


def spec_from_object(obj: Mapping[str, Any], bundle: Path) -> BundleSpec:
    """Check and convert an already decoded config.json object."""
    what = f"{bundle}/config.json"
    for key in ("ociVersion", "process", "root"):
        if key not in obj:
            raise SpecError(f"{what}: missing {key!r}; is this an OCI bundle?")
    process = strictjson.get_obj(obj, "process", what=what)
    linux = strictjson.get_obj(obj, "linux", what=what)
    root_path = strictjson.get_str(strictjson.get_obj(obj, "root", what=what), "path", what=what)
    check_path(root_path, f"{what}: root.path")
    rootfs = Path(root_path) if root_path.startswith("/") else bundle / root_path
    return BundleSpec(
        env=_parse_env(strictjson.get_list(process, "env", what=what), what),
        rootfs=rootfs,
        privileged=_has_sys_admin(process.get("capabilities"), what),
        mounts=tuple(_parse_mount(m, what) for m in strictjson.get_list(obj, "mounts", what=what)),
        runtime_devices=_runtime_devices(linux, what),
        annotations=_annotations(strictjson.get_obj(obj, "annotations", what=what), what),
    )


def _annotations(raw: Mapping[str, Any], what: str) -> tuple[tuple[str, str], ...]:
    """annotations as sorted (key, value) string pairs."""
    if not all(isinstance(v, str) for v in raw.values()):
        raise SpecError(f"{what}: annotations must map strings to strings")
    return tuple(sorted(raw.items()))


def _parse_env(entries: list[Any], what: str) -> dict[str, str]:
    """KEY=VALUE strings to a mapping; like execve, a later duplicate wins."""
    env: dict[str, str] = {}
    for entry in entries:
        if not isinstance(entry, str):
            raise SpecError(f"{what}: process.env entries must be strings, got {entry!r}")
        key, sep, value = entry.partition("=")
        if not sep or not key:
            raise SpecError(f"{what}: process.env entry {entry[:80]!r} is not KEY=VALUE")
        env[key] = value
    return env


def check_path(path: str, what: str) -> None:
    """A path the hook will open: encodable for the kernel and free of NUL."""
    try:
        raw = path.encode("utf-8", "surrogateescape")  # what os.fsencode does on Linux
    except UnicodeEncodeError as err:
        raise SpecError(f"{what} {path!r} is not a valid file name") from err
    if b"\0" in raw:
        raise SpecError(f"{what} {path!r} contains a NUL byte")


def _has_sys_admin(caps: Any, what: str) -> bool:
    """NVIDIA's privileged rule: CAP_SYS_ADMIN in the bounding set.

    Specs before runtime-spec 1.0.0-rc5 carried a flat list instead of sets;
    NVIDIA's hook accepts both (container_config.go GetCapabilities).
    """
    if caps is None:
        return False
    if isinstance(caps, list):
        bounding = caps
    elif isinstance(caps, dict):
        bounding = strictjson.get_list(caps, "bounding", what=what)
    else:
        raise SpecError(f"{what}: process.capabilities must be an object, got {caps!r}")
    return "CAP_SYS_ADMIN" in bounding


def _runtime_devices(linux: Mapping[str, Any], what: str) -> frozenset[tuple[int, int]]:
    """Char devices in ``linux.devices`` whose last matching ``resources.devices`` rule allows rw.

    The runtime creates these nodes and programs the cgroup for them itself (the
    spec-edit mode puts the GPUs here), so the hook leaves them alone.
    """
    nodes = set()
    for entry in strictjson.get_list(linux, "devices", what=what):
        if isinstance(entry, dict) and entry.get("type") == "c":
            major, minor = strictjson.get_int(entry, "major", what=what), strictjson.get_int(entry, "minor", what=what)
            if major is not None and minor is not None:
                nodes.add((major, minor))
    rules = strictjson.get_list(strictjson.get_obj(linux, "resources", what=what), "devices", what=what)
    return frozenset(node for node in nodes if _allowed(node, rules))


def _allowed(node: tuple[int, int], rules: list[Any]) -> bool:
    """runc's reading of resources.devices: the last rule that matches decides; null numbers match all."""
    verdict = False
    for rule in rules:
        if not isinstance(rule, dict) or rule.get("type", "a") not in ("a", "c"):
            continue
        if rule.get("major") not in (None, node[0]) or rule.get("minor") not in (None, node[1]):
            continue
        access = rule.get("access", "rwm")
        if rule.get("allow") is True and isinstance(access, str) and {"r", "w"} <= set(access):
            verdict = True
        elif rule.get("allow") is False:
            verdict = False
    return verdict


def _parse_mount(entry: Any, what: str) -> MountSpec:
    """One mounts[] object."""
    if not isinstance(entry, dict):
        raise SpecError(f"{what}: mounts entries must be objects, got {entry!r}")
    return MountSpec(
        destination=strictjson.get_str(entry, "destination", what=what),
        source=strictjson.get_str(entry, "source", what=what, default=""),
        type=strictjson.get_str(entry, "type", what=what, default=""),
    )


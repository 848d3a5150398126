"""CDI spec generation: the planner's answers, rendered as a Container Device Interface spec.

Pure: an inventory, the live facts and a placement target in, a spec dict out (no I/O). Each
device's edits come from ``plan_devices`` on a request for that one device, and
the spec-level edits from ``make_plan`` on a ``none`` request with the default
capabilities (utility, compute), so CDI and the hook inject the same files and
nodes. The container's ld.so.cache, which a runtime cannot build from a spec, is a
``createContainer`` hook back into gpuhook; what is still left out (the masked
/proc/driver/nvidia, the development symlinks, CUDA compat) ``Rendered.not_covered`` names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from gpuhook.inventory import HostDevice, Inventory, LiveFacts, narrow_to_live
from gpuhook.planning.plan import BindMount, DeviceNode, Plan
from gpuhook.planning.planner import Target, make_plan, plan_devices
from gpuhook.request.model import DEFAULT_CAPABILITIES, DeviceId, GpuIndex, GpuRequest, GpuUuid, MigIndex, MigUuid

KIND: Final = "nvidia.com/gpu"
ALL: Final = "all"
MOUNT_OPTIONS: Final = ("ro", "nosuid", "nodev", "bind")
#: top-level env: a legacy hook that also runs (hooks.d ``always``) then leaves the container alone (as NVIDIA)
SPEC_ENV: Final = ("NVIDIA_VISIBLE_DEVICES=void",)
#: the hook's own environment: no PYTHON*/LD_* (gpuhook refuses them), a fixed PATH
HOOK_ENV: Final = ("PATH=/usr/sbin:/usr/bin:/sbin:/bin",)
#: CDI device names (parser.ValidateDeviceName): alphanumeric ends; ``-_.:`` inside (``:`` for MIG ``G:M``)
_NAME_RE: Final = re.compile(r"[A-Za-z0-9]([-_.:A-Za-z0-9]*[A-Za-z0-9])?")

#: newest first: the first version whose new fields the spec uses is its minimum (SPEC.md table)
_VERSIONS: Final = ("1.1.0", "0.7.0", "0.6.0", "0.5.0", "0.4.0", "0.3.0")


@dataclass(frozen=True, slots=True, kw_only=True)
class Rendered:
    """A spec dict, the fully qualified device names, and what the spec cannot express."""

    spec: dict[str, Any]
    names: tuple[str, ...]
    not_covered: tuple[str, ...]


def device_ids(inventory: Inventory) -> list[tuple[str, DeviceId | None]]:
    """(CDI name, request id) for each GPU by index and UUID, each MIG device by G:M and UUID, then ``all`` (None)."""
    out: list[tuple[str, DeviceId | None]] = []
    for gpu in inventory.gpus:
        out += [(str(gpu.index), GpuIndex(gpu.index)), (gpu.uuid, GpuUuid(gpu.uuid))]
    for mig in inventory.mig_devices:
        out += [(f"{mig.parent_index}:{mig.index}", MigIndex(mig.parent_index, mig.index)),
                (mig.uuid, MigUuid(mig.uuid))]
    # a legacy MIG-GPU-<uuid>/<gi>/<ci> UUID has '/', which no CDI name may hold; its G:M name still covers it
    return [(name, ident) for name, ident in out if _NAME_RE.fullmatch(name)] + [(ALL, None)]


def render_spec(inventory: Inventory, live: LiveFacts, target: Target,
                hook_argv: Sequence[str] | None = None) -> Rendered:
    """The ``nvidia.com/gpu`` spec for every device of *inventory* that exists now, libraries placed as *target* says.

    *live* holds the MIG layout and capability nodes (``LiveNeeds(mig=True)``): the spec names
    the MIG devices that exist when it is written.

    *hook_argv* (absolute program first) is how the runtime runs gpuhook; with it, a
    ``createContainer`` hook ``... cdi-hook update-ldcache --folder DIR`` rebuilds the
    container's ld.so.cache, which no spec field can do.
    """
    inventory = narrow_to_live(inventory, live)
    driver = make_plan(GpuRequest(all_devices=False, devices=(), capabilities=DEFAULT_CAPABILITIES, raw="none"),
                       inventory, live, target)
    shared = {(d.major, d.minor) for d in driver.devices}
    host_paths = _host_paths(inventory, live)
    devices = []
    for name, ident in device_ids(inventory):
        request = GpuRequest(all_devices=ident is None, devices=() if ident is None else (ident,),
                             capabilities=DEFAULT_CAPABILITIES, raw=name)
        nodes = [d for d in plan_devices(request, inventory, live).devices if (d.major, d.minor) not in shared]
        devices.append({"name": name, "containerEdits": {"deviceNodes": [_node(d, host_paths) for d in nodes]}})
    edits: dict[str, Any] = {
        "env": list(SPEC_ENV),
        "deviceNodes": [_node(d, host_paths) for d in driver.devices],
        "mounts": [_mount(m) for m in driver.mounts],
    }
    covered: tuple[str, ...] = ()
    if hook_argv is not None and driver.ldconfig is not None:
        edits["hooks"] = [ldcache_hook(hook_argv, driver.ldconfig.dirs)]
        covered = (_ldcache_item(driver.ldconfig.dirs),)
    spec: dict[str, Any] = {"cdiVersion": "", "kind": KIND, "devices": devices, "containerEdits": edits}
    spec["cdiVersion"] = minimum_version(spec)
    not_covered = tuple(item for item in _not_covered(driver) if item not in covered)
    return Rendered(spec=spec, names=tuple(f"{KIND}={d['name']}" for d in devices), not_covered=not_covered)


def ldcache_hook(hook_argv: Sequence[str], dirs: Sequence[str]) -> dict[str, Any]:
    """The createContainer hook that runs the host's ldconfig over *dirs* in the container's rootfs."""
    if not hook_argv or not hook_argv[0].startswith("/"):
        raise ValueError(f"a CDI hook path must be absolute, not {hook_argv[:1]!r}")
    args = [*hook_argv, "cdi-hook", "update-ldcache", *(a for d in dirs for a in ("--folder", d))]
    return {"hookName": "createContainer", "path": hook_argv[0], "args": args, "env": list(HOOK_ENV)}


def minimum_version(spec: dict[str, Any]) -> str:
    """The lowest cdiVersion that covers the fields *spec* uses (specs-go ``MinimumRequiredVersion``)."""
    all_edits = [spec.get("containerEdits") or {}] + [d.get("containerEdits") or {} for d in spec.get("devices", ())]
    nodes = [n for e in all_edits for n in e.get("deviceNodes") or ()]
    mounts = [m for e in all_edits for m in e.get("mounts") or ()]
    checks = {
        "1.1.0": any(e.get("netDevices") for e in all_edits)
        or any({"schemata", "enableMonitoring"} & set(e.get("intelRdt") or {}) for e in all_edits),
        "0.7.0": any(e.get("intelRdt") or e.get("additionalGids") for e in all_edits),
        "0.6.0": bool(spec.get("annotations")) or any(d.get("annotations") for d in spec.get("devices", ()))
        or "." in spec.get("kind", "/").split("/", 1)[1],
        "0.5.0": any("hostPath" in n for n in nodes) or any(d["name"][:1].isdigit() for d in spec.get("devices", ())),
        "0.4.0": any("type" in m for m in mounts),
    }
    return next((v for v in _VERSIONS if checks.get(v)), "0.3.0")


def _host_paths(inventory: Inventory, live: LiveFacts) -> dict[tuple[int, int], str]:
    """(major, minor) → the node's host path, for every node the planner can pick."""
    every: Iterable[HostDevice] = (*inventory.control_nodes, *inventory.gpu_nodes, *live.caps_nodes,
                                   *live.extra_nodes)
    return {(n.major, n.minor): str(n.host_path) for n in every}


def _node(device: DeviceNode, host_paths: dict[tuple[int, int], str]) -> dict[str, Any]:
    """A CDI deviceNode: the container path, the host node, and the exact numbers (so no stat is needed)."""
    node: dict[str, Any] = {"path": device.path}
    host = host_paths.get((device.major, device.minor))
    # hostPath only when it differs: a spec without it stays valid for the oldest readers
    if host is not None and host != device.path:
        node["hostPath"] = host
    node.update({"type": "c", "major": device.major, "minor": device.minor, "fileMode": device.mode,
                 "permissions": "rw"})
    return node


def _mount(mount: BindMount) -> dict[str, Any]:
    """A read-only, nosuid, nodev bind mount (noexec too for firmware, sockets and config files)."""
    options = [*MOUNT_OPTIONS[:3], *(("noexec",) if mount.noexec else ()), MOUNT_OPTIONS[3]]
    return {"hostPath": mount.source, "containerPath": mount.target, "options": options}


def _not_covered(plan: Plan) -> tuple[str, ...]:
    """The parts of the hook's plan a CDI spec has no field for (they need a createContainer hook)."""
    out = []
    if plan.ldconfig is not None:
        out.append(_ldcache_item(plan.ldconfig.dirs))
    out += [f"symlink {s.path} -> {s.target}" for s in plan.symlinks]
    if plan.proc_driver is not None:
        out.append(f"the masked {plan.proc_driver.target} (ModifyDeviceFiles: 0)")
    if plan.cuda_compat is not None:
        out.append(f"CUDA forward compatibility from {plan.cuda_compat.directory}")
    return tuple(out)


def _ldcache_item(dirs: Sequence[str]) -> str:
    """How ``not_covered`` names the ld.so.cache step."""
    return f"the container's ld.so.cache for {', '.join(dirs)}"

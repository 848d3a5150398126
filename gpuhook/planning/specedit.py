"""Render the device part of a plan as config.json edits, so the runtime owns the GPU devices.

Rules a hook adds behind the runtime's back are lost whenever the runtime or
systemd re-applies the container's device policy: with the systemd cgroup
driver, ``systemctl daemon-reload`` re-applies ``DeviceAllow=`` and the
container sees "Failed to initialize NVML: Unknown Error" (NVIDIA's most
reported problem). Written into ``linux.devices`` and
``linux.resources.devices`` before the runtime starts, the nodes are created by
the runtime and the rules are part of the unit systemd keeps. Pure: dict in,
dict out.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from gpuhook.planning.plan import DeviceNode


def add_devices(spec: Mapping[str, Any], devices: Sequence[DeviceNode],
                env: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    """A copy of *spec* with *devices* in linux.devices and exact rw allow rules, and *env* set in
    process.env (replacing the image's value of each name); idempotent."""
    out = copy.deepcopy(dict(spec))
    if env:
        process = out.setdefault("process", {})
        names = {name for name, _ in env}
        process["env"] = [item for item in process.get("env", []) if not (isinstance(item, str)
                                                                          and item.split("=", 1)[0] in names)]
        process["env"] += [f"{name}={value}" for name, value in env]
    linux = out.setdefault("linux", {})
    nodes = linux.setdefault("devices", [])
    rules = linux.setdefault("resources", {}).setdefault("devices", [])
    have_nodes = {entry.get("path") for entry in nodes if isinstance(entry, dict)}
    for device in devices:
        if device.path not in have_nodes:
            nodes.append({"path": device.path, "type": "c", "major": device.major, "minor": device.minor,
                          "fileMode": device.mode, "uid": 0, "gid": 0})
        rule = {"allow": True, "type": "c", "major": device.major, "minor": device.minor, "access": "rw"}
        if rule not in rules:
            rules.append(rule)
    return out

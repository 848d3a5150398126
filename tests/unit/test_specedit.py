"""add_devices: the plan's devices as config.json edits."""

from __future__ import annotations

from gpuhook.planning.plan import DeviceNode
from gpuhook.planning.specedit import add_devices

NODES = (DeviceNode(path="/dev/nvidiactl", major=195, minor=255), DeviceNode(path="/dev/nvidia1", major=195, minor=1))


def test_devices_and_exact_rules_are_added_without_touching_the_input() -> None:
    """Nodes go to linux.devices, exact rw rules after the runtime's own; the input is not mutated."""
    spec = {"ociVersion": "1.0.2", "linux": {"resources": {"devices": [{"allow": False, "access": "rwm"}]}}}
    edited = add_devices(spec, NODES)
    assert spec == {"ociVersion": "1.0.2", "linux": {"resources": {"devices": [{"allow": False, "access": "rwm"}]}}}
    assert [d["path"] for d in edited["linux"]["devices"]] == ["/dev/nvidiactl", "/dev/nvidia1"]
    assert edited["linux"]["resources"]["devices"][1:] == [
        {"allow": True, "type": "c", "major": 195, "minor": 255, "access": "rw"},
        {"allow": True, "type": "c", "major": 195, "minor": 1, "access": "rw"},
    ]
    assert add_devices(edited, NODES) == edited

"""The OCI runtime state a hook reads on stdin (runtime-spec runtime.md "State")."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from gpuhook.errors import SpecError
from gpuhook.oci import strictjson
from gpuhook.oci.spec import check_path

STATE_LIMIT: Final = strictjson.STATE_LIMIT
WHAT: Final = "the OCI state on stdin"
#: PID_MAX_LIMIT on 64-bit kernels (include/linux/threads.h): no pid is larger.
PID_MAX: Final = 1 << 22


@dataclass(frozen=True, slots=True, kw_only=True)
class ContainerState:
    """What the runtime says about the container being created."""

    id: str
    pid: int | None
    bundle: Path
    status: str
    annotations: tuple[tuple[str, str], ...] = ()


def parse_state(data: bytes) -> ContainerState:
    """Decode the state JSON (runc, crun, docker, podman forms)."""
    return state_from_object(strictjson.loads_object(data, what=WHAT, limit=STATE_LIMIT))


def state_from_object(obj: Mapping[str, Any]) -> ContainerState:
    """Check and convert an already decoded state object."""
    what = WHAT
    # Docker before 17.06 wrote "bundlePath"; NVIDIA's hook still accepts it.
    bundle_key = "bundle" if "bundle" in obj else "bundlePath"
    bundle = strictjson.get_str(obj, bundle_key, what=what)
    if not bundle.startswith("/"):
        raise SpecError(f"{what}: bundle {bundle!r} must be an absolute path")
    check_path(bundle, f"{what}: bundle")
    container_id = strictjson.get_str(obj, "id", what=what, default="")
    pid = strictjson.get_int(obj, "pid", what=what)
    if pid is not None and pid > PID_MAX:
        raise SpecError(f"{what}: pid {pid} is larger than any Linux pid ({PID_MAX})")
    annotations = strictjson.get_obj(obj, "annotations", what=what)
    if not all(isinstance(v, str) for v in annotations.values()):
        raise SpecError(f"{what}: annotations must map strings to strings")
    return ContainerState(
        id=container_id,
        pid=pid or None,  # crun's createContainer state says 0: no host pid
        bundle=Path(bundle),
        status=strictjson.get_str(obj, "status", what=what, default=""),
        annotations=tuple(sorted(annotations.items())),
    )

"""``gpuhook doctor``: checks with a verdict and, for every problem, the fix (pure decisions).

The facts are gathered by ``cli/doctor.py``; this module only decides, so
every verdict is unit-tested without a GPU or systemd.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol


class Verdict(enum.StrEnum):
    """How a check came out."""

    OK = "ok"
    NOTE = "note"  # works; an optional set-up would make it better (never a failure)
    WARN = "warn"
    FAIL = "FAIL"


@dataclass(frozen=True, slots=True, kw_only=True)
class Check:
    """One line of the report."""

    name: str
    verdict: Verdict
    message: str
    fix: str = ""

    def render(self) -> str:
        """``[ ok ] name: message`` plus the fix on problems."""
        line = f"[{self.verdict.value:^4}] {self.name}: {self.message}"
        return f"{line}\n       fix: {self.fix}" if self.fix else line


class Mount(Protocol):
    """What the cgroup checks read of one mount (``gpuhook.sys.mountinfo.MountInfo`` rows have it)."""

    @property
    def mount_point(self) -> str:
        """Where the mount is attached."""
        ...

    @property
    def fs_type(self) -> str:
        """Its filesystem type (``cgroup``, ``cgroup2``, ...)."""
        ...


def cgroup_mode(mounts: Iterable[Mount]) -> str:
    """'v2' (unified), 'hybrid' (v1 controllers plus a cgroup2 mount) or 'v1', from the hook's mounts in mount order."""
    kinds = {row.mount_point: row.fs_type for row in mounts}  # a later mount covers an earlier one
    if kinds.get("/sys/fs/cgroup") == "cgroup2":
        return "v2"
    has_v1 = any(kind == "cgroup" for kind in kinds.values())
    has_v2 = any(kind == "cgroup2" for kind in kinds.values())
    return "hybrid" if has_v1 and has_v2 else "v1"


def cgroup_driver(*, pid1: str, mode: str, docker_daemon_json: str | None, containerd_toml: str | None) -> str:
    """'systemd' or 'cgroupfs': what the engines on this host most likely use.

    Without systemd as PID 1 nothing can use the systemd driver. With it, docker
    and containerd pick systemd when configured to, and docker defaults to it on
    cgroup v2.
    """
    if pid1 != "systemd":
        return "cgroupfs"
    if docker_daemon_json:
        try:
            opts = json.loads(docker_daemon_json).get("exec-opts", [])
        except (ValueError, AttributeError):
            opts = []
        if "native.cgroupdriver=systemd" in opts:
            return "systemd"
    if containerd_toml and re.search(r"(?m)^\s*SystemdCgroup\s*=\s*true", containerd_toml):
        return "systemd"
    return "systemd" if mode == "v2" else "cgroupfs"


def cgroup_checks(mode: str, driver: str) -> tuple[Check, ...]:
    """The cgroup version, the driver, and the daemon-reload exposure with its fix."""
    version = Check(name="cgroup", verdict=Verdict.OK, message={
        "v2": "cgroup v2 (unified): device access is an eBPF program; gpuhook extends the runtime's",
        "hybrid": "cgroup v1 with a cgroup2 mount (hybrid): device access is v1 devices.allow",
        "v1": "cgroup v1: device access is devices.allow",
    }[mode])
    if driver == "systemd":
        exposure = Check(
            name="daemon-reload", verdict=Verdict.WARN,
            message="the systemd cgroup driver re-applies each unit's DeviceAllow= on `systemctl daemon-reload`, "
            "dropping device rules a hook added: running GPU containers then fail with "
            "\"Failed to initialize NVML: Unknown Error\"",
            fix="let the runtime own the GPU devices: register `gpuhook precreate` (podman hooks.d stage precreate) "
            "or run `gpuhook spec-edit --bundle` from a runtime wrapper, or use CDI devices",
        )
    else:
        exposure = Check(name="daemon-reload", verdict=Verdict.OK,
                         message="cgroupfs driver: systemd never re-applies the containers' device rules")
    return (version, Check(name="cgroup driver", verdict=Verdict.OK, message=driver), exposure)


def engine_checks(installed: dict[str, bool], registered: dict[str, bool]) -> tuple[Check, ...]:
    """For each container engine on the host: is gpuhook registered with it, and how to do it if not."""
    out = []
    for engine, present in installed.items():
        if not present:
            continue
        if registered.get(engine):
            out.append(Check(name=f"engine {engine}", verdict=Verdict.OK, message="gpuhook is registered"))
        else:
            out.append(Check(name=f"engine {engine}", verdict=Verdict.WARN, message="gpuhook is not registered",
                             fix=f"gpuhook install --runtime {engine} (add --dry-run to see the change first)"))
    return tuple(out)


def cdi_checks(found: dict[str, Any], fresh: Any) -> tuple[Check, ...]:
    """Each gpuhook CDI spec on the host (path → parsed content) against a freshly rendered one."""
    out = []
    for path, spec in sorted(found.items()):
        if spec == fresh:
            out.append(Check(name="cdi", verdict=Verdict.OK, message=f"{path} matches the host"))
        else:
            out.append(Check(name="cdi", verdict=Verdict.WARN,
                             message=f"{path} is stale: CDI containers would get devices or files the host does "
                             "not have any more",
                             fix=f"gpuhook cdi generate --output {path} (or enable gpuhook-cdi-refresh.path)"))
    return tuple(out)


def persistence_check(off: list[int]) -> Check:
    """Persistence mode: off means NVML's initialisation costs seconds whenever it is asked."""
    if not off:
        return Check(name="persistence", verdict=Verdict.OK, message="persistence mode is on (or not reported)")
    gpus = ", ".join(map(str, off))
    return Check(
        name="persistence", verdict=Verdict.WARN,
        message=f"persistence mode is off on GPU {gpus}: each NVML start re-initialises the GPUs (seconds); "
        "gpuhook's inventory cache avoids it per container, but the first start after a driver change pays it",
        fix="systemctl enable --now nvidia-persistenced",
    )


#: What a GPU container start costs without gpuhookd: the hook imports the GPU path itself.
_IMPORT_COST = "Python's imports (about 45 ms)"


def gpuhookd_check(path: str, *, served: str | None, version: str, why: str = "") -> Check:
    """gpuhookd at *path*: serving *version* (ok), an older or newer one (restart it), or none (a notice).

    *served* is the version the daemon answered a ping with, None when it did not (*why* says why).
    The hook falls back to doing the work itself in both bad cases, so neither is a failure.
    """
    if served is None:
        return Check(name="gpuhookd", verdict=Verdict.NOTE,
                     message=f"{why}: each GPU container start pays {_IMPORT_COST} in the hook",
                     fix="systemctl enable --now gpuhookd.socket")
    if served != version:
        return Check(name="gpuhookd", verdict=Verdict.WARN,
                     message=f"gpuhookd {served} serves {path} but this is gpuhook {version}: it declines every "
                     f"request until restarted, and each GPU container start pays {_IMPORT_COST} meanwhile",
                     fix="systemctl restart gpuhookd.service")
    return Check(name="gpuhookd", verdict=Verdict.OK, message=f"gpuhookd {served} serves {path}")

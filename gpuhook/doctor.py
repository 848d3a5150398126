"""``gpuhook doctor``: checks with a verdict and, for every problem, the fix (pure decisions).

The facts are gathered by ``cli/doctor.py``; this module only decides, so
every verdict is unit-tested without a GPU or systemd.
"""

from __future__ import annotations

import enum
import json
import re
import tomllib
from collections.abc import Iterable, Sequence
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


def nvidia_config_check(path: str, *, read: bool, warnings: Sequence[str], notes: int) -> Check:
    """NVIDIA's config.toml: the keys gpuhook cannot act on (*warnings*: their lines), or that it is not read."""
    name = "nvidia-config"
    if not read:
        return Check(name=name, verdict=Verdict.NOTE, message=(
            f"{path} exists but gpuhook reads its own configuration, not this file"),
            fix=f"`gpuhook config import --from {path} --dry-run` shows what it sets, in gpuhook.yaml's terms")
    also = f"; {notes} more at NVIDIA's default (nothing lost)" if notes else ""
    if not warnings:
        return Check(name=name, verdict=Verdict.OK, message=f"{path}: no key of it is lost{also}")
    listed = "".join(f"\n         {line}" for line in warnings)
    return Check(name=name, verdict=Verdict.WARN, message=(
        f"{path}: {len(warnings)} key(s) have no gpuhook effect{also}:{listed}"),
        fix="remove them, or set their gpuhook equivalent (`gpuhook config show`, `gpuhook config import`)")


# --- does each engine really see gpuhook (facts gathered by cli/enginecheck.py) -------------------------------

#: Where containerd's CRI plugin keeps its runtime handlers: 1.x (config version 2) and 2.x (version 3).
_CRI_RUNTIMES = (("io.containerd.grpc.v1.cri", "containerd", "runtimes"),
                 ("io.containerd.cri.v1.runtime", "containerd", "runtimes"))


def containerd_runtimes(dump: str) -> dict[str, str]:
    """Runtime handler name → its BinaryName ('' for none), from ``containerd config dump``; raises ValueError."""
    plugins = tomllib.loads(dump).get("plugins", {})
    found: dict[str, str] = {}
    for keys in _CRI_RUNTIMES:
        table: Any = plugins
        for key in keys:
            table = table.get(key, {}) if isinstance(table, dict) else {}
        for name, runtime in (table.items() if isinstance(table, dict) else ()):
            options = runtime.get("options", {}) if isinstance(runtime, dict) else {}
            binary = options.get("BinaryName", "") if isinstance(options, dict) else ""
            found[str(name)] = binary if isinstance(binary, str) else ""
    return found


def docker_runtimes(text: str) -> dict[str, str]:
    """Runtime name → path, from ``docker info --format '{{json .Runtimes}}'`` or daemon.json (its "runtimes");
    raises ValueError."""
    data = json.loads(text) if text.strip() else {}
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object")
    runtimes = data.get("runtimes", {}) if "runtimes" in data and isinstance(data.get("runtimes"), dict) else data
    return {str(name): str(entry.get("path", "")) for name, entry in runtimes.items() if isinstance(entry, dict)}


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineView:
    """What one engine on this host sees of gpuhook, and where that was read."""

    engine: str
    installed: bool
    #: runtime handlers (or hooks.d files) the engine has that run gpuhook
    handlers: tuple[str, ...] = ()
    #: where the engine was asked ("containerd config dump", "docker info", a file)
    source: str = ""
    #: why the engine could not be asked ('' when it answered)
    error: str = ""
    #: handlers written in the engine's config that the running engine has not loaded yet
    pending: tuple[str, ...] = ()
    #: gpuhook's files the engine reads that differ from what `gpuhook install` writes
    differs: tuple[str, ...] = ()


_RESTARTS = {"docker": "systemctl restart docker", "containerd": "systemctl restart containerd",
             "crio": "systemctl restart crio"}


def registration_checks(views: Iterable[EngineView]) -> tuple[Check, ...]:
    """One check per installed engine (ok / not registered, with the command / could not ask), and one line
    for the engines that are not installed."""
    out, absent = [], []
    for view in views:
        name = f"engine {view.engine}"
        install = f"gpuhook install --runtime {view.engine} (add --dry-run to see the change first)"
        if not view.installed:
            absent.append(view.engine)
        elif view.error:
            out.append(Check(name=name, verdict=Verdict.WARN, message=f"could not ask {view.engine}: {view.error}",
                             fix=f"check {view.engine}'s configuration, then run gpuhook doctor again"))
        elif view.pending and not view.handlers:
            out.append(Check(name=name, verdict=Verdict.WARN, message=(
                f"runtime {', '.join(view.pending)} is in {view.engine}'s config but {view.source} does not list it: "
                f"{view.engine} was not restarted since"), fix=_RESTARTS.get(view.engine, f"restart {view.engine}")))
        elif view.differs and not view.handlers:
            out.append(Check(name=name, verdict=Verdict.WARN, message=(
                f"{', '.join(view.differs)} differ from what `gpuhook install` writes: {view.engine} runs something "
                "else for gpuhook"), fix=install))
        elif view.handlers:
            out.append(Check(name=name, verdict=Verdict.OK,
                             message=f"{view.source} runs gpuhook: {', '.join(view.handlers)}"))
        else:
            out.append(Check(name=name, verdict=Verdict.WARN,
                             message=f"gpuhook is not registered (no runtime or hook of gpuhook's in {view.source})",
                             fix=install))
    if absent:
        out.append(Check(name="engines", verdict=Verdict.OK,
                         message=f"not installed (not checked): {', '.join(absent)}"))
    return tuple(out)

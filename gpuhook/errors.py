"""The one error tree of gpuhook.

Every failure gpuhook reports is one of these; each front-end turns one into exit status 1
(2 for a malformed command line) and one ``gpuhook: ...`` line on stderr (runc shows a
hook's stderr to the user)::

    GpuHookError
    ├── ConfigError              bad gpuhook.yaml, or a setting that cannot work here
    │   ├── UsageError           a malformed command line (exit status 2)
    │   └── UnsafeEnvironmentError  loader/interpreter variables in a root process's environment
    ├── SpecError                bad OCI state on stdin or bad bundle config.json
    ├── RequestError             bad NVIDIA_* values in the container's environment
    │   ├── UnknownDeviceError   a requested GPU that this host does not have
    │   ├── RequirementError     the host or a selected GPU does not meet the image's NVIDIA_REQUIRE_*
    │   ├── UnhealthyGpuError    a selected GPU is not fit to run work (Xids, pending memory repairs)
    │   └── PolicyError          the sharing policy refuses it (a capability the GPU may not be given)
    │       └── BusyError        the GPUs asked for are held by other containers (names them)
    │           └── MigNoRoomError  no free slice of a GPU fits the MIG instance asked for
    ├── StateError               gpuhook's own state under state_dir (the lease ledger) is unusable
    ├── DiscoveryError           NVML, ld.so.cache, the host's driver files
    │   ├── MissingNodeError     a device node the start needs is missing (carries the modprobe that makes it)
    │   └── LdCacheFormatError   (also a ValueError) a corrupt ld.so.cache
    ├── ProvisionError           a host-side change failed (a MIG instance made or destroyed)
    ├── ApplyError               a privileged step failed (names the step and path)
    └── DaemonError              gpuhookd took a request and gave no complete answer

Errors cross process boundaries (the apply child's report, gpuhookd's reply, a pickled job),
so each one serialises both ways: ``to_dict`` / ``error_from_dict`` and pickle; every class is
defined here, so that any process can rebuild any of them. Each class has a ``reason``: a stable
snake_case word that the ``hook_failed`` log event carries and the metrics count refusals by
(a message's wording may change; a reason does not). Messages name the offending value, what
was expected and, where one exists, the fix.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing costs ~3 ms of every no-GPU start, which imports this module
if TYPE_CHECKING:
    from typing import Any, ClassVar


class GpuHookError(Exception):
    """Base class of every error gpuhook reports: one message."""

    #: what went wrong, as a stable word (log events, metric labels); each class below names its own
    reason: ClassVar[str] = "error"

    def __init__(self, message: str) -> None:
        super().__init__(message)

    def fields(self) -> dict[str, Any]:
        """The keyword arguments that rebuild this error (the message, for most)."""
        return {"message": str(self)}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the class name, its reason and the fields."""
        return {"kind": type(self).__name__, "reason": self.reason, **self.fields()}

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception's default pickling calls cls(*args), which breaks for keyword-only fields.
        return (_rebuild, (type(self).__name__, self.fields()))


class ConfigError(GpuHookError):
    """The gpuhook configuration or the command line is invalid."""

    reason = "bad_config"


class UsageError(ConfigError):
    """A malformed command line: exit status 2, as argparse and NVIDIA's argp use."""

    reason = "usage"


class UnsafeEnvironmentError(ConfigError):
    """A root process found loader or interpreter variables in its own environment."""

    reason = "unsafe_environment"


class SpecError(GpuHookError):
    """The OCI state or the bundle's config.json is unusable."""

    reason = "bad_spec"


class RequestError(GpuHookError):
    """The container's NVIDIA_* request is malformed."""

    reason = "bad_request"


class RequirementError(RequestError):
    """The host or a selected GPU does not meet the image's requirements (planning.requirements checks them)."""

    reason = "requirement"


class UnhealthyGpuError(RequestError):
    """A selected GPU is not fit to run work (planning.health finds it so)."""

    reason = "unhealthy"


class UnknownDeviceError(RequestError):
    """The container asked for a GPU that this host does not have."""

    reason = "unknown_device"


class PolicyError(RequestError):
    """The per-GPU sharing policy refuses the request."""

    reason = "policy"


class BusyError(PolicyError):
    """Every GPU the request could have is held by other containers as far as its policy allows."""

    reason = "busy"


class MigNoRoomError(BusyError):
    """No GPU the request could have has a free slice that fits the MIG instance asked for."""

    reason = "mig_no_room"


class StateError(GpuHookError):
    """gpuhook's own state (the lease ledger under state_dir) cannot be read or written."""

    reason = "state"


class DiscoveryError(GpuHookError):
    """The host's driver could not be inventoried."""

    reason = "discovery"


class MissingNodeError(DiscoveryError):
    """A device node the start needs is missing; *modprobe* is the nvidia-modprobe argv that creates it."""

    reason = "missing_node"

    def __init__(self, message: str, modprobe: tuple[str, ...] | list[str]) -> None:
        super().__init__(message)
        self.modprobe = tuple(modprobe)  # a list after a JSON round trip

    def fields(self) -> dict[str, Any]:
        """The message and the modprobe argv."""
        return {"message": str(self), "modprobe": self.modprobe}


class ProvisionError(GpuHookError):
    """A host-side change for a container (a MIG instance made or destroyed) failed."""

    reason = "provision"


class LdCacheFormatError(DiscoveryError, ValueError):
    """An ld.so.cache file is not in a format glibc writes."""

    reason = "bad_ldcache"


class ApplyError(GpuHookError):
    """A privileged step failed; carries the step, the path and the errno."""

    reason = "apply"

    def __init__(self, step: str, path: str, *, errno_: int | None = None, detail: str = "") -> None:
        self.step = step
        self.path = path
        self.errno = errno_
        self.detail = detail
        super().__init__(self._render())

    def _render(self) -> str:
        why = self.detail or (os.strerror(self.errno) if self.errno else "failed")
        return f"{self.step} {self.path}: {why}"

    def __str__(self) -> str:
        return self._render()  # detail may be extended after a failed rollback

    def fields(self) -> dict[str, Any]:
        """The step, path, errno and detail."""
        return {"step": self.step, "path": self.path, "errno_": self.errno, "detail": self.detail}


class DaemonError(GpuHookError):
    """gpuhookd took the request but its answer never came whole; the work may have begun."""

    reason = "daemon"


def _tree(cls: type[GpuHookError]) -> list[type[GpuHookError]]:
    """*cls* and every subclass of it (recursively)."""
    return [cls, *(sub for direct in cls.__subclasses__() for sub in _tree(direct))]


#: Every class above by name: all of them, so a new class needs no entry of its own to cross a process boundary.
_KINDS = {cls.__name__: cls for cls in _tree(GpuHookError)}


def error_from_dict(data: Any) -> GpuHookError:
    """The error *data* (from ``to_dict``) describes; anything malformed becomes a plain GpuHookError."""
    if not isinstance(data, dict):
        return GpuHookError(f"garbled error report {str(data)[:200]!r}")
    cls = _KINDS.get(str(data.get("kind")), GpuHookError)
    fields = {k: v for k, v in data.items() if k not in ("kind", "reason")}  # the reason is the class's
    try:
        return cls(**fields)
    except TypeError:
        return GpuHookError(str(fields.get("message") or fields)[:1000])


def _rebuild(kind: str, fields: dict[str, Any]) -> GpuHookError:
    """Unpickle an error by its class name and fields."""
    return error_from_dict({"kind": kind, **fields})


def failure_line(err: GpuHookError) -> str:
    """The one line a user sees for *err*."""
    return f"gpuhook: {err}"


def report_failure(err: GpuHookError) -> str:
    """Log *err* as one ``hook_failed`` event (when this process set up logging) and return its user line.

    Every front-end reports through this, and prints the line (gpuhookd sends it back to the hook).
    Messages echo container values, so the line is cut to ``_REPORT_LIMIT`` characters with a
    marker of how many more there were: a container cannot fill a runtime's error or the log.
    The log module is looked up, not imported: a refused no-GPU start never loads it.
    """
    line = failure_line(err)
    if len(line) > _REPORT_LIMIT:
        line = f"{line[:_REPORT_LIMIT]}…({len(line) - _REPORT_LIMIT} more)"
    log = sys.modules.get("gpuhook.log")
    if log is not None and log.is_configured():
        log.get_logger().error("hook_failed", kind=type(err).__name__, reason=err.reason,
                               error=line.removeprefix("gpuhook: "))
    return line


#: The most characters of a reported failure's line (log.MESSAGE_LIMIT; this module imports nothing of gpuhook).
_REPORT_LIMIT = 4096

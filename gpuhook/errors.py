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
    │   └── PolicyError          the sharing policy refuses it (a capability the GPU may not be given)
    │       └── BusyError        the GPUs asked for are held by other containers (names them)
    ├── StateError               gpuhook's own state under state_dir (the lease ledger) is unusable
    ├── DiscoveryError           NVML, ld.so.cache, the host's driver files
    │   └── LdCacheFormatError   (also a ValueError) a corrupt ld.so.cache
    ├── ProvisionError           a host-side change failed (a MIG instance made or destroyed)
    ├── ApplyError               a privileged step failed (names the step and path)
    └── DaemonError              gpuhookd took a request and gave no complete answer

Errors cross process boundaries (the apply child's report, gpuhookd's reply, a pickled job),
so each one serialises both ways: ``to_dict`` / ``error_from_dict`` and pickle. Messages name
the offending value, what was expected and, where one exists, the fix.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing costs ~3 ms of every no-GPU start, which imports this module
if TYPE_CHECKING:
    from typing import Any


class GpuHookError(Exception):
    """Base class of every error gpuhook reports: one message."""

    def __init__(self, message: str) -> None:
        super().__init__(message)

    def fields(self) -> dict[str, Any]:
        """The keyword arguments that rebuild this error (the message, for most)."""
        return {"message": str(self)}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the class name and the fields."""
        return {"kind": type(self).__name__, **self.fields()}

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception's default pickling calls cls(*args), which breaks for keyword-only fields.
        return (_rebuild, (type(self).__name__, self.fields()))


class ConfigError(GpuHookError):
    """The gpuhook configuration or the command line is invalid."""


class UsageError(ConfigError):
    """A malformed command line: exit status 2, as argparse and NVIDIA's argp use."""


class UnsafeEnvironmentError(ConfigError):
    """A root process found loader or interpreter variables in its own environment."""


class SpecError(GpuHookError):
    """The OCI state or the bundle's config.json is unusable."""


class RequestError(GpuHookError):
    """The container's NVIDIA_* request is malformed."""


class UnknownDeviceError(RequestError):
    """The container asked for a GPU that this host does not have."""


class PolicyError(RequestError):
    """The per-GPU sharing policy refuses the request."""


class BusyError(PolicyError):
    """Every GPU the request could have is held by other containers as far as its policy allows."""


class StateError(GpuHookError):
    """gpuhook's own state (the lease ledger under state_dir) cannot be read or written."""


class DiscoveryError(GpuHookError):
    """The host's driver could not be inventoried."""


class MissingNodeError(DiscoveryError):
    """A device node the start needs is missing; *modprobe* is the nvidia-modprobe argv that creates it."""

    def __init__(self, message: str, modprobe: tuple[str, ...]) -> None:
        super().__init__(message)
        self.modprobe = modprobe


class ProvisionError(GpuHookError):
    """A host-side change for a container (a MIG instance made or destroyed) failed."""


class LdCacheFormatError(DiscoveryError, ValueError):
    """An ld.so.cache file is not in a format glibc writes."""


class ApplyError(GpuHookError):
    """A privileged step failed; carries the step, the path and the errno."""

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


_KINDS = {cls.__name__: cls for cls in (
    GpuHookError, ConfigError, UsageError, UnsafeEnvironmentError, SpecError, RequestError, UnknownDeviceError,
    PolicyError, BusyError, StateError, DiscoveryError, LdCacheFormatError, ProvisionError, ApplyError, DaemonError,
)}


def error_from_dict(data: Any) -> GpuHookError:
    """The error *data* (from ``to_dict``) describes; anything malformed becomes a plain GpuHookError."""
    if not isinstance(data, dict):
        return GpuHookError(f"garbled error report {str(data)[:200]!r}")
    cls = _KINDS.get(str(data.get("kind")), GpuHookError)
    fields = {k: v for k, v in data.items() if k != "kind"}
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
        log.get_logger().error("hook_failed", kind=type(err).__name__, error=line.removeprefix("gpuhook: "))
    return line


#: The most characters of a reported failure's line (log.MESSAGE_LIMIT; this module imports nothing of gpuhook).
_REPORT_LIMIT = 4096

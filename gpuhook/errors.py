"""The one error tree of gpuhook.

Every failure the hook reports is one of these; the CLI maps them to exit
status 1 and one line on stderr (runc shows a hook's stderr to the user)::

    GpuHookError
    ├── ConfigError          bad gpuhook.yaml or command-line arguments
    ├── SpecError            bad OCI state on stdin or bad bundle config.json
    ├── RequestError         bad NVIDIA_* values in the container's environment
    │   └── UnknownDeviceError   a requested GPU that this host does not have
    ├── DiscoveryError       NVML, ld.so.cache, the host's driver files
    │   └── LdCacheFormatError   (also a ValueError) a corrupt ld.so.cache
    └── ApplyError           a privileged step failed (names the step and path)

Messages name the offending value, what was expected and, where one exists,
the fix.
"""

from __future__ import annotations

import os


class GpuHookError(Exception):
    """Base class of every error gpuhook reports."""


class ConfigError(GpuHookError):
    """The gpuhook configuration or the command line is invalid."""


class SpecError(GpuHookError):
    """The OCI state or the bundle's config.json is unusable."""


class RequestError(GpuHookError):
    """The container's NVIDIA_* request is malformed."""


class UnknownDeviceError(RequestError):
    """The container asked for a GPU that this host does not have."""


class DiscoveryError(GpuHookError):
    """The host's driver could not be inventoried."""


class LdCacheFormatError(DiscoveryError, ValueError):
    """An ld.so.cache file is not in a format glibc writes."""


class ApplyError(GpuHookError):
    """A privileged step failed; carries the step, the path and the errno."""

    def __init__(self, step: str, path: str, *, errno_: int | None = None, detail: str = "") -> None:
        super().__init__(step, path, errno_, detail)
        self.step = step
        self.path = path
        self.errno = errno_
        self.detail = detail

    def __str__(self) -> str:
        why = self.detail or (os.strerror(self.errno) if self.errno else "failed")
        return f"{self.step} {self.path}: {why}"

"""One NVML session: the library loaded by absolute path, nvmlInit and nvmlShutdown paired, errors mapped once.

The library is loaded from the driver root by absolute path (never through the dynamic
loader's search, which could find a container's or a stale copy).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pynvml

from gpuhook.errors import DiscoveryError

T = TypeVar("T")

#: A GPU without the feature, or an older driver's NVML without the function: nothing to report.
ABSENT = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound)


def call(fn: Callable[..., T], *args: Any) -> T:
    """Call a pynvml function, translating its errors once."""
    try:
        return fn(*args)
    except pynvml.NVMLError as err:
        raise DiscoveryError(f"NVML {fn.__name__} failed: {err}") from err


def text(value: str | bytes) -> str:
    """pynvml returns bytes or str depending on its version."""
    return value.decode() if isinstance(value, bytes) else value


@contextmanager
def session(library: Path) -> Iterator[None]:
    """Load *library*, nvmlInit, and always nvmlShutdown."""
    try:
        pynvml.nvmlLib = ctypes.CDLL(str(library))
    except OSError as err:
        raise DiscoveryError(f"cannot load NVML from {library}: {err}") from err
    call(pynvml.nvmlInit)
    try:
        yield
    finally:
        call(pynvml.nvmlShutdown)

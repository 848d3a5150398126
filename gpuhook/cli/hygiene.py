"""Process hygiene for a root hook started by a runtime with inputs it does not control.

* The environment tripwire (``LD_*``/``PYTHON*``) is ``hookcall.check_environment``, applied
  by every front-end that acts for a container. The runtime wrapper's C front-ends start its
  interpreter without those variables and pass the engine's environment in ``ENGINE_ENV``, for
  runc (``runc_environment``).
* The working directory is the bundle (runc) or the rootfs (createContainer stages); nothing
  may depend on it: the fast path only opens absolute paths, and the GPU path moves to ``/``
  before anything else.
* Inherited descriptors are marked close-on-exec so no helper inherits them.
"""

from __future__ import annotations

import os

from gpuhook.errors import UnsafeEnvironmentError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

#: relay/tripwire.h's ENGINE_ENV: the engine's whole environment, in hex, each entry ended by a NUL, which
#: relay/gpuhook-runtime.c or gpuhook-relay gives the runtime wrapper, whose interpreter they start without
#: the variables ``check_environment`` names. Only a front-end's start of the wrapper sets it.
ENGINE_ENV = "GPUHOOK_ENGINE_ENV"


def runc_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The engine's environment, for runc: ``ENGINE_ENV``'s entries where a front-end started this wrapper,
    else *env* itself (this interpreter's, then the engine's: the engine ran the wrapper directly)."""
    stash = env.get(ENGINE_ENV)
    if stash is None:
        return dict(env)
    try:
        entries = bytes.fromhex(stash).split(b"\0")
    except ValueError:
        entries = [b"not hex"]
    if entries[-1] != b"":
        raise UnsafeEnvironmentError(f"{ENGINE_ENV}={stash[:64]!r} is not what gpuhook-runtime's front-ends write "
                                     f"(entries each ended by a NUL, in hex): unset {ENGINE_ENV} in the engine's "
                                     "environment")
    engine: dict[str, str] = {}
    for entry in entries[:-1]:
        name, eq, value = os.fsdecode(entry).partition("=")
        if name and eq:  # as os.environ reads an environment; the first of a name, as it does too
            engine.setdefault(name, value)
    return engine


def settle_process() -> None:
    """Work from ``/`` and keep inherited descriptors out of every child."""
    from gpuhook.sys import process  # ctypes: only on the GPU path

    os.chdir("/")
    process.close_range_cloexec(3)

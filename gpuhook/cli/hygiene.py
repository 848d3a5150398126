"""Process hygiene for a root hook started by a runtime with inputs it does not control.

* Tripwire: ``LD_*`` and ``PYTHON*`` variables act before Python's first line
  (NVIDIAScape, CVE-2025-23266, was ``LD_PRELOAD`` reaching a root hook), so
  they cannot be undone here; finding one means the registration is unsafe,
  and the hook refuses rather than carry on as if nothing happened.
* The working directory is the bundle (runc) or the rootfs (createContainer
  stages); nothing may depend on it: the fast path only opens absolute paths,
  and the GPU path moves to ``/`` before anything else.
* Inherited descriptors are marked close-on-exec so no helper inherits them.
"""

from __future__ import annotations

import os

from gpuhook.errors import ConfigError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

#: Harmless interpreter settings some daemons export; everything else PYTHON*/LD_* trips.
_ALLOWED = frozenset({"PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONIOENCODING"})


def check_environment(env: Mapping[str, str]) -> None:
    """Refuse to run with loader or interpreter variables in the hook's own environment."""
    found = sorted(k for k in env if (k.startswith(("LD_", "PYTHON"))) and k not in _ALLOWED)
    if found:
        raise ConfigError(
            f"the hook's environment sets {', '.join(found)}; they can inject code into a root process "
            "(CVE-2025-23266). Register the hook with an explicit env such as [\"PATH=/usr/sbin:/usr/bin:/sbin:/bin\"]"
        )


def settle_process() -> None:
    """Work from ``/`` and keep inherited descriptors out of every child."""
    from gpuhook import linux  # ctypes: only on the GPU path

    os.chdir("/")
    linux.close_range_cloexec(3)

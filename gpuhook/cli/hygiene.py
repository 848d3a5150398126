"""Process hygiene for a root hook started by a runtime with inputs it does not control.

* The environment tripwire (``LD_*``/``PYTHON*``) is ``hookcall.check_environment``, applied
  by every front-end that acts for a container.
* The working directory is the bundle (runc) or the rootfs (createContainer stages); nothing
  may depend on it: the fast path only opens absolute paths, and the GPU path moves to ``/``
  before anything else.
* Inherited descriptors are marked close-on-exec so no helper inherits them.
"""

from __future__ import annotations

import os


def settle_process() -> None:
    """Work from ``/`` and keep inherited descriptors out of every child."""
    from gpuhook.sys import process  # ctypes: only on the GPU path

    os.chdir("/")
    process.close_range_cloexec(3)

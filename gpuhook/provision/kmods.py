"""load_kmods: create a missing NVIDIA device node with the host's ``nvidia-modprobe`` (NVIDIA's load-kmods).

After a boot, ``/dev/nvidia-uvm`` (and sometimes ``/dev/nvidiaN``) exists only once something loaded
the module and made the node; NVIDIA's hook runs nvidia-modprobe before each GPU start for that.
gpuhook runs it only for a node the plan found missing, with exactly the arguments that make that
node. The program is the driver root's (found by discovery, a host file: never the container's),
started with a clean environment, no stdin, in ``/``, with a deadline.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from gpuhook.errors import ProvisionError

#: What nvidia-modprobe runs with: its own PATH for modprobe(8), nothing from the engine or container.
CLEAN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}


def create_node(modprobe: Path, args: tuple[str, ...], *, timeout: float) -> None:
    """Run ``modprobe args``; ProvisionError naming the command and its output when it fails."""
    command = " ".join((str(modprobe), *args))
    try:
        st = os.stat(modprobe)
    except OSError as err:
        raise ProvisionError(f"load_kmods: cannot stat {modprobe}: {err.strerror or err}") from err
    if st.st_uid != 0 or st.st_mode & 0o022:
        raise ProvisionError(f"load_kmods: {modprobe} is not root's (owner uid {st.st_uid}, mode "
                             f"{st.st_mode & 0o7777:o}); gpuhook runs only a root-owned nvidia-modprobe that no one "
                             "else may write: fix its owner and mode, or reinstall the driver")
    try:
        done = subprocess.run([str(modprobe), *args], env=CLEAN_ENV, cwd="/", stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, errors="replace", timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise ProvisionError(f"load_kmods: `{command}` did not finish within {timeout:g} s; run it by hand and "
                             "check the kernel log (dmesg)") from None
    except OSError as err:
        raise ProvisionError(f"load_kmods: cannot run `{command}`: {err.strerror or err}") from err
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise ProvisionError(f"load_kmods: `{command}` failed (exit status {done.returncode})"
                             + (f": {said[-1]}" if said else "")
                             + "; run it by hand and check the kernel log (dmesg), or set load_kmods: false "
                               "and create the node at boot")

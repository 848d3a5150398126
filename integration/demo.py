"""`make demo`: a simulated 2-GPU host, a real busybox container under runc with gpuhook, what it sees."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from integration.engines import default_spec, run_container, unique_id, write_bundle
from integration.fakehost import create_host
from integration.rootfs import build_rootfs, copy_rootfs

REPO = Path(__file__).parents[1]
WORK = REPO / ".cache" / "demo"
INSIDE = """
echo '$ ls -l /dev/nvidia*'; ls -l /dev/nvidia*
echo; echo '$ devopen /dev/nvidia0 /dev/nvidia1 /dev/nvidiactl /dev/nvidia-uvm   (ENXIO = allowed, no real driver)'
devopen /dev/nvidia0 /dev/nvidia1 /dev/nvidiactl /dev/nvidia-uvm
echo; echo '$ mknod /tmp/other c 195 7 && devopen /tmp/other   (EPERM = the device cgroup refuses it)'
mknod /tmp/other c 195 7 && devopen /tmp/other
echo; echo '$ dltest libcuda.so.1 libnvidia-ml.so.1   (through the container ld.so.cache)'
dltest libcuda.so.1 libnvidia-ml.so.1
echo; echo '$ grep nvidia /proc/self/mountinfo | head -3'; grep nvidia /proc/self/mountinfo | cut -d' ' -f5,6 | head -3
echo; echo '$ nvidia-smi'; nvidia-smi
"""


def banner(text: str) -> None:
    """A section heading."""
    print(f"\n=== {text} ===")


def main() -> int:
    """Build the host and rootfs, run one GPU container, print what it saw."""
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    host = create_host(WORK / "host", gpus=2)
    gpuhook = [sys.executable, "-I", "-m", "gpuhook", "--config", str(host.config_path)]
    banner(f"simulated GPU host in {host.root}: gpuhook info")
    subprocess.run([*gpuhook, "info"], check=True)

    hook = {"path": sys.executable, "args": [*gpuhook, "prestart"], "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]}
    status = run_demo_container(
        "runc run: busybox with NVIDIA_VISIBLE_DEVICES=all, NVIDIA_DRIVER_CAPABILITIES=compute,utility",
        "bundle", INSIDE, {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"}, hook,
        capabilities=["CAP_MKNOD"])
    if status != 0:
        return status
    banner(f"the hook's log: {host.root / 'gpuhook.log'} (last event)")
    print((host.root / "gpuhook.log").read_text().splitlines()[-1])
    # nvidia-smi -L on the host, then in a container given GPU 1 only: it sees exactly that GPU.
    banner("the host: nvidia-smi -L")
    subprocess.run([host.root / "usr/bin/nvidia-smi", "-L"], check=True)
    return run_demo_container("runc run with NVIDIA_VISIBLE_DEVICES=1: nvidia-smi -L (NVML numbers what it sees "
                              "from 0)", "bundle-gpu1", "nvidia-smi -L",
                              {"NVIDIA_VISIBLE_DEVICES": "1", "NVIDIA_DRIVER_CAPABILITIES": "utility"}, hook)


def run_demo_container(title: str, name: str, script: str, env: dict[str, str], hook: dict[str, Any],
                       capabilities: list[str] | None = None) -> int:
    """Run *script* in a fresh busybox bundle WORK/*name* with *env* and gpuhook's *hook*; print its output."""
    bundle = WORK / name
    bundle.mkdir()
    copy_rootfs(build_rootfs(REPO / ".cache" / "rootfs"), bundle / "rootfs")
    spec = default_spec("rootfs", ["/bin/sh", "-c", script],
                        ["PATH=/usr/local/bin:/usr/bin:/bin", *(f"{k}={v}" for k, v in env.items())],
                        hooks={"prestart": [hook]}, capabilities=capabilities)
    write_bundle(bundle, spec)
    banner(title)
    result = run_container("runc", bundle, unique_id("demo"))
    print(result.stdout, end="")
    if result.returncode != 0:
        print(result.stderr, file=sys.stderr)
    return result.returncode


if __name__ == "__main__":
    raise SystemExit(main())

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

    bundle = WORK / "bundle"
    bundle.mkdir()
    copy_rootfs(build_rootfs(REPO / ".cache" / "rootfs"), bundle / "rootfs")
    hook = {"path": sys.executable, "args": [*gpuhook, "prestart"], "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]}
    env = ["PATH=/usr/local/bin:/usr/bin:/bin", "NVIDIA_VISIBLE_DEVICES=all",
           "NVIDIA_DRIVER_CAPABILITIES=compute,utility"]
    write_bundle(bundle, default_spec("rootfs", ["/bin/sh", "-c", INSIDE], env, hooks={"prestart": [hook]},
                                      capabilities=["CAP_MKNOD"]))
    banner("runc run: busybox with NVIDIA_VISIBLE_DEVICES=all, NVIDIA_DRIVER_CAPABILITIES=compute,utility")
    result = run_container("runc", bundle, unique_id("demo"))
    print(result.stdout, end="")
    if result.returncode != 0:
        print(result.stderr, file=sys.stderr)
        return result.returncode
    banner(f"the hook's log: {host.root / 'gpuhook.log'} (last event)")
    print((host.root / "gpuhook.log").read_text().splitlines()[-1])
    return show_one_gpu(host.root, hook)


def show_one_gpu(root: Path, hook: dict[str, Any]) -> int:
    """nvidia-smi -L on the host, then in a container given GPU 1 only: it sees exactly that GPU."""
    banner("the host: nvidia-smi -L")
    subprocess.run([root / "usr/bin/nvidia-smi", "-L"], check=True)
    bundle = WORK / "bundle-gpu1"
    bundle.mkdir()
    copy_rootfs(build_rootfs(REPO / ".cache" / "rootfs"), bundle / "rootfs")
    env = ["PATH=/usr/local/bin:/usr/bin:/bin", "NVIDIA_VISIBLE_DEVICES=1", "NVIDIA_DRIVER_CAPABILITIES=utility"]
    write_bundle(bundle, default_spec("rootfs", ["/bin/sh", "-c", "nvidia-smi -L"], env, hooks={"prestart": [hook]}))
    banner("runc run with NVIDIA_VISIBLE_DEVICES=1: nvidia-smi -L (NVML numbers what it sees from 0)")
    result = run_container("runc", bundle, unique_id("demo"))
    print(result.stdout, end="")
    if result.returncode != 0:
        print(result.stderr, file=sys.stderr)
    return result.returncode


if __name__ == "__main__":
    raise SystemExit(main())

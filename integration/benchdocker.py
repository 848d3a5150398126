"""`make bench`'s docker rows: ``docker run --runtime nvidia`` of a no-GPU container against ``--runtime runc``.

A private dockerd (integration.daemons) registers gpuhook-runtime's front-end as runtime ``nvidia``,
as ``gpuhook install --runtime docker --name nvidia`` (or ``nvidia-ctk runtime configure``) does. Both
runtimes start a busybox ``/bin/true`` container, interleaved, after one warm-up each; the wall time
is the docker client's, the whole ``docker run --rm``.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from integration.daemons import docker_run, import_image, start_dockerd

IMAGE = "gpuhook-bench-busybox:latest"
RUNTIMES = ("runc", "nvidia")


def measure_docker(work: Path, rootfs: Path, runtime: Path, runs: int) -> dict[str, Any]:
    """Medians (ms) of ``docker run --rm --runtime R IMAGE /bin/true`` for runc and gpuhook's runtime."""
    daemon = start_dockerd(work / "dockerd", runtimes={"nvidia": runtime})
    try:
        import_image(daemon, rootfs, IMAGE)
        walls: dict[str, list[float]] = {name: [] for name in RUNTIMES}
        for round_no in range(runs + 1):
            for name in RUNTIMES if round_no % 2 else RUNTIMES[::-1]:
                result = docker_run(daemon, ["--rm", "--network", "none", "--runtime", name, IMAGE, "/bin/true"])
                if result.returncode != 0:
                    raise RuntimeError(f"docker run --runtime {name} failed ({result.returncode}): {result.stderr}")
                if round_no > 0:  # round 0 warms the image and the runtimes
                    walls[name].append(result.duration_s * 1000)
    finally:
        daemon.stop()
    medians = {name: round(statistics.median(values), 1) for name, values in walls.items()}
    return {"runs": runs, "median_ms": medians, "ratio": round(medians["nvidia"] / medians["runc"], 3)}

"""Does a config.json ask for a GPU at all? The no-GPU fast path's one decision, on the raw JSON.

Every container start on a host with a hooks.d ``always`` rule runs the hook,
so this check runs before anything else is imported (no dataclasses, no
typing, no regular expressions). It only says "certainly no GPU" when the
spec is plainly well-formed and has none of NVIDIA's requests; anything
unusual goes to the full, strict parser (``request.parse``), which then
refuses or injects.
"""

from __future__ import annotations

VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
DEVICE_LIST_DIR = "/var/run/nvidia-container-devices"
BLANKS = " \t\n\r"
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"
CDI_KIND = "nvidia.com/gpu"

#: Byte strings without which a config.json certainly asks for no GPU: every name asks_for_gpu and
#: request.parse look for contains one of them, and JSON's \uXXXX escape is the only way to spell
#: one of their letters, digits, '_', '-' or '.' otherwise (the cap-exceeding spec's rule, hookcall).
GPU_MARKERS = (b"\\u", b"NVIDIA_", b"CUDA_VERSION", b"nvidia-container-devices", CDI_ANNOTATION_PREFIX[:-1].encode())

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any


def is_legacy_image(env: Mapping[str, str]) -> bool:
    """CUDA images from before NVIDIA_VISIBLE_DEVICES: CUDA_VERSION without NVIDIA_REQUIRE_CUDA."""
    return bool(env.get("CUDA_VERSION")) and not env.get("NVIDIA_REQUIRE_CUDA")


def asks_for_gpu(spec: Mapping[str, Any]) -> bool:
    """False only when the decoded config.json certainly requests no GPU."""
    process = spec.get("process")
    if not isinstance(process, dict):
        return True
    entries = process.get("env") or []
    mounts = spec.get("mounts") or []
    if not isinstance(entries, list) or not isinstance(mounts, list):
        return True
    env: dict[str, str] = {}
    for entry in entries:
        if not isinstance(entry, str) or "=" not in entry:
            return True  # malformed: let the strict parser say so
        key, _, value = entry.partition("=")
        env[key] = value
    if env.get(VISIBLE_DEVICES, "").strip(BLANKS) or is_legacy_image(env):
        return True
    # CDI annotations (the device plugin's cdi-annotations strategy) and device-plugin volume mounts:
    # matched loosely here, exactly in request.parse.
    annotations = spec.get("annotations") or {}
    if not isinstance(annotations, dict) or any(
        str(k).startswith(CDI_ANNOTATION_PREFIX) and CDI_KIND in str(v) for k, v in annotations.items()
    ):
        return True
    return any(not isinstance(m, dict) or "nvidia-container-devices" in str(m.get("destination")) for m in mounts)

"""Lexical rules for container paths (the privileged step resolves them safely)."""

from __future__ import annotations

from typing import Final

#: Debian-family multiarch directories, by `uname -m`.
_MULTIARCH: Final = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu", "arm64": "aarch64-linux-gnu"}
BIN_DIR: Final = "/usr/bin"


def libs_dir(*, debian_like: bool, machine: str) -> str:
    """Where driver libraries go: NVIDIA's rule (nvc_container.c copy_config).

    A rootfs with /etc/debian_version gets the multiarch dir, anything else
    /usr/lib64.
    """
    if debian_like and machine in _MULTIARCH:
        return f"/usr/lib/{_MULTIARCH[machine]}"
    return "/usr/lib64"


_MULTIARCH32: Final = {"x86_64": "i386-linux-gnu", "aarch64": "arm-linux-gnueabihf", "arm64": "arm-linux-gnueabihf"}


def libs32_dir(*, debian_like: bool, machine: str) -> str:
    """Where the 32-bit (compat32) libraries go: the 32-bit multiarch dir, else /usr/lib32."""
    if debian_like and machine in _MULTIARCH32:
        return f"/usr/lib/{_MULTIARCH32[machine]}"
    return "/usr/lib32"


def container_path(*parts: str) -> str:
    """Join *parts* into an absolute, normalised container path (an absolute part starts it afresh,
    empty and '.' names go); refuses '..' and NUL. String work only: a plan builds dozens of these."""
    names: list[str] = []
    for part in parts:
        if part.startswith("/"):
            names.clear()
        names += [name for name in part.split("/") if name and name != "."]
    path = "/" + "/".join(names)
    if ".." in names or "\0" in path:
        raise ValueError(f"container path {path} must not contain '..' or NUL")
    return path

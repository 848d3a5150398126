"""Check the image's NVIDIA_REQUIRE_* against the host and the selected GPUs, and explain a mismatch.

"CUDA driver version is insufficient" is the first support question of this
field; the refusal names the image's requirement, the host's driver and the
CUDA version it supports, and the three ways out.
"""

from __future__ import annotations

# defined in errors, as every error is (so that any process rebuilds it); imported from here too
from gpuhook.errors import RequirementError
from gpuhook.inventory import Gpu, Inventory
from gpuhook.request.requirements import Facts, Requirement, cuda_needed, driver_hint, satisfied


def check_requirements(requirements: tuple[Requirement, ...], inventory: Inventory, gpus: tuple[Gpu, ...]) -> None:
    """Raise RequirementError for the first requirement a selected GPU (or the host) does not meet.

    A requirement depends on a GPU only through its arch and brand, so each is checked once per
    distinct (arch, brand) among the selected GPUs, not once per GPU (the first such GPU is named).
    """
    scopes: dict[tuple[str | None, str | None], Gpu] = {}
    for gpu in gpus:
        scopes.setdefault((gpu.arch or None, gpu.brand or None), gpu)
    host = Facts(cuda=inventory.cuda_version, driver=inventory.driver_version)
    facts: list[tuple[Facts, Gpu | None]] = [
        (Facts(cuda=host.cuda, driver=host.driver, arch=arch, brand=brand), first)
        for (arch, brand), first in scopes.items()
    ] or [(host, None)]
    for requirement in requirements:
        for fact, named in facts:
            if not satisfied(requirement, fact):
                raise RequirementError(_explain(requirement, inventory, named))


def _explain(requirement: Requirement, inventory: Inventory, gpu: Gpu | None) -> str:
    """One or two lines a person understands."""
    wants = f"the image requires {requirement.variable}={requirement.text!r}"
    host = f"this host's NVIDIA driver {inventory.driver_version} supports CUDA {inventory.cuda_version}"
    needed = cuda_needed(requirement)
    if needed is not None and not satisfied(requirement, Facts(cuda="999", driver=inventory.driver_version)):
        needed = None  # CUDA is not what fails: a driver/arch/brand term does
    if needed is not None:
        hint = driver_hint(needed)
        upgrade = (f"upgrade the driver to {hint} or newer" if hint
                   else f"upgrade to a driver that supports CUDA {needed}")
        return (
            f"{wants}, but {host}. Fix: {upgrade}, use CUDA forward compatibility (the cuda-compat package "
            f"in the image), or use an image built for CUDA {inventory.cuda_version} or older "
            "(NVIDIA_DISABLE_REQUIRE=true skips this check)"
        )
    where = f"GPU {gpu.index} ({gpu.model}, arch {gpu.arch}, brand {gpu.brand})" if gpu else "this host"
    return (
        f"{wants}, which {where} does not meet ({host}). Fix: select a GPU that meets it, "
        "or set NVIDIA_DISABLE_REQUIRE=true if the image runs anyway"
    )

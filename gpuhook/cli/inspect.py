"""``gpuhook plan`` and ``gpuhook info``: dry runs that need no privileges."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpuhook import service
from gpuhook.cli.bundle import read_spec
from gpuhook.errors import DiscoveryError
from gpuhook.inventory import Gpu, Inventory


def run_plan(config_arg: str | None, debug: bool, bundle: str, env: Mapping[str, str]) -> int:
    """Print what the hook would do to the container in *bundle*."""
    config = service.load_settings(config_arg, debug, env)
    planned = service.render_plan(config, read_spec(Path(bundle).absolute()))
    if planned is None:
        _print_json({"request": None, "plan": None, "note": "the container asks for no GPU; it is left untouched"})
        return 0
    request, plan = planned
    _print_json({
        "request": {
            "source": request.source, "devices": request.raw, "all": request.all_devices,
            "capabilities": sorted(request.capabilities), "requirements": [str(r) for r in request.requirements],
        },
        "plan": plan.to_dict(),
    })
    return 0


def run_info(config_arg: str | None, debug: bool, env: Mapping[str, str], *, as_json: bool,
             refresh: bool = False) -> int:
    """Print the host's driver version, CUDA version and GPUs (*refresh*: rebuild the cache first)."""
    config = service.load_settings(config_arg, debug, env)
    if refresh and config.cache_dir is None:
        raise DiscoveryError("cache_dir is null in the config: the inventory cache is disabled, nothing to refresh")
    found = service.host_inventory(config, refresh=refresh)
    if refresh and found.not_stored is not None:
        raise DiscoveryError(f"the inventory cache was not rebuilt: {found.not_stored}")
    inventory = found.inventory
    if as_json:
        _print_json(_inventory_dict(inventory))
    else:
        sys.stdout.write(_inventory_text(inventory, found.outcome.value))
    return 0


_SOURCES = {
    "hit": "from the cache (no NVML)",
    "refresh": "rebuilt from NVML and cached",
    "disabled": "from NVML (cache disabled)",
    "no-identity": "from NVML (driver identity unreadable; not cached)",
    "mig-changed": "rebuilt from NVML for a new MIG instance, and cached",
}


def _inventory_dict(inventory: Inventory) -> dict[str, Any]:
    """The inventory as JSON-ready data (proc file bodies left out)."""
    data = dataclasses.asdict(inventory)
    if inventory.proc_driver is not None:
        data["proc_driver"]["files"] = [name for name, _ in inventory.proc_driver.files]
    return data


def _inventory_text(inv: Inventory, outcome: str) -> str:
    """A short human summary, like `nvidia-container-cli info`."""
    lines = [
        f"Inventory:      {_SOURCES.get(outcome, f'from NVML (the cache was {outcome})')}",
        f"NVRM version:   {inv.driver_version}",
        f"CUDA version:   {inv.cuda_version}",
        f"Libraries:      {len(inv.libraries)}   Binaries: {len(inv.binaries)}   "
        f"Firmware: {len(inv.firmware)}   IPC sockets: {len(inv.ipc)}",
        "",
    ]
    for gpu in inv.gpus:
        lines += [
            f"Device Index:   {gpu.index}",
            f"Device Minor:   {gpu.minor}",
            f"Model:          {gpu.model}",
            f"Brand:          {gpu.brand}",
            f"GPU UUID:       {gpu.uuid}",
            f"Bus Location:   {gpu.pci_bus_id}",
            f"Architecture:   {gpu.arch}",
            *_mig_lines(inv, gpu),
            "",
        ]
    return "\n".join(lines)


def _mig_lines(inv: Inventory, gpu: Gpu) -> list[str]:
    """A MIG-capable GPU's MIG mode, its GPU-instance profiles and its MIG devices, one line each."""
    if not gpu.mig_profiles and not gpu.mig_enabled:
        return []
    width = max((len(p.name) for p in gpu.mig_profiles), default=0)
    lines = [f"MIG Mode:       {'Enabled' if gpu.mig_enabled else 'Disabled'}"]
    lines += [f"MIG Profile:    {p.name:<{width}}  {p.memory_mib / 1024:5.1f} GiB  {p.instances} fit"
              f"  (id {p.profile_id})" for p in gpu.mig_profiles]
    lines += [f"MIG Device:     {m.parent_index}:{m.index}  {m.uuid}  {m.profile or 'profile unknown'}"
              for m in inv.mig_devices if m.parent_index == gpu.index]
    return lines


def _print_json(data: Any) -> None:
    """Pretty JSON on stdout (Paths become strings)."""
    json.dump(data, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")

"""``gpuhook plan`` and ``gpuhook info``: dry runs that need no privileges."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpuhook.cli.bundle import read_spec
from gpuhook.cli.common import complete_inventory, load_settings, make_target, request_for
from gpuhook.config import Config
from gpuhook.discovery.cache import CachedDiscoverer, Outcome
from gpuhook.discovery.host import HostDiscoverer
from gpuhook.errors import DiscoveryError
from gpuhook.inventory import Inventory
from gpuhook.planning.planner import make_plan


def run_plan(config_arg: str | None, debug: bool, bundle: str, env: Mapping[str, str]) -> int:
    """Print what the hook would do to the container in *bundle*."""
    config = load_settings(config_arg, debug, env)
    spec = read_spec(Path(bundle).absolute())
    request = request_for(spec, config)
    if request is None:
        _print_json({"request": None, "plan": None, "note": "the container asks for no GPU; it is left untouched"})
        return 0
    inventory = complete_inventory(_discoverer(config).discover(), request, config)
    plan = make_plan(request, inventory, make_target(spec, config))
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
    config = load_settings(config_arg, debug, env)
    if refresh and config.cache_dir is None:
        raise DiscoveryError("cache_dir is null in the config: the inventory cache is disabled, nothing to refresh")
    found = _discoverer(config, refresh=refresh).lookup()
    if refresh and found.not_stored is not None:
        raise DiscoveryError(f"the inventory cache was not rebuilt: {found.not_stored}")
    inventory = found.inventory
    if as_json:
        _print_json(_inventory_dict(inventory))
    else:
        sys.stdout.write(_inventory_text(inventory, found.outcome))
    return 0


_SOURCES = {
    Outcome.HIT: "from the cache (no NVML)",
    Outcome.REFRESH: "rebuilt from NVML and cached",
    Outcome.DISABLED: "from NVML (cache disabled)",
    Outcome.NO_IDENTITY: "from NVML (driver identity unreadable; not cached)",
}


def _discoverer(config: Config, *, refresh: bool = False) -> CachedDiscoverer:
    """NVML through the inventory cache (see discovery.cache)."""
    return CachedDiscoverer(config=config, inner=HostDiscoverer(config), refresh=refresh)


def _inventory_dict(inventory: Inventory) -> dict[str, Any]:
    """The inventory as JSON-ready data (proc file bodies left out)."""
    data = dataclasses.asdict(inventory)
    if inventory.proc_driver is not None:
        data["proc_driver"]["files"] = [name for name, _ in inventory.proc_driver.files]
    return data


def _inventory_text(inv: Inventory, outcome: Outcome) -> str:
    """A short human summary, like `nvidia-container-cli info`."""
    lines = [
        f"Inventory:      {_SOURCES.get(outcome, f'from NVML (the cache was {outcome.value})')}",
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
            "",
        ]
    return "\n".join(lines)


def _print_json(data: Any) -> None:
    """Pretty JSON on stdout (Paths become strings)."""
    json.dump(data, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")

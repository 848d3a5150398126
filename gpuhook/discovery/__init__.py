"""Discovery: the host's driver → an ``Inventory`` (cached) and ``LiveFacts`` (read per start). Reads, never changes.

``inventory_for`` is the one entry point: every front-end's inventory comes from it
(through gpuhook.service), so the cache, the live facts and their reconciliation
are decided here once (see discovery.cache).
"""

from __future__ import annotations

from gpuhook.config import Config
from gpuhook.discovery.cache import CachedDiscoverer, Found, Outcome
from gpuhook.discovery.host import HostDiscoverer
from gpuhook.inventory import LiveNeeds

__all__ = ["Found", "Outcome", "inventory_for"]


def inventory_for(config: Config, needs: LiveNeeds, *, refresh: bool = False) -> Found:
    """The host's inventory through the cache, with the live facts *needs* asks for; raises DiscoveryError.

    *refresh* rebuilds the cache from NVML first (``gpuhook info --refresh``); a config whose
    ``cache_dir`` is null asks NVML every time (outcome ``disabled``).
    """
    return CachedDiscoverer(config=config, inner=HostDiscoverer(config), refresh=refresh).find(needs)

"""Discovery: the host's driver → an ``Inventory`` (cached) and ``LiveFacts`` (read per start). Reads, never changes.

``inventory_for`` is the one entry point: every front-end's inventory comes from it
(through gpuhook.service), so the cache, the live facts and their reconciliation
are decided here once (see discovery.cache).
"""

from __future__ import annotations

from collections.abc import Sequence

from gpuhook.config import Config
from gpuhook.discovery.cache import CachedDiscoverer, Found, Outcome, warm
from gpuhook.discovery.host import HostDiscoverer
from gpuhook.inventory import LiveNeeds
from gpuhook.sharing.ledger import MigRecord

__all__ = ["Found", "Outcome", "inventory_for", "warm"]


def inventory_for(config: Config, needs: LiveNeeds, *, refresh: bool = False,
                  recorded: Sequence[MigRecord] = ()) -> Found:
    """The host's inventory through the cache, with the live facts *needs* asks for; raises DiscoveryError.

    *refresh* rebuilds the cache from NVML first (``gpuhook info --refresh``); a config whose
    ``cache_dir`` is null asks NVML every time (outcome ``disabled``). *recorded*: the MIG
    instances the lease ledger records, which join the inventory without asking NVML.
    """
    return CachedDiscoverer(config=config, inner=HostDiscoverer(config), refresh=refresh).find(needs, recorded)

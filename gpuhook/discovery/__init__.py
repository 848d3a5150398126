"""Discovery: the host's driver → an ``Inventory``. The only layer that reads the host."""

from __future__ import annotations

from typing import Protocol

from gpuhook.inventory import Inventory


class Discoverer(Protocol):
    """Anything that can produce the host's inventory."""

    def discover(self) -> Inventory:
        """Inventory the host's GPUs and driver files."""
        ...

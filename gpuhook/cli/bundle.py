"""Reading a bundle's config.json into a BundleSpec (for the commands that start from a bundle)."""

from __future__ import annotations

from pathlib import Path

from gpuhook.hookcall import read_config_json
from gpuhook.oci.spec import SPEC_LIMIT, BundleSpec, parse_spec


def read_spec(bundle: Path) -> BundleSpec:
    """Read and parse ``<bundle>/config.json`` (size-capped, no symlinks, no FIFOs)."""
    return parse_spec(read_config_json(str(bundle), limit=SPEC_LIMIT), bundle)

"""``gpuhook spec-edit --bundle DIR`` and ``gpuhook precreate``: put the GPU devices into the spec.

The durable alternative to rules added behind the runtime's back (see
``planning/specedit.py``): run before the runtime starts, by a runtime wrapper
(``spec-edit``, editing ``<bundle>/config.json`` in place) or by podman's
``precreate`` hook stage (spec on stdin, edited spec on stdout). The prestart
hook then finds the devices in the spec and leaves nodes and rules to the runtime.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

from gpuhook.cli.common import complete_inventory, load_settings, request_for
from gpuhook.cli.inputs import read_bounded, read_config_json
from gpuhook.config import Config
from gpuhook.discovery.cache import CachedDiscoverer
from gpuhook.discovery.host import HostDiscoverer
from gpuhook.oci import strictjson
from gpuhook.oci.spec import SPEC_LIMIT, BundleSpec, parse_spec, spec_from_object
from gpuhook.planning.planner import plan_devices
from gpuhook.planning.specedit import add_devices


def edited_spec(raw: Mapping[str, Any], spec: BundleSpec, config: Config) -> Mapping[str, Any]:
    """*raw* with the requested GPUs' devices and rules added (unchanged when no GPU is asked for)."""
    request = request_for(spec, config)
    if request is None:
        return raw
    inventory = CachedDiscoverer(config=config, inner=HostDiscoverer(config)).discover()
    return add_devices(raw, plan_devices(request, complete_inventory(inventory, request, config)).devices)


def run_spec_edit(config_arg: str | None, debug: bool, bundle_arg: str, env: Mapping[str, str]) -> int:
    """Edit ``<bundle>/config.json`` in place, atomically."""
    config = load_settings(config_arg, debug, env)
    bundle = Path(bundle_arg).absolute()
    path = bundle / "config.json"
    raw = strictjson.loads_object(read_config_json(str(bundle), limit=SPEC_LIMIT), what=str(path), limit=SPEC_LIMIT)
    edited = edited_spec(raw, spec_from_object(raw, bundle), config)
    if edited is not raw:
        write_spec(path, edited)
    return 0


def write_spec(path: Path, spec: Mapping[str, Any]) -> None:
    """Replace *path* atomically (same directory, same mode): a runtime never reads half a spec."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".config.json.")
    with os.fdopen(fd, "w") as handle:
        json.dump(spec, handle)
    os.chmod(tmp, path.stat().st_mode & 0o7777)
    os.replace(tmp, path)


def run_precreate(config_arg: str | None, debug: bool, stdin: BinaryIO, env: Mapping[str, str]) -> int:
    """podman's precreate stage: the spec on stdin, the edited spec on stdout."""
    config = load_settings(config_arg, debug, env)
    data = read_bounded(stdin, limit=SPEC_LIMIT)
    raw = strictjson.loads_object(data, what="the spec on stdin", limit=SPEC_LIMIT)
    # precreate runs before the bundle exists; the rootfs is only used for placement, not here.
    spec = parse_spec(data, Path("/"))
    json.dump(edited_spec(raw, spec, config), sys.stdout)
    return 0

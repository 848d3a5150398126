"""``gpuhook spec-edit --bundle DIR`` and ``gpuhook precreate``: put the GPU devices into the spec.

The durable alternative to rules added behind the runtime's back (see
``planning/specedit.py``): run before the runtime starts, by a runtime wrapper
(``spec-edit``, editing ``<bundle>/config.json`` in place) or by podman's
``precreate`` hook stage (spec on stdin, edited spec on stdout). The prestart
hook then finds the devices in the spec and leaves nodes and rules to the runtime.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path

from gpuhook import service
from gpuhook.hookcall import read_bounded, read_config_json
from gpuhook.oci import strictjson
from gpuhook.oci.spec import SPEC_LIMIT, parse_spec, spec_from_object


def run_spec_edit(config_arg: str | None, debug: bool, bundle_arg: str, env: Mapping[str, str]) -> int:
    """Edit ``<bundle>/config.json`` in place, atomically."""
    config = service.load_settings(config_arg, debug, env)
    bundle = Path(bundle_arg).absolute()
    path = bundle / "config.json"
    raw = strictjson.loads_object(read_config_json(str(bundle), limit=SPEC_LIMIT), what=str(path), limit=SPEC_LIMIT)
    edited = service.render_spec_edit(config, raw, spec_from_object(raw, bundle))
    if edited is not raw:
        service.replace_spec(bundle, edited)
    return 0


def run_precreate(config_arg: str | None, debug: bool, stdin_fd: int, env: Mapping[str, str]) -> int:
    """podman's precreate stage: the spec on stdin, the edited spec on stdout."""
    config = service.load_settings(config_arg, debug, env)
    data = read_bounded(stdin_fd, limit=SPEC_LIMIT, what="the spec on stdin")
    raw = strictjson.loads_object(data, what="the spec on stdin", limit=SPEC_LIMIT)
    # precreate runs before the bundle exists; the rootfs is only used for placement, not here.
    spec = parse_spec(data, Path("/"))
    json.dump(service.render_spec_edit(config, raw, spec), sys.stdout)
    return 0

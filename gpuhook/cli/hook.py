"""``gpuhook prestart`` / ``createRuntime``: the OCI hook itself, and its no-GPU fast path.

Every container start may run the hook (a hooks.d ``always`` rule), so a
container that asks for no GPU costs reading stdin and config.json and
nothing else: this module imports only the C JSON scanner, ``os``, ``select``, ``stat``
and ``time`` (no dataclasses, typing, YAML, logging or NVML), decodes both
documents once, and returns. A GPU request continues in ``cli.inject`` with
the same decoded objects.
"""

from __future__ import annotations

import sys

from gpuhook.cli.hygiene import check_environment
from gpuhook.cli.inputs import read_bounded, read_config_json
from gpuhook.oci import strictjson
from gpuhook.request.quick import asks_for_gpu

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import BinaryIO

STATE_WHAT = "the OCI state on stdin"


def run_hook(config_arg: str | None, debug: bool, stdin: BinaryIO, env: Mapping[str, str], *,
             daemon_socket: str | None = None) -> int:
    """Inject the GPUs the container in the OCI state asks for (or do nothing, fast).

    A GPU request goes to gpuhookd at *daemon_socket* (default ``/run/gpuhook/gpuhookd.sock``,
    ``none``: never) when one serves it; otherwise this process does the work.
    """
    check_environment(env)
    state_bytes = read_bounded(stdin, limit=strictjson.STATE_LIMIT)
    state = strictjson.loads_object(state_bytes, what=STATE_WHAT, limit=strictjson.STATE_LIMIT)
    bundle = strictjson.get_str(state, "bundle" if "bundle" in state else "bundlePath", what=STATE_WHAT)
    spec_bytes = read_config_json(bundle, limit=strictjson.SPEC_LIMIT)
    spec = strictjson.loads_object(spec_bytes, what=f"{bundle}/config.json", limit=strictjson.SPEC_LIMIT)
    if not asks_for_gpu(spec):
        return 0
    from gpuhook.daemon import client, wire

    path = daemon_socket or wire.DEFAULT_SOCKET
    if path == "none":
        note = "disabled (--daemon-socket none)"
    else:
        try:
            status, message = client.call_daemon(path, config=config_arg, debug=debug, env=env, state=state_bytes,
                                                 spec=spec_bytes)
        except client.NotServed as why:
            note = str(why)
        else:
            if message:
                print(message, end="", file=sys.stderr)
            return status
    from gpuhook.cli.inject import inject

    return inject(config_arg, debug, env, state, spec, served_by="hook", daemon_note=note)

"""``gpuhook prestart|createRuntime|poststart|poststop``: the OCI hook itself, and its no-GPU fast path.

Every container start may run the hook (a hooks.d ``always`` rule), so a container that asks
for no GPU costs reading stdin and config.json and nothing else: this module and
``gpuhook.hookcall`` import only the C JSON scanner, ``os``, ``select``, ``stat`` and ``time`` (no
dataclasses, typing, YAML, logging or NVML). A GPU request goes to gpuhookd when one serves,
else continues in ``gpuhook.service`` with the same decoded objects.
"""

from __future__ import annotations

import sys

from gpuhook.hookcall import NOTHING, START, lease_may_exist, read_bounded, read_hook_call
from gpuhook.oci import strictjson

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

    from gpuhook.hookcall import HookArgs, HookCall


def run_hook(args: HookArgs, stdin_fd: int, env: Mapping[str, str]) -> int:
    """Do what the stage in *args* does for the container in the OCI state on *stdin_fd*.

    A GPU request goes to gpuhookd at ``--daemon-socket`` (default ``/run/gpuhook/gpuhookd.sock``,
    ``none``: never) when one serves it; otherwise this process does the work.
    """
    state_bytes = read_bounded(stdin_fd, limit=strictjson.STATE_LIMIT)  # a runtime may block writing it
    call = read_hook_call(args, env, state_bytes)
    if args.action == NOTHING or (args.action == START and not call.asks_gpu):
        return 0
    if args.action != START:
        return _stop(call)
    return _start(call)


def _stop(call: HookCall) -> int:
    """poststop: release the container's lease; a container that holds none costs no more than a no-GPU start."""
    container_id = call.state.get("id")
    if isinstance(container_id, str) and not lease_may_exist(call.args.config, call.env, container_id):
        return 0
    from gpuhook import service

    config = service.load_settings(call.args.config, call.args.debug, call.env)
    service.stop(config, call.state, served_by="hook")
    return 0


def _start(call: HookCall) -> int:
    """A GPU request: gpuhookd's, when it serves, else this process's."""
    from gpuhook.daemon import client, wire

    path = call.args.daemon_socket or wire.DEFAULT_SOCKET
    if path == "none":
        note = "disabled (--daemon-socket none)"
    else:
        try:
            status, message = client.call_daemon(path, config=call.args.config, debug=call.args.debug, env=call.env,
                                                 state=call.state_bytes, spec=call.spec_bytes)
        except client.NotServed as why:
            note = str(why)
        else:
            if message:
                print(message, end="", file=sys.stderr)
            return status
    from gpuhook import service
    from gpuhook.cli.hygiene import settle_process

    settle_process()
    config = service.load_settings(call.args.config, call.args.debug, call.env)
    service.start_hook(config, call.state, call.spec, served_by="hook", daemon_note=note)
    return 0

"""The runtime wrapper's call (``gpuhook-runtime``, ``nvidia-container-runtime``): its argv, its engine's
environment, and the hooks it registers in the bundle.

Shared by the Python wrapper (``cli/runtime.py``) and gpuhookd, which serves the spec edit of a
GPU ``create`` relayed by relay/gpuhook-runtime.c through gpuhook-relay: both read the same argv the
same way and register the same hooks, so a container cannot tell which of them edited its spec.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import PurePath
from typing import Any, Final

HOOK_ENV: Final = ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]
ENGINE_ENV_FIX: Final = ("gpuhook-runtime inherits its engine's environment (dockerd's, or containerd's for its "
                         "shims): remove them from that service's unit (systemctl edit docker.service, "
                         "containerd.service, or k3s.service or rke2-server.service, whose containerd it is) "
                         "and restart it")
#: The stages the wrapper registers gpuhook's hook for: the start that gives the GPUs, and the
#: deletion that releases their lease.
HOOK_STAGES: Final = ("prestart", "poststop")
#: runc's and crun's global options that take a value (``--root DIR`` or ``--root=DIR``), as
#: relay/gpuhook-runtime.c skips them to find the command word.
VALUE_OPTIONS: Final = frozenset({"--root", "--log", "--log-format", "--log-level", "--criu", "--rootless",
                                  "--cgroup-manager"})
#: containerd's opt plugin puts its library directory first in every shim's, and so the runtime's,
#: LD_LIBRARY_PATH ("/opt/containerd/lib:", k3s's "/var/lib/rancher/k3s/agent/containerd/lib", any
#: moved state's): the engine's own setting for runc, which gets it for every call whatever gpuhook does.
#: The C front-ends start the Python wrapper without it (relay/tripwire.h).
ENGINE_LIBRARY_PATH: Final = "LD_LIBRARY_PATH"
#: argv[0] of a spec edit gpuhook-relay relays for relay/gpuhook-runtime.c (then the relay's own
#: path, then the runtime's argv)
RELAYED: Final = "gpuhook-runtime"
#: the engine's setting of gpuhookd's socket for the wrapper (an absolute path; default
#: /run/gpuhook/gpuhookd.sock), which the hooks it registers are given too
SOCKET_ENV: Final = "GPUHOOK_DAEMON_SOCKET"


def command_at(argv: Sequence[str]) -> int:
    """The index of the command word: the first argument that is not a global option (len(argv) if none)."""
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        if argv[i] == "--":
            return i + 1
        i += 2 if argv[i] in VALUE_OPTIONS else 1
    return min(i, len(argv))


def bundle_arg(argv: Sequence[str]) -> str | None:
    """The bundle of a ``create``/``run`` invocation as given (``--bundle``/``-b``; "" for the default,
    the cwd); None for any other command."""
    at = command_at(argv)
    if at == len(argv) or argv[at] not in ("create", "run"):
        return None
    rest = list(argv[at + 1:])
    for i, arg in enumerate(rest):
        if arg in ("--bundle", "-b") and i + 1 < len(rest):
            return rest[i + 1]
        name, eq, value = arg.partition("=")
        if eq and name in ("--bundle", "-b"):
            return value
    return ""


def engine_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The engine's *env* as the tripwire judges it for runc: without ENGINE_LIBRARY_PATH, whatever its value;
    every other variable the tripwire names (LD_PRELOAD, LD_AUDIT, ...) an engine never sets for runc."""
    return {key: value for key, value in env.items() if key != ENGINE_LIBRARY_PATH}


def hook_entry(config: str | None, stage: str = "prestart", relay: PurePath | None = None,
               socket: str | None = None) -> dict[str, Any]:
    """gpuhook's hook for *stage*: *relay* (gpuhook-relay, served by gpuhookd), else as this interpreter runs
    it (absolute path, isolated); an explicit env either way. *socket*: gpuhookd's, if not the default."""
    given = [*(["--config", config] if config else []), *(["--daemon-socket", socket] if socket else [])]
    if relay is not None:
        return {"path": str(relay), "args": [str(relay), *given, stage], "env": HOOK_ENV}
    return {"path": sys.executable, "args": [sys.executable, "-I", "-m", "gpuhook", *given, stage], "env": HOOK_ENV}


def add_hook(spec: dict[str, Any], hook: dict[str, Any], stage: str = "prestart") -> dict[str, Any]:
    """*spec* with *hook* first among the *stage* hooks (once)."""
    hooks = spec.setdefault("hooks", {}).setdefault(stage, [])
    if hook not in hooks:
        hooks.insert(0, hook)
    return spec


def add_hooks(spec: dict[str, Any], config: str | None, relay: PurePath | None = None,
              socket: str | None = None) -> dict[str, Any]:
    """*spec* with gpuhook's hook first among the hooks of each of HOOK_STAGES (once each)."""
    for stage in HOOK_STAGES:
        add_hook(spec, hook_entry(config, stage, relay, socket), stage)
    return spec


def daemon_socket(env: Mapping[str, str]) -> str | None:
    """The engine's gpuhookd socket (``SOCKET_ENV``) if it sets an absolute one, else None (the default)."""
    value = env.get(SOCKET_ENV, "")
    return value if value.startswith("/") else None

"""``gpuhook-runtime``: a runc/crun wrapper that edits the spec on ``create``/``run``, then execs the runtime.

For ``docker run --runtime gpuhook`` (daemon.json ``runtimes``) and any engine
that takes a runtime path. On ``create`` or ``run`` it writes the requested
GPU devices and their rules into ``<bundle>/config.json`` (so the runtime owns
them: see ``planning/specedit.py``) and adds gpuhook's prestart hook for the
mounts and ld.so.cache, and its poststop hook, which releases the GPUs' lease
when the container is deleted; every other command passes straight through.
Installed, it runs behind relay/gpuhook-runtime.c, which execs runc itself for
every other command and for a container that certainly asks for no GPU.
The config comes from ``$GPUHOOK_CONFIG`` or ``/etc/gpuhook/config.yaml``.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from gpuhook.errors import GpuHookError, report_failure
from gpuhook.hookcall import check_environment

#: Trusted locations only: the wrapper runs as root and must not pick a runtime from a daemon's PATH.
RUNTIME_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HOOK_ENV: Final = ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]
ENGINE_ENV_FIX: Final = ("gpuhook-runtime inherits its engine's environment (dockerd's, or containerd's for its "
                         "shims): remove them from that service's unit (systemctl edit docker.service or "
                         "containerd.service) and restart it")
#: The stages the wrapper registers gpuhook's hook for: the start that gives the GPUs, and the
#: deletion that releases their lease.
HOOK_STAGES: Final = ("prestart", "poststop")


#: runc's and crun's global options that take a value (``--root DIR`` or ``--root=DIR``), as
#: relay/gpuhook-runtime.c skips them to find the command word.
VALUE_OPTIONS: Final = frozenset({"--root", "--log", "--log-format", "--log-level", "--criu", "--rootless",
                                  "--cgroup-manager"})


def command_at(argv: Sequence[str]) -> int:
    """The index of the command word: the first argument that is not a global option (len(argv) if none)."""
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        if argv[i] == "--":
            return i + 1
        i += 2 if argv[i] in VALUE_OPTIONS else 1
    return min(i, len(argv))


def bundle_of(argv: Sequence[str]) -> Path | None:
    """The bundle of a ``create``/``run`` invocation (``--bundle``/``-b``, default cwd); None otherwise."""
    at = command_at(argv)
    if at == len(argv) or argv[at] not in ("create", "run"):
        return None
    rest = list(argv[at + 1:])
    for i, arg in enumerate(rest):
        if arg in ("--bundle", "-b") and i + 1 < len(rest):
            return Path(rest[i + 1])
        name, eq, value = arg.partition("=")
        if eq and name in ("--bundle", "-b"):
            return Path(value)
    return Path.cwd()


def log_target(argv: Sequence[str]) -> tuple[str | None, str]:
    """runc's global ``--log FILE`` and ``--log-format text|json`` (before the command word)."""
    path, fmt = None, "text"
    words = list(argv[:command_at(argv)])
    for i, word in enumerate(words):
        name, eq, value = word.partition("=")
        if name in ("--log", "--log-format") and not eq and i + 1 < len(words):
            value = words[i + 1]
        if name == "--log":
            path = value
        elif name == "--log-format":
            fmt = value
    return path, fmt


def write_runtime_log(path: str, fmt: str, message: str) -> None:
    """One error line where the engine reads a runtime's failure (containerd's shim: ``log.json``, as
    logrus writes it for runc), so docker shows gpuhook's reason instead of "unable to retrieve OCI
    runtime error"."""
    import datetime
    import json

    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    line = (json.dumps({"level": "error", "msg": message, "time": now}) if fmt == "json"
            else f'time="{now}" level=error msg={json.dumps(message)}')
    try:
        with open(path, "a", encoding="utf-8") as log:
            log.write(line + "\n")
    except OSError as err:  # the message still goes to stderr
        print(f"gpuhook-runtime: cannot write the runtime log {path}: {err.strerror or err}", file=sys.stderr)


#: containerd starts every shim, and so the runtime, with its own library directory added to
#: LD_LIBRARY_PATH (observed: "/opt/containerd/lib:"): the engine's setting, not the container's.
CONTAINERD_LIBRARY_PATH: Final = frozenset({"/opt/containerd/lib", ""})


def engine_environment(env: Mapping[str, str]) -> dict[str, str]:
    """*env* without containerd's own LD_LIBRARY_PATH (exactly that value; anything else still trips the check)."""
    return {key: value for key, value in env.items()
            if not (key == "LD_LIBRARY_PATH" and set(value.split(":")) <= CONTAINERD_LIBRARY_PATH)}


def installed_relay() -> Path | None:
    """gpuhook-relay beside this wrapper's launcher (the packages' ``bin/``, which ``libexec/gpuhook-runtime``
    runs by absolute path), to register instead of the Python hook: gpuhookd then serves the start."""
    launcher = Path(sys.argv[0])
    relay = launcher.with_name("gpuhook-relay")
    return relay if launcher.is_absolute() and relay.is_file() else None


def hook_entry(config: str | None, stage: str = "prestart", relay: Path | None = None) -> dict[str, Any]:
    """gpuhook's hook for *stage*: *relay* (gpuhook-relay, served by gpuhookd), else as this interpreter runs
    it (absolute path, isolated); an explicit env either way."""
    given = ["--config", config] if config else []
    if relay is not None:
        return {"path": str(relay), "args": [str(relay), *given, stage], "env": HOOK_ENV}
    return {"path": sys.executable, "args": [sys.executable, "-I", "-m", "gpuhook", *given, stage], "env": HOOK_ENV}


def add_hook(spec: dict[str, Any], hook: dict[str, Any], stage: str = "prestart") -> dict[str, Any]:
    """*spec* with *hook* first among the *stage* hooks (once)."""
    hooks = spec.setdefault("hooks", {}).setdefault(stage, [])
    if hook not in hooks:
        hooks.insert(0, hook)
    return spec


def add_hooks(spec: dict[str, Any], config: str | None, relay: Path | None = None) -> dict[str, Any]:
    """*spec* with gpuhook's hook first among the hooks of each of HOOK_STAGES (once each)."""
    for stage in HOOK_STAGES:
        add_hook(spec, hook_entry(config, stage, relay), stage)
    return spec


def main(argv: Sequence[str] | None = None) -> int:
    """Edit the bundle when a container is created, then exec the real runtime."""
    args = list(sys.argv[1:] if argv is None else argv)
    runtime = shutil.which("runc", path=RUNTIME_PATH) or shutil.which("crun", path=RUNTIME_PATH)
    if runtime is None:
        print(f"gpuhook-runtime: neither runc nor crun found in {RUNTIME_PATH}", file=sys.stderr)
        return 1
    bundle = bundle_of(args)
    if bundle is not None:
        try:
            # it runs as root for the container being created, with the engine's environment
            check_environment(engine_environment(os.environ), fix=ENGINE_ENV_FIX)
            _edit(bundle.absolute(), os.environ.get("GPUHOOK_CONFIG"))
        except GpuHookError as err:
            message = report_failure(err)
            print(message, file=sys.stderr)
            log, fmt = log_target(args)
            if log is not None:
                write_runtime_log(log, fmt, message)
            return 1
    os.execv(runtime, [runtime, *args])


def _edit(bundle: Path, config: str | None) -> None:
    """Put the devices and the hook into ``<bundle>/config.json`` if the container asks for a GPU."""
    from gpuhook import service
    from gpuhook.cli.specedit import write_spec
    from gpuhook.hookcall import read_config_json
    from gpuhook.oci import strictjson
    from gpuhook.oci.spec import SPEC_LIMIT, spec_from_object
    from gpuhook.request.quick import asks_for_gpu

    path = bundle / "config.json"
    raw = strictjson.loads_object(read_config_json(str(bundle), limit=SPEC_LIMIT), what=str(path), limit=SPEC_LIMIT)
    if not asks_for_gpu(raw):
        return
    settings = service.load_settings(config, False, os.environ)
    spec = spec_from_object(raw, bundle)
    if service.request_for(spec, settings) is None:  # void, or a marker that asks for nothing
        return
    edited = service.render_spec_edit(settings, raw, spec, hook_follows=True)
    # The hooks go in whenever a GPU is asked for: the prestart one takes the lease (and places a
    # count=N request, which the spec edit leaves to it), the poststop one gives it back.
    write_spec(path, add_hooks(dict(edited), config, installed_relay()))

"""``gpuhook-runtime``: a runc/crun wrapper that edits the spec on ``create``/``run``, then execs the runtime.

For ``docker run --runtime gpuhook`` (daemon.json ``runtimes``) and any engine
that takes a runtime path. On ``create`` or ``run`` it writes the requested
GPU devices and their rules into ``<bundle>/config.json`` (so the runtime owns
them: see ``planning/specedit.py``) and adds gpuhook's prestart hook for the
mounts and ld.so.cache, and its poststop hook, which releases the GPUs' lease
when the container is deleted; every other command passes straight through.
Installed, it runs behind relay/gpuhook-runtime.c, which execs runc itself for
every other command and for a container that certainly asks for no GPU, and
starts this interpreter without the tripwire's variables, handing it the
engine's environment for runc (``hygiene.runc_environment``).
The config comes from ``$GPUHOOK_CONFIG`` or ``/etc/gpuhook/config.yaml``.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

from gpuhook.cli.hygiene import runc_environment
from gpuhook.errors import GpuHookError, report_failure
from gpuhook.hookcall import check_environment
from gpuhook.request.runtimecall import (ENGINE_ENV_FIX, ENGINE_LIBRARY_PATH, bundle_arg, command_at, daemon_socket,
                                         engine_environment)

#: Trusted locations only: the wrapper runs as root and must not pick a runtime from a daemon's PATH.
RUNTIME_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def bundle_of(argv: Sequence[str]) -> Path | None:
    """The bundle of a ``create``/``run`` invocation (``--bundle``/``-b``, default cwd); None otherwise."""
    given = bundle_arg(argv)
    return None if given is None else Path(given) if given else Path.cwd()


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


def installed_relay() -> Path | None:
    """gpuhook-relay beside this wrapper's launcher (the packages' ``bin/``, which ``libexec/gpuhook-runtime``
    runs by absolute path), to register instead of the Python hook: gpuhookd then serves the start."""
    launcher = Path(sys.argv[0])
    relay = launcher.with_name("gpuhook-relay")
    return relay if launcher.is_absolute() and relay.is_file() else None


def interpreter_environment(env: Mapping[str, str]) -> dict[str, str]:
    """This interpreter's *env* as the tripwire judges it: without an ENGINE_LIBRARY_PATH of root's directories
    only, as containerd's opt plugin sets it when the engine runs this wrapper directly (`/opt/containerd/lib`,
    k3s's, RKE2's: wherever its state is). The loader has searched them already; what only root can put there
    injects nothing root did not. Any other value needs the C front-end, which starts this wrapper without it."""
    return {key: value for key, value in env.items()
            if not (key == ENGINE_LIBRARY_PATH and all(map(_root_only, value.split(":"))))}


def _root_only(directory: str) -> bool:
    """Whether only root can have put a file in *directory*: "" (the loader's no-op), or an absolute path whose
    every existing component, from /, is root's and writable by no one else, and no symlink (a missing one:
    its parent, checked, is root's alone)."""
    if not directory:
        return True
    if not directory.startswith("/"):
        return False  # relative to whatever directory the engine started in
    path = "/"
    for part in ["", *filter(None, directory.split("/"))]:
        path = os.path.join(path, part)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
            return False
    return True


def front_end_fix() -> str:
    """What to register instead of this wrapper, whose interpreter got the engine's loader variables."""
    launcher = Path(sys.argv[0])
    front_end = launcher.parent.parent / "libexec" / "gpuhook-runtime"  # the packages' layout
    name = (str(front_end) if launcher.is_absolute() and front_end.is_file()
            else "gpuhook's C front-end (the packages' /usr/bin/gpuhook-runtime)")
    return (f"The engine runs the Python wrapper {launcher} itself: register {name} as the runtime instead, "
            "which gives runc the engine's environment and starts the Python wrapper without them")


def main(argv: Sequence[str] | None = None) -> int:
    """Edit the bundle when a container is created, then exec the real runtime."""
    args = list(sys.argv[1:] if argv is None else argv)
    runtime = shutil.which("runc", path=RUNTIME_PATH) or shutil.which("crun", path=RUNTIME_PATH)
    if runtime is None:
        print(f"gpuhook-runtime: neither runc nor crun found in {RUNTIME_PATH}", file=sys.stderr)
        return 1
    bundle = bundle_of(args)
    try:
        engine_env = runc_environment(os.environ)
        if bundle is not None:
            # runc runs as root for the container with the engine's environment: what no engine sets for it
            check_environment(engine_environment(engine_env), fix=ENGINE_ENV_FIX)
            # and this interpreter, root too, must have started without any of them
            check_environment(interpreter_environment(os.environ), fix=front_end_fix())
            _edit(bundle.absolute(), os.environ.get("GPUHOOK_CONFIG"))
    except GpuHookError as err:
        message = report_failure(err)
        print(message, file=sys.stderr)
        log, fmt = log_target(args)
        if log is not None:
            write_runtime_log(log, fmt, message)
        return 1
    os.execve(runtime, [runtime, *args], engine_env)


def _edit(bundle: Path, config: str | None) -> None:
    """Put the devices and the hook into ``<bundle>/config.json`` if the container asks for a GPU."""
    from gpuhook import service

    service.edit_runtime_bundle(lambda: service.load_settings(config, False, os.environ), config, bundle,
                                installed_relay(), socket=daemon_socket(os.environ))

"""Command line: ``gpuhook [--config FILE] [--debug] COMMAND``.

``main(argv) -> int`` owns exit codes (0 done, 1 refused or failed, 2 usage);
nothing below the CLI prints, exits or reads ``os.environ``.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

from gpuhook import __version__
from gpuhook.errors import GpuHookError

TYPE_CHECKING = False  # importing typing costs ~3 ms of every container start
if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence
    from typing import Any, NoReturn

HOOK_STAGES = ("prestart", "createRuntime")
NOOP_STAGES = ("poststart", "poststop")


def _parser() -> argparse.ArgumentParser:
    """The argument parser (built on demand, never for a plain hook call: see hook_argv)."""
    import argparse

    from gpuhook.daemon.wire import DEFAULT_SOCKET

    parser = argparse.ArgumentParser(prog="gpuhook", description="OCI hook that gives containers NVIDIA GPUs.")
    parser.add_argument(
        "--config", metavar="FILE", help="config file (default: $GPUHOOK_CONFIG, then /etc/gpuhook/config.yaml)"
    )
    parser.add_argument("--debug", action="store_true", help="log at debug level")
    parser.add_argument("--daemon-socket", metavar="PATH",
                        help=f"hooks: hand GPU requests to gpuhookd here (default {DEFAULT_SOCKET}; 'none': never)")
    parser.add_argument("--version", action="version", version=f"gpuhook {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for stage in HOOK_STAGES:
        commands.add_parser(stage, help="inject the requested GPUs (OCI state on stdin)")
    for stage in NOOP_STAGES:
        commands.add_parser(stage, help="accepted for NVIDIA compatibility; does nothing")
    plan = commands.add_parser("plan", help="dry run: print the plan for a bundle as JSON")
    plan.add_argument("--bundle", required=True, help="the OCI bundle directory (holding config.json)")
    edit = commands.add_parser("spec-edit", help="write the requested GPU devices into <bundle>/config.json")
    edit.add_argument("--bundle", required=True, help="the OCI bundle directory (holding config.json)")
    commands.add_parser("precreate", help="podman's precreate stage: spec on stdin, edited spec on stdout")
    daemon = commands.add_parser("daemon", help="gpuhookd: serve hooks from a warm process (systemd: gpuhookd.socket)")
    daemon.add_argument("--socket", default=DEFAULT_SOCKET, help=f"listen here (default {DEFAULT_SOCKET}); "
                        "ignored when systemd passes the socket")
    daemon.add_argument("--request-timeout", type=float, default=120.0, metavar="SECONDS",
                        help="kill a request's worker after this long (default 120)")
    commands.add_parser("doctor", help="check the driver, ldconfig and device-cgroup set-up; say how to fix")
    info = commands.add_parser("info", help="the host's driver and GPUs")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.add_argument("--refresh", action="store_true", help="rebuild the inventory cache from NVML (and print)")
    cdi = commands.add_parser("cdi", help="the host's GPUs as a CDI spec (kind nvidia.com/gpu)")
    cdi_commands = cdi.add_subparsers(dest="cdi_command", required=True, metavar="CDI_COMMAND")
    generate = cdi_commands.add_parser("generate", help="write the CDI spec (stdout unless --output)")
    generate.add_argument("--output", metavar="FILE", help="write here, atomically (e.g. /var/run/cdi/nvidia.yaml)")
    generate.add_argument("--format", dest="fmt", choices=("yaml", "json"),
                          help="default: json for a .json output file, else yaml")
    cdi_commands.add_parser("list", help="print the CDI device names (nvidia.com/gpu=0, ...)")
    # hidden (no help): only the generated spec's createContainer hook calls it
    cdi_hook = commands.add_parser("cdi-hook").add_subparsers(dest="hook_command", required=True)
    ldcache = cdi_hook.add_parser("update-ldcache")
    ldcache.add_argument("--folder", action="append", required=True, help="a library dir in the container")
    install = commands.add_parser("install", help="register gpuhook with a container engine (says what to restart)")
    install.add_argument("--runtime", required=True, choices=("docker", "containerd", "podman", "crio"))
    install.add_argument("--dry-run", action="store_true", help="print the changes (a diff) and change nothing")
    install.add_argument("--root", default="/", help="the host's root (a mounted host filesystem, in an installer)")
    install.add_argument("--bin-dir", help="where gpuhook's executables are (default: this interpreter's bin dir)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the process exit status."""
    words = sys.argv[1:] if argv is None else list(argv)
    args: Any = hook_argv(words) or _parser().parse_args(words)
    try:
        if args.command in HOOK_STAGES:
            from gpuhook.cli.hook import run_hook

            return run_hook(args.config, args.debug, sys.stdin.buffer, os.environ, daemon_socket=args.daemon_socket)
        if args.command in NOOP_STAGES:
            sys.stdin.buffer.read()  # drain: a runtime may block writing the state
            return 0
        return _run_command(args)
    except GpuHookError as err:
        _report_failure(err)
        return 1
    except BrokenPipeError:
        # `gpuhook plan | head`: the reader left; exit quietly instead of a traceback at shutdown.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def exit_now(status: int) -> NoReturn:
    """Flush stdout and stderr and exit with *status*, skipping the interpreter's finalization.

    Tearing down every module and collecting garbage at exit costs about 3 ms of each hook
    run (measured: ``python -I -c pass`` against ``os._exit(0)``), and nothing here needs it:
    the log is flushed per event, and files are closed (or renamed into place) when written.
    Launchers and console scripts call this; ``main`` itself returns, for tests and callers.
    """
    for stream in (sys.stdout, sys.stderr):
        # not contextlib.suppress: importing contextlib costs ~4 ms of every no-GPU start
        try:  # noqa: SIM105
            stream.flush()
        except (OSError, ValueError):  # a reader that left, a closed stream: nothing to add
            pass
    os._exit(status)


def _run_command(args: Any) -> int:  # noqa: PLR0911 - one return per command
    """The commands people run by hand (each imports its module only when used)."""
    env, config, debug = os.environ, args.config, args.debug
    match args.command:
        case "daemon":
            from gpuhook.cli.daemon import run_daemon

            return run_daemon(args.socket, request_timeout=args.request_timeout, env=os.environ)
        case "doctor":
            from gpuhook.cli.doctor import run_doctor
            from gpuhook.daemon.wire import DEFAULT_SOCKET

            return run_doctor(config, debug, env, daemon_socket=args.daemon_socket or DEFAULT_SOCKET)
        case "spec-edit":
            from gpuhook.cli import specedit

            return specedit.run_spec_edit(config, debug, args.bundle, env)
        case "precreate":
            from gpuhook.cli import specedit

            return specedit.run_precreate(config, debug, sys.stdin.buffer, env)
        case "cdi":
            from gpuhook.cli import cdi

            if args.cdi_command == "generate":
                return cdi.run_cdi_generate(config, debug, env, output=args.output, fmt=args.fmt)
            return cdi.run_cdi_list(config, debug, env)
        case "cdi-hook":
            from gpuhook.cli import cdi

            return cdi.run_update_ldcache(config, debug, sys.stdin.buffer, env, args.folder)
        case "install":
            from pathlib import Path

            from gpuhook.cli.install import run_install

            bin_dir = Path(args.bin_dir) if args.bin_dir else Path(sys.executable).parent
            return run_install(args.runtime, dry_run=args.dry_run, root=Path(args.root), bin_dir=bin_dir,
                               python=sys.executable)
        case "plan":
            from gpuhook.cli import inspect

            return inspect.run_plan(config, debug, args.bundle, env)
        case _:
            from gpuhook.cli import inspect

            return inspect.run_info(config, debug, env, as_json=args.json, refresh=args.refresh)


def hook_argv(words: Sequence[str]) -> SimpleNamespace | None:
    """``[--config FILE] [--debug] STAGE`` for a hook or no-op stage, decoded by hand; else None.

    Runtimes run the hook for every container (with a hooks.d ``always`` rule, for
    containers without GPUs too), and importing argparse and building the parser costs
    about as much as the whole no-GPU path. The argv shapes runtimes send are decoded
    here; anything else (help, version, abbreviations, mistakes, other commands) returns
    None and goes through argparse, which owns usage messages and exit status 2.
    """
    config: str | None = None
    debug = False
    daemon_socket: str | None = None
    rest = list(words)
    while len(rest) > 1:
        word = rest.pop(0)
        if word == "--debug":
            debug = True
        elif word == "--config" and not rest[0].startswith("-") and len(rest) > 1:
            config = rest.pop(0)
        elif word.startswith("--config="):
            config = word.removeprefix("--config=")
        elif word == "--daemon-socket" and len(rest) > 1:
            daemon_socket = rest.pop(0)
        else:
            return None
    if len(rest) != 1 or rest[0] not in HOOK_STAGES + NOOP_STAGES:
        return None
    return SimpleNamespace(command=rest[0], config=config, debug=debug, daemon_socket=daemon_socket)


def _report_failure(err: GpuHookError) -> None:
    """One log event (if logging is set up) and one plain line on stderr."""
    print(describe_failure(err), file=sys.stderr)


def describe_failure(err: GpuHookError) -> str:
    """Log *err* (if logging is set up) and return the line for the user (gpuhookd sends it back)."""
    log = sys.modules.get("gpuhook.log")
    if log is not None and log.is_configured():
        log.get_logger().error("hook_failed", kind=type(err).__name__, error=str(err))
    return f"gpuhook: {err}"

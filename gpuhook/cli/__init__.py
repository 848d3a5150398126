"""Command line: ``gpuhook [--config FILE] [--debug] COMMAND``.

``main(argv) -> int`` owns exit codes (0 done, 1 refused or failed, 2 usage);
nothing below the CLI prints, exits or reads ``os.environ``. The hook stages are read by
``gpuhook.hookcall`` (no argparse on that path); every other command's work is a call into
``gpuhook.service``.
"""

from __future__ import annotations

import os
import sys

from gpuhook import __version__
from gpuhook.errors import GpuHookError, SpecError, UsageError, report_failure
from gpuhook.hookcall import STAGES, HookArgs, check_environment, parse_hook_argv

TYPE_CHECKING = False  # importing typing costs ~3 ms of every container start
if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence
    from typing import Any, NoReturn

#: Commands that act as root on a container's behalf (besides the hook stages): each checks its own
#: environment first (hookcall.check_environment), as the hook does.
ACTS_FOR_CONTAINERS = frozenset({"spec-edit", "precreate", "cdi-hook", "daemon"})


def _parser() -> argparse.ArgumentParser:
    """The argument parser (built on demand, never for a plain hook call: see hook_argv)."""
    import argparse

    from gpuhook.daemon.wire import DEFAULT_SOCKET

    class Parser(argparse.ArgumentParser):
        """argparse, with its error line in gpuhook's form (``gpuhook: COMMAND: ...``; exit status 2)."""

        def error(self, message: str) -> NoReturn:
            """Print the usage and one ``gpuhook:`` line, exit 2."""
            self.print_usage(sys.stderr)
            where = self.prog.removeprefix("gpuhook").strip()
            self.exit(2, f"gpuhook: {where + ': ' if where else ''}{message}\n")

    parser = Parser(prog="gpuhook", description="OCI hook that gives containers NVIDIA GPUs.")
    parser.add_argument(
        "--config", metavar="FILE", help="config file (default: $GPUHOOK_CONFIG, then /etc/gpuhook/config.yaml, then "
        "NVIDIA's /etc/nvidia-container-runtime/config.toml); a .toml file is read as NVIDIA's"
    )
    parser.add_argument("--debug", action="store_true", help="log at debug level")
    parser.add_argument("--daemon-socket", metavar="PATH",
                        help=f"hooks: hand GPU requests to gpuhookd here (default {DEFAULT_SOCKET}; 'none': never)")
    parser.add_argument("--version", action="version", version=f"gpuhook {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    helps = {"start": "inject the requested GPUs (OCI state on stdin)",
             "stop": "release what the container's start took (OCI state on stdin)",
             "nothing": "accepted for NVIDIA compatibility; does nothing"}
    for stage, action in STAGES.items():
        commands.add_parser(stage, help=helps[action])
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
    status = commands.add_parser("status", help="every GPU, its sharing policy and the containers holding it")
    shape = status.add_mutually_exclusive_group()
    shape.add_argument("--json", action="store_true", help="print JSON")
    shape.add_argument("--prometheus", action="store_true",
                       help="print the metrics endpoint's text (for node-exporter's textfile collector)")
    release = commands.add_parser("release", help="drop a container's GPU lease by hand (its holder may still run)")
    release.add_argument("container_id", metavar="CONTAINER_ID", help="the container's id (`gpuhook status`)")
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
    _add_config_parser(commands)
    install = commands.add_parser("install", help="register gpuhook with a container engine (says what to restart)")
    install.add_argument("--runtime", required=True, choices=("docker", "containerd", "podman", "crio"))
    install.add_argument("--dry-run", action="store_true", help="print the changes (a diff) and change nothing")
    install.add_argument("--root", default="/", help="the host's root (a mounted host filesystem, in an installer)")
    install.add_argument("--bin-dir", help="where gpuhook's executables are (default: this interpreter's bin dir)")
    install.add_argument("--name", help="docker/containerd/crio: the runtime handler's name (default gpuhook; "
                         "nvidia keeps --runtime nvidia and RuntimeClass nvidia); crio: a handler, not hooks.d")
    install.add_argument("--set-as-default", action="store_true",
                         help="docker/containerd/crio: make it the default runtime, for every container")
    return parser


def _add_config_parser(commands: Any) -> None:
    """``gpuhook config show`` and ``gpuhook config import [--from PATH] [--output PATH] [--dry-run] [--force]``."""
    config = commands.add_parser("config", help="the effective configuration; NVIDIA's config.toml as gpuhook.yaml")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="CONFIG_COMMAND")
    config_commands.add_parser("show", help="print every setting as gpuhook.yaml text, with where it came from")
    config_import = config_commands.add_parser(
        "import", help="write NVIDIA's config.toml as the equivalent gpuhook.yaml (warns about unmapped keys)")
    config_import.add_argument("--from", dest="source", metavar="PATH",
                               help="NVIDIA's config (default /etc/nvidia-container-runtime/config.toml)")
    config_import.add_argument("--output", metavar="PATH", help="where to write (default /etc/gpuhook/config.yaml)")
    config_import.add_argument("--dry-run", action="store_true", help="print the gpuhook.yaml, write nothing")
    config_import.add_argument("--force", action="store_true", help="replace an existing, different --output")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the process exit status."""
    words = sys.argv[1:] if argv is None else list(argv)
    try:
        hook = parse_hook_argv(words)
        if hook is not None:
            from gpuhook.cli.hook import run_hook

            return run_hook(hook, _stdin_fd("the OCI state"), os.environ)
        args: Any = _parser().parse_args(words)
        if args.command in STAGES:  # a spelling only argparse takes (an abbreviated option)
            from gpuhook.cli.hook import run_hook

            hook = HookArgs(args.command, args.config, args.debug, args.daemon_socket)
            return run_hook(hook, _stdin_fd("the OCI state"), os.environ)
        if args.command in ACTS_FOR_CONTAINERS:
            check_environment(os.environ, fix="Run it from a shell or unit without them (env -u NAME ..., "
                                              "or the unit's Environment=/UnsetEnvironment=)")
        return _run_command(args)
    except GpuHookError as err:
        print(report_failure(err), file=sys.stderr)
        return 2 if isinstance(err, UsageError) else 1
    except BrokenPipeError:
        # `gpuhook plan | head`: the reader left; exit quietly instead of a traceback at shutdown.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _stdin_fd(what: str) -> int:
    """fd 0, which a command reading *what* from stdin reads; refused when this process was started without one."""
    # Python leaves sys.stdin None when fd 0 was closed at its start (`<&-`): a file opened since may hold fd 0.
    stream = sys.stdin
    try:
        if stream is not None:
            return stream.fileno()
    except (OSError, ValueError):  # a closed or fd-less stream
        pass
    raise SpecError(f"stdin is closed; this command reads {what} from it (a runtime passes it; by hand: "
                    f"gpuhook ... < FILE)")


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


def _run_command(args: Any) -> int:  # noqa: PLR0911, PLR0912 - one return (one case) per command
    """The commands people run by hand (each imports its module only when used)."""
    env, config, debug = os.environ, args.config, args.debug
    match args.command:
        case "daemon":
            from gpuhook.cli.daemon import run_daemon

            return run_daemon(args.socket, request_timeout=args.request_timeout, env=os.environ, config=config)
        case "doctor":
            from gpuhook.cli.doctor import run_doctor
            from gpuhook.daemon.wire import DEFAULT_SOCKET

            return run_doctor(config, debug, env, daemon_socket=args.daemon_socket or DEFAULT_SOCKET)
        case "spec-edit":
            from gpuhook.cli import specedit

            return specedit.run_spec_edit(config, debug, args.bundle, env)
        case "precreate":
            from gpuhook.cli import specedit

            return specedit.run_precreate(config, debug, _stdin_fd("the spec"), env)
        case "cdi":
            from gpuhook.cli import cdi

            if args.cdi_command == "generate":
                return cdi.run_cdi_generate(config, debug, env, output=args.output, fmt=args.fmt)
            return cdi.run_cdi_list(config, debug, env)
        case "cdi-hook":
            from gpuhook.cli import cdi

            return cdi.run_update_ldcache(config, debug, _stdin_fd("the OCI state"), env, args.folder)
        case "install":
            from pathlib import Path

            from gpuhook.cli.install import run_install

            bin_dir = Path(args.bin_dir) if args.bin_dir else Path(sys.executable).parent
            return run_install(args.runtime, dry_run=args.dry_run, root=Path(args.root), bin_dir=bin_dir,
                               python=sys.executable, name=args.name, default=args.set_as_default)
        case "config":
            from gpuhook.cli.configcmd import run_config

            return run_config(args, env)
        case "status":
            from gpuhook.cli import status

            return status.run_status(config, debug, env, as_json=args.json, prometheus=args.prometheus)
        case "release":
            from gpuhook.cli import status

            return status.run_release(config, debug, env, args.container_id)
        case "plan":
            from gpuhook.cli import inspect

            return inspect.run_plan(config, debug, args.bundle, env)
        case _:
            from gpuhook.cli import inspect

            return inspect.run_info(config, debug, env, as_json=args.json, refresh=args.refresh)

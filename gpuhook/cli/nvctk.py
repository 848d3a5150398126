"""``nvidia-ctk``: NVIDIA's toolkit CLI for the commands people script, mapped onto gpuhook's own.

``runtime configure`` is ``gpuhook install``'s runtime registration (the engine's config file
only, under NVIDIA's default name ``nvidia``), ``cdi generate``/``cdi list`` are ``gpuhook cdi``,
``config`` is ``gpuhook config show``. Flags are NVIDIA's, as ``--flag=value`` or ``--flag value``
(urfave/cli takes both); a boolean flag also takes ``=true``/``=false``. Anything else is a usage
error (exit 2) with one ``nvidia-ctk:`` line; no gpuhook process is started.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from gpuhook import __version__
from gpuhook.errors import GpuHookError, UsageError, report_failure

#: NVIDIA's default runtime name (``--nvidia-runtime-name``).
NVIDIA_NAME = "nvidia"
_TRUE, _FALSE = ("1", "t", "true", "yes"), ("0", "f", "false", "no")


def _bool(text: str) -> bool:
    """A boolean flag's ``=value`` as Go's ParseBool reads it (true/false, 1/0, t/f)."""
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean; expected true or false")


class _Parser(argparse.ArgumentParser):
    """argparse with the error as one ``nvidia-ctk: COMMAND: ...`` line (exit 2)."""

    def error(self, message: str) -> NoReturn:
        """Print the usage and one ``nvidia-ctk:`` line, exit 2."""
        self.print_usage(sys.stderr)
        where = self.prog.removeprefix("nvidia-ctk").strip()
        self.exit(2, f"nvidia-ctk: {where + ': ' if where else ''}{message}\n")


def _flag(parser: argparse.ArgumentParser, *names: str, help_: str) -> None:
    """A boolean flag: bare (true) or ``--name=true|false``."""
    parser.add_argument(*names, nargs="?", const=True, default=False, type=_bool, metavar="BOOL", help=help_)


def _parser() -> argparse.ArgumentParser:
    """NVIDIA's commands and flags that gpuhook answers."""
    parser = _Parser(prog="nvidia-ctk", allow_abbrev=False,
                     description="gpuhook's nvidia-ctk: NVIDIA's toolkit commands, done by gpuhook.")
    parser.add_argument("--version", "-v", action="version", version=f"nvidia-ctk (gpuhook {__version__})")
    # store_true, not _flag: an optional value here would swallow the command word after it
    parser.add_argument("--debug", "-d", action="store_true", help="log at debug level")
    parser.add_argument("--quiet", "-q", action="store_true", help="accepted for NVIDIA compatibility")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    runtime = commands.add_parser("runtime", help="register the runtime with a container engine")
    actions = runtime.add_subparsers(dest="action", required=True, metavar="ACTION", parser_class=_Parser)
    configure = actions.add_parser("configure", allow_abbrev=False,
                                   help="add the runtime to docker's, containerd's or CRI-O's config")
    configure.add_argument("--runtime", default="docker", choices=("docker", "containerd", "crio"),
                           help="the engine (default docker)")
    configure.add_argument("--config", metavar="PATH", help="the engine's config file (default "
                           "/etc/docker/daemon.json, /etc/containerd/config.toml, /etc/crio/crio.conf)")
    configure.add_argument("--drop-in-config", metavar="PATH",
                           help="containerd/crio: the drop-in file (default: conf.d / crio.conf.d beside --config)")
    configure.add_argument("--nvidia-runtime-name", "--runtime-name", dest="name", default=NVIDIA_NAME,
                           metavar="NAME", help=f"the runtime handler's name (default {NVIDIA_NAME})")
    configure.add_argument("--nvidia-runtime-path", "--runtime-path", dest="runtime_path", metavar="PATH",
                           help="the runtime executable (default: gpuhook-runtime beside this command)")
    configure.add_argument("--config-source", metavar="SOURCE",
                           help="accepted for NVIDIA compatibility: gpuhook always edits the file itself")
    _flag(configure, "--set-as-default", "--nvidia-set-as-default", help_="make it the engine's default runtime")
    _flag(configure, "--dry-run", help_="print the change (a diff) and write nothing")

    cdi = commands.add_parser("cdi", help="the host's GPUs as a CDI spec (kind nvidia.com/gpu)")
    cdi_actions = cdi.add_subparsers(dest="action", required=True, metavar="ACTION", parser_class=_Parser)
    generate = cdi_actions.add_parser("generate", allow_abbrev=False,
                                      help="write the CDI spec (stdout unless --output)")
    generate.add_argument("--output", metavar="PATH", help="write here, atomically (e.g. /var/run/cdi/nvidia.yaml)")
    generate.add_argument("--format", dest="fmt", choices=("yaml", "json"),
                          help="default: json for a .json output file, else yaml")
    cdi_actions.add_parser("list", allow_abbrev=False, help="print the CDI device names (nvidia.com/gpu=0, ...)")

    config = commands.add_parser("config", allow_abbrev=False, help="print the effective configuration")
    config.add_argument("--config-file", metavar="PATH",
                        help="NVIDIA's config.toml to read (default /etc/nvidia-container-runtime/config.toml)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one nvidia-ctk command; returns the exit status (0 done, 1 failed, 2 usage)."""
    words = sys.argv[1:] if argv is None else list(argv)
    try:
        args: Any = _parser().parse_args(words)
    except SystemExit as done:  # --help, --version (0) and usage errors (2, its line already printed)
        return done.code if isinstance(done.code, int) else 2
    try:
        return run(args, os.environ)
    except GpuHookError as err:
        print(report_failure(err), file=sys.stderr)
        return 2 if isinstance(err, UsageError) else 1


def run(args: Any, env: Mapping[str, str]) -> int:
    """One parsed command, done by gpuhook's own functions (each module imported only when used)."""
    debug = bool(args.debug)
    if args.command == "runtime":
        from gpuhook.cli.install import run_configure

        return run_configure(args.runtime, runtime=_runtime_path(args.runtime_path), config=_absolute(args.config),
                             dropin=_absolute(args.drop_in_config), name=args.name, default=args.set_as_default,
                             dry_run=args.dry_run)
    if args.command == "cdi":
        from gpuhook.cli import cdi

        if args.action == "generate":
            return cdi.run_cdi_generate(None, debug, env, output=args.output, fmt=args.fmt)
        return cdi.run_cdi_list(None, debug, env)
    from gpuhook.cli import configcmd

    return configcmd.run_config_show(args.config_file, debug, env)


def _absolute(path: str | None) -> Path | None:
    """*path* made absolute against the working directory (the files are written by absolute path)."""
    return None if path is None else Path(os.path.abspath(path))


def _runtime_path(given: str | None) -> Path:
    """The runtime the engine is to run: *given*, else gpuhook-runtime of this installation."""
    from gpuhook.cli.install import runtime_program

    if given is None:
        return runtime_program(Path(sys.executable).parent)
    if not given.startswith("/"):
        # an engine resolves a bare name on its own PATH, not ours: an absolute path says which program
        raise UsageError(f"--nvidia-runtime-path {given!r}: expected an absolute path (such as "
                         f"{Path(sys.executable).parent / 'gpuhook-runtime'})")
    return Path(given)

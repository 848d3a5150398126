"""Command line: ``gpuhook [--config FILE] [--debug] COMMAND``.

``main(argv) -> int`` owns exit codes (0 done, 1 refused or failed, 2 usage);
nothing below the CLI prints, exits or reads ``os.environ``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from gpuhook import __version__
from gpuhook.errors import GpuHookError

HOOK_STAGES = ("prestart", "createRuntime")
NOOP_STAGES = ("poststart", "poststop")


def _parser() -> argparse.ArgumentParser:
    """The argument parser (built on demand: cheap, and keeps imports lazy)."""
    parser = argparse.ArgumentParser(prog="gpuhook", description="OCI hook that gives containers NVIDIA GPUs.")
    parser.add_argument(
        "--config", metavar="FILE", help="config file (default: $GPUHOOK_CONFIG, then /etc/gpuhook/config.yaml)"
    )
    parser.add_argument("--debug", action="store_true", help="log at debug level")
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
    info = commands.add_parser("info", help="the host's driver and GPUs")
    info.add_argument("--json", action="store_true", help="print JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:  # noqa: PLR0911 - one return per command
    """Run one command; returns the process exit status."""
    args = _parser().parse_args(argv)
    try:
        if args.command in HOOK_STAGES:
            from gpuhook.cli.hook import run_hook

            return run_hook(args.config, args.debug, sys.stdin.buffer, os.environ)
        if args.command in NOOP_STAGES:
            sys.stdin.buffer.read()  # drain: a runtime may block writing the state
            return 0
        if args.command in ("spec-edit", "precreate"):
            from gpuhook.cli import specedit

            if args.command == "spec-edit":
                return specedit.run_spec_edit(args.config, args.debug, args.bundle, os.environ)
            return specedit.run_precreate(args.config, args.debug, sys.stdin.buffer, os.environ)
        from gpuhook.cli import inspect

        if args.command == "plan":
            return inspect.run_plan(args.config, args.debug, args.bundle, os.environ)
        return inspect.run_info(args.config, args.debug, os.environ, as_json=args.json)
    except GpuHookError as err:
        _report_failure(err)
        return 1
    except BrokenPipeError:
        # `gpuhook plan | head`: the reader left; exit quietly instead of a traceback at shutdown.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _report_failure(err: GpuHookError) -> None:
    """One log event (if logging is set up) and one plain line on stderr."""
    log = sys.modules.get("gpuhook.log")
    if log is not None and log.is_configured():
        import structlog

        structlog.get_logger().error("hook_failed", kind=type(err).__name__, error=str(err))
    print(f"gpuhook: {err}", file=sys.stderr)

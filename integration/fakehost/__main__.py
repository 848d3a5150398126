"""CLI: python3 -m integration.fakehost create DIR --gpus N [--mig GPU:PROFILE[,PROFILE...]]... [options]."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .builder import DEFAULT_CUDA, DEFAULT_DRIVER, DEFAULT_MODEL, FakeHost, FakeHostError, create_host
from .native import BuildError

_PROFILE_RE = re.compile(r"[0-9]+g\.[0-9]+gb(\+me)?|[0-9]+c\.[0-9]+g\.[0-9]+gb")


@dataclass(frozen=True, slots=True)
class MigRequest:
    """One --mig GPU:PROFILE[,PROFILE...] request."""

    gpu: int
    profiles: tuple[str, ...]


def parse_mig(text: str) -> MigRequest:
    """Parses GPU:PROFILE[,PROFILE...], e.g. 0:1g.10gb,3g.40gb."""
    gpu, sep, profiles = text.partition(":")
    names = tuple(profiles.split(",")) if profiles else ()
    if not sep or not gpu.isdigit() or not names or not all(_PROFILE_RE.fullmatch(name) for name in names):
        raise argparse.ArgumentTypeError(f"expected GPU:PROFILE[,PROFILE...] such as 0:1g.10gb, got {text!r}")
    return MigRequest(int(gpu), names)


def _parser() -> argparse.ArgumentParser:
    """The argument parser for the create command."""
    parser = argparse.ArgumentParser(prog="python3 -m integration.fakehost", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    create = commands.add_parser("create", help="build a simulated GPU host in DIR (new or empty)")
    create.add_argument("dir", metavar="DIR", type=Path)
    create.add_argument("--gpus", type=int, required=True, metavar="N")
    create.add_argument("--driver", default=DEFAULT_DRIVER, metavar="VERSION")
    create.add_argument("--cuda", default=DEFAULT_CUDA, metavar="VERSION")
    create.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME")
    create.add_argument(
        "--mig",
        type=parse_mig,
        action="append",
        default=[],
        metavar="GPU:PROFILE[,PROFILE...]",
        help="put GPU in MIG mode with one GPU instance per PROFILE (e.g. 0:1g.10gb,3g.40gb); repeatable",
    )
    return parser


def _layouts(requests: Sequence[MigRequest]) -> dict[int, tuple[str, ...]]:
    """The --mig requests by GPU; a GPU named twice gets both lists, in order."""
    layouts: dict[int, tuple[str, ...]] = {}
    for request in requests:
        layouts[request.gpu] = layouts.get(request.gpu, ()) + request.profiles
    return layouts


def _summary(host: FakeHost) -> str:
    """What was built, for a person reading the terminal."""
    lines = [
        f"simulated GPU host: {host.root}",
        f"driver {host.driver_version}, CUDA {host.cuda_version}, {len(host.gpus)} x {host.model}",
    ]
    for gpu in host.gpus:
        lines.append(f"  GPU {gpu.index}: {gpu.uuid} minor {gpu.minor} bus {gpu.pci_bus_id}")
        lines += [
            f"    MIG {mig.index}: {mig.profile} {mig.uuid} gi {mig.gi} ci {mig.ci}"
            f" caps nvidia-cap{mig.gi_cap_minor},nvidia-cap{mig.ci_cap_minor}"
            for mig in host.mig_devices
            if mig.parent_index == gpu.index
        ]
    lines.append(f"gpuhook config: {host.config_path}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        host = create_host(
            args.dir,
            gpus=args.gpus,
            driver=args.driver,
            cuda=args.cuda,
            model=args.model,
            mig=_layouts(args.mig) or None,
        )
    except (FakeHostError, BuildError) as error:
        print(f"fakehost: error: {error}", file=sys.stderr)
        return 1
    print(_summary(host))
    return 0


if __name__ == "__main__":
    sys.exit(main())

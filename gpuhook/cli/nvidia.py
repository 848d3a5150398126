"""``nvidia-container-runtime-hook`` / ``nvidia-container-toolkit``: NVIDIA's hook argv.

docker's ``--gpus`` runs ``nvidia-container-runtime-hook prestart`` (found on
dockerd's PATH); NVIDIA's runtime adds ``-config FILE``. Their flags are Go
``flag`` style: one or two dashes, ``-name value`` or ``-name=value``. This
front-end only translates argv and calls the same ``main``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from gpuhook import __version__
from gpuhook.cli import HOOK_STAGES, NOOP_STAGES
from gpuhook.cli import main as gpuhook_main

USAGE = ("usage: nvidia-container-runtime-hook [-config FILE] [-debug] [-daemon-socket PATH|none] [-version] "
         "prestart|poststart|poststop")
#: the names this front-end is installed under
HOOK_NAMES = ("nvidia-container-runtime-hook", "nvidia-container-toolkit")


def translate(argv: Sequence[str]) -> list[str] | str:
    """gpuhook argv for NVIDIA's *argv*, or the text to print (version/usage)."""
    out: list[str] = []
    args = list(argv)
    while args:
        arg = args.pop(0)
        name, eq, value = arg.lstrip("-").partition("=")
        if not arg.startswith("-"):
            if arg not in HOOK_STAGES + NOOP_STAGES:
                return f"unknown command {arg!r}\n{USAGE}"
            return [*out, arg]
        if name == "version":
            return f"gpuhook {__version__} (nvidia-container-runtime-hook compatible)"
        if name == "debug":
            out.append("--debug")
        elif name in ("config", "daemon-socket"):  # the latter is gpuhook's own (gpuhookd's socket)
            if not eq:
                if not args:
                    return f"flag needs an argument: -{name}\n{USAGE}"
                value = args.pop(0)
            out += [f"--{name}", value]
        else:
            return f"flag provided but not defined: {arg}\n{USAGE}"
    return f"missing command\n{USAGE}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the NVIDIA-named scripts."""
    translated = translate(sys.argv[1:] if argv is None else argv)
    if isinstance(translated, str):
        is_version = translated.startswith("gpuhook ")
        print(translated, file=sys.stdout if is_version else sys.stderr)
        return 0 if is_version else 2
    return gpuhook_main(translated)

"""gpuhook-relay laid out as the packages install it, for tests and the benchmark.

``install_relay(bin_dir, python)`` builds relay/gpuhook-relay.c with relay/build.sh and installs
it as ``bin/gpuhook-relay``, ``libexec/nvidia-container-runtime-hook`` and
``libexec/nvidia-container-cli`` (ctr run --gpus), with the launchers they run when gpuhookd
does not serve a call (``#!python -I``, no runpy, like the package's),
and relay/gpuhook-runtime.c as ``libexec/gpuhook-runtime``, the runc wrapper's front-end, with
the Python wrapper it runs for a GPU container's create, ``bin/gpuhook-runtime``.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Final

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "relay" / "build.sh"


class RelayBuildError(RuntimeError):
    """relay/build.sh failed."""


#: The Python commands a relay can stand for: (its file, relative to the prefix; the launcher's entry point).
COMMANDS = {"gpuhook": ("bin/gpuhook-relay", "gpuhook"),
            "nvidia-container-runtime-hook": ("libexec/nvidia-container-runtime-hook", "nvidia_hook"),
            "nvidia-container-cli": ("libexec/nvidia-container-cli", "nvidia_cli")}
#: The runc wrapper's front-end (the packages' /usr/bin/gpuhook-runtime and nvidia-container-runtime).
RUNTIME: Final = "libexec/gpuhook-runtime"


def launcher_text(python: Path | str, entry: str = "gpuhook") -> str:
    """A launcher for *python* (as the package's /usr/lib/gpuhook/bin/gpuhook) of ``gpuhook.cli.entry:ENTRY``."""
    return f"#!{python} -I\nfrom gpuhook.cli.entry import {entry}\n\n{entry}()\n"


def install_relay(bin_dir: Path, python: Path | str) -> Path:
    """Lay out the relays as the package does, for *python*; the path of bin/gpuhook-relay.

    ``bin/gpuhook-relay``, ``libexec/nvidia-container-runtime-hook`` and ``libexec/nvidia-container-cli``
    (the same program: its file name says which command it stands for), and the launchers they fall
    back to, ``bin/gpuhook``, ``bin/nvidia-container-runtime-hook`` and ``bin/nvidia-container-cli``;
    ``libexec/gpuhook-runtime`` and the Python wrapper it runs, ``bin/gpuhook-runtime``.
    """
    prefix = bin_dir.parent
    relay = bin_dir / "gpuhook-relay"
    bin_dir.mkdir(parents=True, exist_ok=True)
    _build(relay, "gpuhook-relay")
    (prefix / RUNTIME).parent.mkdir(parents=True, exist_ok=True)
    _build(prefix / RUNTIME, "gpuhook-runtime")
    for program, _ in COMMANDS.values():
        if prefix / program != relay:
            (prefix / program).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(relay, prefix / program)
    launchers = {name: entry for name, (_, entry) in COMMANDS.items()} | {"gpuhook-runtime": "runtime"}
    for name, entry in launchers.items():
        launcher = bin_dir / name
        launcher.write_text(launcher_text(python, entry))
        launcher.chmod(0o755)
    return relay


def _build(out: Path, program: str) -> None:
    built = subprocess.run([str(BUILD), str(out), program], capture_output=True, text=True, check=False)
    if built.returncode != 0:
        raise RelayBuildError(f"{BUILD} {out} {program} failed ({built.returncode}):\n{built.stdout}{built.stderr}")


def runtime_for(relay: Path) -> Path:
    """The runc wrapper's front-end in the layout of *relay* (``bin/gpuhook-relay``) made by install_relay."""
    return relay.parents[1] / RUNTIME


def relay_for(relay: Path, command: str) -> Path:
    """The relay standing for *command* in the layout of *relay* (``bin/gpuhook-relay``) made by install_relay."""
    return relay.parents[1] / COMMANDS[command][0]

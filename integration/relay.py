"""gpuhook-relay laid out as the packages install it, for tests and the benchmark.

``install_relay(bin_dir, python)`` builds relay/gpuhook-relay.c with relay/build.sh and installs
it as ``bin/gpuhook-relay`` and ``libexec/nvidia-container-runtime-hook``, with the launchers
they run when gpuhookd does not serve a call (``#!python -I``, no runpy, like the package's).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "relay" / "build.sh"


class RelayBuildError(RuntimeError):
    """relay/build.sh failed."""


#: The Python commands a relay can stand for: (its file, relative to the prefix; the launcher's entry point).
COMMANDS = {"gpuhook": ("bin/gpuhook-relay", "gpuhook"),
            "nvidia-container-runtime-hook": ("libexec/nvidia-container-runtime-hook", "nvidia_hook")}


def launcher_text(python: Path | str, entry: str = "gpuhook") -> str:
    """A launcher for *python* (as the package's /usr/lib/gpuhook/bin/gpuhook) of ``gpuhook.cli.entry:ENTRY``."""
    return f"#!{python} -I\nfrom gpuhook.cli.entry import {entry}\n\n{entry}()\n"


def install_relay(bin_dir: Path, python: Path | str) -> Path:
    """Lay out the relays as the package does, for *python*; the path of bin/gpuhook-relay.

    ``bin/gpuhook-relay`` and ``libexec/nvidia-container-runtime-hook`` (the same program: its file
    name says which command it stands for), and the launchers they fall back to,
    ``bin/gpuhook`` and ``bin/nvidia-container-runtime-hook``.
    """
    prefix = bin_dir.parent
    relay = bin_dir / "gpuhook-relay"
    bin_dir.mkdir(parents=True, exist_ok=True)
    built = subprocess.run([str(BUILD), str(relay)], capture_output=True, text=True, check=False)
    if built.returncode != 0:
        raise RelayBuildError(f"{BUILD} {relay} failed ({built.returncode}):\n{built.stdout}{built.stderr}")
    for name, (program, entry) in COMMANDS.items():
        if prefix / program != relay:
            (prefix / program).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(relay, prefix / program)
        launcher = bin_dir / name
        launcher.write_text(launcher_text(python, entry))
        launcher.chmod(0o755)
    return relay


def relay_for(relay: Path, command: str) -> Path:
    """The relay standing for *command* in the layout of *relay* (``bin/gpuhook-relay``) made by install_relay."""
    return relay.parents[1] / COMMANDS[command][0]

"""gpuhook-relay laid out as the packages install it, for tests, the benchmark and the demo.

``install_relay(bin_dir, python)`` builds relay/gpuhook-relay.c with relay/build.sh into
``bin_dir/gpuhook-relay`` and writes its fallback beside it: ``bin_dir/gpuhook``, a launcher
like the package's (``#!python -I``, no runpy), which the relay execs when gpuhookd does not
serve a call.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "relay" / "build.sh"


class RelayBuildError(RuntimeError):
    """relay/build.sh failed."""


def launcher_text(python: Path | str) -> str:
    """The ``gpuhook`` launcher for *python* (as the package's /usr/lib/gpuhook/bin/gpuhook)."""
    return f"#!{python} -I\nfrom gpuhook.cli.entry import gpuhook\n\ngpuhook()\n"


def install_relay(bin_dir: Path, python: Path | str) -> Path:
    """Build gpuhook-relay into *bin_dir* beside a ``gpuhook`` launcher for *python*; the relay's path."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    relay = bin_dir / "gpuhook-relay"
    built = subprocess.run([str(BUILD), str(relay)], capture_output=True, text=True, check=False)
    if built.returncode != 0:
        raise RelayBuildError(f"{BUILD} {relay} failed ({built.returncode}):\n{built.stdout}{built.stderr}")
    launcher = bin_dir / "gpuhook"
    launcher.write_text(launcher_text(python))
    launcher.chmod(0o755)
    return relay

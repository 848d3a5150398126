"""``nvidia-container-runtime-hook`` / ``nvidia-container-toolkit``: NVIDIA's hook argv.

docker's ``--gpus`` runs ``nvidia-container-runtime-hook prestart`` (found on dockerd's PATH);
NVIDIA's runtime adds ``-config FILE``. This front-end only translates argv
(``hookcall.translate_nvidia_argv``, which gpuhookd uses too) and calls the same ``main``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from gpuhook.cli import main as gpuhook_main
from gpuhook.hookcall import translate_nvidia_argv


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the NVIDIA-named scripts."""
    translated = translate_nvidia_argv(sys.argv[1:] if argv is None else argv)
    if isinstance(translated, str):
        is_version = translated.startswith("gpuhook ")
        print(translated, file=sys.stdout if is_version else sys.stderr)
        return 0 if is_version else 2
    return gpuhook_main(translated)

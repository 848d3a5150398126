"""Console-script entry points (pyproject.toml): each command's ``main``, then ``exit_now``."""

from __future__ import annotations

from gpuhook.cli import exit_now, main

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NoReturn


def gpuhook() -> NoReturn:
    """``gpuhook``."""
    exit_now(main())


def nvidia_hook() -> NoReturn:
    """``nvidia-container-runtime-hook`` and ``nvidia-container-toolkit``."""
    from gpuhook.cli import nvidia

    exit_now(nvidia.main())


def runtime() -> NoReturn:
    """``gpuhook-runtime``."""
    from gpuhook.cli import runtime as wrapper

    exit_now(wrapper.main())


def nvidia_cli() -> NoReturn:
    """``nvidia-container-cli``."""
    from gpuhook.cli import nvcli

    exit_now(nvcli.main())


def nvidia_ctk() -> NoReturn:
    """``nvidia-ctk``."""
    from gpuhook.cli import nvctk

    exit_now(nvctk.main())

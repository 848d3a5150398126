"""``nvidia-container-cli``: libnvidia-container's argv, for containerd's ``ctr run --gpus N``.

ctr 1.6 looks ``nvidia-container-cli`` up on *its own* (the client's) PATH and adds the prestart
hook ``containerd oci-hook -- <cli> --load-kmods configure ... --pid={{pid}} {{rootfs}}``
(argv read by ``gpuhook.request.nvcli``). So:

* the request comes from argv, never from the container's environment (ctr sets no NVIDIA_*);
* stdin is empty (``containerd oci-hook`` consumed the OCI state);
* the environment is the ctr client's whole environment, i.e. the user's shell. The LD_*/PYTHON*
  tripwire still applies: such a variable has already acted on this interpreter before its first
  line, so the CLI refuses rather than carry on. Only root can talk to containerd, so this is not
  a privilege boundary crossed (the image cannot set it), but a shell with ``PYTHONPATH`` or
  ``LD_LIBRARY_PATH`` gets refused containers; the fix is a wrapper on ctr's PATH that runs this
  script under ``env -i PATH=...`` (what tests/engines/test_containerd.py installs).

``configure`` builds the same ``GpuRequest`` the hook builds from NVIDIA_* variables and runs the
hook's path after its request step (inventory through the cache, plan, apply), in this process or,
when gpuhook-relay is installed under this name, in gpuhookd's worker. NVIDIA's options that concern
how libnvidia-container itself works are accepted and ignored (each says why in request.nvcli).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpuhook import __version__
from gpuhook.errors import GpuHookError, UsageError, report_failure
from gpuhook.request.nvcli import (
    PROG,
    USAGE,
    Configure,
    GlobalOptions,
    check_ctr_environment,
    command_parser,
    parse_globals,
    translate_configure,
)

__all__ = ["PROG", "Configure", "main", "parse_globals", "translate_configure"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse

    from gpuhook.inventory import Inventory


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``nvidia-container-cli`` script."""
    try:
        options, rest = parse_globals(sys.argv[1:] if argv is None else argv)
        return _dispatch(options, rest[0], rest[1:])
    except UsageError as err:
        print(f"{PROG}: {err}\n{USAGE}", file=sys.stderr)
        return 2
    except GpuHookError as err:
        print(report_failure(err), file=sys.stderr)
        return 1
    except SystemExit as done:  # argparse's own `COMMAND --help` (its errors are UsageError)
        return done.code if isinstance(done.code, int) else 0


def _dispatch(options: GlobalOptions, command: str, args: Sequence[str]) -> int:
    """Run one command; argv errors raise UsageError before anything is read or changed."""
    if command in ("--version", "--help"):
        print(f"cli-version: gpuhook {__version__} (nvidia-container-cli compatible)" if command == "--version"
              else USAGE)
        return 0
    if command == "configure":
        call = translate_configure(args)
        check_ctr_environment(os.environ)  # it acts as root for the container
        return run_configure(call, options.debug, os.environ)
    ns = command_parser(command).parse_args(list(args))
    if command == "info":
        return run_info(options.debug, os.environ, csv=ns.csv)
    return run_list(options.debug, os.environ, ns)


def run_configure(call: Configure, debug: bool, env: Mapping[str, str]) -> int:
    """Give the container at *call.rootfs* (init *call.pid*) the requested GPUs; raises GpuHookError."""
    from gpuhook import service
    from gpuhook.cli.hygiene import settle_process

    settle_process()
    # --root is ignored: the driver root is gpuhook's config
    service.start_configure(service.load_settings(None, debug, env), call, served_by="hook")
    return 0


def _inventory(debug: bool, env: Mapping[str, str]) -> Inventory:
    """The host's inventory, through the cache."""
    from gpuhook import service

    return service.host_inventory(service.load_settings(None, debug, env)).inventory


def run_info(debug: bool, env: Mapping[str, str], *, csv: bool) -> int:
    """Print the driver and its GPUs in ``nvidia-container-cli info`` (or ``--csv``) form."""
    found = _inventory(debug, env)
    sys.stdout.write(format_info(found, csv=csv))
    return 0


def format_info(inv: Inventory, *, csv: bool) -> str:
    """The text of ``info``: driver lines, then one block (or CSV row) per GPU and MIG device."""
    if csv:
        lines = ["NVRM version,CUDA version", f"{inv.driver_version},{inv.cuda_version}", "",
                 "Device Index,Device Minor,Model,Brand,GPU UUID,Bus Location,Architecture"]
        lines += [f"{g.index},{g.minor},{g.model},{g.brand},{g.uuid},{g.pci_bus_id},{g.arch}" for g in inv.gpus]
        if inv.mig_devices:
            lines += ["", "Device Index,GPU Instance ID,Compute Instance ID,Device UUID"]
            lines += [f"{m.parent_index}:{m.index},{m.gi},{m.ci},{m.uuid}" for m in inv.mig_devices]
        return "\n".join(lines) + "\n"
    lines = [f"NVRM version:   {inv.driver_version}", f"CUDA version:   {inv.cuda_version}", ""]
    for gpu in inv.gpus:
        lines += [f"Device Index:   {gpu.index}", f"Device Minor:   {gpu.minor}", f"Model:          {gpu.model}",
                  f"Brand:          {gpu.brand}", f"GPU UUID:       {gpu.uuid}",
                  f"Bus Location:   {gpu.pci_bus_id}", f"Architecture:   {gpu.arch}"]
        for mig in (m for m in inv.mig_devices if m.parent_index == gpu.index):
            lines += [f"  Device Index:        {gpu.index}:{mig.index}", f"  GPU Instance ID:     {mig.gi}",
                      f"  Compute Instance ID: {mig.ci}", f"  Device UUID:         {mig.uuid}"]
        lines.append("")
    return "\n".join(lines)


def run_list(debug: bool, env: Mapping[str, str], ns: argparse.Namespace) -> int:
    """Print host paths one a line, like ``nvidia-container-cli list``: nodes, binaries, libraries, IPC, firmware."""
    found = _inventory(debug, env)
    sys.stdout.write(format_list(found, libraries=ns.libraries, binaries=ns.binaries, ipcs=ns.ipcs,
                                 firmwares=ns.firmwares, compat32=ns.compat32))
    return 0


def format_list(inv: Inventory, *, libraries: bool = False, binaries: bool = False, ipcs: bool = False,
                firmwares: bool = False, compat32: bool = False) -> str:
    """The text of ``list``: with no category flag, everything (NVIDIA's default)."""
    everything = not (libraries or binaries or ipcs or firmwares)
    paths: list[Path] = []
    if everything:
        paths += [n.host_path for n in (*inv.control_nodes, *inv.gpu_nodes)]
    if everything or binaries:
        paths += [f.host_path for f in inv.binaries]
    if everything or libraries:
        paths += [f.host_path for f in inv.libraries]
        if compat32:
            paths += [f.host_path for f in inv.libraries32]
    if everything or firmwares:
        paths += [f.host_path for f in inv.firmware]
    if everything or ipcs:
        paths += [f.host_path for f in inv.ipc]
    return "".join(f"{p}\n" for p in paths)

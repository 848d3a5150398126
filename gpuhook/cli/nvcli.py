"""``nvidia-container-cli``: libnvidia-container's argv, for containerd's ``ctr run --gpus N``.

ctr 1.6 looks ``nvidia-container-cli`` up on *its own* (the client's) PATH and adds the prestart
hook ``containerd oci-hook -- <cli> --load-kmods configure --device=0,1 --compute --compat32
--graphics --utility --video --display --pid={{pid}} {{rootfs}}`` (runtime-lab.md §5). So:

* the request comes from argv, never from the container's environment (ctr sets no NVIDIA_*);
* stdin is empty (``containerd oci-hook`` consumed the OCI state);
* the environment is the ctr client's whole environment, i.e. the user's shell. The LD_*/PYTHON*
  tripwire still applies: such a variable has already acted on this interpreter before its first
  line, so the CLI refuses rather than carry on. Only root can talk to containerd, so this is not
  a privilege boundary crossed (the image cannot set it), but a shell with ``PYTHONPATH`` or
  ``LD_LIBRARY_PATH`` gets refused containers; the fix is a wrapper on ctr's PATH that runs this
  script under ``env -i PATH=...`` (what tests/engines/test_containerd.py installs).

``configure`` builds the same ``GpuRequest`` the hook builds from NVIDIA_* variables and runs the
hook's path after its request step (inventory through the cache, plan, apply). NVIDIA's options
that concern how libnvidia-container itself works are accepted and ignored (each says why below).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, NoReturn

from gpuhook import __version__
from gpuhook.errors import GpuHookError, RequestError, UnsafeEnvironmentError, UsageError, report_failure

TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse

    from gpuhook.inventory import Inventory
    from gpuhook.request.model import GpuRequest

PROG: Final = "nvidia-container-cli"
USAGE: Final = (
    f"usage: {PROG} [--load-kmods] [--root=PATH] [--ldcache=FILE] [--user[=UID[:GID]]] [--debug=FILE] "
    "[--no-pivot] [--no-create-imex-channels] configure|info|list ..."
)
#: The capability flags of ``configure`` and the NVIDIA_DRIVER_CAPABILITIES names they stand for.
CAPABILITY_FLAGS: Final = ("compute", "compat32", "graphics", "utility", "video", "display", "ngx")
_PID_RE: Final = re.compile(r"[0-9]{1,10}")  # ASCII digits only: int() also takes "٣" and "1_0"


@dataclass(frozen=True, slots=True, kw_only=True)
class GlobalOptions:
    """The options before the command; only ``--debug`` changes what gpuhook does."""

    debug: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Configure:
    """A translated ``configure`` call: the request and where to apply it."""

    request: GpuRequest
    pid: int
    rootfs: Path
    no_cgroups: bool = False
    cuda_compat: bool = True


def parse_globals(argv: Sequence[str]) -> tuple[GlobalOptions, list[str]]:
    """Split NVIDIA's global options from the command and its arguments."""
    debug = False
    args = list(argv)
    while args and args[0].startswith("-"):
        arg = args.pop(0)
        name, eq, _value = arg.partition("=")
        if name in ("--load-kmods", "-k", "--no-pivot", "--no-create-imex-channels") and not eq:
            # --load-kmods: gpuhook never loads modules or mknods host nodes; it injects what the driver made.
            # --no-pivot: NVIDIA's pivot_root/chroot choice; gpuhook runs ldconfig in its own sandbox.
            # --no-create-imex-channels: gpuhook never creates host nodes, so there is nothing to skip.
            continue
        if name == "--user" or (name == "-u" and not eq):
            # NVIDIA drops to this uid for its unprivileged steps; gpuhook reads the driver files as root.
            continue
        if name in ("--root", "-r", "--ldcache", "-l", "--debug", "-d"):
            if not eq:
                if not args:
                    raise UsageError(f"option '{name}' requires an argument")
                args.pop(0)
            # --root/--ldcache: the driver root and its ld.so.cache come from gpuhook's config (driver_root),
            # which root owns, not from argv that ctr builds from the user's PATH lookup.
            # --debug=FILE: gpuhook logs to its configured log_file; the option raises the level to debug.
            debug = debug or name in ("--debug", "-d")
            continue
        if name in ("--version", "-V"):
            return GlobalOptions(debug=debug), ["--version"]
        if name in ("--help", "-?", "-h"):
            return GlobalOptions(debug=debug), ["--help"]
        raise UsageError(f"unrecognized option '{arg}'")
    if not args:
        raise UsageError("missing command")
    return GlobalOptions(debug=debug), args


def _parser(command: str) -> argparse.ArgumentParser:
    """The parser of one command; argparse's errors become UsageError."""
    import argparse

    class Parser(argparse.ArgumentParser):
        """Raises instead of exiting, so main owns the exit status."""

        def error(self, message: str) -> NoReturn:
            """Raise UsageError with argparse's message."""
            raise UsageError(message)

    parser = Parser(prog=f"{PROG} {command}", allow_abbrev=False)
    if command == "configure":
        parser.add_argument("--device", "-d", default=None)
        for cap in CAPABILITY_FLAGS:
            parser.add_argument(f"--{cap}", action="store_true")
        parser.add_argument("--require", "-r", action="append", default=[])
        # The ldconfig to run comes from gpuhook's config (it must be a static host binary, checked there).
        parser.add_argument("--ldconfig", "-l", default=None)
        parser.add_argument("--no-cgroups", action="store_true")
        parser.add_argument("--mig-config", default=None)
        parser.add_argument("--mig-monitor", default=None)
        parser.add_argument("--imex-channel", action="append", default=[])
        parser.add_argument("--cuda-compat-mode", choices=("ldconfig", "mount", "disabled"), default=None)
        parser.add_argument("--pid", "-p", default=None)
        parser.add_argument("rootfs")
    elif command == "info":
        parser.add_argument("--csv", action="store_true")
    elif command == "list":
        for name in ("libraries", "binaries", "ipcs", "firmwares", "compat32"):
            parser.add_argument(f"--{name}", f"-{name[0]}", action="store_true")
        # Accepted for NVIDIA's argv; gpuhook lists the GPU and control nodes regardless.
        for name in ("no-persistenced", "no-fabricmanager"):
            parser.add_argument(f"--{name}", action="store_true")
    else:
        raise UsageError(f"unknown command '{command}'")
    return parser



def translate_configure(args: Sequence[str]) -> Configure:
    """The request and container of a ``configure`` argv (after the command word)."""
    from gpuhook.request.grammar import decode_devices
    from gpuhook.request.model import Capability, GpuRequest, RequestSource
    from gpuhook.request.requirements import parse_requirement

    ns = _parser("configure").parse_args(list(args))
    if ns.pid is None:
        # NVIDIA's standalone mode (pid = getppid(), /proc under the rootfs) has no OCI runtime behind it
        # to name the container's init; gpuhook enters the container through that pid, so it must be given.
        raise UsageError("--pid=PID is required (the container's init as the host sees it)")
    if not _PID_RE.fullmatch(ns.pid) or int(ns.pid) <= 1:
        raise UsageError(f"--pid={ns.pid!r}: expected the decimal host pid of the container's init (> 1)")
    rootfs = str(ns.rootfs)
    # Every spelling of "/" ("//.", "/x/..") is refused here; a symlink to it is refused by rootfs_identity.
    normalized = "/" + os.path.normpath(rootfs).lstrip("/")
    if not rootfs.startswith("/") or normalized == "/":
        raise UsageError(f"ROOTFS {rootfs!r}: expected the absolute path of the container's rootfs, not /")
    try:
        raw = ns.device or ""
        devices = decode_devices(raw, source=RequestSource.DEVICE_OPTION)
        requirements = tuple(parse_requirement("--require", expr) for expr in ns.require)
    except RequestError as err:
        raise UsageError(str(err)) from err
    # No --device (or void): NVIDIA selects no GPU but still injects the driver, which is "none" here.
    request = GpuRequest(
        all_devices=devices is not None and devices.all_devices,
        devices=devices.devices if devices is not None else (),
        count=devices.count if devices is not None else None,
        mig_asks=devices.mig_asks if devices is not None else (),
        capabilities=frozenset(Capability(cap) for cap in CAPABILITY_FLAGS if getattr(ns, cap)),
        requirements=requirements,
        imex_channels=_imex_channels(ns.imex_channel),
        mig_config=_mig_all("--mig-config", ns.mig_config),
        mig_monitor=_mig_all("--mig-monitor", ns.mig_monitor),
        source=RequestSource.DEVICE_OPTION,
        raw=raw,
    )
    return Configure(request=request, pid=int(ns.pid), rootfs=Path(normalized),
                     no_cgroups=ns.no_cgroups, cuda_compat=ns.cuda_compat_mode != "disabled")


def _mig_all(option: str, value: str | None) -> bool:
    """--mig-config / --mig-monitor: NVIDIA_MIG_*_DEVICES's grammar, 'all' (NVIDIA's hook passes it, privileged)."""
    from gpuhook.request.grammar import decode_mig_control

    if value is None:
        return False
    try:
        return decode_mig_control(value, source=option)
    except RequestError as err:
        raise UsageError(str(err)) from err


def _imex_channels(values: Sequence[str]) -> tuple[int, ...]:
    """--imex-channel, repeated or comma-separated: NVIDIA_IMEX_CHANNELS's grammar, without 'all'."""
    from gpuhook.request.grammar import MAX_IMEX_CHANNEL, decode_channels

    option = "--imex-channel"
    channels: list[int] = []
    for value in values:
        try:
            decoded = decode_channels(value, source=option)
        except RequestError as err:
            raise UsageError(str(err)) from err
        if decoded.all_channels:
            # The hook ignores NVIDIA_IMEX_CHANNELS=all; a command line that says it must have meant ids.
            raise UsageError(f"{option}={value!r}: 'all' is not a channel id; name the channels (ids below "
                             f"{MAX_IMEX_CHANNEL}), e.g. {option}=0,1")
        channels += decoded.channels
    return tuple(dict.fromkeys(channels))


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
    ns = _parser(command).parse_args(list(args))
    if command == "info":
        return run_info(options.debug, os.environ, csv=ns.csv)
    return run_list(options.debug, os.environ, ns)


def check_ctr_environment(env: Mapping[str, str]) -> None:
    """The hook's LD_*/PYTHON* tripwire, with the fix that applies to ctr (its env is the user's shell)."""
    from gpuhook.hookcall import check_environment

    try:
        check_environment(env)
    except UnsafeEnvironmentError as err:
        raise UnsafeEnvironmentError(
            f"{err}. Under ctr the hook gets ctr's own environment: run ctr without them, or put on ctr's PATH "
            f"a {PROG} wrapper that execs this one under `env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin`"
        ) from None


def run_configure(call: Configure, debug: bool, env: Mapping[str, str]) -> int:
    """Give the container at *call.rootfs* (init *call.pid*) the requested GPUs; raises GpuHookError."""
    from gpuhook import service
    from gpuhook.cli.hygiene import settle_process

    settle_process()
    config = service.load_settings(None, debug, env)  # --root is ignored: the driver root is gpuhook's config
    # containerd puts the rootfs at <state>/<namespace>/<id>/rootfs, so its parent names the container.
    container = service.Container(id=call.rootfs.parent.name, pid=call.pid, rootfs=call.rootfs)
    service.start_configure(config, call.request, container,
                            placement=service.Placement(manage_cgroups=not call.no_cgroups,
                                                        cuda_compat=call.cuda_compat),
                            front_end=PROG)
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

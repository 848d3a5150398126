"""NVIDIA's ``nvidia-container-cli`` argv → a GpuRequest and the container it is for (pure).

ctr 1.6 looks ``nvidia-container-cli`` up on *its own* (the client's) PATH and adds the prestart
hook ``containerd oci-hook -- <cli> --load-kmods configure --device=0,1 --compute --compat32
--graphics --utility --video --display --pid={{pid}} {{rootfs}}`` (runtime-lab.md §5). The request
comes from argv, never from the container's environment (ctr sets no NVIDIA_*). The CLI front-end
(gpuhook.cli.nvcli) and gpuhookd (gpuhook-relay installed under this name) both read it here.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, NoReturn

from gpuhook.errors import RequestError, UnsafeEnvironmentError, UsageError

TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse

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
            # --load-kmods: gpuhook's load_kmods setting decides (on by default, as ctr always passes the flag):
            # a node the start needs and finds missing is made by the driver root's nvidia-modprobe.
            # --no-pivot: NVIDIA's pivot_root/chroot choice; gpuhook runs ldconfig in its own sandbox.
            # --no-create-imex-channels: gpuhook never creates IMEX channel nodes, so there is nothing to skip.
            continue
        if name == "--user" or (name == "-u" and not eq):
            # NVIDIA drops to this uid for its unprivileged steps; gpuhook reads the driver files as root.
            continue
        if name in ("--root", "-r", "--ldcache", "-l", "--debug", "-d", "--daemon-socket"):
            if not eq:
                if not args:
                    raise UsageError(f"option '{name}' requires an argument")
                args.pop(0)
            # --root/--ldcache: the driver root and its ld.so.cache come from gpuhook's config (driver_root),
            # which root owns, not from argv that ctr builds from the user's PATH lookup.
            # --debug=FILE: gpuhook logs to its configured log_file; the option raises the level to debug.
            # --daemon-socket PATH|none: gpuhook's own, read by gpuhook-relay installed under this name.
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


def command_parser(command: str) -> argparse.ArgumentParser:
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

    ns = command_parser("configure").parse_args(list(args))
    if ns.pid is None:
        # NVIDIA's standalone mode (pid = getppid(), /proc under the rootfs) has no OCI runtime behind it
        # to name the container's init; gpuhook enters the container through that pid, so it must be given.
        raise UsageError("--pid=PID is required (the container's init as the host sees it)")
    if not _PID_RE.fullmatch(ns.pid) or int(ns.pid) <= 1:
        raise UsageError(f"--pid={ns.pid!r}: expected the decimal host pid of the container's init (> 1)")
    rootfs = str(ns.rootfs)
    # Every spelling of "/" ("//.", "/x/..") is refused here; a symlink to it is refused by rootfs_identity.
    normalized = "/" + posixpath.normpath(rootfs).lstrip("/")
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

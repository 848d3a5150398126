"""Steps shared by the CLI commands: config, logging, container facts (config.json: ``cli.bundle``)."""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from gpuhook import linux
from gpuhook.config import Config, load_config, resolve_config_path
from gpuhook.errors import SpecError
from gpuhook.oci.spec import BundleSpec
from gpuhook.planning.paths import libs32_dir, libs_dir
from gpuhook.discovery.health import read_xids
from gpuhook.discovery.host import extra_nodes
from gpuhook.inventory import Inventory
from gpuhook.planning.planner import Target
from gpuhook.request.model import GpuRequest
from gpuhook.request.parse import parse_request


def load_settings(config_arg: str | None, debug: bool, env: Mapping[str, str]) -> Config:
    """Load the config and set up logging (debug forces the debug level)."""
    from gpuhook.log import configure_logging

    path, required = resolve_config_path(config_arg, env)
    config = load_config(path, required=required)
    configure_logging(config.log_file, "debug" if debug else config.log_level)
    return config


def rootfs_identity(rootfs: Path) -> tuple[int, int]:
    """(st_dev, st_ino) of the rootfs directory; refuses the host's own root."""
    try:
        st = os.stat(rootfs)
    except OSError as err:
        raise SpecError(f"cannot open the container rootfs {rootfs}: {err.strerror}") from err
    if not stat.S_ISDIR(st.st_mode):
        raise SpecError(f"the container rootfs {rootfs} is not a directory")
    host_root = os.stat("/")
    if (st.st_dev, st.st_ino) == (host_root.st_dev, host_root.st_ino):
        raise SpecError(f"the container rootfs {rootfs} is the host's /; refusing to change the host")
    return st.st_dev, st.st_ino


def is_debian_like(rootfs: Path) -> bool:
    """Whether the rootfs has /etc/debian_version, looked up inside the rootfs."""
    try:
        root = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise SpecError(f"cannot open the container rootfs {rootfs}: {err.strerror}") from err
    try:
        fd = linux.openat2(root, "etc/debian_version", os.O_PATH, linux.RESOLVE_IN_ROOT | linux.RESOLVE_NO_MAGICLINKS)
    except OSError:
        return False
    finally:
        os.close(root)
    os.close(fd)
    return True


def make_target(spec: BundleSpec, config: Config) -> Target:
    """Placement facts for this container."""
    debian_like, machine = is_debian_like(spec.rootfs), os.uname().machine
    return Target(
        libs_dir=libs_dir(debian_like=debian_like, machine=machine),
        libs32_dir=libs32_dir(debian_like=debian_like, machine=machine),
        manage_cgroups=not config.no_cgroups,
        cuda_compat=config.cuda_compat,
        unhealthy_gpus=config.unhealthy_gpus,
        runtime_devices=spec.runtime_devices,
    )


def complete_inventory(inventory: Inventory, request: GpuRequest, config: Config) -> Inventory:
    """Add what is read fresh on every start, never cached: IMEX/gated nodes when asked for, the Xid log."""
    if request.imex_channels or request.gated:
        inventory = dataclasses.replace(inventory, extra_nodes=extra_nodes(config.dev_root))
    if config.unhealthy_gpus != "ignore":
        inventory = dataclasses.replace(inventory, xid_errors=read_xids(config.dev_root))
    return inventory


def request_for(spec: BundleSpec, config: Config) -> GpuRequest | None:
    """The container's request under the configured policy (env, device-plugin mounts, CDI annotations)."""
    return parse_request(
        spec,
        accept_envvar_when_unprivileged=config.accept_envvar_when_unprivileged,
        accept_volume_mounts=config.accept_volume_mounts,
        accept_cdi_annotations=config.accept_cdi_annotations,
    )

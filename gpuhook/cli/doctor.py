"""``gpuhook doctor``: gather the host's facts and print the checks (decisions in ``gpuhook.doctor``)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

from gpuhook import __version__
from gpuhook import service
from gpuhook.config import Config
from gpuhook.daemon import client
from gpuhook.daemon.wire import DEFAULT_SOCKET
from gpuhook.doctor import (
    Check,
    Verdict,
    cdi_checks,
    cgroup_checks,
    cgroup_driver,
    cgroup_mode,
    gpuhookd_check,
    nvidia_config_check,
    persistence_check,
)
from gpuhook.errors import GpuHookError
from gpuhook.sys.mountinfo import MountInfo, read_mountinfo


def _read(path: str) -> str | None:
    """A small host file, or None."""
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return None


def _driver_checks(config: Config) -> tuple[Check, ...]:
    """Can the driver be inventoried through the configured roots, and is persistence mode on?"""
    try:
        inventory = service.discover_uncached(config)
    except GpuHookError as err:
        return (Check(name="driver", verdict=Verdict.FAIL, message=str(err),
                      fix="install or load the NVIDIA driver, or point driver_root/dev_root/proc_root at it"),)
    return (
        Check(name="driver", verdict=Verdict.OK, message=(
            f"NVIDIA {inventory.driver_version} (CUDA {inventory.cuda_version}), {len(inventory.gpus)} GPU(s), "
            f"{len(inventory.libraries)} libraries under {config.driver_root}")),
        persistence_check([g.index for g in inventory.gpus if g.persistence is False]),
    )


def _ldconfig_check(config: Config) -> Check:
    """Is the configured ldconfig a usable static host binary?"""
    try:
        who = service.check_ldconfig(config)
    except GpuHookError as err:
        return Check(name="ldconfig", verdict=Verdict.FAIL, message=str(err),
                     fix="set `ldconfig:` to a static ldconfig")
    return Check(name="ldconfig", verdict=Verdict.OK, message=f"{config.ldconfig} is static; {who}")


def _leases_check(config: Config) -> Check:
    """Does the sharing policy fit this host's GPUs, and can the lease ledger be read and written?"""
    if config.state_dir is None:
        return Check(name="leases", verdict=Verdict.NOTE, message="state_dir is null: no leases are kept")
    try:
        report = service.status(config)  # reclaims the leases of gone holders, as every GPU start does
    except GpuHookError as err:
        return Check(name="leases", verdict=Verdict.FAIL, message=str(err),
                     fix="correct the policy (gpus: / device_policy:) or state_dir as the message says")
    held = {d for lease in report.ledger.leases for d in lease.devices}
    limited = sum(policy.limit is not None for policy in report.policies.values())
    return Check(name="leases", verdict=Verdict.OK, message=(
        f"{len(report.ledger.leases)} lease(s) holding {len(held)} device(s) in {config.state_dir}; "
        f"{limited} of {len(report.policies)} GPU(s) with a sharing limit ({config.gpus.source})"))


def _engines() -> tuple[Check, ...]:
    """Whether each installed engine really sees gpuhook (asked the engine's way: cli/enginecheck.py)."""
    from gpuhook.cli.enginecheck import engine_views
    from gpuhook.doctor import registration_checks

    return registration_checks(engine_views(Path(sys.executable).parent))


CDI_DIRS = (Path("/etc/cdi"), Path("/var/run/cdi"))


def _cdi(config_arg: str | None, config: Config, env: Mapping[str, str]) -> tuple[Check, ...]:
    """Compare every gpuhook-written CDI spec (kind nvidia.com/gpu, gpuhook's hook) with a fresh rendering."""
    import json

    import yaml

    from gpuhook.cli.cdi import hook_argv

    found: dict[str, object] = {}
    for directory in CDI_DIRS:
        for path in sorted(directory.glob("*.y*ml")) + sorted(directory.glob("*.json")):
            try:
                text = path.read_text()
                spec = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
            except (OSError, ValueError, yaml.YAMLError):
                continue
            if isinstance(spec, dict) and spec.get("kind") == "nvidia.com/gpu" and "gpuhook" in text:
                found[str(path)] = spec
    if not found:
        return ()
    try:
        fresh = json.loads(json.dumps(service.render_cdi(config, hook_argv(config_arg, env)).spec))
    except GpuHookError:
        return ()  # the driver check above already says why nothing can be rendered
    return cdi_checks(found, fresh)


def _nvidia_config(config_arg: str | None, env: Mapping[str, str]) -> tuple[Check, ...]:
    """NVIDIA's config.toml, when gpuhook reads it (its unmapped keys) or when it lies unread beside gpuhook's."""
    from gpuhook.config import NVIDIA_PATH, read_config, resolve_config_path

    path, required = resolve_config_path(config_arg, env)
    if path.suffix != ".toml":
        unread = NVIDIA_PATH.exists()
        return (nvidia_config_check(str(NVIDIA_PATH), read=False, warnings=(), notes=0),) if unread else ()
    notices = read_config(path, required=required).notices  # it loaded once already (load_settings)
    return (nvidia_config_check(str(path), read=True, warnings=[n.render() for n in notices if n.lost],
                                notes=sum(not n.lost for n in notices)),)


def daemon_check(socket_path: str) -> Check:
    """Does a gpuhookd of this version answer a ping on *socket_path*?"""
    try:
        served = client.ping(socket_path)
    except client.NotServed as why:
        return gpuhookd_check(socket_path, served=None, version=__version__, why=str(why))
    except GpuHookError as err:  # it took the ping and gave no (whole) answer: a stuck or dying daemon
        return Check(name="gpuhookd", verdict=Verdict.WARN, message=str(err), fix="systemctl restart gpuhookd.service")
    return gpuhookd_check(socket_path, served=served, version=__version__)


def run_doctor(config_arg: str | None, debug: bool, env: Mapping[str, str], *,
               daemon_socket: str = DEFAULT_SOCKET) -> int:
    """Print every check; exit status 1 if any failed."""
    config = service.load_settings(config_arg, debug, env)
    try:
        mounts: tuple[MountInfo, ...] = read_mountinfo()
    except OSError:
        mounts = ()  # unreadable: the checks below then say v1
    mode = cgroup_mode(mounts)
    driver = cgroup_driver(pid1=(_read("/proc/1/comm") or "").strip(), mode=mode,
                           docker_daemon_json=_read("/etc/docker/daemon.json"),
                           containerd_toml=_read("/etc/containerd/config.toml"))
    checks = (*_nvidia_config(config_arg, env), *_driver_checks(config), _ldconfig_check(config), _leases_check(config),
              *cgroup_checks(mode, driver),
              *_engines(),
              *_cdi(config_arg, config, env), daemon_check(daemon_socket))
    sys.stdout.write("".join(check.render() + "\n" for check in checks))
    return 1 if any(check.verdict is Verdict.FAIL for check in checks) else 0

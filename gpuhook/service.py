"""The one sequencer: every front-end's work, in one order, with one place that undoes it.

Front-ends (the OCI hook, gpuhookd, ``nvidia-container-cli configure``, the spec editors, CDI,
``plan``/``info``) only translate their input into a call here and print the outcome; this is
the only module that imports both discovery (read the host) and apply (change a container),
and the only one that orders effects:

* ``start``: request → inventory (cached) + live facts → plan → device access → rootfs changes,
  each effect's undo pushed on one undo stack as soon as the effect exists and unwound, newest
  first, when a later step fails. What a start will take on the host (leases, MIG instances,
  MPS daemons: the next issues) goes on the same stack, recorded before it is used.
* ``stop``: poststop's work (releasing what a start took). Nothing is taken yet, so nothing.
* ``render_*``: the same plan rendered instead of applied (spec edits, CDI, ``plan``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuhook.apply import ChildForkedAhead, ContainerRef, change_rootfs, grant_device_access, opened_container
from gpuhook.config import Config, HealthPolicy, load_config, resolve_config_path
from gpuhook.discovery import Found, inventory_for
from gpuhook.discovery.container import is_debian_like, rootfs_identity
from gpuhook.errors import GpuHookError, SpecError
from gpuhook.inventory import Inventory, LiveNeeds
from gpuhook.log import configure_logging, get_logger
from gpuhook.oci.spec import BundleSpec, spec_from_object
from gpuhook.oci.state import state_from_object
from gpuhook.planning.paths import libs32_dir, libs_dir
from gpuhook.planning.plan import Plan
from gpuhook.planning.planner import Target, live_needs, make_plan, plan_devices
from gpuhook.request.model import GpuRequest
from gpuhook.request.parse import parse_request

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpuhook.apply.ahead import ChildAhead
    from gpuhook.cdi import Rendered

# What only gpuhookd, CDI, spec edits or `doctor` use is imported where it is used: an in-process
# start (the hook where gpuhookd does not serve) imports this module, and every module costs it.


__all__ = [
    "ChildAhead", "ChildForkedAhead", "Container", "Placement", "check_ldconfig", "discover_uncached",
    "enter_hook_view", "fork_apply_ahead",
    "host_inventory", "load_settings", "prepare_daemon", "render_cdi", "render_plan", "render_spec_edit",
    "request_for", "start", "start_configure", "start_hook", "stop", "update_ldcache_in",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Container:
    """The container a start changes: its init's host pid and its rootfs as the hook sees it."""

    pid: int
    rootfs: Path


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """What a front-end may narrow about placement (``nvidia-container-cli --no-cgroups`` and the like)."""

    manage_cgroups: bool = True
    cuda_compat: bool = True


def load_settings(config_arg: str | None, debug: bool, env: Mapping[str, str]) -> Config:
    """Load the config and set up logging (debug forces the debug level): every front-end's first step."""
    path, required = resolve_config_path(config_arg, env)
    config = load_config(path, required=required)
    configure_logging(config.log_file, "debug" if debug else config.log_level.value)
    return config


# --- start and stop ------------------------------------------------------------------------------


def start_hook(config: Config, state_obj: Mapping[str, Any], spec_obj: Mapping[str, Any], *, served_by: str,
               daemon_note: str | None = None, ahead: ChildForkedAhead | None = None) -> None:
    """A hook's start: give the container in the OCI state the GPUs its config.json asks for.

    *served_by* ("hook" or "gpuhookd") goes into every log event; *daemon_note* says why the
    hook did the work itself; *ahead*: gpuhookd's apply child, forked in advance.
    """
    started = time.monotonic()
    state = state_from_object(state_obj)
    spec = spec_from_object(spec_obj, state.bundle)
    log = get_logger()
    log.bind(container_id=state.id, pid=state.pid, served_by=served_by)
    request = request_for(spec, config)
    if request is None:
        log.info("no_gpu_requested", privileged=spec.privileged)
        return
    if state.pid is None or state.pid == 1:
        raise SpecError(
            f"the OCI state's pid is {state.pid}, not a host pid; run gpuhook as a prestart or createRuntime hook"
        )
    _log_request(request, **({"daemon": daemon_note} if daemon_note else {}))
    start(config, request, Container(pid=state.pid, rootfs=spec.rootfs), runtime_devices=spec.runtime_devices,
          started=started, ahead=ahead)


def start(config: Config, request: GpuRequest, container: Container, *, placement: Placement = Placement(),
          runtime_devices: frozenset[tuple[int, int]] = frozenset(), started: float | None = None,
          ahead: ChildForkedAhead | None = None) -> None:
    """Inventory, plan and apply *request* to *container*; raises GpuHookError (and leaves nothing behind)."""
    started = time.monotonic() if started is None else started
    log = get_logger()
    target = _target(container.rootfs, config, placement, runtime_devices)
    step = time.monotonic()
    found = inventory_for(config, live_needs(request, target))
    inventory = found.inventory
    log.info("host_discovered", driver=inventory.driver_version, gpus=len(inventory.gpus),
             cache=found.outcome.value, ms=_ms(step))
    if found.not_stored is not None:
        log.warning("inventory_not_cached", reason=found.not_stored)
    plan = make_plan(request, inventory, found.live, target)
    _log_plan(plan)
    step = time.monotonic()
    ref = ContainerRef(pid=container.pid, rootfs=container.rootfs, rootfs_id=rootfs_identity(container.rootfs))
    with opened_container(ref.pid) as pidfd, contextlib.ExitStack() as undo:
        # The undo stack: each effect's undo is pushed as soon as the effect exists; any failure
        # later unwinds them all, newest first (the rootfs child undoes its own changes itself).
        if (ungrant := grant_device_access(plan, ref.pid)) is not None:
            undo.callback(ungrant)
        report = change_rootfs(plan, pidfd, ref, ldconfig=config.ldconfig, timeout=config.timeout_seconds,
                               ahead=ahead)
        undo.pop_all()  # the start holds: keep every effect
    for what in report.skipped:
        log.warning("apply_skipped", what=what)
    # Peak memory of this process (the hook, or gpuhookd's worker); the apply child is not counted.
    log.info("applied", ms=_ms(step), total_ms=_ms(started),
             peak_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1))


def start_configure(config: Config, request: GpuRequest, container: Container, *, placement: Placement,
                    container_id: str, front_end: str) -> None:
    """``nvidia-container-cli configure``: a request from argv, for a container named only by pid and rootfs."""
    started = time.monotonic()
    get_logger().bind(container_id=container_id, pid=container.pid, front_end=front_end)
    _log_request(request)
    start(config, request, container, placement=placement, started=started)


def stop(config: Config | None, state_obj: Mapping[str, Any]) -> None:
    """poststop: release what the container's start took. A start takes nothing on the host yet."""
    del config, state_obj


def update_ldcache_in(config: Config, rootfs: Path, dirs: Sequence[str]) -> None:
    """The CDI spec's createContainer hook: the host's sandboxed ldconfig over *dirs* in *rootfs*.

    runc runs createContainer hooks in the container's mount namespace after its mounts and
    before pivot_root, so *rootfs* already shows the CDI mounts: no namespace to enter.
    """
    from gpuhook.apply.ldconfig import update_ldcache

    rootfs_identity(rootfs)  # refuses the host's own /
    update_ldcache(config.ldconfig, rootfs, dirs, timeout=config.timeout_seconds)


# --- gpuhookd's preparations ------------------------------------------------------------------------


def prepare_daemon(env: Mapping[str, str]) -> str:
    """Work the default configuration's requests can share (the sealed copy of its ldconfig); '' or why not."""
    from gpuhook.apply.ldconfig import seal_ahead

    try:
        path, required = resolve_config_path(None, env)
        seal_ahead(load_config(path, required=required).ldconfig)
    except GpuHookError as err:
        return f"ldconfig not prepared ({err}); each request copies it"
    return ""


def fork_apply_ahead(*, priority: int, close: Sequence[int] = ()) -> ChildAhead:
    """An apply child forked before its request arrives (an idle gpuhookd worker's)."""
    from gpuhook.apply import fork_apply_child

    return fork_apply_child(priority=priority, close=close)


def enter_hook_view(fds: Sequence[int]) -> str:
    """Take the hook's view (its mount and cgroup namespaces and root, as fds); '' or why it cannot be."""
    from gpuhook.apply.view import enter_client_view

    return enter_client_view(fds)


# --- rendering: the same plan, not applied ---------------------------------------------------------


def render_plan(config: Config, spec: BundleSpec) -> tuple[GpuRequest, Plan] | None:
    """What a start would do to the container *spec* describes (``gpuhook plan``); None: no GPU asked."""
    request = request_for(spec, config)
    if request is None:
        return None
    target = _target(spec.rootfs, config, Placement(), spec.runtime_devices)
    found = inventory_for(config, live_needs(request, target))
    return request, make_plan(request, found.inventory, found.live, target)


def render_spec_edit(config: Config, raw: Mapping[str, Any], spec: BundleSpec) -> Mapping[str, Any]:
    """*raw* with the requested GPUs' devices and rules added (the same object when no GPU is asked for)."""
    from gpuhook.planning.specedit import add_devices

    request = request_for(spec, config)
    if request is None:
        return raw
    found = inventory_for(config, live_needs(request))
    return add_devices(raw, plan_devices(request, found.inventory, found.live).devices)


def render_cdi(config: Config, hook_argv: list[str] | None) -> Rendered:
    """The host's GPUs as a CDI spec, with Debian-layout library placement.

    A spec is written before any image is known, so the image's layout cannot be looked at; the
    Debian multiarch dir is on glibc's default search path in Debian/Ubuntu images (NVIDIA's specs
    use the host's own paths, which is the same on a Debian host).
    """
    from gpuhook.cdi import render_spec

    machine = os.uname().machine
    target = Target(libs_dir=libs_dir(debian_like=True, machine=machine),
                    libs32_dir=libs32_dir(debian_like=True, machine=machine),
                    unhealthy_gpus=HealthPolicy.IGNORE)
    found = host_inventory(config)
    return render_spec(found.inventory, found.live, target, hook_argv)


def host_inventory(config: Config, *, refresh: bool = False) -> Found:
    """The host's inventory through the cache, MIG devices as they exist now (``info``, ``nvidia-container-cli
    info|list``, CDI)."""
    return inventory_for(config, LiveNeeds(mig=True), refresh=refresh)


def discover_uncached(config: Config) -> Inventory:
    """The host's inventory straight from NVML, bypassing the cache (``gpuhook doctor``)."""
    return inventory_for(dataclasses.replace(config, cache_dir=None), LiveNeeds()).inventory


def check_ldconfig(path: Path) -> None:
    """Raise ApplyError unless *path* is an ldconfig the sandbox can run (static, host-owned)."""
    from gpuhook.apply.ldconfig import open_ldconfig

    os.close(open_ldconfig(path))


def request_for(spec: BundleSpec, config: Config) -> GpuRequest | None:
    """The container's request under the configured policy (env, device-plugin mounts, CDI annotations)."""
    return parse_request(
        spec,
        accept_envvar_when_unprivileged=config.accept_envvar_when_unprivileged,
        accept_volume_mounts=config.accept_volume_mounts,
        accept_cdi_annotations=config.accept_cdi_annotations,
    )


# --- helpers ---------------------------------------------------------------------------------------


def _target(rootfs: Path, config: Config, placement: Placement,
            runtime_devices: frozenset[tuple[int, int]]) -> Target:
    """Placement facts for this container."""
    debian_like, machine = is_debian_like(rootfs), os.uname().machine
    return Target(
        libs_dir=libs_dir(debian_like=debian_like, machine=machine),
        libs32_dir=libs32_dir(debian_like=debian_like, machine=machine),
        manage_cgroups=placement.manage_cgroups and not config.no_cgroups,
        cuda_compat=placement.cuda_compat and config.cuda_compat,
        unhealthy_gpus=config.unhealthy_gpus,
        runtime_devices=runtime_devices,
    )


def _log_request(request: GpuRequest, **extra: Any) -> None:
    get_logger().info("request_parsed", source=request.source, devices=request.raw,
                      capabilities=sorted(request.capabilities),
                      requirements=[str(r) for r in request.requirements], **extra)


def _log_plan(plan: Plan) -> None:
    log = get_logger()
    log.info("plan_built", gpus=list(plan.gpus), devices=len(plan.devices), mounts=len(plan.mounts),
             cgroup_rules=len(plan.cgroup_rules))
    for skipped in plan.skipped:
        log.debug("skipped", what=skipped.what, reason=skipped.reason)
    for warning in plan.warnings:
        log.warning("plan_warning", message=warning)


def _ms(since: float) -> float:
    """Milliseconds since *since*, rounded for the log."""
    return round((time.monotonic() - since) * 1000, 1)

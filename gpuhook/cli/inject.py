"""The GPU path of the hook: config, request, inventory (cached), plan, and the privileged apply."""

from __future__ import annotations

import resource
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpuhook.apply import ChildForkedAhead, ContainerRef, apply_plan
from gpuhook.cli.common import complete_inventory, load_settings, make_target, request_for, rootfs_identity
from gpuhook.cli.hygiene import settle_process
from gpuhook.discovery.cache import CachedDiscoverer
from gpuhook.discovery.host import HostDiscoverer
from gpuhook.config import Config
from gpuhook.errors import SpecError
from gpuhook.log import get_logger
from gpuhook.oci.spec import spec_from_object
from gpuhook.oci.state import state_from_object
from gpuhook.planning.planner import Target, make_plan
from gpuhook.request.model import GpuRequest


def inject(
    config_arg: str | None, debug: bool, env: Mapping[str, str], state_obj: Mapping[str, Any],
    spec_obj: Mapping[str, Any], *, served_by: str, daemon_note: str | None = None,
    ahead: ChildForkedAhead | None = None,
) -> int:
    """Give the container its GPUs; raises GpuHookError to refuse it.

    *served_by* ("hook" or "gpuhookd") goes into every log event; *daemon_note* says why the
    hook did the work itself (logged once); *ahead*: gpuhookd's apply child, forked in advance.
    """
    started = time.monotonic()
    settle_process()
    state = state_from_object(state_obj)
    spec = spec_from_object(spec_obj, state.bundle)
    config = load_settings(config_arg, debug, env)
    log = get_logger()
    log.bind(container_id=state.id, pid=state.pid, served_by=served_by)
    request = request_for(spec, config)
    if request is None:
        log.info("no_gpu_requested", privileged=spec.privileged)
        return 0
    if state.pid is None or state.pid == 1:
        raise SpecError(
            f"the OCI state's pid is {state.pid}, not a host pid; run gpuhook as a prestart or createRuntime hook"
        )
    log.info("request_parsed", source=request.source, devices=request.raw,
             capabilities=sorted(request.capabilities), requirements=[str(r) for r in request.requirements],
             **({"daemon": daemon_note} if daemon_note else {}))
    return inject_request(config, request, make_target(spec, config), state.pid, spec.rootfs, started, ahead=ahead)


def inject_request(
    config: Config, request: GpuRequest, target: Target, pid: int, rootfs: Path, started: float, *,
    ahead: ChildForkedAhead | None = None,
) -> int:
    """Everything after the request, shared by the OCI hook and nvidia-container-cli: inventory (cached),
    plan, apply; raises GpuHookError."""
    log = get_logger()
    step = time.monotonic()
    found = CachedDiscoverer(config=config, inner=HostDiscoverer(config)).lookup()
    inventory = complete_inventory(found.inventory, request, config)
    log.info("host_discovered", driver=inventory.driver_version, gpus=len(inventory.gpus),
             cache=found.outcome.value, ms=_ms(step))
    if found.not_stored is not None:
        log.warning("inventory_not_cached", reason=found.not_stored)
    plan = make_plan(request, inventory, target)
    log.info("plan_built", gpus=list(plan.gpus), devices=len(plan.devices), mounts=len(plan.mounts),
             cgroup_rules=len(plan.cgroup_rules))
    for skipped in plan.skipped:
        log.debug("skipped", what=skipped.what, reason=skipped.reason)
    for warning in plan.warnings:
        log.warning("plan_warning", message=warning)
    step = time.monotonic()
    container = ContainerRef(pid=pid, rootfs=rootfs, rootfs_id=rootfs_identity(rootfs))
    report = apply_plan(plan, container, ldconfig=config.ldconfig, timeout=config.timeout_seconds, ahead=ahead)
    for what in report.skipped:
        log.warning("apply_skipped", what=what)
    # Peak memory of this process (the hook, or gpuhookd's worker); the apply child is not counted.
    log.info("applied", ms=_ms(step), total_ms=_ms(started),
             peak_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1))
    return 0


def _ms(since: float) -> float:
    """Milliseconds since *since*, rounded for the log."""
    return round((time.monotonic() - since) * 1000, 1)



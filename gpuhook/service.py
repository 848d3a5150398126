"""The one sequencer: every front-end's work, in one order, with one place that undoes it.

Front-ends (the OCI hook, gpuhookd, ``nvidia-container-cli configure``, the spec editors, CDI,
``plan``/``info``) only translate their input into a call here and print the outcome; this is
the only module that imports both discovery (read the host) and apply (change a container),
and the only one that orders effects:

* ``start``: request → inventory (cached) + live facts → lease (reclaim, allocate under the
  sharing policy, reserve: one ledger transaction) → plan → device access → rootfs changes →
  activate, each effect's undo pushed on one undo stack as soon as the effect exists and
  unwound, newest first, when a later step fails. The lease is recorded before anything is
  changed in the container, so a crash at any point leaves a record whose holder, once gone,
  is reclaimed.
* ``stop``: poststop's work: the container's lease released (its holder has exited).
* ``status``/``release``/``reclaim_gone``: the ledger for a person (``gpuhook status``,
  ``gpuhook release``) and for gpuhookd's watch on holders.
* ``render_*``: the same plan rendered instead of applied (spec edits, CDI, ``plan``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any, TypeVar

from gpuhook import catalog
from gpuhook.apply import (ChildForkedAhead, ContainerRef, HostLdconfig, grant_device_access, hint_rootfs,
                           opened_container, start_rootfs_changes)
from gpuhook.config import Config, HealthPolicy, load_config, read_config_unchanged, resolve_config_path
from gpuhook.discovery import Found, Outcome, inventory_for
from gpuhook.discovery.container import is_debian_like, rootfs_identity
from gpuhook.errors import DiscoveryError, GpuHookError, MissingNodeError, PolicyError, SpecError, StateError
from gpuhook.inventory import DriverFile, Gpu, Inventory, LiveFacts, LiveNeeds, narrow_to_live
from gpuhook.provision import leases, ledger_store
from gpuhook.log import configure_logging, get_logger
from gpuhook.oci.spec import BundleSpec, spec_from_object
from gpuhook.oci.state import state_from_object
from gpuhook.planning.paths import libs32_dir, libs_dir
from gpuhook.planning.plan import Plan
from gpuhook.planning.planner import Target, live_needs, make_plan, plan_devices
from gpuhook.request.model import GpuRequest, MigUuid
from gpuhook.request.nvcli import PROG, Configure
from gpuhook.request.parse import parse_request
from gpuhook.sharing.allocate import Allocation, allocate
from gpuhook.sharing.ledger import Holder, Lease, Ledger, MigRecord, MpsDaemon
from gpuhook.sharing.mig import mode_may_be_stale
from gpuhook.sharing.policy import GpuPolicy, Sharing, client_limits, shm_size_mib

#: what a plan function returns (_creating_nodes)
P = TypeVar("P")

TYPE_CHECKING = False
if TYPE_CHECKING:
    from datetime import datetime

    from gpuhook.sharing.attribution import UsageView

    from gpuhook.apply.ahead import ChildAhead
    from gpuhook.discovery.health import XidLog
    from gpuhook.cdi import Rendered
    from gpuhook.provision import mps
    from gpuhook.sys.prefault import Learned

# What only gpuhookd, CDI, spec edits or `doctor` use is imported where it is used: an in-process
# start (the hook where gpuhookd does not serve) imports this module, and every module costs it.


__all__ = [
    "ChildAhead", "ChildForkedAhead", "Container", "Placement", "XidLog", "check_ldconfig", "discover_uncached",
    "enter_hook_view", "follow_kernel_log", "fork_apply_ahead", "host_inventory", "load_settings", "prepare_daemon",
    "prepare_worker", "render_cdi", "render_plan", "render_spec_edit", "replace_spec",
    "request_for", "share_library_reads", "start", "start_configure", "start_hook", "stop", "update_ldcache_in",
    "writes_ldcache_itself",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Container:
    """The container a start changes: its id (the OCI state's), its init's host pid, its rootfs as the hook sees it."""

    id: str
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
    loaded = read_config_unchanged(path, required=required)
    config = loaded.config
    configure_logging(config.log_file, "debug" if debug else config.log_level.value)
    for notice in loaded.notices:  # `gpuhook doctor` and `config import` show them; a start only at debug
        get_logger().debug("nvidia_config_key_ignored", file=str(path), key=notice.key, reason=notice.reason)
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
    if daemon_note:  # why the hook did the work itself: on every later event, the summary included
        log.bind(daemon=daemon_note)
    _log_request(request)
    start(config, request, Container(id=state.id, pid=state.pid, rootfs=spec.rootfs),
          runtime_devices=spec.runtime_devices, started=started, ahead=ahead)


def start(config: Config, request: GpuRequest, container: Container, *, placement: Placement = Placement(),
          runtime_devices: frozenset[tuple[int, int]] = frozenset(), started: float | None = None,
          ahead: ChildForkedAhead | None = None) -> None:
    """Inventory, plan and apply *request* to *container*; raises GpuHookError (and leaves nothing behind)."""
    started = time.monotonic() if started is None else started
    log = get_logger()
    target = _target(container.rootfs, config, placement, runtime_devices)
    ref = ContainerRef(pid=container.pid, rootfs=container.rootfs, rootfs_id=rootfs_identity(container.rootfs))
    if ahead is not None:  # its child reads the image's libraries while this process plans
        hint_rootfs(ahead, ref, tuple(d for d in (target.libs_dir, target.libs32_dir) if d), _host_ldconfig(config))
    step = time.monotonic()
    needs = live_needs(request, target)
    found = inventory_for(config, needs, recorded=_recorded(config) if needs.mig else ())
    if request.mig_asks and found.outcome is Outcome.HIT and mode_may_be_stale(request, found.inventory):
        found = inventory_for(config, needs, refresh=True, recorded=_recorded(config))  # MIG mode: NVML's word
    inventory = found.inventory
    log.info("host_discovered", driver=inventory.driver_version, gpus=len(inventory.gpus),
             cache=found.outcome.value, ms=_ms(step))
    if found.not_stored is not None:
        log.warning("inventory_not_cached", reason=found.not_stored)
    with opened_container(ref.pid) as pidfd, contextlib.ExitStack() as undo:
        # The undo stack: each effect's undo is pushed as soon as the effect exists; any failure
        # later unwinds them all, newest first (the rootfs child undoes its own changes itself).
        reserved = _reserve(config, request, found, target, container, pidfd, undo)
        request, holder = reserved.request, reserved.holder
        if reserved.made or live_needs(request, target) != live_needs(reserved.asked, target):
            # instances were made, or the allocation named MIG devices: their nodes and layout are read now
            found = inventory_for(config, live_needs(request, target), recorded=_recorded(config))
        step = time.monotonic()
        plan = _creating_nodes(config, found, lambda: inventory_for(config, live_needs(request, target),
                                                                     recorded=_recorded(config)),
                               lambda f: make_plan(request, f.inventory, _with_mps(f.live, reserved.mps), target))
        profile = {"plan": _ms(step)}
        _log_plan(plan)
        # The apply child starts on the rootfs first: the device cgroup is granted while it works.
        pending = start_rootfs_changes(plan, pidfd, ref, ldconfig=_host_ldconfig(config),
                                       timeout=config.timeout_seconds, ahead=ahead)
        try:
            step = time.monotonic()
            if (ungrant := grant_device_access(plan, ref.pid)) is not None:
                undo.callback(ungrant)
            profile["cgroup"] = _ms(step)
            if holder is not None and config.state_dir is not None:
                # Active once its devices are granted, while the child still works (off the start's path): a
                # start that fails after this drops the lease all the same (the undo above).
                leases.activate(config.state_dir, container.id, holder)
        except BaseException:
            pending.abandon()
            raise
        changes = pending.held()
        try:
            reserved.mps_told()  # told while the plan and the child worked; before the container runs
        except BaseException:
            changes.abandon()
            raise
        changes.commit()
        report = changes.report
        undo.pop_all()  # the start holds: keep every effect
    for what in report.skipped:
        log.warning("apply_skipped", what=what)
    for what in report.notes:
        log.debug("apply_note", what=what)
    # The start's one info line (its steps are logged at debug): what it gave, how long each step took (the
    # profile `make bench` prints), and the peak memory of this process (not counting the apply child).
    log.info("applied", gpus=list(plan.gpus), ms=_ms(step), total_ms=_ms(started),
             steps_ms={**profile, **dict(report.steps_ms)}, apply_page_faults=report.page_faults,
             libraries_read=report.libraries_read, libraries_read_ahead=report.libraries_read_ahead,
             peak_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1))


def start_configure(config: Config, call: Configure, *, served_by: str,
                    ahead: ChildForkedAhead | None = None) -> None:
    """``nvidia-container-cli configure`` (ctr run --gpus): a request from argv, for a container named only by
    pid and rootfs, here or in gpuhookd's worker (*ahead*: its apply child, forked in advance)."""
    started = time.monotonic()
    # containerd puts the rootfs at <state>/<namespace>/<id>/rootfs, so its parent names the container.
    container = Container(id=call.rootfs.parent.name, pid=call.pid, rootfs=call.rootfs)
    get_logger().bind(container_id=container.id, pid=container.pid, front_end=PROG, served_by=served_by)
    _log_request(call.request)
    start(config, call.request, container, started=started, ahead=ahead,
          placement=Placement(manage_cgroups=not call.no_cgroups, cuda_compat=call.cuda_compat))


def stop(config: Config, state_obj: Mapping[str, Any], *, served_by: str) -> None:
    """poststop: release the container's lease, once its holder (the container's init) has exited.

    A holder that still runs keeps it (a runtime that runs poststop early, or another engine's
    container of the same id): gpuhookd's watch or the next start's reclaim releases it when it exits.
    """
    container_id = state_obj.get("id")
    if config.state_dir is None or not isinstance(container_id, str):
        return  # a state that names no container holds nothing (NVIDIA's poststop reads nothing either)
    if not ledger_store.may_name(config.state_dir, container_id):
        return  # no lease names it (most poststops: a container without GPUs): no lock to take
    log = get_logger()
    log.bind(container_id=container_id, served_by=served_by)
    released, kept = leases.release_if_gone(config.state_dir, container_id)
    for lease in released:
        log.info("lease_released", devices=list(lease.devices), pid=lease.holder.pid, why="poststop")
    if released:
        _host_cleanup(config)
        _job_mapping(config)
    else:  # a lease kept beside one released is another container's of the same id: nothing to warn of
        for lease in kept:
            log.warning("lease_kept", pid=lease.holder.pid, why="its holder still runs; released when it exits")


def release(config: Config, container_id: str) -> tuple[Lease, ...]:
    """``gpuhook release``: drop *container_id*'s lease by hand, whatever its holder does (every lease under that
    id, when containers of one id hold several); the leases dropped."""
    if config.state_dir is None:
        return ()
    released = leases.release(config.state_dir, container_id)
    for lease in released:
        get_logger().info("lease_released", container_id=container_id, devices=list(lease.devices),
                          pid=lease.holder.pid, why="by hand")
    if released:
        _host_cleanup(config)
        _job_mapping(config)
    return released


def reclaim_gone(config: Config) -> tuple[Ledger, tuple[Lease, ...]]:
    """The ledger after releasing every lease whose holder is gone; (it, the leases released)."""
    if config.state_dir is None:
        return Ledger(), ()
    ledger, stale = leases.reclaim(config.state_dir)
    for lease in stale:
        get_logger().info("lease_released", container_id=lease.container_id, devices=list(lease.devices),
                          pid=lease.holder.pid, why="holder gone", served_by="status")
    if ledger.recycle or ledger.idle_daemons():
        _host_cleanup(config)
        ledger = ledger_store.read(config.state_dir)
    if stale:
        _job_mapping(config)
    return ledger, stale


def release_gone(config: Config, container_id: str) -> None:
    """gpuhookd saw *container_id*'s holder exit: release its lease (if the holder is indeed gone)."""
    if config.state_dir is None:
        return
    released, _ = leases.release_if_gone(config.state_dir, container_id)
    for lease in released:
        get_logger().info("lease_released", container_id=container_id, devices=list(lease.devices),
                          pid=lease.holder.pid, why="holder exited", served_by="gpuhookd")
    if released:
        _host_cleanup(config)
        _job_mapping(config)


def lease_holders(config: Config) -> tuple[Lease, ...]:
    """Every lease as the ledger holds it now (read without the lock)."""
    return ledger_store.read(config.state_dir).leases if config.state_dir is not None else ()


def ledger_path(state_dir: Path) -> Path:
    """The ledger file in *state_dir* (gpuhookd checks it for changes)."""
    return state_dir / ledger_store.LEDGER


@dataclass(frozen=True, slots=True, kw_only=True)
class HostStatus:
    """``gpuhook status``: the GPUs, each one's policy, and the ledger (gone holders reclaimed)."""

    inventory: Inventory
    policies: Mapping[int, GpuPolicy]
    ledger: Ledger
    #: (container id, GPU index) → GPU memory its processes use, where NVML lists them
    memory: Mapping[tuple[str, int], int]


def status(config: Config) -> HostStatus:
    """Every GPU with its policy and holders, after reclaiming the leases of gone holders (and destroying the
    instances gpuhook made for them), with the GPU memory each holder uses (NVML's process lists)."""
    ledger = reclaim_gone(config)[0]
    found = host_inventory(config)
    policies = config.gpus.resolve(found.inventory.gpus)
    return HostStatus(inventory=found.inventory, policies=policies, ledger=ledger,
                      memory=usage_view(config, found.inventory, ledger).memory if ledger.leases else {})


@dataclass(frozen=True, slots=True, kw_only=True)
class _Reserved:
    """A start's lease: the request as allocated (``count`` placed, MIG instances by UUID), its holder (None: no
    lease taken), the MIG instances made for it, and the request as it was asked."""

    request: GpuRequest
    holder: Holder | None
    made: tuple[MigRecord, ...]
    asked: GpuRequest
    #: the MPS daemon of the GPU it holds under ``sharing: mps``
    mps: MpsDaemon | None = None
    #: waits for that daemon's limits to be told (``mps.Ensured.told``): before the container runs
    mps_told: Callable[[], object] = lambda: None


def _reserve(config: Config, request: GpuRequest, found: Found, target: Target, container: Container, pidfd: int,
             undo: contextlib.ExitStack) -> _Reserved:
    """A start's first effect: its lease reserved under the policy (the gone holders' reclaimed first), then
    the MIG instances it asks for made; the undo (release, and destroy what was made) pushed on *undo*."""
    if config.state_dir is None or not _holds_devices(request):
        if request.mig_asks:
            raise PolicyError(f"{request.source}={request.raw!r}: a MIG instance made on demand is recorded in the "
                              "lease ledger, and state_dir is null. Fix: set state_dir (default /run/gpuhook)")
        placed = _allocated(config, request, found, Ledger(), container_id=container.id, target=target)
        return _Reserved(request=placed, holder=None, made=(), asked=request)
    from datetime import UTC, datetime

    step = time.monotonic()
    state_dir = config.state_dir
    holder = leases.holder_of(container.pid, pidfd)
    inventory = narrow_to_live(found.inventory, found.live)
    policies = config.gpus.resolve(inventory.gpus)
    try:
        taken = leases.take(state_dir, request, inventory, policies, container_id=container.id, holder=holder,
                            unhealthy=_unhealthy(inventory, found, target))
    except GpuHookError:
        _host_cleanup(config, inventory)  # a refusal still destroys what the gone holders' leases had made
        raise
    undo.callback(_drop, config, container.id, holder)
    _job_mapping(config, inventory)
    get_logger().info("lease_reserved", devices=list(taken.allocation.devices), ms=_ms(step),
                      reclaimed=[lease.container_id for lease in taken.reclaimed])
    allocation = taken.allocation
    if taken.to_recycle:
        _host_cleanup(config, inventory)  # the reclaimed leases' instances first: they may hold the room
    ensured = _mps_daemon(config, inventory, policies, allocation.request)
    mps, told = (ensured.daemon, ensured.told) if ensured is not None else (None, lambda: None)
    if not allocation.to_make:
        return _Reserved(request=allocation.request, holder=holder, made=(), asked=request, mps=mps, mps_told=told)
    made = _make_migs(config, inventory, allocation, container.id, holder, datetime.now(UTC))
    placed = dataclasses.replace(allocation.request, mig_asks=(),
                                 devices=allocation.request.devices + tuple(MigUuid(r.uuid) for r in made if r.uuid))
    return _Reserved(request=placed, holder=holder, made=made, asked=request, mps=mps, mps_told=told)


def _mps_daemon(config: Config, inventory: Inventory, policies: Mapping[int, GpuPolicy],
                request: GpuRequest) -> mps.Ensured | None:
    """The MPS daemon of the GPU *request* holds under ``sharing: mps`` (started if it is not running)."""
    from gpuhook.planning.select import select_devices

    gpu = next((g for g in select_devices(request, inventory).parents(inventory)
                if policies[g.index].sharing is Sharing.MPS), None)
    if gpu is None or config.state_dir is None:
        return None
    from gpuhook.provision import mps

    step = time.monotonic()
    threads, memory = client_limits(policies[gpu.index], gpu)
    ensured = mps.ensure(config.state_dir, _mps_control(inventory), gpu,
                         mps.Limits(thread_percentage=threads, memory_limit_mib=memory,
                                    shm_size_mib=shm_size_mib(policies[gpu.index])))
    daemon = ensured.daemon
    if ensured.found.problems:
        get_logger().warning("mps_daemon_not_as_recorded", gpu=gpu.index, problems=list(ensured.found.problems),
                             done="restarted in the same directories" if ensured.started else "limits told again")
    get_logger().info("mps_daemon", gpu=gpu.index, pid=daemon.holder.pid if daemon.holder else None,
                      started=ensured.started, thread_percentage=threads, memory_limit_mib=memory, ms=_ms(step))
    return ensured


def _with_mps(live: LiveFacts, daemon: MpsDaemon | None) -> LiveFacts:
    """*live* with *daemon*'s pipes (where CUDA looks by default) and shared memory in place of the host's."""
    if daemon is None:
        return live
    from gpuhook.provision.mps import client_dir

    pipe = DriverFile(name=catalog.MPS_PIPE_DIRECTORY, host_path=Path(client_dir(daemon)))
    return dataclasses.replace(live, mps_pipe=pipe, mps_shm=DriverFile(name="/dev/shm", host_path=Path(daemon.shm_dir)))


def mps_checks(config: Config, inventory: Inventory | None = None,
               ledger: Ledger | None = None) -> dict[str, tuple[str, ...]]:
    """GPU UUID → what is wrong with the MPS daemon gpuhook recorded for it (empty: it is gpuhook's, with the
    limits recorded), for every recorded daemon (``status``, the metrics). Read-only."""
    if config.state_dir is None:
        return {}
    ledger = ledger if ledger is not None else ledger_store.read(config.state_dir)
    if not ledger.daemons:
        return {}
    from gpuhook.provision import mps

    control = _mps_control(inventory or host_inventory(config).inventory)
    return {daemon.gpu: mps.check(control, daemon).problems for daemon in ledger.daemons}


def _mps_control(inventory: Inventory) -> Path:
    """The driver's nvidia-cuda-mps-control (a host binary, found by discovery: never the container's)."""
    found = next((f.host_path for f in inventory.binaries if f.name == catalog.MPS_CONTROL), None)
    if found is None:
        raise DiscoveryError(f"the driver root has no {catalog.MPS_CONTROL}, which runs the MPS daemon of a GPU shared "
                             "with sharing: mps. Fix: install the driver's CUDA MPS tools, or change the GPU's sharing")
    return found


def _make_migs(config: Config, inventory: Inventory, allocation: Allocation, container_id: str, holder: Holder,
               now: datetime) -> tuple[MigRecord, ...]:
    """The MIG instances *allocation* leaves to make, made for *container_id*'s lease (logged one by one)."""
    from gpuhook.provision import mig

    assert config.state_dir is not None
    library = _nvml_library(inventory)
    made = []
    for pick in allocation.to_make:
        step = time.monotonic()
        instance = mig.make(config.state_dir, library, allocation.request, pick, container_id=container_id,
                            holder=holder, now=now)
        made.append(instance.record)
        get_logger().info("mig_created", uuid=instance.record.uuid, gpu=instance.gpu.index,
                          profile=instance.record.profile, gi=instance.record.gi, ci=instance.record.ci,
                          name=instance.record.name, ms=_ms(step))
    return tuple(made)


def _drop(config: Config, container_id: str, holder: Holder) -> None:
    """A failed start's undo: its reservation given back, and the instances made for it destroyed."""
    assert config.state_dir is not None
    leases.drop(config.state_dir, container_id, holder)
    _host_cleanup(config)
    _job_mapping(config)


def _host_cleanup(config: Config, inventory: Inventory | None = None) -> None:
    """What ended leases leave on the host, undone: the MIG instances gpuhook made for them destroyed (the
    ledger's ``recycle``), the MPS daemons of GPUs nobody holds any more stopped; nothing when there is none.

    Never raises: what cannot be undone now stays recorded (and logged), for the next reclaim.
    """
    if config.state_dir is None:
        return
    ledger = ledger_store.read(config.state_dir)
    if not ledger.recycle and not ledger.idle_daemons():
        return
    log = get_logger()
    try:
        inventory = inventory or inventory_for(config, LiveNeeds()).inventory
        if ledger.idle_daemons():
            from gpuhook.provision import mps

            for daemon in mps.stop_idle(config.state_dir, _mps_control(inventory)):
                log.info("mps_daemon_stopped", gpu=daemon.gpu, pid=daemon.holder.pid if daemon.holder else None)
        library = _nvml_library(inventory) if ledger.recycle else None
    except GpuHookError as err:
        log.warning("host_cleanup_failed", error=str(err), why="the next reclaim tries again")
        return
    if library is None:
        return
    from gpuhook.provision import mig

    destroyed, failed = mig.recycle(config.state_dir, library)
    for record in destroyed:
        log.info("mig_destroyed", uuid=record.uuid, gpu=record.gpu, profile=record.profile, gi=record.gi,
                 ci=record.ci, name=record.name)
    for record, error in failed:
        log.warning("mig_not_destroyed", uuid=record.uuid, gpu=record.gpu, gi=record.gi, error=error,
                    why="the next reclaim tries again")


def _job_mapping(config: Config, inventory: Inventory | None = None) -> None:
    """dcgm-exporter's job-mapping files rewritten from the ledger (under its lock, so the newest holders win);
    never raises: a failure is logged, and the next change of holders writes them again."""
    if config.hpc_job_mapping_dir is None or config.state_dir is None:
        return
    from gpuhook.provision import jobmap

    directory = config.hpc_job_mapping_dir
    try:
        known = inventory or inventory_for(config, LiveNeeds()).inventory
        by_uuid = {g.uuid.casefold(): g.index for g in known.gpus}
        migs = {m.uuid.casefold(): m.parent_index for m in known.mig_devices}

        def write(ledger: Ledger) -> tuple[Ledger, None]:
            parents = by_uuid | migs
            parents.update((r.uuid.casefold(), by_uuid[r.gpu.casefold()]) for lease in ledger.leases
                           for r in lease.migs if r.uuid and r.gpu.casefold() in by_uuid)
            jobmap.write(directory, ledger, parents)
            return ledger, None

        ledger_store.update(config.state_dir, write)
    except GpuHookError as err:
        get_logger().warning("job_mapping_not_written", error=str(err), why="written again at the next change")


def _recorded(config: Config) -> tuple[MigRecord, ...]:
    """The MIG instances the ledger records (read without the lock): NVML told gpuhook their UUIDs. None where
    the ledger cannot be read (``gpuhook info`` as a user: a start, as root, reports a bad ledger itself)."""
    if config.state_dir is None:
        return ()
    try:
        ledger = ledger_store.read(config.state_dir)
    except StateError:
        return ()
    return tuple(r for lease in ledger.leases for r in lease.migs if r.uuid) + ledger.recycle


def _nvml_library(inventory: Inventory) -> Path:
    """The driver's NVML, by the absolute path discovery found it at."""
    found = inventory.nvml_library()
    if found is None:
        raise DiscoveryError("the driver's libnvidia-ml.so is not in the inventory; MIG instances are made through "
                             "it. Fix: `gpuhook info --refresh`, and check the driver install")
    return found


def _holds_devices(request: GpuRequest) -> bool:
    """Whether *request* can hold a device (``none`` holds none, and takes no lease)."""
    return request.all_devices or request.count is not None or bool(request.devices or request.mig_asks)


def _allocated(config: Config, request: GpuRequest, found: Found, ledger: Ledger, *, container_id: str,
               target: Target) -> GpuRequest:
    """*request* placed against *ledger* without leasing (state_dir null, or a dry run): ``count`` resolved."""
    if request.count is None:
        return request
    from datetime import UTC, datetime

    inventory = narrow_to_live(found.inventory, found.live)
    return allocate(request, inventory, config.gpus.resolve(inventory.gpus), ledger, container_id=container_id,
                    now=datetime.now(UTC), unhealthy=_unhealthy(inventory, found, target)).request


def _unhealthy(inventory: Inventory, found: Found, target: Target) -> dict[int, str]:
    """The GPUs a start would refuse for their health (what ``count`` must not pick), with the problems."""
    if target.unhealthy_gpus is not HealthPolicy.REFUSE:
        return {}
    from gpuhook.planning.health import problems

    return {g.index: "; ".join(issues) for g in inventory.gpus if (issues := problems(g, found.live))}


def _refuse_unleased(config: Config, request: GpuRequest, inventory: Inventory) -> None:
    """Spec edits run before the container exists, so they take no lease: refuse what needs one."""
    from gpuhook.planning.select import select_devices

    policies = config.gpus.resolve(inventory.gpus)
    if request.count is not None or request.mig_asks or any(policies[g.index].limit is not None
                                        for g in select_devices(request, inventory).parents(inventory)):
        raise PolicyError(f"{request.source}={request.raw!r}: a GPU with a sharing limit, 'any'/'count=N' or a MIG "
                          "instance made on demand (mig=PROFILE) is leased when the container starts, and a spec edit "
                          "runs before it exists. Fix: register "
                          "gpuhook as a prestart hook (and poststop) for these containers")


def update_ldcache_in(config: Config, rootfs: Path, dirs: Sequence[str]) -> None:
    """The CDI spec's createContainer hook: the host's sandboxed ldconfig over *dirs* in *rootfs*.

    runc runs createContainer hooks in the container's mount namespace after its mounts and
    before pivot_root, so *rootfs* already shows the CDI mounts: no namespace to enter.
    """
    from gpuhook.apply.ldconfig import update_ldcache

    rootfs_identity(rootfs)  # refuses the host's own /
    update_ldcache(config.ldconfig, rootfs, dirs, timeout=config.timeout_seconds)


def _host_ldconfig(config: Config, *, keeps: bool = False) -> HostLdconfig:
    """The configured ldconfig and, where gpuhook writes the cache it would (asked once per binary,
    ``ldprofile``; *keeps*: gpuhookd, whose workers inherit the answer), what it takes to: then no
    ldconfig runs."""
    if not config.ldconfig_native:
        return HostLdconfig(config.ldconfig)
    from gpuhook.apply.ldprofile import profile_for

    answer = profile_for(config.ldconfig, config.cache_dir, keeps=keeps)
    if answer.profile is None:
        get_logger().debug("ldconfig_runs", why=answer.why_not)
    return HostLdconfig(config.ldconfig, answer.profile)


def writes_ldcache_itself(config: Config) -> bool:
    """Whether gpuhook writes the containers' ld.so.cache itself under *config* (else ldconfig runs, sandboxed)."""
    return _host_ldconfig(config, keeps=True).profile is not None


# --- gpuhookd's preparations ------------------------------------------------------------------------


def prepare_daemon(env: Mapping[str, str]) -> str:
    """Work the default configuration's requests can share (the sealed copy of its ldconfig); '' or why not."""
    from gpuhook.apply.ldconfig import seal_ahead

    try:
        path, required = resolve_config_path(None, env)
        config = load_config(path, required=required)
        seal_ahead(config.ldconfig)
        _host_ldconfig(config, keeps=True)  # asked now, so every worker forked after knows the answer
    except GpuHookError as err:
        return f"ldconfig not prepared ({err}); each request copies it"
    return ""


def follow_kernel_log(config: Config) -> XidLog | None:
    """gpuhookd, before it forks its workers: *config*'s kernel log opened for the pool to read each record
    once (``health.XidLog``), and every start's Xids asked of it; None where there is none to follow (no log,
    or a simulated host's file): each start then reads the whole log, as the hook does."""
    from gpuhook.discovery import health

    try:
        log = health.XidLog(config.dev_root)
    except (OSError, ValueError):
        return None
    health.share(log)
    return log


def share_library_reads() -> None:
    """gpuhookd, before it forks its workers: what any of its processes reads of a container's libraries is
    kept for all (``ldshared``), so that the starts of one image read each of its libraries once."""
    from gpuhook.apply import ldelf, ldshared

    ldelf.share(ldshared.Shared())


def prepare_worker(config_path: str, *, required: bool) -> bool:
    """What an idle gpuhookd worker does before its request, so that the request need not: the inventory
    cache decoded and, where gpuhook writes the cache itself, the driver's libraries read (a container
    gets the host's very files). Reads only; never asks NVML; any failure is left to the request.
    Returns whether gpuhook writes the containers' caches itself (so that no ldconfig child need wait)."""
    from gpuhook.apply import ldelf
    from gpuhook.discovery import warm

    try:
        config = load_config(Path(config_path), required=required)
        native = writes_ldcache_itself(config)
        inventory = warm(config)
        if inventory is None:
            return native
        if native:
            ldelf.remember(f.host_path for f in (*inventory.libraries, *inventory.libraries32))
        _warm_plan(config, inventory)
    except Exception:  # noqa: BLE001 - an optimisation: whatever fails here, the request does itself
        return False
    return native


def _warm_plan(config: Config, inventory: Inventory) -> None:
    """A plan for every GPU with every capability, thrown away: a forked worker's first plan touches
    code and data that fault in copy-on-write pages and fill caches, about half its time (measured:
    3.0 ms cold, 1.4 ms after this), which the request then does not pay. No NVML: *inventory* is
    the one the cache held."""
    from gpuhook.discovery.live import read_live
    from gpuhook.request.model import ALL_CAPABILITIES

    machine = os.uname().machine
    target = Target(libs_dir=libs_dir(debian_like=True, machine=machine),
                    libs32_dir=libs32_dir(debian_like=True, machine=machine), unhealthy_gpus=HealthPolicy.IGNORE)
    request = GpuRequest(all_devices=True, devices=(), capabilities=ALL_CAPABILITIES)
    # What such a plan reads live: on a host in MIG mode, the layout and caps nodes too ("all" selects every
    # MIG device; without them the plan refused, and the MIG path stayed cold)
    live = read_live(config, live_needs(request, target))
    make_plan(request, narrow_to_live(inventory, live), live, target)


def fork_apply_ahead(*, priority: int, close: Sequence[int] = (), ldconfig_ahead: bool = True,
                     learned: Learned | None = None) -> ChildAhead:
    """An apply child forked before its request arrives (an idle gpuhookd worker's), with its ldconfig
    child unless *ldconfig_ahead* is false (``prepare_worker`` found that gpuhook writes the cache itself);
    it copies in the pages its predecessors wrote (*learned*) while it waits."""
    from gpuhook.apply import fork_apply_child

    return fork_apply_child(priority=priority, close=close, ldconfig_ahead=ldconfig_ahead, learned=learned)


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
    # What a start would pick now, against the ledger as it is (nothing is leased).
    ledger = ledger_store.read(config.state_dir) if config.state_dir and request.count is not None else Ledger()
    placed = _allocated(config, request, found, ledger, container_id="", target=target)
    return placed, make_plan(placed, found.inventory, found.live, target)


def render_spec_edit(config: Config, raw: Mapping[str, Any], spec: BundleSpec, *,
                     hook_follows: bool = False) -> Mapping[str, Any]:
    """*raw* with the requested GPUs' devices and rules added (the same object when no GPU is asked for).

    *hook_follows*: gpuhook's prestart hook is registered too (``gpuhook-runtime``), and takes the
    lease; a ``count``/``any`` request is then left to it whole (which GPUs is decided at the start).
    Without one (``spec-edit``, ``precreate``) nothing would take a lease: what needs one is refused.
    """
    from gpuhook.planning.specedit import add_devices

    request = request_for(spec, config)
    if request is None or (hook_follows and (request.count is not None or request.mig_asks)):
        return raw
    found = inventory_for(config, live_needs(request))
    if not hook_follows:
        _refuse_unleased(config, request, found.inventory)
    device_plan = _creating_nodes(config, found, lambda: inventory_for(config, live_needs(request)),
                                  lambda f: plan_devices(request, f.inventory, f.live))
    return add_devices(raw, device_plan.devices, env=_mps_env(config, found.inventory, device_plan.gpus))


def edit_runtime_bundle(settings: Callable[[], Config], config_arg: str | None, bundle: Path,
                        relay: PurePath | None, *, socket: str | None = None, root_fd: int | None = None) -> bool:
    """The runtime wrapper's spec edit (``gpuhook-runtime`` on ``create``/``run``): the requested GPUs'
    devices and rules, and gpuhook's prestart and poststop hooks (*relay*: gpuhook-relay, else the
    Python hook; *socket*: gpuhookd's, for them, if not the default), written into ``<bundle>/config.json``
    atomically, with its mode; True if it asks for a GPU and was edited. *settings*: loaded only then.
    *root_fd*: resolve *bundle* from this root (gpuhookd: the caller's, which it opened itself). Raises
    GpuHookError."""
    from gpuhook.hookcall import read_config_json
    from gpuhook.oci import strictjson
    from gpuhook.oci.spec import SPEC_LIMIT, spec_from_object
    from gpuhook.request.quick import asks_for_gpu
    from gpuhook.request.runtimecall import add_hooks

    shown = bundle / "config.json"
    raw = strictjson.loads_object(read_config_json(str(bundle), limit=SPEC_LIMIT, root_fd=root_fd), what=str(shown),
                                  limit=SPEC_LIMIT)
    if not asks_for_gpu(raw):
        return False
    config = settings()
    spec = spec_from_object(raw, bundle)
    if request_for(spec, config) is None:  # void, or a marker that asks for nothing
        return False
    edited = render_spec_edit(config, raw, spec, hook_follows=True)
    # The hooks go in whenever a GPU is asked for: the prestart one takes the lease (and places a
    # count=N request, which the spec edit leaves to it), the poststop one gives it back.
    replace_spec(bundle, add_hooks(dict(edited), config_arg, relay, socket), root_fd)
    return True


def replace_spec(bundle: Path, spec: Mapping[str, Any], root_fd: int | None = None) -> None:
    """``<bundle>/config.json`` replaced atomically (same directory, same mode): a runtime never reads half a
    spec. *root_fd*: *bundle* resolved from this root (gpuhookd: the caller's)."""
    import json

    from gpuhook.sys import pathrs
    from gpuhook.sys.files import replace_at

    try:
        dir_fd = (pathrs.openat2(root_fd, str(bundle), os.O_PATH | os.O_DIRECTORY,
                                 pathrs.RESOLVE_IN_ROOT | pathrs.RESOLVE_NO_MAGICLINKS)
                  if root_fd is not None else os.open(bundle, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
        try:
            mode = os.stat("config.json", dir_fd=dir_fd, follow_symlinks=False).st_mode & 0o7777
            replace_at(dir_fd, "config.json", json.dumps(spec).encode(), mode=mode)
        finally:
            os.close(dir_fd)
    except OSError as err:
        raise SpecError(f"cannot write {bundle / 'config.json'}: {err.strerror or err}") from err


def _creating_nodes(config: Config, found: Found, rediscover: Callable[[], Found], plan: Callable[[Found], P]) -> P:
    """``plan(found)``; with load_kmods, each device node it finds missing is made first (nvidia-modprobe,
    as NVIDIA's load-kmods), then the host is read again and the plan made again."""
    tried: set[tuple[str, ...]] = set()
    while True:
        try:
            return plan(found)
        except MissingNodeError as missing:
            from gpuhook.discovery.host import driver_program  # only now: kmods imports subprocess (~10 ms)
            from gpuhook.provision import kmods

            if not config.load_kmods:
                raise MissingNodeError(f"{missing} (load_kmods is off)", missing.modprobe) from None
            if missing.modprobe in tried:
                raise
            modprobe = driver_program(config.driver_root, "nvidia-modprobe")
            if modprobe is None:
                raise MissingNodeError(f"{missing}; load_kmods would, but the driver root {config.driver_root} has "
                                       "no nvidia-modprobe (install it with the driver)", missing.modprobe) from None
            step = time.monotonic()
            kmods.create_node(modprobe, missing.modprobe, timeout=config.timeout_seconds)
            get_logger().info("node_created", command=" ".join((str(modprobe), *missing.modprobe)), ms=_ms(step))
            tried.add(missing.modprobe)
            found = rediscover()


def _mps_env(config: Config, inventory: Inventory, gpus: Sequence[Gpu]) -> tuple[tuple[str, str], ...]:
    """For a GPU shared through gpuhook's MPS daemon: the client's own limits in its environment (a prestart
    hook cannot set them; the daemon's defaults hold either way), and where its pipes are."""
    policies = config.gpus.resolve(inventory.gpus)
    gpu = next((g for g in gpus if policies[g.index].sharing is Sharing.MPS), None)
    if gpu is None:
        return ()
    threads, memory = client_limits(policies[gpu.index], gpu)
    return (("CUDA_MPS_PIPE_DIRECTORY", catalog.MPS_PIPE_DIRECTORY),
            ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", f"{threads:g}"),
            ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", f"0={memory}M"))


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


def usage_view(config: Config, inventory: Inventory | None = None, ledger: Ledger | None = None) -> UsageView:
    """Who uses which GPU now (the metrics endpoint, ``status --prometheus``): read-only, reclaims nothing;
    *inventory* and *ledger*: as the caller has just read them (else read here)."""
    from gpuhook.discovery.usage import cgroup_of, gpu_processes
    from gpuhook.sharing.attribution import usage_view as view

    inventory = inventory or host_inventory(config).inventory
    if ledger is None:
        try:
            ledger = ledger_store.read(config.state_dir) if config.state_dir is not None else Ledger()
        except StateError:
            ledger = Ledger()
    mps_up = {d.gpu: d.holder is not None and leases.alive(d.holder) for d in ledger.daemons}
    cgroups = {lease.container_id: path for lease in ledger.leases if (path := cgroup_of(lease.holder.pid))}
    return view(inventory, config.gpus.resolve(inventory.gpus), ledger, mps_up=mps_up,
                processes=gpu_processes(inventory) if ledger.leases else (), holder_cgroups=cgroups)


def host_inventory(config: Config, *, refresh: bool = False) -> Found:
    """The host's inventory through the cache, MIG devices as they exist now (``info``, ``nvidia-container-cli
    info|list``, CDI)."""
    return inventory_for(config, LiveNeeds(mig=True), refresh=refresh, recorded=_recorded(config))


def discover_uncached(config: Config) -> Inventory:
    """The host's inventory straight from NVML, bypassing the cache (``gpuhook doctor``)."""
    return inventory_for(dataclasses.replace(config, cache_dir=None), LiveNeeds()).inventory


def check_ldconfig(config: Config) -> str:
    """Raise ApplyError unless the configured ldconfig is one the sandbox can run (static, host-owned);
    else say who writes the containers' ld.so.cache."""
    from gpuhook.apply.ldconfig import open_ldconfig
    from gpuhook.apply.ldprofile import profile_for

    os.close(open_ldconfig(config.ldconfig))
    if not config.ldconfig_native:
        return "it runs sandboxed in each container (ldconfig_native: false)"
    answer = profile_for(config.ldconfig, config.cache_dir, keeps=True)  # doctor: asked, whatever it costs
    if answer.profile is not None:
        return ("gpuhook writes each container's ld.so.cache itself, byte for byte what this ldconfig "
                "writes on a sample tree")
    return f"it runs sandboxed in each container: {answer.why_not}"


def request_for(spec: BundleSpec, config: Config) -> GpuRequest | None:
    """The container's request under the configured policy (env, device-plugin mounts, CDI annotations)."""
    return parse_request(
        spec,
        accept_envvar_when_unprivileged=config.accept_envvar_when_unprivileged,
        accept_volume_mounts=config.accept_volume_mounts,
        accept_cdi_annotations=config.accept_cdi_annotations,
        supported_capabilities=config.supported_driver_capabilities,
        disable_require=config.disable_require,
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
    get_logger().debug("request_parsed", source=request.source, devices=request.raw,
                       capabilities=sorted(request.capabilities),
                       requirements=[str(r) for r in request.requirements], **extra)


def _log_plan(plan: Plan) -> None:
    log = get_logger()
    log.debug("plan_built", gpus=list(plan.gpus), devices=len(plan.devices), mounts=len(plan.mounts),
              cgroup_rules=len(plan.cgroup_rules))
    for skipped in plan.skipped:
        log.debug("skipped", what=skipped.what, reason=skipped.reason)
    for warning in plan.warnings:
        log.warning("plan_warning", message=warning)


def _ms(since: float) -> float:
    """Milliseconds since *since*, rounded for the log."""
    return round((time.monotonic() - since) * 1000, 1)

"""``gpuhook status [--json]`` and ``gpuhook release CONTAINER_ID``: the lease ledger for a person."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from gpuhook import service
from gpuhook.errors import StateError
from gpuhook.inventory import Gpu, MigDevice
from gpuhook.sharing.ledger import Lease, Ledger, MpsDaemon, age


def run_status(config_arg: str | None, debug: bool, env: Mapping[str, str], *, as_json: bool,
               prometheus: bool = False) -> int:
    """Print every GPU, its policy and its holders (after reclaiming the leases of gone holders)."""
    config = service.load_settings(config_arg, debug, env)
    report = service.status(config)
    if prometheus:
        from gpuhook.daemon import metrics

        sys.stdout.write(metrics.render(config).decode())
        return 0
    data = status_object(report, service.mps_checks(config, report.inventory, report.ledger))
    if as_json:
        json.dump(data, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(status_text(data, leasing=config.state_dir is not None))
    return 0


def run_release(config_arg: str | None, debug: bool, env: Mapping[str, str], container_id: str) -> int:
    """Drop *container_id*'s lease by hand; say what it held."""
    config = service.load_settings(config_arg, debug, env)
    if config.state_dir is None:
        raise StateError("state_dir is null in the config: gpuhook keeps no leases, so there is none to release")
    released = service.release(config, container_id)
    if not released:
        raise StateError(f"container {container_id!r} holds no lease (see `gpuhook status`)")
    for lease in released:  # several where containers of one id (other runc roots, namespaces) each hold one
        print(f"released {container_id}: {', '.join(lease.devices)} (pid {lease.holder.pid}, since {lease.since})")
    return 0


def status_object(report: service.HostStatus, mps_checks: Mapping[str, tuple[str, ...]]) -> dict[str, Any]:
    """The JSON shape: ``{"gpus": [{"index", "uuid", "model", "sharing", "replicas", ..., "holders": [...]}],
    "mig_devices": [{"uuid", "gpu_index", "profile", "name", "created_by_gpuhook", "holder"}]}``; *mps_checks*:
    what is wrong with each recorded MPS daemon (``service.mps_checks``)."""
    inventory, ledger = report.inventory, report.ledger
    gpus = []
    for gpu in inventory.gpus:
        policy = report.policies[gpu.index]
        migs = {m.uuid.casefold() for m in inventory.mig_devices if m.parent_index == gpu.index}
        holding = ledger.holding(gpu.uuid, *migs)
        holding += tuple(lease for lease in ledger.holding_mig_on(gpu.uuid) if lease not in holding)
        holders = [_holder(lease, gpu, migs) | {"memory_used_bytes": report.memory.get((lease.container_id, gpu.index))}
                   for lease in holding]
        gpus.append({
            "index": gpu.index, "uuid": gpu.uuid, "model": gpu.model, "pci_bus_id": gpu.pci_bus_id,
            "sharing": policy.sharing.value, "replicas": policy.replicas,
            "capabilities": sorted(policy.capabilities) if policy.capabilities is not None else None,
            "holders": holders,
            "mps": _mps(ledger.daemon_for(gpu.uuid), ledger, mps_checks.get(gpu.uuid, ())),
        })
    return {"gpus": gpus, "mig_devices": [_mig_device(mig, ledger) for mig in inventory.mig_devices]}


def _mps(daemon: MpsDaemon | None, ledger: Ledger, problems: tuple[str, ...]) -> dict[str, Any] | None:
    """The GPU's MPS daemon: ``ok`` false with the ``problems`` when the daemon behind its pipes is not
    gpuhook's recorded one or reports other limits (the next start restarts it or tells them again), and
    what a restart does while clients hold the GPU (always the same directories, so they reconnect)."""
    if daemon is None:
        return None
    return {"pid": daemon.holder.pid if daemon.holder else None, "thread_percentage": daemon.thread_percentage,
            "memory_limit_mib": daemon.memory_limit_mib, "pipe_directory": daemon.pipe_dir,
            "clients": [lease.container_id for lease in ledger.holding(daemon.gpu)],
            "ok": not problems, "problems": list(problems), "restart": "same-directories"}


def _mig_device(mig: MigDevice, ledger: Ledger) -> dict[str, Any]:
    record = next((r for lease in ledger.leases for r in lease.migs if r.uuid == mig.uuid), None)
    holder = next(iter(ledger.holding(mig.uuid)), None)
    return {"uuid": mig.uuid, "gpu_index": mig.parent_index, "profile": mig.profile or None,
            "name": record.name if record else None, "created_by_gpuhook": bool(record and record.created),
            "holder": holder.container_id if holder else None}


def _holder(lease: Lease, gpu: Gpu, migs: set[str]) -> dict[str, Any]:
    mig = [d for d in lease.devices if d.casefold() in migs]
    return {"container_id": lease.container_id, "pid": lease.holder.pid, "since": lease.since,
            "state": lease.state.value, "whole_gpu": any(d.casefold() == gpu.uuid.casefold() for d in lease.devices),
            "mig_uuids": mig}


def status_text(data: Mapping[str, Any], *, leasing: bool) -> str:
    """One row per GPU, one line per further holder: readable at a glance."""
    now = datetime.now(UTC)
    rows = [("GPU", "UUID", "MODEL", "POLICY", "HOLDERS")]
    for gpu in data["gpus"]:
        policy = gpu["sharing"] + (f" ({gpu['replicas']})" if gpu["replicas"] is not None else "")
        if gpu["capabilities"] is not None:
            policy += f" [{','.join(gpu['capabilities'])}]"
        holders = [_holder_text(h, now) for h in gpu["holders"]] or ["-"]
        if gpu["mps"] is not None:
            mps = gpu["mps"]
            holders.append(f"MPS daemon pid {mps['pid']}: {mps['thread_percentage']:g}% of the SMs, "
                           f"{mps['memory_limit_mib']} MiB per client, pipes in {mps['pipe_directory']} (a restart "
                           "reuses them: its clients reconnect)")
            holders += [f"MPS daemon NOT as gpuhook recorded it: {problem} (the next start fixes it)"
                        for problem in mps["problems"]]
        rows.append((str(gpu["index"]), gpu["uuid"], gpu["model"], policy, holders[0]))
        rows += [("", "", "", "", more) for more in holders[1:]]
    widths = [max(len(row[n]) for row in rows) for n in range(4)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True)) + "  " + row[4]
             for row in rows]
    if data["mig_devices"]:
        lines += ["", "MIG devices:"]
        lines += [f"  {m['gpu_index']}  {m['uuid']}  {m['profile'] or '?'}"
                  + (f"  #{m['name']}" if m["name"] else "")
                  + ("  made by gpuhook" if m["created_by_gpuhook"] else "  admin's")
                  + f"  {'held by ' + m['holder'] if m['holder'] else 'free'}" for m in data["mig_devices"]]
    if not leasing:
        lines.append("(state_dir is null: gpuhook keeps no leases, so no holders are known)")
    return "\n".join(lines) + "\n"


def _holder_text(holder: Mapping[str, Any], now: datetime) -> str:
    what = "" if holder["whole_gpu"] else f" MIG {','.join(holder['mig_uuids'])}"
    starting = ", starting" if holder["state"] == "reserved" else ""
    used = holder.get("memory_used_bytes")
    memory = f", {used / (1 << 30):.1f} GiB of GPU memory" if used is not None else ""
    return f"{holder['container_id']} (pid {holder['pid']}, {age(holder['since'], now)}{starting}{memory}){what}"

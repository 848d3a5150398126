"""Issue 16's pure core: what a ``mig=PROFILE[#NAME]`` ask gets, the ledger's MIG records and recycle list."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpuhook.errors import BusyError, PolicyError, StateError
from gpuhook.inventory import Gpu, HostDevice, Inventory, MigDevice, MigProfile
from gpuhook.request.model import Capability, GpuIndex, GpuRequest, MigAsk, MigUuid
from gpuhook.sharing.allocate import allocate
from gpuhook.sharing.ledger import Holder, Lease, Ledger, MigRecord, MigState, from_object, timestamp, to_object
from gpuhook.sharing.mig import free_starts, mode_may_be_stale, with_recorded
from gpuhook.sharing.policy import GpuPolicy, MigMode, Sharing

NOW = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
A100 = "NVIDIA A100-SXM4-40GB"
PROFILES = (MigProfile(name="1g.5gb", profile_id=19, slices=1, memory_mib=4864, instances=7),
            MigProfile(name="3g.20gb", profile_id=9, slices=3, memory_mib=19968, instances=2))


def _uuid(i: int) -> str:
    return f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd"


def _gpu(i: int, *, mig: bool) -> Gpu:
    return Gpu(index=i, uuid=_uuid(i), minor=i, pci_bus_id=f"00000000:{0x18 + i:02X}:00.0", model=A100,
               mig_enabled=mig, mig_profiles=PROFILES)


def _admin(parent: int, gi: int, profile: str = "3g.20gb", index: int = 0) -> MigDevice:
    return MigDevice(parent_index=parent, index=index, uuid=f"MIG-{parent}{gi:02d}00000-1111-2222-3333-444444444444",
                     gi=gi, ci=0, name=f"{A100} MIG {profile}", profile=profile)


def host(*mig: bool, migs: tuple[MigDevice, ...] = ()) -> Inventory:
    """A host with one GPU per entry of *mig* (in MIG mode where True), and *migs* admin instances."""
    return Inventory(driver_version="550.54.15", cuda_version="12.4",
                     gpus=tuple(_gpu(i, mig=on) for i, on in enumerate(mig)),
                     gpu_nodes=tuple(HostDevice(name=f"nvidia{i}", host_path=Path(f"/dev/nvidia{i}"), major=195,
                                                minor=i) for i in range(len(mig))),
                     control_nodes=(), libraries=(), binaries=(), firmware=(), ipc=(), mig_devices=migs)


def ask(raw: str, *asks: MigAsk, devices: tuple[GpuIndex, ...] = ()) -> GpuRequest:
    return GpuRequest(all_devices=False, devices=devices, mig_asks=asks, raw=raw,
                      capabilities=frozenset({Capability.COMPUTE, Capability.UTILITY}))


UNLIMITED = GpuPolicy()


def policies(inventory: Inventory, policy: GpuPolicy = UNLIMITED) -> dict[int, GpuPolicy]:
    return {g.index: policy for g in inventory.gpus}


def record(gpu: int, *, name: str | None = None, gi: int | None = 1, created: bool = True,
           profile: str = "3g.20gb") -> MigRecord:
    return MigRecord(gpu=_uuid(gpu), profile=profile, name=name, created=created, profile_id=9, placement=0, gi=gi,
                     ci=0 if gi is not None else None, uuid=f"MIG-made{gpu}{gi}-1111-2222-3333-444444444444"
                     if gi is not None else None, state=MigState.READY if gi is not None else MigState.CREATING)


def lease(container_id: str, *migs: MigRecord, devices: tuple[str, ...] = (), pid: int = 100) -> Lease:
    return Lease(container_id=container_id, devices=devices + tuple(r.uuid for r in migs if r.uuid),
                 holder=Holder(pid=pid, start=1000 + pid), since=timestamp(NOW - timedelta(seconds=5)), migs=migs)


def test_an_ask_on_a_gpu_leaves_the_instance_to_make_on_it() -> None:
    inventory = host(True, True)
    allocation = allocate(ask("0,mig=3g.20gb", MigAsk(profile="3g.20gb", gpu=GpuIndex(0))), inventory,
                          policies(inventory), Ledger(), container_id="c", now=NOW)
    [pick] = allocation.to_make
    assert [g.index for g in pick.candidates] == [0] and allocation.devices == () and allocation.migs == ()


def test_an_ask_without_a_gpu_tries_the_least_used_mig_gpu_first() -> None:
    """Any MIG-enabled GPU with the profile, fewest MIG leases first; a GPU with MIG off is never tried."""
    inventory = host(True, False, True)
    busy = Ledger((lease("a", record(0)),))
    allocation = allocate(ask("mig=1g.5gb", MigAsk(profile="1g.5gb")), inventory, policies(inventory), busy,
                          container_id="c", now=NOW)
    assert [g.index for g in allocation.to_make[0].candidates] == [2, 0]


def test_a_free_admin_instance_is_reused_and_a_held_one_is_not() -> None:
    """An admin's instance of the profile no lease holds is leased at once (by UUID); one that is held, or
    one gpuhook made that awaits destruction, is not."""
    admin, held, recycling = _admin(0, 1), _admin(0, 2, index=1), _admin(1, 1)
    inventory = host(True, True, migs=(admin, held, recycling))
    ledger = Ledger((lease("a", devices=(held.uuid,)),),
                    recycle=(replace(record(1), uuid=recycling.uuid),))
    one = allocate(ask("mig=3g.20gb", MigAsk(profile="3g.20gb", name="x")), inventory, policies(inventory), ledger,
                   container_id="c", now=NOW)
    assert one.devices == (admin.uuid,) and one.request.devices == (MigUuid(admin.uuid),) and not one.to_make
    assert one.migs == (MigRecord(gpu=_uuid(0), profile="3g.20gb", name="x", created=False, gi=1, ci=0,
                                  uuid=admin.uuid),)
    two = allocate(ask("mig=3g.20gb,mig=3g.20gb", MigAsk(profile="3g.20gb"), MigAsk(profile="3g.20gb")), inventory,
                   policies(inventory), ledger, container_id="c", now=NOW)
    assert two.devices == (admin.uuid,) and len(two.to_make) == 1  # one admin instance, one to make


def test_a_name_has_one_holder_per_gpu() -> None:
    """#instance1 held on GPU 0 by a: asked on GPU 0 it is refused naming a; asked anywhere, GPU 1 gets it."""
    inventory = host(True, True)
    ledger = Ledger((lease("a", record(0, name="instance1"), pid=7),))
    with pytest.raises(BusyError, match=r"'instance1' on GPU 0 is held by a \(pid 7, for 5s\).*another #NAME"):
        allocate(ask("0,mig=3g.20gb#instance1", MigAsk(profile="3g.20gb", name="instance1", gpu=GpuIndex(0))),
                 inventory, policies(inventory), ledger, container_id="c", now=NOW)
    anywhere = allocate(ask("mig=3g.20gb#instance1", MigAsk(profile="3g.20gb", name="instance1")), inventory,
                        policies(inventory), ledger, container_id="c", now=NOW)
    assert [g.index for g in anywhere.to_make[0].candidates] == [1]


def test_a_same_id_container_gets_an_instance_of_its_own_and_a_second_stage_keeps_its_made_one() -> None:
    """Issue 31: a made the 3g.20gb instance #instance1 (pid 7). Another container of id a (pid 8) is refused
    the name, naming a's pid, and unnamed gets an instance to make, never a's; a's own second start stage
    (pid 7 again) gets a's instance back, still gpuhook's: it is destroyed (recycled) when the lease ends."""
    made = record(0, name="instance1")
    inventory = with_recorded(host(True), (made,))
    first = lease("a", made, pid=7)
    ledger = Ledger((first,))
    other = Holder(pid=8, start=1008)
    with pytest.raises(BusyError, match=r"'instance1' on GPU 0 is held by a \(pid 7"):
        allocate(ask("0,mig=3g.20gb#instance1", MigAsk(profile="3g.20gb", name="instance1", gpu=GpuIndex(0))),
                 inventory, policies(inventory), ledger, container_id="a", holder=other, now=NOW)
    unnamed = allocate(ask("0,mig=3g.20gb", MigAsk(profile="3g.20gb", gpu=GpuIndex(0))), inventory,
                       policies(inventory), ledger, container_id="a", holder=other, now=NOW)
    assert unnamed.devices == () and len(unnamed.to_make) == 1

    again = allocate(ask("0,mig=3g.20gb#instance1", MigAsk(profile="3g.20gb", name="instance1", gpu=GpuIndex(0))),
                     inventory, policies(inventory), ledger, container_id="a", holder=first.holder, now=NOW)
    assert again.devices == (made.uuid,) and not again.to_make
    second = ledger.reserve(replace(first, devices=again.devices, migs=again.migs))
    assert second.leases[0].migs == (made,) and second.recycle == ()
    assert second.release("a", first.holder).recycle == (made,)


def test_an_exclusive_gpu_held_whole_makes_no_instance_for_another() -> None:
    inventory = host(True)
    ledger = Ledger((lease("a", devices=(_uuid(0),)),))
    with pytest.raises(BusyError, match=r"GPU 0 .* is exclusive, held by a .* as a whole GPU"):
        allocate(ask("0,mig=1g.5gb", MigAsk(profile="1g.5gb", gpu=GpuIndex(0))), inventory,
                 policies(inventory, GpuPolicy(sharing=Sharing.EXCLUSIVE)), ledger, container_id="c", now=NOW)


@pytest.mark.parametrize(("mig", "asked", "message"), [
    ((False, True), MigAsk(profile="3g.20gb", gpu=GpuIndex(0)),
     r"GPU 0 \(NVIDIA A100-SXM4-40GB, GPU-0+-.*\) is not in MIG mode: enable it with `nvidia-smi -i 0 -mig 1`; "
     r"this needs the GPU idle and, on some GPUs, a reset"),
    ((False, False), MigAsk(profile="3g.20gb"), r"no GPU of this host is in MIG mode .*nvidia-smi -i 0 -mig 1"),
    ((True,), MigAsk(profile="2g.10gb", gpu=GpuIndex(0)),
     r"no MIG profile '2g.10gb' here: GPU 0 \(NVIDIA A100-SXM4-40GB\) has 1g.5gb \(4.8 GiB, up to 7\), "
     r"3g.20gb \(19.5 GiB, up to 2\)"),
])
def test_mig_refusals_say_the_fix(mig: tuple[bool, ...], asked: MigAsk, message: str) -> None:
    inventory = host(*mig)
    with pytest.raises(PolicyError, match=message):
        allocate(ask(str(asked), asked), inventory, policies(inventory), Ledger(), container_id="c", now=NOW)


def test_a_policy_instance_turns_a_whole_gpu_into_an_instance() -> None:
    """MIGMode {Enable: true, Instance: 1g.5gb} on GPU 0: asking for GPU 0 asks for a 1g.5gb instance on it;
    GPU 1 (no such policy) is still given whole."""
    inventory = host(True, False)
    rules = {0: GpuPolicy(device="0", mig=MigMode(enable=True, instance="1g.5gb")), 1: GpuPolicy()}
    allocation = allocate(ask("0,1", devices=(GpuIndex(0), GpuIndex(1))), inventory, rules, Ledger(),
                          container_id="c", now=NOW)
    assert allocation.request.devices == (GpuIndex(1),) and allocation.devices == (_uuid(1),)
    assert [(p.ask.profile, p.ask.gpu) for p in allocation.to_make] == [("1g.5gb", GpuIndex(0))]


def test_free_starts_skip_every_overlap() -> None:
    """3g on 8 memory slices: starts 0 and 4 of size 4; a 1g at slice 5 takes start 4 away."""
    assert free_starts((0, 4), 4, ()) == (0, 4)
    assert free_starts((0, 4), 4, ((5, 1),)) == (0,)
    assert free_starts(tuple(range(7)), 1, ((0, 4), (4, 1))) == (5, 6)


def test_ending_a_lease_moves_only_what_gpuhook_made_to_recycle() -> None:
    """Release, reclaim and a second reservation all end a lease: its made instances go to recycle, an admin's
    is simply no longer held; recycled() forgets one once destroyed."""
    made, admin = record(0, gi=1), record(0, gi=2, created=False)
    ledger = Ledger((lease("a", made, admin),))
    after = ledger.release("a")
    assert after.leases == () and after.recycle == (made,)
    assert ledger.without(ledger.leases).recycle == (made,)
    assert ledger.reserve(lease("a")).recycle == (made,)
    assert after.recycled(made) == Ledger()


def test_record_mig_and_forget_mig_change_only_the_holders_lease() -> None:
    holder = Holder(pid=100, start=1100)
    intent = record(0, gi=None)
    ready = record(0, gi=3)
    ledger = Ledger((lease("a"),)).record_mig("a", holder, intent)
    assert ledger.leases[0].migs == (intent,) and ledger.leases[0].devices == ()
    ledger = ledger.record_mig("a", holder, ready, replacing=intent)
    assert ledger.leases[0].migs == (ready,) and ledger.leases[0].devices == (ready.uuid,)
    assert ledger.record_mig("a", Holder(pid=100, start=1), intent) == ledger  # another holder: unchanged
    assert ledger.forget_mig("a", holder, ready).leases[0].migs == ()


def test_records_round_trip_and_a_malformed_one_is_refused() -> None:
    ledger = Ledger((lease("a", record(0, gi=None), record(0, gi=3, name="n")),), recycle=(record(1, gi=4),))
    stored = json.loads(json.dumps(to_object(ledger)))
    assert from_object(stored, source="leases.json") == ledger
    stored["recycle"][0]["gi"] = "4"
    with pytest.raises(StateError, match="recycle list is malformed"):
        from_object(stored, source="leases.json")
    stored["recycle"] = [{"gpu": _uuid(0)}]
    with pytest.raises(StateError, match="recycle list is malformed"):
        from_object(stored, source="leases.json")


def test_recorded_instances_join_the_inventory_after_their_parents_others() -> None:
    """A made instance joins its parent's MIG devices (last); one in a GI an older entry names replaces it."""
    stale = _admin(0, 1)
    inventory = host(True, True, migs=(stale, _admin(1, 2)))
    made = record(0, gi=1)
    merged = with_recorded(inventory, (made, record(0, gi=None)))
    assert [(m.parent_index, m.uuid) for m in merged.mig_devices] == [(0, made.uuid), (1, _admin(1, 2).uuid)]
    assert merged.mig_devices[0].profile == "3g.20gb"
    assert with_recorded(inventory, ()) is inventory


def test_mig_mode_off_in_the_cache_is_asked_of_nvml_again() -> None:
    """MIG mode can be enabled without changing anything the cache's identity sees: an ask the cached
    inventory would refuse for MIG mode off (on its GPU, or on every GPU) sends the start to NVML first."""
    inventory = host(True, False)
    assert not mode_may_be_stale(ask("0,mig=1g.5gb", MigAsk(profile="1g.5gb", gpu=GpuIndex(0))), inventory)
    assert mode_may_be_stale(ask("1,mig=1g.5gb", MigAsk(profile="1g.5gb", gpu=GpuIndex(1))), inventory)
    assert not mode_may_be_stale(ask("mig=1g.5gb", MigAsk(profile="1g.5gb")), inventory)
    assert mode_may_be_stale(ask("mig=1g.5gb", MigAsk(profile="1g.5gb")), host(False, False))

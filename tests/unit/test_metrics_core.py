"""Issue 18's parts without a server: the counters read from the log, attribution, the job-mapping files."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from gpuhook.daemon.metrics import BUCKETS, LogCounters
from gpuhook.inventory import Gpu, Inventory, MigDevice
from gpuhook.provision import jobmap
from gpuhook.sharing.attribution import GpuProcess, usage_view
from gpuhook.sharing.ledger import Holder, Lease, Ledger, MigRecord
from gpuhook.sharing.policy import GpuPolicy, Sharing

UUIDS = [f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd" for i in range(3)]
MIG = "MIG-00000000-1111-2222-3333-444444444444"


def events(path: Path, *items: dict[str, object], partial: str = "") -> None:
    with path.open("a") as log:
        log.write("".join(json.dumps(item) + "\n" for item in items) + partial)


def test_counters_follow_the_log_a_line_at_a_time_and_start_over_after_a_rotation(tmp_path: Path) -> None:
    log = tmp_path / "gpuhook.log"
    events(log, {"event": "applied", "served_by": "gpuhookd", "total_ms": 31.0},
           {"event": "host_discovered", "cache": "hit"}, {"event": "host_discovered", "cache": "absent"},
           {"event": "host_discovered", "cache": "mig-changed"},
           {"event": "hook_failed", "served_by": "gpuhookd", "kind": "BusyError", "error": "GPU 0 is exclusive"},
           {"event": "hook_failed", "kind": "BusyError", "error": "GPU 1 is exclusive"},
           {"event": "hook_failed", "kind": "ApplyError", "error": "mount failed"},
           partial='{"event": "applied", "total_ms"')  # a line still being written
    counters = LogCounters(str(log))
    counters.update()
    assert counters.starts == {("ok", "gpuhookd", "yes"): 1, ("refused", "gpuhookd", "yes"): 1,
                               ("refused", "hook", "yes"): 1, ("error", "hook", "yes"): 1}
    assert counters.refusals == {"busy": 2}
    assert counters.cache == {"hit": 1, "miss": 1, "rebuild": 1}
    assert counters.duration_count == 1 and counters.buckets == [0, 0, 0] + [1] * (len(BUCKETS) - 3)
    with log.open("a") as rest:
        rest.write(': 150.0, "served_by": "hook"}\n')  # the partial line completed
    events(log, {"event": "no_gpu_requested", "served_by": "hook"})
    counters.update()
    assert counters.starts[("ok", "hook", "yes")] == 1 and counters.starts[("ok", "hook", "no")] == 1
    log.rename(tmp_path / "gpuhook.log.1")  # rotated: a new, shorter file
    events(log, {"event": "applied", "served_by": "hook", "total_ms": 12.0})
    counters.update()
    assert counters.starts[("ok", "hook", "yes")] == 2  # kept counting, from the new file's start


def test_a_failure_is_counted_by_its_own_reason_and_an_old_line_by_its_class(tmp_path: Path) -> None:
    """Issue #31: the event's ``reason`` decides, whatever its message says; a reason that is no refusal is an
    error; a line logged before events carried a reason is counted by its class, as before."""
    log = tmp_path / "gpuhook.log"
    events(log, {"event": "hook_failed", "kind": "MigNoRoomError", "reason": "mig_no_room", "error": "GPU 1 is full"},
           {"event": "hook_failed", "kind": "BusyError", "reason": "busy", "error": "no room for a 1g.5gb instance"},
           {"event": "hook_failed", "kind": "ApplyError", "reason": "apply", "error": "mount failed"},
           {"event": "hook_failed", "kind": "SpecError", "error": "no process.args"})
    counters = LogCounters(str(log))
    counters.update()
    assert counters.refusals == {"mig_no_room": 1, "busy": 1, "bad_spec": 1}
    assert counters.starts == {("refused", "hook", "yes"): 2, ("error", "hook", "yes"): 1, ("refused", "hook", "no"): 1}


def test_scrapes_at_once_count_every_line_of_a_growing_log_exactly_once(tmp_path: Path) -> None:
    """Issue #31: threads update the same counters at once while the log grows; the counts are exactly the lines
    written, and the copy a scrape got does not change under a later one."""
    log = tmp_path / "gpuhook.log"
    log.touch()
    counters, written, scrapers = LogCounters(str(log)), 3000, 8
    done = threading.Event()

    def scrape() -> None:
        while not done.is_set():
            counters.update()

    threads = [threading.Thread(target=scrape) for _ in range(scrapers)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(written // 10):
            events(log, *({"event": "applied", "served_by": "gpuhookd", "total_ms": 20.0 + n} for n in range(10)))
    finally:
        done.set()
        for thread in threads:
            thread.join()
    counters.update()
    assert counters.starts == {("ok", "gpuhookd", "yes"): written}
    assert counters.duration_count == written
    before = counters.update()
    events(log, {"event": "no_gpu_requested"})
    counters.update()
    assert before.starts == {("ok", "gpuhookd", "yes"): written}


def inventory() -> Inventory:
    gpus = tuple(Gpu(index=i, uuid=UUIDS[i], minor=i, pci_bus_id=f"00000000:1{i}:00.0", model="NVIDIA A100")
                 for i in range(3))
    return Inventory(driver_version="550.54.15", cuda_version="12.4", gpus=gpus, gpu_nodes=(), control_nodes=(),
                     libraries=(), binaries=(), firmware=(), ipc=(),
                     mig_devices=(MigDevice(parent_index=1, index=0, uuid=MIG, gi=1, ci=0, profile="3g.20gb"),))


def ledger() -> Ledger:
    made = MigRecord(gpu=UUIDS[1], profile="3g.20gb", name=None, created=True, gi=1, ci=0, uuid=MIG)
    return Ledger((Lease(container_id="a", devices=(UUIDS[0],), holder=Holder(pid=10, start=1), since="x"),
                   Lease(container_id="b", devices=(MIG,), holder=Holder(pid=20, start=1), since="x", migs=(made,))))


def test_attribution_names_each_lease_its_gpu_and_memory_by_cgroup() -> None:
    policies = {0: GpuPolicy(sharing=Sharing.EXCLUSIVE), 1: GpuPolicy(), 2: GpuPolicy(sharing=Sharing.MPS, replicas=2)}
    processes = (GpuProcess(gpu=0, pid=11, used_bytes=5, cgroup="/docker/a-id/worker"),
                 GpuProcess(gpu=0, pid=12, used_bytes=7, cgroup="/docker/a-id"),
                 GpuProcess(gpu=1, pid=21, used_bytes=3, cgroup="/docker/b-id"),
                 GpuProcess(gpu=2, pid=99, used_bytes=1, cgroup="/docker/a-idle"))  # a prefix, not a child
    view = usage_view(inventory(), policies, ledger(), mps_up={}, processes=processes,
                      holder_cgroups={"a": "/docker/a-id", "b": "/docker/b-id"})
    assert [(g.index, g.sharing, g.holders, g.mps_up) for g in view.gpus] == [
        (0, "exclusive", ("a",), None), (1, "unlimited", ("b",), None), (2, "mps", (), False)]
    assert [(d.container_id, d.gpu, d.mig_uuid) for d in view.leases] == [("a", 0, ""), ("b", 1, MIG)]
    assert view.mig_instances == {(1, "3g.20gb", True): 1}
    assert view.memory == {("a", 0): 12, ("b", 1): 3}


def test_job_mapping_files_hold_exactly_the_holders(tmp_path: Path) -> None:
    """One file per held GPU index (a MIG device counts for its parent), none for the others; a stale one
    goes, a file that is not a GPU index stays."""
    directory = tmp_path / "jobs"
    directory.mkdir()
    (directory / "2").write_text("gone\n")
    (directory / "README").write_text("not ours\n")
    parents = {u.casefold(): i for i, u in enumerate(UUIDS)} | {MIG.casefold(): 1}
    jobmap.write(directory, ledger(), parents)
    assert {p.name: p.read_text() for p in directory.iterdir()} == {"0": "a\n", "1": "b\n", "README": "not ours\n"}
    jobmap.write(directory, ledger().release("a").release("b"), parents)
    assert sorted(p.name for p in directory.iterdir()) == ["README"]

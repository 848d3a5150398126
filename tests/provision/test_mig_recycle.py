"""Issue 16's provisioning part against the simulated host's NVML: what ``provision.mig.recycle`` destroys.

The recycle list is where every MIG instance gpuhook made goes when its lease ends, and where a crash
leaves it: a record with ids, or one with only the placement it was to be made at. Each scenario runs
in a fresh interpreter (one process binds one host's libnvidia-ml), on an A100-40GB in MIG mode.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from integration.fakehost import FakeHost, create_host

REPO = Path(__file__).resolve().parents[2]

_PRELUDE = '''
import json, sys
from pathlib import Path
from gpuhook.nvml import mig as nvml_mig
from gpuhook.nvml.facts import gi_profiles
from gpuhook.nvml.session import session
from gpuhook.provision import ledger_store
from gpuhook.provision.mig import recycle
from gpuhook.sharing.ledger import Holder, Lease, Ledger, MigRecord, MigState

library, state_dir, gpu = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
out = {}

def make(name, start):
    with session(library):
        handle = nvml_mig.gpu(gpu)
        profile = next(p for p in gi_profiles(0, handle) if p.name == name)
        size = nvml_mig.placements(handle, profile.profile_id)[0][1]
        return profile, nvml_mig.make(handle, profile, start, size)

def layout():
    with session(library):
        handle = nvml_mig.gpu(gpu)
        ids = [p.profile_id for p in gi_profiles(0, handle)]
        return sorted([g.gi, g.start] for g in nvml_mig.gpu_instances(handle, ids))

def write(ledger):
    ledger_store.update(state_dir, lambda _old: (ledger, None))
'''


def run(host: FakeHost, state_dir: Path, body: str) -> dict[str, Any]:
    script = _PRELUDE + textwrap.dedent(body) + "\nprint(json.dumps(out))\n"
    proc = subprocess.run([sys.executable, "-c", script, str(host.nvml_library), str(state_dir), host.gpus[0].uuid],
                          capture_output=True, text=True, check=False, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_recycle_destroys_by_ids_or_placement_and_spares_a_recorded_gi(tmp_path: Path) -> None:
    """Four records to recycle: one with ids (destroyed, CI then GI), one with only a placement whose GI was
    made before the crash (found there, destroyed), one whose GI a live lease now records (a later start's in
    its place: spared), one whose GI is gone already (forgotten). The list ends empty."""
    host = create_host(tmp_path / "host", gpus=1, model="NVIDIA A100-SXM4-40GB", mig={0: ()})
    out = run(host, tmp_path / "state", '''
        p3, by_ids = make("3g.20gb", 0)                # GI 1 at slice 0
        p1, by_place = make("1g.5gb", 4)               # GI at slice 4: its record never got ids
        _, live = make("1g.5gb", 5)                    # a running container's
        base = dict(gpu=gpu, name=None, created=True)
        ids = MigRecord(profile="3g.20gb", profile_id=p3.profile_id, placement=0, gi=by_ids.gi, ci=by_ids.ci,
                        uuid=by_ids.uuid, **base)
        placed = MigRecord(profile="1g.5gb", profile_id=p1.profile_id, placement=4, state=MigState.CREATING, **base)
        stale = MigRecord(profile="1g.5gb", profile_id=p1.profile_id, placement=5, gi=live.gi, ci=0, uuid="MIG-old",
                          **base)
        gone = MigRecord(profile="1g.5gb", profile_id=p1.profile_id, placement=6, gi=14, ci=0, uuid="MIG-gone", **base)
        held = MigRecord(profile="1g.5gb", profile_id=p1.profile_id, placement=5, gi=live.gi, ci=0, uuid=live.uuid,
                         **base)
        lease = Lease(container_id="running", devices=(live.uuid,), holder=Holder(pid=1, start=1), since="x",
                      migs=(held,))
        write(Ledger((lease,), (ids, placed, stale, gone)))
        out["before"] = layout()
        destroyed, failed = recycle(state_dir, library)
        out["destroyed"] = sorted(r.placement for r in destroyed)
        out["failed"] = [why for _, why in failed]
        out["after"] = layout()
        out["live_start"] = 5
        left = ledger_store.read(state_dir)
        out["recycle"] = len(left.recycle)
        out["leases"] = [lease.container_id for lease in left.leases]
    ''')
    assert len(out["before"]) == 3
    assert out["destroyed"] == [0, 4] and out["failed"] == []
    assert [start for _gi, start in out["after"]] == [5]  # only the running container's instance is left
    assert out["recycle"] == 0 and out["leases"] == ["running"]

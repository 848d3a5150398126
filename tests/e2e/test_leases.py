"""Issue 15: per-GPU sharing policy and leases, with real runc containers that keep running.

Each container here runs detached (``runc run -d``) and sleeps, so it holds its GPUs while the test
starts others; gpuhook is its prestart and (unless a test says otherwise) its poststop hook. Every
test has a policy and a ledger (``state_dir``) of its own, and force-deletes what it started. A
container writes the GPU nodes it sees (``ls /dev``) into a host directory bind-mounted at ``/out``:
what it really got, checked beside the ledger and ``gpuhook status``.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from integration.engines import default_spec, leftover_cgroups, require_tool, unique_id, write_bundle
from integration.fakehost import FakeHost
from integration.gpuhookd import Gpuhookd
from integration.rootfs import copy_rootfs

from tests.conftest import readable_host

from .conftest import hook_entry, relay_entry
from .test_relay import run_relay

GPU0 = {"NVIDIA_VISIBLE_DEVICES": "0"}
ANY = {"NVIDIA_VISIBLE_DEVICES": "any"}
COUNT2 = {"NVIDIA_VISIBLE_DEVICES": "count=2"}
#: Writes the container's /dev listing to /out/dev (whole, by rename), then holds its GPUs until killed.
SLEEPER = "ls /dev > /out/.dev && mv /out/.dev /out/dev && exec sleep 1000"
WAIT_S = 30.0
#: The issue says a lease is gone "within a second" of its holder's exit with gpuhookd; a busy CI machine gets 5.
DAEMON_RELEASE_BOUND_S = 5.0
SINCE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")
_NODE = re.compile(r"nvidia(\d+)")


def wait_for(what: str, check: Callable[[], bool], timeout: float = WAIT_S) -> float:
    """Poll *check* until it holds; the seconds it took. Fails naming *what* after *timeout*."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not so after {timeout:g} s")
        time.sleep(0.01)
    return time.monotonic() - start


#: runc's state root when none is given (root's): another ``--root`` is another runc, with ids of its own.
RUNC_ROOT = Path("/run/runc")


@dataclass(frozen=True, slots=True)
class Bundle:
    """One prepared container: its id, its bundle dir, the host dir it sees as /out, and the runc --root it is
    started under (None: runc's own)."""

    id: str
    path: Path
    out: Path
    root: Path | None = None


@dataclass(frozen=True, slots=True)
class Started:
    """What ``runc run -d`` said: its exit status and its stderr (gpuhook's refusal, if any)."""

    bundle: Bundle
    returncode: int
    stderr: str

    @property
    def id(self) -> str:
        """The container id."""
        return self.bundle.id


class Site:
    """One test's policy on a simulated host: its config and ledger, and every container it started."""

    def __init__(self, tmp: Path, host: FakeHost, rootfs_src: Path, gpus: Sequence[Mapping[str, Any]]) -> None:
        self.tmp = tmp
        tmp.mkdir()
        self.host = host
        self.rootfs_src = rootfs_src
        self.state_dir = tmp / "state"
        self.config = host.write_config(tmp / "gpuhook.yaml", state_dir=self.state_dir, gpus=gpus)
        self.runc = require_tool("runc")
        self.started_bundles: list[Bundle] = []
        self._count = 0
        self._by_uuid = {gpu.uuid.casefold(): gpu.index for gpu in host.gpus}
        self._by_minor = {gpu.minor: gpu.index for gpu in host.gpus}

    # -- containers ----------------------------------------------------------------------------------

    def bundle(self, env: Mapping[str, str], *, poststop: bool = True, prestart: dict[str, Any] | None = None,
               create_runtime: dict[str, Any] | None = None, script: str = SLEEPER) -> Bundle:
        """A sleeping container asking for *env*, gpuhook its prestart hook (and poststop hook, unless not;
        *create_runtime*: a createRuntime hook too); *script*: what it runs (it must end sleeping, and write
        /out/dev last)."""
        self._count += 1
        path = self.tmp / f"bundle{self._count}"
        out = self.tmp / f"out{self._count}"
        out.mkdir()
        copy_rootfs(self.rootfs_src, path / "rootfs")
        hooks: dict[str, Any] = {"prestart": [prestart or hook_entry(self.config, "prestart")]}
        if create_runtime:
            hooks["createRuntime"] = [create_runtime]
        if poststop:
            hooks["poststop"] = [hook_entry(self.config, "poststop")]
        spec = default_spec("rootfs", ["/bin/sh", "-c", script],
                            ["PATH=/usr/local/bin:/usr/bin:/bin", *(f"{k}={v}" for k, v in env.items())],
                            hooks=hooks, capabilities=["CAP_MKNOD"])
        spec["mounts"].append({"destination": "/out", "type": "bind", "source": str(out), "options": ["rbind", "rw"]})
        write_bundle(path, spec)
        return Bundle(id=unique_id("lease"), path=path, out=out)

    def start(self, bundle: Bundle) -> Started:
        """``runc run -d``: the container left running (or refused). Its stdio are files, never our pipes:
        the sleeping container would hold a pipe open, and nobody would see its end."""
        self.started_bundles.append(bundle)
        err = bundle.path / "runc.err"
        with err.open("w+b") as stderr:
            proc = subprocess.run([*self._runc(bundle.root), "run", "-d", "--bundle", str(bundle.path), bundle.id],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
                                  timeout=WAIT_S * 2, check=False)
        return Started(bundle, proc.returncode, err.read_text(errors="replace"))

    def run(self, env: Mapping[str, str], *, poststop: bool = True,
            prestart: dict[str, Any] | None = None, script: str = SLEEPER) -> Started:
        """A new container asking for *env*, started."""
        return self.start(self.bundle(env, poststop=poststop, prestart=prestart, script=script))

    def runc_cmd(self, *args: str, root: Path | None = None) -> subprocess.CompletedProcess[str]:
        """``runc [--root ROOT] ARGS``, its output captured (for commands that start no container)."""
        return subprocess.run([*self._runc(root), *args], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=WAIT_S, check=False)

    def _runc(self, root: Path | None) -> list[str]:
        return [self.runc, "--root", str(root)] if root is not None else [self.runc]

    def state(self, container_id: str, *, root: Path | None = None) -> dict[str, Any] | None:
        """``runc state``: the container's status and init pid; None if runc knows no such container."""
        proc = self.runc_cmd("state", container_id, root=root)
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    def delete(self, container_id: str, *, root: Path | None = None) -> None:
        """``runc delete --force``: kill it, and run its poststop hooks."""
        proc = self.runc_cmd("delete", "--force", container_id, root=root)
        assert proc.returncode == 0, proc.stderr

    def kill(self, container_id: str) -> None:
        """``runc kill ID KILL``: its init dies; runc runs no hook; wait until runc sees it stopped."""
        proc = self.runc_cmd("kill", container_id, "KILL")
        assert proc.returncode == 0, proc.stderr
        wait_for(f"{container_id} stopped", lambda: (self.state(container_id) or {}).get("status") == "stopped")

    def cleanup(self) -> None:
        """Force-delete every container this site started; none may be left."""
        for bundle in self.started_bundles:
            if Path(bundle.root or RUNC_ROOT, bundle.id).exists():
                self.runc_cmd("delete", "--force", bundle.id, root=bundle.root)
        left = [b.id for b in self.started_bundles if Path(b.root or RUNC_ROOT, b.id).exists()]
        assert not left, f"runc delete --force left {left}"

    # -- what the containers and gpuhook say ----------------------------------------------------------

    def started(self, started: Started) -> set[int]:
        """*started* runs: the GPU indexes whose /dev/nvidiaN nodes it sees."""
        assert started.returncode == 0, started.stderr
        listing = started.bundle.out / "dev"
        wait_for(f"{started.id} wrote its /dev listing", listing.exists)
        return {self._by_minor[int(m[1])] for name in listing.read_text().split() if (m := _NODE.fullmatch(name))}

    def refused(self, started: Started, *needles: str) -> None:
        """*started* was refused with a gpuhook message holding every needle, and left nothing behind."""
        assert started.returncode != 0, f"{started.id} started, expected a refusal"
        assert "gpuhook: " in started.stderr and "Traceback" not in started.stderr, started.stderr
        for needle in needles:
            assert needle in started.stderr, f"{needle!r} not in runc's error:\n{started.stderr}"
        assert not list(started.bundle.out.iterdir()), "the refused container's process ran"
        root = started.bundle.root
        assert self.state(started.id, root=root) is None and not Path(root or RUNC_ROOT, started.id).exists()
        assert started.id not in self.holders(), self.leases()

    def pid(self, container_id: str, *, root: Path | None = None) -> int:
        """The container's init pid, as runc knows it."""
        state = self.state(container_id, root=root)
        assert state is not None, f"runc knows no {container_id}"
        return int(state["pid"])

    def leases(self) -> list[dict[str, Any]]:
        """The leases in ``<state_dir>/leases.json``, as stored (read directly: nothing is reclaimed)."""
        path = self.state_dir / "leases.json"
        if not path.exists():
            return []
        leases: list[dict[str, Any]] = json.loads(path.read_text())["leases"]
        return leases

    def holders(self) -> dict[str, set[int]]:
        """Container id → the GPU indexes its lease holds (a MIG instance's parent for it), from the ledger file."""
        def gpu(lease: dict[str, Any], device: str) -> int:
            parent = next((r["gpu"] for r in lease.get("migs", ()) if r["uuid"] == device), device)
            return self._by_uuid[parent.casefold()]

        return {lease["container_id"]: {gpu(lease, d) for d in lease["devices"]} for lease in self.leases()}

    def gpuhook(self, *args: str) -> subprocess.CompletedProcess[str]:
        """``gpuhook --config CONFIG ARGS`` (as root, as an admin runs it)."""
        return subprocess.run([sys.executable, "-I", "-m", "gpuhook", "--config", str(self.config), *args],
                              capture_output=True, text=True, timeout=WAIT_S, check=False, cwd="/")

    def status(self) -> dict[str, Any]:
        """``gpuhook status --json``."""
        proc = self.gpuhook("status", "--json")
        assert proc.returncode == 0, proc.stderr
        data: dict[str, Any] = json.loads(proc.stdout)
        return data

    def metric_samples(self) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
        """``gpuhook status --prometheus``'s samples: (name, sorted labels, value) each, in their order."""
        from prometheus_client.parser import text_string_to_metric_families

        proc = self.gpuhook("status", "--prometheus")
        assert proc.returncode == 0, proc.stderr
        return [(s.name, tuple(sorted(s.labels.items())), s.value)
                for family in text_string_to_metric_families(proc.stdout) for s in family.samples]

    def status_holders(self) -> dict[str, set[int]]:
        """Container id → the GPU indexes ``gpuhook status --json`` lists it as a holder of."""
        out: dict[str, set[int]] = {}
        for gpu in self.status()["gpus"]:
            for holder in gpu["holders"]:
                out.setdefault(holder["container_id"], set()).add(gpu["index"])
        return out


MakeSite = Callable[..., Site]


def same_id(bundle: Bundle, as_of: Started, root: Path) -> Bundle:
    """*bundle*, to be started with *as_of*'s id under the runc root *root*: another runc's container of that id."""
    return replace(bundle, id=as_of.id, root=root)


def run_poststop(site: Site, container_id: str, bundle: Bundle) -> None:
    """gpuhook's poststop, as registered, for the state a runtime gives it then (id and bundle, no pid)."""
    entry = hook_entry(site.config, "poststop")
    state = {"ociVersion": "1.0.2", "id": container_id, "status": "stopped", "bundle": str(bundle.path)}
    proc = subprocess.run(entry["args"], input=json.dumps(state), capture_output=True, text=True, timeout=WAIT_S,
                          env=dict(item.split("=", 1) for item in entry["env"]), check=False, cwd="/")
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr


@pytest.fixture(scope="module")
def host8(tmp_path_factory: pytest.TempPathFactory) -> FakeHost:
    """A simulated 8-GPU host; world-readable so unprivileged commands can read it."""
    return readable_host(tmp_path_factory, "fakehost8", gpus=8)


@pytest.fixture
def make_site(tmp_path: Path, rootfs_src: Path) -> Iterator[MakeSite]:
    """``make_site(host, gpus)``: a Site with the policy *gpus* (the ``gpus:`` list); its containers are
    force-deleted after the test."""
    sites: list[Site] = []

    def make(host: FakeHost, gpus: Sequence[Mapping[str, Any]] = ()) -> Site:
        site = Site(tmp_path / f"site{len(sites)}", host, rootfs_src, gpus)
        sites.append(site)
        return site

    try:
        yield make
    finally:
        for site in sites:
            site.cleanup()


EXCLUSIVE0 = [{"device": 0, "sharing": "exclusive"}]
ALL_EXCLUSIVE = [{"device": "all", "sharing": "exclusive"}]


def test_exclusive_gpu_is_refused_while_held_and_free_after_delete(make_site: MakeSite, host8: FakeHost) -> None:
    """GPU 0 exclusive: A holds it while it runs; B's start for GPU 0 is refused naming A (and leaves no
    lease); once `runc delete --force A` has run A's poststop, B starts on GPU 0."""
    site = make_site(host8, EXCLUSIVE0)
    a = site.run(GPU0)
    assert site.started(a) == {0}
    assert site.holders() == {a.id: {0}}
    b = site.bundle(GPU0)
    site.refused(site.start(b), a.id, "GPU 0", "exclusive", "gpuhook release")
    assert site.holders() == {a.id: {0}}
    site.delete(a.id)
    assert site.holders() == {}  # the poststop released it, before runc delete returned
    again = site.start(b)
    assert site.started(again) == {0}
    assert site.holders() == {b.id: {0}}


def test_killed_holder_without_poststop_is_reclaimed_by_the_next_start(make_site: MakeSite, host8: FakeHost) -> None:
    """A registered without poststop and no gpuhookd: `runc kill A KILL` leaves its lease in the ledger; B's
    start for GPU 0 finds A's holder gone, reclaims the lease and starts."""
    site = make_site(host8, EXCLUSIVE0)
    a = site.run(GPU0, poststop=False)
    assert site.started(a) == {0}
    site.kill(a.id)
    assert site.holders() == {a.id: {0}}  # nobody released it: no poststop, no gpuhookd
    b = site.run(GPU0, poststop=False)
    assert site.started(b) == {0}, b.stderr
    assert site.holders() == {b.id: {0}}
    assert site.leases()[0]["pid"] == site.pid(b.id)


@pytest.mark.parametrize("via", ["daemon-socket", "relay"])
def test_gpuhookd_releases_a_lease_when_its_holder_exits(make_site: MakeSite, host8: FakeHost, relay: Path,
                                                          via: str) -> None:
    """gpuhookd serving the config (the hook handing it the start, or gpuhook-relay), A registered without
    poststop (as docker --gpus registers it): A's lease is gone by itself within a second of A's exit (5 s
    allowed on a busy machine), with nobody calling `gpuhook status` or starting another container."""
    site = make_site(host8, EXCLUSIVE0)
    daemon = Gpuhookd(sys.executable, site.tmp / "gpuhookd", config=site.config)
    try:
        argv = ("--daemon-socket", daemon.socket, "prestart")
        prestart = hook_entry(site.config, *argv) if via == "daemon-socket" else relay_entry(relay, site.config, *argv)
        a = site.run(GPU0, poststop=False, prestart=prestart)
        assert site.started(a) == {0}
        assert site.holders() == {a.id: {0}}
        served = [json.loads(line) for line in (host8.root / "gpuhook.log").read_text().splitlines() if a.id in line]
        assert any(e.get("event") == "applied" and e.get("served_by") == "gpuhookd" for e in served), served
        start = time.monotonic()
        proc = site.runc_cmd("kill", a.id, "KILL")
        assert proc.returncode == 0, proc.stderr
        wait_for(f"gpuhookd released {a.id}'s lease", lambda: a.id not in site.holders())
        took = time.monotonic() - start
        print(f"gpuhookd released the lease {took * 1000:.0f} ms after `runc kill` ({via})")
        assert took < DAEMON_RELEASE_BOUND_S, f"the lease went {took:.2f} s after the kill"
        assert site.leases() == []
    finally:
        journal = daemon.stop()
    assert "request failed" not in journal and "Traceback" not in journal, journal


def test_a_relayed_poststop_reads_the_ledger_before_it_skips(make_site: MakeSite, host8: FakeHost, relay: Path) -> None:
    """The relay answers a poststop no lease names itself, from one read of the ledger (the Python hook's fast
    path, relay/answers.h); one the ledger names goes to gpuhookd and the whole way: A, still running, keeps
    its lease (`lease_kept`), and B, never
    started, gets no event at all."""
    site = make_site(host8, EXCLUSIVE0)
    daemon = Gpuhookd(sys.executable, site.tmp / "gpuhookd", config=site.config)
    try:
        argv = ("--daemon-socket", daemon.socket)
        a = site.run(GPU0, poststop=False, prestart=relay_entry(relay, site.config, *argv, "prestart"))
        assert site.holders() == {a.id: {0}}
        offset = (host8.root / "gpuhook.log").stat().st_size
        for container_id in (a.id, "never-started-b"):
            stop = run_relay(relay, "--config", str(site.config), *argv, "poststop",
                             state=json.dumps({"ociVersion": "1.0.2", "id": container_id, "status": "stopped",
                                               "bundle": str(site.tmp)}))
            assert (stop.returncode, stop.stderr) == (0, "")
        with (host8.root / "gpuhook.log").open() as log:
            log.seek(offset)
            events = [json.loads(line) for line in log if line.strip()]
        assert [(e["event"], e.get("container_id"), e.get("served_by")) for e in events] == [
            ("lease_kept", a.id, "gpuhookd")], events
        assert site.holders() == {a.id: {0}}
        assert site.runc_cmd("kill", a.id, "KILL").returncode == 0
    finally:
        journal = daemon.stop()
    assert "request failed" not in journal and "Traceback" not in journal, journal


def test_shared_gpu_takes_replicas_containers(make_site: MakeSite, host8: FakeHost) -> None:
    """GPU 0 shared with replicas 2: A and B start on it, C is refused naming both, and starts once A ends."""
    site = make_site(host8, [{"device": 0, "sharing": "shared", "replicas": 2}])
    a, b = site.run(GPU0), site.run(GPU0)
    assert site.started(a) == site.started(b) == {0}
    c = site.bundle(GPU0)
    site.refused(site.start(c), a.id, b.id, "shared")
    assert site.holders() == {a.id: {0}, b.id: {0}}
    site.delete(a.id)
    assert site.started(site.start(c)) == {0}
    assert site.holders() == {b.id: {0}, c.id: {0}}


def test_count_takes_free_gpus_all_or_nothing(make_site: MakeSite, host: FakeHost) -> None:
    """count=2 on 4 exclusive GPUs: A gets 0 and 1, B 2 and 3 (disjoint, as they see and as the ledger says);
    C is refused (none free), and nothing of it is leased."""
    site = make_site(host, ALL_EXCLUSIVE)
    a, b = site.run(COUNT2), site.run(COUNT2)
    assert site.started(a) == {0, 1}
    assert site.started(b) == {2, 3}
    assert site.holders() == {a.id: {0, 1}, b.id: {2, 3}}
    site.refused(site.run(COUNT2), "count=2", "2 GPUs asked, 0 of 4 free", a.id, b.id)
    site.delete(b.id)
    c = site.run(COUNT2)
    assert site.started(c) == {2, 3}
    assert site.holders() == {a.id: {0, 1}, c.id: {2, 3}}


def test_any_picks_the_least_leased_gpu(make_site: MakeSite, host: FakeHost) -> None:
    """Unlimited GPUs (NVIDIA's default) are leased too, and `any` takes the least held one, then the lowest
    index: with GPU 0 held twice and GPU 1 once, `any` gets 2, then 3, then 1 (not 0)."""
    site = make_site(host)
    held = [site.run({"NVIDIA_VISIBLE_DEVICES": "0,1"}), site.run(GPU0)]
    assert [site.started(s) for s in held] == [{0, 1}, {0}]
    picked = []
    for _ in range(3):
        started = site.run(ANY)
        picked.append(site.started(started))
        assert site.holders()[started.id] == picked[-1]
    assert picked == [{2}, {3}, {1}]


def test_fifty_concurrent_starts_on_eight_exclusive_gpus(make_site: MakeSite, host8: FakeHost) -> None:
    """50 containers asking for `any`, started 16 at a time, on 8 exclusive GPUs: exactly 8 run, each on a
    GPU of its own (as each sees it, and as the ledger says); the 42 others are refused with the busy
    message and leave no runc state, cgroup or lease; once all are deleted the ledger is empty."""
    site = make_site(host8, ALL_EXCLUSIVE)
    bundles = [site.bundle(ANY) for _ in range(50)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        results = list(pool.map(site.start, bundles))
    running = [r for r in results if r.returncode == 0]
    refused = [r for r in results if r.returncode != 0]
    assert len(running) == 8, [r.stderr for r in refused if "0 of 8 free" not in r.stderr][:3]
    seen = {r.id: site.started(r) for r in running}
    assert all(len(gpus) == 1 for gpus in seen.values()), seen
    assert sorted(next(iter(gpus)) for gpus in seen.values()) == list(range(8)), seen  # no two share one
    assert site.holders() == seen
    assert {lease["container_id"]: lease["pid"] for lease in site.leases()} == {r.id: site.pid(r.id) for r in running}
    assert all(lease["state"] == "active" for lease in site.leases())
    for r in refused:
        site.refused(r, "NVIDIA_VISIBLE_DEVICES='any'", "1 GPU asked, 0 of 8 free")
        assert not leftover_cgroups(r.id), r.id
    for r in running:
        site.delete(r.id)
    assert site.leases() == []
    assert site.status_holders() == {}


def test_status_names_the_holder_while_it_runs(make_site: MakeSite, host8: FakeHost) -> None:
    """`gpuhook status` (JSON and table) shows A, with its init pid and since when, as GPU 0's only holder
    while A runs, every other GPU free; after `runc delete` no GPU has a holder."""
    site = make_site(host8, EXCLUSIVE0)
    a = site.run(GPU0)
    assert site.started(a) == {0}
    gpus = site.status()["gpus"]
    assert [g["index"] for g in gpus] == list(range(8))
    first = gpus[0]
    assert (first["uuid"], first["sharing"], first["replicas"]) == (host8.gpus[0].uuid, "exclusive", None)
    assert first["model"] == host8.gpus[0].name and first["pci_bus_id"]
    [holder] = first["holders"]
    assert (holder["container_id"], holder["pid"], holder["state"], holder["whole_gpu"], holder["mig_uuids"]) == (
        a.id, site.pid(a.id), "active", True, [])
    assert SINCE.fullmatch(holder["since"]), holder
    assert all(g["holders"] == [] and g["sharing"] == "unlimited" for g in gpus[1:]), gpus[1:]
    table = site.gpuhook("status")
    assert table.returncode == 0, table.stderr
    rows = table.stdout.splitlines()
    assert rows[0].split()[:2] == ["GPU", "UUID"]
    row0 = next(r for r in rows[1:] if r.split()[0] == "0")
    assert a.id in row0 and host8.gpus[0].uuid in row0 and "exclusive" in row0 and f"pid {site.pid(a.id)}" in row0
    assert sum(a.id in r for r in rows) == 1, table.stdout
    site.delete(a.id)
    assert all(g["holders"] == [] for g in site.status()["gpus"])
    after = site.gpuhook("status")
    assert after.returncode == 0 and a.id not in after.stdout, after.stdout


def test_release_by_hand_frees_a_running_holder(make_site: MakeSite, host8: FakeHost) -> None:
    """A refused start leaves the ledger as it was; `gpuhook release A` drops A's lease though A still runs,
    and then B starts on GPU 0; releasing it again is refused, naming the container."""
    site = make_site(host8, EXCLUSIVE0)
    a = site.run(GPU0)
    assert site.started(a) == {0}
    before = site.leases()
    b = site.bundle(GPU0)
    site.refused(site.start(b), a.id)
    assert site.leases() == before
    released = site.gpuhook("release", a.id)
    assert released.returncode == 0, released.stderr
    assert a.id in released.stdout and host8.gpus[0].uuid in released.stdout, released.stdout
    assert site.holders() == {}
    assert (site.state(a.id) or {}).get("status") == "running"
    assert site.started(site.start(b)) == {0}
    assert site.holders() == {b.id: {0}}
    again = site.gpuhook("release", a.id)
    assert again.returncode != 0 and a.id in again.stderr and "holds no lease" in again.stderr, again
    assert "Traceback" not in again.stderr
    site.delete(a.id)  # A's poststop: it holds no lease, and B's is not touched
    assert site.holders() == {b.id: {0}}



def test_a_same_id_container_under_another_runc_root_is_refused_the_held_gpu(make_site: MakeSite,
                                                                              host8: FakeHost) -> None:
    """Issue 31: while A holds exclusive GPU 0, runc --root R2 starts B with A's id (another runc: another
    container, another init): B is refused naming A and its pid, and A's lease stays as it was; B's poststop
    (run once more here as a runtime that runs it late would, with B's bundle and no pid) leaves A's lease;
    a third container is refused GPU 0 still, and A's delete frees it."""
    site = make_site(host8, EXCLUSIVE0)
    a = site.run(GPU0)
    assert site.started(a) == {0}
    before = site.leases()
    b = site.start(same_id(site.bundle(GPU0), a, site.tmp / "runc2"))
    assert b.returncode != 0 and f"held by {a.id} (pid {site.pid(a.id)}," in b.stderr, b.stderr
    assert "Traceback" not in b.stderr and not list(b.bundle.out.iterdir()), b.stderr
    assert site.state(a.id, root=b.bundle.root) is None
    assert site.leases() == before
    run_poststop(site, a.id, b.bundle)
    assert site.leases() == before
    site.refused(site.run(GPU0), a.id, "exclusive")
    site.delete(a.id)
    assert site.leases() == []


def test_two_running_containers_of_one_id_hold_a_lease_each(make_site: MakeSite, host8: FakeHost) -> None:
    """Issue 31: GPU 0 shared by 2: A, and B with A's id under another runc root, both run on it, each with a
    lease of its own (its own init pid), both listed by `gpuhook status`, and a third container is refused;
    B's delete (its poststop) releases B's lease only, and the third then takes B's place."""
    site = make_site(host8, [{"device": 0, "sharing": "shared", "replicas": 2}])
    a = site.run(GPU0)
    b = site.start(same_id(site.bundle(GPU0), a, site.tmp / "runc2"))
    assert site.started(a) == site.started(b) == {0}
    a_pid, b_pid = site.pid(a.id), site.pid(a.id, root=b.bundle.root)
    assert a_pid != b_pid
    assert sorted((lease["container_id"], lease["pid"]) for lease in site.leases()) == sorted(
        [(a.id, a_pid), (a.id, b_pid)])
    [gpu0] = [gpu for gpu in site.status()["gpus"] if gpu["index"] == 0]
    assert sorted((h["container_id"], h["pid"]) for h in gpu0["holders"]) == sorted([(a.id, a_pid), (a.id, b_pid)])
    # the metrics: one sample per label set (Prometheus refuses a scrape with two), each container counted
    samples = site.metric_samples()
    labelled = [(name, labels) for name, labels, _ in samples]
    assert len(labelled) == len(set(labelled)), samples
    values = {(name, labels): value for name, labels, value in samples}
    assert values[("gpuhook_container_gpu_info", (("container_id", a.id), ("gpu", "0"), ("mig_uuid", ""),
                                                 ("uuid", host8.gpus[0].uuid)))] == 2
    assert values[("gpuhook_gpu_holders", (("gpu", "0"), ("uuid", host8.gpus[0].uuid)))] == 2
    c = site.bundle(GPU0)
    site.refused(site.start(c), f"{a.id} (pid {a_pid},", f"{a.id} (pid {b_pid},", "shared")
    site.delete(a.id, root=b.bundle.root)
    assert [(lease["container_id"], lease["pid"]) for lease in site.leases()] == [(a.id, a_pid)]
    assert site.started(site.start(c)) == {0}
    assert site.holders() == {a.id: {0}, c.id: {0}}
    site.delete(a.id)
    assert site.holders() == {c.id: {0}}


def test_a_request_of_60000_entries_is_refused_without_the_ledger_lock(make_site: MakeSite, host8: FakeHost) -> None:
    """Issue 31: NVIDIA_VISIBLE_DEVICES with 60,000 mig= entries is refused in one short line naming the limit
    while another process holds the ledger's lock the whole time: the refusal came before any lock (a start
    that took it would wait until runc gave up)."""
    site = make_site(host8)
    site.state_dir.mkdir(mode=0o700)
    lock = os.open(site.state_dir / "leases.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        started = site.run({"NVIDIA_VISIBLE_DEVICES": "0," + ",".join(["mig=1g.5gb"] * 60_000)})
    finally:
        os.close(lock)
    site.refused(started, "NVIDIA_VISIBLE_DEVICES has 60001 comma-separated entries", "the limit is 256")
    assert len(started.stderr) < 2000, started.stderr[:2000]
    assert site.started(site.run(GPU0)) == {0}

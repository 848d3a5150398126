"""The inventory cache: its key, its file, and NVML asked only when the driver's identity changes (not MIG)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuhook.cli import main
from gpuhook.config import Config
from gpuhook.discovery.cache import (
    CACHE_FORMAT,
    CachedDiscoverer,
    DriverIdentity,
    Outcome,
    cache_path,
    decode_cache,
    encode_cache,
    fingerprint,
    load_cache,
    read_identity,
    store_cache,
)
from gpuhook.discovery.host import HostDiscoverer
from gpuhook.errors import DiscoveryError
from gpuhook.inventory import Inventory, LiveFacts, MigDevice, MigInstance
from gpuhook.planning.planner import Target, make_plan
from gpuhook.request.model import Capability, GpuIndex, GpuRequest
from integration.fakehost import FakeHost, FakeMigDevice, create_host
from integration.fakehost import mig as fake_mig
from integration.fakehost.models import render_topology

REPO = Path(__file__).parents[2]


def _config(root: Path, cache_dir: Path | None) -> Config:
    """A config pointing every root at *root*, with the cache in *cache_dir*."""
    return Config(driver_root=root, dev_root=root, proc_root=root, log_file=None, cache_dir=cache_dir)


def _calls(host: FakeHost) -> int:
    """NVML calls logged so far on *host*, all processes together."""
    return sum(count for _, count in host.nvml_calls())


@dataclasses.dataclass
class CountingDiscoverer:
    """The real discoverer, counting how often it is asked.

    pynvml binds its function pointers once per process, so in this long-lived test
    process calls.log cannot tell one simulated host's NVML from another's; the
    end-to-end tests count real NVML calls per hook process instead.
    """

    inner: HostDiscoverer
    asked: int = 0

    def discover(self) -> Inventory:
        """Ask the real discoverer (NVML and the driver's files), with the driver version this host's NVML reports.

        The NVML loaded in this process reads the first simulated host's topology file, so a
        test that changes what its own host's NVML reports (the topology's ``driver`` line)
        would not be seen: the version is taken from that host's topology file instead.
        """
        self.asked += 1
        found = self.inner.discover()
        topology = (self.inner.config.driver_root / "etc/mock-nvml/topology").read_text()
        version = next(line.split()[1] for line in topology.splitlines() if line.startswith("driver "))
        return found if version == found.driver_version else dataclasses.replace(found, driver_version=version)


@pytest.fixture(scope="module")
def inventory(host: FakeHost) -> Inventory:
    """The shared 4-GPU host's inventory, straight from NVML."""
    return HostDiscoverer(_config(host.root, None)).discover()


@pytest.fixture
def target(host: FakeHost) -> FakeHost:
    """The host the cache is tested on: the shared one, unless a test class changes hosts."""
    return host


@pytest.fixture
def nvml(target: FakeHost) -> CountingDiscoverer:
    """The discoverer that asks NVML, counted; shared by every CachedDiscoverer of a test."""
    return CountingDiscoverer(HostDiscoverer(_config(target.root, None)))


@pytest.fixture
def cached(target: FakeHost, nvml: CountingDiscoverer, tmp_path: Path) -> Callable[..., CachedDiscoverer]:
    """A CachedDiscoverer over *target* with its cache in tmp_path/cache."""

    def make(*, refresh: bool = False, cache_dir: Path | None = tmp_path / "cache") -> CachedDiscoverer:
        return CachedDiscoverer(config=_config(target.root, cache_dir), inner=nvml, refresh=refresh)

    return make


class TestInventoryJson:
    """Inventory.to_dict / from_dict, the form the cache stores."""

    def test_round_trip(self, inventory: Inventory) -> None:
        """A real inventory survives JSON unchanged, paths and nested values included."""
        assert Inventory.from_dict(json.loads(json.dumps(inventory.to_dict()))) == inventory

    def test_round_trip_with_mig(self, inventory: Inventory) -> None:
        """MIG devices and the layout NVML was asked about survive too."""
        mig = dataclasses.replace(
            inventory, mig_devices=(MigDevice(parent_index=0, index=0, uuid="MIG-a", gi=7, ci=0, name="1g.10gb"),),
            mig_layout=(MigInstance(gpu_minor=0, gi=7, ci=0), MigInstance(gpu_minor=0, gi=8, ci=0)))
        assert Inventory.from_dict(json.loads(json.dumps(mig.to_dict()))) == mig

    def test_round_trip_without_proc_driver(self, inventory: Inventory) -> None:
        """A host without /proc/driver/nvidia (proc_driver None) round-trips too."""
        bare = dataclasses.replace(inventory, proc_driver=None)
        assert Inventory.from_dict(bare.to_dict()) == bare

    @pytest.mark.parametrize(
        "damage",
        [
            pytest.param(lambda d: d.pop("gpus"), id="missing-key"),
            pytest.param(lambda d: d["gpus"][0].update(minor=True), id="bool-for-int"),
            pytest.param(lambda d: d["gpus"][0].update(index="0"), id="str-for-int"),
            pytest.param(lambda d: d["libraries"][0].update(host_path="usr/lib/x.so"), id="relative-path"),
            pytest.param(lambda d: d.update(control_nodes={}), id="dict-for-list"),
            pytest.param(lambda d: d["proc_driver"].update(files=[["version"]]), id="short-pair"),
            pytest.param(lambda d: d.update(driver_version=550), id="int-for-str"),
            pytest.param(lambda d: d.update(mig_layout=[[0, 7]]), id="short-mig-instance"),
            pytest.param(lambda d: d.update(mig_layout=[[0, True, 0]]), id="bool-in-mig-instance"),
        ],
    )
    def test_wrong_types_are_refused(self, inventory: Inventory, damage: Callable[[dict[str, object]], object]) -> None:
        """Every field is type-checked: a damaged document is a ValueError, never a half-built inventory."""
        data = inventory.to_dict()
        damage(data)
        with pytest.raises(ValueError, match="inventory"):
            Inventory.from_dict(data)


class TestDocument:
    """encode_cache / decode_cache: pure, and every unusable document is a miss."""

    def test_matching_key_decodes(self, inventory: Inventory) -> None:
        """The inventory comes back for the key it was stored with."""
        assert decode_cache(encode_cache("k1", inventory), "k1") == inventory

    def test_other_key_is_stale(self, inventory: Inventory) -> None:
        """A document for another driver identity is stale."""
        assert decode_cache(encode_cache("k1", inventory), "k2") is Outcome.STALE

    @pytest.mark.parametrize(
        "data",
        [
            pytest.param(b"", id="empty"),
            pytest.param(b'{"format": 1, "key": "k1", "inventory": {', id="truncated"),
            pytest.param(b"[1, 2]", id="not-an-object"),
            pytest.param(json.dumps({"format": CACHE_FORMAT + 1, "key": "k1", "inventory": {}}).encode(),
                         id="other-format"),
            pytest.param(json.dumps({"format": CACHE_FORMAT, "key": "k1", "inventory": {"gpus": []}}).encode(),
                         id="bad-inventory"),
            pytest.param(b"\xff\xfe garbage", id="binary"),
            pytest.param(b"[" * 100_000 + b"]" * 100_000, id="deep-nesting"),
        ],
    )
    def test_unusable_documents_are_corrupt(self, data: bytes) -> None:
        """Garbage, other formats and wrong shapes are CORRUPT, not exceptions."""
        assert decode_cache(data, "k1") is Outcome.CORRUPT


class TestFingerprint:
    """The key is a pure function of the identity, and every part of the identity counts."""

    @pytest.fixture
    def identity(self, host: FakeHost) -> DriverIdentity:
        """The shared host's identity."""
        return read_identity(_config(host.root, None))

    def test_stable(self, host: FakeHost, identity: DriverIdentity) -> None:
        """Reading an unchanged host twice gives the same key."""
        assert fingerprint(read_identity(_config(host.root, None))) == fingerprint(identity)

    @pytest.mark.parametrize(
        "change",
        [
            pytest.param({"gpuhook_version": "99"}, id="gpuhook-version"),
            pytest.param({"roots": ("/a", "/b", "/c")}, id="roots"),
            pytest.param({"proc_files": ()}, id="proc-files"),
            pytest.param({"proc_gpus": ()}, id="proc-gpus"),
            pytest.param({"dev_nodes": ()}, id="dev-nodes"),
            pytest.param({"ld_cache": (1, 2, 3, 4)}, id="ld-cache"),
            pytest.param({"driver_dirs": ()}, id="driver-dirs"),
            pytest.param({"ipc": ()}, id="ipc-sockets"),
        ],
    )
    def test_each_part_changes_the_key(self, identity: DriverIdentity, change: dict[str, object]) -> None:
        """Changing any one field of the identity changes the key."""
        assert fingerprint(dataclasses.replace(identity, **change)) != fingerprint(identity)  # type: ignore[arg-type]

    def test_identity_reads_the_driver(self, host: FakeHost, identity: DriverIdentity) -> None:
        """The identity holds the NVRM version, every /dev/nvidia* node and the ld.so.cache stamp."""
        files = dict(identity.proc_files)
        assert host.driver_version in (files["proc/driver/nvidia/version"] or "")
        names = {name for name, _, _ in identity.dev_nodes}
        assert {f"nvidia{g.minor}" for g in host.gpus} | {"nvidiactl", "nvidia-uvm"} <= names
        st = host.ld_cache.stat()
        assert identity.ld_cache == (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _add_node(host: FakeHost) -> None:
    """A new GPU node appears (hot-plug, or a node made by hand)."""
    os.mknod(host.root / "dev/nvidia7", stat.S_IFCHR | 0o666, os.makedev(host.nvidia_major, 7))


def _remove_node(host: FakeHost) -> None:
    """A GPU node disappears (GPU removed or unbound)."""
    (host.root / "dev/nvidia1").unlink()


def _touch_ld_cache(host: FakeHost) -> None:
    """ldconfig rewrote the driver root's ld.so.cache (a driver install)."""
    st = host.ld_cache.stat()
    os.utime(host.ld_cache, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def _new_driver_version(host: FakeHost) -> None:
    """The kernel module was reloaded with another version (which NVML then reports too)."""
    version = host.root / "proc/driver/nvidia/version"
    version.chmod(0o644)
    version.write_text(version.read_text().replace(host.driver_version, "550.90.07"))
    topology = host.topology_path
    topology.write_text(topology.read_text().replace(f"driver {host.driver_version}\n", "driver 550.90.07\n"))


def _restart_persistenced(host: FakeHost) -> None:
    """nvidia-persistenced restarted: a new socket inode."""
    path = host.root / "run/nvidia-persistenced/socket"
    path.unlink()
    with socket.socket(socket.AF_UNIX) as sock:
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            sock.bind(f"/proc/self/fd/{dir_fd}/{path.name}")  # tmp paths can exceed sun_path
        finally:
            os.close(dir_fd)


HOST_CHANGES = [
    pytest.param(_add_node, id="gpu-node-added"),
    pytest.param(_remove_node, id="gpu-node-removed"),
    pytest.param(_touch_ld_cache, id="ld-so-cache-touched"),
    pytest.param(_new_driver_version, id="driver-reloaded"),
    pytest.param(_restart_persistenced, id="persistenced-restarted"),
]


class TestIdentityChanges:
    """Each way the driver's identity changes makes the next lookup ask NVML again."""

    @pytest.fixture
    def target(self, tmp_path: Path) -> FakeHost:
        """A fresh 2-GPU host this test may change."""
        return create_host(tmp_path / "host", gpus=2)

    @pytest.mark.parametrize("change", HOST_CHANGES)
    def test_identity_change_rebuilds(self, target: FakeHost, cached: Callable[..., CachedDiscoverer],
                                      nvml: CountingDiscoverer, change: Callable[[FakeHost], None]) -> None:
        """A changed driver identity is a stale cache: NVML is asked again and the new result stored."""
        cached().lookup()
        change(target)
        rebuilt = cached().lookup()
        assert rebuilt.outcome is Outcome.STALE and rebuilt.not_stored is None and nvml.asked == 2
        assert cached().lookup().outcome is Outcome.HIT and nvml.asked == 2

    def test_removed_node_is_not_served_from_the_cache(self, target: FakeHost,
                                                       cached: Callable[..., CachedDiscoverer]) -> None:
        """After /dev/nvidia1 goes away, the inventory no longer lists it."""
        assert len(cached().lookup().inventory.gpu_nodes) == 2
        _remove_node(target)
        assert [n.name for n in cached().lookup().inventory.gpu_nodes] == ["nvidia0"]


#: GPU 0 of the MIG host: a 3g instance (GI 1) and two 1g ones (GI 7, 8), one compute instance each
MIG_PROFILES = ("3g.40gb", "1g.10gb", "1g.10gb")
#: the same GPU with one more 1g instance (GI 9), one the first inventory never saw
GROWN_PROFILES = (*MIG_PROFILES, "1g.10gb")


def _mig_devices(host: FakeHost, profiles: tuple[str, ...]) -> tuple[FakeMigDevice, ...]:
    """GPU 0's MIG devices with *profiles*, as the simulated driver lays them out."""
    return fake_mig.make_mig_devices(host.gpus, {0: profiles}, host.driver_version)


def _set_topology(host: FakeHost, devices: tuple[FakeMigDevice, ...]) -> None:
    """What the mock NVML reports from now on: *devices*, numbered per GPU in order (as NVML enumerates them)."""
    numbered = tuple(dataclasses.replace(d, index=i) for i, d in enumerate(devices))
    host.topology_path.write_text(render_topology(host.driver_version, host.cuda_version, host.gpus, numbered))


def _destroy(host: FakeHost, device: FakeMigDevice) -> None:
    """``nvidia-smi mig -dci -dgi``: the instance's capability files and nodes go away."""
    shutil.rmtree(host.capabilities_dir / f"gpu{device.parent_minor}/mig/gi{device.gi}")
    for minor in (device.gi_cap_minor, device.ci_cap_minor):
        (host.root / f"dev/nvidia-caps/nvidia-cap{minor}").unlink()


def _create(host: FakeHost, device: FakeMigDevice) -> None:
    """``nvidia-smi mig -cgi -C`` then ``nvidia-modprobe -f``: capability files and their nodes appear."""
    for rel, minor in ((device.gi_proc_path, device.gi_cap_minor), (device.ci_proc_path, device.ci_cap_minor)):
        path = host.capabilities_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(fake_mig.capability_file(minor, fake_mig.ACCESS_MODE))
        path.chmod(fake_mig.ACCESS_MODE)
        os.mknod(host.root / f"dev/nvidia-caps/nvidia-cap{minor}", stat.S_IFCHR | fake_mig.ACCESS_MODE,
                 os.makedev(host.caps_major, minor))


def _start(host: FakeHost, cache_dir: Path, *, mig: bool) -> dict[str, object]:
    """What a start in a fresh process gets from discovery.inventory_for (a fresh process loads this host's NVML).

    In this long-lived process pynvml stays bound to the first simulated host it loaded
    (see CountingDiscoverer), so NVML's MIG answers are only this host's in a new one.
    """
    code = (
        "import json, sys; from pathlib import Path; from gpuhook.config import Config; "
        "from gpuhook.discovery import inventory_for; from gpuhook.inventory import LiveNeeds; "
        "r, c = Path(sys.argv[1]), Path(sys.argv[2]); "
        "config = Config(driver_root=r, dev_root=r, proc_root=r, log_file=None, cache_dir=c); "
        "found = inventory_for(config, LiveNeeds(mig=sys.argv[3] == 'mig')); "
        "print(json.dumps({'outcome': found.outcome.value, 'pynvml': 'pynvml' in sys.modules, "
        "'migs': [[m.parent_index, m.index, m.gi, m.uuid] for m in found.inventory.mig_devices], "
        "'caps': [n.minor for n in found.live.caps_nodes]}))"
    )
    argv = [sys.executable, "-I", "-c", code, str(host.root), str(cache_dir), "mig" if mig else "whole"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=REPO)
    found: dict[str, object] = json.loads(out.stdout)
    return found


def _nvml_processes(host: FakeHost) -> int:
    """How many processes have called NVML on *host* so far."""
    return len({pid for pid, _ in host.nvml_calls()})


class TestMigLayoutIsLive:
    """Creating or destroying a MIG instance keeps the cache: the layout is read at each start, without NVML."""

    @pytest.fixture
    def target(self, tmp_path: Path) -> FakeHost:
        """A fresh 2-GPU host with GPU 0 in MIG mode (GI 1, 7 and 8), which the test changes."""
        return create_host(tmp_path / "host", gpus=2, mig={0: MIG_PROFILES})

    def test_layout_changes_keep_the_key(self, target: FakeHost) -> None:
        """The identity does not hold the capabilities tree or /dev/nvidia-caps: the key outlives MIG changes."""
        config = _config(target.root, None)
        key = fingerprint(read_identity(config))
        _destroy(target, target.mig_devices[1])
        assert fingerprint(read_identity(config)) == key
        _create(target, _mig_devices(target, GROWN_PROFILES)[3])
        assert fingerprint(read_identity(config)) == key

    def test_destroyed_instance_is_no_longer_offered_and_nvml_is_not_asked(self, target: FakeHost,
                                                                           tmp_path: Path) -> None:
        """GI 7 destroyed: the next start is a hit without pynvml; GI 8's device moves down to 0:1, GI 7's nodes go."""
        cache = tmp_path / "cache"
        first = _start(target, cache, mig=True)
        one, two, three = target.mig_devices
        assert first["outcome"] == "absent" and _nvml_processes(target) == 1
        assert first["migs"] == [[0, 0, one.gi, one.uuid], [0, 1, two.gi, two.uuid], [0, 2, three.gi, three.uuid]]
        _destroy(target, two)
        _set_topology(target, (one, three))
        after = _start(target, cache, mig=True)
        assert after["outcome"] == "hit" and after["pynvml"] is False and _nvml_processes(target) == 1
        assert after["migs"] == [[0, 0, one.gi, one.uuid], [0, 1, three.gi, three.uuid]]
        caps = after["caps"]
        assert isinstance(caps, list) and two.gi_cap_minor not in caps and three.ci_cap_minor in caps

    def test_new_instance_costs_one_rebuild_only_for_a_start_that_may_use_it(self, target: FakeHost,
                                                                            tmp_path: Path) -> None:
        """GI 9 created: a whole-GPU start is still a hit; the first MIG start asks NVML once; the next is a hit."""
        cache = tmp_path / "cache"
        assert _start(target, cache, mig=True)["outcome"] == "absent"
        grown = _mig_devices(target, GROWN_PROFILES)
        _create(target, grown[3])
        _set_topology(target, grown)
        whole = _start(target, cache, mig=False)
        assert whole["outcome"] == "hit" and whole["pynvml"] is False and _nvml_processes(target) == 1
        mig = _start(target, cache, mig=True)
        assert mig["outcome"] == "mig-changed" and _nvml_processes(target) == 2
        assert [0, 3, grown[3].gi, grown[3].uuid] in mig["migs"]  # type: ignore[operator]
        again = _start(target, cache, mig=True)
        assert again["outcome"] == "hit" and again["pynvml"] is False and _nvml_processes(target) == 2
        assert again["migs"] == mig["migs"]


class TestCachedDiscoverer:
    """NVML on a miss, never on a hit; the file is atomic, trusted and self-healing."""

    def test_second_lookup_is_a_hit_without_nvml(self, cached: Callable[..., CachedDiscoverer],
                                                  nvml: CountingDiscoverer) -> None:
        """The first lookup asks NVML and stores; the second answers from the file alone."""
        first = cached().lookup()
        assert first.outcome is Outcome.ABSENT and first.not_stored is None and nvml.asked == 1
        second = cached().lookup()
        assert second.outcome is Outcome.HIT and second.inventory == first.inventory
        assert nvml.asked == 1

    def test_file_and_directory_modes(self, cached: Callable[..., CachedDiscoverer], tmp_path: Path) -> None:
        """The directory is 0755, the file 0644, and no temporary file is left behind."""
        cached().lookup()
        directory = tmp_path / "cache"
        assert stat.S_IMODE(directory.stat().st_mode) == 0o755
        files = list(directory.iterdir())
        assert len(files) == 1 and files[0].name.startswith("inventory-") and files[0].suffix == ".json"
        assert stat.S_IMODE(files[0].stat().st_mode) == 0o644

    def test_refresh_rebuilds(self, cached: Callable[..., CachedDiscoverer], nvml: CountingDiscoverer) -> None:
        """refresh=True ignores a valid file, asks NVML and writes it again."""
        cached().lookup()
        assert cached(refresh=True).lookup().outcome is Outcome.REFRESH and nvml.asked == 2
        assert cached().lookup().outcome is Outcome.HIT and nvml.asked == 2

    def test_disabled(self, cached: Callable[..., CachedDiscoverer], nvml: CountingDiscoverer,
                      tmp_path: Path) -> None:
        """cache_dir null: NVML every time, nothing written."""
        assert cached(cache_dir=None).lookup().outcome is Outcome.DISABLED
        assert cached(cache_dir=None).lookup().outcome is Outcome.DISABLED
        assert nvml.asked == 2 and not (tmp_path / "cache").exists()

    def test_corrupt_file_is_a_miss_and_is_replaced(self,
                                                    cached: Callable[..., CachedDiscoverer]) -> None:
        """A truncated file is rebuilt, not an error."""
        config = cached().config
        assert config.cache_dir is not None
        cached().lookup()
        path = cache_path(config.cache_dir, config)
        path.write_bytes(path.read_bytes()[:100])
        assert cached().lookup().outcome is Outcome.CORRUPT
        assert cached().lookup().outcome is Outcome.HIT

    def test_symlinked_file_is_not_followed(self, cached: Callable[..., CachedDiscoverer], tmp_path: Path) -> None:
        """A symlink in place of the file is untrusted (O_NOFOLLOW), then replaced by a real file."""
        config = cached().config
        assert config.cache_dir is not None
        cached().lookup()
        path = cache_path(config.cache_dir, config)
        real = tmp_path / "elsewhere.json"
        path.rename(real)
        path.symlink_to(real)
        assert cached().lookup().outcome is Outcome.UNTRUSTED
        assert not path.is_symlink() and cached().lookup().outcome is Outcome.HIT

    def test_group_writable_file_is_untrusted(self, cached: Callable[..., CachedDiscoverer]) -> None:
        """A file others may write could point bind mounts anywhere: it is not read."""
        config = cached().config
        assert config.cache_dir is not None
        cached().lookup()
        cache_path(config.cache_dir, config).chmod(0o666)
        assert cached().lookup().outcome is Outcome.UNTRUSTED
        assert cached().lookup().outcome is Outcome.HIT  # the rebuild wrote a 0644 file

    def test_world_writable_directory_is_neither_read_nor_written(self, cached: Callable[..., CachedDiscoverer],
                                                                  tmp_path: Path) -> None:
        """In a directory others may write, the cache is bypassed and the reason reported."""
        cached().lookup()
        (tmp_path / "cache").chmod(0o777)
        found = cached().lookup()
        assert found.outcome is Outcome.UNTRUSTED
        assert found.not_stored is not None and "writable by others" in found.not_stored

    def test_unwritable_location_still_gives_the_inventory(self, cached: Callable[..., CachedDiscoverer],
                                                          tmp_path: Path) -> None:
        """A cache_dir that cannot be created is reported, and the start goes on with NVML's answer."""
        (tmp_path / "file").write_text("")
        found = cached(cache_dir=tmp_path / "file" / "cache").lookup()
        assert found.outcome is Outcome.ABSENT and found.inventory.gpus
        assert found.not_stored is not None and "cannot write" in found.not_stored

    def test_hit_does_not_import_pynvml(self, target: FakeHost, cached: Callable[..., CachedDiscoverer]) -> None:
        """With a valid cache, a fresh process gets the inventory without importing pynvml."""
        cached().lookup()
        root, cache_dir = str(target.root), str(cached().config.cache_dir)
        code = (
            "import sys; from pathlib import Path; from gpuhook.config import Config; "
            "from gpuhook.discovery.cache import CachedDiscoverer; from gpuhook.discovery.host import HostDiscoverer; "
            f"r = Path({root!r}); "
            f"c = Config(driver_root=r, dev_root=r, proc_root=r, log_file=None, cache_dir=Path({cache_dir!r})); "
            "found = CachedDiscoverer(config=c, inner=HostDiscoverer(c)).lookup(); "
            "print(found.outcome.value, 'pynvml' in sys.modules)"
        )
        out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
        assert out.stdout.split() == ["hit", "False"]

    def test_racing_writers_never_expose_a_partial_file(self, inventory: Inventory, tmp_path: Path) -> None:
        """Writers racing to replace the file leave readers a whole document every time."""
        path = tmp_path / "cache" / "inventory-race.json"
        data = encode_cache("k", inventory)
        store_cache(path, data)
        blob = tmp_path / "data"
        blob.write_bytes(data)
        writer = (
            "import sys; from pathlib import Path; from gpuhook.discovery.cache import store_cache; "
            "data = Path(sys.argv[2]).read_bytes(); [store_cache(Path(sys.argv[1]), data) for _ in range(200)]"
        )
        writers = [subprocess.Popen([sys.executable, "-I", "-c", writer, str(path), str(blob)], cwd=REPO)
                   for _ in range(3)]
        running = True
        while running:
            running = any(w.poll() is None for w in writers)
            found = load_cache(path)
            assert isinstance(found, bytes) and decode_cache(found, "k") == inventory
        assert all(w.wait() == 0 for w in writers)
        assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporary left behind


class TestInfoRefresh:
    """`gpuhook info --refresh` rebuilds the cache by hand."""

    def _write_config(self, tmp_path: Path, host: FakeHost, cache_dir: str) -> Path:
        """A config for *host* with *cache_dir* (a path or null) and no log."""
        path = tmp_path / "gpuhook.yaml"
        path.write_text(f"driver_root: {host.root}\ndev_root: {host.root}\nproc_root: {host.root}\n"
                        f"log_file: null\ncache_dir: {cache_dir}\n")
        return path

    def test_refresh_writes_the_cache(self, host: FakeHost, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
        """info --refresh asks NVML and writes the file; a plain info then reads it."""
        config = self._write_config(tmp_path, host, str(tmp_path / "cache"))
        assert main(["--config", str(config), "info", "--refresh"]) == 0
        assert "rebuilt from NVML and cached" in capsys.readouterr().out
        assert len(list((tmp_path / "cache").glob("inventory-*.json"))) == 1
        calls = _calls(host)
        assert main(["--config", str(config), "info"]) == 0
        out = capsys.readouterr().out
        assert "from the cache (no NVML)" in out and host.gpus[0].uuid in out
        assert _calls(host) == calls

    def test_refresh_with_the_cache_disabled_fails(self, host: FakeHost, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
        """With cache_dir null there is nothing to refresh: exit 1 with one line that says so."""
        config = self._write_config(tmp_path, host, "null")
        assert main(["--config", str(config), "info", "--refresh"]) == 1
        assert "inventory cache is disabled" in capsys.readouterr().err


def _make_unusable(path: Path, kind: str, tmp_path: Path) -> None:
    """Put a *kind* of unusable entry at the cache file's *path*."""
    path.unlink(missing_ok=True)
    if kind == "directory":
        path.mkdir()
        (path / "inside").write_text("{}")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        with socket.socket(socket.AF_UNIX) as sock:
            dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                sock.bind(f"/proc/self/fd/{dir_fd}/{path.name}")
            finally:
                os.close(dir_fd)
    elif kind == "symlink":
        (tmp_path / "elsewhere.json").write_text("{}")
        path.symlink_to(tmp_path / "elsewhere.json")
    else:  # unreadable: a file the reader cannot open (root reads anything: make it a device node instead)
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))


UNUSABLE = ["directory", "fifo", "socket", "symlink", "device"]


class TestUnusableCacheFile:
    """Whatever sits at the cache path, a lookup is a miss with the inventory, never an error."""

    @pytest.mark.parametrize("kind", UNUSABLE)
    def test_a_miss_and_storing_over_it_fails_quietly_or_heals(self, cached: Callable[..., CachedDiscoverer],
                                                               tmp_path: Path, kind: str) -> None:
        """An unusable entry is UNTRUSTED; a directory cannot be replaced (not_stored says why), the rest are."""
        config = cached().config
        assert config.cache_dir is not None
        config.cache_dir.mkdir(mode=0o755)
        path = cache_path(config.cache_dir, config)
        _make_unusable(path, kind, tmp_path)
        assert load_cache(path) is Outcome.UNTRUSTED
        found = cached().lookup()
        assert found.outcome is Outcome.UNTRUSTED and found.inventory.gpus
        if kind == "directory":
            assert found.not_stored is not None and "cannot write" in found.not_stored
            assert path.is_dir() and cached().lookup().outcome is Outcome.UNTRUSTED
        else:
            assert found.not_stored is None and cached().lookup().outcome is Outcome.HIT

    def test_info_with_a_directory_at_the_cache_path(self, host: FakeHost, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
        """`gpuhook info` answers from NVML; `info --refresh` refuses with one line that says why."""
        cache_dir = tmp_path / "cache"
        config_file = TestInfoRefresh._write_config(TestInfoRefresh(), tmp_path, host, str(cache_dir))
        config = Config(driver_root=host.root, dev_root=host.root, proc_root=host.root, log_file=None,
                        cache_dir=cache_dir)
        cache_dir.mkdir(mode=0o755)
        cache_path(cache_dir, config).mkdir()
        assert main(["--config", str(config_file), "info"]) == 0
        assert host.gpus[0].uuid in capsys.readouterr().out
        assert main(["--config", str(config_file), "info", "--refresh"]) == 1
        err = capsys.readouterr().err
        assert "the inventory cache was not rebuilt: cannot write" in err and "Traceback" not in err


def _nvml_reports(host: FakeHost, version: str) -> None:
    """Make the mock NVML report driver *version* (the driver files stay at the host's own)."""
    topology = host.topology_path
    topology.write_text(topology.read_text().replace(f"driver {host.driver_version}\n", f"driver {version}\n"))


class TestDriverUpgradeDuringDiscovery:
    """An inventory whose NVML and driver files disagree is retried once, then refused; never stored."""

    @pytest.fixture
    def target(self, tmp_path: Path) -> FakeHost:
        """A fresh 2-GPU host this test may change."""
        return create_host(tmp_path / "host", gpus=2)

    def test_a_persistent_mismatch_is_refused_naming_both_versions(self, target: FakeHost,
                                                                    cached: Callable[..., CachedDiscoverer],
                                                                    nvml: CountingDiscoverer) -> None:
        """NVML says 550.90.07, the kernel module 550.54.15: asked twice, refused, nothing stored."""
        _nvml_reports(target, "550.90.07")
        version = re.escape(target.driver_version)
        with pytest.raises(DiscoveryError, match=rf"NVML reports driver 550\.90\.07, the kernel module is {version}"
                                                 r".*retry once the upgrade is done"):
            cached().lookup()
        config = cached().config
        assert config.cache_dir is not None
        assert nvml.asked == 2 and not cache_path(config.cache_dir, config).exists()

    def test_a_change_during_discovery_is_retried_and_the_retry_stored(self, target: FakeHost,
                                                                        cached: Callable[..., CachedDiscoverer],
                                                                        nvml: CountingDiscoverer) -> None:
        """The identity changes while NVML answers once: the second answer is used and stored, a hit next."""
        inner = nvml.discover

        def racing() -> Inventory:
            if nvml.asked == 0:
                _touch_ld_cache(target)  # ldconfig of an upgrade ran meanwhile
            return inner()

        found = dataclasses.replace(cached(), inner=type("Racing", (), {"discover": staticmethod(racing)})()).lookup()
        assert found.not_stored is None and nvml.asked == 2
        assert cached().lookup().outcome is Outcome.HIT and nvml.asked == 2

    def test_a_start_on_a_mismatched_host_is_refused_not_started_without_libraries(
            self, target: FakeHost, tmp_path: Path) -> None:
        """Even with the cache disabled, the planner refuses GPU nodes without libcuda/libnvidia-ml."""
        _nvml_reports(target, "550.90.07")
        config = _config(target.root, None)
        inventory = CachedDiscoverer(config=config, inner=CountingDiscoverer(HostDiscoverer(config))).lookup().inventory
        assert inventory.driver_version == "550.90.07"
        inventory = dataclasses.replace(inventory, libraries=tuple(  # the files of the version NVML does not report
            f for f in inventory.libraries if f.name.endswith(".so.550.90.07")))
        request = GpuRequest(all_devices=False, devices=(GpuIndex(0),), raw="0",
                             capabilities=frozenset({Capability.COMPUTE, Capability.UTILITY}))
        with pytest.raises(DiscoveryError, match=r"lack libcuda\.so\.550\.90\.07, libnvidia-ml\.so\.550\.90\.07"):
            make_plan(request, inventory, LiveFacts(), Target(libs_dir="/usr/lib/x86_64-linux-gnu"))

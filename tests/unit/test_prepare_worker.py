"""What an idle gpuhookd worker prepares before its request (service.prepare_worker)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpuhook import service
from gpuhook.apply import ldelf
from gpuhook.config import load_config
from gpuhook.discovery import cache, inventory_for
from gpuhook.inventory import LiveNeeds
from integration.fakehost import FakeHost, create_host


def test_an_idle_worker_decodes_the_cache_and_reads_the_drivers_libraries(host: FakeHost,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_config(host.config_path, required=True)
    found = inventory_for(config, LiveNeeds())  # the cache file, as the first start leaves it
    monkeypatch.setattr(cache, "_DECODED", {})
    monkeypatch.setattr(ldelf, "_KNOWN", {})
    service.prepare_worker(str(host.config_path), required=True)
    assert [known[2] for known in cache._DECODED.values()] == [found.inventory]
    read = {Path(p) for p in (f.host_path for f in found.inventory.libraries)}
    assert read and all(ldelf.known(p.stat()) is not ldelf.UNKNOWN for p in read)


def test_an_idle_worker_without_a_cache_asks_nothing(host: FakeHost, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """No valid cache file: nothing is decoded and NVML is not asked (the request rebuilds it)."""
    moved = tmp_path / "config.yaml"
    lines = [line for line in host.config_path.read_text().splitlines() if not line.startswith("cache_dir:")]
    moved.write_text("\n".join([*lines, f"cache_dir: {tmp_path / 'empty-cache'}", ""]))
    assert load_config(moved, required=True).cache_dir == tmp_path / "empty-cache"
    monkeypatch.setattr(cache, "_DECODED", {})
    calls_before = len(host.nvml_calls())
    service.prepare_worker(str(moved), required=True)
    assert cache._DECODED == {}
    assert len(host.nvml_calls()) == calls_before
    service.prepare_worker(str(tmp_path / "missing.yaml"), required=True)  # a broken config: no exception


@pytest.mark.parametrize("mig", [pytest.param({}, id="whole-gpus"), pytest.param({0: ("1g.5gb",)}, id="mig-mode")])
def test_the_plan_thrown_away_is_made_on_any_host(tmp_path: Path, mig: dict[int, tuple[str, ...]]) -> None:
    """The worker's warm-up plan (every GPU, every capability) completes on a host in MIG mode too, where "all"
    selects the MIG devices and so needs the layout read live (it used to be refused, silently, in prepare_worker)."""
    host = create_host(tmp_path / "host", gpus=1, model="NVIDIA A100-SXM4-40GB", mig=mig)
    # The cache built by a process of its own: this one may have loaded another host's (mock) NVML already.
    subprocess.run([sys.executable, "-I", "-m", "gpuhook", "--config", str(host.config_path), "info", "--refresh"],
                   check=True, capture_output=True, cwd="/")
    config = load_config(host.config_path, required=True)
    inventory = cache.warm(config)
    assert inventory is not None and len(inventory.mig_devices) == len(mig.get(0, ()))
    service._warm_plan(config, inventory)  # raises what the plan refuses

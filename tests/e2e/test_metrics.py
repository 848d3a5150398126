"""Issue 18: gpuhookd's Prometheus endpoint, scraped by a real Prometheus, and dcgm-exporter's job mapping.

A simulated 4-GPU host with GPU 0 exclusive; gpuhookd serves the config (its metrics process on a
loopback port) and real runc containers reach it through the hook's ``--daemon-socket``. Debian's
``prometheus`` scrapes the endpoint every second; the test asks its HTTP API, as a dashboard would.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from integration.engines import require_tool
from integration.fakehost import FakeHost, create_host
from integration.gpuhookd import Gpuhookd

from .conftest import hook_entry, relay_entry
from .test_leases import Site, wait_for

GPU0 = {"NVIDIA_VISIBLE_DEVICES": "0"}
NO_GPU: dict[str, str] = {}
SCRAPE_WAIT_S = 30.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Rig:
    """The site (policy, ledger, containers), its gpuhookd, the endpoint, Prometheus's address, the job dir."""

    site: Site
    daemon: Gpuhookd
    metrics: str
    prometheus: str
    job_dir: Path
    relay: Path

    def run(self, env: dict[str, str], *, relay: bool = False, **kw: Any) -> Any:
        """A container whose prestart hook hands the start to gpuhookd: the Python hook, or gpuhook-relay as the
        packages register it (which hands gpuhookd a no-GPU start too); its poststop is the Site's."""
        argv = ("--daemon-socket", self.daemon.socket, "prestart")
        hook = relay_entry(self.relay, self.site.config, *argv) if relay else hook_entry(self.site.config, *argv)
        return self.site.run(env, prestart=hook, **kw)

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"http://{self.prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as answer:
            data = json.load(answer)
        assert data["status"] == "success", data
        return data["data"]["result"]  # type: ignore[no-any-return]

    def value(self, expr: str) -> float:
        found = self.query(expr)
        return float(found[0]["value"][1]) if found else 0.0

    def jobs(self) -> dict[str, list[str]]:
        return {p.name: p.read_text().split() for p in sorted(self.job_dir.iterdir())} if self.job_dir.exists() else {}

    def metrics_pid(self) -> int:
        """The metrics process: the gpuhookd child listening on the endpoint's port (from its journal line)."""
        line = next(line for line in self.daemon.journal.read_text().splitlines() if "metrics on http" in line)
        return int(line.rsplit("(process ", 1)[1].rstrip(")"))


@pytest.fixture
def rig(tmp_path: Path, rootfs_src: Path, relay: Path) -> Iterator[Rig]:
    prometheus = require_tool("prometheus")
    host: FakeHost = create_host(tmp_path / "host", gpus=4)
    site = Site(tmp_path / "site", host, rootfs_src, [{"device": 0, "sharing": "exclusive"}])
    metrics, web, job_dir = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}", tmp_path / "jobs"
    with site.config.open("a") as config:
        config.write(f"metrics_listen: {metrics}\nhpc_job_mapping_dir: {job_dir}\n")
    daemon = Gpuhookd(sys.executable, tmp_path / "gpuhookd", config=site.config)
    scrape = tmp_path / "prometheus.yml"
    scrape.write_text(f"global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n"
                      f"scrape_configs: [{{job_name: gpuhook, static_configs: [{{targets: ['{metrics}']}}]}}]\n")
    server = subprocess.Popen([prometheus, f"--config.file={scrape}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                               f"--web.listen-address={web}"], stdout=subprocess.DEVNULL,
                              stderr=(tmp_path / "prometheus.log").open("wb"))
    made = Rig(site, daemon, metrics, web, job_dir, relay)
    try:
        wait_for("prometheus scrapes gpuhook", lambda: _up(made), timeout=SCRAPE_WAIT_S)
        yield made
    finally:
        site.cleanup()
        server.terminate()
        server.wait(timeout=30)
        journal = daemon.stop()
        assert "Traceback" not in journal, journal


def _up(rig: Rig) -> bool:
    try:
        return rig.value('up{job="gpuhook"}') == 1.0
    except OSError:
        return False


def test_prometheus_sees_starts_by_result_and_which_container_holds_which_gpu(rig: Rig) -> None:
    """A GPU container, a no-GPU one (through gpuhook-relay) and a refused one, all through gpuhookd:
    Prometheus counts them by result; gpuhook_container_gpu_info names the running container and its GPU,
    and is gone after it ends; the job-mapping file of GPU 0 holds exactly its holder throughout."""
    a = rig.run(GPU0)
    assert rig.site.started(a) == {0}
    assert rig.jobs() == {"0": [a.id]}
    plain = rig.run(NO_GPU, relay=True)
    assert plain.returncode == 0, plain.stderr
    rig.site.refused(rig.run(GPU0), a.id, "exclusive")
    assert rig.jobs() == {"0": [a.id]}  # the refusal changed no holder

    def counted() -> bool:
        ok = rig.value('sum(gpuhook_container_starts_total{result="ok",gpus="yes",served_by="gpuhookd"})')
        no_gpu = rig.value('sum(gpuhook_container_starts_total{result="ok",gpus="no",served_by="gpuhookd"})')
        refused = rig.value('sum(gpuhook_container_starts_total{result="refused",served_by="gpuhookd"})')
        return ok == 1 and no_gpu == 1 and refused == 1
    wait_for("Prometheus counts the three starts by result", counted, timeout=SCRAPE_WAIT_S)
    assert rig.value('gpuhook_refusals_total{reason="busy"}') >= 1
    held = rig.query(f'gpuhook_container_gpu_info{{container_id="{a.id}"}}')
    assert [(h["metric"]["gpu"], h["metric"]["uuid"]) for h in held] == [("0", rig.site.host.gpus[0].uuid)]
    assert rig.value('gpuhook_gpu_holders{gpu="0"}') == 1
    assert rig.value('sum(gpuhook_start_duration_seconds_count)') >= 1
    rig.site.delete(a.id)
    assert rig.jobs() == {}
    series = f'gpuhook_container_gpu_info{{container_id="{a.id}"}}'
    wait_for("the lease's series is gone", lambda: not rig.query(series), timeout=SCRAPE_WAIT_S)


def test_a_stopped_metrics_process_does_not_slow_a_start(rig: Rig) -> None:
    """SIGSTOP the metrics process: containers start as before (timed, printed), and the job mapping and the
    ledger stay right; SIGCONT, and the counts catch up."""
    def timed() -> float:
        start = time.monotonic()
        started = rig.run(GPU0)
        took = time.monotonic() - start
        assert rig.site.started(started) == {0}
        rig.site.delete(started.id)
        return took

    before = [timed() for _ in range(3)]
    pid = rig.metrics_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        stopped = [timed() for _ in range(3)]
    finally:
        os.kill(pid, signal.SIGCONT)
    print(f"GPU start with the metrics process running: {min(before) * 1000:.0f} ms (best of 3); "
          f"SIGSTOPped: {min(stopped) * 1000:.0f} ms (best of 3)")
    assert rig.jobs() == {}
    wait_for("the counts catch up", lambda: rig.value(
        'sum(gpuhook_container_starts_total{result="ok",gpus="yes"})') >= 6, timeout=SCRAPE_WAIT_S)


def test_status_prometheus_prints_the_same_families(rig: Rig) -> None:
    """`gpuhook status --prometheus`: the endpoint's text, for node-exporter's textfile collector; with the
    GPU memory NVML lists for the container's process, attributed to it through its cgroup."""
    a = rig.run(GPU0)
    assert rig.site.started(a) == {0}
    rig.site.host.set_gpu_processes([(0, rig.site.pid(a.id), 3 << 30), (1, os.getpid(), 1 << 20)])
    text = rig.site.gpuhook("status", "--prometheus")
    assert text.returncode == 0, text.stderr
    with urllib.request.urlopen(f"http://{rig.metrics}/metrics", timeout=10) as answer:
        served = answer.read().decode()
    families = {line.split()[2] for line in text.stdout.splitlines() if line.startswith("# TYPE")}
    assert families == {line.split()[2] for line in served.splitlines() if line.startswith("# TYPE")}
    assert f'gpuhook_container_gpu_info{{container_id="{a.id}"' in text.stdout
    # the test's own process on GPU 1 is no container's: not attributed
    used = [line for line in text.stdout.splitlines() if line.startswith("gpuhook_container_gpu_memory_used_bytes{")]
    assert [(line.split()[0], float(line.split()[1])) for line in used] == [
        (f'gpuhook_container_gpu_memory_used_bytes{{container_id="{a.id}",gpu="0"}}', float(3 << 30))], used

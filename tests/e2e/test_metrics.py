"""Issue 18: gpuhookd's Prometheus endpoint, scraped by a real Prometheus, and dcgm-exporter's job mapping.

A simulated 4-GPU host with GPU 0 exclusive; gpuhookd serves the config (its metrics process on a
loopback port) and real runc containers reach it through the hook's ``--daemon-socket``. Debian's
``prometheus`` scrapes the endpoint every second; the test asks its HTTP API, as a dashboard would.
"""

from __future__ import annotations

import json
import os
import pwd
import selectors
import signal
import socket
import threading
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
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gpuhook.daemon import httpd
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

    def scrape(self, timeout: float = 10.0) -> str:
        """The endpoint's text, fetched by hand."""
        with urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=timeout) as answer:
            return answer.read().decode()  # type: ignore[no-any-return]

    def address(self) -> tuple[str, int]:
        host, _, port = self.metrics.rpartition(":")
        return host, int(port)

    def log_file(self) -> Path:
        return Path(yaml.safe_load(self.site.config.read_text())["log_file"])

    def metrics_pid(self) -> int:
        """The metrics process: the gpuhookd child listening on the endpoint's port (from its journal line)."""
        line = next(line for line in self.daemon.journal.read_text().splitlines() if "metrics on http" in line)
        return int(line.rsplit("(process ", 1)[1].rstrip(")"))


@pytest.fixture
def rig(tmp_path: Path, rootfs_src: Path, relay: Path) -> Iterator[Rig]:
    """The site, its gpuhookd serving metrics, and Prometheus scraping them every second."""
    yield from _serving(tmp_path, rootfs_src, relay, prometheus=require_tool("prometheus"))


@pytest.fixture
def served(tmp_path: Path, rootfs_src: Path, relay: Path) -> Iterator[Rig]:
    """The site and its gpuhookd serving metrics, nobody else scraping them (the tests scrape by hand)."""
    yield from _serving(tmp_path, rootfs_src, relay, prometheus=None)


def _serving(tmp_path: Path, rootfs_src: Path, relay: Path, *, prometheus: str | None) -> Iterator[Rig]:
    host: FakeHost = create_host(tmp_path / "host", gpus=4)
    site = Site(tmp_path / "site", host, rootfs_src, [{"device": 0, "sharing": "exclusive"}])
    metrics, web, job_dir = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}", tmp_path / "jobs"
    with site.config.open("a") as config:
        config.write(f"metrics_listen: {metrics}\nhpc_job_mapping_dir: {job_dir}\n")
    daemon = Gpuhookd(sys.executable, tmp_path / "gpuhookd", config=site.config)
    server = None
    if prometheus is not None:
        scrape = tmp_path / "prometheus.yml"
        scrape.write_text(f"global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n"
                          f"scrape_configs: [{{job_name: gpuhook, static_configs: [{{targets: ['{metrics}']}}]}}]\n")
        server = subprocess.Popen([prometheus, f"--config.file={scrape}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                   f"--web.listen-address={web}"], stdout=subprocess.DEVNULL,
                                  stderr=(tmp_path / "prometheus.log").open("wb"))
    made = Rig(site, daemon, metrics, web, job_dir, relay)
    try:
        wait_for("the endpoint answers", lambda: _answers(made), timeout=SCRAPE_WAIT_S)
        if server is not None:
            wait_for("prometheus scrapes gpuhook", lambda: _up(made), timeout=SCRAPE_WAIT_S)
        yield made
    finally:
        site.cleanup()
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
        journal = daemon.stop()
        assert "Traceback" not in journal, journal


def _answers(rig: Rig) -> bool:
    """Whether the metrics process serves yet (gpuhookd answers hooks before it does)."""
    try:
        rig.scrape()
    except OSError:
        return False
    return True


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


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The series of the family *name* in exposition *text*, by their labels."""
    return {tuple(sorted(sample.labels.items())): sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == name}


def proc_status(pid: int) -> dict[str, str]:
    fields = (line.partition(":") for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {name: value.strip() for name, _, value in fields}


def wait_closed(socks: list[socket.socket], timeout: float) -> list[float]:
    """Wait until the server has closed each of *socks* (its end reads as EOF: it never answered them); the
    seconds each took. Fails after *timeout*."""
    start, took = time.monotonic(), []
    with selectors.DefaultSelector() as waiting:
        for sock in socks:
            waiting.register(sock, selectors.EVENT_READ)
        while waiting.get_map():
            left = start + timeout - time.monotonic()
            assert left > 0, f"{len(waiting.get_map())} of {len(socks)} connections still open after {timeout:g} s"
            for key, _ in waiting.select(left):
                assert key.fileobj.recv(4096) == b""  # type: ignore[union-attr]
                waiting.unregister(key.fileobj)
                took.append(time.monotonic() - start)
    return took


def test_idle_connections_beyond_the_cap_hold_nothing_and_a_scrape_still_succeeds(served: Rig) -> None:
    """Issue #31: more idle connections than the cap (any local user can open them): a scrape is answered at once
    all the same, by a process that still runs one thread; the connections over the cap are dropped as the new
    ones come, and every other one at its deadline."""
    over = 16
    idle = [socket.create_connection(served.address()) for _ in range(httpd.MAX_CONNECTIONS + over)]
    try:
        start = time.monotonic()
        text = served.scrape(timeout=httpd.DEADLINE_S)  # answered before the idle ones time out
        took = time.monotonic() - start
        assert samples(text, "gpuhook_gpu_holders"), text
        assert proc_status(served.metrics_pid())["Threads"] == "1"
        closed = wait_closed(idle, timeout=httpd.DEADLINE_S * 3)
        print(f"a scrape behind {len(idle)} idle connections: {took * 1000:.0f} ms")
        assert sum(t < httpd.DEADLINE_S / 2 for t in closed) >= over  # evicted, not timed out
    finally:
        for sock in idle:
            sock.close()


def test_a_slow_loris_connection_is_dropped_at_the_deadline(served: Rig) -> None:
    """Issue #31: a request head trickled a header line at a time never ends: the server drops the connection at
    its deadline, unanswered, whatever it keeps sending."""
    with socket.create_connection(served.address()) as loris:
        start = time.monotonic()
        loris.sendall(b"GET /metrics HTTP/1.1\r\nHost: gpuhook\r\n")
        with selectors.DefaultSelector() as waiting:
            waiting.register(loris, selectors.EVENT_READ)
            while not waiting.select(0.25):  # no answer yet: one more header line (the trickle's pace)
                assert time.monotonic() - start < httpd.DEADLINE_S * 3, "the slow connection is still served"
                loris.sendall(b"X-Slow: 1\r\n")
        dropped = time.monotonic() - start
        assert loris.recv(4096) == b""
    print(f"a slow-loris connection dropped after {dropped:.2f} s (deadline {httpd.DEADLINE_S:g} s)")
    assert httpd.DEADLINE_S - 0.5 < dropped < httpd.DEADLINE_S * 2


def test_concurrent_scrapes_count_each_start_in_a_growing_log_once(served: Rig) -> None:
    """Issue #31: rounds of scrapers at once (two Prometheus servers are enough to overlap), the log gaining starts
    before and during each round: the counter then is exactly the starts written."""
    rounds, scrapers, batch = 25, 8, 20
    line = json.dumps({"event": "applied", "served_by": "test-writer", "total_ms": 25.0}).encode() + b"\n"
    log = os.open(served.log_file(), os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)

    def write() -> None:
        os.write(log, line * batch)  # whole lines, as gpuhook's processes append them

    together = threading.Barrier(scrapers, action=write)
    errors: list[BaseException] = []

    def scrape(first: bool) -> None:
        try:
            for _ in range(rounds):
                together.wait(timeout=60)
                if first:
                    write()  # while the others' scrapes read
                served.scrape()
        except BaseException as err:  # noqa: BLE001  (reported by the test's thread)
            errors.append(err)
            together.abort()

    threads = [threading.Thread(target=scrape, args=(n == 0,)) for n in range(scrapers)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        os.close(log)
    assert not errors, errors
    counted = samples(served.scrape(), "gpuhook_container_starts_total")
    assert counted[(("gpus", "yes"), ("result", "ok"), ("served_by", "test-writer"))] == rounds * batch * 2


def test_the_endpoint_serves_unprivileged_and_still_reports_the_ledger_and_the_log(served: Rig) -> None:
    """Issue #31: the process that talks to the scrapers is nobody (ids, groups, capabilities), holds no fd of
    gpuhook's log, and still serves the lease a GPU start took and the start it logged (its root child reads
    them)."""
    a = served.run(GPU0)
    assert served.site.started(a) == {0}
    pid, nobody = served.metrics_pid(), pwd.getpwnam("nobody")
    status = proc_status(pid)
    assert status["Uid"].split() == [str(nobody.pw_uid)] * 4 and status["Gid"].split() == [str(nobody.pw_gid)] * 4
    assert status["Groups"] == "" and int(status["CapEff"], 16) == 0 and status["NoNewPrivs"] == "1"
    held = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    assert str(served.log_file()) not in held
    lease = (("container_id", a.id), ("gpu", "0"), ("mig_uuid", ""), ("uuid", served.site.host.gpus[0].uuid))

    def reported() -> bool:
        text = served.scrape()
        starts = samples(text, "gpuhook_container_starts_total")
        return (samples(text, "gpuhook_container_gpu_info").get(lease) == 1
                and starts.get((("gpus", "yes"), ("result", "ok"), ("served_by", "gpuhookd"))) == 1)
    wait_for("the endpoint reports the lease and the start", reported, timeout=SCRAPE_WAIT_S)

"""Prometheus metrics of gpuhook: every start, the GPUs and who holds them (issue 18).

gpuhookd serves them from a process of its own (``serve``, forked at its start when
``metrics_listen`` is set): the starts never talk to it, so a dead or stopped metrics process
cannot slow one. It talks to whoever connects as SERVE_AS, through ``httpd`` (bounded connections
and time); its root child computes the text at each scrape (``Collector``), one at a time, read-only:

* **counters** from gpuhook's own log (``log_file``): each start logs its outcome there, whether a
  gpuhookd worker served it or the hook did it in-process, so both are counted without the start
  paying for metrics. The log is read incrementally, from its start (a rotated log starts over:
  the counters keep counting in this process, and Prometheus takes a restarted process's reset);
* **gauges** from the lease ledger and the cached inventory: the GPUs, their policy, their
  holders, the MIG instances, the MPS daemons;
* GPU memory per container from NVML's running-process lists, each process mapped to the
  container whose init's cgroup holds it.

``gpuhook status --prometheus`` renders the same text once (for node-exporter's textfile
collector). The names in ``METRICS`` are the contract (packaging/grafana/ is checked against them).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO, Final, NoReturn

from gpuhook import service
from gpuhook.errors import ConfigError

if TYPE_CHECKING:
    import pwd

    from prometheus_client.registry import Collector as _Base

    from gpuhook.config import Config
else:
    _Base = object

#: Every metric family the endpoint serves (histograms add _bucket, _sum and _count series).
METRICS: Final = (
    "gpuhook_container_starts_total",
    "gpuhook_refusals_total",
    "gpuhook_start_duration_seconds",
    "gpuhook_inventory_cache_total",
    "gpuhook_gpu_info",
    "gpuhook_gpu_holders",
    "gpuhook_container_gpu_info",
    "gpuhook_mig_instances",
    "gpuhook_mps_daemon_up",
    "gpuhook_mps_daemon_ok",
    "gpuhook_container_gpu_memory_used_bytes",
)

#: GPU start durations: buckets that resolve 10-200 ms, and the tail.
BUCKETS: Final = (0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
#: The refusal reasons by error class, for log lines older than the events' own ``reason`` (a refusal is the
#: container's request being turned down).
REASONS: Final = {
    "UnknownDeviceError": "unknown_device", "RequirementError": "requirement", "UnhealthyGpuError": "unhealthy",
    "BusyError": "busy", "PolicyError": "policy", "RequestError": "bad_request", "SpecError": "bad_spec",
}
#: The reasons that are refusals; any other reason is gpuhook's own failure (result ``error``).
REFUSALS: Final = frozenset({*REASONS.values(), "mig_no_room"})
#: Inventory cache outcomes (discovery.Outcome) as hit, miss or rebuild.
_CACHE: Final = {"hit": "hit", "refresh": "rebuild", "mig-changed": "rebuild"}
#: A log larger than this is read from its last part only, the first time.
_FIRST_READ_LIMIT: Final = 64 << 20
#: Who the endpoint's process serves as: it reads what any local user sends it, so it keeps nothing of root's
#: (what it serves, its root child reads).
SERVE_AS: Final = "nobody"


@dataclass(frozen=True, slots=True)
class Counts:
    """The counters as one ``LogCounters.update`` left them (a copy: later scrapes do not change it)."""

    starts: dict[tuple[str, str, str], int]
    refusals: dict[str, int]
    cache: dict[str, int]
    buckets: tuple[int, ...]
    duration_sum: float
    duration_count: int


@dataclass(slots=True)
class LogCounters:
    """The start counters, kept up to date from the log file's new lines at each call of ``update``."""

    path: str | None
    starts: dict[tuple[str, str, str], int] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)
    cache: dict[str, int] = field(default_factory=dict)
    buckets: list[int] = field(default_factory=lambda: [0] * len(BUCKETS))
    duration_sum: float = 0.0
    duration_count: int = 0
    _inode: int | None = None
    _offset: int = 0
    _partial: bytes = b""
    #: held from reading the saved offset to counting the lines read: two scrapes at once must neither count
    #: the same lines twice nor lose any
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def update(self) -> Counts:
        """Count the lines logged since the last call (from the start after a rotation); the counts then."""
        with self._lock:
            self._read_new()
            return Counts(dict(self.starts), dict(self.refusals), dict(self.cache), tuple(self.buckets),
                          self.duration_sum, self.duration_count)

    def _read_new(self) -> None:
        if self.path is None:
            return
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return
        with os.fdopen(fd, "rb") as log:
            st = os.fstat(log.fileno())
            if st.st_ino != self._inode or st.st_size < self._offset:
                self._inode, self._partial = st.st_ino, b""
                self._offset = max(0, st.st_size - _FIRST_READ_LIMIT) if self._offset == 0 else 0
            log.seek(self._offset)
            data = self._partial + log.read()
            self._offset = log.tell()
        *lines, self._partial = data.split(b"\n")
        for line in lines:
            self._count(line)

    def _count(self, line: bytes) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            return
        if not isinstance(event, dict):
            return
        name, served_by = event.get("event"), str(event.get("served_by") or "hook")
        if name == "applied" and isinstance(event.get("total_ms"), int | float):
            self._start("ok", served_by, "yes")
            self._observe(event["total_ms"] / 1000)
        elif name == "no_gpu_requested":
            self._start("ok", served_by, "no")
        elif name == "hook_failed":
            given = event.get("reason")  # the error class's own; an older line has only the class name
            reason = given if isinstance(given, str) and given else REASONS.get(str(event.get("kind")))
            refusal = reason if reason in REFUSALS else None
            self._start("refused" if refusal else "error", served_by, "no" if refusal == "bad_spec" else "yes")
            if refusal:
                self.refusals[refusal] = self.refusals.get(refusal, 0) + 1
        elif name == "host_discovered":
            result = _CACHE.get(str(event.get("cache")), "miss")
            self.cache[result] = self.cache.get(result, 0) + 1

    def _start(self, result: str, served_by: str, gpus: str) -> None:
        key = (result, served_by, gpus)
        self.starts[key] = self.starts.get(key, 0) + 1

    def _observe(self, seconds: float) -> None:
        self.duration_sum += seconds
        self.duration_count += 1
        for n, bound in enumerate(BUCKETS):
            if seconds <= bound:
                self.buckets[n] += 1


class Collector(_Base):
    """prometheus_client's custom collector: every family in METRICS, computed at each scrape."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.counters = LogCounters(str(config.log_file) if config.log_file else None)

    def collect(self) -> Iterator[Any]:
        """The families, from the log's new lines, the ledger and the inventory as they are now."""
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        counters = self.counters.update()
        starts = CounterMetricFamily("gpuhook_container_starts", "Container starts gpuhook saw, by outcome",
                                     labels=("result", "served_by", "gpus"))
        for (result, served_by, gpus), value in sorted(counters.starts.items()):
            starts.add_metric((result, served_by, gpus), value)
        yield starts
        refusals = CounterMetricFamily("gpuhook_refusals", "Container starts refused, by reason", labels=("reason",))
        for reason, value in sorted(counters.refusals.items()):
            refusals.add_metric((reason,), value)
        yield refusals
        cumulative = [(str(bound), count) for bound, count in zip(BUCKETS, counters.buckets, strict=True)]
        yield HistogramMetricFamily("gpuhook_start_duration_seconds", "GPU container starts, hook's own time",
                                    buckets=[*cumulative, ("+Inf", counters.duration_count)],
                                    sum_value=counters.duration_sum)
        cache = CounterMetricFamily("gpuhook_inventory_cache", "Inventory lookups of GPU starts", labels=("result",))
        for result, value in sorted(counters.cache.items()):
            cache.add_metric((result,), value)
        yield cache
        yield from host_families(self.config)


def host_families(config: Config) -> Iterator[Any]:
    """The gauges of the GPUs, their holders, MIG instances, MPS daemons and memory per container."""
    from prometheus_client.core import GaugeMetricFamily as gauge  # noqa: N813  (read as the constructor it is)

    view = service.usage_view(config)
    info = gauge("gpuhook_gpu_info", "A GPU of this host and its sharing policy",
                 labels=("gpu", "uuid", "model", "sharing"))
    holders = gauge("gpuhook_gpu_holders", "Containers holding the GPU (whole or a MIG device on it)",
                    labels=("gpu", "uuid"))
    held = gauge("gpuhook_container_gpu_info", "Leases of a container id on a GPU or MIG device (one per container)",
                 labels=("container_id", "gpu", "uuid", "mig_uuid"))
    mig = gauge("gpuhook_mig_instances", "MIG devices that exist now", labels=("gpu", "profile", "created_by_gpuhook"))
    mps = gauge("gpuhook_mps_daemon_up", "gpuhook's MPS daemon of the GPU runs", labels=("gpu",))
    memory = gauge("gpuhook_container_gpu_memory_used_bytes", "GPU memory the container's processes use (NVML)",
                   labels=("container_id", "gpu"))
    for gpu in view.gpus:
        info.add_metric((str(gpu.index), gpu.uuid, gpu.model, gpu.sharing), 1)
        holders.add_metric((str(gpu.index), gpu.uuid), len(gpu.holders))
        if gpu.mps_up is not None:
            mps.add_metric((str(gpu.index),), 1 if gpu.mps_up else 0)
    # containers of one id (other runc roots, namespaces) on one device are one label set: counted, never two
    # samples of it, which Prometheus would refuse the whole scrape for
    devices = Counter((lease.container_id, str(lease.gpu), lease.uuid, lease.mig_uuid) for lease in view.leases)
    for labels, count in sorted(devices.items()):
        held.add_metric(labels, count)
    for (parent, profile, created), count in sorted(view.mig_instances.items()):
        mig.add_metric((str(parent), profile, "true" if created else "false"), count)
    for (container_id, on), used in sorted(view.memory.items()):
        memory.add_metric((container_id, str(on)), used)
    yield from (info, holders, held, mig, mps, memory, _mps_ok(config))


def _mps_ok(config: Config) -> Any:
    """1 while the daemon behind a GPU's MPS pipes is gpuhook's recorded one with its limits, else 0."""
    from prometheus_client.core import GaugeMetricFamily

    from gpuhook.errors import GpuHookError

    family = GaugeMetricFamily("gpuhook_mps_daemon_ok", "The MPS daemon behind the GPU's pipes is gpuhook's, "
                               "with the policy's limits", labels=("gpu", "uuid"))
    try:
        inventory = service.host_inventory(config).inventory
        checks = service.mps_checks(config, inventory)
    except GpuHookError:  # no ledger to read, no nvidia-cuda-mps-control: no daemon to judge
        return family
    index = {g.uuid: g.index for g in inventory.gpus}
    for uuid, problems in sorted(checks.items()):
        family.add_metric((str(index.get(uuid, "")), uuid), 0 if problems else 1)
    return family


def render(config: Config) -> bytes:
    """The exposition text once (``gpuhook status --prometheus``): the log's counters read whole."""
    return _renderer(config)()


def _renderer(config: Config) -> Callable[[], bytes]:
    """The exposition text at each call, the log's counters kept from call to call."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector(config))
    return lambda: bytes(generate_latest(registry))


def serve(config: Config) -> None:
    """Serve the endpoint on ``config.metrics_listen`` until killed (the metrics process's body).

    As root: bind the port and fork the collector (``_collect``), which stays root to read the ledger, the
    log and NVML, one scrape at a time. Then become SERVE_AS, holding only the port and the socket to the
    collector, and serve (``httpd``: bounded connections and time), each scrape's text asked of the collector.
    """
    import pwd
    import signal

    from prometheus_client.exposition import CONTENT_TYPE_LATEST

    from gpuhook.daemon import httpd
    from gpuhook.sys import process

    assert config.metrics_listen is not None
    try:
        user = pwd.getpwnam(SERVE_AS)
    except KeyError:
        raise ConfigError(f"the metrics endpoint serves as the user {SERVE_AS!r}, which this host lacks. Fix: "
                          f"create it (adduser --system {SERVE_AS}) or unset metrics_listen") from None
    host, _, port = config.metrics_listen.rpartition(":")
    host = host.strip("[]")
    listener = socket.create_server((host, int(port)), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    ours, theirs = socket.socketpair()
    gpuhookd = os.getppid()
    if os.fork() == 0:
        listener.close()
        ours.close()
        _collect(theirs, config)
    theirs.close()
    _become(user, keep=(listener.fileno(), ours.fileno()))
    process.prctl(process.PR_SET_PDEATHSIG, signal.SIGTERM)  # the credential change cleared gpuhookd's
    if os.getppid() != gpuhookd:
        return  # gpuhookd ended before: end with it
    answers = ours.makefile("rb")
    httpd.serve(listener, httpd.Page("/metrics", CONTENT_TYPE_LATEST, lambda: _ask(ours, answers)))


def _become(user: pwd.struct_passwd, *, keep: tuple[int, ...]) -> None:
    """Become *user* for good (real, effective and saved ids, no supplementary groups, no new privileges),
    holding no fd of gpuhookd's but stdio and *keep*. The others (its log file open for writing among them)
    are pointed at /dev/null rather than closed: a number closed under an object that still believes it
    owns it could be reused, and later closed under a connection."""
    from gpuhook.sys import process

    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    for fd in map(int, os.listdir("/proc/self/fd")):
        if fd > 2 and fd != null and fd not in keep:
            with contextlib.suppress(OSError):  # the listing's own fd, closed by now
                os.dup2(null, fd)
    os.close(null)
    os.setgroups([])
    os.setresgid(user.pw_gid, user.pw_gid, user.pw_gid)
    os.setresuid(user.pw_uid, user.pw_uid, user.pw_uid)
    process.prctl(process.PR_SET_NO_NEW_PRIVS, 1)
    process.prctl(process.PR_SET_DUMPABLE, 0)  # other processes of SERVE_AS may not ptrace it or read its memory


def _ask(collector: socket.socket, answers: BinaryIO) -> bytes:
    """One scrape's text from the collector; RuntimeError with its line if it failed, SystemExit if it ended."""
    collector.sendall(b"?")
    head = answers.read(9)  # ok or not, and the text's size
    size = int.from_bytes(head[1:], "big") if len(head) == 9 else -1
    text = answers.read(size) if size >= 0 else b""
    if len(text) != size:
        raise SystemExit("its collector (a child process) ended")
    if not head[0]:
        raise RuntimeError(text.decode(errors="replace"))
    return text


def _collect(server: socket.socket, config: Config) -> NoReturn:
    """The collector's body (root, one thread): for each byte the server sends, a scrape's text (or why not),
    until the server ends. One scrape at a time, so the counters count each log line once."""
    make = _renderer(config)
    with contextlib.suppress(OSError):
        while server.recv(1):
            try:
                ok, text = 1, make()
            except Exception as err:  # noqa: BLE001  (the scrape fails with its line; the next may succeed)
                ok, text = 0, str(err).encode()
            server.sendall(bytes([ok]) + len(text).to_bytes(8, "big") + text)
    os._exit(0)

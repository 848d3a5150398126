"""`make bench`: what gpuhook adds to a real ``runc run``, on simulated GPU hosts.

``python -m integration.bench [--runs N] [--out FILE]`` (root: it makes device nodes and runs runc).

Every scenario runs a busybox ``/bin/true`` container with ``runc run`` from a fresh copy of the
rootfs (copied outside the timed region, as an engine's overlay gives each container a fresh
upper layer), on a journaled ext4 of its own (``integration.scratchfs`` says why); the image rows
run a CUDA runtime-sized image (``library_image``: the host's own libraries) on overlayfs, as
engines mount an image. Scenarios are interleaved round-robin, after one untimed warm-up round that
also builds each host's inventory cache, so drift on a noisy VM hits all of them alike, and a ratio
is the median over rounds of a run's time ÷ bare runc's in the same round. The rows whose targets
are a few percent of a start (no GPU, its poststop, the no-op hooks) or a difference of two milliseconds
(1 GPU, an existing MIG device, an MPS client) and bare runc (``Scenario.close``) then run
``CLOSE_FACTOR`` − 1 times as many rounds again, of just them. Wall time is
``integration.engines.run_container``'s ``duration_s``: the whole ``runc run`` plus the rig's
sub-millisecond leftover check.

The hook runs from a regular (non-editable) install of this checkout, as ``pip install`` makes
it in production: the dev venv's editable-install finder imports pathlib, urllib and importlib
at every interpreter start, ~10 ms that no user pays. Its dependencies come from the running
environment through a plain directory line in a ``.pth`` file, which costs nothing at start-up.

The hook is registered as the packages register it: gpuhook-relay (built by relay/build.sh
beside that install's ``gpuhook`` launcher), served by a gpuhookd started once, as systemd's
gpuhookd.socket would; its spares prepare between runs, at the lowest priority, as they would
between container starts. The 8-GPU start with the cache off calls NVML on every start (the mock
answers in microseconds, a real NVML without persistence mode in seconds).

References: the interpreter floor (a hook that is ``python -I -c pass``: what any Python hook
costs before its first import), and the Python hook (packaging/gpuhook-hook) registered instead
of the relay: on a no-GPU container, through gpuhookd, and without gpuhookd (importing the GPU
path: what every start costs where the daemon is not running).

The hook's own wall time and peak RSS come from separate, instrumented runs (not the timed
ones, so the instrument cannot skew them): a small wrapper starts the hook with
``posix_spawn`` and reads ``ru_maxrss`` from ``wait4``, which on Linux covers the hook and the
apply child it forks and reaps. Through gpuhookd, the worker's peak RSS is what it logs. The
hook's log gives its step timings (``ms`` of discovery and apply, ``total_ms`` from the GPU
path's start, so without interpreter start and CLI imports).
NVML calls per start are the lines the mock NVML appends to the host's ``calls.log`` during
each timed run. Finally ``-X importtime`` of the no-GPU path lists its most costly imports.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import datetime
import json
import math
import os
import platform
import shutil
import stat
import statistics
import subprocess
import sys
import threading
import time
import venv
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from integration.benchdocker import measure_docker
from integration.engines import default_spec, require_tool, run_container, unique_id, write_bundle
from integration.fakehost import FakeHost, create_host
from integration.gpuhookd import Gpuhookd
from integration.relay import install_relay, relay_for, runtime_for
from integration.rootfs import MULTIARCH, build_rootfs, copy_rootfs, mount_image
from integration.scratchfs import scratch_filesystem, tmpfs, unmount

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / ".cache" / "bench" / "results.json"
LAUNCHER = REPO / "packaging" / "gpuhook-hook"
WORK = REPO / ".cache" / "bench" / "work"
#: the ledgers' state dirs, on a tmpfs of their own as /run is on a real host (this VM's /run is its root ext4);
#: not in /dev/shm, which an MPS daemon gets replaced by its own
STATE_TMPFS = Path("/run/gpuhook-bench")
SCRATCH_IMAGE = Path("/dev/shm/gpuhook-bench-rootfs.img")
HOOK_ENV = ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]
COMPUTE = "compute,utility"
#: library names in a CUDA runtime image's library directories (nvidia/cuda:12 runtime on Ubuntu: ~200)
IMAGE_LIBRARIES = 200
#: timed runs per scenario: a run here varies by ±20% (bare runc 28–50 ms in one bench), so a median of
#: 15 moved a ratio by ~0.1 from one bench to the next; 40 about halve that (a bench: under 3 minutes)
RUNS = 40
#: The rows whose targets sit within a few percent of bare runc (``Scenario.close``) and bare runc itself get
#: this many times the runs, in extra rounds of just them: bare runc alone spans 24–51 ms in 80 runs here, so
#: a median of 40 moves a ratio by ±0.05 (a 1.1 target is 3.5 ms); 200 runs bring that near ±0.02.
CLOSE_FACTOR = 5
INSTRUMENTED_RUNS = 5
IMPORTTIME_RUNS = 5

# Started by the instrumented runs in place of the hook: spawn it, wait4 for its rusage, record.
# Runs with -I -S: nothing but the interpreter itself.
_WRAPPER = """\
import json, os, sys, time
record, argv = sys.argv[1], sys.argv[2:]
start = time.perf_counter()
pid = os.posix_spawn(argv[0], argv, os.environ)
_, status, usage = os.wait4(pid, 0)
wall_ms = (time.perf_counter() - start) * 1000
with open(record, "a") as out:
    out.write(json.dumps({"wall_ms": wall_ms, "maxrss_kib": usage.ru_maxrss}) + "\\n")
sys.exit(os.waitstatus_to_exitcode(status))
"""


class BenchError(RuntimeError):
    """A benchmark container did not run as expected."""


@dataclass(frozen=True, slots=True)
class Scenario:
    """One kind of container start."""

    name: str
    title: str
    host: FakeHost | None = None
    env: tuple[str, ...] = ()
    #: the hook's argv, program first (None: no hook)
    hook_argv: tuple[str, ...] | None = None
    #: devices and mounts written into config.json (the static floor)
    static: dict[str, Any] | None = None
    #: with a valid cache NVML must not be called
    cached: bool = False
    #: the hook is registered for poststop too (as the packages do), its argv's stage word (if any) replaced
    poststop: bool = False
    #: the runc wrapper that runs the container (gpuhook-runtime, as docker --runtime nvidia runs it), or runc
    wrapper: Path | None = None
    #: the hook's environment beyond PATH
    hook_env: tuple[str, ...] = ()
    #: a container asking for the same GPUs keeps running through all the runs (started before them,
    #: deleted after), so each run is its GPU's second client (an MPS daemon already up)
    held: bool = False
    #: the rootfs is this image on overlayfs (a fresh upper layer per run, as engines mount images),
    #: not a copy of the small test rootfs
    image: Path | None = None
    #: a row whose target is a few percent of a start or a couple of milliseconds of one, or bare runc (the
    #: reference of the first kind): CLOSE_FACTOR times the runs
    close: bool = False


@dataclass(slots=True)
class Samples:
    """What the runs of one scenario measured."""

    wall_ms: list[float] = field(default_factory=list)
    nvml_calls: list[int] = field(default_factory=list)
    hook_ms: list[float] = field(default_factory=list)
    #: per instrumented run served by gpuhookd: the hook's wall time less the daemon's served time
    outside_ms: list[float] = field(default_factory=list)
    maxrss_kib: list[int] = field(default_factory=list)
    #: per timed run, the hook log's step timings (discovery, apply, total from run_hook's start)
    log_ms: list[dict[str, float]] = field(default_factory=list)


# --- set-up -------------------------------------------------------------------------------------


def install_hook(dest: Path) -> Path:
    """A venv with a regular install of this checkout's gpuhook; returns its python."""
    venv.create(dest, with_pip=False, symlinks=True, clear=True)
    site = next((dest / "lib").glob("python3*/site-packages"))
    shutil.copytree(REPO / "gpuhook", site / "gpuhook", ignore=shutil.ignore_patterns("__pycache__"))
    deps = [p for p in sys.path if p.endswith("site-packages")]
    (site / "gpuhook-deps.pth").write_text("".join(f"{p}\n" for p in deps))
    compileall.compile_dir(site / "gpuhook", quiet=1)  # the hook runs as root and would write them anyway
    return dest / "bin" / "python"


def write_config(path: Path, host: FakeHost, *, cache: bool, leases: bool = True, metrics: str | None = None,
                 gpus: Sequence[dict[str, Any]] = ()) -> Path:
    """A production-like config for *host*: info-level log, cache and lease ledger in the host's /run (or none),
    gpuhookd's metrics endpoint on *metrics* (HOST:PORT) or none, the per-GPU sharing policy *gpus* (or none)."""
    cache_dir = json.dumps(str(host.root / "run" / "gpuhook")) if cache else "null"
    state_dir = json.dumps(str(STATE_TMPFS / path.stem)) if leases else "null"
    path.write_text(
        f"driver_root: {json.dumps(str(host.root))}\n"
        f"dev_root: {json.dumps(str(host.root))}\n"
        f"proc_root: {json.dumps(str(host.root))}\n"
        f"log_file: {json.dumps(str(host.root / 'gpuhook.log'))}\n"
        "log_level: info\n"
        f"cache_dir: {cache_dir}\n"
        f"state_dir: {state_dir}\n"
        + (f"metrics_listen: {metrics}\n" if metrics else "")
        + (f"gpus: {json.dumps(list(gpus))}\n" if gpus else "")  # JSON is YAML too
    )
    return path


def static_floor(python: Path, config: Path, env: Sequence[str], rootfs_src: Path, work: Path) -> dict[str, Any]:
    """The devices, cgroup rules and bind mounts of ``gpuhook plan`` as config.json entries."""
    bundle = work / "plan-bundle"
    shutil.rmtree(bundle, ignore_errors=True)
    copy_rootfs(rootfs_src, bundle / "rootfs")
    write_bundle(bundle, default_spec("rootfs", ["/bin/true"], list(env)))
    out = subprocess.run([str(python), "-I", "-m", "gpuhook", "--config", str(config), "plan", "--bundle", str(bundle)],
                         capture_output=True, text=True, check=True, env={"PATH": "/usr/bin:/bin"})
    shutil.rmtree(bundle)
    plan = json.loads(out.stdout)["plan"]
    return {
        "devices": [{"path": d["path"], "type": "c", "major": d["major"], "minor": d["minor"],
                     "fileMode": d["mode"], "uid": 0, "gid": 0} for d in plan["devices"]],
        "rules": [{"allow": True, "type": "c", "major": d["major"], "minor": d["minor"], "access": "rw"}
                  for d in plan["devices"]],
        "mounts": [{"destination": m["target"], "type": "bind", "source": m["source"],
                    "options": ["bind", "ro", "nosuid", "nodev", *(["noexec"] if m["noexec"] else [])]}
                   for m in plan["mounts"]],
    }


def make_spec(scenario: Scenario, wrapper: tuple[str, ...] = (),
              process: Sequence[str] = ("/bin/true",)) -> dict[str, Any]:
    """config.json for one run of *scenario* (*wrapper*: argv that starts the hook instrumented), running
    *process*."""
    hooks = None
    if scenario.hook_argv is not None:
        args = [*wrapper, *scenario.hook_argv]
        env = [*HOOK_ENV, *scenario.hook_env]
        hooks = {"prestart": [{"path": args[0], "args": args, "env": env}]}
        if scenario.poststop:
            argv = scenario.hook_argv
            stop = [*argv[:-1], "poststop"] if argv[-1] == "prestart" else list(argv)  # a stage word, or a no-op
            hooks["poststop"] = [{"path": stop[0], "args": stop, "env": env}]
    spec = default_spec("rootfs", list(process), list(scenario.env), hooks=hooks, annotations={})
    if scenario.static is not None:
        spec["linux"]["devices"] = scenario.static["devices"]
        spec["linux"]["resources"]["devices"] += scenario.static["rules"]
        spec["mounts"] += scenario.static["mounts"]
    return spec


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


#: The metrics scenarios' endpoint, scraped every second while the runs go on (as Prometheus would).
METRICS_ADDRESS: Final = f"127.0.0.1:{_free_port()}"


def scrape_every_second(stop: threading.Event) -> None:
    """GET the metrics endpoint once a second until *stop* is set (a failed scrape is not the bench's concern)."""
    import urllib.request

    while not stop.wait(1.0):
        try:
            with urllib.request.urlopen(f"http://{METRICS_ADDRESS}/metrics", timeout=5) as answer:
                answer.read()
        except OSError:
            pass


def make_scenarios(python: Path, relay: Path, rootfs_src: Path, work: Path,
                   daemon_for: Callable[[Path], str]) -> list[Scenario]:
    """Hosts with 1, 8 and 64 GPUs (built once) and every scenario on them.

    The hook is registered as the packages register it: gpuhook-relay, served by gpuhookd (the
    package enables its socket). References: the Python hook (packaging/gpuhook-hook) with and
    without gpuhookd, what starts cost where the relay or the daemon is not used. gpuhookd serves
    only its own config, so each config gets its daemon (``daemon_for(config)``: its socket).
    """
    hosts = {n: create_host(work / f"host{n}", gpus=n) for n in (1, 8, 64)}
    a100 = create_host(work / "a100", gpus=1, model="NVIDIA A100-SXM4-40GB", mig={0: ()})
    # MIG mode with an instance made beforehand (by an admin or mig-parted): a start just uses it
    a100_made = create_host(work / "a100-made", gpus=1, model="NVIDIA A100-SXM4-40GB", mig={0: ("1g.5gb",)})
    # sharing: mps, so that gpuhook runs the GPU's MPS control daemon (the simulated host's) for its clients
    mps_host = create_host(work / "mps", gpus=1)
    configs = work / "configs"
    configs.mkdir()
    cfg = {n: write_config(configs / f"host{n}.yaml", h, cache=True) for n, h in hosts.items()}
    mig_cfg = write_config(configs / "a100-mig.yaml", a100, cache=True)
    made_cfg = write_config(configs / "a100-made.yaml", a100_made, cache=True)
    mps_cfg = write_config(configs / "mps.yaml", mps_host, cache=True,
                           gpus=[{"device": 0, "sharing": "mps", "replicas": 2}])
    no_cache = write_config(configs / "host8-nocache.yaml", hosts[8], cache=False)
    no_leases = write_config(configs / "host8-noleases.yaml", hosts[8], cache=True, leases=False)
    sandboxed = write_config(configs / "host8-ldconfig.yaml", hosts[8], cache=True)
    with sandboxed.open("a") as extra:
        extra.write("ldconfig_native: false\n")
    image = library_image(rootfs_src, work / "image")
    with_metrics = write_config(configs / "host8-metrics.yaml", hosts[8], cache=True, metrics=METRICS_ADDRESS)
    # gpuhook-runtime finds its config as under dockerd: in its environment, which it inherits from here.
    os.environ["GPUHOOK_CONFIG"] = str(cfg[8])
    os.environ["GPUHOOK_DAEMON_SOCKET"] = daemon_for(cfg[8])  # and gpuhookd's socket, for it and its hooks

    def hook(config: Path) -> tuple[str, ...]:
        return (str(relay), "--config", str(config), "--daemon-socket", daemon_for(config), "prestart")

    def python_hook(config: Path, socket: str | None = None) -> tuple[str, ...]:
        # What the kernel runs for packaging/gpuhook-hook (its shebang is `python -I`).
        return (str(python), "-I", str(LAUNCHER), "--config", str(config), "--daemon-socket",
                socket or daemon_for(config), "prestart")

    def ctr_hook(config: Path) -> tuple[str, ...]:
        # What `ctr run --gpus 0..7` registers: containerd oci-hook fills in the pid and rootfs, then execs
        # nvidia-container-cli (gpuhook-relay under that name, as the packages install it).
        devices = ",".join(str(n) for n in range(8))
        return (require_tool("containerd"), "oci-hook", "--", str(relay_for(relay, "nvidia-container-cli")),
                "--daemon-socket", daemon_for(config), "--load-kmods", "configure", f"--device={devices}",
                "--compute", "--utility", "--pid={{pid}}", "{{rootfs}}")

    def gpus(caps: str) -> tuple[str, ...]:
        return ("NVIDIA_VISIBLE_DEVICES=all", f"NVIDIA_DRIVER_CAPABILITIES={caps}")

    return [
        Scenario("bare", "bare runc (no hook)", close=True),
        Scenario("no-gpu", "hook, container asks for no GPU", hosts[8], hook_argv=hook(cfg[8]), close=True),
        Scenario("gpu1", "hook, 1 GPU, compute,utility", hosts[1], gpus(COMPUTE), hook(cfg[1]), cached=True,
                 close=True),
        Scenario("gpu8", "hook, 8 GPUs, compute,utility", hosts[8], gpus(COMPUTE), hook(cfg[8]), cached=True),
        Scenario("gpu64", "hook, 64 GPUs, compute,utility", hosts[64], gpus(COMPUTE), hook(cfg[64]), cached=True),
        Scenario("gpu8-all", "hook, 8 GPUs, all capabilities", hosts[8], gpus("all"), hook(cfg[8]), cached=True),
        Scenario("bare-image", f"bare runc, a CUDA runtime-sized image ({IMAGE_LIBRARIES} library names) on "
                 "overlayfs", image=image),
        Scenario("gpu8-image", f"hook, 8 GPUs, compute,utility, that image ({IMAGE_LIBRARIES} library names, "
                 "overlayfs)", hosts[8], gpus(COMPUTE), hook(cfg[8]), cached=True, image=image),
        Scenario("gpu8-image-ldconfig", "hook, 8 GPUs, compute,utility, that image, its cache written by the host's "
                 "ldconfig (ldconfig_native: false)", hosts[8], gpus(COMPUTE), hook(sandboxed), cached=True,
                 image=image),
        Scenario("gpu8-nocache", "hook, 8 GPUs, compute,utility, cache off (NVML every start)", hosts[8],
                 gpus(COMPUTE), hook(no_cache)),
        Scenario("gpu8-nolease", "hook, 8 GPUs, compute,utility, leases off (state_dir: null)", hosts[8],
                 gpus(COMPUTE), hook(no_leases), cached=True),
        Scenario("no-gpu-poststop", "hook for prestart and poststop, container asks for no GPU", hosts[8],
                 hook_argv=hook(cfg[8]), poststop=True, close=True),
        Scenario("no-gpu-metrics", "hook, container asks for no GPU, gpuhookd's metrics endpoint on", hosts[8],
                 hook_argv=hook(with_metrics)),
        Scenario("gpu8-metrics", "hook, 8 GPUs, compute,utility, gpuhookd's metrics endpoint on (scraped)", hosts[8],
                 gpus(COMPUTE), hook(with_metrics), cached=True),
        Scenario("mig-on-demand", "hook for prestart and poststop, MIG on demand: 0,mig=1g.5gb made at the "
                 "start, destroyed at poststop (A100-40GB)", a100, ("NVIDIA_VISIBLE_DEVICES=0,mig=1g.5gb",
                                                                    f"NVIDIA_DRIVER_CAPABILITIES={COMPUTE}"),
                 hook(mig_cfg), poststop=True),
        Scenario("mig-existing", "hook, an existing MIG device (0:0, a 1g.5gb instance) of an A100-40GB in MIG mode, "
                 "compute,utility", a100_made, ("NVIDIA_VISIBLE_DEVICES=0:0", f"NVIDIA_DRIVER_CAPABILITIES={COMPUTE}"),
                 hook(made_cfg), cached=True, close=True),
        Scenario("mps-client", "hook for prestart and poststop, an MPS client: the second container of a GPU with "
                 "sharing: mps (replicas 2; a holder keeps its daemon up), compute,utility", mps_host,
                 ("NVIDIA_VISIBLE_DEVICES=0", f"NVIDIA_DRIVER_CAPABILITIES={COMPUTE}"), hook(mps_cfg), cached=True,
                 poststop=True, held=True, close=True),
        Scenario("ctr-gpu8", "ctr run --gpus 0..7 (containerd oci-hook → nvidia-container-cli configure, served by "
                 "gpuhookd), compute,utility", hosts[8], hook_argv=ctr_hook(cfg[8]),
                 hook_env=(f"GPUHOOK_CONFIG={cfg[8]}",), cached=True),
        Scenario("runtime-no-gpu", "gpuhook-runtime as the runtime (docker --runtime nvidia), container asks for "
                 "no GPU", hosts[8], wrapper=runtime_for(relay)),
        Scenario("runtime-gpu8", "gpuhook-runtime as the runtime, 8 GPUs compute,utility (gpuhookd edits the spec "
                 "and serves its hooks)", hosts[8], gpus(COMPUTE), wrapper=runtime_for(relay)),
        Scenario("static8", "static floor: 8 GPUs' devices + mounts in config.json, no hook", hosts[8],
                 static=static_floor(python, cfg[8], gpus(COMPUTE), rootfs_src, work)),
        Scenario("hook-floor", "reference: hook = busybox `true`, a static no-op (what running any hook costs runc)",
                 hook_argv=(shutil.which("busybox") or "/bin/busybox", "true"), close=True),
        Scenario("hook-floor-poststop", "reference: busybox `true` as the prestart and the poststop hook (what two "
                 "hooks cost runc)", hook_argv=(shutil.which("busybox") or "/bin/busybox", "true"), poststop=True,
                 close=True),
        Scenario("python-floor", "reference: hook = `python -I -c pass` (interpreter floor)",
                 hook_argv=(str(python), "-I", "-c", "pass")),
        Scenario("no-gpu-python", "reference: Python hook, no GPU (no daemon involved)", hosts[8],
                 hook_argv=python_hook(cfg[8])),
        Scenario("no-gpu-python-poststop", "reference: Python hook for prestart and poststop, no GPU", hosts[8],
                 hook_argv=python_hook(cfg[8]), poststop=True),
        Scenario("gpu8-python", "reference: Python hook through gpuhookd, 8 GPUs", hosts[8], gpus(COMPUTE),
                 python_hook(cfg[8]), cached=True),
        Scenario("gpu8-nodaemon", "reference: Python hook without gpuhookd, 8 GPUs (in-process)", hosts[8],
                 gpus(COMPUTE), python_hook(cfg[8], "none"), cached=True),
    ]


# --- running --------------------------------------------------------------------------------------


def run_once(scenario: Scenario, spec: dict[str, Any], rootfs_src: Path, bundle: Path,
             ) -> tuple[float, int, dict[str, float]]:
    """One ``runc run``: its wall time in ms, the NVML calls it caused and the hook's logged timings."""
    if scenario.image is None:
        copy_rootfs(rootfs_src, bundle / "rootfs")
    else:
        mount_image(scenario.image, bundle)
    write_bundle(bundle, spec)
    host = scenario.host
    log = host.root / "gpuhook.log" if host else None
    calls_before = len(host.nvml_calls()) if host else 0
    log_before = log.stat().st_size if log and log.exists() else 0
    try:
        result = run_container("runc", bundle, unique_id("bench"), wrapper=scenario.wrapper)
    finally:
        if scenario.image is not None:
            unmount(bundle / "rootfs")
        shutil.rmtree(bundle, ignore_errors=True)
    if result.returncode != 0:
        raise BenchError(f"{scenario.name}: runc run failed ({result.returncode}): {result.stderr.strip()}")
    calls = sum(count for _, count in host.nvml_calls()[calls_before:]) if host else 0
    return result.duration_s * 1000, calls, _logged_timings(log, log_before)


def library_image(rootfs_src: Path, dest: Path, names: int = IMAGE_LIBRARIES) -> Path:
    """An image the size of a CUDA runtime one: the test rootfs and, in /usr/lib/<multiarch>, about *names*
    library names of the host's own (its first regular files under 400 KiB by name, each with the links to it
    there), and the ld.so.cache the host's ldconfig makes of it, as an image's build leaves one."""
    copy_rootfs(rootfs_src, dest)
    listing = sorted(os.scandir(Path("/usr/lib") / MULTIARCH), key=lambda e: e.name)
    links: dict[str, list[str]] = {}
    for entry in listing:
        if entry.is_symlink() and ".so" in entry.name:
            links.setdefault(os.path.basename(os.readlink(entry.path)), []).append(entry.name)
    libdir = dest / "usr" / "lib" / MULTIARCH
    libdir.mkdir(parents=True, exist_ok=True)
    count = 0
    for entry in listing:
        if count >= names:
            break
        if not (entry.name.startswith("lib") and ".so" in entry.name and entry.is_file(follow_symlinks=False)
                and entry.stat(follow_symlinks=False).st_size < 400 << 10):
            continue
        shutil.copy2(entry.path, libdir / entry.name)
        for link in links.get(entry.name, ()):
            (libdir / link).symlink_to(entry.name)
        count += 1 + len(links.get(entry.name, ()))
    (dest / "etc" / "ld.so.conf.d").mkdir(exist_ok=True)
    (dest / "etc" / "ld.so.conf.d" / f"{MULTIARCH}.conf").write_text(f"/usr/lib/{MULTIARCH}\n")
    subprocess.run([require_tool("ldconfig"), "-r", str(dest)], check=True, capture_output=True)
    return dest


def _logged_timings(log: Path | None, offset: int) -> dict[str, float]:
    """discovery_ms, lease_ms (reserving the lease; activating it is part of apply_ms), apply_ms and
    total_ms from the events the hook logged past *offset*, and the peak RSS of the gpuhookd worker
    that did the work (if one did)."""
    if log is None or not log.exists():
        return {}
    with log.open("rb") as handle:
        handle.seek(offset)
        # whole lines only: gpuhookd may be writing the line of a notice the relay did not wait for
        whole = handle.read().rpartition(b"\n")[0]
        events = [json.loads(line) for line in whole.splitlines() if line.strip()]
    out = {}
    for event in events:
        if event.get("event") == "host_discovered":
            out["discovery_ms"] = event["ms"]
        elif event.get("event") == "lease_reserved":
            out["lease_ms"] = event["ms"]
        elif event.get("event") == "mps_daemon":
            out["mps_daemon_pid"] = event["pid"]
        elif event.get("event") == "mig_created":
            out["mig_ms"] = event["ms"]
        elif event.get("event") == "applied":
            out["apply_ms"], out["total_ms"] = event["ms"], event["total_ms"]
            out.update({f"step:{step}": ms for step, ms in event.get("steps_ms", {}).items()})
            if event.get("served_by") == "gpuhookd":
                out["worker_rss_mib"], out["apply_page_faults"] = event["peak_rss_mib"], event["apply_page_faults"]
        elif event.get("event") == "request_served":  # gpuhookd's side of the exchange, around the start
            out["served_ms"], out["page_faults"] = event["ms"], event["page_faults"]
            out.update({f"served:{step}": ms for step, ms in event["steps_ms"].items() if step != "start"})
    return out


def measure(scenarios: Sequence[Scenario], python: Path, rootfs_src: Path, work: Path, runs: int, *,
            bundle: Path) -> dict[str, Samples]:
    """Warm-up round, *runs* interleaved timed rounds, then the instrumented hook runs; each run's
    container in *bundle* (on the scratch filesystem)."""
    samples = {s.name: Samples() for s in scenarios}
    specs = {s.name: make_spec(s) for s in scenarios}
    with contextlib.ExitStack() as holders:
        for scenario in scenarios:
            if scenario.held:
                holders.enter_context(holding(scenario, rootfs_src, work / f"holder-{scenario.name}"))
        _timed_rounds(scenarios, specs, samples, rootfs_src, runs, bundle)
        close = [s for s in scenarios if s.close]
        _timed_rounds(close, specs, samples, rootfs_src, runs * (CLOSE_FACTOR - 1), bundle, warm_up=False)
        _instrumented_runs(scenarios, samples, python, rootfs_src, work, bundle)
    for scenario in (s for s in scenarios if s.held):  # what such a row is for: starts that find their daemon up
        daemons = {logged.get("mps_daemon_pid") for logged in samples[scenario.name].log_ms}
        if len(daemons) != 1:
            raise BenchError(f"{scenario.name}: its runs were served by MPS daemons {sorted(map(str, daemons))}, "
                             "not by the one its holder started")
    return samples


@contextlib.contextmanager
def holding(scenario: Scenario, rootfs_src: Path, bundle: Path) -> Iterator[None]:
    """A container asking what *scenario* asks, through its hooks, kept running (``runc run -d`` of a
    ``sleep``) for the duration; deleted after (its poststop hook releases what it held)."""
    copy_rootfs(rootfs_src, bundle / "rootfs")
    write_bundle(bundle, make_spec(scenario, process=("/bin/sleep", "100000")))
    container_id = unique_id("bench-holder")
    runc = require_tool("runc")
    # stderr to a file: the detached container inherits it, and a pipe would never reach its end
    with (bundle / "runc.err").open("w+") as stderr:
        started = subprocess.run([runc, "run", "-d", "--bundle", str(bundle), container_id], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=stderr, timeout=30, check=False)
        stderr.seek(0)
        error = stderr.read().strip()
    try:
        if started.returncode != 0:
            raise BenchError(f"{scenario.name}: its holder did not start ({started.returncode}): {error}")
        yield
    finally:
        deleted = subprocess.run([runc, "delete", "--force", container_id], stdin=subprocess.DEVNULL,
                                 capture_output=True, text=True, timeout=30, check=False)
        shutil.rmtree(bundle, ignore_errors=True)
    if deleted.returncode != 0:
        raise BenchError(f"{scenario.name}: runc delete of its holder failed: {deleted.stderr.strip()}")


def _timed_rounds(scenarios: Sequence[Scenario], specs: dict[str, dict[str, Any]], samples: dict[str, Samples],
                  rootfs_src: Path, runs: int, bundle: Path, *, warm_up: bool = True) -> None:
    first = 0 if warm_up else 1
    for round_no in range(first, runs + 1):
        # Round-robin, starting one scenario later each round, so none always follows the same one.
        for k in range(len(scenarios)):
            scenario = scenarios[(round_no + k) % len(scenarios)]
            wall, calls, logged = run_once(scenario, specs[scenario.name], rootfs_src, bundle)
            if round_no > 0:  # round 0 warms the page cache, the .pyc files and the inventory caches
                samples[scenario.name].wall_ms.append(wall)
                samples[scenario.name].nvml_calls.append(calls)
                if logged:
                    samples[scenario.name].log_ms.append(logged)
        print(f"  round {round_no}/{runs} of {len(scenarios)} scenarios done", file=sys.stderr, flush=True)


def _instrumented_runs(scenarios: Sequence[Scenario], samples: dict[str, Samples], python: Path, rootfs_src: Path,
                       work: Path, bundle: Path) -> None:
    wrapper_py = work / "hookstat.py"
    wrapper_py.write_text(_WRAPPER)
    for scenario in scenarios:
        if scenario.hook_argv is None:
            continue
        record = work / f"hookstat-{scenario.name}.jsonl"
        wrapper = (str(python), "-I", "-S", str(wrapper_py), str(record))
        served = [run_once(scenario, make_spec(scenario, wrapper), rootfs_src, bundle)[2].get("served_ms")
                  for _ in range(INSTRUMENTED_RUNS)]
        for line, served_ms in zip(record.read_text().splitlines(), served, strict=True):
            measured = json.loads(line)
            samples[scenario.name].hook_ms.append(measured["wall_ms"])
            samples[scenario.name].maxrss_kib.append(measured["maxrss_kib"])
            if served_ms is not None:  # the same run's two sides: what the relay adds to the daemon's work
                samples[scenario.name].outside_ms.append(measured["wall_ms"] - served_ms)


# --- reporting ------------------------------------------------------------------------------------


def p90(values: Sequence[float]) -> float:
    """The 90th percentile, nearest-rank."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def paired_ratio(runs: Sequence[float], reference: Sequence[float]) -> float:
    """The median over rounds of a run's time ÷ the reference's in the same round (the rounds are interleaved:
    a slow minute of the machine slows both alike, and drops out)."""
    return statistics.median(run / ref for run, ref in zip(runs, reference, strict=True))


def summarise(scenarios: Sequence[Scenario], samples: dict[str, Samples]) -> dict[str, dict[str, Any]]:
    """Medians, p90s and ratios per scenario."""
    bare = samples["bare"].wall_ms
    out = {}
    for scenario in scenarios:
        got = samples[scenario.name]
        median = statistics.median(got.wall_ms)
        logged = {key: round(statistics.median(t[key] for t in got.log_ms), 1)
                  for key in ("discovery_ms", "apply_ms", "total_ms") if got.log_ms}
        for key in ("lease_ms", "mig_ms"):
            found = [t[key] for t in got.log_ms if key in t]
            if found:
                logged[key] = round(statistics.median(found), 2)
        steps = dict.fromkeys(k for t in got.log_ms for k in t if k.startswith(("step:", "served:")))
        profile = {k.removeprefix("step:").replace("served:", "gpuhookd: "):
                   round(statistics.median(t.get(k, 0.0) for t in got.log_ms), 2) for k in steps}
        for key in ("served_ms", "page_faults", "apply_page_faults"):
            if any(key in t for t in got.log_ms):
                logged[key] = round(statistics.median(t[key] for t in got.log_ms if key in t), 1)
        out[scenario.name] = {
            "title": scenario.title,
            "runs": len(got.wall_ms),
            "median_ms": round(median, 2),
            "p90_ms": round(p90(got.wall_ms), 2),
            # the rounds this row ran in are bare runc's first ones (a close row: all of them)
            "ratio_vs_bare": round(paired_ratio(got.wall_ms, bare[: len(got.wall_ms)]), 3),
            "hook_ms_median": round(statistics.median(got.hook_ms), 2) if got.hook_ms else None,
            "relay_outside_ms_median": round(statistics.median(got.outside_ms), 2) if got.outside_ms else None,
            "hook_peak_rss_mib": round(max(got.maxrss_kib) / 1024, 1) if got.maxrss_kib else None,
            "worker_peak_rss_mib": max((t["worker_rss_mib"] for t in got.log_ms if "worker_rss_mib" in t),
                                       default=None),
            "nvml_calls_per_start": statistics.mean(got.nvml_calls) if scenario.host else None,
            "hook_log_ms_median": logged or None,
            "profile_ms_median": profile or None,
            "wall_ms": [round(v, 2) for v in got.wall_ms],
        }
    return out


def check_targets(results: dict[str, dict[str, Any]], docker: dict[str, Any]) -> list[dict[str, Any]]:
    """The issues' targets (#19, #20), each with the measured value and whether it is met."""
    # Our processes only: the ctr row's hook is containerd's own oci-hook (a Go program), the floor is Python's.
    rss = max(r[key] for name, r in results.items() if name not in ("python-floor", "hook-floor")
              for key in ("hook_peak_rss_mib", "worker_peak_rss_mib")
              if r[key] is not None and not (name == "ctr-gpu8" and key == "hook_peak_rss_mib"))
    cached_calls = max(results[n]["nvml_calls_per_start"]
                       for n in ("gpu1", "gpu8", "gpu64", "gpu8-all", "mig-existing"))

    def in_hook(name: str, key: str = "total_ms") -> float:
        logged = results[name]["hook_log_ms_median"] or {}
        if key not in logged:
            raise BenchError(f"{name}: its starts logged no {key} (gpuhook.log of its host)")
        return float(logged[key])

    rows = [
        ("hook on a no-GPU container ≤ 1.1 × bare runc", results["no-gpu"]["ratio_vs_bare"], 1.1),
        ("hook for prestart and poststop, no GPU ≤ 1.1 × bare runc", results["no-gpu-poststop"]["ratio_vs_bare"],
         1.1),
        ("gpuhook-runtime, container asks for no GPU ≤ 1.2 × bare runc", results["runtime-no-gpu"]["ratio_vs_bare"],
         1.2),
        ("docker run --runtime nvidia, no GPU ≤ 1.2 × docker run --runtime runc", docker["ratio"], 1.2),
        ("8 GPUs compute,utility, valid cache ≤ 1.6 × bare runc", results["gpu8"]["ratio_vs_bare"], 1.6),
        ("8 GPUs, all capabilities ≤ 2.0 × bare runc", results["gpu8-all"]["ratio_vs_bare"], 2.0),
        ("64 GPUs ≤ 1.15 × the 8-GPU figure", round(paired_ratio(results["gpu64"]["wall_ms"],
                                                               results["gpu8"]["wall_ms"]), 3), 1.15),
        ("a lease adds ≤ 2 ms (reserving it, 8 GPUs)", in_hook("gpu8", "lease_ms"), 2.0),
        ("an existing MIG device adds ≤ 2 ms to a 1-GPU start (the starts' time in gpuhookd)",
         round(in_hook("mig-existing") - in_hook("gpu1"), 2), 2.0),
        ("an MPS client adds ≤ 2 ms to a 1-GPU start (its GPU's daemon up; the starts' time in gpuhookd)",
         round(in_hook("mps-client") - in_hook("gpu1"), 2), 2.0),
        (f"a CUDA runtime-sized image ({IMAGE_LIBRARIES} library names): the start's time in gpuhookd with gpuhook's "
         "cache writer ÷ with the host's ldconfig ≤ 1",
         round(in_hook("gpu8-image") / in_hook("gpu8-image-ldconfig"), 3), 1.0),
        ("peak RSS of the hook and of gpuhookd's worker ≤ 30 MiB", rss, 30.0),
        ("NVML calls per start with a valid cache = 0", cached_calls, 0),
    ]
    return [{"target": t, "value": v, "limit": limit, "met": v <= limit} for t, v, limit in rows]


def import_profile(python: Path, config: Path, work: Path) -> dict[str, Any]:
    """``-X importtime`` of the hook on a no-GPU container: the modules with the largest own cost."""
    bundle = work / "nogpu-bundle"
    write_bundle(bundle, default_spec("rootfs", ["/bin/true"], []))
    state = json.dumps({"ociVersion": "1.0.2", "id": "importtime", "pid": os.getpid(), "bundle": str(bundle),
                        "status": "creating"})
    own: dict[str, list[int]] = {}
    cumulative: dict[str, list[int]] = {}
    for _ in range(IMPORTTIME_RUNS):
        out = subprocess.run([str(python), "-X", "importtime", "-I", "-m", "gpuhook", "--config", str(config),
                              "prestart"], input=state, capture_output=True, text=True, check=True, cwd="/",
                             env={"PATH": "/usr/bin:/bin"})
        for line in out.stderr.splitlines():
            fields = line.removeprefix("import time:").split("|")
            if len(fields) == 3 and fields[0].strip().isdigit():
                name = fields[2].strip()
                own.setdefault(name, []).append(int(fields[0]))
                cumulative.setdefault(name, []).append(int(fields[1]))
    shutil.rmtree(bundle)
    top = sorted(own, key=lambda n: statistics.median(own[n]), reverse=True)[:15]
    return {
        "modules": len(own),
        "total_self_us": round(sum(statistics.median(v) for v in own.values())),
        "top_self_us": [{"module": n, "self_us": round(statistics.median(own[n])),
                         "cumulative_us": round(statistics.median(cumulative[n]))} for n in top],
    }


def kernel_log_profile(work: Path) -> dict[str, Any]:
    """GPU health's read of this machine's own kernel log (the simulated hosts' dev/kmsg is a small file): whole,
    as the hook reads it on every GPU start, and as gpuhookd's pool follows it (``health.XidLog``)."""
    from gpuhook.discovery import health

    root = work / "kernel-log"
    (root / "dev").mkdir(parents=True)
    os.mknod(root / "dev" / "kmsg", 0o600 | stat.S_IFCHR, os.makedev(1, 11))  # the kernel's log
    fd = os.open(root / "dev" / "kmsg", os.O_RDONLY | os.O_NONBLOCK)
    try:
        records = len(health.read_records(fd).splitlines())
    finally:
        os.close(fd)

    def median_ms(read: Callable[[], object]) -> float:
        times = []
        for _ in range(IMPORTTIME_RUNS * 2):
            start = time.perf_counter()
            read()
            times.append((time.perf_counter() - start) * 1000)
        return round(statistics.median(times), 3)

    whole = median_ms(lambda: health.read_xids(root))
    followed = median_ms(health.XidLog(root).read_new)
    shutil.rmtree(root)
    return {"records": records, "whole_ms": whole, "followed_ms": followed}


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.machine())
    runc = subprocess.run([require_tool("runc"), "--version"], capture_output=True, text=True, check=True)
    return {"cpus": os.cpu_count(), "cpu": model, "kernel": platform.release(),
            "python": platform.python_version(), "runc": runc.stdout.splitlines()[0]}


def markdown(report: dict[str, Any]) -> str:
    """The results table and the targets, as Markdown."""
    lines = [
        "| scenario | runs | median ms | p90 ms | × bare runc | hook ms "
        "| in hook: discovery / lease / apply / total ms | peak RSS MiB: hook / gpuhookd worker | NVML calls/start |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["scenarios"].values():
        hook = "–" if r["hook_ms_median"] is None else f"{r['hook_ms_median']:.1f}"
        logged = r["hook_log_ms_median"]
        lease = f"{logged['lease_ms']:g}" if logged and "lease_ms" in logged else "–"
        if logged and "mig_ms" in logged:
            lease += f" + {logged['mig_ms']:g} making the instance"
        steps = ("–" if not logged else
                 f"{logged['discovery_ms']:g} / {lease} / {logged['apply_ms']:g} / {logged['total_ms']:g}")
        rss = "–" if r["hook_peak_rss_mib"] is None else f"{r['hook_peak_rss_mib']:.1f}"
        if r["worker_peak_rss_mib"] is not None:
            rss += f" / {r['worker_peak_rss_mib']:.1f}"
        calls = "–" if r["nvml_calls_per_start"] is None else f"{r['nvml_calls_per_start']:g}"
        lines.append(f"| {r['title']} | {r['runs']} | {r['median_ms']:.1f} | {r['p90_ms']:.1f} "
                     f"| {r['ratio_vs_bare']:.2f} | {hook} | {steps} | {rss} | {calls} |")
    lines += ["", *profile_lines(report["scenarios"])]
    lines += ["", "| target | measured | met |", "|---|---:|:---:|"]
    lines += [f"| {t['target']} | {t['value']:g} | {'yes' if t['met'] else '**no**'} |" for t in report["targets"]]
    return "\n".join(lines) + "\n"


#: The GPU starts whose time is broken down step by step (issue #20: choose the next millisecond from data).
PROFILED: Final = ("gpu8", "gpu8-all", "gpu64", "ctr-gpu8", "gpu8-image", "gpu8-image-ldconfig")


def profile_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    """Where a GPU start's time goes, as a Markdown table: runc's own share, the relay's outside gpuhookd
    (the hook's wall time less the request's time in the worker), the worker's before the start (decode
    and checks, hand-over, config and entering the hook's view), and the start's steps (medians;
    discovery and lease from their own events, then plan, device cgroup, and the apply child's)."""
    bare = results["bare"]["median_ms"]
    rows = [name for name in PROFILED if results[name]["profile_ms_median"]]
    if not rows:
        return []
    found = dict.fromkeys(step for name in rows for step in results[name]["profile_ms_median"])
    steps = sorted(found, key=lambda step: not step.startswith("gpuhookd"))  # the worker's, then the start's
    head = ["runc's own (start − bare − served − relay)", "relay outside gpuhookd (hook − served, same run)",
            "discovery", "lease", *steps]
    lines = ["Profile of the GPU path (median ms): " + ", ".join(f"`{name}`" for name in rows),
             "", "| step | " + " | ".join(results[name]["title"] for name in rows) + " |",
             "|---|" + "---:|" * len(rows)]
    cells: dict[str, list[str]] = {h: [] for h in head}
    for name in rows:
        r = results[name]
        logged, profile = r["hook_log_ms_median"] or {}, r["profile_ms_median"]
        outside, worker = r["relay_outside_ms_median"], logged.get("served_ms")
        hook = worker + outside if worker is not None and outside is not None else r["hook_ms_median"]
        cells[head[0]].append(f"{r['median_ms'] - bare - hook:.1f}" if hook is not None else "–")
        cells[head[1]].append(f"{outside:.1f}" if outside is not None else "–")
        cells["discovery"].append(f"{logged.get('discovery_ms', 0):g}")
        cells["lease"].append(f"{logged.get('lease_ms', 0):g}")
        for step in steps:
            cells[step].append(f"{profile.get(step, 0):g}")
    lines += [f"| {h} | " + " | ".join(cells[h]) + " |" for h in head]
    for key, what in (("page_faults", "gpuhookd worker's page faults"), ("apply_page_faults", "its apply child's")):
        faults = [f"{(results[name]['hook_log_ms_median'] or {}).get(key, '–')}" for name in rows]
        lines.append(f"| {what} (a count, not ms) | " + " | ".join(faults) + " |")
    return lines


def print_report(report: dict[str, Any]) -> None:
    """The report as people read it: the machine, the tables, the docker rows, the import profile."""
    m, docker, imports = report["machine"], report["docker_no_gpu"], report["importtime_no_gpu"]
    print(f"\n{report['date']}, {m['cpus']} CPUs ({m['cpu']}), Linux {m['kernel']}, {m['runc']}, "
          f"Python {m['python']}; {report['runs']} runs each; container rootfs copies on "
          f"{report['rootfs_filesystem']}\n")
    print(markdown(report))
    print(f"docker run --rm of a no-GPU container, medians of {docker['runs']}: --runtime runc "
          f"{docker['median_ms']['runc']} ms, --runtime nvidia (gpuhook-runtime) {docker['median_ms']['nvidia']} ms "
          f"({docker['ratio']:.2f}×)\n")
    print(f"the Python hook's no-GPU path, python -X importtime: {imports['modules']} modules, "
          f"{imports['total_self_us'] / 1000:.1f} ms "
          "of their own time (importtime's figures, inflated by its own bookkeeping); the largest:")
    print(", ".join(f"{m['module']} {m['self_us'] / 1000:.1f}" for m in imports["top_self_us"]))
    log = report["kernel_log"]
    print(f"\nGPU health on this machine's own kernel log (/dev/kmsg, {log['records']} records): read whole, as the "
          f"hook does on every GPU start, {log['whole_ms']} ms ({log['whole_ms'] * 1000 / max(log['records'], 1):.1f} "
          f"µs a record); gpuhookd's pool reads each record once: {log['followed_ms']} ms a start")


def main(argv: Sequence[str] | None = None) -> int:
    """Build the hosts, run the scenarios, write the JSON and print the table."""
    parser = argparse.ArgumentParser(prog="python -m integration.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=RUNS, help=f"timed runs per scenario (default {RUNS})")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON results (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if os.geteuid() != 0:
        print("the benchmark makes device nodes and runs runc: run it as root (make bench)", file=sys.stderr)
        return 1
    unmount(WORK / "scratch")  # a killed run's, before its tree goes
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    print("setting up: rootfs, hook install, simulated hosts with 1, 8 and 64 GPUs", file=sys.stderr)
    rootfs_src = build_rootfs(REPO / ".cache" / "rootfs")
    python = install_hook(WORK / "venv")
    relay = install_relay(python.parent, python)
    with tmpfs(STATE_TMPFS):
        scenarios, samples, bundle_fs = run_scenarios(python, relay, rootfs_src, args.runs)
    results = summarise(scenarios, samples)
    print("docker run --runtime runc / nvidia, interleaved", file=sys.stderr)
    docker = measure_docker(WORK, rootfs_src, runtime_for(relay), args.runs)
    imports = import_profile(python, WORK / "configs" / "host8.yaml", WORK)
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": f"python -m integration.bench --runs {args.runs}",
        "machine": machine(),
        "rootfs_filesystem": bundle_fs,
        "runs": args.runs,
        "scenarios": results,
        "docker_no_gpu": docker,
        "targets": check_targets(results, docker),
        "importtime_no_gpu": imports,
        "kernel_log": kernel_log_profile(WORK),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print_report(report)
    print(f"\nresults: {args.out}")
    shutil.rmtree(WORK, ignore_errors=True)
    return 0


def run_scenarios(python: Path, relay: Path, rootfs_src: Path, runs: int,
                  ) -> tuple[list[Scenario], dict[str, Samples], str]:
    """Every scenario, each config served by its gpuhookd, with *runs* timed runs; the scenarios, what their runs
    measured, and the filesystem the containers' rootfs copies were on."""
    daemons: dict[Path, Gpuhookd] = {}

    def daemon_for(config: Path) -> str:
        # as systemd's gpuhookd.socket would start it, with that host's config
        if config not in daemons:
            daemons[config] = Gpuhookd(python, WORK / f"gpuhookd-{config.stem}", config=config)
        return daemons[config].socket

    try:
        scenarios = make_scenarios(python, relay, rootfs_src, WORK, daemon_for)
        close = sum(s.close for s in scenarios)
        print(f"running {len(scenarios)} scenarios × {runs} runs, interleaved; then {close} of them (bare runc and "
              f"the close rows) × {runs * (CLOSE_FACTOR - 1)} more", file=sys.stderr)
        stop_scraping = threading.Event()
        scraper = threading.Thread(target=scrape_every_second, args=(stop_scraping,), daemon=True)
        scraper.start()
        try:
            with scratch_filesystem(WORK / "scratch", SCRATCH_IMAGE) as bundle_fs:
                print(f"container rootfs copies on {bundle_fs}", file=sys.stderr)
                samples = measure(scenarios, python, rootfs_src, WORK, runs, bundle=WORK / "scratch" / "bundle")
        finally:
            stop_scraping.set()
    finally:
        journals = [daemon.stop() for daemon in daemons.values()]
    if any("request failed" in journal for journal in journals):
        raise BenchError(f"a gpuhookd request failed: {journals}")
    return scenarios, samples, bundle_fs


if __name__ == "__main__":
    raise SystemExit(main())

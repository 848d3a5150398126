"""gpuhook doctor's decisions: cgroup mode, cgroup driver, daemon-reload exposure, gpuhookd."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuhook.doctor import Verdict, cgroup_checks, cgroup_driver, cgroup_mode
from gpuhook.sys.mountinfo import parse_mountinfo
from integration.fakehost import FakeHost

HYBRID = ("30 25 0:26 / /sys/fs/cgroup/devices rw - cgroup cgroup rw,devices\n"
          "40 25 0:36 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n")
UNIFIED = "30 25 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"


def test_cgroup_modes() -> None:
    """Unified, hybrid and plain v1 hosts are told apart from mountinfo."""
    assert cgroup_mode(parse_mountinfo(UNIFIED)) == "v2"
    assert cgroup_mode(parse_mountinfo(HYBRID)) == "hybrid"
    assert cgroup_mode(parse_mountinfo(HYBRID.splitlines()[0])) == "v1"
    # a cgroup2 mounted over the v1 tree at /sys/fs/cgroup (runc in v2 mode) makes it unified
    assert cgroup_mode(parse_mountinfo(HYBRID + "50 25 0:40 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n" + UNIFIED)) == "v2"


@pytest.mark.parametrize(
    ("pid1", "mode", "daemon_json", "containerd", "expected"),
    [
        pytest.param("process_api", "v2", None, None, "cgroupfs", id="no-systemd"),
        pytest.param("systemd", "v2", None, None, "systemd", id="docker-default-on-v2"),
        pytest.param("systemd", "v1", None, None, "cgroupfs", id="v1-default"),
        pytest.param("systemd", "v1", '{"exec-opts": ["native.cgroupdriver=systemd"]}', None, "systemd", id="docker"),
        pytest.param("systemd", "v1", None, "  SystemdCgroup = true\n", "systemd", id="containerd"),
        pytest.param("systemd", "v1", "not json", None, "cgroupfs", id="broken-daemon-json"),
    ],
)
def test_cgroup_driver(pid1: str, mode: str, daemon_json: str | None, containerd: str | None, expected: str) -> None:
    """The driver the engines most likely use."""
    assert cgroup_driver(pid1=pid1, mode=mode, docker_daemon_json=daemon_json, containerd_toml=containerd) == expected


def test_systemd_driver_is_exposed_with_the_fix() -> None:
    """The daemon-reload problem is a warning naming the symptom and the spec-edit fix."""
    exposure = cgroup_checks("v2", "systemd")[-1]
    assert exposure.verdict is Verdict.WARN
    assert "Failed to initialize NVML: Unknown Error" in exposure.message and "gpuhook precreate" in exposure.fix
    assert cgroup_checks("hybrid", "cgroupfs")[-1].verdict is Verdict.OK


def test_doctor_on_the_simulated_host(host: FakeHost, tmp_path: Path) -> None:
    """The real command: driver found, static ldconfig, this machine's hybrid cgroups, exit 0."""
    out = subprocess.run([sys.executable, "-I", "-m", "gpuhook", "--config", str(host.config_path), "doctor"],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"[ ok ] driver: NVIDIA {host.driver_version} (CUDA {host.cuda_version}), 4 GPU(s)" in out.stdout
    assert "[ ok ] cgroup driver: cgroupfs" in out.stdout
    assert "is static; gpuhook writes each container's ld.so.cache itself" in out.stdout
    assert "] gpuhookd: " in out.stdout  # whatever serves this machine's default socket: never a failure
    empty = tmp_path / "no-driver.yaml"
    empty.write_text(f"driver_root: {tmp_path}\ndev_root: {tmp_path}\nproc_root: {tmp_path}\nlog_file: null\n")
    broken = subprocess.run([sys.executable, "-I", "-m", "gpuhook", "--config", str(empty), "doctor"],
                            capture_output=True, text=True, check=False)
    assert broken.returncode == 1 and "[FAIL] driver:" in broken.stdout and "fix: " in broken.stdout


def test_engine_checks_say_how_to_register() -> None:
    """An installed engine without gpuhook gets the install command; absent engines get no check of their own."""
    from gpuhook.doctor import EngineView, registration_checks

    checks = registration_checks([
        EngineView(engine="docker", installed=True, handlers=("nvidia",), source="docker info"),
        EngineView(engine="podman", installed=True, source="hooks dirs"),
        EngineView(engine="crio", installed=False)])
    assert [(c.name, c.verdict) for c in checks][:2] == [("engine docker", Verdict.OK), ("engine podman", Verdict.WARN)]
    assert checks[1].fix.startswith("gpuhook install --runtime podman")
    assert [c.name for c in checks[2:]] == ["engines"]


def test_cdi_freshness() -> None:
    """A spec equal to a fresh rendering is ok; a different one is stale, with the command that renews it."""
    from gpuhook.doctor import cdi_checks

    fresh = {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": [{"name": "0"}]}
    checks = cdi_checks({"/etc/cdi/a.yaml": fresh, "/var/run/cdi/nvidia.yaml": {**fresh, "devices": []}}, fresh)
    assert [c.verdict for c in checks] == [Verdict.OK, Verdict.WARN]
    assert checks[1].fix == ("gpuhook cdi generate --output /var/run/cdi/nvidia.yaml "
                             "(or enable gpuhook-cdi-refresh.path)")


def test_refresh_units_run_a_real_command() -> None:
    """The systemd service and the udev rule start a command gpuhook's parser accepts."""
    import shlex

    from gpuhook.cli import _parser

    packaging = Path(__file__).parents[2] / "packaging"
    service = (packaging / "systemd/gpuhook-cdi-refresh.service").read_text()
    (line,) = [entry for entry in service.splitlines() if entry.startswith("ExecStart=")]
    argv = shlex.split(line.removeprefix("ExecStart="))
    assert argv[0] == "/usr/lib/gpuhook/bin/gpuhook"
    args = _parser().parse_args(argv[1:])
    assert (args.command, args.cdi_command, args.output) == ("cdi", "generate", "/var/run/cdi/nvidia.yaml")
    assert "Unit=gpuhook-cdi-refresh.service" in (packaging / "systemd/gpuhook-cdi-refresh.path").read_text()
    rules = (packaging / "udev/71-gpuhook-cdi-refresh.rules").read_text()
    assert 'SYSTEMD_WANTS}+="gpuhook-cdi-refresh.service"' in rules


def test_persistence_mode_check() -> None:
    """Persistence mode off on some GPU is a warning with the fix; on (or unknown) is fine."""
    from gpuhook.doctor import persistence_check

    assert persistence_check([]).verdict is Verdict.OK
    warning = persistence_check([0, 3])
    assert warning.verdict is Verdict.WARN and "GPU 0, 3" in warning.message and "nvidia-persistenced" in warning.fix


def test_gpuhookd_verdicts() -> None:
    """Serving this version is ok; another version is a problem fixed by a restart; none is a notice."""
    from gpuhook.doctor import gpuhookd_check

    ok = gpuhookd_check("/run/x.sock", served="1.2.0", version="1.2.0")
    assert (ok.verdict, ok.message, ok.fix) == (Verdict.OK, "gpuhookd 1.2.0 serves /run/x.sock", "")
    stale = gpuhookd_check("/run/x.sock", served="1.1.0", version="1.2.0")
    assert stale.verdict is Verdict.WARN and stale.fix == "systemctl restart gpuhookd.service"
    assert "gpuhookd 1.1.0 serves /run/x.sock but this is gpuhook 1.2.0" in stale.message
    off = gpuhookd_check("/run/x.sock", served=None, version="1.2.0", why="no gpuhookd at /run/x.sock (refused)")
    assert off.verdict is Verdict.NOTE and off.fix == "systemctl enable --now gpuhookd.socket"
    assert off.message.startswith("no gpuhookd at /run/x.sock (refused): ") and "about 45 ms" in off.message
    assert off.render().startswith("[note] gpuhookd: ")


@pytest.fixture
def gpuhookd(tmp_path: Path) -> Iterator[str]:
    """A real `gpuhook daemon` on a socket in a fresh 0700 directory; its path once it answers a ping."""
    from gpuhook.daemon import client

    socket_dir = tmp_path / "gpuhookd"
    socket_dir.mkdir(mode=0o700)
    path = str(socket_dir / "gpuhookd.sock")
    journal = tmp_path / "gpuhookd.log"
    with journal.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-I", "-m", "gpuhook", "daemon", "--socket", path],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=out, env={"PATH": "/usr/bin:/bin"})
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping(path)
                break
            except client.NotServed:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"gpuhookd did not answer a ping: {journal.read_text()}")
                time.sleep(0.05)
        yield path
    finally:
        proc.kill()
        proc.wait()


def test_gpuhookd_check_with_a_real_daemon(gpuhookd: str) -> None:
    """The check pings the daemon on the given socket and reports its version."""
    from gpuhook import __version__
    from gpuhook.cli.doctor import daemon_check

    check = daemon_check(gpuhookd)
    assert (check.verdict, check.message) == (Verdict.OK, f"gpuhookd {__version__} serves {gpuhookd}")


def test_gpuhookd_check_without_a_daemon(tmp_path: Path) -> None:
    """No socket, or a socket nobody listens on (a killed daemon's): a notice saying why, never a failure."""
    import socket

    from gpuhook.cli.doctor import daemon_check

    missing = daemon_check(str(tmp_path / "none.sock"))
    assert missing.verdict is Verdict.NOTE and "No such file or directory" in missing.message
    stale_path = str(tmp_path / "stale.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:
        stale.bind(stale_path)  # bound, never listening: connect() is refused
        refused = daemon_check(stale_path)
    assert refused.verdict is Verdict.NOTE and "refused" in refused.message
    assert refused.fix == "systemctl enable --now gpuhookd.socket"


def test_gpuhookd_units_run_the_daemon_on_its_default_socket() -> None:
    """gpuhookd.service starts a command the parser accepts, listening where gpuhookd.socket does."""
    import shlex

    from gpuhook.cli import _parser
    from gpuhook.daemon.wire import DEFAULT_SOCKET

    units = Path(__file__).parents[2] / "packaging/systemd"
    service = (units / "gpuhookd.service").read_text().splitlines()
    (line,) = [entry for entry in service if entry.startswith("ExecStart=")]
    argv = shlex.split(line.removeprefix("ExecStart="))
    args = _parser().parse_args(argv[1:])
    assert (argv[0], args.command, args.socket) == ("/usr/bin/gpuhook", "daemon", DEFAULT_SOCKET)
    assert {"Requires=gpuhookd.socket", "After=gpuhookd.socket", "KillMode=process"} <= set(service)
    assert f"ListenStream={DEFAULT_SOCKET}" in (units / "gpuhookd.socket").read_text().splitlines()

"""gpuhook-runtime with the environment containerd gives its shims (issue #31).

containerd's opt plugin puts its library directory into every shim's LD_LIBRARY_PATH, so into the
runtime's: under k3s ``/var/lib/rancher/k3s/agent/containerd/lib``. The front-end (libexec/gpuhook-runtime,
as the packages install it) is called as containerd's runc shim calls a runtime: ``--root R run --bundle B
ID`` with that environment. runc must get the engine's environment exactly (it is the pid the front-end
was started as, by then); the Python wrapper's interpreter must never see the library path (it refuses a
start it sees it in), and what no engine sets for runc (LD_PRELOAD) is refused in one line. Each case runs
served by gpuhookd (the relay execs runc) and not (the Python wrapper does).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuhook.hookcall import check_environment
from gpuhook.errors import UnsafeEnvironmentError
from gpuhook.request.runtimecall import ENGINE_ENV_FIX
from integration.engines import unique_id
from integration.fakehost import FakeHost
from integration.gpuhookd import Gpuhookd
from integration.relay import runtime_for

from .conftest import MakeContainer
from .test_cgroups import EXPECTED, PROBE

K3S_LIBRARY_PATH = "/var/lib/rancher/k3s/agent/containerd/lib"


@pytest.fixture(params=[pytest.param(True, id="served"), pytest.param(False, id="not-served")])
def engine_env(request: pytest.FixtureRequest, host: FakeHost, tmp_path: Path) -> Iterator[dict[str, str]]:
    """k3s's containerd shim's environment for the runtime: its PATH and LD_LIBRARY_PATH, the config, and a
    gpuhookd serving that config (or a socket nobody serves)."""
    env = {"PATH": "/var/lib/rancher/k3s/agent/containerd/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "LD_LIBRARY_PATH": K3S_LIBRARY_PATH, "GPUHOOK_CONFIG": str(host.config_path),
           "GPUHOOK_DAEMON_SOCKET": str(tmp_path / "nobody.sock")}
    if not request.param:
        yield env
        return
    daemon = Gpuhookd(sys.executable, tmp_path / "gpuhookd", config=host.config_path)
    try:
        yield env | {"GPUHOOK_DAEMON_SOCKET": daemon.socket}
    finally:
        daemon.stop()


@contextlib.contextmanager
def started(front_end: Path, bundle: Path, env: dict[str, str], root: Path) -> Iterator[subprocess.Popen[str]]:
    """The front-end's ``--root ROOT run --bundle BUNDLE ID`` with the engine's *env*; the container removed after."""
    container_id = unique_id("k3s")
    argv = [str(front_end), "--root", str(root), "run", "--bundle", str(bundle), container_id]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        yield proc
    finally:
        if proc.poll() is None:  # a failed assertion before the container ended
            proc.kill()
            proc.communicate(timeout=60)
        subprocess.run(["runc", "--root", str(root), "delete", "--force", container_id], capture_output=True,
                       check=False, timeout=60)


def test_a_gpu_container_starts_with_k3s_library_path(make_container: MakeContainer, relay: Path, host: FakeHost,
                                                      engine_env: dict[str, str], tmp_path: Path) -> None:
    """The container gets its GPUs, its spec edited by gpuhookd where it serves (it takes that environment too),
    and runc runs it with the engine's environment, LD_LIBRARY_PATH included."""
    container = make_container(PROBE + "; dltest libcuda.so.1; echo ready; read line || :",
                               {"NVIDIA_VISIBLE_DEVICES": "1,3"},
                               hooks=[])
    with started(runtime_for(relay), container.bundle, engine_env, tmp_path / "runc") as proc:
        assert proc.stdout is not None
        lines: list[str] = []
        while (line := proc.stdout.readline()) not in ("ready\n", ""):  # the container waits on its stdin now
            lines.append(line)
        runc_env = Path(f"/proc/{proc.pid}/environ").read_bytes() if line else b""
        exe = Path(f"/proc/{proc.pid}/exe").resolve() if line else None
        out, err = proc.communicate(timeout=60)  # closes its stdin: the container ends
    assert proc.returncode == 0, "".join(lines) + out + err
    assert EXPECTED | {"dlopen libcuda.so.1: OK"} <= {line.strip() for line in lines}
    assert exe is not None and exe.name == "runc"
    assert dict(entry.split("=", 1) for entry in runc_env.decode().split("\0") if entry) == engine_env
    hooks = json.loads((container.bundle / "config.json").read_text())["hooks"]
    assert [h["path"] for stage in ("prestart", "poststop") for h in hooks[stage]] == [str(relay)] * 2
    edits = [event for line in (host.root / "gpuhook.log").read_text().splitlines()
             if (event := json.loads(line)).get("event") == "runtime_spec_edited"
             and event.get("bundle") == str(container.bundle)]
    assert len(edits) == (1 if engine_env["GPUHOOK_DAEMON_SOCKET"].endswith("gpuhookd.sock") else 0)


def test_ld_preload_in_the_engines_environment_is_refused(make_container: MakeContainer, relay: Path,
                                                          engine_env: dict[str, str], tmp_path: Path) -> None:
    """LD_PRELOAD, which no engine sets for runc: refused in one line naming it and the engine's unit, before
    runc runs or the spec changes; neither the static front-ends nor the wrapper's interpreter loaded it."""
    container = make_container("echo ran", {"NVIDIA_VISIBLE_DEVICES": "0"}, hooks=[])
    before = (container.bundle / "config.json").read_bytes()
    env = engine_env | {"LD_PRELOAD": "/nonexistent/gpuhook-test.so"}
    with started(runtime_for(relay), container.bundle, env, tmp_path / "runc") as proc:
        out, err = proc.communicate(timeout=60)
    with pytest.raises(UnsafeEnvironmentError) as refusal:
        check_environment({"LD_PRELOAD": ""}, fix=ENGINE_ENV_FIX)
    assert (proc.returncode, out) == (1, "")
    assert err == f"gpuhook: {refusal.value}\n"
    assert (container.bundle / "config.json").read_bytes() == before


def test_a_forged_engine_env_is_one_line(tmp_path: Path) -> None:
    """ENGINE_ENV that no front-end wrote (not hex): the Python wrapper says so in one line, runs nothing."""
    wrapper = Path(sys.executable).with_name("gpuhook-runtime")
    result = subprocess.run([str(wrapper), "create", "--bundle", str(tmp_path), "c1"], capture_output=True, text=True,
                            check=False, timeout=60,
                            env={"PATH": "/usr/bin:/bin", "GPUHOOK_ENGINE_ENV": "not hex"})
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == ("gpuhook: GPUHOOK_ENGINE_ENV='not hex' is not what gpuhook-runtime's front-ends write "
                             "(entries each ended by a NUL, in hex): unset GPUHOOK_ENGINE_ENV in the engine's "
                             "environment\n")

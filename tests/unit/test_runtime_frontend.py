"""relay/gpuhook-runtime.c: runc's calls go straight to runc; only a GPU container's create/run starts Python.

The front-end is built as the packages install it (``libexec/gpuhook-runtime``), beside a stand-in for
the Python wrapper (``bin/gpuhook-runtime``) that records its argv, so each test sees which of the two
a call reached. The runtime is the real runc, with a private ``--root``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuhook.cli.hygiene import ENGINE_ENV, runc_environment
from integration.relay import BUILD, launcher_text


@pytest.fixture(scope="module")
def front_end(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``<prefix>/libexec/gpuhook-runtime``, built once."""
    prefix = tmp_path_factory.mktemp("runtime")
    (prefix / "libexec").mkdir()
    subprocess.run([str(BUILD), str(prefix / "libexec/gpuhook-runtime"), "gpuhook-runtime"], check=True)
    return prefix / "libexec/gpuhook-runtime"


@pytest.fixture
def wrapper(front_end: Path, tmp_path: Path) -> Path:
    """The Python wrapper's stand-in: appends its argv to a file of this test's, then exits 7."""
    record = tmp_path / "wrapper-calls"
    script = front_end.parents[1] / "bin" / "gpuhook-runtime"
    script.parent.mkdir(exist_ok=True)
    script.write_text(f'#!/bin/sh\necho "$0 $*" >> {record}\nexit 7\n')
    script.chmod(0o755)
    return record


def run(front_end: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The front-end with *args* and a plain environment."""
    return subprocess.run([str(front_end), *args], capture_output=True, text=True, check=False, cwd=cwd,
                          env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, timeout=60)


def bundle(tmp_path: Path, env: list[str], name: str = "bundle") -> Path:
    """A bundle whose config.json has *env* (incomplete: runc refuses it, after the front-end chose)."""
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "process": {"args": ["true"], "env": env},
                                                  "root": {"path": "rootfs"}}))
    return path


def test_other_commands_go_to_runc(front_end: Path, wrapper: Path, tmp_path: Path) -> None:
    """`state`, `delete run` (a container named "run") and `--version` are runc's answers, not Python's."""
    state = run(front_end, "--root", str(tmp_path / "runc"), "state", "nosuch")
    deleted = run(front_end, "--root", str(tmp_path / "runc"), "--log-format", "json", "delete", "run")
    version = run(front_end, "--version")
    assert state.returncode == 1 and "container does not exist" in state.stderr, state
    assert deleted.returncode == 1 and "does not exist" in deleted.stderr, deleted
    assert version.returncode == 0 and version.stdout.startswith("runc version"), version
    assert not wrapper.exists()


def test_a_create_without_a_gpu_goes_to_runc(front_end: Path, wrapper: Path, tmp_path: Path) -> None:
    """No GPU marker in config.json: runc creates (here: refuses the incomplete spec) without the wrapper."""
    plain = bundle(tmp_path, ["PATH=/bin", "HOME=/root"])
    created = run(front_end, "--root", str(tmp_path / "runc"), "create", "--bundle", str(plain), "c1")
    in_cwd = run(front_end, "--root", str(tmp_path / "runc"), "run", "c2", cwd=plain)
    assert created.returncode != 0 and "runc create failed" in created.stderr, created
    assert in_cwd.returncode != 0 and "runc run failed" in in_cwd.stderr, in_cwd
    assert not wrapper.exists()


@pytest.mark.parametrize("env", [["NVIDIA_VISIBLE_DEVICES=0"], ["CUDA_VERSION=12.4"], ["X=\\u004e"]])
def test_a_create_that_may_ask_for_a_gpu_goes_to_the_wrapper(front_end: Path, wrapper: Path, tmp_path: Path,
                                                             env: list[str]) -> None:
    """Any GPU marker: the Python wrapper gets the engine's argv unchanged (its exit status is returned)."""
    gpu = bundle(tmp_path, env)
    argv = ["--root", "/r", "--log", "/l.json", "--log-format", "json", "create", f"--bundle={gpu}", "c1"]
    result = run(front_end, *argv)
    assert result.returncode == 7, result
    assert wrapper.read_text() == f"{front_end.parents[1] / 'bin/gpuhook-runtime'} {' '.join(argv)}\n"


def test_a_config_it_cannot_read_goes_to_the_wrapper(front_end: Path, wrapper: Path, tmp_path: Path) -> None:
    """A missing config.json, or one behind a symlink: the Python wrapper decides (and reports)."""
    linked = tmp_path / "linked"
    linked.mkdir()
    os.symlink(bundle(tmp_path, ["PATH=/bin"]) / "config.json", linked / "config.json")
    missing = run(front_end, "create", "-b", str(tmp_path / "nowhere"), "c1")
    symlinked = run(front_end, "create", "-b", str(linked), "c2")
    assert (missing.returncode, symlinked.returncode) == (7, 7)
    assert len(wrapper.read_text().splitlines()) == 2


@pytest.fixture(scope="module")
def built_relay(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gpuhook-relay, built once, for the layouts where the front-end's GPU create goes to it first."""
    relay = tmp_path_factory.mktemp("relay") / "gpuhook-relay"
    subprocess.run([str(BUILD), str(relay), "gpuhook-relay"], check=True)
    return relay


def layout(tmp_path: Path, front_end: Path, relay: Path | None) -> Path:
    """A prefix of its own: ``libexec/gpuhook-runtime`` (a copy of *front_end*), ``bin/gpuhook-relay`` if
    *relay*; the front-end's path. Nothing serves gpuhookd's socket the engine names (``run_in``)."""
    prefix = tmp_path / "prefix"
    (prefix / "libexec").mkdir(parents=True)
    (prefix / "bin").mkdir()
    shutil.copy2(front_end, prefix / "libexec/gpuhook-runtime")
    if relay is not None:
        shutil.copy2(relay, prefix / "bin/gpuhook-relay")
    return prefix / "libexec/gpuhook-runtime"


def run_in(program: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """*program* with *args* and the engine's *env* (and a gpuhookd socket nobody serves)."""
    engine_env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", **env,
                  "GPUHOOK_DAEMON_SOCKET": str(program.parents[2] / "nobody.sock")}
    return subprocess.run([str(program), *args], capture_output=True, text=True, check=False, env=engine_env,
                          timeout=20)


@pytest.mark.parametrize("relay", [pytest.param(True, id="through-the-relay"), pytest.param(False, id="direct")])
@pytest.mark.parametrize("put", [pytest.param(shutil.copy2, id="copy"), pytest.param(os.link, id="hard-link")])
def test_it_refuses_to_run_itself_as_the_wrapper(front_end: Path, built_relay: Path, tmp_path: Path, relay: bool,
                                                 put: Callable[[Path, Path], object]) -> None:
    """bin/gpuhook-runtime being this program (a copy or a hard link) would exec itself for ever, through the
    relay's fallback too: the copy started as the wrapper stops with one line naming itself and the fix."""
    program = layout(tmp_path, front_end, built_relay if relay else None)
    wrapper = program.parents[1] / "bin/gpuhook-runtime"
    put(program, wrapper)
    result = run_in(program, "create", "-b", str(bundle(tmp_path, ["NVIDIA_VISIBLE_DEVICES=all"])), "c1", env={})
    assert (result.returncode, result.stdout) == (1, ""), result
    assert result.stderr == (
        f"gpuhook-runtime: {wrapper} is this front-end (a copy or link of it), not the Python wrapper that belongs "
        "there, and would run itself for ever: put the Python wrapper there (the launcher of "
        "gpuhook.cli.entry:runtime, as pip and the packages install it)\n")


@pytest.mark.parametrize("relay", [pytest.param(True, id="through-the-relay"), pytest.param(False, id="direct")])
def test_the_wrapper_starts_without_the_engines_loader_variables(front_end: Path, built_relay: Path,
                                                                 tmp_path: Path, relay: bool) -> None:
    """containerd's LD_LIBRARY_PATH (k3s's here) and every other tripwire variable never reach the Python wrapper's
    interpreter; the engine's whole environment comes in ENGINE_ENV, which gives it back exactly."""
    program = layout(tmp_path, front_end, built_relay if relay else None)
    record = tmp_path / "environ"
    script = program.parents[1] / "bin/gpuhook-runtime"
    script.write_text(f"#!/bin/sh\ncat /proc/$$/environ > {record}\nexit 7\n")  # the environ it was started with
    script.chmod(0o755)
    engine = {"LD_LIBRARY_PATH": "/var/lib/rancher/k3s/agent/containerd/lib:", "LD_PRELOAD": "/x.so",
              "PYTHONPATH": "/p", "GCONV_PATH": "/g", "PYTHONUNBUFFERED": "1", "NOTIFY_SOCKET": "/run/n=1\n2"}
    result = run_in(program, "create", "--bundle", str(bundle(tmp_path, ["NVIDIA_VISIBLE_DEVICES=0"])), "c1",
                    env=engine)
    assert result.returncode == 7, result
    started = dict(entry.split("=", 1) for entry in record.read_bytes().decode().split("\0") if entry)
    assert set(started) == {"PYTHONUNBUFFERED", "NOTIFY_SOCKET", "PATH", "GPUHOOK_DAEMON_SOCKET", ENGINE_ENV}
    assert runc_environment(started) == engine | {k: started[k] for k in ("PATH", "GPUHOOK_DAEMON_SOCKET")}


def test_a_wrapper_the_engine_runs_itself_takes_roots_library_path_only(front_end: Path, tmp_path: Path) -> None:
    """The Python wrapper registered directly (BinaryName) under k3s: its interpreter got the opt plugin's
    library path, a directory only root can fill (here, one not made yet under root's /var/lib), so it gets past
    the tripwire (to the missing bundle), as through the front-end. A library path any user can fill refuses
    in one line naming the front-end beside it to register instead, which starts the wrapper without it."""
    program = layout(tmp_path, front_end, None)
    python_wrapper = program.parents[1] / "bin/gpuhook-runtime"
    python_wrapper.write_text(launcher_text(sys.executable, "runtime"))
    python_wrapper.chmod(0o755)
    missing_bundle = (1, f"gpuhook: cannot open {tmp_path / 'nowhere'}/config.json: No such file or directory\n")
    k3s = {"LD_LIBRARY_PATH": "/var/lib/rancher/k3s/agent/containerd/lib"}
    for runtime in (python_wrapper, program):
        started = run_in(runtime, "create", "--bundle", str(tmp_path / "nowhere"), "c1", env=k3s)
        assert (started.returncode, started.stderr) == missing_bundle, runtime
    anyones = tmp_path / "anyones"
    anyones.mkdir(mode=0o777)
    anyones.chmod(0o777)
    for value in (str(anyones), f"/opt/containerd/lib:{anyones / 'lib'}", "lib"):
        direct = run_in(python_wrapper, "create", "--bundle", str(tmp_path / "nowhere"), "c1",
                        env={"LD_LIBRARY_PATH": value})
        assert (direct.returncode, direct.stderr) == (1, (
            "gpuhook: the hook's environment sets LD_LIBRARY_PATH; they can inject code into a root process "
            f"(CVE-2025-23266). The engine runs the Python wrapper {python_wrapper} itself: register {program} as "
            "the runtime instead, which gives runc the engine's environment and starts the Python wrapper without "
            "them\n")), value
        fronted = run_in(program, "create", "--bundle", str(tmp_path / "nowhere"), "c1", env={"LD_LIBRARY_PATH": value})
        assert (fronted.returncode, fronted.stderr) == missing_bundle, value

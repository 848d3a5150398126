"""Every entry point that runs as root for a container: the environment tripwire, and no traceback for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuhook import __version__
from gpuhook.daemon import server
from gpuhook.errors import (
    ApplyError,
    DaemonError,
    GpuHookError,
    LdCacheFormatError,
    UnknownDeviceError,
    UsageError,
    error_from_dict,
)
from integration.fakehost import FakeHost

#: How each console script starts (pyproject.toml [project.scripts]), as a fresh isolated interpreter.
SCRIPTS = {
    "gpuhook": "from gpuhook.cli.entry import gpuhook as m; m()",
    "nvidia-container-runtime-hook": "from gpuhook.cli.entry import nvidia_hook as m; m()",
    "gpuhook-runtime": "from gpuhook.cli.entry import runtime as m; m()",
    "nvidia-container-cli": "from gpuhook.cli.entry import nvidia_cli as m; m()",
}
CLEAN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}


def run(script: str, *args: str, env: dict[str, str] | None = None, stdin: bytes = b"",
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """One console script as a runtime or a person would run it (a clean environment unless *env*)."""
    return subprocess.run([sys.executable, "-I", "-c", SCRIPTS[script], *args], input=stdin.decode(),
                          env=CLEAN_ENV | (env or {}), capture_output=True, text=True, check=False, timeout=60,
                          cwd=cwd or "/")


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    """A bundle whose container asks for GPU 0 (nothing is ever started from it here)."""
    (tmp_path / "rootfs").mkdir()
    spec = {"ociVersion": "1.0.2", "root": {"path": "rootfs"},
            "process": {"args": ["true"], "env": ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=0"]}}
    (tmp_path / "config.json").write_text(json.dumps(spec))
    return tmp_path


def state_of(bundle: Path) -> bytes:
    """The OCI state a runtime sends for *bundle* (a pid that is not the container's: never reached here)."""
    return json.dumps({"ociVersion": "1.0.2", "id": "c1", "pid": 4242, "bundle": str(bundle),
                       "status": "creating"}).encode()


def root_entry_points(bundle: Path, config: Path) -> list[tuple[str, list[str], bytes]]:
    """(script, argv, stdin) of every entry point that does work as root on a container's behalf."""
    state = state_of(bundle)
    return [
        ("gpuhook", ["--config", str(config), "prestart"], state),
        ("gpuhook", ["--config", str(config), "createRuntime"], state),
        ("gpuhook", ["--config", str(config), "poststop"], state),
        ("gpuhook", ["--config", str(config), "poststart"], state),
        ("gpuhook", ["--config", str(config), "precreate"], (bundle / "config.json").read_bytes()),
        ("gpuhook", ["--config", str(config), "spec-edit", "--bundle", str(bundle)], b""),
        ("gpuhook", ["--config", str(config), "cdi-hook", "update-ldcache", "--folder", "/usr/lib"], state),
        ("nvidia-container-runtime-hook", ["-config", str(config), "prestart"], state),
        ("gpuhook-runtime", ["create", "--bundle", str(bundle), "c1"], b""),
        ("nvidia-container-cli", ["--load-kmods", "configure", "--device=0", "--compute", "--pid=4242",
                                  str(bundle / "rootfs")], b""),
    ]


@pytest.mark.parametrize("variable", ["LD_AUDIT", "LD_PRELOAD", "PYTHONPATH", "LD_LIBRARY_PATH", "GCONV_PATH",
                                      "GLIBC_TUNABLES"])
def test_tripwire_refuses_in_every_root_entry_point(bundle: Path, host: FakeHost, variable: str) -> None:
    """A loader or interpreter variable in the environment: every root entry point refuses, naming it."""
    for script, argv, stdin in root_entry_points(bundle, host.config_path):
        # The value names no file: the loader only warns, so what is checked is gpuhook's own refusal. It is
        # under /tmp, where any user could put one (the runtime wrapper lets a library path of root's alone in).
        result = run(script, *argv, env={variable: "/tmp/nonexistent/x.so", "GPUHOOK_CONFIG": str(host.config_path)},
                     stdin=stdin)
        label = f"{script} {' '.join(argv)}"
        assert result.returncode == 1, f"{label}: {result.returncode} {result.stderr}"
        assert f"gpuhook: the hook's environment sets {variable}" in result.stderr, label
        assert "Traceback" not in result.stderr, label
    assert json.loads((bundle / "config.json").read_text())["process"]["env"][-1] == "NVIDIA_VISIBLE_DEVICES=0"
    assert "linux" not in json.loads((bundle / "config.json").read_text())  # spec-edit/runtime changed nothing


def test_containerds_own_library_path_is_not_the_containers() -> None:
    """containerd adds /opt/containerd/lib to every shim's LD_LIBRARY_PATH: gpuhook-runtime lets that pass (a
    directory only root can fill), not one any user can fill."""
    result = run("gpuhook-runtime", "create", "--bundle", "/nonexistent", "c1",
                 env={"LD_LIBRARY_PATH": "/opt/containerd/lib:"})
    assert result.returncode == 1
    assert result.stderr.strip() == "gpuhook: cannot open /nonexistent/config.json: No such file or directory"
    planted = run("gpuhook-runtime", "create", "--bundle", "/nonexistent", "c1",
                  env={"LD_LIBRARY_PATH": "/opt/containerd/lib:/tmp/x"})
    assert "the hook's environment sets LD_LIBRARY_PATH" in planted.stderr


def test_tripwire_in_gpuhookd_relay_requests() -> None:
    """gpuhookd reads a relayed call as the hook does: the same refusal, before anything is read."""
    env = b"\0".join([b"PATH=/bin", b"LD_AUDIT=/x.so"])
    parts = [__version__.encode(), b"gpuhook\0prestart", env, b"{}"]
    fds = [os.open("/", os.O_PATH) for _ in range(5)]
    try:
        own = server.OwnConfig("/etc/gpuhook/config.yaml", False)
        verdict, status, message = server._triage(b"relay", parts, fds, own)
    finally:
        for fd in fds:
            os.close(fd)
    assert (verdict, status) == (b"done", 1)
    assert message.startswith("gpuhook: the hook's environment sets LD_AUDIT")


def test_stop_stages_read_the_state_and_change_nothing(bundle: Path, host: FakeHost) -> None:
    """poststop and poststart succeed on a real state and leave the bundle as it was."""
    before = (bundle / "config.json").read_bytes()
    for stage in ("poststop", "poststart"):
        result = run("gpuhook", "--config", str(host.config_path), stage, stdin=state_of(bundle))
        assert (result.returncode, result.stderr) == (0, ""), stage
    assert (bundle / "config.json").read_bytes() == before


def bad_inputs(tmp_path: Path, host: FakeHost) -> list[tuple[str, list[str], bytes, str]]:
    """(script, argv, stdin, what the one line must say) for bad input to every command."""
    config = str(host.config_path)
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("unhealthy_gpus: sometimes\n")
    no_cache = tmp_path / "nocache.yaml"
    no_cache.write_text(host.config_path.read_text() + "\ncache_dir: null\n")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    return [
        ("gpuhook", [], b"", "the following arguments are required"),
        ("gpuhook", ["frobnicate"], b"", "invalid choice"),
        ("gpuhook", ["--config", config, "prestart"], b"not json", "the OCI state on stdin"),
        ("gpuhook", ["--config", config, "prestart"], b'{"id": "x", "pid": 5, "bundle": "rel"}', "absolute"),
        ("gpuhook", ["--config", config, "poststop"], b"[1, 2]", "the OCI state on stdin"),
        ("gpuhook", ["--config", "/nonexistent/gpuhook.yaml", "info"], b"", "/nonexistent/gpuhook.yaml"),
        ("gpuhook", ["--config", str(bad_yaml), "info"], b"", "sometimes"),
        ("gpuhook", ["--config", str(no_cache), "info", "--refresh"], b"", "cache_dir is null"),
        ("gpuhook", ["--config", config, "plan", "--bundle", "/nonexistent"], b"", "/nonexistent"),
        ("gpuhook", ["--config", config, "plan", "--bundle", str(a_file)], b"", str(a_file)),
        ("gpuhook", ["--config", config, "spec-edit", "--bundle", "/nonexistent"], b"", "/nonexistent"),
        ("gpuhook", ["--config", config, "spec-edit"], b"", "--bundle"),
        ("gpuhook", ["--config", config, "precreate"], b"{", "the spec on stdin"),
        ("gpuhook", ["--config", config, "cdi", "generate", "--format", "xml"], b"", "invalid choice"),
        ("gpuhook", ["--config", config, "cdi", "generate", "--output", f"{a_file}/x.yaml"], b"", str(a_file)),
        ("gpuhook", ["--config", config, "cdi", "bogus"], b"", "invalid choice"),
        ("gpuhook", ["--config", config, "cdi-hook", "update-ldcache", "--folder", "/usr/../../x"], b"", "--folder"),
        ("gpuhook", ["--config", config, "cdi-hook", "update-ldcache", "--folder", "/usr/lib"], b"{}", "bundle"),
        ("gpuhook", ["daemon", "--request-timeout", "nan"], b"", "--request-timeout"),
        ("gpuhook", ["daemon", "--request-timeout", "inf"], b"", "--request-timeout"),
        ("gpuhook", ["daemon", "--request-timeout", "1e10"], b"", "--request-timeout"),
        ("gpuhook", ["daemon", "--request-timeout", "soon"], b"", "invalid float"),
        ("gpuhook", ["daemon", "--socket", "relative.sock"], b"", "relative.sock"),
        ("gpuhook", ["install", "--runtime", "lxc"], b"", "invalid choice"),
        ("gpuhook", ["--config", config, "doctor", "--bogus"], b"", "unrecognized arguments"),
        ("nvidia-container-runtime-hook", ["-bogus", "prestart"], b"", "flag provided but not defined"),
        ("nvidia-container-runtime-hook", ["-config"], b"", "flag needs an argument"),
        ("nvidia-container-cli", ["configure", "--pid=abc", "/r"], b"", "--pid='abc'"),
        ("nvidia-container-cli", ["configure", "--pid=5"], b"", "rootfs"),
        ("nvidia-container-cli", ["configure", "--pid=5", "--device=zz!", "/r"], b"", "zz!"),
        ("nvidia-container-cli", ["configure", "--pid=5", "--imex-channel=x", "/r"], b"", "--imex-channel"),
        ("nvidia-container-cli", ["--bogus", "info"], b"", "unrecognized option"),
        ("nvidia-container-cli", ["frob"], b"", "unknown command"),
        ("gpuhook-runtime", ["create", "--bundle", "/nonexistent", "c1"], b"", "/nonexistent"),
    ]


def test_bad_input_gets_one_line_never_a_traceback(tmp_path: Path, host: FakeHost) -> None:
    """Every command given bad arguments or input: exit 1 or 2 and a last line ``...: `` naming the problem."""
    failures = []
    for script, argv, stdin, says in bad_inputs(tmp_path, host):
        result = run(script, *argv, stdin=stdin, env={"GPUHOOK_CONFIG": str(host.config_path)}, cwd=tmp_path)
        last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
        prefix = "nvidia-container-cli: " if script == "nvidia-container-cli" else "gpuhook: "
        ok = (result.returncode in (1, 2) and "Traceback" not in result.stderr
              and any(line.startswith(prefix) and says in line for line in result.stderr.splitlines())
              and (last.startswith(prefix) or last.startswith("usage:")))
        if not ok:
            failures.append(f"{script} {argv}: rc {result.returncode}, stderr {result.stderr[-600:]!r}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("err", [
    GpuHookError("plain"),
    UsageError("--pid='x': expected a pid"),
    UnknownDeviceError("GPU 9 is not on this host"),
    LdCacheFormatError("bad magic at 0"),
    ApplyError("mknod", "/dev/nvidia0", errno_=17),
    ApplyError("mount", "/usr/lib/x", detail="the target is a symlink"),
    DaemonError("gpuhookd /run/x: no complete answer"),
], ids=lambda e: type(e).__name__)
def test_errors_serialise_both_ways(err: GpuHookError) -> None:
    """An error survives JSON (the apply child's report, gpuhookd's) and pickle (a job sent ahead) unchanged."""
    import pickle

    for copy in (error_from_dict(json.loads(json.dumps(err.to_dict()))), pickle.loads(pickle.dumps(err))):
        assert type(copy) is type(err)
        assert str(copy) == str(err)
        assert copy.fields() == err.fields()


def test_a_garbled_error_report_is_still_one_error() -> None:
    """A report that is not one of ours becomes a plain GpuHookError carrying what it said."""
    assert str(error_from_dict({"kind": "ApplyError", "step": "x"})) == str({"step": "x"})
    assert type(error_from_dict(["x"])) is GpuHookError
    assert type(error_from_dict({"kind": "SystemExit", "message": "m"})) is GpuHookError


def test_daemon_front_end_never_imports_cli() -> None:
    """gpuhookd's modules, imported alone, bring in no gpuhook.cli module (the daemon is not a second CLI)."""
    code = ("import sys, gpuhook.daemon.server, gpuhook.daemon.client; "
            "print(sorted(m for m in sys.modules if m.startswith('gpuhook.cli')))")
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

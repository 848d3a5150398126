"""nvidia-ctk: NVIDIA's flags mapped onto gpuhook's own commands; cdi generate's directory; doctor's engine
verdicts (does each engine really see gpuhook); the CDI refresh unit at boot."""

from __future__ import annotations

import json
import os
import stat
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuhook.cli import cdi, configcmd, nvctk
from gpuhook.cli.enginecheck import hooks_view, is_gpuhooks
from gpuhook.cli.install import runtime_program
from gpuhook.doctor import EngineView, Verdict, containerd_runtimes, docker_runtimes, registration_checks
from gpuhook.install import changes
from integration.fakehost import FakeHost

#: This installation's runc wrapper: libexec's C front-end where `make relay` built it, else bin's Python one.
RUNTIME = str(runtime_program(Path(sys.executable).parent))
PACKAGING = Path(__file__).parents[2] / "packaging"


@pytest.mark.parametrize("argv", [
    pytest.param(["--runtime=docker", "--config={config}", "--set-as-default"], id="equals-form"),
    pytest.param(["--runtime", "docker", "--config", "{config}", "--nvidia-set-as-default=true"], id="space-form"),
])
def test_runtime_configure_docker_writes_the_config_it_is_given(argv: list[str], tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """`runtime configure --runtime=docker --config=PATH --set-as-default` (either flag form, either alias):
    that daemon.json gets runtime `nvidia` (NVIDIA's default name) running gpuhook-runtime as the default, the
    admin's settings kept; it says the file and the restart; nothing else is written; twice: nothing."""
    config = tmp_path / "daemon.json"
    config.write_text('{"log-level": "warn"}')
    words = ["runtime", "configure", *(w.replace("{config}", str(config)) for w in argv)]
    assert nvctk.main(words) == 0
    out = capsys.readouterr().out
    assert f"wrote {config}" in out and "restart dockerd (systemctl restart docker)" in out
    assert json.loads(config.read_text()) == {"log-level": "warn", "default-runtime": "nvidia",
                                              "runtimes": {"nvidia": {"path": RUNTIME}}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["daemon.json", "daemon.json.gpuhook-backup"]
    assert nvctk.main(words) == 0
    assert "nothing to change" in capsys.readouterr().out


def test_runtime_configure_dry_run_and_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--dry-run prints the diff and writes nothing; --runtime-name and --nvidia-runtime-path name the handler and
    the program; --set-as-default=false leaves the default alone."""
    config = tmp_path / "containerd" / "config.toml"
    words = ["runtime", "configure", "--runtime=containerd", f"--config={config}", "--runtime-name", "gpu",
             "--nvidia-runtime-path=/opt/gpuhook/bin/gpuhook-runtime", "--set-as-default=false"]
    assert nvctk.main([*words, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert 'BinaryName = "/opt/gpuhook/bin/gpuhook-runtime"' in out and "would change 2 file(s)" in out
    assert not config.parent.exists()
    assert nvctk.main(words) == 0
    dropin = tomllib.loads((config.parent / "conf.d/gpuhook.toml").read_text())
    cri = dropin["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]
    assert cri["runtimes"]["gpu"]["options"]["BinaryName"] == "/opt/gpuhook/bin/gpuhook-runtime"
    assert "default_runtime_name" not in cri
    assert tomllib.loads(config.read_text())["imports"] == [f"{config.parent}/conf.d/*.toml"]


def test_runtime_configure_crio_drop_in(tmp_path: Path) -> None:
    """--runtime=crio: NVIDIA's drop-in name in the crio.conf.d beside --config (or --drop-in-config itself)."""
    config = tmp_path / "crio.conf"
    assert nvctk.main(["runtime", "configure", "--runtime=crio", f"--config={config}", "--set-as-default"]) == 0
    crio = tomllib.loads((tmp_path / "crio.conf.d/99-nvidia.toml").read_text())["crio"]
    assert crio["runtime"]["default_runtime"] == "nvidia"
    assert crio["runtime"]["runtimes"]["nvidia"] == {"runtime_path": RUNTIME, "runtime_type": "oci"}
    assert not config.exists()
    mine = tmp_path / "mine.conf"
    assert nvctk.main(["runtime", "configure", "--runtime=crio", f"--drop-in-config={mine}"]) == 0
    assert "nvidia" in tomllib.loads(mine.read_text())["crio"]["runtime"]["runtimes"]


@pytest.mark.parametrize(("argv", "message"), [
    pytest.param([], "required: COMMAND", id="no-command"),
    pytest.param(["frobnicate"], "invalid choice: 'frobnicate'", id="unknown-command"),
    pytest.param(["runtime", "configure", "--runtime=podman"], "invalid choice: 'podman'", id="podman"),
    pytest.param(["runtime", "configure", "--set-as-default=maybe"], "'maybe' is not a boolean", id="bad-bool"),
    pytest.param(["cdi", "generate", "--mode=nvml"], "unrecognized arguments: --mode=nvml", id="unknown-flag"),
    pytest.param(["runtime", "configure", "--runtime-path=gpuhook-runtime"], "expected an absolute path",
                 id="relative-runtime"),
])
def test_usage_errors_are_one_line_and_exit_2(argv: list[str], message: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Anything gpuhook's nvidia-ctk does not do is a usage error: exit 2, one line naming it, no traceback."""
    assert nvctk.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.splitlines()[-1].startswith(("nvidia-ctk:", "gpuhook:"))


def test_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    """--version names gpuhook; --help lists the commands people script."""
    assert nvctk.main(["--version"]) == 0
    assert "gpuhook" in capsys.readouterr().out
    assert nvctk.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(word in out for word in ("runtime", "cdi", "config")), out


def test_cdi_and_config_are_gpuhooks_commands(host: FakeHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`cdi generate --output=PATH --format=json` and `cdi list` write what gpuhook's cdi does (kind
    nvidia.com/gpu, into a directory it creates); `config --config-file=PATH` is gpuhook's config show."""
    monkeypatch.setenv("GPUHOOK_CONFIG", str(host.config_path))
    out = tmp_path / "run/cdi/nvidia.json"
    assert nvctk.main(["cdi", "generate", f"--output={out}", "--format", "json"]) == 0
    spec = json.loads(out.read_text())
    assert spec["kind"] == "nvidia.com/gpu"
    capsys.readouterr()
    assert nvctk.main(["cdi", "list"]) == 0
    assert "nvidia.com/gpu=0" in capsys.readouterr().out.split()
    calls: list[tuple[Any, ...]] = []

    def show(*args: Any) -> int:
        calls.append(args)
        return 0

    monkeypatch.setattr(configcmd, "run_config_show", show)
    assert nvctk.main(["config", "--config-file=/etc/nvidia-container-runtime/config.toml"]) == 0
    assert calls and calls[0][0] == "/etc/nvidia-container-runtime/config.toml"


@pytest.fixture
def umask_077() -> Iterator[None]:
    """A restrictive umask, as a root shell or unit may have."""
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.usefixtures("umask_077")
def test_cdi_output_directory_is_made_0755(tmp_path: Path) -> None:
    """`cdi generate --output /var/run/cdi/nvidia.yaml` on a fresh boot: the missing directories are made, mode
    0755 whatever the umask (every engine must read the spec); an existing directory's mode is left alone."""
    (tmp_path / "run").mkdir(mode=0o700)
    out = tmp_path / "run/cdi/sub/nvidia.yaml"
    cdi._write_atomically(out, "kind: nvidia.com/gpu\n")
    assert out.read_text() == "kind: nvidia.com/gpu\n"
    for directory in (tmp_path / "run/cdi", tmp_path / "run/cdi/sub"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "run").stat().st_mode) == 0o700
    assert stat.S_IMODE(out.stat().st_mode) == 0o644


def test_refresh_unit_runs_at_boot() -> None:
    """/var/run is a tmpfs: the refresh service is wanted by multi-user.target (not only by the .path unit, which
    fires on driver changes alone), still skipped on a host without the NVIDIA control node."""
    service = (PACKAGING / "systemd/gpuhook-cdi-refresh.service").read_text()
    sections: dict[str, list[str]] = {}
    for line in service.splitlines():
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
        elif line and not line.startswith("#"):
            current.append(line)
    assert "WantedBy=multi-user.target" in sections["Install"]
    assert "ConditionPathExists=/dev/nvidiactl" in sections["Unit"]


# --- doctor: does each engine really see gpuhook ---------------------------------------------------------------

DUMP = f"""version = 2
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
  BinaryName = ""
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]
  runtime_type = "io.containerd.runc.v2"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]
  BinaryName = "{RUNTIME}"
"""


def test_engine_answers_are_parsed() -> None:
    """containerd's config dump and docker's info/daemon.json give each runtime's program."""
    assert containerd_runtimes(DUMP) == {"runc": "", "nvidia": RUNTIME}
    assert docker_runtimes('{"runc": {"path": "runc"}, "nvidia": {"path": "/x/gpuhook-runtime"}}') == {
        "runc": "runc", "nvidia": "/x/gpuhook-runtime"}
    assert docker_runtimes('{"log-level": "warn", "runtimes": {"nvidia": {"path": "/y"}}}') == {"nvidia": "/y"}
    assert is_gpuhooks(RUNTIME) and not is_gpuhooks("runc") and not is_gpuhooks("")


def test_registration_verdicts() -> None:
    """ok names what runs gpuhook; not registered says the install command; loaded-but-not-restarted says the
    restart; engines not installed are one line."""
    checks = registration_checks([
        EngineView(engine="containerd", installed=True, handlers=("runtime handler nvidia",),
                   source="containerd config dump"),
        EngineView(engine="podman", installed=True, source="hooks dirs /x"),
        EngineView(engine="docker", installed=True, pending=("nvidia",), source="docker info"),
        EngineView(engine="crio", installed=False),
        EngineView(engine="other", installed=False),
    ])
    assert [(c.name, c.verdict) for c in checks] == [
        ("engine containerd", Verdict.OK), ("engine podman", Verdict.WARN), ("engine docker", Verdict.WARN),
        ("engines", Verdict.OK)]
    assert "runtime handler nvidia" in checks[0].message
    assert checks[1].fix.startswith("gpuhook install --runtime podman")
    assert checks[2].fix == "systemctl restart docker"
    assert checks[3].message == "not installed (not checked): crio, other"


def test_podman_hooks_compared_by_json_content(tmp_path: Path) -> None:
    """gpuhook's hooks.d files formatted another way count as registered; a gpuhook.json that runs something
    else is reported as different; none at all is not registered."""
    bin_dir = tmp_path / "bin"
    hooks = tmp_path / "hooks.d"
    hooks.mkdir()
    assert hooks_view("podman", True, [hooks], bin_dir=bin_dir).handlers == ()
    for change in changes("podman", bin_dir=str(bin_dir), current={}):
        (hooks / change.path.rsplit("/", 1)[-1]).write_text(json.dumps(json.loads(change.content or ""), indent=7))
    assert len(hooks_view("podman", True, [hooks], bin_dir=bin_dir).handlers) == 2
    entry = yaml.safe_load((hooks / "gpuhook.json").read_text())
    entry["hook"]["path"] = "/usr/bin/true"
    (hooks / "gpuhook.json").write_text(json.dumps(entry))
    view = hooks_view("podman", True, [hooks], bin_dir=bin_dir)
    assert view.differs == (str(hooks / "gpuhook.json"),)
    assert registration_checks([view])[0].verdict is Verdict.WARN

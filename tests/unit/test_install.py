"""gpuhook install: the exact change per engine, idempotent, with backups; the shipped k8s files parse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gpuhook.cli.install import run_install
from gpuhook.errors import ConfigError
from gpuhook.install import changes, docker_daemon_json

BIN = "/usr/lib/gpuhook/bin"
PACKAGING = Path(__file__).parents[2] / "packaging"


def test_docker_dry_run_then_real_run_then_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--dry-run prints the diff and writes nothing; a real run writes it (with a backup); a second run is a no-op."""
    daemon = tmp_path / "etc/docker/daemon.json"
    daemon.parent.mkdir(parents=True)
    daemon.write_text('{"log-level": "warn"}\n')
    assert run_install("docker", dry_run=True, root=tmp_path, bin_dir=Path(BIN)) == 0
    out = capsys.readouterr().out
    assert '+    "gpuhook": {' in out and f"link /usr/local/bin/nvidia-container-runtime-hook -> {BIN}/" in out
    assert daemon.read_text() == '{"log-level": "warn"}\n'
    run_install("docker", dry_run=False, root=tmp_path, bin_dir=Path(BIN))
    assert "restart dockerd" in capsys.readouterr().out
    data = json.loads(daemon.read_text())
    assert data == {"log-level": "warn", "runtimes": {"gpuhook": {"path": f"{BIN}/gpuhook-runtime"}}}
    assert (tmp_path / "etc/docker/daemon.json.gpuhook-backup").read_text() == '{"log-level": "warn"}\n'
    link = tmp_path / "usr/local/bin/nvidia-container-runtime-hook"
    assert link.readlink() == Path(f"{BIN}/nvidia-container-runtime-hook")
    run_install("docker", dry_run=False, root=tmp_path, bin_dir=Path(BIN))
    assert "nothing to change" in capsys.readouterr().out


@pytest.mark.parametrize("engine", ["containerd", "podman", "crio"])
def test_other_engines_are_idempotent(engine: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """containerd's drop-in, podman's and CRI-O's hooks.d file: written once, then nothing to change."""
    run_install(engine, dry_run=False, root=tmp_path, bin_dir=Path(BIN))
    capsys.readouterr()
    run_install(engine, dry_run=False, root=tmp_path, bin_dir=Path(BIN))
    assert "nothing to change" in capsys.readouterr().out
    for change in changes(engine, bin_dir=BIN, current={}):
        target = tmp_path / change.path.lstrip("/")
        assert target.is_symlink() if change.link_to else target.read_text() == change.content


def test_hooks_d_entry_is_safe_and_matches_the_shipped_file() -> None:
    """An absolute path and a non-empty env (NVIDIAScape); the shipped packaging file (the package has
    gpuhook-relay) says the same."""
    (change,) = changes("podman", bin_dir=BIN, current={}, relay=True)
    hook = json.loads(change.content or "")
    assert hook["hook"]["path"].startswith("/") and hook["hook"]["env"]
    assert hook == json.loads((PACKAGING / "oci-hooks.d/gpuhook.json").read_text())


def test_with_the_relays_installed_engines_run_them() -> None:
    """The packages' layout: hooks.d runs bin/gpuhook-relay, docker --gpus libexec's relay under NVIDIA's name."""
    (hooks_d,) = changes("podman", bin_dir=BIN, current={}, relay=True)
    assert json.loads(hooks_d.content or "")["hook"]["path"] == f"{BIN}/gpuhook-relay"
    link = next(c for c in changes("docker", bin_dir=BIN, current={}, relay=True) if c.link_to)
    assert link.link_to == "/usr/lib/gpuhook/libexec/nvidia-container-runtime-hook"


def test_broken_daemon_json_is_refused() -> None:
    """A daemon.json that is not a JSON object is never overwritten."""
    with pytest.raises(ConfigError, match="not valid JSON"):
        docker_daemon_json("{oops", f"{BIN}/gpuhook-runtime")


def test_kubernetes_files_parse_and_agree() -> None:
    """The RuntimeClass names the handler the containerd drop-in defines; the DaemonSet runs gpuhook install."""
    runtime_class = yaml.safe_load((PACKAGING / "kubernetes/runtimeclass.yaml").read_text())
    dropin = (PACKAGING / "kubernetes/containerd-gpuhook.toml").read_text()
    assert runtime_class["handler"] == "gpuhook" and "runtimes.gpuhook]" in dropin
    (change, _) = changes("containerd", bin_dir=BIN, current={})
    assert 'BinaryName = "/usr/lib/gpuhook/bin/gpuhook-runtime"' in dropin and change.content and \
        'BinaryName = "/usr/lib/gpuhook/bin/gpuhook-runtime"' in change.content
    daemonset = yaml.safe_load((PACKAGING / "kubernetes/daemonset.yaml").read_text())
    pod = daemonset["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"][0]
    assert "gpuhook install --runtime containerd --root /host" in args
    # then it stays as gpuhookd, on the host's socket, in the host's pid namespace
    assert args.endswith("exec /usr/lib/gpuhook/bin/gpuhook daemon --socket /run/gpuhook/gpuhookd.sock")
    assert pod["hostPID"] is True
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    assert host_paths[next(n for n, p in mounts.items() if p == "/run/gpuhook")] == "/run/gpuhook"

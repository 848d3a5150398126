"""NVIDIA's config.toml under real runc: its keys govern the simulated host's containers as gpuhook's own do.

The simulated host needs dev_root and proc_root, which NVIDIA's file has no key for: they go in its
``[gpuhook]`` table (NVIDIA's tools ignore it), while the keys under test are NVIDIA's own. The lookup of
/etc/nvidia-container-runtime/config.toml is exercised without touching the machine's /etc: runc runs in a
private mount namespace whose /etc is an overlay holding the file (and hiding any /etc/gpuhook).
"""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from integration.engines import RunResult, require_tool, run_container, unique_id
from integration.fakehost import FakeHost

from .conftest import HOOK_ENV, Container, MakeContainer, hook_entry

PROBE = "devopen /dev/nvidia0"
UNPRIVILEGED_ASK = {"NVIDIA_VISIBLE_DEVICES": "0"}


def _toml_string(value: str) -> str:
    return json.dumps(value)  # a JSON string of printable text is a TOML basic string


def nvidia_toml(host: FakeHost, nvidia_keys: str) -> str:
    """NVIDIA's config.toml for *host*: *nvidia_keys* (top-level), the driver root as NVIDIA names it,
    and the rest of the host's gpuhook settings in the [gpuhook] table."""
    own: dict[str, Any] = yaml.safe_load(host.config_path.read_text())
    root = own.pop("driver_root")
    table = "".join(f"{key} = {_toml_string(str(value))}\n" for key, value in own.items())
    return f"{nvidia_keys}\n[nvidia-container-cli]\nroot = {_toml_string(root)}\n\n[gpuhook]\n{table}"


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _set_privileged(container: Container) -> None:
    """CAP_SYS_ADMIN in the bounding set: NVIDIA's (and gpuhook's) definition of a privileged container."""
    spec = json.loads((container.bundle / "config.json").read_text())
    for kind in ("bounding", "effective", "permitted"):
        spec["process"]["capabilities"][kind].append("CAP_SYS_ADMIN")
    (container.bundle / "config.json").write_text(json.dumps(spec))


def test_unprivileged_env_request_is_refused_as_with_gpuhooks_key(make_container: MakeContainer, host: FakeHost,
                                                                  tmp_path: Path) -> None:
    """accept-nvidia-visible-devices-envvar-when-unprivileged = false: an unprivileged NVIDIA_VISIBLE_DEVICES=0
    gets nothing, exactly what gpuhook.yaml's accept_envvar_when_unprivileged: false gives."""
    toml = _write(tmp_path, "config.toml",
                  nvidia_toml(host, "accept-nvidia-visible-devices-envvar-when-unprivileged = false"))
    own = _write(tmp_path, "own.yaml", host.config_path.read_text() + "accept_envvar_when_unprivileged: false\n")
    results = [make_container(PROBE, UNPRIVILEGED_ASK, hook=hook_entry(path, "prestart")).run() for path in (toml, own)]
    for result in results:
        assert result.returncode == 0, result.stderr
        assert "/dev/nvidia0 ENOENT" in result.stdout, result.stdout
    assert results[0].stdout == results[1].stdout


def test_privileged_and_permitted_requests_still_get_the_gpu(make_container: MakeContainer, host: FakeHost,
                                                             tmp_path: Path) -> None:
    """The key narrows only unprivileged containers; set true (NVIDIA's default), they get GPU 0 again."""
    refusing = _write(tmp_path, "refusing.toml",
                      nvidia_toml(host, "accept-nvidia-visible-devices-envvar-when-unprivileged = false"))
    privileged = make_container(PROBE, UNPRIVILEGED_ASK, hook=hook_entry(refusing, "prestart"))
    _set_privileged(privileged)
    permitting = _write(tmp_path, "permitting.toml",
                        nvidia_toml(host, "accept-nvidia-visible-devices-envvar-when-unprivileged = true"))
    unprivileged = make_container(PROBE, UNPRIVILEGED_ASK, hook=hook_entry(permitting, "prestart"))
    for result in (privileged.run(), unprivileged.run()):
        assert result.returncode == 0, result.stderr
        assert "/dev/nvidia0 ENXIO" in result.stdout, result.stdout  # injected: the cgroup allows it, no driver


def test_disable_require(make_container: MakeContainer, host: FakeHost, tmp_path: Path) -> None:
    """An image's unmet NVIDIA_REQUIRE_CUDA refuses the start; with disable-require = true it starts with its GPU."""
    env = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_REQUIRE_CUDA": "cuda>=99.0"}
    checked = _write(tmp_path, "checked.toml", nvidia_toml(host, "disable-require = false"))
    refused = make_container(PROBE, env, hook=hook_entry(checked, "prestart")).run()
    assert refused.returncode != 0 and "NVIDIA_REQUIRE_CUDA" in refused.stderr, refused.stderr
    disabled = _write(tmp_path, "disabled.toml", nvidia_toml(host, "disable-require = true"))
    started = make_container(PROBE, env, hook=hook_entry(disabled, "prestart")).run()
    assert started.returncode == 0, started.stderr
    assert "/dev/nvidia0 ENXIO" in started.stdout


def _etc_with(tmp_path: Path, toml: str) -> tuple[Path, Path]:
    """An overlay's upper and work dirs that add /etc/nvidia-container-runtime/config.toml and hide /etc/gpuhook."""
    upper, work = tmp_path / "etc-upper", tmp_path / "etc-work"
    (upper / "nvidia-container-runtime").mkdir(parents=True)
    work.mkdir()
    (upper / "nvidia-container-runtime" / "config.toml").write_text(toml)
    os.mknod(upper / "gpuhook", stat.S_IFCHR | 0o600, 0)  # an overlay whiteout: no gpuhook config of its own
    return upper, work


def _in_private_etc(upper: Path, work: Path, argv: list[str]) -> list[str]:
    """*argv* run in a private mount namespace whose /etc is the overlay (the machine's /etc is untouched)."""
    mount = (f"mount -t overlay overlay -o lowerdir=/etc,upperdir={shlex.quote(str(upper))},"
             f"workdir={shlex.quote(str(work))} /etc && exec \"$@\"")
    return [require_tool("unshare"), "--mount", "--propagation", "private", "--", require_tool("sh"), "-c", mount,
            "sh", *argv]


def test_nvidia_config_is_read_when_gpuhook_has_none(make_container: MakeContainer, host: FakeHost,
                                                    tmp_path: Path) -> None:
    """No --config, no $GPUHOOK_CONFIG, no /etc/gpuhook/config.yaml: NVIDIA's /etc file governs the hook."""
    upper, work = _etc_with(tmp_path, nvidia_toml(host, "accept-nvidia-visible-devices-envvar-when-unprivileged "
                                                        "= false"))
    shown = subprocess.run(_in_private_etc(upper, work, [sys.executable, "-I", "-m", "gpuhook", "config", "show"]),
                           capture_output=True, text=True, check=False, env={"PATH": os.environ["PATH"]})
    assert shown.returncode == 0, shown.stderr
    assert "from /etc/nvidia-container-runtime/config.toml" in shown.stdout
    assert ("accept_envvar_when_unprivileged: false  # NVIDIA's config.toml: "
            "accept-nvidia-visible-devices-envvar-when-unprivileged") in shown.stdout

    wrapper = tmp_path / "runc-private-etc"
    wrapper.write_text("#!/bin/sh\nexec " + shlex.join(_in_private_etc(upper, work, [require_tool("runc")])) +
                       ' "$@"\n')
    wrapper.chmod(0o755)
    plain_hook = {"path": sys.executable, "args": [sys.executable, "-I", "-m", "gpuhook", "prestart"],
                  "env": HOOK_ENV}
    refused = _run(make_container(PROBE, UNPRIVILEGED_ASK, hook=plain_hook), wrapper)
    assert refused.returncode == 0, refused.stderr
    assert "/dev/nvidia0 ENOENT" in refused.stdout, refused.stdout
    # The same container, the key set true in that same /etc file: it gets GPU 0 (so the file was what refused it).
    (upper / "nvidia-container-runtime" / "config.toml").write_text(
        nvidia_toml(host, "accept-nvidia-visible-devices-envvar-when-unprivileged = true"))
    granted = _run(make_container(PROBE, UNPRIVILEGED_ASK, hook=plain_hook), wrapper)
    assert granted.returncode == 0, granted.stderr
    assert "/dev/nvidia0 ENXIO" in granted.stdout, granted.stdout


def _run(container: Container, wrapper: Path) -> RunResult:
    return run_container("runc", container.bundle, unique_id("gpuhook"), wrapper=wrapper)

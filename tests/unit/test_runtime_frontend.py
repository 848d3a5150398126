"""relay/gpuhook-runtime.c: runc's calls go straight to runc; only a GPU container's create/run starts Python.

The front-end is built as the packages install it (``libexec/gpuhook-runtime``), beside a stand-in for
the Python wrapper (``bin/gpuhook-runtime``) that records its argv, so each test sees which of the two
a call reached. The runtime is the real runc, with a private ``--root``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from integration.relay import BUILD


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


def test_it_refuses_to_run_itself_as_the_wrapper(front_end: Path, tmp_path: Path) -> None:
    """bin/gpuhook-runtime being this program would exec itself for ever: refused, naming the fix."""
    script = front_end.parents[1] / "bin" / "gpuhook-runtime"
    script.parent.mkdir(exist_ok=True)
    script.unlink(missing_ok=True)
    os.link(front_end, script)
    try:
        result = run(front_end, "create", "-b", str(bundle(tmp_path, ["NVIDIA_VISIBLE_DEVICES=all"])), "c1")
    finally:
        script.unlink()
    assert result.returncode == 1 and "is this program itself" in result.stderr, result

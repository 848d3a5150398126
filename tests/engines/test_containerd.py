"""containerd's ``ctr run --gpus N``: a real private containerd runs gpuhook as nvidia-container-cli."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuhook.cli.install import runtime_program
from integration.containerd import DEBIAN_CONFIG, Containerd
from integration.engines import host_mounts, leftover_cgroups, unique_id
from integration.fakehost import FakeHost
from integration.rootfs import build_rootfs

REPO = Path(__file__).parents[2]
IMAGE = "docker.io/library/gpuhook-busybox:test"
HOOK_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
#: Opens GPU 0 and 1 and loads libcuda: ENXIO = injected and allowed (no driver), ENOENT = not injected.
SCRIPT = "devopen /dev/nvidia0 /dev/nvidia1; dltest libcuda.so.1"


def _cli() -> Path:
    """The installed nvidia-container-cli script next to the test's interpreter (the venv's)."""
    script = Path(sys.executable).parent / "nvidia-container-cli"
    if not script.is_file():
        pytest.fail(f"{script} is missing: install gpuhook into this venv (pip install -e .) so the script exists")
    return script


def _wrapper(bindir: Path, config: Path) -> Path:
    """An nvidia-container-cli for ctr's PATH that runs gpuhook's with a clean env (ctr passes the user's)."""
    bindir.mkdir(parents=True, exist_ok=True)
    wrapper = bindir / "nvidia-container-cli"
    wrapper.write_text(f'#!/bin/sh\nexec env -i PATH={HOOK_PATH} GPUHOOK_CONFIG={config} {_cli()} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


@pytest.fixture(scope="module")
def ctrd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Containerd]:
    """A private containerd (own root, state and socket) with the busybox+glibc image; stopped by pid after."""
    if os.geteuid() != 0:
        pytest.fail("the containerd tests start a real containerd and containers and must run as root (make test does)")
    daemon = Containerd(tmp_path_factory.mktemp("containerd"))
    try:
        daemon.start()
        daemon.import_rootfs(build_rootfs(REPO / ".cache" / "rootfs"), IMAGE)
        yield daemon
    finally:
        daemon.stop()


@pytest.fixture(scope="module")
def ctr_env(tmp_path_factory: pytest.TempPathFactory, host: FakeHost) -> dict[str, str]:
    """ctr's environment: the wrapper first on PATH, nothing else."""
    bindir = tmp_path_factory.mktemp("ctr-bin")
    _wrapper(bindir, host.config_path)
    return {"PATH": f"{bindir}:{HOOK_PATH}"}


def test_ctr_gpus_gives_the_container_that_gpu(ctrd: Containerd, ctr_env: dict[str, str], host: FakeHost) -> None:
    """``ctr run --gpus 1``: /dev/nvidia1 injected and allowed, /dev/nvidia0 not there, libcuda loads."""
    before = host_mounts(host.root)
    container_id = unique_id("ctr")
    result = ctrd.run(IMAGE, container_id, "/bin/sh", "-c", SCRIPT, options=("--gpus", "1"), env=ctr_env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["/dev/nvidia0 ENOENT", "/dev/nvidia1 ENXIO", "dlopen libcuda.so.1: OK"]
    log = (host.root / "gpuhook.log").read_text()
    assert f'"container_id": "{container_id}"' in log and '"front_end": "nvidia-container-cli"' in log
    assert host_mounts(host.root) == before
    assert leftover_cgroups(container_id) == []


def test_ctr_two_gpus(ctrd: Containerd, ctr_env: dict[str, str]) -> None:
    """``--gpus 0 --gpus 1`` becomes --device=0,1: both nodes open with ENXIO."""
    result = ctrd.run(IMAGE, unique_id("ctr"), "/bin/sh", "-c", SCRIPT, options=("--gpus", "0", "--gpus", "1"),
                      env=ctr_env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[:2] == ["/dev/nvidia0 ENXIO", "/dev/nvidia1 ENXIO"]


def test_ctr_unknown_gpu_is_refused_with_one_line(ctrd: Containerd, ctr_env: dict[str, str]) -> None:
    """``--gpus 9`` on a 4-GPU host: the container does not start, and ctr shows gpuhook's reason."""
    container_id = unique_id("ctr")
    result = ctrd.run(IMAGE, container_id, "/bin/true", options=("--gpus", "9"), env=ctr_env)
    assert result.returncode != 0
    assert "gpuhook: --device='9': no GPU with index 9 on this host" in result.stderr
    assert container_id not in ctrd.ctr("containers", "list", "--quiet").stdout


def test_ctr_with_python_env_is_refused(ctrd: Containerd, host: FakeHost, tmp_path: Path) -> None:
    """Without the env -i wrapper the hook gets ctr's env; a PYTHON*/LD_* variable there refuses the container."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "nvidia-container-cli").symlink_to(_cli())
    env = {"PATH": f"{bindir}:{HOOK_PATH}", "GPUHOOK_CONFIG": str(host.config_path), "LD_LIBRARY_PATH": "/nowhere"}
    result = ctrd.run(IMAGE, unique_id("ctr"), "/bin/true", options=("--gpus", "0"), env=env)
    assert result.returncode != 0
    assert "the hook's environment sets LD_LIBRARY_PATH" in result.stderr and "env -i" in result.stderr




def _containerd_seeing(etc: Path, bindir: Path) -> Path:
    """A `containerd` for the doctor's probe that runs the real one in a private mount namespace where *etc*
    is /etc/containerd: it reads exactly what `install --root` wrote, at the paths the host would have."""
    bindir.mkdir(parents=True, exist_ok=True)
    wrapper = bindir / "containerd"
    wrapper.write_text("#!/bin/sh\n"
                       f"exec unshare --mount --propagation private sh -c 'mount --bind \"$0\" /etc/containerd && "
                       f"exec containerd \"$@\"' {etc} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


@pytest.mark.parametrize("name", ["gpuhook", "nvidia"])
def test_stock_debian_config_plus_install_knows_the_handler(name: str, tmp_path: Path) -> None:
    """containerd 1.6 with Debian's stock config.toml plus `gpuhook install --runtime containerd [--name nvidia]`:
    containerd's own `config dump` has the runtime handler running gpuhook-runtime (the imports line makes it
    read the drop-in), and doctor's containerd check says so; before the install it says not registered."""
    from gpuhook.cli import main
    from gpuhook.cli.enginecheck import containerd_view
    from gpuhook.doctor import Verdict, registration_checks

    if os.geteuid() != 0 or not Path("/etc/containerd").is_dir():
        pytest.fail("needs root and containerd's /etc/containerd (make test installs containerd and runs as root)")
    root = tmp_path / "root"
    etc = root / "etc/containerd"
    etc.mkdir(parents=True)
    (etc / "config.toml").write_text(DEBIAN_CONFIG)
    containerd = str(_containerd_seeing(etc, tmp_path / "bin"))
    before = registration_checks([containerd_view(containerd)])[0]
    assert before.verdict is Verdict.WARN and before.fix.startswith("gpuhook install --runtime containerd"), before
    bin_dir = Path(sys.executable).parent
    assert main(["install", "--runtime", "containerd", "--root", str(root), "--bin-dir", str(bin_dir),
                 *(("--name", name) if name != "gpuhook" else ())]) == 0
    view = containerd_view(containerd)
    assert view.error == "" and view.handlers == (f"runtime handler {name} ({runtime_program(bin_dir)})",), view
    assert registration_checks([view])[0].verdict is Verdict.OK

"""gpuhook as the prestart hook of real runc and crun containers on a simulated 4-GPU host."""

from __future__ import annotations

import json

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from integration.engines import host_mounts, tree_snapshot
from integration.fakehost import FakeHost

from .conftest import MakeContainer, hook_entry

TWO_GPUS = {"NVIDIA_VISIBLE_DEVICES": "1,3", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"}
PROBE = (
    "devopen /dev/nvidia1 /dev/nvidia3 /dev/nvidiactl /dev/nvidia-uvm /dev/nvidia0; "
    "mknod /tmp/gpu0 c 195 0 && devopen /tmp/gpu0; "
    "dltest libcuda.so.1 libnvidia-ml.so.1; "
    "test -x /usr/bin/nvidia-smi && echo nvidia-smi OK"
)


def lines(output: str) -> set[str]:
    """Output lines as a set."""
    return {line.strip() for line in output.splitlines() if line.strip()}


@pytest.mark.parametrize("engine", ["runc", "crun"])
def test_two_gpus_are_injected(make_container: MakeContainer, engine: str) -> None:
    """NVIDIA_VISIBLE_DEVICES=1,3: exactly those GPUs open (ENXIO: allowed, no driver), others do not."""
    result = make_container(PROBE, TWO_GPUS, engine=engine).run()
    assert result.returncode == 0, result.stderr
    assert {
        "/dev/nvidia1 ENXIO", "/dev/nvidia3 ENXIO", "/dev/nvidiactl ENXIO", "/dev/nvidia-uvm ENXIO",
        "/dev/nvidia0 ENOENT",  # not selected, so not created
        "/tmp/gpu0 EPERM",  # a node the container makes itself is still refused by the device cgroup
        "dlopen libcuda.so.1: OK", "dlopen libnvidia-ml.so.1: OK",  # through the container's new ld.so.cache
        "nvidia-smi OK",
    } <= lines(result.stdout)


def test_mounts_are_read_only_and_nodes_have_host_numbers(make_container: MakeContainer, host: FakeHost) -> None:
    """Libraries are ro,nosuid,nodev bind mounts; nodes carry the host's exact major:minor."""
    script = ("grep libcuda.so /proc/self/mountinfo; stat -c '%n %t:%T' /dev/nvidia3 /dev/nvidia-uvm; "
              "touch /usr/bin/nvidia-smi 2>&1 || true")
    result = make_container(script, TWO_GPUS).run()
    assert result.returncode == 0, result.stderr
    mount_line = next(line for line in result.stdout.splitlines() if "libcuda.so." in line)
    assert {"ro", "nosuid", "nodev"} <= set(mount_line.split()[5].split(","))
    assert f"/dev/nvidia-uvm {host.uvm_major:x}:0" in result.stdout
    assert "/dev/nvidia3 c3:3" in result.stdout
    assert "Read-only file system" in result.stdout


def test_container_without_nvidia_variables_is_untouched(make_container: MakeContainer, host: FakeHost) -> None:
    """No NVIDIA variables: the container starts, nothing is injected, the hook does not even log."""
    log = host.root / "gpuhook.log"
    before_log = log.read_bytes() if log.exists() else b""
    container = make_container("ls /dev; ls /usr/lib/x86_64-linux-gnu | wc -l", {})
    before = tree_snapshot(container.rootfs)
    result = container.run()
    assert result.returncode == 0, result.stderr
    assert "nvidia" not in result.stdout
    assert tree_snapshot(container.rootfs) == before
    # (A gpuhookd of this host may log, at any moment, that an earlier container's lease was released.)
    after = (log.read_bytes() if log.exists() else b"")
    assert after.startswith(before_log)
    assert all(json.loads(line)["why"] == "holder exited" for line in after[len(before_log):].splitlines())


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        pytest.param({"NVIDIA_VISIBLE_DEVICES": "9"}, ["'9'", "no GPU with index 9", "it has 4 GPUs"], id="no-gpu-9"),
        pytest.param({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "compute,cuda"},
                     ["unknown capability 'cuda'", "compat32, compute"], id="unknown-capability"),
        pytest.param({"NVIDIA_VISIBLE_DEVICES": "GPU-nope"}, ["'GPU-nope' is not a device"], id="malformed"),
    ],
)
def test_bad_requests_are_refused_cleanly(make_container: MakeContainer, host: FakeHost, env: dict[str, str],
                                          expected: list[str]) -> None:
    """The container is refused with a message naming the value; no mounts, files or devices are left."""
    container = make_container("echo started", env)
    owned = (container.bundle.parent, host.root)
    files_before, mounts_before = tree_snapshot(container.rootfs), host_mounts(*owned)
    result = container.run()
    assert result.returncode != 0 and "started" not in result.stdout
    for text in expected:
        assert text in result.stderr
    assert "Traceback" not in result.stderr
    assert tree_snapshot(container.rootfs) == files_before
    assert host_mounts(*owned) == mounts_before
    if "9" in env.get("NVIDIA_VISIBLE_DEVICES", ""):
        for gpu in host.gpus:
            assert gpu.uuid in result.stderr  # the message lists what exists


def test_failed_apply_rolls_back(make_container: MakeContainer, host: FakeHost) -> None:
    """An image whose /usr/bin/nvidia-smi is a directory: refused, and every node and file made is undone."""
    container = make_container("echo started", TWO_GPUS, prepare=lambda r: (r / "usr/bin/nvidia-smi").mkdir())
    owned = (container.bundle.parent, host.root)
    files_before, mounts_before = tree_snapshot(container.rootfs), host_mounts(*owned)
    result = container.run()
    assert result.returncode != 0
    assert "/usr/bin/nvidia-smi: exists in the image and is not a regular file" in result.stderr
    assert tree_snapshot(container.rootfs) == files_before
    assert host_mounts(*owned) == mounts_before


def test_symlinked_mount_target_stays_inside_the_rootfs(make_container: MakeContainer, tmp_path: Path) -> None:
    """An image that points the libs dir at a host path gets the mounts inside its own rootfs, never on the host."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "marker").write_text("host")

    def prepare(rootfs: Path) -> None:
        shutil.rmtree(rootfs / "usr/lib/x86_64-linux-gnu")
        (rootfs / "usr/lib/x86_64-linux-gnu").symlink_to(victim)  # absolute: resolves in the rootfs, not the host

    container = make_container("ls /usr/lib/x86_64-linux-gnu | grep -c libcuda", TWO_GPUS, prepare=prepare)
    result = container.run()
    assert sorted(p.name for p in victim.iterdir()) == ["marker"]
    assert (victim / "marker").read_text() == "host"
    assert result.returncode == 0, result.stderr
    assert (container.rootfs / victim.relative_to("/") / "libcuda.so.550.54.15").exists()


def test_nvidia_hook_name_works(make_container: MakeContainer, host: FakeHost) -> None:
    """The nvidia-container-runtime-hook front-end (docker's --gpus name) with NVIDIA's -config flag."""
    script = Path(sys.executable).with_name("nvidia-container-runtime-hook")
    hook = {"path": str(script),
            "args": ["nvidia-container-runtime-hook", "-config", str(host.config_path), "prestart"],
            "env": ["PATH=/usr/bin:/bin"]}
    result = make_container(PROBE, TWO_GPUS, hook=hook).run()
    assert result.returncode == 0, result.stderr
    assert "/dev/nvidia3 ENXIO" in result.stdout


def test_plan_and_info_work_unprivileged(host: FakeHost, tmp_path: Path) -> None:
    """`gpuhook plan` and `gpuhook info` need no root on the simulated host."""
    config = tmp_path / "nolog.yaml"
    config.write_text(host.config_path.read_text().replace(f"log_file: {host.root}/gpuhook.log", "log_file: null"))
    bundle = tmp_path / "bundle"
    (bundle / "rootfs/etc").mkdir(parents=True)
    (bundle / "rootfs/etc/debian_version").write_text("12\n")
    (bundle / "config.json").write_text(
        '{"ociVersion":"1.0.2","process":{"env":["NVIDIA_VISIBLE_DEVICES=1,3"]},"root":{"path":"rootfs"}}')
    for path in (tmp_path, *tmp_path.parents):
        if path == Path("/tmp"):
            break
        path.chmod(0o755)
    config.chmod(0o644)
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
    base = [sys.executable, "-I", "-m", "gpuhook", "--config", str(config)]
    env = {"PATH": "/usr/bin:/bin"}
    info = subprocess.run([*nobody, *base, "info"], capture_output=True, text=True, env=env, cwd="/", check=False)
    assert info.returncode == 0, info.stderr
    assert "NVRM version:   550.54.15" in info.stdout and host.gpus[3].uuid in info.stdout
    plan = subprocess.run([*nobody, *base, "plan", "--bundle", str(bundle)], capture_output=True, text=True,
                          env=env, cwd="/", check=False)
    assert plan.returncode == 0, plan.stderr
    assert '"/dev/nvidia3"' in plan.stdout and '"c 195:1 rw"' in plan.stdout
    assert '"/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15"' in plan.stdout
    assert os.geteuid() == 0  # the test itself ran as root and dropped privileges only for the commands


def test_packaged_launcher_runs_the_hook(make_container: MakeContainer, host: FakeHost) -> None:
    """packaging/gpuhook-hook, run as its `python -I` shebang would run it, injects the GPUs."""
    launcher = Path(__file__).parents[2] / "packaging" / "gpuhook-hook"
    hook = {"path": sys.executable, "args": [sys.executable, "-I", str(launcher), "--config", str(host.config_path),
                                            "prestart"], "env": ["PATH=/usr/bin:/bin"]}
    result = make_container(PROBE, TWO_GPUS, hook=hook).run()
    assert result.returncode == 0, result.stderr
    assert "/dev/nvidia1 ENXIO" in result.stdout and "dlopen libcuda.so.1: OK" in result.stdout


def test_plan_shows_which_gpus_count_would_take(host: FakeHost, tmp_path: Path) -> None:
    """`gpuhook plan` of a `count=2` container on exclusive GPUs, GPU 0 held by a running process: the GPUs
    a start would pick now (1 and 2), and nothing is leased by the dry run."""
    from gpuhook.provision import ledger_store
    from gpuhook.sharing.ledger import Holder, Lease, Ledger
    from gpuhook.sys.procstat import start_ticks

    state = tmp_path / "state"
    config = host.write_config(tmp_path / "gpuhook.yaml", state_dir=state,
                               gpus=[{"device": "all", "sharing": "exclusive"}])
    me = Holder(pid=os.getpid(), start=start_ticks(os.getpid()) or 0)
    held = Lease(container_id="holder", devices=(host.gpus[0].uuid,), holder=me, since="2026-12-01T00:00:00Z")
    ledger_store.update(state, lambda ledger: (ledger.reserve(held), None))
    bundle = tmp_path / "bundle"
    (bundle / "rootfs").mkdir(parents=True)
    (bundle / "config.json").write_text(
        '{"ociVersion":"1.0.2","process":{"env":["NVIDIA_VISIBLE_DEVICES=count=2"]},"root":{"path":"rootfs"}}')
    plan = subprocess.run([sys.executable, "-I", "-m", "gpuhook", "--config", str(config), "plan", "--bundle",
                           str(bundle)], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, check=False)
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["plan"]["gpus"] == [host.gpus[1].uuid, host.gpus[2].uuid]
    assert ledger_store.read(state) == Ledger((held,))


def test_an_image_without_cuda_compat_gets_no_warning(make_container: MakeContainer, host: FakeHost) -> None:
    """Most images have no /usr/local/cuda/compat: a GPU start says nothing about it (it is no problem)."""
    log = host.root / "gpuhook.log"
    offset = log.stat().st_size if log.exists() else 0
    result = make_container("true", TWO_GPUS).run()
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in log.read_bytes()[offset:].splitlines()]
    assert "applied" in {e["event"] for e in events}
    assert [e for e in events if e["level"] == "warning" and "cuda/compat" in json.dumps(e)] == []


def test_the_cache_gpuhook_writes_is_the_sandboxed_ldconfigs(make_container: MakeContainer, host: FakeHost,
                                                              tmp_path: Path) -> None:
    """The same start with gpuhook writing the cache (the default) and with the sandboxed ldconfig
    (``ldconfig_native: false``) leaves byte-equal caches and the same links in the rootfs; only
    ldconfig leaves its auxiliary cache."""
    from gpuhook.apply.ldprofile import links_in

    sandboxed = tmp_path / "sandboxed.yaml"
    sandboxed.write_text(host.config_path.read_text() + "\nldconfig_native: false\n")
    ours = make_container("dltest libcuda.so.1", TWO_GPUS, prepare=_with_var_cache)
    theirs = make_container("dltest libcuda.so.1", TWO_GPUS, prepare=_with_var_cache,
                            hook=hook_entry(sandboxed, "prestart"))
    for container in (ours, theirs):
        result = container.run()
        assert result.returncode == 0 and "dlopen libcuda.so.1: OK" in result.stdout, result.stderr
    assert (ours.rootfs / "etc/ld.so.cache").read_bytes() == (theirs.rootfs / "etc/ld.so.cache").read_bytes()
    assert links_in(ours.rootfs) == links_in(theirs.rootfs)
    assert not (ours.rootfs / "var/cache/ldconfig").exists()
    assert (theirs.rootfs / "var/cache/ldconfig/aux-cache").exists()


def test_an_image_with_hundreds_of_libraries_gets_ldconfig(make_container: MakeContainer) -> None:
    """Past ldwrite.MOST_LIBRARIES the sandboxed ldconfig is the quicker writer, and it writes the cache."""
    from gpuhook.apply.ldelf import sample_library
    from gpuhook.apply.ldwrite import MOST_LIBRARIES
    from gpuhook.ldcache import parse_ldcache

    def prepare(rootfs: Path) -> None:
        _with_var_cache(rootfs)
        lib = rootfs / "usr/lib/x86_64-linux-gnu"
        for n in range(MOST_LIBRARIES + 1):
            (lib / f"libmany{n}.so.1").write_bytes(sample_library(f"libmany{n}.so.1".encode()))

    container = make_container("dltest libcuda.so.1", TWO_GPUS, prepare=prepare)
    result = container.run()
    assert result.returncode == 0 and "dlopen libcuda.so.1: OK" in result.stdout, result.stderr
    assert (container.rootfs / "var/cache/ldconfig/aux-cache").exists()  # ldconfig ran
    cached = {e.key for e in parse_ldcache((container.rootfs / "etc/ld.so.cache").read_bytes())}
    assert {"libmany0.so.1", f"libmany{MOST_LIBRARIES}.so.1", "libcuda.so.1"} <= cached


def _with_var_cache(rootfs: Path) -> None:
    """/var/cache in the image: where ldconfig, and only ldconfig, leaves its auxiliary cache."""
    (rootfs / "var/cache").mkdir(parents=True, exist_ok=True)

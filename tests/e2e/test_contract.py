"""NVIDIA's env contract end to end under runc: requirements and the legacy-image rule."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from integration.engines import host_mounts, tree_snapshot
from integration.fakehost import FakeHost

from .conftest import MakeContainer, hook_entry

DEVICES = "ls /dev | grep -c '^nvidia[0-9]'; dltest libcuda.so.1 libnvidia-encode.so.1"


def test_cuda_requirement_refuses_with_host_versions(make_container: MakeContainer, host: FakeHost) -> None:
    """cuda>=99.0 is refused; the message holds the host's driver and CUDA versions and the fix."""
    container = make_container("echo started", {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_REQUIRE_CUDA": "cuda>=99.0"})
    owned = (container.bundle.parent, host.root)
    files, mounts = tree_snapshot(container.rootfs), host_mounts(*owned)
    result = container.run()
    assert result.returncode != 0 and "started" not in result.stdout
    assert f"driver {host.driver_version} supports CUDA {host.cuda_version}" in result.stderr
    assert "NVIDIA_REQUIRE_CUDA='cuda>=99.0'" in result.stderr and "NVIDIA_DISABLE_REQUIRE=true" in result.stderr
    assert tree_snapshot(container.rootfs) == files and host_mounts(*owned) == mounts


def test_disable_require_lets_it_start(make_container: MakeContainer) -> None:
    """NVIDIA_DISABLE_REQUIRE=true skips the check."""
    env = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_REQUIRE_CUDA": "cuda>=99.0", "NVIDIA_DISABLE_REQUIRE": "true"}
    result = make_container("devopen /dev/nvidia0", env).run()
    assert result.returncode == 0, result.stderr
    assert "/dev/nvidia0 ENXIO" in result.stdout


def test_brand_and_arch_terms_select_per_gpu(make_container: MakeContainer) -> None:
    """The usual nvidia/cuda image requirement passes on the simulated Tesla H100s."""
    env = {"NVIDIA_VISIBLE_DEVICES": "1", "NVIDIA_REQUIRE_CUDA": "cuda>=12.0 brand=tesla,driver>=470,driver<471",
           "NVIDIA_REQUIRE_ARCH": "arch>=8.0"}
    assert make_container("devopen /dev/nvidia1", env).run().returncode == 0
    refused = make_container("true", {"NVIDIA_VISIBLE_DEVICES": "1", "NVIDIA_REQUIRE_BRAND": "brand=geforce"}).run()
    assert refused.returncode != 0 and "which GPU 1 (NVIDIA H100 80GB HBM3, arch 9.0, brand Tesla)" in refused.stderr


def test_legacy_image_gets_all_gpus_and_capabilities(make_container: MakeContainer) -> None:
    """CUDA_VERSION=11.0 without NVIDIA_VISIBLE_DEVICES: every GPU and every capability (video libs too)."""
    result = make_container(DEVICES, {"CUDA_VERSION": "11.0"}).run()
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == "4"
    assert "dlopen libnvidia-encode.so.1: OK" in result.stdout


def _compat_libcuda(version: str) -> Callable[[Path], None]:
    """An image preparation step: a real libcuda.so.<version> (SONAME libcuda.so.1) in /usr/local/cuda/compat."""
    def prepare(rootfs: Path) -> None:
        compat = rootfs / "usr/local/cuda/compat"
        compat.mkdir(parents=True)
        source = compat / "stub.c"
        source.write_text("int cuda_compat_stub(void) { return 1; }\n")
        subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
                        str(compat / f"libcuda.so.{version}"), str(source)], check=True)
        source.unlink()
        (compat / "libcuda.so.1").symlink_to(f"libcuda.so.{version}")
    return prepare


@pytest.mark.parametrize(("version", "expected"), [
    pytest.param("560.28.03", "/usr/local/cuda/compat/libcuda.so.1", id="newer-compat-wins"),
    pytest.param("535.104.05", "/usr/lib/x86_64-linux-gnu/libcuda.so.1", id="older-compat-ignored"),
])
def test_cuda_forward_compatibility(make_container: MakeContainer, version: str, expected: str) -> None:
    """libcuda.so.1 resolves to the image's compat copy only when it is newer than the host's 550 driver."""
    container = make_container("dltest -p libcuda.so.1; cat /etc/ld.so.conf.d/00-gpuhook-cuda-compat.conf 2>&1; true",
                               {"NVIDIA_VISIBLE_DEVICES": "0"}, prepare=_compat_libcuda(version))
    result = container.run()
    assert result.returncode == 0, result.stderr
    assert f"dlopen libcuda.so.1: OK {expected}" in result.stdout
    assert ("/usr/local/cuda/compat" in result.stdout.splitlines()[-1]) is expected.startswith("/usr/local")


def test_all_capabilities_bring_every_file(make_container: MakeContainer) -> None:
    """capabilities=all: every capability's libraries, the Vulkan/EGL/OpenCL config files, modeset, GLX link."""
    script = ("dltest libcuda.so.1 libnvidia-encode.so.1 libGLX_nvidia.so.0 libEGL_nvidia.so.0 libnvidia-ngx.so.1 "
              "libnvidia-ml.so.1; cat /usr/share/vulkan/icd.d/nvidia_icd.json "
              "/usr/share/glvnd/egl_vendor.d/10_nvidia.json "
              "/etc/OpenCL/vendors/nvidia.icd; readlink /usr/lib/x86_64-linux-gnu/libGLX_indirect.so.0; "
              "devopen /dev/nvidia-modeset")
    result = make_container(script, {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "all"}).run()
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.count(": OK") == 6, out
    assert '"libGLX_nvidia.so.0"' in out and '"libEGL_nvidia.so.0"' in out  # the Vulkan ICD and EGL vendor files
    assert "libnvidia-opencl.so.1" in out and "libGLX_nvidia.so.550.54.15\n" in out
    assert "/dev/nvidia-modeset ENXIO" in out


def test_compute_only_gets_no_graphics_files(make_container: MakeContainer) -> None:
    """compute,utility: no Vulkan ICD, no graphics libraries, no modeset node."""
    script = "ls /usr/share/vulkan 2>&1; dltest libGLX_nvidia.so.0; ls /dev/nvidia-modeset 2>&1; true"
    result = make_container(script, {"NVIDIA_VISIBLE_DEVICES": "0"}).run()
    assert "No such file" in result.stdout and "dlopen libGLX_nvidia.so.0: FAIL" in result.stdout


def test_imex_channel_and_gated_devices(make_container: MakeContainer) -> None:
    """NVIDIA_IMEX_CHANNELS=2 and NVIDIA_GDS/NVIDIA_MOFED=enabled: exactly those nodes, allowed in the cgroup."""
    env = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "2", "NVIDIA_GDS": "enabled",
           "NVIDIA_MOFED": "enabled"}
    script = ("ls /dev/nvidia-caps-imex-channels; devopen /dev/nvidia-caps-imex-channels/channel2 /dev/nvidia-fs0 "
              "/dev/infiniband/uverbs0 /dev/gdrdrv")
    result = make_container(script, env).run()
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.splitlines()[0] == "channel2"
    assert "/dev/nvidia-caps-imex-channels/channel2 ENXIO" in out and "/dev/nvidia-fs0 ENXIO" in out
    assert "/dev/infiniband/uverbs0 ENXIO" in out and "/dev/gdrdrv ENOENT" in out
    refused = make_container("true", {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "9"}).run()
    assert refused.returncode != 0 and "channel 9" in refused.stderr


def test_compat32_mounts_the_i386_libraries(make_container: MakeContainer) -> None:
    """compat32: the driver's 32-bit libraries go to /usr/lib/i386-linux-gnu and into the container's ld.so.cache."""
    script = "ls /usr/lib/i386-linux-gnu | grep -c 'libcuda.so.550.54.15'; /sbin/ldconfig -p | grep 'libcuda.so.1 '"
    result = make_container(script, {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "compute,compat32"}
                            ).run()
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == "1"
    assert "libcuda.so.1 (libc6) => /usr/lib/i386-linux-gnu/libcuda.so.1" in result.stdout
    assert "libcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1" in result.stdout
    without = make_container("ls /usr/lib/i386-linux-gnu | grep -c libcuda; true", {"NVIDIA_VISIBLE_DEVICES": "0"}
                             ).run()
    assert without.stdout.splitlines()[0] == "0"


def test_compat_conf_is_taken_back_when_compat_no_longer_applies(make_container: MakeContainer, host: FakeHost,
                                                                  tmp_path: Path) -> None:
    """Issue 14 item 8: a restart of the same rootfs where compat no longer applies (after a host driver
    upgrade, or with ``cuda_compat: false``) removes the conf gpuhook wrote, and the cache no longer puts
    the image's older compat libcuda first."""
    conf = "etc/ld.so.conf.d/00-gpuhook-cuda-compat.conf"
    script = "dltest -p libcuda.so.1; ldconfig -p | grep -m1 'libcuda.so.1 '; true"
    container = make_container(script, {"NVIDIA_VISIBLE_DEVICES": "0"}, prepare=_compat_libcuda("560.28.03"))
    first = container.run()
    assert first.returncode == 0, first.stderr
    assert "dlopen libcuda.so.1: OK /usr/local/cuda/compat/libcuda.so.1" in first.stdout
    assert "/usr/local/cuda/compat/libcuda.so.1" in first.stdout.splitlines()[-1]  # first in ld.so.cache
    assert (container.rootfs / conf).read_text() == "/usr/local/cuda/compat\n"

    no_compat = tmp_path / "no-compat.yaml"
    no_compat.write_text(yaml.safe_dump({**yaml.safe_load(host.config_path.read_text()), "cuda_compat": False}))
    spec_path = container.bundle / "config.json"
    spec = json.loads(spec_path.read_text())
    spec["hooks"]["prestart"] = [hook_entry(no_compat, "prestart")]
    spec_path.write_text(json.dumps(spec))
    second = container.run()
    assert second.returncode == 0, second.stderr
    assert not (container.rootfs / conf).exists() and not (container.rootfs / conf).is_symlink()
    assert "dlopen libcuda.so.1: OK /usr/lib/x86_64-linux-gnu/libcuda.so.1" in second.stdout, second.stdout
    assert "/usr/lib/x86_64-linux-gnu/libcuda.so.1" in second.stdout.splitlines()[-1], second.stdout
    assert (container.rootfs / "usr/local/cuda/compat/libcuda.so.560.28.03").is_file()  # the image's own files stay

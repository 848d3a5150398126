"""nvidia-container-cli's argv (as ctr and NVIDIA's hook send it) becomes the hook's GpuRequest."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuhook.cli.nvcli import Configure, UsageError, main, parse_globals, translate_configure
from gpuhook.errors import RequestError
from gpuhook.oci.spec import BundleSpec
from gpuhook.request.model import (
    ALL_CAPABILITIES, Capability, GpuIndex, GpuRequest, GpuUuid, MigIndex, MigUuid, RequestSource,
)
from gpuhook.request.parse import parse_request
from integration.fakehost import FakeHost

ROOTFS = "/run/containerd/io.containerd.runtime.v2.task/default/ctr1/rootfs"
UUID0 = "GPU-ce61a72e-7167-8246-14f7-5885646b8f53"
MIG0 = "MIG-0b6e1b8c-0d4c-5c3b-9a4c-2f6a0a0f6b11"
#: Exactly what `ctr run --gpus 0 --gpus 1` makes containerd oci-hook exec (runtime-lab.md §5), argv[0] dropped.
CTR_ARGV = ["--load-kmods", "configure", "--device=0,1", "--compute", "--compat32", "--graphics", "--utility",
            "--video", "--display", "--pid=4242", ROOTFS]


def translate(argv: list[str]) -> Configure:
    """Global options, then the configure command, as main() splits them."""
    _options, rest = parse_globals(argv)
    assert rest[0] == "configure"
    return translate_configure(rest[1:])


def test_ctr_argv_is_the_hooks_request() -> None:
    """ctr's argv gives the GpuRequest the hook builds from the same NVIDIA_* values (bar its source)."""
    call = translate(CTR_ARGV)
    spec = BundleSpec(env={"NVIDIA_VISIBLE_DEVICES": "0,1",
                           "NVIDIA_DRIVER_CAPABILITIES": "compute,compat32,graphics,utility,video,display"},
                      rootfs=Path(ROOTFS), privileged=False)
    from_env = parse_request(spec, accept_envvar_when_unprivileged=True, accept_volume_mounts=False)
    assert from_env is not None
    assert call.request == dataclasses.replace(from_env, source=RequestSource.DEVICE_OPTION, raw="0,1")
    assert (call.pid, call.rootfs, call.no_cgroups, call.cuda_compat) == (4242, Path(ROOTFS), False, True)


@pytest.mark.parametrize(
    ("device", "all_devices", "devices"),
    [
        pytest.param("--device=0,1", False, (GpuIndex(0), GpuIndex(1)), id="indices"),
        pytest.param("--device=1", False, (GpuIndex(1),), id="one"),
        pytest.param("--device=all", True, (), id="all"),
        pytest.param("--device=none", False, (), id="none"),
        pytest.param(f"--device={UUID0}", False, (GpuUuid(UUID0),), id="uuid"),
        pytest.param(f"--device={UUID0},{MIG0},0:1", False, (GpuUuid(UUID0), MigUuid(MIG0), MigIndex(0, 1)),
                     id="mixed"),
        pytest.param("--device=1,1", False, (GpuIndex(1),), id="duplicate"),
        pytest.param(None, False, (), id="absent-means-driver-only"),
        pytest.param("--device=void", False, (), id="void-means-driver-only"),
    ],
)
def test_device_list(device: str | None, all_devices: bool, devices: tuple[object, ...]) -> None:
    """--device goes through the hook's NVIDIA_VISIBLE_DEVICES grammar."""
    argv = ["configure", *([device] if device else []), "--utility", "--pid=7", ROOTFS]
    request = translate(argv).request
    assert (request.all_devices, request.devices) == (all_devices, devices)


@pytest.mark.parametrize(
    ("flags", "capabilities"),
    [
        pytest.param([], frozenset(), id="none"),
        pytest.param(["--compute", "--utility"], frozenset({Capability.COMPUTE, Capability.UTILITY}), id="default"),
        pytest.param(["--graphics", "--display"], frozenset({Capability.GRAPHICS, Capability.DISPLAY}), id="gfx"),
        pytest.param([f"--{c.value}" for c in Capability], ALL_CAPABILITIES, id="all"),
        pytest.param(["--video", "--video"], frozenset({Capability.VIDEO}), id="repeated"),
    ],
)
def test_capability_flags(flags: list[str], capabilities: frozenset[Capability]) -> None:
    """One flag per capability; no flag means none (NVIDIA's CLI injects no capability's files then)."""
    assert translate(["configure", "--device=0", *flags, "--pid=7", ROOTFS]).request.capabilities == capabilities


def test_nvidia_hook_argv() -> None:
    """The full argv NVIDIA's runtime hook builds (nvidia-toolkit.md §4.2) is accepted and translated."""
    call = translate([
        "--root=/run/nvidia/driver", "--load-kmods", "--no-create-imex-channels", "--no-pivot",
        "--debug=/dev/stderr", "--ldcache=/etc/ld.so.cache", "--user", "configure",
        "--cuda-compat-mode=disabled", "--ldconfig=@/sbin/ldconfig.real", "--no-cgroups", "--device=all",
        "--mig-config=all", "--mig-monitor=all", "--imex-channel=3", "--imex-channel=1,3", "--compute",
        "--utility", "--require=cuda>=12.0 brand=tesla", "--require=cuda>=11.8", "--pid=99", ROOTFS,
    ])
    request = call.request
    assert request.all_devices and request.mig_config and request.mig_monitor
    assert request.imex_channels == (3, 1)
    assert [str(r) for r in request.requirements] == ["cuda>=12.0 brand=tesla", "cuda>=11.8"]
    assert (call.no_cgroups, call.cuda_compat, call.pid) == (True, False, 99)


def outcome(decode: Callable[[], object], name: str, value: str) -> object:
    """What *decode* returns, or its refusal's text after the ``NAME='value'`` that each front-end puts first."""
    try:
        return decode()
    except (RequestError, UsageError) as err:
        prefix = f"{name}={value!r}"
        assert str(err).startswith(prefix)
        return str(err).removeprefix(prefix)


def env_request(env: dict[str, str]) -> GpuRequest:
    """The hook's request from NVIDIA_* variables, in a privileged container (so MIG control may be asked)."""
    request = parse_request(BundleSpec(env={"NVIDIA_VISIBLE_DEVICES": "0"} | env, rootfs=Path(ROOTFS),
                                       privileged=True),
                            accept_envvar_when_unprivileged=True, accept_volume_mounts=False)
    assert request is not None
    return request


def cli_request(*options: str) -> GpuRequest:
    """The request of a configure argv with *options* (and --device=0 unless they name devices)."""
    devices = [] if any(o.startswith("--device=") for o in options) else ["--device=0"]
    return translate(["configure", *devices, *options, "--pid=7", ROOTFS]).request


@pytest.mark.parametrize("devices", ["0,1", "all", "none", "0,all", f"{UUID0},{MIG0},0:1", "1,1", " 2 ,, 0:1 ",
                                     "x", "0,nvidia.com/gpu=1", "0,٣", "00000"])
def test_device_lists_decode_alike(devices: str) -> None:
    """--device and NVIDIA_VISIBLE_DEVICES share one grammar: the same ids, or the same refusal under each name."""
    def chosen(request: GpuRequest) -> tuple[bool, tuple[object, ...]]:
        return request.all_devices, request.devices

    from_env = outcome(lambda: chosen(env_request({"NVIDIA_VISIBLE_DEVICES": devices})), "NVIDIA_VISIBLE_DEVICES",
                       devices)
    from_cli = outcome(lambda: chosen(cli_request(f"--device={devices}")), "--device", devices)
    assert from_env == from_cli


@pytest.mark.parametrize("channels", ["3", "3, 0,3", "1,,2", "", "-1", "0,1048576", "a", "2,none"])
def test_imex_channel_lists_decode_alike(channels: str) -> None:
    """--imex-channel and NVIDIA_IMEX_CHANNELS share one decoder: the same ids, or the same refusal."""
    from_env = outcome(lambda: env_request({"NVIDIA_IMEX_CHANNELS": channels}).imex_channels,
                       "NVIDIA_IMEX_CHANNELS", channels)
    from_cli = outcome(lambda: cli_request(f"--imex-channel={channels}").imex_channels, "--imex-channel", channels)
    assert from_env == from_cli


def test_imex_all_is_ignored_by_the_hook_and_refused_by_the_cli() -> None:
    """The one difference: NVIDIA_IMEX_CHANNELS=all is ignored (as NVIDIA does); argv must name channel ids."""
    assert env_request({"NVIDIA_IMEX_CHANNELS": "all"}).imex_channels == ()
    with pytest.raises(UsageError, match=r"--imex-channel='all': 'all' is not a channel id"):
        cli_request("--imex-channel=all")


@pytest.mark.parametrize("value", ["all", " all", "0", "all,all", "ALL"])
def test_mig_control_decodes_alike(value: str) -> None:
    """--mig-config and NVIDIA_MIG_CONFIG_DEVICES (privileged): 'all' or the same refusal."""
    from_env = outcome(lambda: env_request({"NVIDIA_MIG_CONFIG_DEVICES": value}).mig_config,
                       "NVIDIA_MIG_CONFIG_DEVICES", value.strip())
    from_cli = outcome(lambda: cli_request(f"--mig-config={value}").mig_config, "--mig-config", value.strip())
    assert from_env == from_cli


def test_global_options() -> None:
    """--debug (any form) raises the log level; the rest are accepted and change nothing."""
    assert parse_globals(["--debug=/tmp/log", "info"])[0].debug
    assert parse_globals(["-d", "/tmp/log", "info"])[0].debug
    options, rest = parse_globals(["-k", "-r", "/", "--user=1000:1000", "list", "--libraries"])
    assert not options.debug and rest == ["list", "--libraries"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param([], "missing command", id="empty"),
        pytest.param(["--load-kmods"], "missing command", id="only-globals"),
        pytest.param(["start"], "unknown command 'start'", id="unknown-command"),
        pytest.param(["--bogus", "info"], "unrecognized option '--bogus'", id="unknown-global"),
        pytest.param(["--root"], "requires an argument", id="dangling-root"),
        pytest.param(["configure", "--device=0", ROOTFS], "--pid=PID is required", id="no-pid"),
        pytest.param(["configure", "--pid=1", ROOTFS], "--pid='1'", id="pid-1"),
        pytest.param(["configure", "--pid=٣٣", ROOTFS], "--pid='٣٣'", id="pid-unicode-digits"),
        pytest.param(["configure", "--pid=-5", ROOTFS], "--pid='-5'", id="pid-negative"),
        pytest.param(["configure", "--pid=7"], "rootfs", id="no-rootfs"),
        pytest.param(["configure", "--pid=7", "rootfs"], "ROOTFS 'rootfs'", id="relative-rootfs"),
        pytest.param(["configure", "--pid=7", "/"], "ROOTFS '/'", id="host-root"),
        pytest.param(["configure", "--pid=7", "//."], "ROOTFS '//.'", id="host-root-spelled"),
        pytest.param(["configure", "--pid=7", "/x/../.."], "ROOTFS '/x/../..'", id="host-root-dotdot"),
        pytest.param(["configure", "--device=x", "--pid=7", ROOTFS], "--device='x': 'x' is not a device",
                     id="bad-device"),
        pytest.param(["configure", "--device=nvidia.com/gpu=0", "--pid=7", ROOTFS], "is a CDI device name",
                     id="cdi-device"),
        pytest.param(["configure", "--require=cuda>>12", "--pid=7", ROOTFS], "--require", id="bad-require"),
        pytest.param(["configure", "--mig-config=0", "--pid=7", ROOTFS], "only 'all'", id="mig-list"),
        pytest.param(["configure", "--imex-channel=a", "--pid=7", ROOTFS], "--imex-channel='a'", id="imex"),
        pytest.param(["configure", "--cuda-compat-mode=x", "--pid=7", ROOTFS], "--cuda-compat-mode", id="compat"),
        pytest.param(["configure", "--no-devbind", "--pid=7", ROOTFS], "--no-devbind", id="unsupported-option"),
        pytest.param(["configure", "--dev=0", "--pid=7", ROOTFS], "--dev=0", id="no-abbreviations"),
        pytest.param(["info", "--json"], "--json", id="info-option"),
    ],
)
def test_bad_argv_is_a_usage_error(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2, the problem on stderr with the usage line; nothing is read or changed."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("nvidia-container-cli: ") and message in err and "usage: nvidia-container-cli" in err


def test_usage_error_type() -> None:
    """translate_configure raises UsageError (main maps it to 2), never a GpuHookError."""
    with pytest.raises(UsageError):
        translate_configure(["--device=9x", "--pid=7", ROOTFS])


def test_loader_variables_refuse_with_the_ctr_fix(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """ctr hands the hook the user's shell env: LD_*/PYTHON* there refuse the container (exit 1), saying why."""
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/lib")
    assert main(CTR_ARGV) == 1
    err = capsys.readouterr().err
    assert err.startswith("gpuhook: the hook's environment sets LD_LIBRARY_PATH") and "env -i" in err


def test_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    """--version and --help print to stdout and exit 0."""
    assert main(["--version"]) == 0 and "nvidia-container-cli compatible" in capsys.readouterr().out
    assert main(["--help"]) == 0 and "usage: nvidia-container-cli" in capsys.readouterr().out
    assert main(["configure", "--help"]) == 0 and "usage: nvidia-container-cli configure" in capsys.readouterr().out


def test_info(host: FakeHost, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """info: the driver, then a block per GPU, in NVIDIA's layout; --csv in its CSV layout."""
    monkeypatch.setenv("GPUHOOK_CONFIG", str(host.config_path))
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"NVRM version:   {host.driver_version}\nCUDA version:   {host.cuda_version}\n\n")
    for gpu in host.gpus:
        assert f"GPU UUID:       {gpu.uuid}\n" in out
    assert out.count("Device Index:   ") == len(host.gpus)
    assert main(["info", "--csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == ["NVRM version,CUDA version", f"{host.driver_version},{host.cuda_version}", ""]
    assert lines[3] == "Device Index,Device Minor,Model,Brand,GPU UUID,Bus Location,Architecture"
    assert [line.split(",")[4] for line in lines[4:]] == [gpu.uuid for gpu in host.gpus]


def test_list(host: FakeHost, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """list: host paths one a line; everything by default, one category with its flag."""
    monkeypatch.setenv("GPUHOOK_CONFIG", str(host.config_path))
    assert main(["list"]) == 0
    everything = capsys.readouterr().out.splitlines()
    assert everything[0] == str(host.root / "dev" / "nvidiactl")
    assert str(host.root / "dev" / "nvidia3") in everything
    assert any(line.endswith(f"/libcuda.so.{host.driver_version}") for line in everything)
    assert any(line.endswith("/nvidia-smi") for line in everything)
    assert main(["list", "--binaries"]) == 0
    binaries = capsys.readouterr().out.splitlines()
    assert binaries and all("/bin/" in line for line in binaries)
    assert main(["list", "--libraries"]) == 0
    libraries = capsys.readouterr().out.splitlines()
    assert libraries and all(".so" in line for line in libraries) and set(libraries) < set(everything)
    assert main(["list", "--libraries", "--compat32"]) == 0
    assert len(capsys.readouterr().out.splitlines()) > len(libraries)


def test_request_fields_match_model() -> None:
    """Guard: if GpuRequest grows a field, this front-end must decide how argv sets it."""
    assert {f.name for f in dataclasses.fields(GpuRequest)} == {
        "all_devices", "devices", "count", "mig_asks", "capabilities", "requirements", "imex_channels", "gated",
        "mig_config", "mig_monitor", "source", "raw",
    }

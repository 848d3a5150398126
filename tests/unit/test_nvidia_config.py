"""NVIDIA's config.toml read as gpuhook's configuration, the two keys it brings, and `gpuhook config`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from gpuhook.cli import main
from gpuhook.cli.configcmd import render_show
from gpuhook.config import (
    DEFAULT_PATH,
    NVIDIA_PATH,
    Config,
    LogLevel,
    Origin,
    load_config,
    parse_config,
    read_config,
    resolve_config_path,
)
from gpuhook.errors import ConfigError
from gpuhook.nvidia_config import translate_toml
from gpuhook.oci.spec import BundleSpec, spec_from_object
from gpuhook.request.model import ALL_CAPABILITIES, Capability
from gpuhook.request.parse import parse_capabilities, parse_request

C = Capability

#: NVIDIA's own rendering of its defaults (`nvidia-ctk config default`, commented lines included).
STOCK = """\
#accept-nvidia-visible-devices-as-volume-mounts = false
#accept-nvidia-visible-devices-envvar-when-unprivileged = true
disable-require = false
supported-driver-capabilities = "compat32,compute,display,graphics,ngx,utility,video"
#swarm-resource = "DOCKER_RESOURCE_GPU"

[nvidia-container-cli]
#debug = "/var/log/nvidia-container-toolkit.log"
environment = []
#ldcache = "/etc/ld.so.cache"
ldconfig = "@/sbin/ldconfig"
load-kmods = true
#no-cgroups = false
#path = "/usr/bin/nvidia-container-cli"
#root = "/run/nvidia/driver"
#user = "root:video"

[nvidia-container-runtime]
#debug = "/var/log/nvidia-container-runtime.log"
log-level = "info"
mode = "auto"
runtimes = ["docker-runc", "runc", "crun"]

[nvidia-container-runtime.modes]

[nvidia-container-runtime.modes.cdi]
annotation-prefixes = ["cdi.k8s.io/"]
default-kind = "nvidia.com/gpu"
spec-dirs = ["/etc/cdi", "/var/run/cdi"]

[nvidia-container-runtime.modes.csv]
mount-spec-path = "/etc/nvidia-container-runtime/host-files-for-container.d"

[nvidia-container-runtime.modes.legacy]
cuda-compat-mode = "ldconfig"

[nvidia-container-runtime-hook]
path = "nvidia-container-runtime-hook"
skip-mode-detection = false

[nvidia-ctk]
path = "nvidia-ctk"
"""


def _load(text: str, tmp_path: Path, name: str = "config.toml") -> Config:
    path = tmp_path / name
    path.write_text(text)
    return load_config(path, required=True)


def test_stock_file_is_the_defaults(tmp_path: Path) -> None:
    """NVIDIA's shipped defaults equal gpuhook's, and lose nothing: notes only, no warning."""
    assert _load(STOCK, tmp_path) == Config()
    found = translate_toml(STOCK, source="stock")
    assert found.notices and not found.warnings
    assert "swarm-resource" not in {n.key for n in found.notices}  # commented out: absent


def test_empty_file_is_the_defaults(tmp_path: Path) -> None:
    """Every key absent: NVIDIA's defaults, which are gpuhook's."""
    assert _load("", tmp_path) == Config()


@pytest.mark.parametrize(("toml", "expected"), [
    ("accept-nvidia-visible-devices-envvar-when-unprivileged = false", {"accept_envvar_when_unprivileged": False}),
    ("accept-nvidia-visible-devices-as-volume-mounts = true", {"accept_volume_mounts": True}),
    ("disable-require = true", {"disable_require": True}),
    ('supported-driver-capabilities = "compute,utility"',
     {"supported_driver_capabilities": frozenset({C.COMPUTE, C.UTILITY})}),
    ('supported-driver-capabilities = "all"', {"supported_driver_capabilities": ALL_CAPABILITIES}),
    ('[nvidia-container-cli]\nroot = "/run/nvidia/driver"', {"driver_root": Path("/run/nvidia/driver")}),
    ('[nvidia-container-cli]\nroot = ""', {}),
    ('[nvidia-container-cli]\nldconfig = "@/usr/sbin/ldconfig"', {"ldconfig": Path("/usr/sbin/ldconfig")}),
    ("[nvidia-container-cli]\nload-kmods = false", {"load_kmods": False}),
    ("[nvidia-container-cli]\nno-cgroups = true", {"no_cgroups": True}),
    ('[nvidia-container-cli]\ndebug = "/var/log/nvidia-container-toolkit.log"',
     {"log_file": Path("/var/log/nvidia-container-toolkit.log")}),
    ('[nvidia-container-runtime]\nlog-level = "warn"', {"log_level": LogLevel.WARNING}),
    ('[nvidia-container-runtime]\nlog-level = "trace"', {"log_level": LogLevel.DEBUG}),
    ('[nvidia-container-runtime.modes.legacy]\ncuda-compat-mode = "disabled"', {"cuda_compat": False}),
    ('[nvidia-container-runtime.modes.legacy]\ncuda-compat-mode = "mount"', {}),
    ('[gpuhook]\ndev_root = "/host"\nproc_root = "/host"', {"dev_root": Path("/host"), "proc_root": Path("/host")}),
])
def test_mapped_keys(tmp_path: Path, toml: str, expected: dict[str, object]) -> None:
    """Each key with a gpuhook meaning sets that setting, and nothing else."""
    config = _load(toml + "\n", tmp_path)
    assert {name: getattr(config, name) for name in expected} == expected
    assert config == Config(**expected)


def test_ldconfig_in_the_container_is_refused(tmp_path: Path) -> None:
    """An ldconfig without '@' is the container's: gpuhook never runs it, and says how to name the host's."""
    with pytest.raises(ConfigError, match=r"nvidia-container-cli.ldconfig = '/sbin/ldconfig' names an ldconfig "
                                          r"inside the container.*write '@/sbin/ldconfig'"):
        _load('[nvidia-container-cli]\nldconfig = "/sbin/ldconfig"\n', tmp_path)


def test_ignored_imex_requests_are_refused(tmp_path: Path) -> None:
    """ignore-imex-channel-requests = true would grant more under gpuhook than NVIDIA did: an error."""
    with pytest.raises(ConfigError, match="ignore-imex-channel-requests = true"):
        _load("[features]\nignore-imex-channel-requests = true\n", tmp_path)
    assert _load("[features]\nignore-imex-channel-requests = false\n", tmp_path) == Config()


@pytest.mark.parametrize(("toml", "match"), [
    ('accept-nvidia-visible-devices-envvar-when-unprivileged = "no"', "must be true or false"),
    ('supported-driver-capabilities = "compute,gpu"', "unknown capability 'gpu'"),
    ("supported-driver-capabilities = 3", "must be a string"),
    ('[nvidia-container-runtime]\nlog-level = "loud"', "log-level must be one of"),
    ('[nvidia-container-cli]\nroot = "run/nvidia"', "driver_root must be an absolute path"),
    ("[gpuhook]\ndev_rot = '/host'", r"unknown setting\(s\) dev_rot"),
    ("no-cgroups = true\n[gpuhook]\nno_cgroups = false\n[nvidia-container-cli]\nno-cgroups = true",
     "contradicts nvidia-container-cli.no-cgroups"),
    ("disable-require = [", "not valid TOML"),
])
def test_bad_values_are_errors(tmp_path: Path, toml: str, match: str) -> None:
    """A wrong type, an unknown capability, a bad [gpuhook] key or a contradiction: an error naming it."""
    with pytest.raises(ConfigError, match=match):
        _load(toml + "\n", tmp_path)


def test_unmapped_and_unknown_keys_warn(tmp_path: Path) -> None:
    """One notice per key: unmapped ones say why they have no effect; unknown ones (typos) are kept as warnings."""
    found = translate_toml('swarm-resource = "DOCKER_RESOURCE_GPU"\naccept-nvidia-visible-devices-envvar-when-'
                           'unpriviliged = false\n[nvidia-container-cli]\nuser = "nobody"\nenvironment = []\n',
                           source="t")
    by_key = {n.key: n for n in found.notices}
    assert set(by_key) == {"swarm-resource", "accept-nvidia-visible-devices-envvar-when-unpriviliged",
                           "nvidia-container-cli.user", "nvidia-container-cli.environment"}
    assert by_key["swarm-resource"].lost and "NVIDIA_VISIBLE_DEVICES" in by_key["swarm-resource"].reason
    assert "unknown key" in by_key["accept-nvidia-visible-devices-envvar-when-unpriviliged"].render()
    assert by_key["nvidia-container-cli.user"].lost
    assert not by_key["nvidia-container-cli.environment"].lost  # NVIDIA's default: nothing is lost
    assert _load('swarm-resource = "X"\n', tmp_path) == Config()  # warned, never an error


def test_explicit_toml_is_nvidia_format(tmp_path: Path) -> None:
    """A file named explicitly is read as NVIDIA's when it ends in .toml, as gpuhook.yaml otherwise."""
    toml = tmp_path / "nvidia.toml"
    toml.write_text("disable-require = true\n")
    path, required = resolve_config_path(str(toml), {})
    assert read_config(path, required=required).config.disable_require
    via_env = resolve_config_path(None, {"GPUHOOK_CONFIG": str(toml)})
    assert load_config(*via_env[:1], required=via_env[1]).disable_require
    yaml_file = tmp_path / "x.yaml"
    yaml_file.write_text("disable_require: true\n")
    assert load_config(yaml_file, required=True).disable_require


def test_fallback_order(tmp_path: Path) -> None:
    """--config, $GPUHOOK_CONFIG, gpuhook's default file, then NVIDIA's config.toml, then neither (optional)."""
    default, nvidia = tmp_path / "gpuhook.yaml", tmp_path / "config.toml"
    env = {"GPUHOOK_CONFIG": "/b.yaml"}
    assert resolve_config_path("/a.toml", env, default=default, nvidia=nvidia) == (Path("/a.toml"), True)
    assert resolve_config_path(None, env, default=default, nvidia=nvidia) == (Path("/b.yaml"), True)
    assert resolve_config_path(None, {}, default=default, nvidia=nvidia) == (default, False)
    nvidia.write_text("accept-nvidia-visible-devices-envvar-when-unprivileged = false\n")
    assert resolve_config_path(None, {}, default=default, nvidia=nvidia) == (nvidia, False)
    assert not load_config(nvidia, required=False).accept_envvar_when_unprivileged
    default.write_text("")
    assert resolve_config_path(None, {}, default=default, nvidia=nvidia) == (default, False)  # gpuhook's own wins
    assert str(DEFAULT_PATH) == "/etc/gpuhook/config.yaml"
    assert str(NVIDIA_PATH) == "/etc/nvidia-container-runtime/config.toml"


def test_supported_capabilities_in_gpuhook_yaml() -> None:
    """gpuhook.yaml takes a list or NVIDIA's comma-separated string; all is every capability."""
    assert parse_config("supported_driver_capabilities: [compute, utility]\n").supported_driver_capabilities == \
        frozenset({C.COMPUTE, C.UTILITY})
    assert parse_config('supported_driver_capabilities: "video,compute"\n').supported_driver_capabilities == \
        frozenset({C.VIDEO, C.COMPUTE})
    assert parse_config("supported_driver_capabilities: all\n").supported_driver_capabilities == ALL_CAPABILITIES
    assert parse_config("supported_driver_capabilities: []\n").supported_driver_capabilities == frozenset()
    with pytest.raises(ConfigError, match="must be a list of capability names"):
        parse_config("supported_driver_capabilities: 7\n")


@pytest.mark.parametrize(("raw", "legacy", "supported", "expected"), [
    ("all", False, {C.COMPUTE, C.UTILITY, C.VIDEO}, {C.COMPUTE, C.UTILITY, C.VIDEO}),  # all = exactly the set
    ("compute,graphics", False, {C.COMPUTE, C.UTILITY}, {C.COMPUTE}),
    (None, False, {C.UTILITY}, {C.UTILITY}),  # the default utility,compute, narrowed
    (None, True, {C.GRAPHICS, C.COMPUTE}, {C.GRAPHICS, C.COMPUTE}),  # legacy image: all, narrowed
    ("", False, set(ALL_CAPABILITIES), {C.COMPUTE, C.UTILITY}),
])
def test_capabilities_are_narrowed_to_the_supported_set(raw: str | None, legacy: bool, supported: set[Capability],
                                                        expected: set[Capability]) -> None:
    """NVIDIA_DRIVER_CAPABILITIES ∩ supported-driver-capabilities, as NVIDIA's hook computes it."""
    assert parse_capabilities(raw, legacy=legacy, supported=frozenset(supported)) == expected


def _spec(env: dict[str, str]) -> BundleSpec:
    return spec_from_object({
        "ociVersion": "1.0.2", "root": {"path": "rootfs"},
        "process": {"args": ["sh"], "cwd": "/", "env": [f"{k}={v}" for k, v in env.items()],
                    "capabilities": {"bounding": ["CAP_SYS_ADMIN"]}},
    }, Path("/bundle"))


def test_disable_require_and_supported_set_reach_the_request() -> None:
    """disable_require drops NVIDIA_REQUIRE_* and the legacy CUDA_VERSION rule; the request's capabilities narrow."""
    env = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_REQUIRE_CUDA": "cuda>=99.0", "NVIDIA_DRIVER_CAPABILITIES": "all"}
    flags = {"accept_envvar_when_unprivileged": True, "accept_volume_mounts": False}
    plain = parse_request(_spec(env), **flags)
    assert plain is not None and plain.requirements and plain.capabilities == ALL_CAPABILITIES
    narrowed = parse_request(_spec(env), **flags, disable_require=True,
                             supported_capabilities=frozenset({C.UTILITY}))
    assert narrowed is not None and narrowed.requirements == () and narrowed.capabilities == {C.UTILITY}
    legacy = parse_request(_spec({"CUDA_VERSION": "99.1"}), **flags, disable_require=True)
    assert legacy is not None and legacy.all_devices and legacy.requirements == ()


def test_show_lists_every_key_with_its_origin(tmp_path: Path) -> None:
    """`config show` prints every setting once, as YAML that loads back to the same Config, with its origin."""
    path = tmp_path / "config.toml"
    path.write_text('disable-require = true\nswarm-resource = "X"\n[nvidia-container-cli]\nroot = "/drv"\n'
                    '[gpuhook]\nproc_root = "/p"\n')
    loaded = read_config(path, required=True)
    text = render_show(loaded)
    shown = parse_config(text)  # the default policy reads back as `gpus: []` (its source named differently)
    assert shown.gpus.is_unlimited and dataclasses.replace(shown, gpus=loaded.config.gpus) == loaded.config
    assert set(yaml.safe_load(text)) == {f for f in Config.__dataclass_fields__}
    assert "driver_root: /drv  # NVIDIA's config.toml: nvidia-container-cli.root" in text
    assert "proc_root: /p  # gpuhook.yaml: [gpuhook] proc_root" in text
    assert "dev_root: /  # default" in text
    assert "# ignored: swarm-resource" in text
    assert loaded.origins["disable_require"] == (Origin.NVIDIA, "disable-require")


def test_config_import(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """import writes the equivalent gpuhook.yaml (0644), warns about unmapped keys, and refuses to overwrite."""
    source, output = tmp_path / "config.toml", tmp_path / "etc" / "gpuhook" / "config.yaml"
    source.write_text('accept-nvidia-visible-devices-envvar-when-unprivileged = false\nswarm-resource = "X"\n'
                      "[nvidia-container-cli]\nno-cgroups = true\n")
    assert main(["config", "import", "--from", str(source), "--output", str(output), "--dry-run"]) == 0
    dry = capsys.readouterr()
    assert not output.exists() and "warning" in dry.err and "swarm-resource" in dry.err
    assert main(["config", "import", "--from", str(source), "--output", str(output)]) == 0
    assert output.read_text() == dry.out and output.stat().st_mode & 0o777 == 0o644
    assert load_config(output, required=True) == load_config(source, required=True) == \
        Config(accept_envvar_when_unprivileged=False, no_cgroups=True)
    capsys.readouterr()
    assert main(["config", "import", "--from", str(source), "--output", str(output)]) == 0  # the same: no change
    output.write_text("no_cgroups: false\n")
    assert main(["config", "import", "--from", str(source), "--output", str(output)]) == 1
    assert "add --force" in capsys.readouterr().err and output.read_text() == "no_cgroups: false\n"
    assert main(["config", "import", "--from", str(source), "--output", str(output), "--force"]) == 0
    assert output.read_text() == dry.out
    assert main(["config", "import", "--from", str(tmp_path / "absent.toml"), "--output", str(output)]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_config_show_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`gpuhook --config FILE config show` exits 0 and prints the file's values."""
    source = tmp_path / "config.toml"
    source.write_text("[nvidia-container-cli]\nload-kmods = false\n")
    assert main(["--config", str(source), "config", "show"]) == 0
    assert "load_kmods: false  # NVIDIA's config.toml: nvidia-container-cli.load-kmods" in capsys.readouterr().out


def test_doctor_check() -> None:
    """doctor warns with one line per lost key, is ok when only defaults are ignored, notes an unread file."""
    from gpuhook.doctor import Verdict, nvidia_config_check

    found = translate_toml('swarm-resource = "X"\n[nvidia-container-cli]\nenvironment = []\n', source="f")
    check = nvidia_config_check("f", read=True, warnings=[n.render() for n in found.warnings],
                                notes=len(found.notices) - len(found.warnings))
    assert check.verdict is Verdict.WARN and "1 key(s)" in check.message
    assert "1 more at NVIDIA's default" in check.message
    assert 'swarm-resource = "X": no effect' in check.render()
    assert nvidia_config_check("f", read=True, warnings=[], notes=3).verdict is Verdict.OK
    unread = nvidia_config_check("/etc/nvidia-container-runtime/config.toml", read=False, warnings=[], notes=0)
    assert unread.verdict is Verdict.NOTE and "config import" in unread.fix


def test_poststop_shortcut_reads_nvidia_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without gpuhook's own file the poststop shortcut looks at NVIDIA's: a [gpuhook] table may move state_dir."""
    from gpuhook import hookcall

    nvidia = tmp_path / "config.toml"
    monkeypatch.setattr(hookcall, "_DEFAULT_CONFIG", str(tmp_path / "absent.yaml"))
    monkeypatch.setattr(hookcall, "_NVIDIA_CONFIG", str(nvidia))
    state = tmp_path / "state"
    state.mkdir()
    container = "h4-nvidia-config-poststop"
    assert hookcall.lease_may_exist(None, {}, container) is False  # no file anywhere: the default ledger, absent
    nvidia.write_text(f'[gpuhook]\nstate_dir = "{state}"\n')
    assert hookcall.lease_may_exist(None, {}, container) is True  # its shape leaves doubt: the full load decides

"""gpuhook install: the exact change per engine, idempotent, with backups; the shipped k8s files parse;
gpuhook-runtime's hooks."""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from gpuhook.cli import runtime
from gpuhook.request import runtimecall
from gpuhook.cli.install import run_install
from gpuhook.errors import ConfigError
from gpuhook.install import HOOKS_D_FILES, changes, containerd_config, docker_daemon_json, registration
from integration.containerd import DEBIAN_CONFIG
from integration.fakehost import FakeHost

BIN = "/usr/lib/gpuhook/bin"
PACKAGING = Path(__file__).parents[2] / "packaging"
HOOKS_D = {"podman": "/usr/share/containers/oci/hooks.d", "crio": "/etc/containers/oci/hooks.d"}


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
    """An absolute path and a non-empty env (NVIDIAScape); the shipped packaging files (the package has
    gpuhook-relay) say the same, one per stage."""
    wanted = changes("podman", bin_dir=BIN, current={}, relay=True)
    assert [c.path.rsplit("/", 1)[-1] for c in wanted] == ["gpuhook.json", "gpuhook-poststop.json"]
    for change in wanted:
        hook = json.loads(change.content or "")
        assert hook["hook"]["path"].startswith("/") and hook["hook"]["env"]
        assert hook == json.loads((PACKAGING / "oci-hooks.d" / change.path.rsplit("/", 1)[-1]).read_text())
    assert sorted(p.name for p in (PACKAGING / "oci-hooks.d").iterdir()) == sorted(HOOKS_D_FILES.values())


@pytest.mark.parametrize("engine", ["podman", "crio"])
@pytest.mark.parametrize("relay", [False, True])
def test_hooks_d_registers_prestart_and_poststop(engine: str, relay: bool) -> None:
    """gpuhook.json runs the hook for prestart, gpuhook-poststop.json the same hook for poststop: one
    stage per file (schema 1.0.0 gives an entry's stages one argv), every container."""
    entries = {c.path: json.loads(c.content or "") for c in changes(engine, bin_dir=BIN, current={}, relay=relay)}
    prestart = entries.pop(f"{HOOKS_D[engine]}/gpuhook.json")
    poststop = entries.pop(f"{HOOKS_D[engine]}/gpuhook-poststop.json")
    assert not entries
    assert (prestart["stages"], prestart["hook"]["args"][-1]) == (["prestart"], "prestart")
    assert (poststop["stages"], poststop["hook"]["args"][-1]) == (["poststop"], "poststop")
    assert poststop["when"] == prestart["when"] == {"always": True}
    assert poststop["hook"]["path"] == prestart["hook"]["path"]
    assert poststop["hook"]["args"][:-1] == prestart["hook"]["args"][:-1]
    assert poststop["hook"]["env"] == prestart["hook"]["env"]


@pytest.mark.parametrize("engine", ["podman", "crio"])
def test_an_older_install_gets_only_the_poststop_file(engine: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A host registered before poststop was: installing again adds gpuhook-poststop.json and leaves
    gpuhook.json as it is (no backup of an unchanged file); a third run changes nothing."""
    prestart = next(c for c in changes(engine, bin_dir=BIN, current={}) if c.path.endswith("/gpuhook.json"))
    old = tmp_path / prestart.path.lstrip("/")
    old.parent.mkdir(parents=True)
    old.write_text(prestart.content or "")
    run_install(engine, dry_run=False, root=tmp_path, bin_dir=Path(BIN))
    out = capsys.readouterr().out
    assert "changed 1 file(s)" in out and "gpuhook-poststop.json" in out
    assert sorted(p.name for p in old.parent.iterdir()) == ["gpuhook-poststop.json", "gpuhook.json"]
    poststop = json.loads((old.parent / "gpuhook-poststop.json").read_text())
    assert poststop["stages"] == ["poststop"] and poststop["hook"]["args"][-1] == "poststop"
    run_install(engine, dry_run=False, root=tmp_path, bin_dir=Path(BIN))
    assert "nothing to change" in capsys.readouterr().out


def test_with_the_relays_installed_engines_run_them() -> None:
    """The packages' layout: hooks.d runs bin/gpuhook-relay, docker --gpus libexec's relay under NVIDIA's name."""
    for hooks_d in changes("podman", bin_dir=BIN, current={}, relay=True):
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
    front_end = "/usr/lib/gpuhook/libexec/gpuhook-runtime"  # what `gpuhook install` registers in the packages' layout
    (change, _, _) = changes("containerd", bin_dir=BIN, current={}, runtime=front_end)
    binary = f'BinaryName = "{front_end}"'
    assert change.content and binary in dropin and binary in change.content
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


def test_runtime_wrapper_adds_prestart_and_poststop_once() -> None:
    """gpuhook-runtime's hooks: first among prestart and among poststop, the same argv but the stage;
    the spec's own hooks kept behind them; a second pass adds nothing."""
    other = {"path": "/usr/bin/true", "args": ["true"]}
    spec: dict[str, object] = {"hooks": {"poststop": [other], "poststart": [other]}}
    runtimecall.add_hooks(spec, "/etc/gpuhook/other.yaml")
    once = json.loads(json.dumps(spec))
    runtimecall.add_hooks(spec, "/etc/gpuhook/other.yaml")
    assert spec == once
    hooks = once["hooks"]
    assert hooks["poststart"] == [other]
    assert hooks["poststop"][1:] == [other] and len(hooks["prestart"]) == 1
    (prestart, poststop) = hooks["prestart"][0], hooks["poststop"][0]
    assert prestart["args"] == [sys.executable, "-I", "-m", "gpuhook", "--config", "/etc/gpuhook/other.yaml",
                                "prestart"]
    assert poststop == {**prestart, "args": [*prestart["args"][:-1], "poststop"]}
    assert poststop["path"] == sys.executable and poststop["env"] == runtimecall.HOOK_ENV


def test_runtime_wrapper_registers_the_relay_where_it_is_installed() -> None:
    """With gpuhook-relay beside the wrapper (the packages' layout), the hooks are the relay's: gpuhookd serves
    the start, and a poststop without a lease costs no interpreter."""
    spec: dict[str, object] = {}
    runtimecall.add_hooks(spec, None, Path("/usr/lib/gpuhook/bin/gpuhook-relay"))
    relay = "/usr/lib/gpuhook/bin/gpuhook-relay"
    assert spec["hooks"] == {stage: [{"path": relay, "args": [relay, stage], "env": runtimecall.HOOK_ENV}]
                             for stage in ("prestart", "poststop")}


def test_runtime_wrapper_edit_registers_poststop(tmp_path: Path, host: FakeHost) -> None:
    """A GPU container's config.json as the wrapper leaves it: the devices, one prestart and one poststop
    hook of gpuhook's, even when the bundle is edited twice; a container without GPUs gets neither."""
    gpu, plain = tmp_path / "gpu", tmp_path / "plain"
    for bundle, env in ((gpu, "NVIDIA_VISIBLE_DEVICES=1"), (plain, "PATH=/bin")):
        (bundle / "rootfs").mkdir(parents=True)
        (bundle / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "root": {"path": "rootfs"},
                                                        "process": {"args": ["true"], "cwd": "/", "env": [env]}}))
    for _ in range(2):
        runtime._edit(gpu, str(host.config_path))
    edited = json.loads((gpu / "config.json").read_text())
    assert [[h["args"][-1] for h in edited["hooks"][stage]] for stage in ("prestart", "poststop")] == \
        [["prestart"], ["poststop"]]
    assert "/dev/nvidia1" in {d["path"] for d in edited["linux"]["devices"]}
    before = (plain / "config.json").read_text()
    runtime._edit(plain, str(host.config_path))
    assert (plain / "config.json").read_text() == before


@pytest.mark.parametrize("engine", ["podman", "crio"])
def test_a_hooks_d_file_formatted_another_way_is_left_alone(engine: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A package's own hooks.d files that say the same in other whitespace are not rewritten (nor
    backed up): `install` on a packaged host changes nothing."""
    run_install(engine, dry_run=False, root=tmp_path, bin_dir=Path(BIN))
    written = [p for p in tmp_path.rglob("*.json") if "hooks.d" in str(p)]
    assert len(written) == 2
    for path in written:
        path.write_text(json.dumps(json.loads(path.read_text()), indent=4, sort_keys=True))
    before = {p: p.read_text() for p in written}
    capsys.readouterr()
    run_install(engine, dry_run=False, root=tmp_path, bin_dir=Path(BIN))
    assert "nothing to change" in capsys.readouterr().out
    assert {p: p.read_text() for p in written} == before
    assert not list(tmp_path.rglob("*.gpuhook-backup"))




@pytest.mark.parametrize(("current", "imports"), [
    pytest.param(DEBIAN_CONFIG, ["/etc/containerd/conf.d/*.toml"], id="debian-12-package"),
    pytest.param(None, ["/etc/containerd/conf.d/*.toml"], id="no-config"),
    pytest.param('# mine\nimports = ["/etc/other.toml"]  # kept\nversion = 2\n[plugins]\n',
                 ["/etc/other.toml", "/etc/containerd/conf.d/*.toml"], id="imports-of-its-own"),
    pytest.param("imports = []\n", ["/etc/containerd/conf.d/*.toml"], id="empty-imports"),
    pytest.param("# only a comment, no newline at the end", ["/etc/containerd/conf.d/*.toml"], id="no-version"),
])
def test_containerd_config_imports_the_drop_in(current: str | None, imports: list[str]) -> None:
    """containerd reads conf.d only through a top-level imports: Debian 12's config.toml has none, so
    install adds it (after `version`, before any table), keeps everything else, and changes nothing twice."""
    updated = containerd_config(current)
    parsed = tomllib.loads(updated)
    assert parsed["imports"] == imports
    if current:
        before = tomllib.loads(current)
        assert {k: v for k, v in parsed.items() if k != "imports"} == {k: v for k, v in before.items()
                                                                         if k != "imports"}
    assert containerd_config(updated) == updated


def test_containerd_config_that_cannot_be_edited_safely_is_refused() -> None:
    """Invalid TOML and a multi-line imports are refused, naming the file and what to do."""
    with pytest.raises(ConfigError, match="not valid TOML"):
        containerd_config("version = = 2\n")
    with pytest.raises(ConfigError, match=r"spans several lines.*by hand"):
        containerd_config('imports = [\n  "/etc/a.toml",\n]\n')


def test_containerd_install_makes_the_drop_in_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """On a Debian 12 host: the drop-in is written and config.toml imports it (a backup kept); twice: nothing."""
    config = tmp_path / "etc/containerd/config.toml"
    config.parent.mkdir(parents=True)
    config.write_text(DEBIAN_CONFIG)
    run_install("containerd", dry_run=False, root=tmp_path, bin_dir=Path(BIN))
    assert "/etc/containerd/conf.d/*.toml" in tomllib.loads(config.read_text())["imports"]
    assert (tmp_path / "etc/containerd/config.toml.gpuhook-backup").read_text() == DEBIAN_CONFIG
    assert (tmp_path / "etc/containerd/conf.d/gpuhook.toml").exists()
    capsys.readouterr()
    run_install("containerd", dry_run=False, root=tmp_path, bin_dir=Path(BIN))
    assert "nothing to change" in capsys.readouterr().out


@pytest.mark.parametrize(("request_", "devices"), [
    pytest.param("0", {"/dev/nvidia0"}, id="exclusive-gpu-by-index"),
    pytest.param("any", set(), id="any-left-to-the-hook"),
])
def test_runtime_wrapper_leaves_the_lease_to_its_hook(request_: str, devices: set[str], tmp_path: Path,
                                                      host: FakeHost) -> None:
    """Under a sharing policy the wrapper is not refused as a bare spec edit is: the prestart hook it
    registers takes the lease. An exclusive GPU asked by index gets its device in the spec; `any` is
    left whole to the hook (which GPU is decided at the start), with both hooks registered."""
    config = host.write_config(tmp_path / "gpuhook.yaml", state_dir=tmp_path / "state",
                               gpus=[{"device": "all", "sharing": "exclusive"}])
    bundle = tmp_path / "bundle"
    (bundle / "rootfs").mkdir(parents=True)
    (bundle / "config.json").write_text(json.dumps({
        "ociVersion": "1.0.2", "root": {"path": "rootfs"},
        "process": {"args": ["true"], "cwd": "/", "env": [f"NVIDIA_VISIBLE_DEVICES={request_}"]}}))
    runtime._edit(bundle, str(config))
    edited = json.loads((bundle / "config.json").read_text())
    assert [[h["args"][-1] for h in edited["hooks"][stage]] for stage in ("prestart", "poststop")] == \
        [["prestart"], ["poststop"]]
    assert {d["path"] for d in edited.get("linux", {}).get("devices", []) if "nvidia" in d["path"]
            and d["path"][len("/dev/nvidia"):].isdigit()} == devices


@pytest.mark.parametrize(("argv", "expected"), [
    pytest.param(["--root", "/r", "--log", "/b/log.json", "--log-format", "json", "create", "--bundle", "/b", "id"],
                 ("/b/log.json", "json"), id="containerd-shim"),
    pytest.param(["--log=/l", "create", "id"], ("/l", "text"), id="equals-and-default-format"),
    pytest.param(["create", "--log", "/not-global", "id"], (None, "text"), id="after-the-command"),
])
def test_runtime_log_flags(argv: list[str], expected: tuple[str | None, str]) -> None:
    """runc's global --log/--log-format, as the wrapper reads them to report its refusal there."""
    assert runtime.log_target(argv) == expected


def test_runtime_log_line_is_what_the_shim_parses(tmp_path: Path) -> None:
    """The JSON line has logrus's level/msg/time, appended; the text form quotes the message."""
    log = tmp_path / "log.json"
    runtime.write_runtime_log(str(log), "json", 'gpuhook: no GPU with index 9 "x"')
    runtime.write_runtime_log(str(log), "text", "gpuhook: second")
    first, second = log.read_text().splitlines()
    entry = json.loads(first)
    assert entry["level"] == "error" and entry["msg"] == 'gpuhook: no GPU with index 9 "x"' and entry["time"]
    assert second.endswith('level=error msg="gpuhook: second"')


def test_docker_under_nvidias_name_as_the_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`install --runtime docker --name nvidia --set-as-default`: daemon.json's runtimes.nvidia is gpuhook's
    wrapper and the default runtime (so `--runtime nvidia` and compose's `runtime: nvidia` keep working);
    an admin's other settings stay; twice: nothing to change."""
    daemon_json = tmp_path / "etc/docker/daemon.json"
    daemon_json.parent.mkdir(parents=True)
    daemon_json.write_text('{"log-driver": "journald"}')
    run_install("docker", dry_run=False, root=tmp_path, bin_dir=Path(BIN), name="nvidia", default=True)
    data = json.loads(daemon_json.read_text())
    assert data == {"log-driver": "journald", "default-runtime": "nvidia",
                    "runtimes": {"nvidia": {"path": f"{BIN}/gpuhook-runtime"}}}
    capsys.readouterr()
    run_install("docker", dry_run=False, root=tmp_path, bin_dir=Path(BIN), name="nvidia", default=True)
    assert "nothing to change" in capsys.readouterr().out


def test_containerd_under_another_name_as_the_default() -> None:
    """The containerd drop-in names the handler and, with --set-as-default, the CRI default_runtime_name."""
    dropin = next(c for c in changes("containerd", bin_dir=BIN, current={}, name="nvidia", default=True)
                  if c.path.endswith("conf.d/gpuhook.toml"))
    assert dropin.content is not None
    cri = tomllib.loads(dropin.content)["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]
    assert cri["default_runtime_name"] == "nvidia"
    assert cri["runtimes"]["nvidia"]["options"]["BinaryName"] == f"{BIN}/gpuhook-runtime"


@pytest.mark.parametrize(("engine", "name", "default", "match"), [
    pytest.param("docker", "Nvidia!", False, "expected a runtime name", id="bad-name"),
    pytest.param("podman", "nvidia", False, "hooks.d files", id="podman-has-no-runtime-name"),
    pytest.param("podman", None, True, "hooks.d files", id="podman-has-no-default-runtime"),
])
def test_runtime_names_are_checked(engine: str, name: str | None, default: bool, match: str, tmp_path: Path) -> None:
    """A name an engine would refuse, and --name/--set-as-default where there is no runtime, are refused."""
    with pytest.raises(ConfigError, match=match):
        run_install(engine, dry_run=True, root=tmp_path, bin_dir=Path(BIN), name=name, default=default)


@pytest.mark.parametrize(("name", "default", "dropin"), [
    pytest.param("nvidia", True, "/etc/crio/crio.conf.d/99-nvidia.toml", id="nvidia-default"),
    pytest.param("gpuhook", False, "/etc/crio/crio.conf.d/99-gpuhook.conf", id="gpuhook"),
])
def test_crio_with_a_name_registers_a_runtime_handler(name: str, default: bool, dropin: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`install --runtime crio --name N [--set-as-default]`: one crio.conf.d drop-in (NVIDIA's own file name for
    nvidia, which CRI-O would otherwise apply after ours) with [crio.runtime.runtimes.N] running gpuhook-runtime
    as an "oci" runtime, default_runtime only when asked; no hooks.d file (gpuhook would run twice); twice: nothing."""
    run_install("crio", dry_run=False, root=tmp_path, bin_dir=Path(BIN), name=name, default=default)
    assert "restart crio (systemctl restart crio)" in capsys.readouterr().out
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == [dropin.lstrip("/")]
    crio = tomllib.loads((tmp_path / dropin.lstrip("/")).read_text())["crio"]
    assert crio["runtime"]["runtimes"] == {name: {"runtime_path": f"{BIN}/gpuhook-runtime", "runtime_type": "oci"}}
    assert crio["runtime"].get("default_runtime") == (name if default else None)
    run_install("crio", dry_run=False, root=tmp_path, bin_dir=Path(BIN), name=name, default=default)
    assert "nothing to change" in capsys.readouterr().out


def test_crio_without_a_name_keeps_the_hooks_d_files() -> None:
    """Plain `install --runtime crio` is today's: the two hooks.d files, no runtime handler."""
    paths = [c.path for c in changes("crio", bin_dir=BIN, current={})]
    assert paths == [f"{HOOKS_D['crio']}/gpuhook.json", f"{HOOKS_D['crio']}/gpuhook-poststop.json"]


@pytest.mark.parametrize("engine", ["docker", "containerd", "crio"])
def test_registration_edits_the_config_file_it_is_given(engine: str, tmp_path: Path) -> None:
    """An explicit engine config (nvidia-ctk's --config): that file (and containerd's/CRI-O's drop-in beside it)
    and nothing else is changed, under the name given; containerd's imports reads that drop-in."""
    config = str(tmp_path / {"docker": "daemon.json", "containerd": "config.toml", "crio": "crio.conf"}[engine])
    wanted = registration(engine, runtime=f"{BIN}/gpuhook-runtime", current={}, name="nvidia", default=True,
                          config=config)
    assert all(c.path.startswith(f"{tmp_path}/") and c.link_to is None for c in wanted)
    text = {c.path.removeprefix(f"{tmp_path}/"): c.content or "" for c in wanted}
    if engine == "docker":
        assert json.loads(text["daemon.json"]) == {"default-runtime": "nvidia",
                                                   "runtimes": {"nvidia": {"path": f"{BIN}/gpuhook-runtime"}}}
    elif engine == "containerd":
        assert tomllib.loads(text["config.toml"])["imports"] == [f"{tmp_path}/conf.d/*.toml"]
        cri = tomllib.loads(text["conf.d/gpuhook.toml"])["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]
        assert cri["runtimes"]["nvidia"]["options"]["BinaryName"] == f"{BIN}/gpuhook-runtime"
    else:
        assert list(text) == ["crio.conf.d/99-nvidia.toml"]


@pytest.mark.parametrize("imports", [
    pytest.param('imports = ["conf.d/*.toml"]', id="relative-to-the-config"),
    pytest.param('imports = ["/etc/containerd/conf.d/gpuhook.toml"]', id="the-file-itself"),
])
def test_containerd_imports_that_already_read_the_drop_in_are_kept(imports: str) -> None:
    """An imports entry that already covers the drop-in (relative ones resolve against config.toml's dir, as
    containerd does) leaves config.toml as it is."""
    current = f"version = 2\n{imports}\n"
    assert containerd_config(current) == current


def test_kubernetes_has_nvidias_runtime_class_beside_gpuhooks() -> None:
    """RuntimeClass nvidia (handler nvidia, as `install --runtime containerd --name nvidia` makes it) beside
    gpuhook's, each saying which to use when."""
    nvidia_file = PACKAGING / "kubernetes/runtimeclass-nvidia.yaml"
    nvidia = yaml.safe_load(nvidia_file.read_text())
    assert (nvidia["kind"], nvidia["metadata"]["name"], nvidia["handler"]) == ("RuntimeClass", "nvidia", "nvidia")
    assert "gpuhook install --runtime containerd --name nvidia" in nvidia_file.read_text()
    assert "runtimeclass-nvidia.yaml" in (PACKAGING / "kubernetes/runtimeclass.yaml").read_text()
    dropin = next(c for c in changes("containerd", bin_dir=BIN, current={}, name="nvidia") if c.content)
    assert "nvidia" in tomllib.loads(dropin.content or "")["plugins"]["io.containerd.grpc.v1.cri"]["containerd"][
        "runtimes"]


def test_runtime_hooks_name_a_non_default_daemon_socket() -> None:
    """$GPUHOOK_DAEMON_SOCKET in the engine's environment: the hooks the wrapper registers are given it."""
    spec: dict[str, object] = {}
    relay = Path("/usr/lib/gpuhook/bin/gpuhook-relay")
    socket = runtimecall.daemon_socket({"GPUHOOK_DAEMON_SOCKET": "/run/other/gpuhookd.sock"})
    runtimecall.add_hooks(spec, None, relay, socket)
    assert [h["args"] for stage in ("prestart", "poststop") for h in spec["hooks"][stage]] == [  # type: ignore[index]
        [str(relay), "--daemon-socket", "/run/other/gpuhookd.sock", stage] for stage in ("prestart", "poststop")]
    assert runtimecall.daemon_socket({"GPUHOOK_DAEMON_SOCKET": "relative.sock"}) is None

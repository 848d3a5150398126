"""hookcall: the environment tripwire's list, and config.json over the size cap (no GPU: left untouched)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpuhook import hookcall
from gpuhook.errors import SpecError, UnsafeEnvironmentError
from gpuhook.hookcall import (
    _SCAN_CHUNK,
    HookArgs,
    check_environment,
    lease_may_exist,
    read_config_json,
    read_hook_call,
    read_start_config,
)
from gpuhook.oci.strictjson import SPEC_LIMIT
from gpuhook.sharing.ledger import Ledger

GLIBC_NAMES = ("GCONV_PATH", "GETCONF_DIR", "GLIBC_TUNABLES", "HOSTALIASES", "LOCALDOMAIN", "LOCPATH",
               "MALLOC_TRACE", "NIS_PATH", "NLSPATH", "RESOLV_HOST_CONF", "RES_OPTIONS")


@pytest.mark.parametrize("name", [*GLIBC_NAMES, "LD_PRELOAD", "LD_", "LD_ANYTHING", "PYTHONPATH", "PYTHONSTARTUP",
                                  "PYTHONHOME", "PYTHON", "PYTHONWARNINGS"])
def test_loader_libc_and_interpreter_variables_trip(name: str) -> None:
    """Each name the loader, glibc or the interpreter acts on is refused, named in the message."""
    with pytest.raises(UnsafeEnvironmentError, match=f"the hook's environment sets {name}; they can inject"):
        check_environment({"PATH": "/bin", name: "x"})


@pytest.mark.parametrize("name", ["PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONIOENCODING", "PATH", "LANG",
                                  "LC_ALL", "HOME", "XLD_PRELOAD", "MY_LOCPATH", "TZ", "NVIDIA_VISIBLE_DEVICES"])
def test_harmless_variables_pass(name: str) -> None:
    """The three interpreter settings daemons export, and names that only look alike, pass."""
    check_environment({name: "x"})


def test_every_found_name_is_listed_sorted() -> None:
    """The message keeps its format: every name found, sorted, joined by ', '."""
    with pytest.raises(UnsafeEnvironmentError) as excinfo:
        check_environment({"LOCPATH": "/x", "GCONV_PATH": "/y", "LD_PRELOAD": "z", "PYTHONUNBUFFERED": "1"})
    assert "sets GCONV_PATH, LD_PRELOAD, LOCPATH; they can inject" in str(excinfo.value)


def _bundle(tmp_path: Path, spec: dict[str, object], *, pad: int = 0, pad_first: bool = True) -> Path:
    """A bundle whose config.json is *spec* with *pad* bytes of padding in a member before (or after) it."""
    bundle = tmp_path / "bundle"
    bundle.mkdir(exist_ok=True)
    padding = {"org.example.padding": "x" * pad} if pad else {}
    document = {**padding, **spec} if pad_first else {**spec, **padding}
    (bundle / "config.json").write_text(json.dumps(document))
    return bundle


NO_GPU: dict[str, object] = {"ociVersion": "1.0.2", "process": {"args": ["sh"], "env": ["PATH=/bin"]},
                              "root": {"path": "rootfs"}}
STATE = json.dumps({"ociVersion": "1.0.2", "id": "c1", "pid": 4242, "bundle": "", "status": "creating"})


def _start(bundle: Path) -> bool:
    """read_hook_call for a prestart on *bundle*: whether it asks for a GPU."""
    state = json.loads(STATE) | {"bundle": str(bundle)}
    call = read_hook_call(HookArgs("prestart", None, False, None), {"PATH": "/bin"}, json.dumps(state).encode())
    return call.asks_gpu


def test_an_oversized_config_without_a_gpu_request_is_no_gpu(tmp_path: Path) -> None:
    """9 MiB asking for no GPU: the hook's start is a no-GPU start; other readers keep the cap."""
    bundle = _bundle(tmp_path, NO_GPU, pad=9 << 20)
    assert (bundle / "config.json").stat().st_size > SPEC_LIMIT
    assert read_start_config(str(bundle), limit=SPEC_LIMIT) is None
    assert _start(bundle) is False
    with pytest.raises(SpecError, match=f"bytes; the limit is {SPEC_LIMIT}"):
        read_config_json(str(bundle), limit=SPEC_LIMIT)


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param({**NO_GPU, "process": {"env": ["NVIDIA_VISIBLE_DEVICES=0"]}}, id="visible-devices"),
        pytest.param({**NO_GPU, "process": {"env": ["CUDA_VERSION=12.4"]}}, id="legacy-image"),
        pytest.param({**NO_GPU, "annotations": {"cdi.k8s.io/x": "nvidia.com/gpu=0"}}, id="cdi-annotation"),
        pytest.param({**NO_GPU, "mounts": [{"destination": "/var/run/nvidia-container-devices/0"}]},
                     id="device-list-mount"),
        pytest.param({**NO_GPU, "process": {"env": ["\\u004eVIDIA_VISIBLE_DEVICES=0"]}}, id="escaped-name"),
    ],
)
@pytest.mark.parametrize("pad_first", [True, False], ids=["request-last", "request-first"])
def test_an_oversized_config_with_a_gpu_marker_is_refused(tmp_path: Path, spec: dict[str, object],
                                                          pad_first: bool) -> None:
    """Any GPU marker (or a \\u escape, which could spell one) in an oversized file: the size refusal."""
    bundle = _bundle(tmp_path, spec, pad=9 << 20, pad_first=pad_first)
    with pytest.raises(SpecError, match=rf"config.json is \d+ bytes; the limit is {SPEC_LIMIT}"):
        read_start_config(str(bundle), limit=SPEC_LIMIT)


def test_a_marker_across_a_chunk_boundary_is_found(tmp_path: Path) -> None:
    """The scan keeps the tail of each chunk: a marker split by the 64 KiB boundary still refuses."""
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    head = b'{"org.example.padding": "' + b"x" * (SPEC_LIMIT + _SCAN_CHUNK)
    cut = (_SCAN_CHUNK - 3 - len(head) - len(b'", "')) % _SCAN_CHUNK  # "NVI" | "DIA_" on the boundary
    data = head + b"y" * cut + b'", "NVIDIA_VISIBLE_DEVICES": "0"}'
    assert data.index(b"NVIDIA_") % _SCAN_CHUNK == _SCAN_CHUNK - 3
    (bundle / "config.json").write_bytes(data)
    with pytest.raises(SpecError, match="the limit is"):
        read_start_config(str(bundle), limit=SPEC_LIMIT)


@pytest.mark.parametrize("through_root", [False, True], ids=["own-root", "hook-root-fd"])
@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink"])
def test_an_unusable_config_json_is_a_clean_refusal(tmp_path: Path, kind: str, through_root: bool) -> None:
    """A directory, FIFO or symlink at config.json: SpecError, never IsADirectoryError or a hang (read
    from our root, or as gpuhookd reads it, through the hook's root fd)."""
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    path = bundle / "config.json"
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        (tmp_path / "real.json").write_text(json.dumps(NO_GPU))
        path.symlink_to(tmp_path / "real.json")
    root_fd = os.open("/", os.O_PATH | os.O_DIRECTORY) if through_root else None
    try:
        for read in (read_config_json, read_start_config):
            with pytest.raises(SpecError, match=r"config\.json"):
                read(str(bundle), limit=SPEC_LIMIT, root_fd=root_fd)
    finally:
        if root_fd is not None:
            os.close(root_fd)


@pytest.mark.parametrize("shape", [
    pytest.param('{"ociVersion": "1.0.2", "ociVersion": "1.0.2"%s}', id="duplicate-keys"),
    pytest.param('{"x": NaN%s}', id="nan"),
    pytest.param('{"a": 1%s} {}', id="trailing-data"),
])
def test_a_config_without_a_gpu_marker_is_no_gpu_whatever_its_shape(tmp_path: Path, shape: str) -> None:
    """No marker (read_config_json's rule): a no-GPU start, nothing decoded; the same shape with a GPU
    request in it goes to the strict parser, which refuses it."""
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(shape % "")
    assert _start(bundle) is False
    (bundle / "config.json").write_text(shape % ', "env": ["NVIDIA_VISIBLE_DEVICES=0"]')
    with pytest.raises(SpecError, match=r"config\.json is not valid JSON"):
        _start(bundle)


def test_a_config_json_is_read_to_its_end_whatever_its_size_says() -> None:
    """The first read takes what fstat said (plus one, to see the end); a file that says less (FUSE,
    one that grew) is read on to its end, or to the most asked for."""
    read_fd, write_fd = os.pipe()  # a pipe's size is 0
    data = bytes(range(256)) * 16
    with os.fdopen(write_fd, "wb") as writer:
        writer.write(data)  # 4 KiB: what a pipe holds without a reader
    try:
        assert hookcall._read_up_to(read_fd, 100, 0) == data[:100]
        assert hookcall._read_up_to(read_fd, 1 << 20, 0) == data[100:]
    finally:
        os.close(read_fd)


# --- lease_may_exist: the poststop's no-lease fast path ----------------------------------------------


def _write_ledger(state_dir: Path, *container_ids: str) -> None:
    """A ledger as gpuhook writes it (ledger_store), holding *container_ids*."""
    from gpuhook.provision import ledger_store
    from gpuhook.sharing.ledger import Holder, Lease

    def add(ledger: Ledger) -> tuple[Ledger, None]:
        for n, container_id in enumerate(container_ids):
            ledger = ledger.reserve(Lease(container_id=container_id, devices=("GPU-0",),
                                          holder=Holder(pid=100 + n, start=1), since="2026-12-01T12:00:00Z"))
        return ledger, None

    ledger_store.update(state_dir, add)


def _config(tmp_path: Path, text: str) -> str:
    """*text* as a config file; the directories it names must not spell state_dir (the fast path counts that word)."""
    assert "state_dir" not in str(tmp_path) or str(tmp_path) not in text, "rename the test"
    path = tmp_path / "gpuhook.yaml"
    path.write_text(text)
    return str(path)


def test_no_ledger_file_means_no_lease(tmp_path: Path) -> None:
    """state_dir without leases.json (or not there at all): certainly no lease."""
    (tmp_path / "state").mkdir(mode=0o700)
    assert lease_may_exist(_config(tmp_path, f"state_dir: {tmp_path}/state\n"), {}, "c1") is False
    assert lease_may_exist(_config(tmp_path, f"state_dir: {tmp_path}/absent\n"), {}, "c1") is False


def test_a_ledger_naming_the_container_may_hold_its_lease(tmp_path: Path) -> None:
    """True exactly when the ledger names the id (not a longer id it is a prefix of)."""
    state_dir = tmp_path / "state"
    _write_ledger(state_dir, "c10", "other-ctr")
    config = _config(tmp_path, f"log_level: info\nstate_dir: {state_dir}\ncache_dir: null\n")
    assert lease_may_exist(config, {}, "c10") is True
    assert lease_may_exist(config, {}, "other-ctr") is True
    assert lease_may_exist(config, {}, "c1") is False
    assert lease_may_exist(config, {}, "other") is False
    _write_ledger(state_dir, "c1")
    assert lease_may_exist(config, {}, "c1") is True


@pytest.mark.parametrize("line", [
    "state_dir: {dir}", "state_dir: \"{dir}\"", "state_dir: '{dir}'", "state_dir: {dir}  # the ledger",
    "state_dir:   {dir}   ",
])
def test_the_ledger_directory_is_read_from_a_flat_line(tmp_path: Path, line: str) -> None:
    """Plain, double- or single-quoted, with a comment: the same directory the full config load gives."""
    from gpuhook.config import parse_config

    state_dir = tmp_path / "state"
    _write_ledger(state_dir, "held")
    text = line.format(dir=state_dir) + "\n"
    assert parse_config(text).state_dir == state_dir
    config = _config(tmp_path, text)
    assert lease_may_exist(config, {}, "held") is True
    assert lease_may_exist(config, {}, "free") is False


@pytest.mark.parametrize("line", ["state_dir: null", "state_dir: ~", "state_dir:", "state_dir: NULL"])
def test_a_null_state_dir_means_no_lease(tmp_path: Path, line: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """state_dir null: no ledger anywhere, whatever the default directory holds."""
    from gpuhook import hookcall

    default = tmp_path / "default"
    _write_ledger(default, "held")
    monkeypatch.setattr(hookcall, "DEFAULT_STATE_DIR", str(default))
    assert lease_may_exist(_config(tmp_path, line + "\n"), {}, "held") is False


@pytest.mark.parametrize("text", [
    pytest.param('state_dir: ""\n', id="empty-string"),
    pytest.param("state_dir: ''\n", id="empty-single-quoted"),
    pytest.param("state_dir: 'null'  # quoted: a string\n", id="quoted-null"),
    pytest.param("state_dir: null\ngpus: [{device: 0, sharing: exclusive}]\n", id="null-beside-a-policy"),
])
def test_a_state_dir_the_config_loader_refuses_goes_to_the_full_path(tmp_path: Path, text: str) -> None:
    """The real loader refuses these for their state_dir, so the fast path must not answer "no lease" (exit 0):
    the full path then refuses them with the loader's message."""
    from gpuhook.config import read_config
    from gpuhook.errors import ConfigError

    config = _config(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"^{re.escape(config)}: state_dir"):
        read_config(Path(config), required=True)
    assert lease_may_exist(config, {}, "c1") is True


def test_without_state_dir_the_default_directory_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A config that does not set state_dir: the default's ledger decides."""
    from gpuhook import hookcall

    default = tmp_path / "default"
    _write_ledger(default, "held")
    monkeypatch.setattr(hookcall, "DEFAULT_STATE_DIR", str(default))
    config = _config(tmp_path, "log_level: debug\n")
    assert lease_may_exist(config, {}, "held") is True
    assert lease_may_exist(config, {}, "free") is False


def test_the_config_is_found_as_the_full_load_finds_it(tmp_path: Path) -> None:
    """--config beats $GPUHOOK_CONFIG."""
    held = tmp_path / "held"
    _write_ledger(held, "c1")
    (tmp_path / "empty").mkdir(mode=0o700)
    (tmp_path / "a.yaml").write_text(f"state_dir: {held}\n")
    (tmp_path / "b.yaml").write_text(f"state_dir: {tmp_path}/empty\n")
    assert lease_may_exist(None, {"GPUHOOK_CONFIG": str(tmp_path / "a.yaml")}, "c1") is True
    assert lease_may_exist(str(tmp_path / "b.yaml"), {"GPUHOOK_CONFIG": str(tmp_path / "a.yaml")}, "c1") is False
    assert lease_may_exist(None, {"GPUHOOK_CONFIG": str(tmp_path / "b.yaml")}, "c1") is False


@pytest.mark.parametrize("text", [
    pytest.param("state_dir: {dir}\nstate_dir: {dir}\n", id="two-lines"),
    pytest.param("{{state_dir: {dir}}}\n", id="flow-mapping"),
    pytest.param("{{log_level: info,\nstate_dir: {dir}}}\n", id="flow-mapping-over-lines"),
    pytest.param("state_dir: \"{dir}\\u0041\"\n", id="escape-in-value"),
    pytest.param("\"state_dir\": {dir}\n", id="quoted-key"),
    pytest.param("state_dir: !!str {dir}\n", id="tag"),
    pytest.param("state_dir: &s {dir}\n", id="anchor"),
    pytest.param("  state_dir: {dir}\n", id="indented"),
    pytest.param("state_dir: relative/dir\n", id="relative"),
    pytest.param("# state_dir: {dir}\n", id="only-a-comment"),
    pytest.param("state_dir: {dir}\n# state_dir used to be elsewhere\n", id="also-in-a-comment"),
    pytest.param("state_dir: {dir}\t# tab before the comment\n", id="tab"),
    pytest.param("log_file: /var/log/state_dir.log\n", id="in-another-value"),
    pytest.param("state_dir:{dir}\n", id="no-space-after-the-colon"),  # one scalar: the full load refuses it
    pytest.param("state_dir: {dir}\u00e9\n", id="not-ascii"),
    pytest.param("state_dir: {dir}\x01\n", id="control-byte"),
    pytest.param("# pad\n" * 200_000 + "state_dir: {dir}\n", id="over-1-MiB"),  # not just its first MiB
])
def test_shapes_it_cannot_read_go_to_the_full_path(tmp_path: Path, text: str) -> None:
    """Anything but one plain top-level state_dir line: "may exist" (the full config load decides), even where the
    directory it names holds no ledger."""
    (tmp_path / "empty").mkdir(mode=0o700)
    assert lease_may_exist(_config(tmp_path, text.format(dir=tmp_path / "empty")), {}, "c1") is True


@pytest.mark.parametrize("text", [
    pytest.param("\"state\\x5fdir\": {dir}\n", id="escape-in-the-key"),
    pytest.param("state_dir: {dir}\n  x\n", id="continuation-line"),
    pytest.param("state_dir:\n  {dir}\n", id="value-on-the-next-line"),
])
def test_a_directory_the_flat_reading_would_misplace_goes_to_the_full_path(
        tmp_path: Path, text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """YAML that the full load reads as a state_dir other than the line's (a key spelled with an escape, a plain
    scalar folded over two lines, the value on the next line): the container's lease there must not be missed."""
    from gpuhook import hookcall
    from gpuhook.config import parse_config

    (tmp_path / "default").mkdir(mode=0o700)
    monkeypatch.setattr(hookcall, "DEFAULT_STATE_DIR", str(tmp_path / "default"))
    text = text.format(dir=tmp_path / "st")
    real = parse_config(text).state_dir
    assert real is not None and real in (tmp_path / "st", tmp_path / "st x")
    _write_ledger(real, "c1")
    assert lease_may_exist(_config(tmp_path, text), {}, "c1") is True


@pytest.mark.parametrize("container_id", ["", "c 1", 'c"1', "c\\1", "ctr\u00e9", "c/1", "c\n1", "c,1"])
def test_ids_json_might_escape_go_to_the_full_path(tmp_path: Path, container_id: str) -> None:
    """Only [A-Za-z0-9_.-] ids are matched in the raw file; others: "may exist"."""
    (tmp_path / "empty").mkdir(mode=0o700)
    assert lease_may_exist(_config(tmp_path, f"state_dir: {tmp_path}/empty\n"), {}, container_id) is True


def test_a_missing_or_unreadable_config_goes_to_the_full_path(tmp_path: Path) -> None:
    """A named config that is missing (the full load refuses it) or cannot be read: "may exist"."""
    assert lease_may_exist(str(tmp_path / "absent.yaml"), {}, "c1") is True
    assert lease_may_exist(None, {"GPUHOOK_CONFIG": str(tmp_path / "absent.yaml")}, "c1") is True
    (tmp_path / "dir.yaml").mkdir()
    assert lease_may_exist(str(tmp_path / "dir.yaml"), {}, "c1") is True


def test_an_unreadable_ledger_goes_to_the_full_path(tmp_path: Path) -> None:
    """leases.json that cannot be read (here a directory): "may exist"."""
    state_dir = tmp_path / "state"
    (state_dir / "leases.json").mkdir(parents=True)
    assert lease_may_exist(_config(tmp_path, f"state_dir: {state_dir}\n"), {}, "c1") is True


def test_the_tripwire_says_whose_environment_to_fix() -> None:
    """A hook's refusal names both fixes (its registration's env, dockerd's unit for docker --gpus);
    gpuhook-runtime's names its engine's service."""
    from gpuhook.request.runtimecall import ENGINE_ENV_FIX
    from gpuhook.errors import UnsafeEnvironmentError
    from gpuhook.hookcall import check_environment

    with pytest.raises(UnsafeEnvironmentError, match=r"explicit env.*dockerd's unit"):
        check_environment({"LD_PRELOAD": "/x.so"})
    with pytest.raises(UnsafeEnvironmentError, match=r"LD_AUDIT.*gpuhook-runtime inherits its engine's environment"):
        check_environment({"LD_AUDIT": "/x.so"}, fix=ENGINE_ENV_FIX)


@pytest.mark.parametrize("command", [["prestart"], ["poststop"], ["--debug", "createRuntime"], ["precreate"]])
def test_a_closed_stdin_is_one_line(command: list[str]) -> None:
    """A hook started with stdin closed (``<&-``: Python's sys.stdin is then None) says so in one line, exit 1."""
    proc = subprocess.run(["/bin/sh", "-c", 'exec "$0" -I -m gpuhook "$@" <&-', sys.executable, *command],
                          capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, timeout=60, check=False)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines() == [
        f"gpuhook: stdin is closed; this command reads {'the spec' if command == ['precreate'] else 'the OCI state'} "
        "from it (a runtime passes it; by hand: gpuhook ... < FILE)"]

"""hookcall: the environment tripwire's list, and config.json over the size cap (no GPU: left untouched)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpuhook.errors import SpecError, UnsafeEnvironmentError
from gpuhook.hookcall import (
    _SCAN_CHUNK,
    HookArgs,
    check_environment,
    read_config_json,
    read_hook_call,
    read_start_config,
)
from gpuhook.oci.strictjson import SPEC_LIMIT

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


@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink"])
def test_an_unusable_config_json_is_a_clean_refusal(tmp_path: Path, kind: str) -> None:
    """A directory, FIFO or symlink at config.json: SpecError, never IsADirectoryError or a hang."""
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
    for read in (read_config_json, read_start_config):
        with pytest.raises(SpecError, match=r"config\.json"):
            read(str(bundle), limit=SPEC_LIMIT)

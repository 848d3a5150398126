"""OCI state and config.json parsing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuhook.errors import SpecError
from gpuhook.oci.spec import parse_spec
from gpuhook.oci.state import parse_state
import contextlib

RUNC_STATE = b'{"ociVersion":"1.0.2-dev","id":"c1","status":"creating","pid":4242,"bundle":"/b"}'
CRUN_STATE = b'{"ociVersion":"1.0","id":"c1","pid":4242,"root":"rootfs","bundle":"/b","status":"created"}'


@pytest.mark.parametrize("data", [RUNC_STATE, CRUN_STATE], ids=["runc", "crun"])
def test_states_of_real_runtimes(data: bytes) -> None:
    """runc's and crun's prestart states both parse."""
    state = parse_state(data)
    assert (state.id, state.pid, state.bundle) == ("c1", 4242, Path("/b"))


def test_legacy_bundle_path_and_poststop_without_pid() -> None:
    """Docker < 17.06 wrote bundlePath; poststop states have no pid."""
    state = parse_state(b'{"id":"x","bundlePath":"/old","status":"stopped"}')
    assert state.bundle == Path("/old") and state.pid is None


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param(b'{"id":"a","pid":true,"bundle":"/b"}', "non-negative integer", id="bool-pid"),
        pytest.param(b'{"id":"a","pid":1,"pid":2,"bundle":"/b"}', "duplicate key", id="duplicate"),
        pytest.param(b'{"id":"a","pid":NaN,"bundle":"/b"}', "non-standard", id="nan"),
        pytest.param(b'{"id":"a","pid":1,"bundle":"b"}', "absolute", id="relative-bundle"),
        pytest.param(b"[1]", "JSON object", id="array"),
        pytest.param(b"{" * 100000, "not valid JSON", id="deep-nesting"),
        pytest.param(b"[" * 100000, "nests arrays or objects too deeply", id="deep-arrays"),
        pytest.param(b" " * (2 << 20), "limit", id="too-big"),
    ],
)
def test_bad_states(data: bytes, message: str) -> None:
    """Hostile or broken state is refused with the project's error."""
    with pytest.raises(SpecError, match=message):
        parse_state(data)


def _config(**process: object) -> bytes:
    """A config.json with the given process fields."""
    return json.dumps({"ociVersion": "1.0.2", "process": process, "root": {"path": "rootfs"}}).encode()


def test_spec_env_rootfs_and_privilege() -> None:
    """env (later duplicates win), relative root.path, CAP_SYS_ADMIN in bounding."""
    data = _config(env=["A=1", "A=2", "B=x=y"], capabilities={"bounding": ["CAP_SYS_ADMIN"]})
    spec = parse_spec(data, Path("/bundle"))
    assert spec.env == {"A": "2", "B": "x=y"}
    with pytest.raises(SpecError, match="'NOEQUALS' is not KEY=VALUE"):
        parse_spec(_config(env=["NOEQUALS"]), Path("/bundle"))
    with pytest.raises(SpecError, match="not a valid file name"):
        parse_spec(json.dumps({"ociVersion": "1", "process": {}, "root": {"path": "\ud800"}}).encode(), Path("/b"))
    assert spec.rootfs == Path("/bundle/rootfs")
    assert spec.privileged


def test_flat_capability_list_of_old_specs() -> None:
    """Pre-rc5 specs carried a flat capability list; NVIDIA accepts it."""
    assert parse_spec(_config(capabilities=["CAP_SYS_ADMIN"]), Path("/b")).privileged
    assert not parse_spec(_config(capabilities={"effective": ["CAP_SYS_ADMIN"]}), Path("/b")).privileged


def test_spec_must_look_like_a_bundle() -> None:
    """A config.json without process/root is refused with what is missing."""
    with pytest.raises(SpecError, match="missing 'root'"):
        parse_spec(b'{"ociVersion":"1","process":{}}', Path("/b"))


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                    max_leaves=12))
def test_any_json_parses_or_raises_our_error(value: object) -> None:
    """Any JSON shape as state or config either parses or raises SpecError."""
    for data in (json.dumps(value).encode(), json.dumps({"ociVersion": "1", "process": value, "root": value}).encode()):
        for parse in (parse_state, lambda d: parse_spec(d, Path("/b"))):
            with contextlib.suppress(SpecError):
                parse(data)


def test_runtime_owned_devices() -> None:
    """Char devices in linux.devices count as runtime-owned when the last matching rule allows rw."""
    linux = {
        "devices": [{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0},
                    {"path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1},
                    {"path": "/dev/sda", "type": "b", "major": 8, "minor": 0}],
        "resources": {"devices": [{"allow": False, "access": "rwm"},
                                  {"allow": True, "type": "c", "major": 195, "minor": 0, "access": "rw"},
                                  {"allow": True, "type": "c", "major": 195, "minor": 1, "access": "r"},
                                  {"allow": True, "type": "a", "access": "rwm"},
                                  {"allow": False, "type": "c", "major": 195, "minor": 1, "access": "rwm"}]},
    }
    data = json.dumps({"ociVersion": "1", "process": {}, "root": {"path": "r"}, "linux": linux}).encode()
    assert parse_spec(data, Path("/b")).runtime_devices == {(195, 0)}


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3), max_leaves=10)


@given(_JSON, st.sampled_from(["", " ", "\n\t"]))
def test_decoder_matches_the_json_module(value: object, pad: str) -> None:
    """The C-scanner decoder reads every document exactly as json.loads does."""
    import json as stdlib_json

    from gpuhook.oci.strictjson import decode

    text = pad + stdlib_json.dumps(value) + pad
    assert decode(text) == stdlib_json.loads(text)


@pytest.mark.parametrize("text", ["", "  ", "{} x", "[1,]", "{'a': 1}", "NaN", '{"a": Infinity}', '{"a":1,"a":2}',
                                  "[" * 100000, "\ufeff{}"])
def test_decoder_refuses_what_it_must(text: str) -> None:
    """Empty input, trailing data, bad syntax, NaN/Infinity, duplicate keys, deep nesting: ValueError/RecursionError."""
    from gpuhook.oci.strictjson import decode

    with pytest.raises((ValueError, RecursionError)):
        decode(text)


# --- bad input in a fresh hook process ---------------------------------------------------------------
#
# In a test process json is imported, so CPython 3.11's C scanner finds json.decoder and reports a
# syntax error whole; the hook never imports json, so these run the hook as runc does: a fresh `python -I`.

#: (bytes, what the one line must say): every way a document can be bad, each named with its place.
BAD_DOCUMENTS = [
    pytest.param(b"{", "is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
                 id="open-brace"),
    pytest.param(RUNC_STATE[:40], "is not valid JSON: Unterminated string starting at: line 1 column 37 (char 36)",
                 id="truncated"),
    pytest.param(b'{"id": "c1",\n "bundle": ', "is not valid JSON: Expecting value: line 2 column 12 (char 24)",
                 id="truncated-after-a-key"),
    pytest.param(b"{'id': 'c1'}",
                 "is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
                 id="single-quotes"),
    pytest.param(b'{"id": "c\x001"}', "is not valid JSON: Invalid control character at: line 1 column 10 (char 9)",
                 id="nul-in-a-string"),
    pytest.param(b"\x00", "is not valid JSON: Expecting value: line 1 column 1 (char 0)", id="nul"),
    pytest.param(b'{"id": "c1"} {}', "is not valid JSON: Extra data: line 1 column 13 (char 12)", id="trailing-data"),
    pytest.param(b'{"id": "\xff"}', "is not UTF-8: byte 0xff at offset 8 (invalid start byte)", id="invalid-utf-8"),
    pytest.param(b'{"a": ' + b"[" * 100000, "nests arrays or objects too deeply to decode", id="huge-nesting"),
]


def _fresh_hook(stdin: bytes, *args: str) -> subprocess.CompletedProcess[bytes]:
    """``python -I -m gpuhook ARGS`` as a runtime runs the hook: a clean environment, *stdin* as its stdin."""
    return subprocess.run([sys.executable, "-I", "-m", "gpuhook", *args], input=stdin, capture_output=True,
                          env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, timeout=60, check=False)


def _one_failure_line(proc: subprocess.CompletedProcess[bytes]) -> str:
    """The hook's only stderr line, once it is certain that it failed (exit 1) without a traceback."""
    err = proc.stderr.decode("utf-8", "replace")
    assert "Traceback" not in err, err
    assert proc.returncode == 1, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpuhook: "), err
    return lines[0]


@pytest.mark.parametrize(("data", "message"), BAD_DOCUMENTS)
def test_a_bad_state_is_one_line_from_a_fresh_hook(data: bytes, message: str) -> None:
    """The OCI state on stdin, bad in any of these ways: one ``gpuhook:`` line naming what and where, exit 1."""
    assert _one_failure_line(_fresh_hook(data, "prestart")) == f"gpuhook: the OCI state on stdin {message}"


@pytest.mark.parametrize(("data", "message"), BAD_DOCUMENTS)
def test_a_bad_config_json_is_one_line_from_a_fresh_hook(tmp_path: Path, data: bytes, message: str) -> None:
    """config.json bad in the same ways (with a GPU request in it, so it is decoded): the same one line."""
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    # A GPU marker right after the document's error: the place the message names is the same as in the state.
    (bundle / "config.json").write_bytes(data + b"NVIDIA_VISIBLE_DEVICES")
    state = json.dumps({"ociVersion": "1.0.2", "id": "c1", "status": "creating", "pid": 1, "bundle": str(bundle)})
    line = _one_failure_line(_fresh_hook(state.encode(), "prestart"))
    assert line == f"gpuhook: {bundle}/config.json {message}"

"""OCI state and config.json parsing."""

from __future__ import annotations

import json
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

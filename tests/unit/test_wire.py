"""The hook ↔ gpuhookd message format."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuhook.daemon import wire

_ENV_KEYS = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,15}", fullmatch=True)
_ENV_VALUES = st.text(alphabet=st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)), max_size=40)


@given(config=st.none() | st.text(alphabet=st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)),
                                  max_size=30),
       debug=st.booleans(), env=st.dictionaries(_ENV_KEYS, _ENV_VALUES, max_size=5),
       state=st.binary(max_size=200), spec=st.binary(max_size=200))
def test_hook_request_round_trip(config: str | None, debug: bool, env: dict[str, str], state: bytes,
                                 spec: bytes) -> None:
    """Whatever the hook sends arrives unchanged: config (None and "" differ), env, raw documents."""
    data = wire.encode_request(b"hook", wire.hook_parts("1.2.3", config, debug, env, state, spec))
    line, _, body = data.partition(b"\n")
    kind, sizes = wire.parse_header(line)
    assert kind == b"hook"
    decoded = wire.decode_hook_parts(wire.split_parts(body, sizes))
    assert decoded == ("1.2.3", config, debug, env, state, spec)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        pytest.param(b"gpuhookd/2 ping 1", "not a gpuhookd/1 request", id="version"),
        pytest.param(b"gpuhookd/1 exec 1", "not a gpuhookd/1 request", id="kind"),
        pytest.param(b"gpuhookd/1 ping 1 2", "malformed ping request header", id="parts"),
        pytest.param(b"gpuhookd/1 ping -1", "malformed ping request header", id="negative"),
        pytest.param(b"gpuhookd/1 ping 1234567890", "malformed ping request header", id="huge-number"),
        pytest.param(b"gpuhookd/1 hook 1 1 1 1 9999999 9999999", "the limit is", id="too-large"),
    ],
)
def test_bad_headers_are_refused(line: bytes, message: str) -> None:
    """A header names its kind, one size per part, and stays under the request limit."""
    with pytest.raises(wire.WireError, match=message):
        wire.parse_header(line)


def test_env_entries_need_a_key() -> None:
    """An environment part is KEY=VALUE entries."""
    parts = wire.hook_parts("1", None, False, {}, b"", b"")
    parts[3] = b"A=1\0NOEQUALS"
    with pytest.raises(wire.WireError, match="without KEY="):
        wire.decode_hook_parts(parts)


@given(verdict=st.sampled_from(wire.VERDICTS), status=st.integers(-255, 255), message=st.text(max_size=100))
def test_reply_round_trip(verdict: bytes, status: int, message: str) -> None:
    """Replies decode to what was encoded (messages are UTF-8; lone surrogates become U+FFFD)."""
    decoded = wire.decode_reply(wire.encode_reply(verdict, status, message))
    assert decoded == (verdict, status, message.encode("utf-8", "replace").decode("utf-8"))


@pytest.mark.parametrize("data", [b"", b"gpuhookd/1 done 0 5\nabc", b"gpuhookd/1 done 0 0", b"gpuhookd/1 ok 0 0\n",
                                  b"HTTP/1.1 200 OK\n"])
def test_incomplete_replies_are_refused(data: bytes) -> None:
    """A cut-off or foreign reply is never taken for an answer."""
    with pytest.raises(wire.WireError):
        wire.decode_reply(data)

"""NVIDIA's hook argv and the no-op stages."""

from __future__ import annotations

import io

import pytest

from gpuhook.cli import main
from gpuhook.cli.nvidia import translate


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        pytest.param(["prestart"], ["prestart"], id="docker"),
        pytest.param(["-config", "/c.toml", "prestart"], ["--config", "/c.toml", "prestart"], id="config-space"),
        pytest.param(["--config=/c", "-debug", "poststop"], ["--config", "/c", "--debug", "poststop"], id="config-eq"),
        pytest.param(["createRuntime"], ["createRuntime"], id="create-runtime"),
        pytest.param(["--daemon-socket", "none", "prestart"], ["--daemon-socket", "none", "prestart"],
                     id="daemon-socket"),  # gpuhook's own flag (gpuhook-relay looks for exactly this form)
    ],
)
def test_nvidia_argv_is_translated(argv: list[str], expected: list[str]) -> None:
    """Go-flag style argv becomes gpuhook's argv."""
    assert translate(argv) == expected


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param([], "missing command", id="empty"),
        pytest.param(["start"], "unknown command 'start'", id="unknown"),
        pytest.param(["-config"], "needs an argument", id="dangling"),
        pytest.param(["-bogus", "prestart"], "not defined: -bogus", id="flag"),
        pytest.param(["-version"], "gpuhook ", id="version"),
    ],
)
def test_nvidia_argv_messages(argv: list[str], message: str) -> None:
    """Usage problems and -version come back as text."""
    result = translate(argv)
    assert isinstance(result, str) and message in result


def test_noop_stages_drain_stdin(monkeypatch: pytest.MonkeyPatch) -> None:
    """poststart/poststop read the state and succeed without touching anything."""
    stdin = io.TextIOWrapper(io.BytesIO(b'{"id":"x","status":"stopped","bundle":"/b"}'))
    monkeypatch.setattr("sys.stdin", stdin)
    assert main(["poststop"]) == 0
    assert stdin.buffer.read() == b""

"""NVIDIA's hook argv, translated once (``hookcall``) for the Python front-end and gpuhookd alike."""

from __future__ import annotations

import pytest

from gpuhook.hookcall import parse_hook_argv, relayed_hook_args, translate_nvidia_argv


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
    assert translate_nvidia_argv(argv) == expected


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
    result = translate_nvidia_argv(argv)
    assert isinstance(result, str) and message in result


@pytest.mark.parametrize(
    ("argv", "stage", "action"),
    [
        pytest.param(["gpuhook", "prestart"], "prestart", "start", id="gpuhook-prestart"),
        pytest.param(["gpuhook", "--config", "/c", "createRuntime"], "createRuntime", "start", id="create-runtime"),
        pytest.param(["gpuhook", "poststop"], "poststop", "stop", id="poststop"),
        pytest.param(["nvidia-container-runtime-hook", "-config=/c", "poststart"], "poststart", "nothing",
                     id="nvidia-poststart"),
    ],
)
def test_the_stage_table_decides_what_a_call_does(argv: list[str], stage: str, action: str) -> None:
    """One table for every front-end: the same stage does the same thing under either name."""
    args = relayed_hook_args(argv)
    assert args is not None
    assert (args.stage, args.action) == (stage, action)
    assert parse_hook_argv(argv[1:]) is not None or argv[0] != "gpuhook"


@pytest.mark.parametrize("argv", [["gpuhook", "info"], ["nvidia-container-runtime-hook", "-version"], ["sh", "-c"],
                                  []])
def test_what_is_not_a_hook_call_is_left_to_the_cli(argv: list[str]) -> None:
    """Help, version, other commands and other programs are not hook calls."""
    assert relayed_hook_args(argv) is None

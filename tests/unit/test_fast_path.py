"""The hook's no-GPU fast path: argv without argparse, and nothing heavy imported on the way out."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpuhook.cli import _parser
from gpuhook.hookcall import parse_hook_argv

REPO = Path(__file__).parents[2]
#: Everything the no-GPU path may import beyond the interpreter's own start-up: the C JSON scanner, select,
#: two tiny modules (__future__, types) and gpuhook's light modules; no contextlib (~4 ms), typing,
#: dataclasses, re, pathlib, ctypes, YAML or logging.
ALLOWED = {"__future__", "types", "_json", "select", "gpuhook", "gpuhook.cli", "gpuhook.cli.hook", "gpuhook.hookcall",
           "gpuhook.errors", "gpuhook.oci", "gpuhook.oci.strictjson", "gpuhook.request", "gpuhook.request.quick"}


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["prestart"], id="bare"),
        pytest.param(["--config", "/etc/g.yaml", "prestart"], id="config"),
        pytest.param(["--config=/etc/g.yaml", "--debug", "createRuntime"], id="config-eq-debug"),
        pytest.param(["--debug", "--config", "/c", "poststop"], id="debug-first"),
        pytest.param(["--config", "/a", "--config", "/b", "prestart"], id="last-config-wins"),
        pytest.param(["--config", "prestart", "prestart"], id="file-named-like-a-stage"),
        pytest.param(["--config=", "poststart"], id="empty-config"),
    ],
)
def test_hook_argv_agrees_with_argparse(argv: list[str]) -> None:
    """The hand decoder gives exactly what argparse gives for the argv shapes runtimes send."""
    fast = parse_hook_argv(argv)
    slow = _parser().parse_args(argv)
    assert fast is not None
    assert (fast.stage, fast.config, fast.debug) == (slow.command, slow.config, slow.debug)


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param([], id="empty"),
        pytest.param(["--help"], id="help"),
        pytest.param(["--version"], id="version"),
        pytest.param(["info", "--refresh"], id="other-command"),
        pytest.param(["--config", "--debug", "prestart"], id="option-as-value"),
        pytest.param(["--conf", "/c", "prestart"], id="abbreviation"),
        pytest.param(["prestart", "extra"], id="trailing"),
        pytest.param(["--config", "/c"], id="no-stage"),
        pytest.param(["--bogus", "prestart"], id="unknown-option"),
    ],
)
def test_anything_else_goes_to_argparse(argv: list[str]) -> None:
    """Help, version, other commands and mistakes are left to argparse (usage text, exit 2)."""
    assert parse_hook_argv(argv) is None


def test_no_gpu_start_loads_nothing_heavy(tmp_path: Path) -> None:
    """A container without NVIDIA variables: exit 0 having imported only json, select and light gpuhook modules."""
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps(
        {"ociVersion": "1.0.2", "process": {"args": ["sh"], "env": ["PATH=/bin"]}, "root": {"path": "rootfs"}}))
    state = json.dumps({"ociVersion": "1.0.2", "id": "c1", "pid": 4242, "bundle": str(bundle), "status": "creating"})
    # As in production (a regular install, `python -I`): the interpreter plus what site imports (os), and
    # no .pth processing: this dev venv's editable-install finder imports contextlib, re and more at
    # start-up, which would hide the same imports made by gpuhook.
    code = (f"import sys, os; before = set(sys.modules); sys.path.insert(0, {str(REPO)!r}); "
            "from gpuhook.cli import main; "
            "rc = main(['--config', '/nonexistent.yaml', 'prestart']); print(rc, sorted(set(sys.modules) - before))")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], input=state, capture_output=True, text=True,
                         check=True, cwd="/")
    rc, _, loaded = out.stdout.strip().partition(" ")
    assert rc == "0", out.stderr
    assert set(ast.literal_eval(loaded)) <= ALLOWED

"""Corpus G: container inputs that cost the host: an oversized config.json, huge values, a full log disk."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuhook.oci.strictjson import SPEC_LIMIT

from .rig import GPU0, GPU_PROBE, Rig

#: Over the 8 MiB cap by 1 MiB: the size docker specs reach with a large env or many annotations.
PADDING = 9 << 20
#: The bounded line: 4 KiB of message, "gpuhook: " and the "…(N more)" marker.
LINE_BOUND = 4096 + 64


def _padded_first(padding: str) -> Callable[[dict[str, Any]], None]:
    """An edit that puts a *padding* member before everything else, so any GPU request comes after it.

    A top-level member runc ignores: an annotation would also go into the OCI state (1 MiB cap),
    an environment variable past the kernel's argument limit.
    """

    def edit(spec: dict[str, Any]) -> None:
        rest = dict(spec)
        spec.clear()
        spec["org.example.padding"] = padding
        spec.update(rest)

    return edit


def _config_size(rig: Rig) -> int:
    """The size of the newest bundle's config.json."""
    bundles = sorted(rig.tmp.glob("bundle*"), key=lambda p: int(p.name.removeprefix("bundle")))
    return (bundles[-1] / "config.json").stat().st_size


def test_oversized_config_without_a_gpu_request_starts(rig: Rig) -> None:
    """A 9 MiB config.json that asks for no GPU is left untouched, as any no-GPU container (all three modes)."""
    outcome = rig.run(rig.container(None, GPU_PROBE, edit_spec=_padded_first("x" * PADDING)))
    assert _config_size(rig) > SPEC_LIMIT
    rig.check_no_gpu(outcome)


def test_oversized_config_with_a_gpu_request_at_the_end_is_refused(rig: Rig) -> None:
    """The same 9 MiB of padding before NVIDIA_VISIBLE_DEVICES=0: refused with the size message."""
    outcome = rig.run(rig.container(GPU0, GPU_PROBE, edit_spec=_padded_first("x" * PADDING)))
    assert _config_size(rig) > SPEC_LIMIT
    outcome.assert_refused("config.json is", f"the limit is {SPEC_LIMIT}")


def test_oversized_config_with_a_unicode_escape_is_refused(rig: Rig) -> None:
    r"""A \u escape could spell NVIDIA_VISIBLE_DEVICES in an oversized file, so one is refused unread."""
    outcome = rig.run(rig.container(None, GPU_PROBE, edit_spec=_padded_first("é" + "x" * PADDING)))
    assert "\\u00e9" in (sorted(rig.tmp.glob("bundle*"))[-1] / "config.json").read_text()[:100]
    outcome.assert_refused(f"the limit is {SPEC_LIMIT}", "escape")


def _log_lines(rig: Rig, offset: int) -> list[bytes]:
    """The host log's lines written since *offset*."""
    log = rig.host.root / "gpuhook.log"
    return log.read_bytes()[offset:].splitlines() if log.exists() else []


def test_huge_visible_devices_value_is_echoed_and_logged_bounded(rig: Rig) -> None:
    """A 100 KiB NVIDIA_VISIBLE_DEVICES is refused with one bounded line that names the entry's length and the
    limit (quoting only its start), and no log line holds it whole."""
    log = rig.host.root / "gpuhook.log"
    offset = log.stat().st_size if log.exists() else 0
    value = "GPU-" + "a" * (100 << 10)
    outcome = rig.run(rig.container({"NVIDIA_VISIBLE_DEVICES": value}, GPU_PROBE))
    outcome.assert_refused(f"the entry {value[:40]!r}... is {len(value)} characters long", "the limit is 128")
    assert len(outcome.hook_error.splitlines()[0]) <= LINE_BOUND, len(outcome.hook_error)
    lines = _log_lines(rig, offset)
    if rig.via.socket == "none" or lines:  # the hook logs itself; gpuhookd logs where its configuration says
        assert lines, "the refusal was not logged"
    assert all(len(line) <= 3 * LINE_BOUND for line in lines), max(map(len, lines))
    assert all(json.loads(line) for line in lines)


@pytest.fixture
def full_log(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A log file on a 64 KiB tmpfs that is full: every write to it fails with ENOSPC."""
    mnt = tmp_path_factory.mktemp("fulllog")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0755", "tmpfs", str(mnt)], check=True)
    try:
        log = mnt / "gpuhook.log"
        log.touch()
        with open(mnt / "filler", "wb", buffering=0) as filler:
            try:
                while True:
                    filler.write(b"\0" * 4096)
            except OSError as err:
                assert err.errno == 28, err  # ENOSPC: now the disk is full
        with pytest.raises(OSError, match="No space left"), open(log, "a") as handle:
            handle.write("x\n")
        yield log
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_gpu_start_with_the_log_on_a_full_disk_still_starts(rig: Rig, full_log: Path) -> None:
    """ENOSPC from the log never refuses a start: the container gets its GPU and the log stays empty."""
    config = rig.config(log_file=full_log, log_level="debug")
    outcome = rig.run(rig.container(GPU0, GPU_PROBE, config=config))
    rig.check_gpu(outcome, [0])
    assert full_log.stat().st_size == 0
    assert os.statvfs(full_log.parent).f_bfree == 0

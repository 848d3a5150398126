"""The event log: it never refuses a start (a full disk), and container values in it are bounded."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuhook import log as logmod
from gpuhook.errors import RequestError, report_failure
from gpuhook.log import MESSAGE_LIMIT, VALUE_LIMIT, EventLog, bounded


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 KiB tmpfs with no block left: writes to files on it fail with ENOSPC."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mnt)], check=True)
    try:
        (mnt / "gpuhook.log").touch()
        with open(mnt / "filler", "wb", buffering=0) as filler, pytest.raises(OSError, match="No space left"):
            while True:
                filler.write(b"\0" * 4096)
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_a_full_disk_never_raises_and_is_said_once(full_disk: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """ENOSPC at flush: no exception from any event, one line on stderr, later events dropped quietly."""
    log = EventLog(logmod._open_log(full_disk / "gpuhook.log"), "debug")
    for i in range(50):
        log.info("step", number=i, text="x" * 1000)
        log.error("hook_failed", error="y" * 5000)
    err = capsys.readouterr().err
    assert err.count("cannot write the log (No space left on device)") == 1, err
    assert (full_disk / "gpuhook.log").stat().st_size == 0


def test_an_unopenable_log_falls_back_to_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A log path that cannot be opened (its parent is a file) logs to stderr instead of failing."""
    (tmp_path / "file").write_text("")
    log = EventLog(logmod._open_log(tmp_path / "file" / "gpuhook.log"), "info")
    log.info("started")
    err = capsys.readouterr().err
    assert "cannot open log file" in err and '"event": "started"' in err


def test_every_value_is_bounded(tmp_path: Path) -> None:
    """Strings, list items, mapping keys and bound context are cut to VALUE_LIMIT with the marker; messages to 4 KiB."""
    path = tmp_path / "gpuhook.log"
    with open(path, "a", encoding="utf-8") as stream:
        log = EventLog(stream, "info")
        log.bind(container_id="c" * 10_000)
        log.info("request_parsed", devices="0," * 500_000, requirements=["r" * 1000] * 1000,
                 env={"K" * 1000: "v" * 1000}, count=3, ok=True, none=None, path=tmp_path / ("p" * 1000))
        log.error("hook_failed", error="e" * 100_000)
    parsed, failed = (json.loads(line) for line in path.read_text().splitlines())
    assert len(parsed["devices"]) < VALUE_LIMIT + 20
    assert parsed["devices"].endswith(f"…({1_000_000 - VALUE_LIMIT} more)")
    assert parsed["container_id"] == bounded("c" * 10_000)
    assert len(parsed["requirements"]) == logmod.ITEMS_LIMIT + 1 and parsed["requirements"][-1] == "…(872 more)"
    assert all(len(item) < VALUE_LIMIT + 20 for item in parsed["requirements"])
    assert [len(k) < VALUE_LIMIT + 20 and len(v) < VALUE_LIMIT + 20 for k, v in parsed["env"].items()] == [True]
    assert (parsed["count"], parsed["ok"], parsed["none"]) == (3, True, None)
    assert len(parsed["path"]) < VALUE_LIMIT + 20
    assert len(failed["error"]) < MESSAGE_LIMIT + 20 and failed["error"].endswith(f"({100_000 - MESSAGE_LIMIT} more)")
    assert len(path.read_bytes()) < 64 * 1024


def test_a_reported_failure_echoes_a_bounded_line() -> None:
    """report_failure cuts the user's line (which echoes container values) to 4 KiB with the marker."""
    line = report_failure(RequestError(f"NVIDIA_VISIBLE_DEVICES={'0,' * 1_000_000!r}: not a device list"))
    assert line.startswith("gpuhook: NVIDIA_VISIBLE_DEVICES='0,0,") and len(line) < MESSAGE_LIMIT + 20
    assert line.endswith("more)") and "\n" not in line
    assert report_failure(RequestError("short")) == "gpuhook: short"


def test_bounded_leaves_short_text_alone() -> None:
    """Text within the limit is unchanged; longer text says exactly how much was cut."""
    assert bounded("abc", 3) == "abc"
    assert bounded("abcdef", 3) == "abc…(3 more)"


def test_configuring_again_keeps_the_open_log_until_it_is_rotated(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """gpuhookd configures logging for every request: the open file is kept (no context carried over)
    while its path names it; once the log is moved away (logrotate) events go to a new file there."""
    for name in ("_log", "_log_path"):  # the process's log as it was, after the test
        monkeypatch.setattr(logmod, name, getattr(logmod, name))
    path = tmp_path / "gpuhook.log"
    logmod.configure_logging(path, "info")
    stream = logmod.get_logger()._stream
    logmod.get_logger().bind(container_id="first")
    logmod.configure_logging(path, "info")
    assert logmod.get_logger()._stream is stream
    logmod.get_logger().info("second_event")
    path.rename(tmp_path / "gpuhook.log.1")
    logmod.configure_logging(path, "info")
    assert logmod.get_logger()._stream is not stream
    logmod.get_logger().info("after_rotation")
    rotated = [json.loads(line) for line in (tmp_path / "gpuhook.log.1").read_text().splitlines()]
    assert [(e["event"], e.get("container_id")) for e in rotated] == [("second_event", None)]
    assert [json.loads(line)["event"] for line in path.read_text().splitlines()] == ["after_rotation"]

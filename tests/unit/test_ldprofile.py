"""Whether gpuhook writes the cache itself: the host ldconfig asked once per binary, the answer kept."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from gpuhook.apply import ldprofile, ldwrite
from gpuhook.apply.ldprofile import ProfileAnswer, ask, profile_for

LDCONFIG = Path("/sbin/ldconfig")
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="ldconfig -r chroots: needs root")


@pytest.fixture(autouse=True)
def _forget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ldprofile, "_KNOWN", {})


def test_the_hosts_ldconfig_agrees_and_names_its_directories() -> None:
    answer = ask(LDCONFIG)
    assert answer.profile is not None, answer.why_not
    assert b"/lib/x86_64-linux-gnu" in answer.profile.system_dirs
    assert answer.profile.generator.startswith(b"ldconfig (")


def test_an_ldconfig_that_writes_otherwise_is_not_stood_in_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """One rule of ldwrite changed (tls/ no longer a hwcap directory): the sample tree shows it."""
    monkeypatch.setattr(ldwrite, "_HWCAP_BITS", {k: v for k, v in ldwrite._HWCAP_BITS.items() if k != b"tls"})
    answer = ask(LDCONFIG)
    assert answer.profile is None
    assert "writes another cache than gpuhook on a sample tree" in answer.why_not


def test_a_program_that_is_no_ldconfig_is_not_stood_in_for(tmp_path: Path) -> None:
    busybox = shutil.which("busybox")
    assert busybox is not None
    answer = ask(Path(busybox))
    assert answer.profile is None and "could not ask" in answer.why_not
    script = tmp_path / "ldconfig"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o755)
    assert "not a 64-bit ELF" in ask(script).why_not


def test_the_answer_is_kept_per_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir(mode=0o755)
    binary = tmp_path / "ldconfig"
    shutil.copy(LDCONFIG, binary)
    asked: list[Path] = []
    real_ask = ldprofile.ask
    monkeypatch.setattr(ldprofile, "ask", lambda path: asked.append(path) or real_ask(path))
    first = profile_for(binary, cache_dir)
    assert first.profile is not None and asked == [binary]
    assert profile_for(binary, cache_dir) == first and len(asked) == 1  # in memory
    monkeypatch.setattr(ldprofile, "_KNOWN", {})
    assert profile_for(binary, cache_dir) == first and len(asked) == 1  # from the file
    os.utime(binary, ns=(0, 0))  # another binary (an upgrade): asked again
    monkeypatch.setattr(ldprofile, "_KNOWN", {})
    assert profile_for(binary, cache_dir) == first and len(asked) == 2


def test_a_kept_answer_anybody_could_write_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir(mode=0o755)
    assert profile_for(LDCONFIG, cache_dir).profile is not None
    (stored,) = cache_dir.iterdir()
    record = json.loads(stored.read_text())
    record.update(native=True, system_dirs=["/planted"])
    stored.write_text(json.dumps(record))
    stored.chmod(0o666)
    monkeypatch.setattr(ldprofile, "_KNOWN", {})
    monkeypatch.setattr(ldprofile, "ask", lambda path: ProfileAnswer(None, "asked again"))
    assert profile_for(LDCONFIG, cache_dir) == ProfileAnswer(None, "asked again")


def test_without_a_place_to_keep_the_answer_only_gpuhookd_asks() -> None:
    """A hook with cache_dir null would ask on every start (two ldconfig runs to save one): it runs
    ldconfig instead; gpuhookd asks once and its workers inherit the answer."""
    assert "not asked" in profile_for(LDCONFIG, None).why_not
    assert profile_for(LDCONFIG, None, keeps=True).profile is not None
    assert profile_for(LDCONFIG, None).profile is not None  # this process keeps it now


def test_an_ask_killed_midway_leaves_nothing_for_long(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sample trees of an ask whose process died (SIGKILL while it ran) go at the next ask."""
    import signal
    import subprocess
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen(["sleep", "60"])
    left = tmp_path / f"gpuhook-ldconfig-{dead.pid}-abcd"
    (left / "theirs/etc").mkdir(parents=True)
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    alive = tmp_path / f"gpuhook-ldconfig-{os.getpid()}-mine"
    alive.mkdir()
    assert ask(LDCONFIG).profile is not None
    assert not left.exists()
    assert alive.exists()  # ours (this process): not swept
    assert sorted(p.name for p in tmp_path.iterdir()) == [alive.name]  # and the ask's own trees are gone

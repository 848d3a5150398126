"""ledger_store: leases.json under state_dir, changed by compare-and-swap under leases.lock, written atomically.

These run as root (state_dir must be root-only) and use real processes for the lock.
"""

from __future__ import annotations

import multiprocessing
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpuhook.errors import StateError
from gpuhook.provision import ledger_store
from gpuhook.provision.ledger_store import LEDGER, LIMIT, LOCK, read, update
from gpuhook.sharing.ledger import Holder, Lease, Ledger, to_object

FORK = multiprocessing.get_context("fork")
#: How long a child process may take before the test calls it stuck.
DEADLINE_S = 60


def _lease(container_id: str, pid: int = 1) -> Lease:
    return Lease(container_id=container_id, devices=("GPU-00000000-aaaa-bbbb-cccc-dddddddddddd",),
                 holder=Holder(pid=pid, start=pid * 10), since="2026-12-01T12:00:00Z")


def _add(container_id: str) -> Callable[[Ledger], tuple[Ledger, int]]:
    """A change that appends *container_id*'s lease and returns how many leases there were before."""
    return lambda ledger: (ledger.reserve(_lease(container_id)), len(ledger.leases))


def _same(ledger: Ledger) -> tuple[Ledger, str]:
    """A change that changes nothing (a new, equal value)."""
    return Ledger(tuple(ledger.leases)), "unchanged"


def _run(target: Callable[..., None], *args: Any) -> int:
    """*target* in a forked child; its exit code (a stuck child fails the test rather than hang it)."""
    child = FORK.Process(target=target, args=args)
    child.start()
    child.join(DEADLINE_S)
    if child.exitcode is None:
        child.kill()
        child.join()
        pytest.fail(f"{target.__name__} did not finish within {DEADLINE_S} s (is the lock held?)")
    return child.exitcode


def _temps(state_dir: Path) -> list[str]:
    return sorted(name for name in os.listdir(state_dir) if name.endswith(".tmp"))


def test_update_creates_state_dir_root_only_and_writes_the_ledger(tmp_path: Path) -> None:
    """The first update makes state_dir 0700 (with its parents), then leases.json 0600, as JSON the ledger reads."""
    state_dir = tmp_path / "run" / "gpuhook"
    assert update(state_dir, _add("a")) == 0
    assert stat.S_IMODE(state_dir.stat().st_mode) == 0o700
    info = (state_dir / LEDGER).stat()
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.geteuid()
    assert read(state_dir).leases == (_lease("a"),)
    assert update(state_dir, _add("b")) == 1
    assert [lease.container_id for lease in read(state_dir).leases] == ["a", "b"]
    assert _temps(state_dir) == []


def test_read_of_an_absent_state_dir_or_ledger_is_empty(tmp_path: Path) -> None:
    """Nothing there yet: no leases (read creates nothing)."""
    assert read(tmp_path / "absent") == Ledger()
    assert not (tmp_path / "absent").exists()
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    assert read(state_dir) == Ledger()


def test_update_replaces_the_file_by_rename(tmp_path: Path) -> None:
    """Each write is a new file renamed over the old: a reader that opened the old one still reads it whole."""
    state_dir = tmp_path / "state"
    update(state_dir, _add("a"))
    path = state_dir / LEDGER
    with path.open("rb") as old:
        before = os.fstat(old.fileno()).st_ino
        update(state_dir, _add("b"))
        assert path.stat().st_ino != before
        old_text = old.read()
    assert b'"a"' in old_text and b'"b"' not in old_text
    assert b'"b"' in path.read_bytes()


def test_update_writes_only_when_the_ledger_changes(tmp_path: Path) -> None:
    """A change that returns an equal ledger leaves the file alone (same inode, same mtime) and creates none."""
    state_dir = tmp_path / "state"
    assert update(state_dir, _same) == "unchanged"
    assert not (state_dir / LEDGER).exists()
    assert (state_dir / LOCK).exists()
    update(state_dir, _add("a"))
    before = (state_dir / LEDGER).stat()
    assert update(state_dir, _same) == "unchanged"
    assert update(state_dir, lambda ledger: (ledger.release("nobody"), None)) is None
    after = (state_dir / LEDGER).stat()
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (before.st_ino, before.st_mtime_ns, before.st_size)


def test_a_failing_change_writes_nothing_and_releases_the_lock(tmp_path: Path) -> None:
    """The change raising: the ledger is as it was, and another process can take the lock at once."""
    state_dir = tmp_path / "state"
    update(state_dir, _add("a"))
    before = (state_dir / LEDGER).read_bytes()

    def boom(ledger: Ledger) -> tuple[Ledger, None]:
        raise RuntimeError("refused")

    with pytest.raises(RuntimeError, match="refused"):
        update(state_dir, boom)
    assert (state_dir / LEDGER).read_bytes() == before
    assert _run(_child_add, state_dir, "b") == 0
    assert [lease.container_id for lease in read(state_dir).leases] == ["a", "b"]


def test_a_write_error_is_a_state_error_and_keeps_the_old_ledger(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC and the like while writing: StateError naming the file; the old ledger stays whole."""
    state_dir = tmp_path / "state"
    update(state_dir, _add("a"))
    before = (state_dir / LEDGER).read_bytes()

    def full(dir_fd: int, name: str, data: bytes, *, mode: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ledger_store, "replace_at", full)
    with pytest.raises(StateError, match=rf"cannot write {state_dir}/leases.json: No space left on device"):
        update(state_dir, _add("b"))
    assert (state_dir / LEDGER).read_bytes() == before


def _child_add(state_dir: Path, container_id: str) -> None:
    update(state_dir, _add(container_id))


def _child_killed_before_rename(state_dir: Path) -> None:
    """An update whose process dies (SIGKILL-like, no cleanup) between writing its temporary file and the rename."""
    os.replace = lambda *args, **kwargs: os._exit(9)  # this forked child only
    update(state_dir, _add("torn"))


def test_a_writer_killed_before_its_rename_leaves_the_ledger_whole_and_the_next_update_sweeps(tmp_path: Path) -> None:
    """The dead writer's .leases.json.*.tmp stays, the ledger is the old one, the lock is free; the next update
    (even one that changes nothing) removes the temporary file."""
    state_dir = tmp_path / "state"
    update(state_dir, _add("a"))
    assert _run(_child_killed_before_rename, state_dir) == 9
    torn = _temps(state_dir)
    assert len(torn) == 1 and torn[0].startswith(".leases.json.")
    assert (state_dir / torn[0]).read_bytes().count(b'"torn"') == 1  # it got as far as writing it
    assert [lease.container_id for lease in read(state_dir).leases] == ["a"]
    assert update(state_dir, _same) == "unchanged"
    assert _temps(state_dir) == []


def test_a_stale_temporary_file_is_removed_by_the_next_update(tmp_path: Path) -> None:
    """Only the ledger's own temporaries go: other files in state_dir are left alone."""
    state_dir = tmp_path / "state"
    update(state_dir, _add("a"))
    (state_dir / ".leases.json.4242.deadbeef.tmp").write_text("{half")
    (state_dir / "other.tmp").write_text("keep")
    (state_dir / ".leases.json.keep").write_text("keep")
    update(state_dir, _add("b"))
    assert sorted(os.listdir(state_dir)) == [".leases.json.keep", LEDGER, LOCK, "other.tmp"]


@pytest.mark.parametrize("mode", [0o770, 0o720, 0o702, 0o777, 0o1777])
def test_a_state_dir_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    """Whoever can write state_dir can grant GPUs: group/world-writable is refused, by update and by read."""
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    state_dir.chmod(mode)
    for call in (lambda: update(state_dir, _add("a")), lambda: read(state_dir)):
        with pytest.raises(StateError, match=rf"state_dir {state_dir} must be owned by root and writable only by it "
                                             rf"\(it is mode {stat.S_IMODE(mode):o}, uid 0\)"):
            call()
    assert not (state_dir / LEDGER).exists()


def test_a_state_dir_readable_by_others_but_writable_only_by_root_is_accepted(tmp_path: Path) -> None:
    """0755 is private enough: only writing grants GPUs."""
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    state_dir.chmod(0o755)
    update(state_dir, _add("a"))
    assert len(read(state_dir).leases) == 1


def test_a_state_dir_owned_by_another_uid_is_refused(tmp_path: Path) -> None:
    """A 0700 directory of another user is that user's: refused."""
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    os.chown(state_dir, 12345, 12345)
    for call in (lambda: update(state_dir, _add("a")), lambda: read(state_dir)):
        with pytest.raises(StateError, match=r"must be owned by root and writable only by it "
                                             r"\(it is mode 700, uid 12345\)"):
            call()


def test_a_state_dir_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    """state_dir is never followed through a symlink (it could point at a directory someone else controls)."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(StateError, match="cannot create or open state_dir"):
        update(tmp_path / "link", _add("a"))
    with pytest.raises(StateError, match="cannot open state_dir"):
        read(tmp_path / "link")
    assert os.listdir(real) == []


@pytest.mark.parametrize(
    ("content", "message"),
    [
        pytest.param(b"{half", "is not JSON", id="not-json"),
        pytest.param(b"\xff\xfe", "is not JSON", id="not-utf8"),
        pytest.param(b'{"format": 1}', "is not a format-1 lease ledger", id="no-leases"),
        pytest.param(b'{"format": 1, "leases": [{"container_id": "a"}]}', "lease 0 is malformed", id="bad-lease"),
        pytest.param(b" " * (LIMIT + 1), f"is over {LIMIT} bytes", id="too-large"),
    ],
)
def test_a_corrupt_ledger_is_a_state_error_naming_the_file(tmp_path: Path, content: bytes, message: str) -> None:
    """update (before its change runs) and read both refuse, naming leases.json; the file is left for the admin."""
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    (state_dir / LEDGER).write_bytes(content)
    called: list[Ledger] = []

    def change(ledger: Ledger) -> tuple[Ledger, None]:
        called.append(ledger)
        return ledger, None

    for call in (lambda: update(state_dir, change), lambda: read(state_dir)):
        with pytest.raises(StateError, match=message) as excinfo:
            call()
        assert str(excinfo.value).startswith(str(state_dir / LEDGER))
    assert called == []
    assert (state_dir / LEDGER).read_bytes() == content


@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink"])
def test_a_ledger_that_is_not_a_regular_file_is_refused(tmp_path: Path, kind: str) -> None:
    """A directory, FIFO or symlink at leases.json: StateError naming it, never followed, never a hang."""
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    path = state_dir / LEDGER
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        (tmp_path / "elsewhere.json").write_bytes(b'{"format": 1, "leases": []}')
        path.symlink_to(tmp_path / "elsewhere.json")
    for call in (lambda: update(state_dir, _add("a")), lambda: read(state_dir)):
        with pytest.raises(StateError, match=str(path)):
            call()


WORKERS = 8
UPDATES = 25


def _contend(state_dir: Path, worker: int, barrier: Any) -> None:
    barrier.wait(DEADLINE_S)
    for n in range(UPDATES):
        update(state_dir, _add(f"w{worker}-{n}"))


def test_concurrent_updates_lose_nothing(tmp_path: Path) -> None:
    """8 processes × 25 appending updates, started together: exactly 200 leases, each once; a reader without the
    lock meanwhile always sees a whole ledger that only grows."""
    state_dir = tmp_path / "state"
    update(state_dir, _same)
    barrier = FORK.Barrier(WORKERS + 1)
    workers = [FORK.Process(target=_contend, args=(state_dir, w, barrier)) for w in range(WORKERS)]
    for worker in workers:
        worker.start()
    try:
        barrier.wait(DEADLINE_S)
        seen = [0]
        while any(worker.is_alive() for worker in workers):
            count = len(read(state_dir).leases)  # a torn file would raise StateError here
            assert count >= seen[-1]
            seen.append(count)
        assert [worker.exitcode for worker in workers] == [0] * WORKERS
    finally:
        for worker in workers:
            worker.join(DEADLINE_S)
            if worker.exitcode is None:
                worker.kill()
                worker.join()
    ids = [lease.container_id for lease in read(state_dir).leases]
    assert len(ids) == WORKERS * UPDATES
    assert sorted(ids) == sorted(f"w{w}-{n}" for w in range(WORKERS) for n in range(UPDATES))
    for w in range(WORKERS):  # each worker's leases in its own order
        assert [i for i in ids if i.startswith(f"w{w}-")] == [f"w{w}-{n}" for n in range(UPDATES)]
    assert _temps(state_dir) == []
    assert (state_dir / LEDGER).read_bytes().startswith(b"{")
    assert to_object(read(state_dir))["format"] == 1


def test_may_name_says_no_only_when_the_ledger_certainly_holds_no_lease_of_the_container(tmp_path: Path) -> None:
    """The poststop's lock-free look (service.stop): absent state_dir or ledger, or a ledger naming
    others only, is "no"; the container's own lease, an id JSON would escape, a ledger too large to be
    gpuhook's or one that cannot be opened leave the answer to the locked path."""
    state = tmp_path / "state"
    assert not ledger_store.may_name(state, "ctr-1")  # no state_dir yet (and none is made)
    assert not state.exists()
    update(state, _add("ctr-2"))
    assert not ledger_store.may_name(state, "ctr-1")
    update(state, _add("ctr-1"))
    assert ledger_store.may_name(state, "ctr-1")
    assert ledger_store.may_name(state, 'odd"id')
    (state / LEDGER).write_bytes(b" " * (LIMIT + 1))
    assert ledger_store.may_name(state, "ctr-3")
    (state / LEDGER).unlink()
    (state / LEDGER).symlink_to(tmp_path / "elsewhere.json")
    assert ledger_store.may_name(state, "ctr-3")  # O_NOFOLLOW: not the ledger, the locked path says so

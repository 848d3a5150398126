"""gpuhook.sys.syscalls: a failing raw call raises OSError carrying errno and the path."""

from __future__ import annotations

import pytest

from gpuhook.sys import syscalls


def test_failing_call_raises_oserror_with_path() -> None:
    """open_tree of a missing path is FileNotFoundError naming the path; a NUL is refused before the call."""
    with pytest.raises(FileNotFoundError) as excinfo:
        syscalls.open_tree(-100, "/nonexistent/gpuhook", syscalls.OPEN_TREE_CLOEXEC)
    assert excinfo.value.filename == "/nonexistent/gpuhook"
    with pytest.raises(ValueError, match="NUL"):
        syscalls.open_tree(-100, "/etc\0/x", syscalls.OPEN_TREE_CLOEXEC)

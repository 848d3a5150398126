"""gpuhook.sys.mountinfo: the one mountinfo parser, and mount ids from statx and fdinfo."""

from __future__ import annotations

import os
from pathlib import Path

from gpuhook.sys import mountinfo
from gpuhook.sys.mountinfo import MountInfo, parse_mountinfo

TEXT = (
    "22 1 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw\n"
    "36 35 98:0 /mnt1 /mnt\\040two rw,noatime master:1 propagate_from:2 - ext3 /dev/my\\134disk rw,errors=continue\n"
    "40 25 0:36 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate\n"
)


def test_rows_have_every_field_decoded() -> None:
    """Ids, paths with their octal escapes undone, optional fields, type, source, both option lists."""
    rows = parse_mountinfo(TEXT)
    assert rows[1] == MountInfo(
        mount_id=36, parent_id=35, device="98:0", root="/mnt1", mount_point="/mnt two",
        options=("rw", "noatime"), optional=("master:1", "propagate_from:2"), fs_type="ext3",
        source="/dev/my\\disk", super_options=("rw", "errors=continue"),
    )
    assert [row.mount_point for row in rows] == ["/proc", "/mnt two", "/sys/fs/cgroup/unified"]
    assert rows[2].optional == () and rows[2].super_options == ("rw", "nsdelegate")


def test_shared_peer_groups() -> None:
    """shared:N marks a shared mount; a slave (master:N) or private mount is not one."""
    rows = parse_mountinfo(TEXT)
    assert [row.shared_peer_group for row in rows] == [12, None, None]
    assert mountinfo.shared_mount_ids(rows) == frozenset({22})


def test_lines_without_mountinfo_shape_are_left_out() -> None:
    """No separator, a non-numeric id or a short tail: the line is skipped, the rest still read."""
    text = ("22 1 0:21 / /proc rw shared:12 proc proc rw\n"
            "x 1 0:21 / /a rw - proc proc rw\n"
            "23 1 0:21 / /b rw - proc proc\n"
            "\n" + TEXT)
    assert [row.mount_id for row in parse_mountinfo(text)] == [22, 36, 40]


def test_unescape_only_decodes_octal_escapes() -> None:
    """\\040 is a space, \\011 a tab, \\134 a backslash; a lone backslash stays."""
    assert mountinfo.unescape("/a\\040b\\011c\\134d") == "/a b\tc\\d"
    assert mountinfo.unescape("/a\\b") == "/a\\b"


def test_read_mountinfo_of_a_pid(tmp_path: Path) -> None:
    """read_mountinfo reads <proc>/<pid>/mountinfo."""
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "mountinfo").write_text(TEXT)
    assert mountinfo.read_mountinfo(7, proc=tmp_path) == parse_mountinfo(TEXT)


def test_our_mounts_agree_with_statx_and_fdinfo() -> None:
    """statx's mount id equals fdinfo's on every mount we can open, and each is a row of our mountinfo."""
    rows = mountinfo.read_mountinfo()
    ids = {row.mount_id for row in rows}
    seen = set()
    for point in sorted({row.mount_point for row in rows})[:40]:
        try:
            fd = os.open(point, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # hidden under another mount
        try:
            assert mountinfo.mount_id(fd) == mountinfo.fdinfo_mount_id(fd) > 0
            seen.add(mountinfo.mount_id(fd))
        finally:
            os.close(fd)
    assert len(seen) > 3
    assert seen <= ids

"""Finding and reading the container's device cgroup (pure parts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuhook.apply.cgroups import DeviceCgroup, _covered, cgroup_mounts, locate_device_cgroup, parse_cgroup_file
from gpuhook.errors import ApplyError
from gpuhook.planning.plan import CgroupRule
from gpuhook.sys.mountinfo import parse_mountinfo

MOUNTINFO = (
    "30 25 0:26 / /sys/fs/cgroup/cpu rw,relatime shared:9 - cgroup cgroup rw,cpu\n"
    "34 25 0:30 / /sys/fs/cgroup/devices rw,relatime shared:13 - cgroup cgroup rw,devices\n"
    "40 25 0:36 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
)


def _proc(tmp_path: Path, cgroup: str, mountinfo: str = MOUNTINFO) -> Path:
    """A fake /proc with one pid's cgroup file and our mountinfo."""
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "cgroup").write_text(cgroup)
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "mountinfo").write_text(mountinfo)
    return tmp_path


def test_v1_devices_dir(tmp_path: Path) -> None:
    """runc's /<id>, docker's /docker/<id>: joined under the devices mount."""
    proc = _proc(tmp_path, "4:devices:/docker/abc\n3:cpu:/docker/abc\n0::/docker/abc\n")
    assert locate_device_cgroup(7, proc=proc) == DeviceCgroup(1, Path("/sys/fs/cgroup/devices/docker/abc"))


def test_v2_dir_is_the_visible_hierarchy(tmp_path: Path) -> None:
    """runc in v2 mode: devices:/ is the v1 root, so the cgroup2 dir that exists is used (the last mounted)."""
    mounts = tmp_path / "mnt"
    (mounts / "late/abc").mkdir(parents=True)
    mountinfo = MOUNTINFO + f"50 25 0:40 / {mounts}/early rw - cgroup2 cgroup2 rw\n" \
        f"51 25 0:40 / {mounts}/late rw - cgroup2 cgroup2 rw\n"
    proc = _proc(tmp_path, "4:devices:/\n0::/abc\n", mountinfo)
    assert locate_device_cgroup(7, proc=proc) == DeviceCgroup(2, mounts / "late/abc")


@pytest.mark.parametrize(
    ("cgroup", "message"),
    [
        pytest.param("0::/abc\n", "neither a v1 devices cgroup nor a cgroup2 directory", id="v2-dir-missing"),
        pytest.param("4:devices:/../../etc\n", r"'\.\.'", id="traversal"),
        pytest.param("0::/../../etc\n", r"'\.\.'", id="v2-traversal"),
    ],
)
def test_refusals(tmp_path: Path, cgroup: str, message: str) -> None:
    """v2 and traversal are refused with a message, never followed."""
    with pytest.raises(ApplyError, match=message):
        locate_device_cgroup(7, proc=_proc(tmp_path, cgroup))


def test_parsers() -> None:
    """mountinfo and /proc/pid/cgroup decoding."""
    mounts = parse_mountinfo(MOUNTINFO + "41 25 0:37 /a\\040b /mnt/dev\\040ices rw - cgroup cgroup rw,devices\n")
    assert cgroup_mounts(mounts, v2=False) == [("/", "/sys/fs/cgroup/devices"), ("/a b", "/mnt/dev ices")]
    assert cgroup_mounts(mounts, v2=True) == [("/", "/sys/fs/cgroup/unified")]
    assert parse_cgroup_file("12:cpu,cpuacct:/x\n0::/y\n") == {"cpu": "/x", "cpuacct": "/x", "": "/y"}


@pytest.mark.parametrize(
    ("listing", "covered"),
    [
        pytest.param("c 1:3 rwm\n", False, id="other"),
        pytest.param("c 195:1 rw\n", True, id="exact"),
        pytest.param("c 195:* rwm\n", True, id="wildcard-minor"),
        pytest.param("a *:* rwm\n", True, id="privileged"),
        pytest.param("c 195:1 r\n", False, id="read-only"),
    ],
)
def test_covered(listing: str, covered: bool) -> None:
    """Only rules the cgroup does not already grant are written (and so rolled back)."""
    assert _covered(CgroupRule(major=195, minor=1), listing) is covered

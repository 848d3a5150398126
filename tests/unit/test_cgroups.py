"""Finding and reading the container's device cgroup (pure parts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuhook.apply.cgroups import _covered, device_cgroup_dir, devices_mount, parse_cgroup_file
from gpuhook.errors import ApplyError
from gpuhook.planning.plan import CgroupRule

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
    assert device_cgroup_dir(7, proc=proc) == Path("/sys/fs/cgroup/devices/docker/abc")


@pytest.mark.parametrize(
    ("cgroup", "message"),
    [
        pytest.param("0::/abc\n", "cgroup v2", id="pure-v2"),
        pytest.param("4:devices:/\n0::/abc\n", "cgroup v2", id="runc-v2-mode"),
        pytest.param("4:devices:/../../etc\n", r"'\.\.'", id="traversal"),
    ],
)
def test_refusals(tmp_path: Path, cgroup: str, message: str) -> None:
    """v2 and traversal are refused with a message, never followed."""
    with pytest.raises(ApplyError, match=message):
        device_cgroup_dir(7, proc=_proc(tmp_path, cgroup))


def test_parsers() -> None:
    """mountinfo and /proc/pid/cgroup decoding."""
    assert devices_mount(MOUNTINFO) == ("/", "/sys/fs/cgroup/devices")
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

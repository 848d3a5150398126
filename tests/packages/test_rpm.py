"""The .rpm: the same files as the .deb, installed with `rpm --root ... -i --nodeps`.

Into an empty root (no shell there, so --noscripts): exactly the listed files, with their modes and
link targets, `rpm -V` clean, and an erase that leaves only rpm's database. Into a clean Debian 12
root (which has /bin/sh, python3.11 and runc) with its scriptlets: the same checks as the .deb
(`gpuhook --version`, `gpuhook info`, real `runc run`s of a GPU container, one served by the
installed gpuhookd; gpuhookd restarted on upgrade and stopped on erase when systemd runs), then
`rpm -e` leaves nothing of gpuhook.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from integration.engines import tree_snapshot
from integration.fakehost import FakeHost

from .conftest import (
    UNITS,
    InstalledRoot,
    Packages,
    changed,
    check_commands,
    check_docs,
    check_gpu_containers,
    check_gpuhookd_container,
    check_info,
    check_units,
    deb_files,
    install_root,
    need,
    rpm_files,
    systemd_running,
)

#: rpm's own database (--dbpath /var/lib/rpm, as on RPM distributions).
RPM_BOOKKEEPING = ("var/lib/rpm",)


def rpm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run rpm with args."""
    need("rpm", "rpm")
    # Debian's rpm keeps its database in ~/.rpmdb; an RPM distribution's is /var/lib/rpm.
    dbpath = ["--dbpath", "/var/lib/rpm"] if "--root" in args else []
    proc = subprocess.run(["rpm", *dbpath, *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        pytest.fail(f"rpm {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return proc


def query(package: Path, fmt: str) -> list[str]:
    """rpm -qp --qf fmt, one line per entry."""
    return rpm("-qp", "--qf", fmt, str(package)).stdout.splitlines()


def test_rpm_name_and_relations(packages: Packages) -> None:
    """dist/gpuhook-<version>.<arch>.rpm; requires the interpreter file; conflicts, no Obsoletes."""
    assert packages.rpm.name == f"gpuhook-{packages.version}.x86_64.rpm"
    requires = [r for r in query(packages.rpm, "[%{REQUIRENAME}\\n]") if not r.startswith("rpmlib(")]
    assert requires == ["/usr/bin/python3.11"]
    assert set(query(packages.rpm, "[%{CONFLICTNAME}\\n]")) == {
        "nvidia-container-toolkit", "nvidia-container-runtime-hook", "libnvidia-container-tools",
        "nvidia-container-toolkit-base"}
    assert {"nvidia-container-toolkit", "nvidia-container-runtime-hook", "nvidia-container-toolkit-base"} <= set(
        query(packages.rpm, "[%{PROVIDENAME}\\n]"))
    # No Obsoletes: dnf would otherwise swap NVIDIA's package out on an upgrade and refuse it later.
    assert query(packages.rpm, "[%{OBSOLETENAME}\\n]") == []
    flags = dict(line.split(" ", 1)[::-1] for line in query(packages.rpm, "[%{FILEFLAGS:fflags} %{FILENAMES}\\n]"))
    assert set(flags["/etc/gpuhook/config.yaml"]) >= {"c", "n"}  # %config(noreplace)
    assert set(flags["/etc/logrotate.d/gpuhook"]) >= {"c", "n"}
    scripts = rpm("-qp", "--scripts", str(packages.rpm)).stdout
    for scriptlet in ("postinstall scriptlet", "preuninstall scriptlet", "postuninstall scriptlet"):
        assert scriptlet in scripts


def test_rpm_lists_the_same_files_as_the_deb(packages: Packages) -> None:
    """rpm -qpl and dpkg-deb -c agree (systemd and udev files under /usr/lib on RPM, /lib on Debian)."""
    listed = set(rpm("-qpl", str(packages.rpm)).stdout.split())
    assert {f"/usr/lib/systemd/system/{unit}" for unit in UNITS} <= listed  # gpuhookd's socket and service
    assert rpm_files(packages.rpm) <= listed
    assert rpm_files(packages.rpm) == deb_files(packages.deb)


def test_empty_root_install_and_erase(packages: Packages, tmp_path: Path) -> None:
    """rpm --root EMPTY -i --nodeps: every listed path, with its mode and link target; erase empties it."""
    root = tmp_path / "root"
    root.mkdir()
    rpm("--root", str(root), "-i", "--nodeps", "--noscripts", str(packages.rpm))
    assert rpm("--root", str(root), "-q", "gpuhook").stdout.strip() == f"gpuhook-{packages.version}-1.x86_64"
    rpm("--root", str(root), "-V", "--nodeps", "gpuhook")  # sizes, digests, modes, link targets
    entries = query(packages.rpm, "[%{FILEMODES:perms} %{FILENAMES} %{FILELINKTOS}\\n]")
    for entry in entries:
        perms, name, *target = entry.split(" ")
        path = root / name.lstrip("/")
        st = os.lstat(path)
        if perms.startswith("l"):  # a symlink's own mode means nothing on Linux
            assert stat.S_ISLNK(st.st_mode) and os.readlink(path) == target[0], name
        else:
            assert stat.filemode(st.st_mode) == perms, name
    assert os.readlink(root / "usr/lib/gpuhook/bin/python") == "/usr/bin/python3.11"
    assert (root / "usr/bin/gpuhook").resolve() == root / "usr/lib/gpuhook/bin/gpuhook" or \
        os.readlink(root / "usr/bin/gpuhook") == "/usr/lib/gpuhook/bin/gpuhook"
    owned_dirs = {e.split(" ")[1].lstrip("/") for e in entries if e.startswith("d")}
    rpm("--root", str(root), "-e", "--nodeps", "--noscripts", "gpuhook")
    # What is left are the parent directories rpm made for the package's paths without owning them
    # (/etc, /usr/bin, ...: on a real system they belong to the filesystem package), and rpm's db.
    parents = {str(Path(e.split(" ")[1]).parent).lstrip("/") for e in entries}
    parents |= {str(p) for d in list(parents) for p in Path(d).parents if str(p) != "."} | {"var", "var/lib"}
    snapshot = tree_snapshot(root)
    left = [p for p, row in snapshot.items()
            if not any(p == a or p.startswith(a + "/") for a in RPM_BOOKKEEPING)
            and not (row[0] == "d" and p in parents and p not in owned_dirs)]
    assert left == []
    assert not (root / "usr/lib/gpuhook").exists()


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory, packages: Packages, base_tarball, host: FakeHost,
              rootfs_src) -> InstalledRoot:
    """rpm --root DEBIAN_ROOT -i --nodeps, scriptlets included (run by rpm in a chroot of the root)."""
    chroot, bundles, before = install_root(tmp_path_factory, base_tarball, host, rootfs_src, "rpm", [])
    proc = rpm("--root", str(chroot.root), "-i", "--nodeps", str(packages.rpm))
    installed = InstalledRoot(chroot, host, bundles, rootfs_src, before, proc.stdout + proc.stderr)
    installed.point_config_at_host()
    return installed


def test_scriptlets_on_install(installed: InstalledRoot) -> None:
    """%post restarts nothing and says what to restart; the config check passes."""
    assert "No container engine was restarted" in installed.install_output
    assert "systemctl restart docker" in installed.install_output
    assert "gpuhookd.socket starts a warm daemon" in installed.install_output
    assert "WARNING" not in installed.install_output


def test_man_pages_and_logrotate(installed: InstalledRoot) -> None:
    """The man pages as packaging/man has them (and rendering cleanly); /etc/logrotate.d/gpuhook."""
    check_docs(installed)


def test_commands(installed: InstalledRoot, packages: Packages) -> None:
    """gpuhook --version and NVIDIA's names from the rpm's venv."""
    check_commands(installed, packages.version)


def test_info_on_the_simulated_host(installed: InstalledRoot) -> None:
    """gpuhook info through /etc/gpuhook/config.yaml."""
    check_info(installed)


def test_runc_gpu_container(installed: InstalledRoot) -> None:
    """A real `runc run` inside the root with the rpm's hook."""
    check_gpu_containers(installed)


def test_gpuhookd_units(installed: InstalledRoot) -> None:
    """gpuhookd.socket and gpuhookd.service are installed as the repository has them."""
    check_units(installed)


def test_runc_gpu_container_served_by_gpuhookd(installed: InstalledRoot, packages: Packages) -> None:
    """The rpm's gpuhookd, running in the root, does the GPU work of a real runc container's hook."""
    check_gpuhookd_container(installed, packages.version)


def test_upgrade_keeps_the_venv_and_config(installed: InstalledRoot, packages: Packages) -> None:
    """rpm -U --replacepkgs: %post with 2, the old %postun with 1 must not remove the new files; with
    systemd running, %post restarts a running gpuhookd and the old %preun (1) stops nothing."""
    config = (installed.root / "etc/gpuhook/config.yaml").read_text()
    with systemd_running(installed.root) as systemctl:
        rpm("--root", str(installed.root), "-U", "--replacepkgs", "--nodeps", str(packages.rpm))
        calls = systemctl.read_text().splitlines()
    assert "try-restart gpuhookd.service" in calls
    assert not [call for call in calls if "stop" in call.split() or "preset" in call.split()]
    assert (installed.root / "etc/gpuhook/config.yaml").read_text() == config
    check_commands(installed, packages.version)


def test_erase_leaves_nothing(installed: InstalledRoot) -> None:
    """rpm -e: files, the edited config (kept as .rpmsave, rpm's rule), log and cache handled."""
    root = installed.root
    with systemd_running(root) as systemctl:
        rpm("--root", str(root), "-e", "--nodeps", "gpuhook")
        calls = systemctl.read_text().splitlines()
    assert "stop gpuhookd.socket gpuhookd.service" in calls
    assert "--no-reload disable gpuhook-cdi-refresh.path gpuhook-cdi-refresh.service gpuhookd.socket" in calls
    # rpm keeps an edited %config(noreplace) file as .rpmsave: the admin's, not the package's.
    saved = root / "etc/gpuhook/config.yaml.rpmsave"
    assert saved.is_file()
    saved.unlink()
    (root / "etc/gpuhook").rmdir()
    left = changed(installed.before, tree_snapshot(root), RPM_BOOKKEEPING)
    assert left == []

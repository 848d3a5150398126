"""The .deb: built with nfpm, installed with apt into a clean Debian 12 root, used there, purged.

Inside the root: `gpuhook --version` and NVIDIA's names, `gpuhook info` against the simulated host,
real `runc run`s of a GPU container with the installed hook, one of them served by the installed
gpuhookd; gpuhookd.socket enabled, and restarted on upgrade when systemd runs; then `apt-get
remove` keeps only the conffile and `apt-get purge` leaves nothing of gpuhook (only dpkg's and
apt's own bookkeeping).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from integration.engines import tree_snapshot
from integration.fakehost import FakeHost

from .conftest import (
    MAN_PAGES,
    InstalledRoot,
    build_packages,
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
    package_paths,
    systemd_running,
)

#: what installing and purging any package changes outside the package's own files.
DPKG_BOOKKEEPING = ("var/lib/dpkg", "var/lib/apt", "var/cache/apt", "var/cache/debconf", "var/log/apt",
                    "var/log/dpkg.log", "var/log/alternatives.log")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory, packages: Packages, base_tarball, host: FakeHost,
              rootfs_src) -> InstalledRoot:
    """`apt-get install ./gpuhook_*.deb` in a fresh Debian 12 root, then its config aimed at the host."""
    dist = packages.deb.parent
    chroot, bundles, before = install_root(tmp_path_factory, base_tarball, host, rootfs_src, "deb", [dist])
    proc = chroot.run(f"cd {dist} && apt-get install -y --no-install-recommends ./{packages.deb.name}")
    installed = InstalledRoot(chroot, host, bundles, rootfs_src, before, proc.stdout + proc.stderr)
    installed.point_config_at_host()
    return installed


def test_deb_name_and_control(packages: Packages) -> None:
    """dist/gpuhook_<version>_<arch>.deb; depends on the interpreter package; replaces NVIDIA's."""
    assert packages.deb.name == f"gpuhook_{packages.version}_amd64.deb"
    fields = subprocess.run(["dpkg-deb", "-f", str(packages.deb)], capture_output=True, text=True,
                            check=True).stdout
    assert "Depends: python3.11\n" in fields
    for relation in ("Conflicts", "Replaces"):
        assert (f"{relation}: nvidia-container-toolkit, nvidia-container-runtime-hook, libnvidia-container-tools, "
                "nvidia-container-toolkit-base\n" in fields)
    assert ("Provides: nvidia-container-toolkit, nvidia-container-runtime-hook, nvidia-container-toolkit-base\n"
            in fields)
    conffiles = subprocess.run(["dpkg-deb", "-I", str(packages.deb), "conffiles"], capture_output=True, text=True,
                               check=True).stdout
    assert sorted(conffiles.split()) == ["/etc/gpuhook/config.yaml", "/etc/logrotate.d/gpuhook"]


def test_deb_contents(packages: Packages) -> None:
    """The files the issue lists, and the venv's python a symlink to the target's interpreter."""
    files = deb_files(packages.deb)
    assert {
        "/usr/bin/gpuhook", "/usr/bin/nvidia-container-runtime-hook", "/usr/bin/nvidia-container-toolkit",
        "/usr/bin/nvidia-container-cli", "/usr/bin/gpuhook-runtime", "/etc/gpuhook/config.yaml",
        "/usr/share/containers/oci/hooks.d/gpuhook.json", "/usr/share/containers/oci/hooks.d/gpuhook-poststop.json",
        "/usr/lib/systemd/system/gpuhook-cdi-refresh.path",
        "/usr/lib/systemd/system/gpuhook-cdi-refresh.service", "/usr/lib/udev/rules.d/71-gpuhook-cdi-refresh.rules",
        "/usr/lib/systemd/system/gpuhookd.socket", "/usr/lib/systemd/system/gpuhookd.service",
        "/usr/share/doc/gpuhook/changelog.gz", "/usr/bin/nvidia-ctk", "/etc/logrotate.d/gpuhook",
        *MAN_PAGES,
        "/usr/lib/gpuhook/bin/python", "/usr/lib/gpuhook/bin/gpuhook-hook", "/usr/lib/gpuhook/pyvenv.cfg",
        "/usr/lib/gpuhook/bin/gpuhook-relay", "/usr/lib/gpuhook/bin/gpuhook",
        "/usr/lib/gpuhook/libexec/nvidia-container-runtime-hook", "/usr/lib/gpuhook/bin/nvidia-container-runtime-hook",
        "/usr/bin/nvidia-container-runtime", "/usr/lib/gpuhook/libexec/gpuhook-runtime",
        "/usr/lib/gpuhook/libexec/nvidia-container-cli", "/usr/lib/gpuhook/bin/nvidia-container-cli",
        "/usr/lib/gpuhook/bin/gpuhook-runtime",
    } <= files
    assert not any("/pip/" in f or f.endswith("/activate") for f in files)
    assert any(f.endswith(".pyc") and "/gpuhook/cli/" in f for f in files)


def test_install_says_what_to_restart(installed: InstalledRoot) -> None:
    """The postinst restarts nothing, says what to restart, and enables the CDI refresh path unit and
    gpuhookd's socket (the service is started by the socket, so it has no link of its own)."""
    out = installed.install_output
    assert "Setting up gpuhook" in out
    assert "No container engine was restarted" in out
    assert "systemctl restart docker" in out
    assert "gpuhookd.socket starts a warm daemon" in out
    assert "WARNING" not in out  # the shipped config parses
    wants = installed.root / "etc/systemd/system/multi-user.target.wants/gpuhook-cdi-refresh.path"
    assert wants.is_symlink()
    socket = installed.root / "etc/systemd/system/sockets.target.wants/gpuhookd.socket"
    assert socket.readlink() == Path("/lib/systemd/system/gpuhookd.socket")
    assert not list((installed.root / "etc/systemd/system").rglob("gpuhookd.service"))


def test_gpuhookd_units(installed: InstalledRoot) -> None:
    """gpuhookd.socket and gpuhookd.service are installed as the repository has them."""
    check_units(installed)


def test_runc_gpu_container_served_by_gpuhookd(installed: InstalledRoot, packages: Packages) -> None:
    """The installed gpuhookd, running in the root, does the GPU work of a real runc container's hook."""
    check_gpuhookd_container(installed, packages.version)


def test_installed_files_match_the_package(installed: InstalledRoot, packages: Packages) -> None:
    """dpkg -L lists exactly the .deb's entries, and each is on disk."""
    listed = installed.chroot.run("dpkg-query -L gpuhook").stdout.split()
    for path in listed:
        assert (installed.root / path.lstrip("/")).exists() or (installed.root / path.lstrip("/")).is_symlink()
    files = {p for p in package_paths(listed) if not (installed.root / p.lstrip("/")).is_dir()
             or (installed.root / p.lstrip("/")).is_symlink()}
    assert files - {"/lib"} == deb_files(packages.deb)  # /lib: merged-usr's symlink, listed as the dir


def test_man_pages_and_logrotate(installed: InstalledRoot) -> None:
    """The man pages as packaging/man has them (and rendering cleanly); /etc/logrotate.d/gpuhook."""
    check_docs(installed)


def test_commands(installed: InstalledRoot, packages: Packages) -> None:
    """gpuhook --version, NVIDIA's names, from the private venv with no system site-packages."""
    check_commands(installed, packages.version)


def test_info_on_the_simulated_host(installed: InstalledRoot) -> None:
    """gpuhook info, configured through the installed /etc/gpuhook/config.yaml."""
    check_info(installed)


def test_runc_gpu_container(installed: InstalledRoot) -> None:
    """runc inside the root starts a GPU container with the hook as the package registers it."""
    venv = tree_snapshot(installed.root / "usr/lib/gpuhook")
    check_gpu_containers(installed)
    assert tree_snapshot(installed.root / "usr/lib/gpuhook") == venv  # no pyc or anything written at run time


def test_reinstall_keeps_the_edited_config(installed: InstalledRoot, packages: Packages) -> None:
    """An upgrade-style reinstall (prerm/postrm `upgrade`) keeps the venv and the admin's conffile; with
    systemd running, the postinst restarts a running gpuhookd (so it runs the new code) and nothing else."""
    config = (installed.root / "etc/gpuhook/config.yaml").read_text()
    dist = packages.deb.parent
    with systemd_running(installed.root) as systemctl:
        installed.chroot.run(f"cd {dist} && dpkg -i ./{packages.deb.name}")
        calls = systemctl.read_text().splitlines()
    assert "try-restart gpuhookd.service" in calls
    assert "start gpuhookd.socket" in calls and "--system daemon-reload" in calls
    assert not [call for call in calls if "stop" in call.split() or "docker" in call]
    assert (installed.root / "etc/gpuhook/config.yaml").read_text() == config
    check_info(installed)
    check_units(installed)


def test_remove_then_purge_leaves_nothing(installed: InstalledRoot) -> None:
    """remove keeps the (edited) conffile; purge removes it, the log, the cache, the unit links."""
    chroot, root = installed.chroot, installed.root
    # An engine configuration written by `gpuhook install`: the admin's, so only warned about.
    daemon_json = root / "etc/docker/daemon.json"
    daemon_json.parent.mkdir(parents=True)
    daemon_json.write_text('{"runtimes": {"gpuhook": {"path": "/usr/lib/gpuhook/bin/gpuhook-runtime"}}}\n')
    with systemd_running(root) as systemctl:
        removed = chroot.run("apt-get remove -y gpuhook")
        calls = systemctl.read_text().splitlines()
    assert "stop gpuhookd.socket gpuhookd.service" in calls  # the prerm: no daemon outlives the package
    said = removed.stdout + removed.stderr
    assert "/etc/docker/daemon.json" in said and "will fail once it is removed" in said
    assert "gpuhook-runtime" in daemon_json.read_text()
    daemon_json.unlink()
    daemon_json.parent.rmdir()
    assert not (root / "usr/bin/gpuhook").exists()
    assert not (root / "usr/lib/gpuhook").exists()
    assert (root / "etc/gpuhook/config.yaml").is_file()
    assert (root / "etc/systemd/system/sockets.target.wants/gpuhookd.socket").is_symlink()  # until the purge
    chroot.run("apt-get purge -y gpuhook")
    assert not (root / "etc/systemd/system/sockets.target.wants/gpuhookd.socket").is_symlink()
    left = changed(installed.before, tree_snapshot(root), DPKG_BOOKKEEPING)
    assert left == []
    status = chroot.run("dpkg-query -W -f='${db:Status-Abbrev}' gpuhook", check=False)
    assert status.returncode != 0 or status.stdout.strip() in ("", "un")


NVIDIA_LOOKALIKE = """\
name: nvidia-container-toolkit
arch: amd64
platform: linux
version: 1.17.8
release: "1"
maintainer: test <test@localhost>
description: stand-in with the name, files and relations of NVIDIA's package
deb:
  breaks: [nvidia-container-runtime-hook]
replaces: [nvidia-container-runtime-hook]
contents:
  - {src: HOOK, dst: /usr/bin/nvidia-container-runtime-hook, file_info: {mode: 0755}}
  - {src: /usr/bin/nvidia-container-runtime-hook, dst: /usr/bin/nvidia-container-toolkit, type: symlink}
  - {src: TOML, dst: /etc/nvidia-container-runtime/config.toml, type: config}
"""
#: NVIDIA's config.toml as a Kubernetes node has it: only the device plugin grants GPUs.
NVIDIA_CONFIG = """\
disable-require = false
accept-nvidia-visible-devices-envvar-when-unprivileged = false

[nvidia-container-cli]
load-kmods = true
ldconfig = "@/sbin/ldconfig"
"""


def test_switching_from_and_back_to_nvidia(tmp_path_factory: pytest.TempPathFactory, packages: Packages,
                                           base_tarball, host: FakeHost, rootfs_src) -> None:
    """apt swaps NVIDIA's nvidia-container-toolkit (a stand-in with its files and relations) for gpuhook
    and back, each way in one `apt-get install`, leaving the other's files in place; NVIDIA's config.toml
    (its conffile, kept on removal) becomes gpuhook's /etc/gpuhook/config.yaml on the way in."""
    work = tmp_path_factory.mktemp("nvidia-pkg")
    work.chmod(0o755)
    hook = work / "hook"
    hook.write_text("#!/bin/sh\necho NVIDIA hook\n")
    toml = work / "config.toml"
    toml.write_text(NVIDIA_CONFIG)
    config = work / "nfpm.yaml"
    config.write_text(NVIDIA_LOOKALIKE.replace("HOOK", str(hook)).replace("TOML", str(toml)))
    nvidia_deb = work / "nvidia-container-toolkit_1.17.8-1_amd64.deb"
    subprocess.run([build_packages.find_nfpm(), "package", "--config", str(config), "--packager", "deb",
                    "--target", str(nvidia_deb)], check=True, capture_output=True)
    dist = packages.deb.parent
    chroot, _, _ = install_root(tmp_path_factory, base_tarball, host, rootfs_src, "switch", [dist, work])
    apt = "apt-get install -y --no-install-recommends"
    chroot.run(f"cd {work} && {apt} ./{nvidia_deb.name}")
    assert "NVIDIA hook" in chroot.run("nvidia-container-toolkit prestart").stdout

    chroot.run(f"cd {dist} && {apt} ./{packages.deb.name}")
    out = chroot.run("dpkg-query -W -f='${Package} ${db:Status-Abbrev}\\n' gpuhook nvidia-container-toolkit; "
                     "nvidia-container-toolkit -version", check=False).stdout
    assert "gpuhook ii" in out and "nvidia-container-toolkit ii" not in out
    assert "(nvidia-container-runtime-hook compatible)" in out
    imported = (chroot.root / "etc/gpuhook/config.yaml").read_text()
    assert "accept_envvar_when_unprivileged: false" in imported and "load_kmods: true" in imported, imported

    chroot.run(f"cd {work} && {apt} ./{nvidia_deb.name}")
    out = chroot.run("dpkg-query -W -f='${Package} ${db:Status-Abbrev}\\n' gpuhook nvidia-container-toolkit; "
                     "nvidia-container-toolkit prestart", check=False).stdout
    assert "nvidia-container-toolkit ii" in out and "gpuhook ii" not in out
    assert "NVIDIA hook" in out
    assert not (chroot.root / "usr/lib/gpuhook").exists()

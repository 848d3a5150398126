"""Corpus A: mount destinations and path resolution in a hostile rootfs (security.md §4 A1-A16)."""

from __future__ import annotations

import itertools
import os
import shutil
import stat
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .rig import GPU0, GPU_PROBE, LIBS_DIR, Outcome, Rig

LIBCUDA = "libcuda.so.550.54.15"


def replace_with_symlink(rootfs: Path, rel: str, target: str) -> None:
    """Replace the image's *rel* (file or dir) by a symlink to *target*."""
    path = rootfs / rel
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    path.symlink_to(target)


def refused_or_gpu(rig: Rig, outcome: Outcome, path: str, libs_dir: str) -> None:
    """Either a clean refusal naming *path*, or a working GPU 0 with libraries confined at *libs_dir*."""
    if outcome.started:
        rig.check_gpu(outcome, [0], libs_dir=libs_dir)
    else:
        outcome.assert_refused(path)


@pytest.fixture
def deep_trees() -> Iterator[list[Path]]:
    """Very deep directory chains to delete after the test (shutil.rmtree recurses, rm -rf does not)."""
    trees: list[Path] = []
    yield trees
    for tree in trees:
        subprocess.run(["rm", "-rf", "--one-file-system", "--", str(tree)], check=True)


def deep_chain(base: Path, depth: int, link: str | None = None) -> str:
    """Create *depth* nested ``d`` dirs under *base*, plus ``next -> link`` at the bottom; returns the rel path."""
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        if link is not None:
            os.symlink(link, "next", dir_fd=fd)
    finally:
        os.close(fd)
    return "/".join(["d"] * depth)


# --- A1/A2: symlinked library directory ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "libs_at"),
    [
        pytest.param("absolute-to-marker", "victim", id="A1-absolute-to-host-marker-dir"),
        pytest.param("absolute-etc", "/etc", id="A1-absolute-to-etc"),
        pytest.param("relative-to-marker", "/host/victim", id="A2-relative-dotdot-to-host-marker-dir"),
        pytest.param("relative-etc", "/etc", id="A2-relative-dotdot-chain-to-etc"),
    ],
)
def test_symlinked_lib_dir_is_confined(rig: Rig, kind: str, libs_at: str) -> None:
    """A1/A2: a lib dir symlinked at a host path (absolute or ``../``) gets the libraries inside R; dlopen works."""
    if libs_at == "victim":
        libs_at = str(rig.victim)
    rel_marker = os.path.relpath(rig.victim, rig.tmp / "bundleN/rootfs/usr/lib")
    target = {"absolute-to-marker": str(rig.victim), "absolute-etc": "/etc",
              "relative-to-marker": rel_marker, "relative-etc": "../../../../../../../../etc"}[kind]
    container = rig.container(GPU0, GPU_PROBE,
                              prepare=lambda r: replace_with_symlink(r, LIBS_DIR.lstrip("/"), target))
    outcome = rig.run(container, watch=[Path("/etc")])
    rig.check_gpu(outcome, [0], libs_dir=libs_at)
    assert (container.rootfs / libs_at.lstrip("/") / LIBCUDA).is_file()
    assert sorted(p.name for p in rig.victim.iterdir()) == ["marker"]


# --- A4: loops and long chains ----------------------------------------------------------------------


def test_symlink_loop_on_lib_path_is_refused(rig: Rig) -> None:
    """A4: a symlink loop ``usr/lib -> lib2 -> lib`` on the lib path is refused with ELOOP, quickly."""
    def prepare(rootfs: Path) -> None:
        replace_with_symlink(rootfs, "usr/lib", "lib2")
        (rootfs / "usr/lib2").symlink_to("lib")

    outcome = rig.run(rig.container(GPU0, prepare=prepare), timeout=10)
    outcome.assert_refused(LIBS_DIR, os.strerror(40))


def _chain(rootfs: Path, links: int) -> None:
    """Reach the lib dir through exactly *links* symlinks: lib dir -> /c1 -> ... -> /real."""
    (rootfs / "real").mkdir()
    hops = [f"/c{i}" for i in range(1, links)] + ["/real"]
    replace_with_symlink(rootfs, LIBS_DIR.lstrip("/"), hops[0])
    for here, there in itertools.pairwise(hops):
        (rootfs / here.lstrip("/")).symlink_to(there)


def test_forty_link_chain_still_works(rig: Rig) -> None:
    """A4: a 40-symlink chain to the lib dir (the kernel's limit) is legitimate: the libraries land in its target."""
    container = rig.container(GPU0, "devopen /dev/nvidia0; ls /real", prepare=lambda r: _chain(r, 40))
    outcome = rig.run(container)
    rig.check_gpu(outcome, [0], libs_dir="/real", probe=False)
    assert {"/dev/nvidia0 ENXIO", LIBCUDA} <= outcome.stdout


def test_forty_one_link_chain_is_refused(rig: Rig) -> None:
    """A4: 41 symlinks to the lib dir exceed the kernel's limit: refused with ELOOP, never resolved on the host."""
    outcome = rig.run(rig.container(GPU0, prepare=lambda r: _chain(r, 41)), timeout=10)
    outcome.assert_refused(LIBS_DIR, os.strerror(40))


# --- A5-A7: /dev ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("relative", [False, True], ids=["A5-dev-absolute-to-host-marker", "A5-dev-relative-dotdot"])
def test_symlinked_dev_is_refused(rig: Rig, relative: bool) -> None:
    """A5: an image /dev symlinked to a host dir holding ``ptmx`` and ``nvidia0`` is refused; that dir is intact."""
    # The symlink is planted by an earlier prestart hook, after runc set up /dev: runc 1.1.5 itself
    # writes through an image's symlinked /dev (ptmx, fd, stdin...; runc CVE-2026-41579), so a
    # symlink present from the start would test runc, not gpuhook. Renaming the dir away in the
    # host namespace detaches runc's /dev tmpfs in the container's, as a shared volume could.
    target = "../../host/hostdev" if relative else str(rig.hostdev)
    container = rig.container(GPU0, pre_hook=f'mv "$R/dev" "$R/dev.image" && ln -s "{target}" "$R/dev"')
    outcome = rig.run(container)
    outcome.assert_refused("/dev")
    assert sorted(p.name for p in rig.hostdev.iterdir()) == ["nvidia0", "ptmx"]
    assert (container.rootfs / "dev").readlink() == Path(target)


@pytest.mark.parametrize("relative", [False, True], ids=["A6-absolute", "A6-relative-dotdot"])
def test_dev_node_planted_as_symlink_to_host_file_is_refused(rig: Rig, relative: bool) -> None:
    """A pre-planted ``/dev/nvidia0 -> <host file>`` is never followed (no chmod, no mount, no mknod there)."""
    target = "../../../host/secret" if relative else str(rig.secret)
    container = rig.container(GPU0, dev_tmpfs=False, prepare=lambda r: (r / "dev/nvidia0").symlink_to(target))
    outcome = rig.run(container)
    outcome.assert_refused("/dev/nvidia0")
    assert (container.rootfs / "dev/nvidia0").readlink() == Path(target)


def _plant_node(kind: str) -> Callable[[Path], None]:
    """A preparer planting ``/dev/nvidia0`` as *kind*."""
    modes = {"regular-file": (stat.S_IFREG, 0), "fifo": (stat.S_IFIFO, 0), "socket": (stat.S_IFSOCK, 0),
             "dev-mem-c1:1": (stat.S_IFCHR, os.makedev(1, 1)), "other-gpu-c195:1": (stat.S_IFCHR, os.makedev(195, 1)),
             "identical-c195:0": (stat.S_IFCHR, os.makedev(195, 0))}

    def prepare(rootfs: Path) -> None:
        kind_bits, rdev = modes[kind]
        os.mknod(rootfs / "dev/nvidia0", kind_bits | 0o666, rdev)
        os.chmod(rootfs / "dev/nvidia0", 0o666)

    return prepare


@pytest.mark.parametrize("kind", ["regular-file", "fifo", "socket", "dev-mem-c1:1", "other-gpu-c195:1"])
def test_dev_node_planted_as_wrong_inode_is_refused(rig: Rig, kind: str) -> None:
    """A7: a pre-planted ``/dev/nvidia0`` that is not exactly ``c 195:0`` is refused (never reused, never opened)."""
    outcome = rig.run(rig.container(GPU0, dev_tmpfs=False, prepare=_plant_node(kind)), timeout=10)
    outcome.assert_refused("/dev/nvidia0")


def test_dev_node_planted_identical_is_accepted(rig: Rig) -> None:
    """A7: an image that already has the very node ``c 195:0`` gets GPU 0 as usual."""
    outcome = rig.run(rig.container(GPU0, GPU_PROBE, dev_tmpfs=False, prepare=_plant_node("identical-c195:0")))
    rig.check_gpu(outcome, [0])


# --- A8-A10: wrong file types and dangling destinations --------------------------------------------------


@pytest.mark.parametrize(
    "path",
    ["/usr/bin/nvidia-smi", f"{LIBS_DIR}/{LIBCUDA}"],
    ids=["A8-dir-at-nvidia-smi", "A8-dir-at-libcuda"],
)
def test_directory_where_a_file_is_mounted_is_refused(rig: Rig, path: str) -> None:
    """A directory at a file mount destination is refused; nothing is mounted over it or created through it."""
    def prepare(rootfs: Path) -> None:
        (rootfs / path.lstrip("/")).mkdir()
        (rootfs / path.lstrip("/") / "inside").write_text("image\n")

    container = rig.container(GPU0, prepare=prepare)
    outcome = rig.run(container)
    outcome.assert_refused(path, "not a regular file")
    assert [p.name for p in (container.rootfs / path.lstrip("/")).iterdir()] == ["inside"]


@pytest.mark.parametrize(
    ("path", "plant"),
    [
        pytest.param("/run/nvidia-persistenced", "file", id="A9-persistenced-dir-is-a-file"),
        pytest.param("proc/driver/nvidia", "file", id="A9-proc-driver-nvidia-is-a-file"),
        pytest.param("proc/driver/nvidia", "symlink-to-root", id="A9-proc-driver-nvidia-symlink-to-root"),
    ],
)
def test_file_or_symlink_where_a_directory_is_expected_is_refused(rig: Rig, path: str, plant: str) -> None:
    """A file or a symlink to ``/`` where gpuhook needs a directory is refused (no proc mount in the spec)."""
    def prepare(rootfs: Path) -> None:
        where = rootfs / path.lstrip("/")
        where.parent.mkdir(parents=True, exist_ok=True)
        if plant == "file":
            where.write_text("image\n")
        else:
            where.symlink_to("/")

    outcome = rig.run(rig.container(GPU0, prepare=prepare, proc=False))
    outcome.assert_refused(path)


@pytest.mark.parametrize("dest", ["absolute-nonexistent", "relative-to-host-new"],
                         ids=["A10-to-nonexistent", "A10-dotdot-to-host-NEW"])
def test_dangling_symlink_destination_is_refused(rig: Rig, dest: str) -> None:
    """``/usr/bin/nvidia-smi`` as a dangling symlink is refused; nothing is created at its target (host or R)."""
    target = "/nonexistent/x" if dest == "absolute-nonexistent" else os.path.relpath(
        rig.outside / "NEW", rig.tmp / "bundleN/rootfs/usr/bin")
    container = rig.container(GPU0, prepare=lambda r: replace_with_symlink(r, "usr/bin/nvidia-smi", target))
    outcome = rig.run(container)
    outcome.assert_refused("/usr/bin/nvidia-smi")
    assert not (rig.outside / "NEW").exists() and not (container.rootfs / "nonexistent").exists()


# --- A14-A16 -------------------------------------------------------------------------------------------


def test_overlong_component_on_lib_path(rig: Rig) -> None:
    """A14: the lib dir pointing through a 300-byte component is refused cleanly (ENAMETOOLONG), in bounded time."""
    target = "/x/" + "a" * 300 + "/lib"
    outcome = rig.run(rig.container(GPU0, prepare=lambda r: replace_with_symlink(r, LIBS_DIR.lstrip("/"), target)),
                      timeout=10)
    outcome.assert_refused(os.strerror(36))
    assert LIBS_DIR in outcome.hook_error or "a" * 300 in outcome.hook_error, outcome.hook_error


@pytest.mark.parametrize("hops", [1, 2], ids=["A14-1500-deep-dirs", "A14-3000-deep-dirs-6000-byte-path"])
def test_very_deep_lib_path(rig: Rig, deep_trees: list[Path], hops: int) -> None:
    """A14: a lib dir 1500 (or 2x1500, a 6000-byte resolved path) directories deep is confined or refused cleanly."""
    depth = 1500
    bottom = ""

    def prepare(rootfs: Path) -> None:
        nonlocal bottom
        link = None
        for hop in reversed(range(hops)):  # build the last hop first: each bottom links to the next hop
            top = rootfs / f"deep{hop}"
            top.mkdir()
            deep_trees.append(top)
            has_next = link is not None
            path = f"/deep{hop}/" + deep_chain(top, depth, link)
            bottom = bottom or path
            link = path + "/next" if has_next else path
        replace_with_symlink(rootfs, LIBS_DIR.lstrip("/"), link or "")

    outcome = rig.run(rig.container(GPU0, GPU_PROBE, prepare=prepare), timeout=15)
    refused_or_gpu(rig, outcome, LIBS_DIR, bottom)


ODD_NAMES = [b"lib\xffodd.so.1", b"lib\nnewline.so.1", b"lib::colons.so.1", b"-rf.so.1", b"lib%s%n.so.1"]


def _odd_names(rootfs: Path) -> None:
    """Names with odd bytes in the lib dir and in ld.so.conf.d (files, conf lines and dirs)."""
    libdir = os.fsencode(rootfs / LIBS_DIR.lstrip("/"))
    libm = (rootfs / "lib/x86_64-linux-gnu/libm.so.6").read_bytes()
    for i, name in enumerate(ODD_NAMES):
        with open(os.path.join(libdir, name), "wb") as handle:
            handle.write(libm if i % 2 else b"")
    dirs = [b"/opt/\xff", b"/opt/a::b", b"-x", b"/opt/%n%n", b"/opt/line\nbreak"]
    for d in dirs:
        os.makedirs(os.fsencode(rootfs) + b"/" + d.lstrip(b"/"), exist_ok=True)
    conf = os.fsencode(rootfs / "etc/ld.so.conf.d")
    with open(os.path.join(conf, b"odd\xff::-.conf"), "wb") as handle:
        handle.write(b"\n".join(dirs) + b"\n")
    with open(os.path.join(conf, b"-rf.conf"), "wb") as handle:
        handle.write(b"include /etc/ld.so.conf.d/\xff*.conf\n--help\n")


def test_odd_bytes_in_names(rig: Rig) -> None:
    """A15: ``\\xff``, newlines, ``::``, ``%n``, leading dashes in lib names and ld.so.conf.d: the GPU still works."""
    outcome = rig.run(rig.container(GPU0, GPU_PROBE, prepare=_odd_names))
    if outcome.started:
        rig.check_gpu(outcome, [0])
    else:
        outcome.assert_refused()


def test_shared_rootfs_propagation(rig: Rig) -> None:
    """A16: ``rootfsPropagation: shared`` leaks no gpuhook mount to the host (o3); refusing it is acceptable."""
    def edit(spec: dict[str, object]) -> None:
        spec["linux"]["rootfsPropagation"] = "shared"  # type: ignore[index]

    outcome = rig.run(rig.container(GPU0, GPU_PROBE, edit_spec=edit))
    if outcome.started:
        rig.check_gpu(outcome, [0])
    else:
        outcome.assert_refused("propagation")

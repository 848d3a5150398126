"""gpuhook's own ld.so.cache against the host's ldconfig, on the same trees (root: ldconfig -r chroots).

Each layout is built twice; the host's ldconfig runs on one (``ldconfig -r``, as the sandbox runs
it chrooted), ``write_ldcache`` on the other; the caches must be byte-equal and the trees must hold
the same links (ldconfig makes SONAME links and removes stale ones). ldconfig's auxiliary cache
(``/var/cache/ldconfig``) is the one thing written only by ldconfig.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuhook.apply.ldelf import read_library, sample_library
from gpuhook.apply.ldprofile import ask, links_in, sample_tree
from gpuhook.apply.ldwrite import LdconfigProfile, hidden_devices, write_ldcache
from gpuhook.apply.rootfs import RootFs
from gpuhook.errors import ApplyError
from gpuhook.ldcache import parse_ldcache

LDCONFIG = Path("/sbin/ldconfig")
HOST_LIBS = Path("/lib/x86_64-linux-gnu")
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="ldconfig -r chroots: needs root")

Layout = Callable[[Path], None]


@pytest.fixture(scope="module")
def profile() -> LdconfigProfile:
    answer = ask(LDCONFIG)
    assert answer.profile is not None, answer.why_not
    return answer.profile


def _put(root: Path, rel: str, data: bytes) -> None:
    path = root / rel.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _link(root: Path, rel: str, target: str) -> None:
    path = root / rel.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)


def _host_lib(root: Path, rel: str, name: str) -> None:
    """A copy of one of the host's real libraries (real ELF notes, sonames, sizes)."""
    _put(root, rel, (HOST_LIBS / name).resolve().read_bytes())


def _glibc(root: Path, libdir: str) -> None:
    for name in ("libc.so.6", "libm.so.6", "ld-linux-x86-64.so.2"):
        _host_lib(root, f"{libdir}/{name}", name)
    _host_lib(root, f"{libdir}/libz.so.1.2.13", "libz.so.1")
    _link(root, f"{libdir}/libz.so", "libz.so.1")


def debian_multiarch(root: Path) -> None:
    _glibc(root, "/lib/x86_64-linux-gnu")
    _put(root, "/etc/ld.so.conf", b"include /etc/ld.so.conf.d/*.conf\n\n")
    _put(root, "/etc/ld.so.conf.d/libc.conf", b"# libc default configuration\n/usr/local/lib\n")
    _put(root, "/etc/ld.so.conf.d/x86_64-linux-gnu.conf",
         b"# Multiarch support\n/usr/local/lib/x86_64-linux-gnu\n/lib/x86_64-linux-gnu\n/usr/lib/x86_64-linux-gnu\n")
    _put(root, "/usr/lib/x86_64-linux-gnu/libfoo.so.2.4.1", sample_library(b"libfoo.so.2", needed=(b"libc.so.6",)))
    (root / "usr/local/lib").mkdir(parents=True)


def rhel_lib64(root: Path) -> None:
    _glibc(root, "/usr/lib64")
    _link(root, "/lib64", "usr/lib64")
    _link(root, "/lib", "usr/lib")
    (root / "usr/lib").mkdir(parents=True)
    _put(root, "/etc/ld.so.conf", b"include ld.so.conf.d/*.conf\n")
    _put(root, "/etc/ld.so.conf.d/dyninst-x86_64.conf", b"/usr/lib64/dyninst\n")
    _put(root, "/usr/lib64/dyninst/libdyn.so.12.1", sample_library(b"libdyn.so.12"))
    _put(root, "/etc/ld.so.conf.d/cuda.conf", b"/usr/local/cuda/targets/x86_64-linux/lib\n")
    _put(root, "/usr/local/cuda/targets/x86_64-linux/lib/libcudart.so.12.4.127", sample_library(b"libcudart.so.12"))
    _link(root, "/usr/local/cuda/targets/x86_64-linux/lib/libcudart.so", "libcudart.so.12")


def merged_usr(root: Path) -> None:
    _glibc(root, "/usr/lib/x86_64-linux-gnu")
    for top in ("lib", "lib64", "bin", "sbin"):
        _link(root, f"/{top}", f"usr/{top}")
    (root / "usr/lib64").mkdir(parents=True)
    _link(root, "/usr/lib64/ld-linux-x86-64.so.2", "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2")
    _put(root, "/etc/ld.so.conf", b"include /etc/ld.so.conf.d/*.conf\n")
    _put(root, "/etc/ld.so.conf.d/x86_64-linux-gnu.conf", b"/lib/x86_64-linux-gnu\n/usr/lib/x86_64-linux-gnu\n")


def hwcaps(root: Path) -> None:
    debian_multiarch(root)
    lib = "/usr/lib/x86_64-linux-gnu"
    for level, bit in (("x86-64-v2", 1), ("x86-64-v3", 2), ("x86-64-v4", 3)):
        _put(root, f"{lib}/glibc-hwcaps/{level}/libfoo.so.2.4.1", sample_library(b"libfoo.so.2", isa_needed=1 << bit))
    (root / lib.lstrip("/") / "glibc-hwcaps/x86-64-v5").mkdir()
    _put(root, f"{lib}/glibc-hwcaps/.hidden/libfoo.so.2", sample_library(b"libfoo.so.2"))
    _put(root, f"{lib}/glibc-hwcaps/bad:name/libfoo.so.2", sample_library(b"libfoo.so.2"))
    _put(root, f"{lib}/haswell/libfoo.so.2", sample_library(b"libfoo.so.2"))
    _put(root, f"{lib}/x86_64/tls/libfoo.so.2", sample_library(b"libfoo.so.2"))
    _put(root, f"{lib}/tls/libbar.so.1", sample_library(b"libbar.so.1"))
    _link(root, f"{lib}/avx512_1", "haswell")


def empty(root: Path) -> None:
    _put(root, "/etc/ld.so.conf", b"")


def missing_conf(root: Path) -> None:
    (root / "etc").mkdir()
    _glibc(root, "/lib/x86_64-linux-gnu")


def odd_entries(root: Path) -> None:
    """Versions, links (stale, to directories, escaping the root), non-libraries, a FIFO."""
    debian_multiarch(root)
    lib = "/usr/lib/x86_64-linux-gnu"
    for version in ("1.2", "1.10", "1.9.9"):
        _put(root, f"{lib}/libver.so.{version}", sample_library(b"libver.so.1"))
    _link(root, f"{lib}/libver.so.1", "libver.so.1.2")  # repointed to the newest
    _link(root, f"{lib}/libstale.so.3", "libgone.so.3.0")  # removed
    _link(root, f"{lib}/libstale.so", "libgone.so")  # not *.so.*: kept
    _link(root, f"{lib}/libescape.so.1", "/../../../../../lib/x86_64-linux-gnu/libc.so.6")  # stays in the root
    _link(root, f"{lib}/libdir.so.1", "/etc")
    _put(root, f"{lib}/libempty.so.1", b"")
    _put(root, f"{lib}/libtiny.so.1", b"\x7fELF")
    _put(root, f"{lib}/libtrunc.so.1", sample_library(b"libtrunc.so.1")[:100])
    _put(root, f"{lib}/libc.so", b"/* GNU ld script */\nOUTPUT_FORMAT(elf64-x86-64)\nGROUP ( libc.so.6 )\n")
    _put(root, f"{lib}/libsoname-only.so", sample_library(b"libsoname-only.so.4"))
    _put(root, f"{lib}/libfile.so.7", sample_library(b"libreal.so.7"))
    _put(root, f"{lib}/libprelinked.so.1.#prelink#.ab12cd", sample_library(b"libprelinked.so.1"))
    _put(root, f"{lib}/lib32.so.1", sample_library(b"lib32.so.1", bits=32, needed=(b"libc.so.6",)))
    _put(root, f"{lib}/notes.txt", b"not a library" * 10)
    os.mkfifo(root / lib.lstrip("/") / "libfifo.so.1")  # a FIFO itself is never opened by either
    # Debian's ldconfig leaves a loader's link alone, even where a newer file has its SONAME
    _put(root, f"{lib}/ld-2.36.so", sample_library(b"ld-linux-x86-64.so.2"))
    _put(root, f"{lib}/ld-2.99.so", sample_library(b"ld-linux-x86-64.so.2"))
    _link(root, f"{lib}/ld-linux-x86-64.so.2", "ld-2.36.so")
    _put(root, "/etc/ld.so.conf.d/weird.conf", b"  \t# only a comment\n/opt/a//\ninclude\n/opt/b=libc5\n"
                                                b"/opt/c=nonsense\nHWCAP 1 nosegneg\n/opt/a\x00ignored\n")
    _put(root, "/opt/a/liba.so.1", sample_library(b"liba.so.1"))
    _put(root, "/opt/b/libb.so.1", sample_library(b"libb.so.1", bits=32))
    _put(root, "/opt/c/libc-other.so.1", sample_library(b"libc-other.so.1", bits=32))


def slashed_sonames(root: Path) -> None:
    """SONAMEs with slashes: each link goes where its name leads from the library's directory, inside the
    root however many ``..`` it has (ldconfig -r's chroot), replacing a link there, or nowhere."""
    debian_multiarch(root)
    lib = "/usr/lib/x86_64-linux-gnu"
    climb = "../" * 12  # from the library directory, past the root
    (root / lib.lstrip("/") / "sub").mkdir()
    (root / "opt/escaped").mkdir(parents=True)
    _put(root, f"{lib}/libsub.so.1.0", sample_library(b"sub/libsub.so.1"))
    _put(root, f"{lib}/libup.so.2.0", sample_library(b"../libup.so.2"))
    _put(root, f"{lib}/libout.so.1.0", sample_library(f"{climb}opt/escaped/libout.so.1".encode()))
    _link(root, "/opt/escaped/libold.so.3", "elsewhere.so.3")
    _put(root, f"{lib}/libold.so.3.0", sample_library(f"{climb}opt/escaped/libold.so.3".encode()))
    _put(root, f"{lib}/libdots.so.1", sample_library(b"sub/.."))
    _put(root, f"{lib}/libdotdot.so.1", sample_library(b".."))
    _put(root, f"{lib}/libnodir.so.1.0", sample_library(b"nodir/libnodir.so.1"))
    _put(root, f"{lib}/libabs.so.1.0", sample_library(b"/opt/escaped/libabs.so.1"))


def sample(root: Path) -> None:
    sample_tree(root, (b"/lib/x86_64-linux-gnu", b"/usr/lib/x86_64-linux-gnu"))


def host_rootfs_libs(root: Path) -> None:
    """Every regular library of the host's multiarch directory (hundreds of real ELF files)."""
    _put(root, "/etc/ld.so.conf", b"/usr/lib/x86_64-linux-gnu\n")
    target = root / "usr/lib/x86_64-linux-gnu"
    target.mkdir(parents=True)
    for entry in os.scandir(HOST_LIBS):
        if entry.is_symlink() or not entry.is_file() or ".so" not in entry.name:
            continue
        os.link(entry.path, target / entry.name) if _same_fs(HOST_LIBS, target) else shutil.copy(entry.path, target)


def _same_fs(a: Path, b: Path) -> bool:
    return a.stat().st_dev == b.stat().st_dev


LAYOUTS: dict[str, Layout] = {
    "debian-multiarch": debian_multiarch, "rhel-lib64": rhel_lib64, "merged-usr": merged_usr, "hwcaps": hwcaps,
    "empty": empty, "missing-ld.so.conf": missing_conf, "odd-entries": odd_entries, "sample": sample,
    "slashed-sonames": slashed_sonames,
}


@pytest.fixture
def twin(tmp_path: Path) -> Iterator[Callable[[Layout], tuple[Path, Path]]]:
    def make(layout: Layout) -> tuple[Path, Path]:
        theirs, ours = tmp_path / "theirs", tmp_path / "ours"
        for root in (theirs, ours):
            root.mkdir()
            layout(root)
        return theirs, ours
    yield make


def _their_cache(root: Path, dirs: tuple[str, ...]) -> bytes:
    subprocess.run([str(LDCONFIG), "-r", str(root), "-f", "/etc/ld.so.conf", "-C", "/etc/ld.so.cache", *dirs],
                   check=True, env={"LC_ALL": "C"}, capture_output=True, timeout=60)
    return (root / "etc/ld.so.cache").read_bytes()


def _our_cache(root: Path, dirs: tuple[str, ...], profile: LdconfigProfile) -> tuple[bytes, RootFs]:
    fs = RootFs(os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
    write_ldcache(fs, dirs, profile, hidden_devices(fs), deadline=time.monotonic() + 60)
    return (root / "etc/ld.so.cache").read_bytes(), fs


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("dirs", [(), ("/usr/lib/x86_64-linux-gnu", "/opt/driver/lib")], ids=["conf", "cmdline"])
def test_the_cache_and_links_equal_ldconfigs(name: str, dirs: tuple[str, ...], twin, profile: LdconfigProfile) -> None:
    theirs, ours = twin(LAYOUTS[name])
    for root in (theirs, ours):
        if dirs:
            _put(root, "/opt/driver/lib/libcuda.so.550.54.15", sample_library(b"libcuda.so.1"))
    expected = _their_cache(theirs, dirs)
    got, _ = _our_cache(ours, dirs, profile)
    assert parse_ldcache(got) == parse_ldcache(expected)
    assert got == expected
    assert links_in(ours) == links_in(theirs)


def test_hundreds_of_real_libraries(twin, profile: LdconfigProfile) -> None:
    theirs, ours = twin(host_rootfs_libs)
    expected = _their_cache(theirs, ())
    got, _ = _our_cache(ours, (), profile)
    assert len(parse_ldcache(got)) > 100
    assert got == expected


def test_an_undo_puts_every_link_and_the_cache_back(tmp_path: Path, profile: LdconfigProfile) -> None:
    odd_entries(tmp_path)
    _put(tmp_path, "/etc/ld.so.cache", b"the image's own cache")
    before = links_in(tmp_path)
    fs = RootFs(os.open(tmp_path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
    fs.save_aside("/etc/ld.so.cache")
    fs.save_aside("/etc/ld.so.cache~")
    write_ldcache(fs, (), profile, frozenset(), deadline=time.monotonic() + 60)
    assert links_in(tmp_path) != before  # links were made and a stale one removed
    assert fs.rollback() == []
    assert links_in(tmp_path) == before
    assert (tmp_path / "etc/ld.so.cache").read_bytes() == b"the image's own cache"
    assert not (tmp_path / "etc/ld.so.cache~").exists()


def test_a_fifo_or_device_where_libraries_are_read_is_never_opened(tmp_path: Path, profile: LdconfigProfile) -> None:
    """A FIFO named by a library link, by an include and at the temporary cache name: nothing blocks
    (ldconfig itself would hang on each; its sandbox covers them with empty files)."""
    debian_multiarch(tmp_path)
    lib = tmp_path / "usr/lib/x86_64-linux-gnu"
    os.mkfifo(lib / "fifo")
    (lib / "libfifo.so.1").symlink_to("fifo")
    os.mkfifo(tmp_path / "etc/ld.so.conf.d/fifo.conf")
    os.mkfifo(tmp_path / "etc/ld.so.cache~")
    os.mknod(lib / "libnull.so.1", stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null's numbers
    (lib / "libnode.so.1").symlink_to("libnull.so.1")
    done = threading.Event()
    result: list[object] = []

    def run() -> None:
        fs = RootFs(os.open(tmp_path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
        result.append(write_ldcache(fs, (), profile, frozenset(), deadline=time.monotonic() + 60))
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(60), "write_ldcache blocked on a FIFO"
    names = {e.key for e in parse_ldcache((tmp_path / "etc/ld.so.cache").read_bytes())}
    assert "libfoo.so.2" in names and "libfifo.so.1" not in names and "libnode.so.1" not in names


def test_the_rootfs_dev_proc_and_sys_read_as_empty(tmp_path: Path, profile: LdconfigProfile) -> None:
    """What is mounted at the rootfs's /dev (runc's tmpfs) is not scanned, as the sandbox hid it."""
    debian_multiarch(tmp_path)
    dev = tmp_path / "dev"
    dev.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "none", str(dev)], check=True)
    try:
        _put(tmp_path, "/dev/lib/libplanted.so.1", sample_library(b"libplanted.so.1"))
        _put(tmp_path, "/etc/ld.so.conf.d/dev.conf", b"/dev/lib\ninclude /dev/lib/*.conf\n")
        _put(tmp_path, "/dev/lib/x.conf", b"/opt/never\n")
        _put(tmp_path, "/opt/never/libnever.so.1", sample_library(b"libnever.so.1"))
        _link(tmp_path, "/usr/lib/x86_64-linux-gnu/libvia.so.1", "/dev/lib/libplanted.so.1")
        fs = RootFs(os.open(tmp_path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
        hidden = hidden_devices(fs)
        assert os.stat(dev).st_dev in hidden
        write_ldcache(fs, (), profile, hidden, deadline=time.monotonic() + 60)
        names = {e.key for e in parse_ldcache((tmp_path / "etc/ld.so.cache").read_bytes())}
        assert names.isdisjoint({"libplanted.so.1", "libnever.so.1", "libvia.so.1"}), names
        assert "libfoo.so.2" in names
    finally:
        subprocess.run(["umount", str(dev)], check=True)


def test_no_etc_to_write_into_is_ldconfigs_error(tmp_path: Path, profile: LdconfigProfile) -> None:
    fs = RootFs(os.open(tmp_path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
    with pytest.raises(ApplyError, match="ldconfig cannot create its temporary cache file either"):
        write_ldcache(fs, (), profile, frozenset(), deadline=time.monotonic() + 60)


def test_an_include_loop_ends(tmp_path: Path, profile: LdconfigProfile) -> None:
    _put(tmp_path, "/etc/ld.so.conf", b"include /etc/ld.so.conf\n/opt/x\n")
    _put(tmp_path, "/opt/x/libx.so.1", sample_library(b"libx.so.1"))
    fs = RootFs(os.open(tmp_path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
    assert write_ldcache(fs, (), profile, frozenset(), deadline=time.monotonic() + 60) == 1


def test_a_start_past_its_deadline_stops_scanning(tmp_path: Path, profile: LdconfigProfile) -> None:
    debian_multiarch(tmp_path)
    fs = RootFs(os.open(tmp_path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
    with pytest.raises(ApplyError, match="timed out scanning"):
        write_ldcache(fs, (), profile, frozenset(), deadline=time.monotonic() - 1)


@pytest.mark.parametrize("cut", [0, 20, 63, 64, 65, 120, 200, 280, 300, 330, 340, 350])
def test_a_cut_library_reads_as_ldconfig_reads_it(cut: int, twin, profile: LdconfigProfile) -> None:
    """Offsets past the file's end are refused as ldconfig's check_ptr refuses them, and what a cut
    leaves readable reads as the zeros ldconfig's mapping shows past the end."""
    whole = sample_library(b"libcut.so.1", needed=(b"libc.so.6",), isa_needed=4)
    assert cut < len(whole)

    def layout(root: Path) -> None:
        _put(root, "/etc/ld.so.conf", b"")
        _put(root, "/lib/x86_64-linux-gnu/libcut.so.1.0", whole[:cut])
        _put(root, "/lib/x86_64-linux-gnu/glibc-hwcaps/x86-64-v3/libcut.so.1", whole[:cut])

    theirs, ours = twin(layout)
    assert _our_cache(ours, (), profile)[0] == _their_cache(theirs, ())


def test_garbage_never_raises(tmp_path: Path) -> None:
    import random

    rng = random.Random(20)
    base = bytearray(sample_library(b"libg.so.1", needed=(b"libc.so.6",), isa_needed=2))
    path = tmp_path / "libg.so.1"
    for _ in range(300):
        data = bytearray(base)
        for _ in range(rng.randint(1, 12)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        path.write_bytes(bytes(data))
        fd = os.open(path, os.O_RDONLY)
        try:
            read_library(fd, len(data), b"libg.so.1")  # None or an answer: never an exception
        finally:
            os.close(fd)


def test_a_library_read_before_is_not_read_again(tmp_path: Path, profile: LdconfigProfile,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A gpuhookd worker reads the driver's libraries while idle (ldelf.remember); a start then finds
    the same inode bind-mounted in the container and takes what was read, to the same cache."""
    from gpuhook.apply import ldelf, ldwrite

    debian_multiarch(tmp_path)
    lib = tmp_path / "usr/lib/x86_64-linux-gnu/libfoo.so.2.4.1"
    _our_cache(tmp_path, (), profile)  # the links made: later runs see the same tree
    expected, _ = _our_cache(tmp_path, (), profile)
    monkeypatch.setattr(ldelf, "_KNOWN", {})
    ldelf.remember([lib])
    assert ldelf.known(lib.stat()) == ldelf.LibraryInfo(0x0303, b"libfoo.so.2", 0)
    read: list[bytes] = []
    real = ldwrite.read_library
    monkeypatch.setattr(ldwrite, "read_library", lambda fd, size, name: read.append(name) or real(fd, size, name))
    got, _ = _our_cache(tmp_path, (), profile)
    assert got == expected
    assert b"libfoo.so.2.4.1" not in read and b"libc.so.6" in read
    os.utime(lib, ns=(1, 1))  # changed since: read again
    _our_cache(tmp_path, (), profile)
    assert b"libfoo.so.2.4.1" in read


def test_a_head_start_reads_the_images_libraries_and_changes_nothing(twin, profile: LdconfigProfile,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """gpuhookd's apply child, told the rootfs before its plan (CacheWriter.read_libraries): the image's
    libraries read, nothing in the tree changed (no link, no cache); the start's writer then reads none of
    them again, and writes the cache a start without the head start writes."""
    from gpuhook.apply import ldelf, ldwrite

    headstart, plain = twin(debian_multiarch)
    expected, _ = _our_cache(plain, (), profile)
    monkeypatch.setattr(ldelf, "_KNOWN", {})
    before = links_in(headstart)
    writer = ldwrite.CacheWriter(RootFs(os.open(headstart, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)), (), profile,
                                 frozenset(), deadline=time.monotonic() + 60)
    assert writer.library_names() > 0
    assert writer.read_libraries() >= 3  # libc, libm, libfoo and the rest of the layout's
    assert links_in(headstart) == before and not (headstart / "etc/ld.so.cache").exists()
    read: list[bytes] = []
    real = ldwrite.read_library
    monkeypatch.setattr(ldwrite, "read_library", lambda fd, size, name: read.append(name) or real(fd, size, name))
    got, _ = _our_cache(headstart, (), profile)
    assert read == [] and got == expected

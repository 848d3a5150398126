"""gpuhook's ld.so.cache writer against glibc's own ldconfig, over real Debian trees and synthetic layouts (issue #31).

Each layout is made twice: the host's ldconfig writes one copy's cache (``ldconfig -r``, with the open files
the sandbox leaves it: ``ldconfig.OPEN_FILES``, stdin, stdout and stderr), ``write_ldcache`` the other's.
Every name in either cache must then resolve to the same entries, found as ld.so finds them (search_cache's
binary search by _dl_cache_libcmp, elf/dl-cache.c), and the caches and the trees' links must be byte-equal.

The real trees: Debian 12, 13 and 11 minbase roots from debootstrap (cached under ``.cache/debootstrap``:
about 35-65 s each on the first run, then an extraction), and the host's own library directories, mirrored
with hard links. The synthetic ones take each rule where C and Python differ: bytes over 0x7f (a signed
``char``), runs of digits past 2**31 (C's ``int`` wraps), include chains as deep as ldconfig's open files,
and a tree where a thousand links are made.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuhook.apply.ldconfig import OPEN_FILES, STANDARD_FILES, update_ldcache
from gpuhook.apply.ldelf import sample_library
from gpuhook.apply.ldprofile import ask, links_in
from gpuhook.apply.ldwrite import LdconfigProfile, write_ldcache
from gpuhook.apply.rootfs import RootFs
from gpuhook.ldcache import parse_ldcache
from tests.packages.conftest import debootstrap_tarball, extract_root, need

LDCONFIG = Path("/sbin/ldconfig")
PROGS = Path(__file__).parent / "progs"
LIB = "/usr/lib/x86_64-linux-gnu"
#: how many files of an include chain ldconfig reads in its sandbox
CHAIN = OPEN_FILES - STANDARD_FILES
#: Debian suites compared (each a cached debootstrap root), beside the package tests' Debian 12 root
SUITES = ("trixie", "bullseye")
pytestmark = pytest.mark.skipif(os.geteuid() != 0 and os.environ.get("CI") != "true",
                                reason="ldconfig -r chroots: needs root")

Layout = Callable[[Path], None]
Twin = Callable[[Layout], tuple[Path, Path]]
Same = Callable[[Path, Path], int]


@pytest.fixture(scope="module")
def profile() -> LdconfigProfile:
    answer = ask(LDCONFIG)
    assert answer.profile is not None, answer.why_not
    return answer.profile


def _put(root: Path, rel: str | bytes, data: bytes) -> None:
    path = root / os.fsdecode(rel).lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _link(root: Path, rel: str, target: str) -> None:
    path = root / rel.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)


def _libs(root: Path, directory: str, libraries: dict[bytes, bytes]) -> None:
    """*libraries* (file name: SONAME) in *directory*, the one the configuration names."""
    _put(root, "/etc/ld.so.conf", directory.encode() + b"\n")
    for name, soname in libraries.items():
        _put(root, directory.encode() + b"/" + name, sample_library(soname))


# -- what the two caches say -------------------------------------------------------------------------


def _sandbox_open_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))


def glibc_cache(root: Path) -> bytes:
    """The cache the host's ldconfig writes in *root*, with the open files its sandbox leaves it."""
    subprocess.run([str(LDCONFIG), "-r", str(root), "-f", "/etc/ld.so.conf", "-C", "/etc/ld.so.cache"],
                   check=True, env={"LC_ALL": "C"}, stdin=subprocess.DEVNULL, capture_output=True, timeout=120,
                   preexec_fn=_sandbox_open_files)
    return (root / "etc/ld.so.cache").read_bytes()


def gpuhook_cache(root: Path, profile: LdconfigProfile) -> bytes:
    fs = RootFs(os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
    try:
        write_ldcache(fs, (), profile, frozenset(), deadline=time.monotonic() + 60)
        fs.commit()
    finally:
        os.close(fs.root_fd)
    return (root / "etc/ld.so.cache").read_bytes()


@pytest.fixture(scope="module")
def ld_so(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """progs/cachesearch.c built: ld.so's search of a cache, in C as glibc has it (the resolution's oracle)."""
    binary = tmp_path_factory.mktemp("progs") / "cachesearch"
    subprocess.run([need("gcc", "gcc"), "-O2", "-Wall", "-Werror", "-fsigned-char", "-fwrapv", "-o", str(binary),
                    str(PROGS / "cachesearch.c")], check=True, capture_output=True)
    return binary


def resolved(ld_so: Path, cache: Path, names: list[bytes]) -> dict[bytes, tuple[bytes, ...]]:
    """What ld.so finds for each of *names* in *cache*: the entries it considers, in order (``flags:hwcap:path``;
    the CPU picks among them). None found: the name is not there for ld.so, whatever the cache holds."""
    out = subprocess.run([str(ld_so), str(cache)], input=b"".join(n + b"\0" for n in names), check=True,
                         capture_output=True, timeout=60).stdout
    answers, entries = [], []
    for record in out.split(b"\0")[:-1]:
        if record:
            entries.append(record)
        else:  # a name's end
            answers.append(tuple(entries))
            entries = []
    return dict(zip(names, answers, strict=True))


@pytest.fixture
def same(profile: LdconfigProfile, ld_so: Path) -> Same:
    """Write both caches; check that every name resolves alike and the bytes and the links are equal; the count."""
    def check(theirs: Path, ours: Path) -> int:
        expected, got = glibc_cache(theirs), gpuhook_cache(ours, profile)
        glibc, gpuhook = parse_ldcache(expected), parse_ldcache(got)
        names = sorted({os.fsencode(e.key) for e in glibc + gpuhook})
        by_glibc = resolved(ld_so, theirs / "etc/ld.so.cache", names)
        by_gpuhook = resolved(ld_so, ours / "etc/ld.so.cache", names)
        wrong = {n: (by_glibc[n], by_gpuhook[n]) for n in names if by_glibc[n] != by_gpuhook[n]}
        assert not wrong, f"{len(wrong)} of {len(names)} names resolve otherwise (in glibc's cache, gpuhook's): {wrong}"
        assert gpuhook == glibc
        assert got == expected
        assert links_in(ours) == links_in(theirs)
        return len(glibc)
    return check


@pytest.fixture
def twin(tmp_path: Path) -> Iterator[Twin]:
    def make(layout: Layout) -> tuple[Path, Path]:
        theirs, ours = tmp_path / "theirs", tmp_path / "ours"
        for root in (theirs, ours):
            root.mkdir()
            layout(root)
        return theirs, ours
    yield make


# -- the synthetic layouts ------------------------------------------------------------------------------


def high_bytes(count: int) -> Layout:
    """Names and SONAMEs with bytes over 0x7f (below NUL to glibc), among *count* others (where the binary
    search goes depends on the cache's size)."""
    libraries = {b"libzzz.so.1": b"libzzz.so.1", b"liba\xe9.so.1": b"liba\xe9.so.1", b"libaz.so.1": b"libaz.so.1",
                 b"liba.so.1": b"liba.so.1", b"lib\xff.so.2": b"lib\xff.so.2", b"libq.so.1.0": b"libq.so.1\x80",
                 b"lib\x80\x80.so.3": b"lib\x80\x80.so.3", b"libv.so.1.\xe9": b"libv.so.1",
                 b"libv.so.1.a": b"libv.so.1"}  # the newer of two names, linked as libv.so.1: a (é is below it)
    libraries |= {f"libf{i:03}.so.1".encode(): f"libf{i:03}.so.1".encode() for i in range(count)}
    return lambda root: _libs(root, LIB, libraries)


def wrapping_versions(root: Path) -> None:
    """Runs of digits that C's int wraps: 2**32 is 0 (older than 5), 2**31 negative (yet newer than 5: the
    difference wraps too), and SONAMEs whose order is no order (inserted as ldconfig inserts them)."""
    _libs(root, LIB, {
        b"libx.so.1.4294967296": b"libx.so.1", b"libx.so.1.5": b"libx.so.1",
        b"liby.so.2.2147483648": b"liby.so.2", b"liby.so.2.5": b"liby.so.2",
        b"libw.so.2147483647": b"libw.so.2147483647", b"libw.so.0": b"libw.so.0",
        b"libw.so.4294967295": b"libw.so.4294967295", b"libw.so.3000000000": b"libw.so.3000000000",
        b"libw.so.1": b"libw.so.1", b"libw.so.99999999999999999999": b"libw.so.99999999999999999999",
        b"libhuge.so.1": b"libhuge.so." + b"7" * 5000,  # more digits than Python's int() reads
    })


def include_chain(length: int) -> Layout:
    """ld.so.conf including a chain of *length* files (every other one through a glob), each naming a
    directory; some of those hold a library, so the cache shows how deep each reader went."""
    def layout(root: Path) -> None:
        _put(root, "/etc/ld.so.conf", b"include /etc/chain/0.conf\n")
        for i in range(length):
            nxt = f"/etc/chain/{i + 1}.conf" if i % 2 else f"/etc/chain/{i + 1}.c*f"
            _put(root, f"/etc/chain/{i}.conf", f"include {nxt}\n/opt/chain/{i}\n".encode())
            if i % 25 == 0 or i >= min(length, CHAIN) - 3:
                _put(root, f"/opt/chain/{i}/libchain{i}.so.1", sample_library(f"libchain{i}.so.1".encode()))
    return layout


def many_links(root: Path) -> None:
    """1200 libraries without their SONAME links: the writer makes 1200 links (and journals each)."""
    _libs(root, LIB, {f"libmany{i}.so.1.0".encode(): f"libmany{i}.so.1".encode() for i in range(1200)})


def multiarch_and_loops(root: Path) -> None:
    """Debian's multiarch directories (with an i386 one), one SONAME in three of them (and in two more that
    included files name), symlink loops of libraries and of directories, and glibc-hwcaps and legacy hwcap
    subdirectories."""
    _put(root, "/etc/ld.so.conf", b"include /etc/ld.so.conf.d/*.conf\n")
    _put(root, "/etc/ld.so.conf.d/x86_64-linux-gnu.conf",
         b"/usr/local/lib/x86_64-linux-gnu\n/lib/x86_64-linux-gnu\n/usr/lib/x86_64-linux-gnu\n")
    _put(root, "/etc/ld.so.conf.d/i386-linux-gnu.conf", b"/usr/lib/i386-linux-gnu\n")
    _put(root, "/etc/ld.so.conf.d/loops.conf", b"/opt/loop\n/opt/ring/a\n/opt/self/sub/sub/sub\n")
    for top in ("lib", "lib64"):
        _link(root, f"/{top}", f"usr/{top}")
    for directory, marker in ((LIB, b"usr"), ("/usr/local/lib/x86_64-linux-gnu", b"local"),
                              ("/usr/lib/x86_64-linux-gnu/glibc-hwcaps/x86-64-v3", b"v3")):
        _put(root, f"{directory}/libdup.so.1.{marker.decode()}", sample_library(b"libdup.so.1"))
    _put(root, "/usr/lib/i386-linux-gnu/libdup.so.1", sample_library(b"libdup.so.1", bits=32))
    _put(root, f"{LIB}/glibc-hwcaps/x86-64-v2/libhw.so.1", sample_library(b"libhw.so.1", isa_needed=2))
    _put(root, f"{LIB}/x86_64/libhw.so.1", sample_library(b"libhw.so.1"))
    _put(root, f"{LIB}/tls/haswell/libhw.so.1", sample_library(b"libhw.so.1"))
    _put(root, f"{LIB}/libhw.so.1.0", sample_library(b"libhw.so.1"))
    _link(root, f"{LIB}/libloop.so.1", "libloop.so.1")  # a loop of one link
    _link(root, f"{LIB}/libping.so.2", "libpong.so.2")
    _link(root, f"{LIB}/libpong.so.2", "libping.so.2")
    _link(root, "/opt/loop", "/opt/loop")  # a directory that is a loop
    _link(root, "/opt/ring/a", "b")
    _link(root, "/opt/ring/b", "a")
    _put(root, "/opt/self/libself.so.1", sample_library(b"libself.so.1"))
    _link(root, "/opt/self/sub", ".")  # /opt/self/sub/sub/sub is /opt/self
    _link(root, f"{LIB}/x86_64/x86_64", ".")
    for conf, named in ((b"\xe9.conf", b"/opt/high"), (b"e.conf", b"/opt/low")):  # glob's order: strcmp's
        _put(root, b"/etc/ld.so.conf.d/" + conf, named + b"\n")
        _put(root, named + b"/libdup2.so.1", sample_library(b"libdup2.so.1"))


SYNTHETIC: dict[str, Layout] = {
    **{f"high-bytes-{n}": high_bytes(n) for n in (0, 6, 40, 150)},
    "wrapping-versions": wrapping_versions,
    "include-chain-100": include_chain(100),
    "multiarch-and-loops": multiarch_and_loops,
}


@pytest.mark.parametrize("name", SYNTHETIC)
def test_synthetic_layouts_resolve_as_glibcs(name: str, twin: Twin, same: Same) -> None:
    assert same(*twin(SYNTHETIC[name])) > 0


def test_an_include_chain_is_read_as_deep_as_ldconfigs_open_files(tmp_path: Path, same: Same) -> None:
    """Not a depth of its own: the chain's files are read to the last one ldconfig can open, by ``ldconfig -r``
    and by the sandboxed ldconfig alike. That one is started from a process holding fds past 1023, inheritable
    ones as a runtime may leak to its hooks: it is waited on with poll (select() refuses such fds), and
    given only its standard files."""
    roots = [tmp_path / name for name in ("theirs", "ours", "sandboxed")]
    for root in roots:
        root.mkdir()
        include_chain(CHAIN + 4)(root)
    theirs, ours, sandboxed = roots
    same(theirs, ours)
    names = {e.key for e in parse_ldcache((ours / "etc/ld.so.cache").read_bytes())}
    assert {f"libchain{i}.so.1" for i in (CHAIN - 3, CHAIN - 2)} <= names  # the last files' (depths CHAIN-2, -1)
    assert f"libchain{CHAIN - 1}.so.1" not in names
    held: list[int] = []
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(limits[0], 2048), max(limits[1], 2048)))
    try:
        while not held or held[-1] < 1100:
            held.append(os.open("/dev/null", os.O_RDONLY))
        update_ldcache(LDCONFIG, sandboxed, (), timeout=30)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)
    assert (sandboxed / "etc/ld.so.cache").read_bytes() == (ours / "etc/ld.so.cache").read_bytes()


_BYTE = st.sampled_from([b"a", b"b", b"z", b".", b"-", b"\x80", b"\xe9", b"\xff"])
_DIGITS = st.sampled_from([b"0", b"1", b"9", b"10", b"2147483647", b"2147483648", b"4294967295", b"4294967296",
                           b"4294967301", b"18446744073709551621"])
_NAME = st.lists(st.one_of(_BYTE, _DIGITS), min_size=1, max_size=5).map(b"".join)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(_NAME, st.tuples(st.booleans(), _DIGITS), min_size=1, max_size=24))
def test_random_names_and_versions_resolve_as_glibcs(tmp_path: Path, same: Same,
                                                     libraries: dict[bytes, tuple[bool, bytes]]) -> None:
    """Random names of bytes and digit runs: each library ``lib<name>.so.<version>``, its SONAME that name
    or ``lib<name>.so`` (so that versions compete for one SONAME)."""
    files = {}
    for stem, (versioned, version) in libraries.items():
        name = b"lib" + stem + b".so." + version
        files[name] = name if versioned else b"lib" + stem + b".so"
    work = tmp_path / f"run-{time.monotonic_ns()}"  # one tmp_path for every example
    theirs, ours = work / "theirs", work / "ours"
    for root in (theirs, ours):
        _libs(root, LIB, files)
    try:
        same(theirs, ours)
    finally:
        shutil.rmtree(work)


# -- the real trees -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def debian_roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each suite's root, extracted once from its cached debootstrap tarball (made on the first run)."""
    tarballs = {"bookworm": debootstrap_tarball(), **{s: debootstrap_tarball(s, ()) for s in SUITES}}
    return {suite: extract_root(tarball, tmp_path_factory.mktemp(suite) / "root")
            for suite, tarball in tarballs.items()}


def _hard_copy(source: Path, dest: Path) -> None:
    subprocess.run(["cp", "-a", "--link", f"{source}/.", str(dest)], check=True)


@pytest.mark.parametrize("suite", ["bookworm", *SUITES])
def test_debian_roots_resolve_as_glibcs(suite: str, debian_roots: dict[str, Path], twin: Twin, same: Same) -> None:
    assert same(*twin(lambda root: _hard_copy(debian_roots[suite], root))) > 20


def host_libraries(root: Path) -> None:
    """The host's configuration and every directory it names (and the built-in ones), mirrored: files hard
    linked (or copied), symlinks as they are, hwcap subdirectories with them."""
    shutil.copytree("/etc/ld.so.conf.d", root / "etc/ld.so.conf.d", symlinks=True)
    shutil.copy("/etc/ld.so.conf", root / "etc/ld.so.conf")
    for top in ("lib", "lib64", "lib32", "libx32"):
        if os.path.islink(f"/{top}"):
            _link(root, f"/{top}", os.readlink(f"/{top}"))
    named = [line.strip() for conf in Path("/etc/ld.so.conf.d").glob("*.conf")
             for line in conf.read_text().splitlines() if line.strip().startswith("/")]
    for directory in {os.path.realpath(d) for d in (*named, "/usr/lib", "/usr/lib64")}:
        if os.path.isdir(directory):
            _mirror(Path(directory), root / directory.lstrip("/"))


def _mirror(source: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for entry in os.scandir(source):
        target = dest / entry.name
        if entry.is_symlink():
            target.symlink_to(os.readlink(entry.path))
        elif entry.is_dir() and entry.name in ("glibc-hwcaps", "x86_64", "tls", "haswell", "x86-64-v2",
                                               "x86-64-v3", "x86-64-v4"):
            _mirror(Path(entry.path), target)
        elif entry.is_file() and ".so" in entry.name:
            try:
                os.link(entry.path, target)
            except OSError:
                shutil.copy2(entry.path, target)


def test_the_hosts_libraries_resolve_as_glibcs(twin: Twin, same: Same) -> None:
    assert same(*twin(host_libraries)) > 100


# -- many links: file descriptors -----------------------------------------------------------------------


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_thousand_links_hold_one_fd_per_directory(twin: Twin, profile: LdconfigProfile) -> None:
    """Each link the writer makes is journalled with its directory, held once (not once per link) until the
    changes are kept; the cache and the links are glibc's."""
    theirs, ours = twin(many_links)
    fs = RootFs(os.open(ours, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
    baseline = _open_fds()
    assert write_ldcache(fs, (), profile, frozenset(), deadline=time.monotonic() + 60) == 1200
    assert _open_fds() - baseline == 1  # the library directory's, for an undo
    assert fs.commit() == []
    assert _open_fds() == baseline
    os.close(fs.root_fd)
    assert (ours / "etc/ld.so.cache").read_bytes() == glibc_cache(theirs)
    assert len(links_in(ours)) == 1200
    assert links_in(ours) == links_in(theirs)

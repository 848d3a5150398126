"""Whether gpuhook may write a container's ld.so.cache itself: the host ldconfig, asked once.

``ldwrite`` does what glibc 2.36's ldconfig does, but two things of a host's ldconfig are
compiled into it: the directories it always scans (Debian's four multiarch and plain ``lib``
directories, ``/lib64`` on RHEL) and the generator string it writes into the cache. Both are
read from the binary by running it once on an empty tree (``-v`` names each built-in directory
it cannot find). Then it runs once more on a sample tree (``sample_tree``: includes, types, a
newer version, links good, stale and odd, legacy hwcap and glibc-hwcaps directories, an i386
library, a linker script), and ``ldwrite`` on a copy of it: only if the two leave byte-equal
caches and the same links is the profile used. Another ldconfig (another glibc, another
architecture, a patched one) that does anything differently keeps the sandboxed ldconfig.

The answer is kept per binary (device, inode, size, mtime): in memory (gpuhookd's workers
inherit it) and in ``<cache_dir>/ldconfig-<path>.json`` for the hook, which would otherwise
ask on every start. A replaced ldconfig (a glibc upgrade) is asked again.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from gpuhook.apply.ldconfig import open_ldconfig
from gpuhook.apply.ldelf import sample_library
from gpuhook.apply.ldwrite import LdconfigProfile, write_ldcache
from gpuhook.apply.rootfs import RootFs
from gpuhook.errors import ApplyError
from gpuhook.sys.files import is_trusted, open_trusted_dir, replace_at
from gpuhook.ldcache import generator_of

_FORMAT: Final = 1
_ENV: Final = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
_PROBE_TIMEOUT_S: Final = 10.0
_CANNOT_STAT: Final = b"Can't stat "
_CMDLINE_DIR: Final = "/opt/cmd/lib"
_WHAT: Final = "the answer about the host's ldconfig"
#: the temporary trees of one ask: <tmp>/gpuhook-ldconfig-<pid>-XXXX
_WORK_PREFIX: Final = "gpuhook-ldconfig-"


@dataclass(frozen=True, slots=True)
class ProfileAnswer:
    """The profile to use, or None and why not."""

    profile: LdconfigProfile | None
    why_not: str = ""


_KNOWN: dict[tuple[int, int, int, int], ProfileAnswer] = {}


def profile_for(ldconfig: Path, cache_dir: Path | None, *, keeps: bool = False) -> ProfileAnswer:
    """Whether (and how) ``ldwrite`` may stand in for *ldconfig*; asks the binary at most once.

    *keeps*: this process keeps the answer for the processes it forks (gpuhookd). Without it and
    without a *cache_dir* to keep it in, the binary is not asked (each start would ask again, which
    costs more than the ldconfig run it saves): the answer is no."""
    try:
        st = os.stat(ldconfig)
    except OSError as err:
        return ProfileAnswer(None, f"cannot stat {ldconfig}: {err.strerror}")
    identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if (known := _KNOWN.get(identity)) is not None:
        return known
    path = cache_dir / f"ldconfig-{zlib.crc32(os.fsencode(ldconfig)):08x}.json" if cache_dir is not None else None
    answer = _stored(path, identity) if path is not None else None
    if answer is None and path is None and not keeps:
        return ProfileAnswer(None, "not asked: with cache_dir null the answer could not be kept (gpuhookd asks once)")
    if answer is None:
        answer = ask(ldconfig)
        if path is not None:
            _store(path, identity, answer)
    _KNOWN[identity] = answer
    return answer


def ask(ldconfig: Path) -> ProfileAnswer:
    """Run *ldconfig* on an empty and a sample tree (as root, in a private temporary directory)."""
    import shutil  # a start imports this module; only a new ldconfig needs these
    import subprocess
    import tempfile

    try:
        os.close(open_ldconfig(ldconfig))  # the binary the sandbox would accept: static, readable
    except ApplyError as err:
        return ProfileAnswer(None, str(err))
    _sweep(Path(tempfile.gettempdir()))
    work = Path(tempfile.mkdtemp(prefix=f"{_WORK_PREFIX}{os.getpid()}-"))
    try:
        empty = work / "empty"
        (empty / "etc").mkdir(parents=True)
        output = _run(ldconfig, empty, "-v", "-X")
        system_dirs = tuple(line[line.index(_CANNOT_STAT) + len(_CANNOT_STAT):].rsplit(b": ", 1)[0]
                            for line in output.splitlines() if _CANNOT_STAT in line)
        generator = generator_of((empty / "etc" / "ld.so.cache").read_bytes())
        if generator is None or not system_dirs:
            return ProfileAnswer(None, f"{ldconfig} wrote no generator string or named no built-in directory")
        profile = LdconfigProfile(system_dirs, generator)
        theirs, ours = work / "theirs", work / "ours"
        sample_tree(theirs, system_dirs)
        sample_tree(ours, system_dirs)
        _run(ldconfig, theirs, _CMDLINE_DIR)
        root_fd = os.open(ours, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            write_ldcache(RootFs(root_fd), (_CMDLINE_DIR,), profile, frozenset(),
                          deadline=time.monotonic() + _PROBE_TIMEOUT_S)
        finally:
            os.close(root_fd)
        if (theirs / "etc/ld.so.cache").read_bytes() != (ours / "etc/ld.so.cache").read_bytes():
            return ProfileAnswer(None, f"{ldconfig} ({generator.decode(errors='replace')}) writes another cache "
                                       "than gpuhook on a sample tree")
        if links_in(theirs) != links_in(ours):
            return ProfileAnswer(None, f"{ldconfig} makes other links than gpuhook on a sample tree")
        return ProfileAnswer(profile)
    except (OSError, subprocess.SubprocessError, ValueError) as err:  # ValueError: it failed (_run)
        return ProfileAnswer(None, f"could not ask {ldconfig}: {err}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _sweep(temp: Path) -> None:
    """Remove the trees of asks whose process is gone (killed mid-ask: a crash leaves nothing for long)."""
    import shutil

    for left in temp.glob(f"{_WORK_PREFIX}*-*"):
        pid = left.name[len(_WORK_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(left, ignore_errors=True)


def _run(ldconfig: Path, root: Path, *args: str) -> bytes:
    """``ldconfig -r root -f /etc/ld.so.conf -C /etc/ld.so.cache ARGS``: its output."""
    import subprocess

    done = subprocess.run([str(ldconfig), "-r", str(root), "-f", "/etc/ld.so.conf", "-C", "/etc/ld.so.cache", *args],
                          env=_ENV, stdin=subprocess.DEVNULL, capture_output=True, timeout=_PROBE_TIMEOUT_S,
                          check=False)
    if done.returncode != 0:
        raise ValueError(f"exited with status {done.returncode}: {done.stderr.decode(errors='replace').strip()[-300:]}")
    return done.stdout + done.stderr


def links_in(root: Path) -> dict[str, str]:
    """Every symlink under *root* (relative path → target), not followed: what ldconfig made and removed."""
    found = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(directory, name)
            if os.path.islink(path):
                found[os.path.relpath(path, root)] = os.readlink(path)
    return found


def sample_tree(root: Path, system_dirs: tuple[bytes, ...]) -> None:
    """A small rootfs that takes ldconfig through each rule ``ldwrite`` follows."""
    def put(rel: str, data: bytes) -> None:
        path = root / rel.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def link(rel: str, target: str) -> None:
        path = root / rel.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(target)

    libc6 = (b"libc.so.6",)
    put("/etc/ld.so.conf", b"include /etc/ld.so.conf.d/*.conf\n# comment\n/opt/typed/lib=libc6\n"
                           b"/opt/badtype/lib=libc6 \n  /opt/plain/lib/ \t\nhwcap 0 nosegneg\n"
                           b"include conf2.d/*.conf\n/nowhere\n")
    put("/etc/ld.so.conf.d/a.conf", b"/usr/local/lib\n")
    put("/etc/ld.so.conf.d/b.conf", b"/opt/plain/lib # again\n")
    put("/etc/ld.so.conf.d/.hidden.conf", b"/opt/hidden/lib\n")
    put("/etc/conf2.d/c.conf", b"/opt/rel/lib")
    first = os.fsdecode(system_dirs[0])
    put(f"{first}/libcal.so.1.0", sample_library(b"libcal.so.1", needed=libc6))
    put(f"{first}/libcal.so.1.9", sample_library(b"libcal.so.1", needed=libc6))
    put(f"{first}/libcal.so.1.10", sample_library(b"libcal.so.1", needed=libc6))
    link(f"{first}/libcal.so", "libcal.so.1")
    link(f"{first}/libstale.so.2", "libgone.so.2.0")
    link(f"{first}/libalias.so.5", "libcal.so.1.0")
    put(f"{first}/libnosoname.so.3", sample_library(None))
    put(f"{first}/libscript.so", b"/* GNU ld script */\nGROUP ( libcal.so.1 )\n" + b" " * 64)
    put(f"{first}/libc32.so.1", sample_library(b"libc32.so.1", needed=libc6, bits=32))
    put(f"{first}/libplain32.so.1", sample_library(b"libplain32.so.1", bits=32))
    put(f"{first}/notalib.txt", b"x" * 80)
    put(f"{first}/ld-2.36.so", sample_library(b"ld-linux-x86-64.so.2"))
    put(f"{first}/ld-2.99.so", sample_library(b"ld-linux-x86-64.so.2"))
    link(f"{first}/ld-linux-x86-64.so.2", "ld-2.36.so")
    put(f"{first}/x86_64/libhw.so.1", sample_library(b"libhw.so.1"))
    put(f"{first}/tls/libtls.so.1", sample_library(b"libtls.so.1"))
    put(f"{first}/glibc-hwcaps/x86-64-v3/libcal.so.1.10", sample_library(b"libcal.so.1", isa_needed=1 << 2))
    (root / first.lstrip("/") / "glibc-hwcaps/x86-64-v2").mkdir(parents=True)
    if len(system_dirs) > 1:
        second = os.fsdecode(system_dirs[1])
        put(f"{second}/libcal.so.1.2", sample_library(b"libcal.so.1"))
        put(f"{second}/libdup.so.1", sample_library(b"libdup.so.1"))
    put("/opt/typed/lib/libtyped.so.1", sample_library(b"libtyped.so.1", bits=32))
    put("/opt/badtype/lib/libbad.so.1", sample_library(b"libbad.so.1", bits=32))
    put("/opt/plain/lib/libplain.so.1.2.3", sample_library(b"libplain.so.1"))
    put("/opt/hidden/lib/libhidden.so.1", sample_library(b"libhidden.so.1"))
    put("/opt/rel/lib/librel.so.1", sample_library(b"librel.so.1"))
    put(f"{_CMDLINE_DIR}/libcmd.so.1", sample_library(b"libcmd.so.1"))
    put("/usr/local/lib/libloc.so.7", sample_library(b"libloc.so.7"))


#: larger than any answer: a bigger file is not ours
_MAX_STORED: Final = 1 << 16


def _stored(path: Path, identity: tuple[int, ...]) -> ProfileAnswer | None:
    """The answer kept in *path* for this binary, or None (absent, another binary, not trusted)."""
    data = _read_trusted(path)
    if data is None:
        return None
    try:
        record = json.loads(data)
        if record.get("format") != _FORMAT or tuple(record["identity"]) != identity:
            return None
        if not record["native"]:
            return ProfileAnswer(None, str(record["why_not"]))
        return ProfileAnswer(LdconfigProfile(tuple(os.fsencode(d) for d in record["system_dirs"]),
                                             os.fsencode(record["generator"])))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _read_trusted(path: Path) -> bytes | None:
    """*path*'s bytes if it and its directory are root's (or ours) and writable by nobody else (the
    answer decides what runs as root), a regular file, not a symlink; else None."""
    try:
        dir_fd = open_trusted_dir(path.parent, _WHAT)
    except OSError:
        return None
    try:
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not is_trusted(st, directory=False) or st.st_size > _MAX_STORED:
            return None
        return os.read(fd, _MAX_STORED)
    except OSError:
        return None
    finally:
        os.close(fd)


def _store(path: Path, identity: tuple[int, ...], answer: ProfileAnswer) -> None:
    profile = answer.profile
    record = {"format": _FORMAT, "identity": list(identity), "native": profile is not None,
              "why_not": answer.why_not,
              "system_dirs": [os.fsdecode(d) for d in profile.system_dirs] if profile else [],
              "generator": os.fsdecode(profile.generator) if profile else ""}
    try:
        dir_fd = open_trusted_dir(path.parent, _WHAT)
    except OSError:
        return  # no cache directory yet (the inventory cache makes it), or not ours: asked again next time
    try:
        replace_at(dir_fd, path.name, json.dumps(record).encode(), mode=0o644)
    except OSError:
        pass  # a read-only cache directory: asked again next time
    finally:
        os.close(dir_fd)

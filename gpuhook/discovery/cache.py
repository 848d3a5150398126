"""The host inventory cache: ask NVML once per driver identity, not once per container.

NVML's init takes seconds per GPU on hosts without persistence mode, and every
GPU container start needs the inventory. Nothing in it changes while the
driver's identity is unchanged, so the hook keeps it in
``<cache_dir>/inventory-<roots>.json`` and asks NVML only when the identity's
fingerprint differs from the one stored with it.

The identity is everything ``HostDiscoverer`` reads besides NVML's answers,
read with stat calls and a few small reads (no NVML, about a millisecond):

* gpuhook's version, the cache format and the configured roots;
* ``/proc/driver/nvidia/version`` (the NVRM version: a driver reload),
  ``params``, ``registry``, the ``gpus/`` listing and ``/proc/devices`` (majors);
* the ``/dev/nvidia*`` names, types and device numbers (GPUs added, removed,
  reset; directories one level down), except ``/dev/nvidia-caps``;
* the driver root's ``etc/ld.so.cache`` (st_dev, st_ino, size, mtime_ns):
  ldconfig rewrites it on every driver install; without one, the library
  directories that are searched instead;
* the binary and firmware directories and the daemons' IPC sockets (a
  restarted nvidia-persistenced makes a new socket inode).

The MIG layout is not part of the identity: instances are created and destroyed
while the driver stays, and each change would otherwise cost every start an NVML
rebuild. The layout (``/proc/driver/nvidia/capabilities``) and the capability
nodes (``/dev/nvidia-caps``) are read at each start instead (``LiveFacts``, see
discovery.live), and ``CachedDiscoverer.find`` reconciles them with the cached
inventory, cheapest first:

* a destroyed instance: its MIG device is dropped and its parent's later ones
  renumbered (``inventory.narrow_to_live``), no NVML;
* an instance NVML was never asked about (only NVML knows its UUID): ignored by a
  start that cannot select MIG devices; a start that can (``LiveNeeds.mig``) asks
  NVML once and stores the result (outcome ``mig-changed``), so the next starts
  are hits again. An instance NVML was asked about but did not report is not
  asked about again (``Inventory.mig_layout``), so it cannot cost every start.

An instance destroyed and recreated with the same GPU and compute instance ids
between two starts looks unchanged (procfs shows nothing else), as it did when
the layout was part of the identity: its old UUID is offered until ``gpuhook
info --refresh`` or the next rebuild.

The file is written to a temporary name in the same directory and renamed
over the old one, so a reader sees a whole old or a whole new file; two
hooks that race to rebuild write equal results and the last rename wins.
Anything unusable (absent, corrupt, another format, another identity, not
owned by root, not a regular file: a directory, FIFO, socket or symlink in its
place, or unreadable) is a miss, never an error, and storing over it fails
quietly (the start logs ``inventory_not_cached``): the hook then asks NVML as it
would without a cache. The cache holds host paths that get bind-mounted into
containers, so only a file and directory owned by root (or the caller) and
writable by nobody else are trusted.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import stat
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from collections.abc import Sequence
from typing import Final, Protocol

from gpuhook import __version__, catalog
from gpuhook.config import Config
from gpuhook.errors import DiscoveryError
from gpuhook.discovery.host import BINARY_DIRS, LIBRARY_DIRS, PROC_DRIVER_FILES
from gpuhook.discovery.hostroot import HostRoot
from gpuhook.discovery.live import read_live
from gpuhook.inventory import Inventory, LiveFacts, LiveNeeds, narrow_to_live, unseen_instances
from gpuhook.sharing.ledger import MigRecord
from gpuhook.sharing.mig import with_recorded
from gpuhook.sys.files import is_trusted, open_trusted_dir, replace_at

#: Bumped when the document or Inventory.to_dict changes meaning; an older file is then a miss.
#: 2: caps_nodes left the inventory (read live), mig_layout joined it.
#: 3: MIG mode, GI profiles and MIG device profiles. 4: each GPU's memory.
CACHE_FORMAT: Final = 4
#: An inventory of 64 GPUs and a full driver, with its key, is about 50 KiB; anything far larger is not ours.
CACHE_LIMIT: Final = 4 << 20
_FIRMWARE_DIR: Final = "lib/firmware/nvidia"
#: /dev entries left out of the identity: capability nodes come and go with MIG instances.
_LIVE_DEV_ENTRIES: Final = frozenset({"nvidia-caps"})

#: (st_dev, st_ino, st_size, st_mtime_ns) of a file or directory.
Stamp = tuple[int, int, int, int]


class Discoverer(Protocol):
    """Anything that can produce the host's inventory (``HostDiscoverer`` asks NVML)."""

    def discover(self) -> Inventory:
        """Inventory the host's GPUs and driver files."""
        ...


class Outcome(enum.Enum):
    """Where an inventory came from, and why not from the cache."""

    HIT = "hit"  # a valid cache: no NVML
    ABSENT = "absent"  # no cache file yet (first start, or after a reboot emptied /run)
    STALE = "stale"  # written for another driver identity
    CORRUPT = "corrupt"  # unreadable JSON, another format, or wrong types
    UNTRUSTED = "untrusted"  # file or directory writable by others than root, or not readable
    NO_IDENTITY = "no-identity"  # the driver's identity could not be read (the cache is bypassed)
    REFRESH = "refresh"  # rebuilt on request (gpuhook info --refresh)
    DISABLED = "disabled"  # cache_dir is null
    MIG_CHANGED = "mig-changed"  # a hit, rebuilt: the start may use a MIG instance NVML was never asked about


@dataclass(frozen=True, slots=True, kw_only=True)
class DriverIdentity:
    """What the inventory depends on besides NVML's answers (read without NVML)."""

    gpuhook_version: str
    roots: tuple[str, str, str]
    proc_files: tuple[tuple[str, str | None], ...]
    proc_gpus: tuple[str, ...]
    dev_nodes: tuple[tuple[str, int, int], ...]
    ld_cache: Stamp | None
    driver_dirs: tuple[tuple[str, Stamp | None], ...]
    ipc: tuple[tuple[str, Stamp | None], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheLookup:
    """An inventory and how it was obtained."""

    inventory: Inventory
    outcome: Outcome
    #: why a freshly built inventory was not written to the cache (None: written, or a hit)
    not_stored: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Found:
    """What a start plans with: the inventory (cached, narrowed to the live MIG layout) and the live facts."""

    inventory: Inventory
    live: LiveFacts
    outcome: Outcome
    #: why a freshly built inventory was not written to the cache (None: written, or a hit)
    not_stored: str | None = None


# --- pure: fingerprint and (de)serialisation -------------------------------------------------


def fingerprint(identity: DriverIdentity) -> str:
    """The cache key: *identity* as canonical JSON (equal identities, equal keys).

    The identity itself rather than a digest of it: a few KiB compared as a string
    is exact and cheaper than importing hashlib on every container start, and the
    file then shows what its inventory was built for.
    """
    # Its fields hold only tuples of plain values, which json writes as asdict's lists would be, without
    # asdict's recursive deep copy (~1 ms of every start with a valid cache).
    fields = {name: getattr(identity, name) for name in DriverIdentity.__slots__}
    return json.dumps([CACHE_FORMAT, fields], sort_keys=True, separators=(",", ":"))


def encode_cache(key: str, inventory: Inventory) -> bytes:
    """The cache file's contents: the format, the identity's fingerprint and the inventory."""
    document = {"format": CACHE_FORMAT, "key": key, "inventory": inventory.to_dict()}
    return json.dumps(document, separators=(",", ":")).encode()


#: what the cache directory is for, in the refusal of one that others can write
_WHAT: Final = "the inventory cache"
#: The last file decoded, by path: its bytes, its key and the inventory. A gpuhookd worker decodes
#: the cache while idle (``warm``), so that its request only reads the file and compares bytes.
_DECODED: dict[Path, tuple[bytes, str, Inventory]] = {}


def decode_cache(data: bytes, key: str) -> Inventory | Outcome:
    """The inventory stored for *key*, or why *data* cannot be used."""
    try:
        document = json.loads(data)
    except (ValueError, RecursionError):
        return Outcome.CORRUPT
    if not isinstance(document, dict) or document.get("format") != CACHE_FORMAT:
        return Outcome.CORRUPT
    if document.get("key") != key:
        return Outcome.STALE
    try:
        return Inventory.from_dict(document.get("inventory"))
    except ValueError:
        return Outcome.CORRUPT


def cache_path(cache_dir: Path, config: Config) -> Path:
    """The cache file for this configuration's roots (one per driver root, so they do not take turns).

    Two root sets with the same CRC would share a file and rebuild it in turn (the
    key holds the roots), never read each other's inventory.
    """
    roots = "\0".join(str(p) for p in (config.driver_root, config.dev_root, config.proc_root))
    return cache_dir / f"inventory-{zlib.crc32(os.fsencode(roots)):08x}.json"


# --- I/O edge: the identity, reading and writing the file ------------------------------------


def read_identity(config: Config) -> DriverIdentity:
    """Stat and read the driver's identity under the configured roots; raises OSError."""
    driver, proc = HostRoot(config.driver_root), HostRoot(config.proc_root)
    ld_cache = _stamp(driver, "etc/ld.so.cache")
    # Without an ld.so.cache, libraries are found by listing these directories instead.
    dirs = (*BINARY_DIRS, _FIRMWARE_DIR, *(f"{_FIRMWARE_DIR}/{v}" for v in driver.listdir(_FIRMWARE_DIR)),
            *(LIBRARY_DIRS if ld_cache is None else ()))
    return DriverIdentity(
        gpuhook_version=__version__,
        roots=(str(config.driver_root), str(config.dev_root), str(config.proc_root)),
        proc_files=tuple((rel, _text(proc.read_bytes(rel))) for rel in _proc_files()),
        proc_gpus=proc.listdir("proc/driver/nvidia/gpus"),
        dev_nodes=_dev_nodes(config.dev_root / "dev"),
        ld_cache=ld_cache,
        driver_dirs=tuple((rel, _stamp(driver, rel)) for rel in dirs),
        ipc=tuple((rel, _stamp(driver, rel)) for rel in catalog.IPC_SOCKETS),
    )


def load_cache(path: Path) -> bytes | Outcome:
    """The cache file's bytes, or why there are none to use."""
    try:
        dir_fd = open_trusted_dir(path.parent, _WHAT)
    except (FileNotFoundError, NotADirectoryError):
        return Outcome.ABSENT
    except OSError:
        return Outcome.UNTRUSTED
    try:
        # O_NOFOLLOW: a symlink is not our file; O_NONBLOCK: a FIFO cannot hang the start.
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return Outcome.ABSENT
    except OSError:
        return Outcome.UNTRUSTED
    finally:
        os.close(dir_fd)
    try:
        return _read_trusted(fd)
    finally:
        os.close(fd)


def _read_trusted(fd: int) -> bytes | Outcome:
    """The bytes of the open cache file *fd*, if it is a trusted regular file of sensible size."""
    try:
        # fstat before reading: fdopen refuses a directory with IsADirectoryError, and a directory,
        # FIFO or device in the file's place is a miss like any other unusable file.
        if not is_trusted(os.fstat(fd), directory=False):
            return Outcome.UNTRUSTED
        with os.fdopen(fd, "rb", closefd=False) as handle:
            data = handle.read(CACHE_LIMIT + 1)
    except OSError:
        return Outcome.UNTRUSTED
    return Outcome.CORRUPT if len(data) > CACHE_LIMIT else data


def store_cache(path: Path, data: bytes) -> None:
    """Atomically replace the cache file with *data*; raises OSError."""
    _make_dir(path.parent)
    dir_fd = open_trusted_dir(path.parent, _WHAT)
    # Relative to dir_fd, so the directory checked above is the one written. No fsync: the
    # default cache_dir is tmpfs, and a torn file after a crash on disk fails to decode or to
    # match and is rebuilt, like any other miss.
    try:
        replace_at(dir_fd, path.name, data, mode=0o644)
    finally:
        os.close(dir_fd)


@dataclass(frozen=True, slots=True, kw_only=True)
class CachedDiscoverer:
    """A Discoverer that answers from the cache while the driver's identity is unchanged."""

    config: Config
    inner: Discoverer
    #: ignore the cache file and rebuild it (``gpuhook info --refresh``)
    refresh: bool = False

    def discover(self) -> Inventory:
        """The host's inventory, from the cache when it is valid; raises DiscoveryError."""
        return self.lookup().inventory

    def find(self, needs: LiveNeeds, recorded: Sequence[MigRecord] = ()) -> Found:
        """The inventory and the live facts *needs* asks for, reconciled (see the module docstring); *recorded*:
        the MIG instances the lease ledger records (gpuhook made them, and NVML told it their UUIDs)."""
        found = self.lookup()
        if recorded:
            found = replace(found, inventory=with_recorded(found.inventory, recorded))
        live = read_live(self.config, needs)
        # Only a hit can be behind the layout: a rebuilt inventory was made a moment ago, and
        # asking NVML again for an instance made since would be the same race once more.
        if found.outcome is Outcome.HIT and needs.mig and unseen_instances(found.inventory, live):
            rebuilt = replace(self, refresh=True).lookup()
            found = replace(rebuilt, outcome=Outcome.MIG_CHANGED)
        return Found(inventory=narrow_to_live(found.inventory, live), live=live, outcome=found.outcome,
                     not_stored=found.not_stored)

    def lookup(self) -> CacheLookup:
        """The inventory with where it came from; a rebuilt one is stored for the next start."""
        if self.config.cache_dir is None:
            return CacheLookup(inventory=self.inner.discover(), outcome=Outcome.DISABLED)
        path = cache_path(self.config.cache_dir, self.config)
        try:
            key = fingerprint(read_identity(self.config))
        except OSError as err:
            return CacheLookup(inventory=self.inner.discover(), outcome=Outcome.NO_IDENTITY,
                               not_stored=f"cannot read the driver's identity: {err}")
        outcome = Outcome.REFRESH
        if not self.refresh:
            found = _decoded(path, key)
            if isinstance(found, Inventory):
                return CacheLookup(inventory=found, outcome=Outcome.HIT)
            outcome = found
        inventory, belongs = self._consistent(key)
        if isinstance(belongs, OSError):
            return CacheLookup(inventory=inventory, outcome=outcome,
                               not_stored=f"cannot read the driver's identity again: {belongs}")
        key = belongs
        try:
            store_cache(path, encode_cache(key, inventory))
        except OSError as err:
            return CacheLookup(inventory=inventory, outcome=outcome, not_stored=f"cannot write {path}: {err}")
        return CacheLookup(inventory=inventory, outcome=outcome)

    def _consistent(self, key: str) -> tuple[Inventory, str | OSError]:
        """NVML's inventory and the identity key it belongs to, asked at most twice; raises DiscoveryError.

        The identity is read again after NVML answers: if it changed meanwhile, or NVML's driver
        version is not the kernel module's (an in-place driver upgrade), the inventory may be of
        either driver and lack its libraries, so it is neither stored nor used: NVML is asked once
        more, and a second disagreement refuses the start. Instead of the key comes the error that
        kept the identity from being read again (the inventory then serves, unstored).
        """
        problem = ""
        for _ in range(2):
            inventory = self.inner.discover()
            try:
                after = read_identity(self.config)
            except OSError as err:
                return inventory, err
            module = _module_version(after)
            after_key = fingerprint(after)
            if after_key == key and module in (None, inventory.driver_version):
                return inventory, key
            problem = ("the driver changed during discovery" if after_key != key
                       else "NVML's driver version is not the kernel module's")
            problem += f" (NVML reports driver {inventory.driver_version}, the kernel module is {module or 'unknown'})"
            key = after_key
        raise DiscoveryError(f"{problem}, twice in a row: an in-place driver upgrade is under way, or the kernel "
                             "module was not reloaded after one; retry once the upgrade is done (reload the "
                             "nvidia module or reboot if it was)")


def _decoded(path: Path, key: str) -> Inventory | Outcome:
    """The cache file's inventory for *key*: decoded again only when its bytes changed."""
    data = load_cache(path)
    if not isinstance(data, bytes):
        return data
    if (known := _DECODED.get(path)) is not None and known[0] == data and known[1] == key:
        return known[2]
    found = decode_cache(data, key)
    if isinstance(found, Inventory):
        _DECODED[path] = (data, key, found)
    return found


def warm(config: Config) -> Inventory | None:
    """Decode the cache file now (a gpuhookd worker, idle): its request then finds it decoded; the
    inventory, if the file held a valid one. Never asks NVML: a missing or stale file is left for
    the request to rebuild."""
    if config.cache_dir is None:
        return None
    with contextlib.suppress(OSError):
        found = _decoded(cache_path(config.cache_dir, config), fingerprint(read_identity(config)))
        return found if isinstance(found, Inventory) else None
    return None


def _module_version(identity: DriverIdentity) -> str | None:
    """The kernel module's version in ``/proc/driver/nvidia/version`` (None: no such file, or no version in it)."""
    text = dict(identity.proc_files).get("proc/driver/nvidia/version")
    first = (text or "").partition("\n")[0]
    # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 ..." (open modules: "... for x86_64  ...")
    return next((word for word in first.split() if word[:1].isdigit() and word.count(".") >= 1
                 and word.replace(".", "").isdigit()), None)


def _proc_files() -> tuple[str, ...]:
    """The small procfs files of the identity."""
    return ("proc/devices", *(f"proc/driver/nvidia/{name}" for name in PROC_DRIVER_FILES))


def _text(data: bytes | None) -> str | None:
    """File contents as text for the fingerprint (None: absent)."""
    return None if data is None else data.decode("utf-8", "surrogateescape")


def _stamp(root: HostRoot, rel: str) -> Stamp | None:
    """The identity of *rel* inside *root* (symlinks followed inside it), None if absent."""
    st = root.stat(rel)
    if st is None:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _dev_nodes(dev: Path) -> tuple[tuple[str, int, int], ...]:
    """(name, file type, rdev) of every ``nvidia*`` entry in *dev* but the live ones, one level into directories."""
    out: list[tuple[str, int, int]] = []
    pending = [(dev, "")]
    while pending:
        directory, prefix = pending.pop()
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            if not prefix and (not entry.name.startswith("nvidia") or entry.name in _LIVE_DEV_ENTRIES):
                continue
            st = entry.stat(follow_symlinks=False)
            out.append((prefix + entry.name, stat.S_IFMT(st.st_mode), st.st_rdev))
            if not prefix and stat.S_ISDIR(st.st_mode):  # /dev/nvidia-caps/nvidia-cap<N>
                pending.append((Path(entry.path), entry.name + "/"))
    return tuple(sorted(out))


def _make_dir(directory: Path) -> None:
    """Create the cache directory 0755 if it is missing (its parent, /run, must exist)."""
    try:
        os.mkdir(directory, 0o755)
    except FileExistsError:
        return
    os.chmod(directory, 0o755)  # exact, whatever the umask

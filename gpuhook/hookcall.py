"""One OCI hook call, read the one way: the stage table, the argv, the tripwire, the state, config.json.

Every front-end that is called as a hook goes through here: the Python hook (``gpuhook
prestart``), NVIDIA's hook name (``nvidia-container-runtime-hook``, docker ``--gpus``) and
gpuhookd for gpuhook-relay's raw calls. The stage a runtime names decides what the call does
(``STAGES``): ``prestart`` and ``createRuntime`` start (give the container its GPUs),
``poststop`` stops (releases the container's lease), ``poststart`` does nothing.

Every container start on a hooks.d ``always`` host runs this, GPU or not, so it imports only
``os``, ``select``, ``stat``, ``time``, the C JSON scanner and gpuhook's own no-GPU modules: no
dataclasses, enum or typing (stage names are plain strings for that reason), no YAML, no ctypes
unless config.json is read through another process's root (gpuhookd).
"""

from __future__ import annotations

import os
import select
import stat
import time

from gpuhook import __version__
from gpuhook.errors import SpecError, UnsafeEnvironmentError
from gpuhook.oci import strictjson
from gpuhook.request.quick import GPU_MARKERS, asks_for_gpu

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from typing import Any

# What a stage does (see the module docstring).
START = "start"
STOP = "stop"
NOTHING = "nothing"
STAGES = {"prestart": START, "createRuntime": START, "poststart": NOTHING, "poststop": STOP}

STATE_WHAT = "the OCI state on stdin"
STDIN_TIMEOUT = 5.0
#: A config.json over the size cap is scanned this far for GPU_MARKERS (64 KiB at a time, never held whole).
SCAN_LIMIT = 256 << 20
_SCAN_CHUNK = 1 << 16

#: The names NVIDIA's hook is installed under; their argv is Go ``flag`` style.
NVIDIA_HOOK_NAMES = ("nvidia-container-runtime-hook", "nvidia-container-toolkit")
NVIDIA_USAGE = ("usage: nvidia-container-runtime-hook [-config FILE] [-debug] [-daemon-socket PATH|none] [-version] "
                "prestart|poststart|poststop")

#: Harmless interpreter settings some daemons export; every other LD_*/PYTHON* variable trips.
_ALLOWED = frozenset({"PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONIOENCODING"})
#: glibc's other variables that load code or files into a process before or beside its own
#: (iconv modules, locales, tunables, resolver and message catalogs): what ld.so's secure mode
#: would drop for a setuid program (sysdeps/generic/unsecvars.h), as a hook's root process has none.
UNSAFE_NAMES = frozenset({
    "GCONV_PATH", "GETCONF_DIR", "GLIBC_TUNABLES", "HOSTALIASES", "LOCALDOMAIN", "LOCPATH", "MALLOC_TRACE",
    "NIS_PATH", "NLSPATH", "RESOLV_HOST_CONF", "RES_OPTIONS",
})


class HookArgs:
    """``[--config FILE] [--debug] [--daemon-socket PATH] STAGE``, decoded."""

    __slots__ = ("config", "daemon_socket", "debug", "stage")

    def __init__(self, stage: str, config: str | None, debug: bool, daemon_socket: str | None) -> None:
        self.stage = stage
        self.config = config
        self.debug = debug
        self.daemon_socket = daemon_socket

    @property
    def action(self) -> str:
        """START, STOP or NOTHING."""
        return STAGES[self.stage]


class HookCall:
    """A hook call as read: its arguments, environment, the OCI state and (for a start) config.json."""

    __slots__ = ("args", "asks_gpu", "bundle", "env", "spec", "spec_bytes", "state", "state_bytes")

    def __init__(self, args: HookArgs, env: Mapping[str, str], state_bytes: bytes) -> None:
        self.args = args
        self.env = env
        self.state_bytes = state_bytes
        self.state: Mapping[str, Any] = {}
        self.bundle = ""
        self.spec_bytes = b""
        self.spec: Mapping[str, Any] = {}
        self.asks_gpu = False


#: Where a hook's environment comes from, so where to fix it: runc gives a hook exactly the
#: "env" of its registration; docker's ``--gpus`` hook is run by dockerd with its own environment.
HOOK_ENV_FIX = ("Register the hook with an explicit env such as [\"PATH=/usr/sbin:/usr/bin:/sbin:/bin\"]; "
                "for docker --gpus the hook inherits dockerd's environment: remove them from dockerd's unit "
                "(systemctl edit docker.service, /etc/default/docker) and restart it")


def check_environment(env: Mapping[str, str], *, fix: str = HOOK_ENV_FIX) -> None:
    """Refuse to run with loader, libc or interpreter variables in a root process's own environment.

    ``LD_*``, ``PYTHON*`` (but ``_ALLOWED``) and ``UNSAFE_NAMES`` act before Python's first line
    (NVIDIAScape, CVE-2025-23266, was ``LD_PRELOAD`` reaching a root hook; ``LOCPATH`` with
    ``GCONV_PATH`` loads a library into ``python -I``), so they cannot be undone here; finding one
    means the registration is unsafe. Every front-end that acts as root for a container calls this
    first, with *fix*: which process's environment to clean, for that front-end.
    """
    found = sorted(k for k in env
                   if (k.startswith(("LD_", "PYTHON")) and k not in _ALLOWED) or k in UNSAFE_NAMES)
    if found:
        raise UnsafeEnvironmentError(
            f"the hook's environment sets {', '.join(found)}; they can inject code into a root process "
            f"(CVE-2025-23266). {fix}"
        )


def parse_hook_argv(words: Sequence[str]) -> HookArgs | None:
    """gpuhook's hook argv, decoded by hand; None for anything else (argparse owns usage and exit 2).

    Runtimes run the hook for every container, and importing argparse and building the parser
    costs about as much as the whole no-GPU path, so the shapes runtimes send are decoded here.
    """
    config: str | None = None
    debug = False
    daemon_socket: str | None = None
    rest = list(words)
    while len(rest) > 1:
        word = rest.pop(0)
        if word == "--debug":
            debug = True
        elif word == "--config" and not rest[0].startswith("-") and len(rest) > 1:
            config = rest.pop(0)
        elif word.startswith("--config="):
            config = word.removeprefix("--config=")
        elif word == "--daemon-socket" and len(rest) > 1:
            daemon_socket = rest.pop(0)
        else:
            return None
    if len(rest) != 1 or rest[0] not in STAGES:
        return None
    return HookArgs(rest[0], config, debug, daemon_socket)


def translate_nvidia_argv(words: Sequence[str]) -> list[str] | str:
    """gpuhook's argv for NVIDIA's hook *words* (``-config FILE``, ``--debug``, ...), or the text to print.

    docker's ``--gpus`` runs ``nvidia-container-runtime-hook prestart``; NVIDIA's runtime adds
    ``-config FILE``. Go's flags take one or two dashes, ``-name value`` or ``-name=value``.
    """
    out: list[str] = []
    args = list(words)
    while args:
        arg = args.pop(0)
        name, eq, value = arg.lstrip("-").partition("=")
        if not arg.startswith("-"):
            if arg not in STAGES:
                return f"gpuhook: unknown command {arg!r}\n{NVIDIA_USAGE}"
            return [*out, arg]
        if name == "version":
            return f"gpuhook {__version__} (nvidia-container-runtime-hook compatible)"
        if name == "debug":
            out.append("--debug")
        elif name in ("config", "daemon-socket"):  # the latter is gpuhook's own (gpuhookd's socket)
            if not eq:
                if not args:
                    return f"gpuhook: flag needs an argument: -{name}\n{NVIDIA_USAGE}"
                value = args.pop(0)
            out += [f"--{name}", value]
        else:
            return f"gpuhook: flag provided but not defined: {arg}\n{NVIDIA_USAGE}"
    return f"gpuhook: missing command\n{NVIDIA_USAGE}"


def relayed_hook_args(argv: Sequence[str]) -> HookArgs | None:
    """The hook call in a relay's argv, whose first word names the command it stands for: ``gpuhook``,
    or NVIDIA's hook name (its flags translated first); None for anything else (help, version, ...)."""
    if not argv:
        return None
    if argv[0] == "gpuhook":
        return parse_hook_argv(argv[1:])
    if argv[0] in NVIDIA_HOOK_NAMES:
        translated = translate_nvidia_argv(argv[1:])
        return parse_hook_argv(translated) if isinstance(translated, list) else None
    return None


def read_hook_call(args: HookArgs, env: Mapping[str, str], state_bytes: bytes, *, spec_bytes: bytes | None = None,
                   root_fd: int | None = None) -> HookCall:
    """Check the environment and decode the state; for a start also config.json and whether it asks for a GPU
    (a config.json without any of ``GPU_MARKERS`` asks for none and is not decoded: read_config_json's rule).

    *spec_bytes*: config.json as the caller already read it (the Python hook, handing over to
    gpuhookd); else it is read here, through *root_fd* when given (gpuhookd: the hook's root).
    """
    check_environment(env)
    call = HookCall(args, env, state_bytes)
    if args.action == NOTHING:
        return call
    call.state = strictjson.loads_object(state_bytes, what=STATE_WHAT, limit=strictjson.STATE_LIMIT)
    if args.action != START:
        return call
    call.bundle = strictjson.get_str(call.state, "bundle" if "bundle" in call.state else "bundlePath",
                                     what=STATE_WHAT)
    if spec_bytes is None:
        spec_bytes = read_start_config(call.bundle, limit=strictjson.SPEC_LIMIT, root_fd=root_fd)
        if spec_bytes is None:  # over the cap, and certainly no GPU: left untouched
            return call
    call.spec_bytes = spec_bytes
    if not has_gpu_marker(spec_bytes):  # certainly no GPU (read_config_json's rule): nothing to decode
        return call
    call.spec = strictjson.loads_object(call.spec_bytes, what=f"{call.bundle}/config.json",
                                        limit=strictjson.SPEC_LIMIT)
    call.asks_gpu = asks_for_gpu(call.spec)
    return call


#: Where the lease ledger is when the config does not move state_dir (config.Config's default).
DEFAULT_STATE_DIR = "/run/gpuhook"
LEDGER_NAME = "leases.json"
_DEFAULT_CONFIG = "/etc/gpuhook/config.yaml"
_NVIDIA_CONFIG = "/etc/nvidia-container-runtime/config.toml"  # config.NVIDIA_PATH
_SAFE_ID = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")
_MAY = True  # the full path decides


def lease_may_exist(config_arg: str | None, env: Mapping[str, str], container_id: str) -> bool:
    """False only when *container_id* certainly holds no lease: a poststop that then costs what a
    no-GPU prestart costs (no config module, no YAML, no lock).

    The ledger is ``<state_dir>/leases.json``, written whole by rename, so reading it without the
    lock shows every lease taken before this call. state_dir comes from the config file; this
    reads it only from the one shape gpuhook writes (a top-level ``state_dir: /path`` line) and
    leaves every other shape to the full config load.
    """
    if not _plain(container_id):
        return _MAY  # JSON would escape it: the full path reads the ledger
    path = config_arg or env.get("GPUHOOK_CONFIG") or _DEFAULT_CONFIG
    # A named config must exist (the full load says so); the default one may be absent.
    text = _read_small(path, b"" if path == _DEFAULT_CONFIG else None)
    if path == _DEFAULT_CONFIG and text == b"":  # gpuhook has none of its own: NVIDIA's may be the config
        text = _read_small(_NVIDIA_CONFIG, b"")
        # Only its [gpuhook] table can move state_dir, and TOML can spell that key otherwise only with \u escapes.
        if text is not None and not any(m in text for m in (b"state_dir", b"\\u", b"\\U")):
            text = b""
    state_dir = _flat_state_dir(text) if text is not None else None
    if state_dir is None:
        return _MAY
    ledger = _read_small(f"{state_dir}/{LEDGER_NAME}", b"", limit=-1) if state_dir else b""
    return ledger is None or ledger_may_name(ledger, container_id)


def ledger_may_name(ledger: bytes, container_id: str) -> bool:
    """False only when the ledger's bytes certainly hold no lease of *container_id* (an id JSON would
    escape is looked for by the full path: True)."""
    return not _plain(container_id) or b'"container_id": "' + container_id.encode() + b'"' in ledger


def _plain(container_id: str) -> bool:
    """Whether *container_id* is written into the ledger's JSON as it is (no escapes)."""
    key = container_id.encode()
    return bool(key) and set(key) <= _SAFE_ID


def _read_small(path: str, missing: bytes | None, *, limit: int = 1 << 20) -> bytes | None:
    """All of *path* if it has at most *limit* bytes (-1: any size); *missing* if it does not exist; None if
    it cannot be read or is longer (its first MiB could hide the state_dir line that follows)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(limit if limit < 0 else limit + 1)
    except FileNotFoundError:
        return missing
    except OSError:
        return None
    return data if limit < 0 or len(data) <= limit else None


def _flat_state_dir(text: bytes) -> str | None:
    """The config's state_dir ("" for null) when the document certainly sets it so (or leaves it at the
    default); None when its shape leaves any doubt (the full config load then decides).

    Certain means: every line that starts at the left margin is a comment or begins with a
    lower-case key (so no quoted or escaped key, directive, document marker or flow mapping can
    name state_dir), no backslash anywhere, and at most one ``state_dir:`` line (then a space or its
    end), whose plain value the next line does not continue (an indented or blank line after it could).
    relay/answers.h ports this; tests/unit/test_relay_answers.py holds the two to the same answers.
    """
    lines = text.splitlines()
    if b"\\" in text or not all(_starts_plainly(line, comment_ok=True) for line in lines):
        return None
    found = [n for n, line in enumerate(lines) if b"state_dir" in line]
    if not found:
        return DEFAULT_STATE_DIR
    at = found[0]
    if (len(found) != 1 or text.count(b"state_dir") != 1 or not lines[at].startswith(b"state_dir:")
            or lines[at][10:11] not in (b"", b" ")  # `state_dir:/x` is one scalar, not a key and its value
            or (at + 1 < len(lines) and not _starts_plainly(lines[at + 1], comment_ok=False))):
        return None
    state_dir = _plain_path(lines[at][len(b"state_dir:"):].partition(b" #")[0].strip(b" "))
    if state_dir == "" and (b"gpus" in text or b"device_policy" in text):
        return None  # null, where a sharing policy may limit GPUs: the full load refuses that (config.build_config)
    return state_dir


def _starts_plainly(line: bytes, *, comment_ok: bool) -> bool:
    """A line that begins with a lower-case key, or (*comment_ok*) is indented, blank or a comment."""
    if not line[:1] or line[:1] in (b" ", b"\t", b"#"):
        return comment_ok
    return b"a"[0] <= line[0] <= b"z"[0]


def _plain_path(value: bytes) -> str | None:
    """A state_dir value: the path, "" for null, None for anything PyYAML might read otherwise.

    Only a plain scalar can be null: a quoted one (``""``, ``'null'``) is a string, which the full
    load refuses as a state_dir that is no absolute path; so must this, by leaving it to that load.
    """
    if value[:1] in (b'"', b"'") and len(value) > 1 and value[-1:] == value[:1]:
        value = value[1:-1]
    elif value in (b"", b"~", b"null", b"Null", b"NULL"):  # empty: the next line is no block (checked)
        return ""
    if (not value.startswith(b"/") or any(c in value for c in b"\"'#:{}[],&*!|>%@`")
            or any(c < 0x20 or c >= 0x7F for c in value)):
        return None  # a tag, an alias, a flow, a relative path, a control or non-ASCII byte: the full load decides
    return value.decode()


def read_bounded(fd: int, *, limit: int, timeout: float = STDIN_TIMEOUT, what: str = STATE_WHAT) -> bytes:
    """Read *fd* to EOF, at most *limit* + 1 bytes, giving up after *timeout* seconds.

    A writer that never closes stdin must not hang the container start.
    """
    chunks: list[bytes] = []
    size = 0
    deadline = time.monotonic() + timeout
    while size <= limit:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise SpecError(f"{what} did not arrive within {timeout:g} s (is stdin closed?)")
        chunk = os.read(fd, min(65536, limit + 1 - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def read_config_json(bundle: str, *, limit: int, root_fd: int | None = None) -> bytes:
    """``<bundle>/config.json``: never through a symlink, never a FIFO, at most *limit* bytes.

    *root_fd*: resolve *bundle* from this root instead of ours (gpuhookd, for gpuhook-relay: the
    hook's root, passed as an fd). A lookup from an fd walks the mounts of the namespace that fd
    belongs to, and RESOLVE_IN_ROOT keeps ``..`` and absolute symlinks inside it, so the bundle
    is found exactly as the hook process itself would find it.

    A hook's start reads it with ``read_start_config``: the cap protects the GPU path, so a file
    over *limit* is not refused there when it certainly asks for no GPU. That is decided by a bounded
    scan of its raw bytes (64 KiB at a time, at most ``SCAN_LIMIT``, never held whole): no
    ``quick.GPU_MARKERS`` in them (``\\u``, ``NVIDIA_``, ``CUDA_VERSION``,
    ``nvidia-container-devices``, ``cdi.k8s.io``). Every name a GPU request is read from contains
    a marker, and ``\\uXXXX`` is the only JSON escape that can spell a letter, digit, ``_``, ``-``
    or ``.``, so a file without any asks for no GPU whatever its shape. Any marker: refused as here.
    """
    return _read_config(bundle, limit, root_fd, oversize_ok=False) or b""  # None only with oversize_ok


def read_start_config(bundle: str, *, limit: int, root_fd: int | None = None) -> bytes | None:
    """config.json for a hook's start: as ``read_config_json``, but None when it is over *limit* and
    certainly asks for no GPU (the rule is in ``read_config_json``'s docstring)."""
    return _read_config(bundle, limit, root_fd, oversize_ok=True)


def _read_config(bundle: str, limit: int, root_fd: int | None, *, oversize_ok: bool) -> bytes | None:
    """config.json's bytes; over *limit*: None if *oversize_ok* and no GPU marker is in it, else refused."""
    path = f"{bundle}/config.json"
    fd = _open_config_json(bundle, path, root_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SpecError(f"{path} is not a regular file")
        head = b""
        if st.st_size <= limit:
            # os.read, not a file object: one read of the size fstat gave (and one at EOF) is the whole cost
            head = _read_up_to(fd, limit + 1, st.st_size)
            if len(head) <= limit or not oversize_ok:
                return head  # one byte over: loads_object names the limit
        if oversize_ok and not _gpu_marker_in_file(fd, head):
            return None
    finally:
        os.close(fd)
    raise SpecError(f"{path} is {max(st.st_size, limit + 1)} bytes; the limit is {limit}. A larger config.json "
                    f"is read only when it asks for no GPU: at most {SCAN_LIMIT} bytes with none of "
                    "NVIDIA_, CUDA_VERSION, nvidia-container-devices, cdi.k8s.io or a \\u escape in it")


def _read_up_to(fd: int, most: int, size_hint: int) -> bytes:
    """At most *most* bytes from *fd*, to its end: first what its size says (plus one, to see the end)."""
    chunks, got = [], 0
    want = min(most, size_hint + 1)
    while got < most:
        chunk = os.read(fd, min(most - got, want))  # want >= 1: size_hint >= 0
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
        want = _SCAN_CHUNK  # a file that grew, or whose size says nothing (FUSE, procfs)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def has_gpu_marker(data: bytes) -> bool:
    """Whether *data* holds one of ``GPU_MARKERS``: without any, a config.json certainly asks for no GPU."""
    return any(marker in data for marker in GPU_MARKERS)


def _gpu_marker_in_file(fd: int, head: bytes) -> bool:
    """Whether the file holds one of ``GPU_MARKERS`` (or runs past ``SCAN_LIMIT``): *head*, its first
    bytes, then the rest chunk by chunk, never held whole."""
    keep = max(len(m) for m in GPU_MARKERS) - 1  # a marker may straddle two chunks
    window, scanned = head, len(head)
    while not has_gpu_marker(window):
        if scanned > SCAN_LIMIT:
            return True
        chunk = os.read(fd, _SCAN_CHUNK)
        if not chunk:
            return False
        scanned += len(chunk)
        window = window[-keep:] + chunk
    return True


def _open_config_json(bundle: str, path: str, root_fd: int | None) -> int:
    """An O_RDONLY fd of *path* (``<bundle>/config.json``), opened without following a symlink or blocking."""
    if not bundle.startswith("/"):
        raise SpecError(f"the bundle {bundle!r} must be an absolute path")
    # O_NOFOLLOW: never a symlink to a host file (the bundle's own path may hold links); O_NONBLOCK: a FIFO
    # cannot hang the open.
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        if root_fd is None:
            return os.open(path, flags)
        from gpuhook.sys import pathrs  # ctypes: gpuhookd only, where it is preloaded

        return pathrs.openat2(root_fd, path.lstrip("/"), flags, pathrs.RESOLVE_IN_ROOT | pathrs.RESOLVE_NO_MAGICLINKS)
    except (OSError, ValueError) as err:  # ValueError: a NUL byte in the path
        raise SpecError(f"cannot open {path}: {getattr(err, 'strerror', None) or err}") from err

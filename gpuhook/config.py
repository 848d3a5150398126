"""gpuhook's configuration: YAML (or NVIDIA's config.toml) → a frozen ``Config``.

Looked up as ``--config FILE``, then ``$GPUHOOK_CONFIG``, then
``/etc/gpuhook/config.yaml``, then (gpuhook having no config of its own)
NVIDIA's ``/etc/nvidia-container-runtime/config.toml``, else the built-in
defaults. A file named explicitly must exist; the default paths may be absent.
A file whose name ends in ``.toml`` is read as NVIDIA's (``gpuhook.nvidia_config``
maps its keys). Unknown keys of gpuhook's own are an error (a typo must not
silently fall back to a default on a root hook).

``yaml`` is imported only when a file is actually read, so the no-GPU fast
path never pays for it.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from gpuhook.errors import ConfigError
from gpuhook.hookcall import DEFAULT_STATE_DIR
from gpuhook.planning.health import HealthPolicy
from gpuhook.request.model import ALL_CAPABILITIES, Capability
from gpuhook.sharing.policy import NO_POLICY, Policy, Sharing, decode_device_file, decode_gpus

if TYPE_CHECKING:  # nvidia_config (and tomllib) are imported only when a config.toml is read
    from gpuhook.nvidia_config import Notice

# HealthPolicy is defined in core (the planner applies it) and re-exported with the other settings' types.
__all__ = [
    "DEFAULT_PATH", "ENV_VAR", "NVIDIA_PATH", "Config", "HealthPolicy", "LoadedConfig", "LogLevel", "Origin",
    "load_config", "parse_config", "parse_flat_yaml", "read_config", "resolve_config_path",
]

DEFAULT_PATH: Final = Path("/etc/gpuhook/config.yaml")
#: NVIDIA's config, read when gpuhook has none of its own (nvidia-toolkit.md §4.4)
NVIDIA_PATH: Final = Path("/etc/nvidia-container-runtime/config.toml")
ENV_VAR: Final = "GPUHOOK_CONFIG"


class LogLevel(enum.StrEnum):
    """The least severe event written to the log (a str, so the log module takes it as a level name)."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """Every setting of the hook, with NVIDIA-compatible defaults."""

    #: where the driver's libraries, binaries, firmware and ld.so.cache live
    #: (``/run/nvidia/driver`` for a containerised driver)
    driver_root: Path = Path("/")
    #: where the /dev/nvidia* nodes live
    dev_root: Path = Path("/")
    #: where /proc/driver/nvidia and /proc/devices live
    proc_root: Path = Path("/")
    #: the host's ldconfig; it must be statically linked (it runs chrooted in the container)
    ldconfig: Path = Path("/sbin/ldconfig")
    #: write the container's ld.so.cache in gpuhook where the host's ldconfig was found to write the
    #: same (asked once per binary); false: always run that ldconfig, sandboxed
    ldconfig_native: bool = True
    #: JSON-lines log; None disables it
    log_file: Path | None = Path("/var/log/gpuhook.log")
    #: where the host inventory cache lives (a root-owned directory, ideally on tmpfs so a
    #: reboot empties it); None disables the cache and every GPU container start asks NVML
    cache_dir: Path | None = Path("/run/gpuhook")
    log_level: LogLevel = LogLevel.INFO
    #: NVIDIA's accept-nvidia-visible-devices-envvar-when-unprivileged
    accept_envvar_when_unprivileged: bool = True
    #: NVIDIA's accept-nvidia-visible-devices-as-volume-mounts (device-plugin "volume-mounts")
    accept_volume_mounts: bool = False
    #: NVIDIA's disable-require: no NVIDIA_REQUIRE_* (nor legacy CUDA_VERSION) check is made
    disable_require: bool = False
    #: NVIDIA's supported-driver-capabilities: what a container may get (requests are narrowed to it)
    #: and what NVIDIA_DRIVER_CAPABILITIES=all means
    supported_driver_capabilities: frozenset[Capability] = ALL_CAPABILITIES
    #: take the GPUs from ``cdi.k8s.io/*`` annotations naming ``nvidia.com/gpu=…`` (device plugin's
    #: cdi-annotations strategy; the annotations come from the kubelet, not from the image)
    accept_cdi_annotations: bool = False
    #: leave the device cgroup alone (rootless, or when the runtime already allows the devices)
    no_cgroups: bool = False
    #: NVIDIA's load-kmods: before a GPU start, create missing NVIDIA device nodes (typically
    #: /dev/nvidia-uvm after a boot) with the host's nvidia-modprobe from the driver root
    load_kmods: bool = True
    #: a selected GPU with a critical Xid or pending memory repairs: refuse, warn or ignore
    unhealthy_gpus: HealthPolicy = HealthPolicy.REFUSE
    #: use the image's /usr/local/cuda/compat libraries when they are newer than the host driver
    cuda_compat: bool = True
    #: the longest the privileged step (mounts, nodes, ldconfig) may take
    timeout_seconds: float = 30.0
    #: gpuhook's state (the lease ledger): a root-only directory, ideally on tmpfs; None: no leases
    #: (only with no sharing limit: every GPU unlimited)
    state_dir: Path | None = Path(DEFAULT_STATE_DIR)
    #: the per-GPU sharing policy: the ``gpus:`` list, or what ``device_policy`` names
    gpus: Policy = NO_POLICY
    #: a device-policy file (``{"Devices": [...]}``, JSON or YAML) instead of ``gpus:``
    device_policy: Path | None = None
    #: the host's CUDA MPS pipe directory (NVIDIA's hook takes ``$CUDA_MPS_PIPE_DIRECTORY`` from its own
    #: environment, else this default): a compute container gets it at the same path while it exists;
    #: None: never
    mps_pipe_directory: Path | None = Path("/tmp/nvidia-mps")
    #: where gpuhookd serves Prometheus metrics (``127.0.0.1:9490``); None: it does not
    metrics_listen: str | None = None
    #: dcgm-exporter's HPC job-mapping directory (``--hpc-job-mapping-dir``): gpuhook keeps ``<dir>/<gpu index>``
    #: holding the ids of the containers that hold that GPU; None: not kept
    hpc_job_mapping_dir: Path | None = None


_FIELDS: Final = {f.name: f for f in dataclasses.fields(Config)}
_PATH_KEYS: Final = ("driver_root", "dev_root", "proc_root", "ldconfig")
#: null disables the feature
_OPTIONAL_PATH_KEYS: Final = ("log_file", "cache_dir", "state_dir", "device_policy", "mps_pipe_directory",
                               "hpc_job_mapping_dir")
_BOOL_KEYS: Final = (
    "accept_envvar_when_unprivileged", "accept_volume_mounts", "accept_cdi_annotations", "no_cgroups", "cuda_compat",
    "load_kmods", "disable_require", "ldconfig_native",
)
#: settings that take one of an enum's values (the YAML holds the value, Config the member)
_ENUM_KEYS: Final[dict[str, type[enum.StrEnum]]] = {"log_level": LogLevel, "unhealthy_gpus": HealthPolicy}


class Origin(enum.StrEnum):
    """Where a setting's value came from (``gpuhook config show``)."""

    GPUHOOK = "gpuhook.yaml"
    NVIDIA = "NVIDIA's config.toml"
    DEFAULT = "default"


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadedConfig:
    """A Config with what it was read from: the file, each setting's origin, NVIDIA's unmapped keys."""

    config: Config
    #: the file read; None when there was none (the defaults)
    path: Path | None = None
    #: every setting → (Origin, detail: the file's key that set it, or "")
    origins: Mapping[str, tuple[Origin, str]] = dataclasses.field(default_factory=dict)
    #: each setting given, as the file spelled it (gpuhook.yaml's types)
    raw: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    notices: tuple[Notice, ...] = ()


def resolve_config_path(explicit: str | None, env: Mapping[str, str], *, default: Path = DEFAULT_PATH,
                        nvidia: Path = NVIDIA_PATH) -> tuple[Path, bool]:
    """The file to read and whether it must exist (NVIDIA's file only when *default* is absent)."""
    if explicit:
        return Path(explicit), True
    if env.get(ENV_VAR):
        return Path(env[ENV_VAR]), True
    if not default.exists() and nvidia.exists():
        return nvidia, False
    return default, False


def load_config(path: Path, *, required: bool) -> Config:
    """Read *path*; an absent optional file gives the defaults."""
    return read_config(path, required=required).config


#: What read_config_unchanged read last, by (path, required): the file's identity then, and the result.
_read_before: dict[tuple[Path, bool], tuple[tuple[int, ...] | None, LoadedConfig]] = {}
#: A file changed this recently is read again each time: a rewrite in place within the filesystem's
#: timestamp granularity could keep its size and times (git's "racy" index entries, the same rule).
_SETTLED_NS: Final = 2_000_000_000


def read_config_unchanged(path: Path, *, required: bool) -> LoadedConfig:
    """``read_config``, answered again from memory while *path* is the same file with the same size and
    times (gpuhookd loads its config for every request; an edit shows at the next one).

    The file is stat'ed before it is read, so a change made meanwhile is read (under the older
    identity) and seen as a change at the next call; a file changed in the last ``_SETTLED_NS`` is
    not remembered at all.
    """
    try:
        st = os.stat(path)
        identity: tuple[int, ...] | None = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    except FileNotFoundError:
        identity = None
    except OSError:
        return read_config(path, required=required)  # which says what is wrong
    before = _read_before.get((path, required))
    if before is not None and before[0] == identity:
        return before[1]
    loaded = read_config(path, required=required)
    if identity is None or max(st.st_mtime_ns, st.st_ctime_ns) < time.time_ns() - _SETTLED_NS:
        _read_before[(path, required)] = (identity, loaded)
    return loaded  # an older entry left behind names an identity the file can no longer have (ctime moved)


def read_config(path: Path, *, required: bool, nvidia: bool | None = None) -> LoadedConfig:
    """Read *path*, with each setting's origin: NVIDIA's format when *nvidia* (None: when it ends in ``.toml``)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if required:
            raise ConfigError(f"config file {path} does not exist") from None
        return LoadedConfig(config=Config(), origins=_origins({}))
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read config file {path}: {err}") from err
    if nvidia or (nvidia is None and path.suffix == ".toml"):
        from gpuhook.nvidia_config import translate_toml

        found = translate_toml(text, source=str(path))
        config = build_config(found.settings, source=str(path))
        origins = {key: (Origin.GPUHOOK if where.startswith("[") else Origin.NVIDIA, where)
                   for key, where in found.origins.items()}
        return LoadedConfig(config=config, path=path, origins=_origins(origins), raw=found.settings,
                            notices=found.notices)
    data = _parse_yaml(text, str(path))
    return LoadedConfig(config=build_config(data, source=str(path)), path=path, raw=data,
                        origins=_origins({key: (Origin.GPUHOOK, key) for key in data}))


def _origins(given: Mapping[str, tuple[Origin, str]]) -> dict[str, tuple[Origin, str]]:
    """Every setting's origin: *given*, else the default."""
    return {name: given.get(name, (Origin.DEFAULT, "")) for name in _FIELDS}


def parse_config(text: str, *, source: str = "<config>") -> Config:
    """Decode YAML text into a Config, refusing unknown keys and wrong types."""
    return build_config(_parse_yaml(text, source), source=source)


def _parse_yaml(text: str, source: str) -> dict[str, Any]:
    """The YAML document's mapping ({} for an empty one)."""
    data = parse_flat_yaml(text)
    if data is _NOT_FLAT:
        data = _load_yaml(text, source)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of settings, got {type(data).__name__}")
    return data


def build_config(data: Mapping[str, Any], *, source: str) -> Config:
    """A Config from settings as gpuhook.yaml spells them, refusing unknown keys and wrong types."""
    unknown = sorted(str(k) for k in data if k not in _FIELDS)
    if unknown:
        raise ConfigError(f"{source}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(_FIELDS)}")
    settings = {key: _convert(key, value, source) for key, value in data.items()}
    if settings.get("device_policy") is not None:
        if "gpus" in settings:
            raise ConfigError(f"{source}: gpus and device_policy both set a sharing policy; keep one")
        settings["gpus"] = load_device_policy(settings["device_policy"])
    config = Config(**settings)
    if config.state_dir is None and not config.gpus.is_unlimited:
        raise ConfigError(f"{source}: state_dir is null, but the sharing policy ({config.gpus.source}) limits GPUs, "
                          "which needs the lease ledger there; set state_dir (default /run/gpuhook)")
    if config.state_dir is not None and any(p.sharing is Sharing.MPS
                                            for p in (*config.gpus.entries, config.gpus.default)):
        _refuse_state_dir_in_dev_shm(config.state_dir, config.gpus.source, source)
    return config


def _refuse_state_dir_in_dev_shm(state_dir: Path, policy: str, source: str) -> None:
    """An MPS daemon's /dev/shm is its own directory under state_dir: a state_dir in /dev/shm would be hidden
    from the daemon by that very mount (its pipe directory with it), and the daemon would never answer."""
    real = os.path.realpath(state_dir)
    if real == "/dev/shm" or real.startswith("/dev/shm/"):
        raise ConfigError(f"{source}: state_dir {str(state_dir)!r} is in /dev/shm ({real}), but the sharing policy "
                          f"({policy}) shares a GPU through MPS, whose daemon gets a /dev/shm of its own there, which "
                          "would hide its pipe directory from it. Fix: set state_dir outside /dev/shm "
                          "(default /run/gpuhook)")


def load_device_policy(path: Path) -> Policy:
    """The device-policy file *path* (JSON, or YAML for anything that is not JSON)."""
    import json

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"device_policy: cannot read {path}: {getattr(err, 'strerror', None) or err}") from err
    try:
        data = json.loads(text)
    except ValueError:
        data = _load_yaml(text, str(path))
    return decode_device_file(data, source=str(path))


def _load_yaml(text: str, source: str) -> Any:
    import yaml  # only for files outside the flat subset: PyYAML costs ~14 ms per container start

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's, where PyYAML was built with it
    try:
        return yaml.load(text, Loader=loader)  # a safe loader
    except yaml.YAMLError as err:
        raise ConfigError(_yaml_error_line(err, text, source)) from err


def _yaml_error_line(err: Any, text: str, source: str) -> str:
    """PyYAML's error as one line, ``FILE: not valid YAML at LINE:COLUMN: PROBLEM (CONTEXT at LINE:COLUMN)``.

    PyYAML's own text spans four lines and names the document ``<unicode string>``; the hook's
    failure is one line (runc shows it to the user), so its parts are put together here.
    """
    import yaml

    if isinstance(err, yaml.reader.ReaderError):  # a character YAML never allows: it has a position, not a mark
        line = text.count("\n", 0, err.position) + 1
        column = err.position - text.rfind("\n", 0, err.position)
        char = err.character if isinstance(err.character, int) else ord(err.character)
        return f"{source}: not valid YAML at {line}:{column}: character {char:#06x}: {err.reason}"
    if not isinstance(err, yaml.MarkedYAMLError) or err.problem_mark is None:
        return f"{source}: not valid YAML: {' '.join(str(err).split())}"
    problem_mark = err.problem_mark
    problem = err.problem or "a syntax error"
    if err.context:
        context_mark = err.context_mark
        at = f" at {context_mark.line + 1}:{context_mark.column + 1}" if context_mark is not None else ""
        problem += f" ({err.context}{at})"
    return f"{source}: not valid YAML at {problem_mark.line + 1}:{problem_mark.column + 1}: {problem}"


_NOT_FLAT: Final[Any] = object()
# key: plain | "double-quoted" | 'single-quoted' (quoted: printable ASCII without escapes, always a string);
# spaces only: YAML refuses some tabs
_LINE: Final = re.compile(r"""([a-z_]+):(?: +(?:([^#'"\s]*)|"([ !#-\[\]-~]*)"|'([ -&(-~]*)'))?(?: +#.*)? *""")
_SCALARS: Final[dict[str, Any]] = {
    "": None, "~": None, "null": None, "Null": None, "NULL": None,
    "true": True, "True": True, "TRUE": True, "false": False, "False": False, "FALSE": False,
    # the enum settings' words, as the plain strings PyYAML reads them
    **{member.value: member.value for kind in _ENUM_KEYS.values() for member in kind},
}


def parse_flat_yaml(text: str) -> Any:
    """A flat ``key: scalar`` document as PyYAML's safe_load reads it, or _NOT_FLAT.

    gpuhook.yaml is a flat mapping of paths, booleans, numbers and level names.
    This reads exactly that subset (tests check it against PyYAML) and hands
    anything else, including every value PyYAML 1.1 might read differently
    ("yes", "1e3", escapes), to PyYAML. Quoted paths are common (installers write
    JSON-style strings), so simple quoted strings are read here too.
    """
    data: dict[str, Any] = {}
    # Only "\n" ends a line and only spaces indent a comment here: other line breaks (PyYAML reads "\r" as
    # one, str.splitlines many more) and tabs go to PyYAML, which may refuse them.
    for line in text.split("\n"):
        stripped = line.lstrip(" ")
        if not stripped or stripped.startswith("#"):
            continue
        match = _LINE.fullmatch(line)
        if match is None or match[1] in data:
            return _NOT_FLAT
        quoted = match[3] if match[3] is not None else match[4]
        raw = match[2] or ""
        if quoted is not None:
            data[match[1]] = quoted
        elif raw in _SCALARS:
            data[match[1]] = _SCALARS[raw]
        elif re.fullmatch(r"[1-9][0-9]{0,8}|0", raw):
            data[match[1]] = int(raw)
        elif re.fullmatch(r"/[A-Za-z0-9_./-]*", raw):
            data[match[1]] = raw
        else:
            return _NOT_FLAT
    return data or None


#: host:port with a dotted IPv4 address, a [bracketed] IPv6 one or a host name
_LISTEN: Final = re.compile(r"(\[[0-9a-fA-F:.]+\]|[0-9A-Za-z.-]+):([0-9]{1,5})")


def _listen_address(value: Any, where: str) -> str:
    found = _LISTEN.fullmatch(value) if isinstance(value, str) else None
    if found is None or not 0 < int(found[2]) < 65536:
        raise ConfigError(f"{where} must be HOST:PORT (127.0.0.1:9490; dcgm-exporter has 9400, node-exporter "
                          f"9100), got {value!r}")
    return str(value)


def _convert(key: str, value: Any, source: str) -> Any:
    """Check and convert one setting."""
    where = f"{source}: {key}"
    if key in (*_OPTIONAL_PATH_KEYS, "metrics_listen") and value is None:
        return None  # the feature is off
    if key in _PATH_KEYS or key in _OPTIONAL_PATH_KEYS:
        if not isinstance(value, str) or not value.startswith("/"):
            raise ConfigError(f"{where} must be an absolute path, got {value!r}")
        return Path(value)
    if key in _BOOL_KEYS:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if key in _ENUM_KEYS:
        kind = _ENUM_KEYS[key]
        values = [member.value for member in kind]
        if not isinstance(value, str) or value not in values:
            raise ConfigError(f"{where} must be one of {', '.join(values)}, got {value!r}")
        return kind(value)
    if key == "gpus":
        return decode_gpus(value, source=source)
    convert = {"metrics_listen": _listen_address, "timeout_seconds": _seconds,
               "supported_driver_capabilities": _capability_set}
    return convert[key](value, where)


def _seconds(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 600:
        raise ConfigError(f"{where} must be a number of seconds in (0, 600], got {value!r}")
    return float(value)


def _capability_set(value: Any, where: str) -> frozenset[Capability]:
    """A list of capability names or NVIDIA's comma-separated string; ``all`` is every one."""
    names = [n.strip() for n in value.split(",")] if isinstance(value, str) else value
    known = ", ".join(c.value for c in Capability)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{where} must be a list of capability names ({known}, or all) or a comma-separated "
                          f"string of them, got {value!r}")
    names = [n for n in names if n]
    if "all" in names:
        return ALL_CAPABILITIES
    wrong = [n for n in names if n not in known.split(", ")]
    if wrong:
        raise ConfigError(f"{where}: unknown capability {wrong[0]!r}; expected names from {known}, or all")
    return frozenset(Capability(n) for n in names)

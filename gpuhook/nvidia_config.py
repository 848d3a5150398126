"""NVIDIA's ``/etc/nvidia-container-runtime/config.toml`` → gpuhook settings (pure: text in, values out).

Every key NVIDIA's toolkit documents (nvidia-toolkit.md §4.4) is in one of three tables:

* ``_MAPPED``: it has a gpuhook meaning; its value becomes a gpuhook setting, spelled as
  gpuhook.yaml spells it, so ``gpuhook.config`` checks it exactly as it checks its own file
  and ``gpuhook config import`` can write it out unchanged;
* ``_UNMAPPED``: it has none; it gives one ``Notice`` naming the key and why it has no effect
  (a plain note when it holds NVIDIA's default, since nothing is then lost);
* ``_REFUSED``: a security-relevant key whose value gpuhook cannot honour: a ConfigError, so
  that switching from NVIDIA never makes a host grant more than it did.

A key in none of them is a typo or a newer toolkit's: a warning, not an error, because
NVIDIA's own tools ignore unknown keys, so a file they ran with must not stop every GPU start.
A ``[gpuhook]`` table holds gpuhook's own keys (as gpuhook.yaml names them): NVIDIA's tools
ignore it, so one file can carry what NVIDIA has no key for (``dev_root``, ``gpus``, ...).
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from gpuhook.errors import ConfigError

__all__ = ["GPUHOOK_TABLE", "Notice", "Translation", "translate_toml"]

#: The table of config.toml read as gpuhook.yaml's keys.
GPUHOOK_TABLE: Final = "gpuhook"
_CLI: Final = "nvidia-container-cli"
_RUNTIME: Final = "nvidia-container-runtime"


@dataclass(frozen=True, slots=True, kw_only=True)
class Notice:
    """A key of NVIDIA's file that gpuhook does not act on, and why."""

    key: str  #: dotted, as NVIDIA's docs name it (``nvidia-container-cli.user``)
    value: Any
    reason: str
    #: True when the value is not NVIDIA's default, so something NVIDIA did is lost
    lost: bool

    def render(self) -> str:
        """``KEY = VALUE: why``, for doctor, the postinst and ``config import``."""
        tail = "" if self.lost else " (it holds NVIDIA's default: nothing is lost)"
        return f"{self.key} = {_toml_value(self.value)}: {self.reason}{tail}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Translation:
    """What a config.toml says in gpuhook's terms."""

    #: gpuhook setting → value, as gpuhook.yaml would hold it (str paths, bools, strings, lists)
    settings: dict[str, Any] = field(default_factory=dict)
    #: gpuhook setting → the config.toml key it came from (``[gpuhook] KEY`` for the gpuhook table)
    origins: dict[str, str] = field(default_factory=dict)
    notices: tuple[Notice, ...] = ()

    @property
    def warnings(self) -> tuple[Notice, ...]:
        """The notices where something NVIDIA did is lost."""
        return tuple(n for n in self.notices if n.lost)


def _flag(setting: str) -> Callable[[Any, str], dict[str, Any]]:
    """A boolean key mapped onto a gpuhook boolean."""

    def convert(value: Any, key: str) -> dict[str, Any]:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {_toml_value(value)}")
        return {setting: value}

    return convert


def _string(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{key} must be a string, got {_toml_value(value)}")
    return value


def _capabilities(value: Any, key: str) -> dict[str, Any]:
    # NVIDIA's is a comma-separated string ("all" included); gpuhook.config checks the names.
    return {"supported_driver_capabilities": _string(value, key)}


def _root(value: Any, key: str) -> dict[str, Any]:
    text = _string(value, key)
    return {"driver_root": text} if text else {}  # "" is NVIDIA's default: the host's /


def _ldconfig(value: Any, key: str) -> dict[str, Any]:
    text = _string(value, key)
    if not text:
        return {}
    if not text.startswith("@"):
        # NVIDIA runs such a path inside the container (and refuses it unless the
        # allow-ldconfig-from-container feature is on); gpuhook never runs a container's binary as root.
        raise ConfigError(
            f"{key} = {text!r} names an ldconfig inside the container (no '@'); gpuhook never runs a "
            f"container's binary as root: write {'@' + text!r} for the host's (it must be static), or remove the key")
    # NVIDIA swaps @/sbin/ldconfig for /sbin/ldconfig.real where that exists (Ubuntu's wrapper script);
    # gpuhook runs exactly the path given and checks it is a static binary (`gpuhook doctor`).
    return {"ldconfig": text[1:]}


def _cli_debug(value: Any, key: str) -> dict[str, Any]:
    # libnvidia-container's per-start log file: gpuhook's per-start log is log_file (its JSON lines).
    text = _string(value, key)
    return {"log_file": text} if text else {}


_LEVELS: Final = {"trace": "debug", "debug": "debug", "info": "info", "warn": "warning", "warning": "warning",
                  "error": "error", "fatal": "error", "panic": "error"}


def _log_level(value: Any, key: str) -> dict[str, Any]:
    text = _string(value, key).lower()
    if text not in _LEVELS:
        raise ConfigError(f"{key} must be one of {', '.join(_LEVELS)} (logrus levels), got {value!r}")
    return {"log_level": _LEVELS[text]}


def _compat_mode(value: Any, key: str) -> dict[str, Any]:
    text = _string(value, key)
    modes = {"ldconfig": True, "mount": True, "disabled": False, "hook": False}  # "hook": the legacy hook disables
    if text not in modes:
        raise ConfigError(f"{key} must be one of {', '.join(modes)}, got {text!r}")
    return {"cuda_compat": modes[text]}


#: NVIDIA key → its gpuhook settings (nvidia-toolkit.md §4.4; each converter checks NVIDIA's type).
_MAPPED: Final[dict[str, Callable[[Any, str], dict[str, Any]]]] = {
    "accept-nvidia-visible-devices-envvar-when-unprivileged": _flag("accept_envvar_when_unprivileged"),
    "accept-nvidia-visible-devices-as-volume-mounts": _flag("accept_volume_mounts"),
    "disable-require": _flag("disable_require"),
    "supported-driver-capabilities": _capabilities,
    f"{_CLI}.root": _root,
    f"{_CLI}.ldconfig": _ldconfig,
    f"{_CLI}.load-kmods": _flag("load_kmods"),
    f"{_CLI}.no-cgroups": _flag("no_cgroups"),
    f"{_CLI}.debug": _cli_debug,
    f"{_RUNTIME}.log-level": _log_level,
    f"{_RUNTIME}.modes.legacy.cuda-compat-mode": _compat_mode,
}

_SPEC_DIRS: Final = ["/etc/cdi", "/var/run/cdi"]
#: NVIDIA key → (its default, or a tuple of the defaults it ships with; why it has no gpuhook effect)
_UNMAPPED: Final[dict[str, tuple[Any, str]]] = {
    "swarm-resource": ("", "gpuhook reads the GPUs from NVIDIA_VISIBLE_DEVICES only, never from swarm's "
                           "generic-resource variables; set NVIDIA_VISIBLE_DEVICES in the service instead"),
    f"{_CLI}.path": ("", "gpuhook does the CLI's work itself: there is no nvidia-container-cli to find"),
    f"{_CLI}.environment": ([], "gpuhook runs no nvidia-container-cli to pass an environment to"),
    f"{_CLI}.user": (("", "root:video"), "gpuhook reads NVML in its own root process, not as a separate user"),
    f"{_CLI}.ldcache": (("", "/etc/ld.so.cache"), "gpuhook always reads <driver_root>/etc/ld.so.cache"),
    f"{_CLI}.no-pivot": (False, "gpuhook's ldconfig sandbox does not pivot_root, so there is nothing to turn off"),
    f"{_RUNTIME}.debug": (("", "/dev/null"), "gpuhook-runtime reports through runc's --log and gpuhook's log_file"),
    f"{_RUNTIME}.runtimes": ((["docker-runc", "runc", "crun"], ["runc", "crun"]),
                             "gpuhook-runtime runs runc; register another low-level runtime with your engine"),
    f"{_RUNTIME}.mode": ("auto", "gpuhook has one mode: its hook injects the GPUs (CDI specs come from "
                                 "`gpuhook cdi generate`)"),
    f"{_RUNTIME}.modes.cdi.spec-dirs": (_SPEC_DIRS, "the engine reads CDI specs itself; gpuhook's runtime "
                                                    "does not look for them"),
    f"{_RUNTIME}.modes.cdi.default-kind": ("nvidia.com/gpu", "gpuhook's CDI kind is always nvidia.com/gpu"),
    f"{_RUNTIME}.modes.cdi.annotation-prefixes": (["cdi.k8s.io/"], "gpuhook reads cdi.k8s.io/ annotations only, "
                                                                   "and only with accept_cdi_annotations: true"),
    f"{_RUNTIME}.modes.csv.mount-spec-path": ("/etc/nvidia-container-runtime/host-files-for-container.d",
                                              "csv mode (Tegra) is not supported"),
    f"{_RUNTIME}.modes.csv.compat-container-root": (None, "csv mode (Tegra) is not supported"),
    f"{_RUNTIME}.modes.jit-cdi.nvcdi-feature-flags": (None, "gpuhook has no jit-cdi mode"),
    f"{_RUNTIME}.modes.jit-cdi.nvcdi-disable-hooks": (None, "gpuhook has no jit-cdi mode"),
    "nvidia-container-runtime-hook.path": ("nvidia-container-runtime-hook",
                                           "gpuhook's hook is registered by `gpuhook install`"),
    "nvidia-container-runtime-hook.skip-mode-detection": (False, "gpuhook's hook has no mode to detect"),
    "nvidia-ctk.path": ("nvidia-ctk", "gpuhook's CDI specs name gpuhook's own hook"),
    "features.allow-cuda-compat-libs-from-container": (False, "gpuhook's cuda_compat (from modes.legacy."
                                                              "cuda-compat-mode) decides"),
    "features.allow-ldconfig-from-container": (False, "gpuhook never runs a container's ldconfig"),
    "features.allow-unknown-oci-spec-fields": (False, "gpuhook reads only the config.json fields it needs"),
    "features.disable-cuda-compat-lib-hook": (False, "gpuhook's CDI specs have no cuda-compat hook"),
    "features.disable-imex-channel-creation": (False, "gpuhook creates no IMEX channel nodes"),
    "features.no-additional-gids-for-device-nodes": (False, "gpuhook adds no group ids for device nodes"),
}

#: Security-relevant keys: the values gpuhook would not honour, and the fix (an error, never a warning).
_REFUSED: Final[dict[str, tuple[Any, str]]] = {
    "features.ignore-imex-channel-requests": (
        True, "NVIDIA then ignores NVIDIA_IMEX_CHANNELS, gpuhook grants the channels a container asks for; remove "
              "the key (or set it false) once you accept that, or keep NVIDIA's toolkit on this host"),
}


def translate_toml(text: str, *, source: str) -> Translation:
    """NVIDIA's config.toml *text* in gpuhook's terms; ConfigError for TOML errors, bad types and refused values."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{source}: not valid TOML: {err}") from err
    own = data.pop(GPUHOOK_TABLE, {})
    if not isinstance(own, dict):
        raise ConfigError(f"{source}: {GPUHOOK_TABLE} must be a table ([{GPUHOOK_TABLE}]) of gpuhook.yaml's keys")
    settings: dict[str, Any] = {}
    origins: dict[str, str] = {}
    notices: list[Notice] = []
    for key, value in _flatten(data):
        where = f"{source}: {key}"
        if key in _MAPPED:
            for setting, converted in _MAPPED[key](value, where).items():
                settings[setting], origins[setting] = converted, key
        elif key in _REFUSED and value == _REFUSED[key][0]:
            raise ConfigError(f"{where} = {_toml_value(value)}: {_REFUSED[key][1]}")
        elif key in _UNMAPPED or key in _REFUSED:
            default, reason = _UNMAPPED.get(key) or (not _REFUSED[key][0], "gpuhook does this already")
            defaults = default if isinstance(default, tuple) else (default,)
            notices.append(Notice(key=key, value=value, reason=f"no effect: {reason}", lost=value not in defaults))
        else:
            notices.append(Notice(key=key, value=value, lost=True, reason=(
                "unknown key (a typo, or a newer toolkit's): NVIDIA's tools ignore it, so does gpuhook")))
    for setting, value in own.items():
        if setting in settings and settings[setting] != value:
            raise ConfigError(
                f"{source}: [{GPUHOOK_TABLE}] {setting} = {_toml_value(value)} contradicts {origins[setting]} "
                f"(= {_toml_value(settings[setting])} for gpuhook); keep one")
        settings[setting], origins[setting] = value, f"[{GPUHOOK_TABLE}] {setting}"
    return Translation(settings=settings, origins=origins, notices=tuple(notices))


def _flatten(table: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) for every leaf of *table*; an empty table is no key."""
    out: list[tuple[str, Any]] = []
    for key, value in table.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            out += _flatten(value, dotted + ".")
        else:
            out.append((dotted, value))
    return out


def _toml_value(value: Any) -> str:
    """*value* as TOML writes it (for messages)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return str(value)
